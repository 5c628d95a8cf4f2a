"""What every Triton kernel family shares: whether Triton and jax-triton import here, and the small
shape helpers of their launches.

Triton exists only on GPU machines (and as a CPU wheel whose interpreter runs the kernels in tests);
every kernel module must still import without it, so each checks these flags before defining or
launching a kernel.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

try:
  import triton  # noqa: F401
  HAVE_TRITON = True
except Exception:  # noqa: BLE001  (no Triton here: the kernels are not defined)
  HAVE_TRITON = False

try:
  import jax_triton  # noqa: F401
  HAVE_JAX_TRITON = True
except Exception:  # noqa: BLE001
  HAVE_JAX_TRITON = False


def pow2_at_least(n: int) -> int:
  return 1 << max(0, (int(n) - 1).bit_length())


def split_width(width: int) -> tuple[int, int]:
  """A tile width as (power of two, power of two or 0): 192 -> (128, 64), 256 -> (256, 0).
  Triton blocks are powers of two while the expert widths here (192, 768) are not."""
  hi = 1 << (int(width).bit_length() - 1)
  rest = width - hi
  if rest == 0:
    return hi, 0
  if rest & (rest - 1):
    raise ValueError(f"tile width {width} is not a power of two or a sum of two powers of two")
  return hi, rest


def placeholder() -> jax.Array:
  """A one-element int32 array standing in for an unused optional kernel operand."""
  return jnp.zeros((1,), jnp.int32)


def gpu_available() -> bool:
  """Triton and jax-triton import and some device is a GPU (the gmm backend's `available`)."""
  if not (HAVE_TRITON and HAVE_JAX_TRITON):
    return False
  try:
    return any(d.platform == "gpu" for d in jax.devices())
  except RuntimeError:
    return False


def default_backend_is_gpu() -> bool:
  """Triton and jax-triton import and JAX's default backend is a GPU: where the attention core, the
  top-k and the fan-in kernels launch (their modules' `available`)."""
  if not (HAVE_TRITON and HAVE_JAX_TRITON):
    return False
  try:
    return jax.default_backend() == "gpu"
  except RuntimeError:
    return False
