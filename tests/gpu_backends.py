"""Which grouped-matmul kernel backends the GPU suite must run on this machine, and why one is missing.

On a GPU every expected backend has to be available: a test of a missing one fails naming it and the
cause (an import error, no Hopper GPU), so a machine without jax-triton cannot pass the suite having
checked no kernel. The default expectation is triton on any NVIDIA GPU plus mosaic on Hopper (sm_90:
its kernels are wgmma); `UMOE_GPU_BACKENDS=triton` (a comma list, empty for none) overrides it.
"""
from __future__ import annotations

import os

import jax

from umoe_jax.ops import gmm as G

KERNEL_BACKENDS = ("triton", "mosaic")


def on_gpu() -> bool:
  return any(d.platform == "gpu" for d in jax.devices())


def _hopper() -> bool:
  d = jax.devices()[0]
  cc = getattr(d, "compute_capability", None)
  return str(cc).startswith("9") if cc else any(n in d.device_kind for n in ("H100", "H200"))


def expected_backends() -> list[str]:
  """The kernel backends this machine must run: $UMOE_GPU_BACKENDS, else triton (+ mosaic on
  Hopper) on a GPU, none without one."""
  env = os.environ.get("UMOE_GPU_BACKENDS")
  if env is not None:
    names = [n.strip() for n in env.split(",") if n.strip()]
    unknown = sorted(set(names) - set(KERNEL_BACKENDS))
    if unknown:
      raise ValueError(f"UMOE_GPU_BACKENDS={env!r}: unknown backend(s) {unknown}; "
                       f"valid: {', '.join(KERNEL_BACKENDS)}")
    return names
  if not on_gpu():
    return []
  return ["triton", "mosaic"] if _hopper() else ["triton"]


def missing_reason(name: str) -> str | None:
  """None when backend `name` is registered and available here, else why not."""
  G.register_builtin_kernels()
  module = {"triton": "kernels.gmm.triton_gmm", "mosaic": "kernels.gmm.mosaic_gmm"}[name]
  try:
    mod = __import__(module, fromlist=["_"])
  except Exception as e:  # noqa: BLE001
    return f"{module} does not import: {e!r}"
  if name not in G.BACKENDS:
    return f"{module} imports but the backend is not registered (umoe_jax/ops/gmm_backends.py)"
  if G.BACKENDS.get(name).available():
    return None
  if name == "triton":
    if not mod.HAVE_TRITON:
      return "triton does not import (pip install -r requirements-gpu.txt)"
    if not mod.HAVE_JAX_TRITON:
      return "jax_triton does not import (pip install -r requirements-gpu.txt)"
    return "no GPU device"
  if not mod.HAVE_MGPU:
    return f"this jax ({jax.__version__}) lacks the Pallas Mosaic GPU API the kernels use"
  return f"not a Hopper GPU ({jax.devices()[0].device_kind})"
