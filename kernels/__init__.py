"""GPU and TPU kernels for umoe-jax, one folder per family:

  gmm/        grouped matmuls of the experts: Triton (sm90), Pallas Mosaic GPU, Pallas TPU megablox,
              the fused dispatch's Triton fan-ins, and their tile tables (gmm/tuning.py)
  attention/  the pre-mixing attention core in Triton (one shared key head, D-wide values)
  router/     the routers' top-k ids in one Triton pass

Shared by the Triton families: triton_base.py (is Triton here, launch shape helpers) and
triton_launch.py (how a launch reaches XLA).

Kernels are plain functions of arrays. They import nothing from umoe_jax but its leaf helpers (the
epilogue's activation forms, shard_map's varying types, the Pallas TPU probe); umoe_jax chooses among
them through its registries (`umoe_jax.ops.gmm_backends.BACKENDS`,
`umoe_jax.model.attention.cores.CORES`, `umoe_jax.ops.topk.BACKENDS`), each with an XLA entry that runs
anywhere. Every module imports on a machine without the toolchain (no Triton, no jax_triton, a jax
whose Pallas Mosaic GPU API differs); its `available()` then says False.
"""
