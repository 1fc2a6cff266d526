"""The run's parallel layout: one object for the training side (Megatron's TP, CP, EP, DP, PP) and the inference side
(vLLM's TP, PP, DP), built once from the config (layout.py), and the one module that sets Megatron's global parallel
state from it and reads it back (megatron_state.py)."""
