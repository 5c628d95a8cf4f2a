"""Grouped-matmul kernels: the raw (non-differentiable) gmm / tgmm forms each backend of
`umoe_jax.ops.gmm` wraps in one custom VJP. triton.py (NVIDIA sm90, with fan_in.py for the fused
dispatch), mosaic.py (Pallas Mosaic GPU), megablox.py (Pallas TPU); tile sizes in tuning.py."""
