"""Attention-core kernels: triton_attention.py (the causal core of one shared key head, pre-mixing's
D-wide values in one pass; forward and both backward forms), its Triton bodies (triton_kernels.py)
and measured tile table (tiles.py). Chosen through `umoe_jax.model.attention.cores.CORES`."""
