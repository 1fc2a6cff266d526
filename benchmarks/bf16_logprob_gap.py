"""docs/bf16_logprobs.md's figures: `python benchmarks/bf16_logprob_gap.py [OUT.json]` (about 40 s).

Measure bf16 log-prob errors of vLLM and Megatron against an fp64 HF forward of the same bf16 weights."""
import os, sys, json, tempfile, torch, torch.nn.functional as F
from pathlib import Path
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests")); sys.path.insert(0, str(REPO))
import conftest  # env
import torch.distributed as dist
from resharding_oracle import free_port
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
torch.set_num_threads(1)
dist.init_process_group("gloo", rank=0, world_size=1)
from mindspeed_rl.parallel import megatron_state
from mindspeed_rl.parallel.layout import TrainLayout
PARALLEL = megatron_state.initialize(TrainLayout(), rank=0, world_size=1, timeout_minutes=30)
from mindspeed_rl.accelerator import get_accelerator
from mindspeed_rl.data.tiny_model import create_tiny_qwen2_checkpoint
from mindspeed_rl.engines.megatron_engine import MegatronEngine
from mindspeed_rl.engines.vllm_engine import VLLMEngine, VLLMEngineConfig
from mindspeed_rl.models.checkpoint import load_hf_checkpoint
from mindspeed_rl.protocol import RolloutBatch
from mindspeed_rl.resharding.naive import load_full_hf
acc = get_accelerator("cpu"); acc.seed_model_parallel_rng(1)
ck = tempfile.mkdtemp(prefix="bf16_gap_")
create_tiny_qwen2_checkpoint(ck, vocab_size=64, hidden_size=128, ffn_hidden_size=256, num_layers=2,
                             num_attention_heads=4, num_query_groups=2, seed=3)
spec, base = load_hf_checkpoint(ck)
rollout = VLLMEngine(VLLMEngineConfig(model_dir=ck, tensor_parallel_size=1, dtype="bfloat16", max_model_len=32,
    max_num_seqs=64, max_num_batched_tokens=1024, seed=0, enforce_eager=True, gpu_memory_utilization=0.5,
    cpu_kvcache_space_gb=0.0625, on_cpu=True))
print("vllm dtypes", {t.dtype for t in rollout.named_weights().values()})
PROMPTS = [[5, 9, 6, 11], [7, 9, 8, 11], [4, 9, 4, 11], [3, 2, 1], [9, 9, 9, 9, 9]]
W = 10

def hf_logprobs(state, dtype, ids_list):
    from transformers import Qwen2ForCausalLM, AutoConfig
    m = Qwen2ForCausalLM(AutoConfig.from_pretrained(ck)).eval()
    m.config._attn_implementation = "eager"
    m.load_state_dict({k: v for k, v in state.items()}, strict=False)
    m = m.to(dtype)
    with torch.no_grad():
        for k, v in state.items():
            m.get_parameter(k).copy_(v.to(dtype))
    out = []
    with torch.no_grad():
        for prompt, resp in ids_list:
            ids = torch.tensor([prompt + resp])
            logits = m(ids).logits[0]
            lp = torch.log_softmax(logits.double(), -1)
            out.append((logits, torch.stack([lp[len(prompt) - 1 + j, t] for j, t in enumerate(resp)])))
    return out

def run(case, state):
    rounded = {k: v.to(torch.bfloat16).float() for k, v in state.items()}
    load_full_hf(rollout.named_weights(), rounded, spec, tp=1, tp_rank=0); rollout.mark_weights_loaded()
    gens = rollout.generate(PROMPTS, n=8, max_tokens=W, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, seed=7)
    samples = [(PROMPTS[g.prompt_index], g.token_ids) for g in gens]
    batch = RolloutBatch.from_token_lists([p for p, _ in samples], [t for _, t in samples], pad_id=0, response_width=W)
    mask = batch.response_mask.bool()
    vllm = torch.zeros(batch.response_logprobs_shape, dtype=torch.float64)
    for r, g in enumerate(gens): vllm[r, :len(g.logprobs)] = torch.tensor(g.logprobs, dtype=torch.float64)
    def pad(lst):
        t = torch.zeros(batch.response_logprobs_shape, dtype=torch.float64)
        for r, x in enumerate(lst): t[r, :len(x)] = x
        return t
    ref = hf_logprobs(rounded, torch.float64, samples)
    ref_lp = pad([x for _, x in ref])
    logit_std = torch.cat([l for l, _ in ref]).std().item()
    # floor: exact logits rounded to bf16 once
    floor = pad([torch.stack([torch.log_softmax(l.to(torch.bfloat16).double(), -1)[len(p) - 1 + j, t] for j, t in enumerate(resp)])
                 for (l, _), (p, resp) in zip(ref, samples)])
    rows = {"vLLM bf16": vllm, "fp64 logits rounded to bf16 once": floor}
    rows["HF bf16 (eager)"] = pad([x for _, x in hf_logprobs(rounded, torch.bfloat16, samples)])
    for name, dtype, st in (("Megatron bf16", torch.bfloat16, rounded), ("Megatron fp32 (bf16 weights)", torch.float32, rounded)):
        eng = MegatronEngine(spec=spec, hf_state=st, params_dtype=dtype, accelerator=acc, parallel=PARALLEL, optimizer=None)
        rows[name] = eng.compute_logprobs(batch, micro_batch_size=8, temperature=1.0).double()
        if dtype == torch.bfloat16:
            head = eng.module.output_layer
            h = head.register_forward_hook(lambda mod, args, out: (F.linear(args[0].float(), mod.weight.float()), None))
            rows["Megatron bf16, lm-head in fp32"] = eng.compute_logprobs(batch, micro_batch_size=8, temperature=1.0).double()
            h.remove()
    if case == "off-grid norms":
        eng = MegatronEngine(spec=spec, hf_state=state, params_dtype=torch.bfloat16, accelerator=acc, parallel=PARALLEL, optimizer=None)
        rows["Megatron bf16, fp32 norms off the bf16 grid"] = eng.compute_logprobs(batch, micro_batch_size=8, temperature=1.0).double()
        for n, p in eng.module.named_parameters():
            if p.dtype == torch.float32:
                p.data = p.data.to(torch.bfloat16)
        rows["Megatron bf16, norms cast to bf16"] = eng.compute_logprobs(batch, micro_batch_size=8, temperature=1.0).double()
    gs = torch.Generator().manual_seed(100)
    stale = {k: v + 0.02 * torch.randn(v.shape, generator=gs) for k, v in rounded.items()}
    eng = MegatronEngine(spec=spec, hf_state=stale, params_dtype=torch.bfloat16, accelerator=acc, parallel=PARALLEL, optimizer=None)
    stale_lp = eng.compute_logprobs(batch, micro_batch_size=8, temperature=1.0).double()
    res = {"case": case, "logit_std": logit_std, "tokens": int(mask.sum())}
    for name, lp in rows.items():
        d = (lp - ref_lp).abs()[mask]
        res[name] = (d.max().item(), d.mean().item())
    d = (rows["vLLM bf16"] - rows["Megatron bf16"]).abs()[mask]
    res["gap vLLM - Megatron bf16"] = (d.max().item(), d.mean().item())
    d = (rows["vLLM bf16"] - rows["Megatron bf16, lm-head in fp32"]).abs()[mask]
    res["gap vLLM - Megatron bf16 lm-head fp32"] = (d.max().item(), d.mean().item())
    for key in ("Megatron bf16, fp32 norms off the bf16 grid", "Megatron bf16, norms cast to bf16", "Megatron fp32 (bf16 weights)", "HF bf16 (eager)"):
        if key in rows:
            d = (rows["vLLM bf16"] - rows[key]).abs()[mask]
            res["gap vLLM - " + key] = (d.max().item(), d.mean().item())
    d = (rows["vLLM bf16"] - stale_lp).abs()[mask]
    res["gap vLLM - Megatron bf16 with stale weights (+0.02 randn)"] = (d.max().item(), d.mean().item())
    print(json.dumps(res, indent=1), flush=True)
    return res

g = torch.Generator().manual_seed(5)
results = [run("random init", base)]
sharp = dict(base); sharp["lm_head.weight"] = base["lm_head.weight"] * 16
results.append(run("lm-head x16 (confident logits)", sharp))
trained = {k: (v * (1 + 0.05 * torch.randn(v.shape, generator=g)) if "norm" in k else v) for k, v in sharp.items()}
results.append(run("off-grid norms", trained))
json.dump(results, open(sys.argv[1] if len(sys.argv) > 1 else "bf16_logprob_gap.json", "w"), indent=1)
