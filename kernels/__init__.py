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

import os as _os

_HERE = _os.path.dirname(_os.path.abspath(__file__))


def __getattr__(name: str):
  """A name this package lacks. Hugging Face's `kernels` distribution (which transformers imports)
  has the same import name, and this package shadows it wherever the repository root is on sys.path
  (Python started in the root): transformers' `from kernels import ...` arrives here, and gets one
  line saying so instead of a bare "cannot import name"."""
  if name.startswith("_") or _os.path.exists(_os.path.join(_HERE, name)) or _os.path.exists(
      _os.path.join(_HERE, f"{name}.py")):
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")   # submodules import as usual
  raise ImportError(
      f"'kernels' here is umoe-jax's own kernels/ package ({_HERE}), not the `kernels` distribution "
      f"that transformers imports: the repository root is on sys.path. Run transformers from another "
      f"directory, or start Python with -P (PYTHONSAFEPATH=1), which keeps the current directory off "
      f"sys.path", name=name, path=__file__)
