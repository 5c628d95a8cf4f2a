"""Grouped-matmul kernels: the raw (non-differentiable) gmm / tgmm forms each backend of
`umoe_jax.ops.gmm` wraps in one custom VJP. triton_gmm.py (NVIDIA sm90, with triton_fan_in.py for
the fused dispatch), mosaic_gmm.py (Pallas Mosaic GPU), megablox_gmm.py (Pallas TPU); tile sizes in
tuning.py."""
