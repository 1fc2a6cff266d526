"""The GRPO loop and what it needs. `run_grpo` is imported on first use, so that the light helpers
(metrics, curves, sinks) load without the engines, Ray and the data stack."""

__all__ = ["run_grpo"]


def __getattr__(name: str):
    if name == "run_grpo":
        from mindspeed_rl.trainer.run import run_grpo

        return run_grpo
    raise AttributeError(name)
