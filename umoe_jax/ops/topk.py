"""Top-k ids over the last axis, the routers' pick of experts: `top_k_ids`.

    top_k_ids(x [..., E], k) -> ids [..., k] int32

the columns of the k largest values, descending, ties toward the lower index: `jax.lax.top_k`'s
ids. Backends:
  "xla"     `jax.lax.top_k` (XLA lowers it to a full sort of every row on GPU);
  "triton"  kernels/triton_topk.py, one pass over x, where it runs (a GPU with Triton and
            jax-triton, a float dtype, E <= 1024); `jax.lax.top_k` elsewhere (the same ids);
  "auto"    "triton" on one device (4x / 17x faster than the sort at k = 15 / 3 on an H200),
            "xla" on several: XLA does not partition the kernel's
            custom call, so in a program sharded over devices it would gather x whole to every
            device (inside shard_map, where each device holds its own rows, "triton" is fine).
The ids carry no gradient; callers gather the values they need (`jnp.take_along_axis(x, ids, -1)`),
through which gradients reach x as through `jax.lax.top_k`'s values: `biased_top_k` is that for the
routers (ids of probs + the selection bias, gates gathered from probs).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from umoe_jax.ops.varying import vary_like, varying_axes

BACKENDS = ("auto", "xla", "triton")


def _kernel():
  """kernels.triton_topk, or None where the kernels package cannot load (a library-only install)."""
  try:
    from kernels import triton_topk
  except Exception:  # noqa: BLE001  (no kernels package / toolchain: XLA answers)
    return None
  return triton_topk


def top_k_ids(x: jax.Array, k: int, *, backend: str = "auto") -> jax.Array:
  """ids [..., k] int32 of the k largest entries of x [..., E] along the last axis (module
  docstring); `backend` in BACKENDS. NaN entries: see kernels/triton_topk.py."""
  if backend not in BACKENDS:
    raise ValueError(f"top_k_ids backend={backend!r}; valid: {', '.join(BACKENDS)}")
  if x.ndim < 1 or not 1 <= k <= x.shape[-1]:
    raise ValueError(f"top_k_ids: k={k} must be in [1, E] for x of shape {x.shape} (E = last axis)")
  if backend == "auto":
    backend = "triton" if jax.device_count() == 1 else "xla"
  x = jax.lax.stop_gradient(x)
  if backend == "triton":
    kernel = _kernel()
    flat = x.reshape(-1, x.shape[-1])
    if kernel is not None and kernel.supported(flat, k):
      ids = kernel.top_k_ids(flat, k).reshape(*x.shape[:-1], k)
      return vary_like(ids, varying_axes(x))  # a custom call drops shard_map's varying type
  return jax.lax.top_k(x, k)[1].astype("int32")


def biased_top_k(probs: jax.Array, k: int, renormalize: bool, bias: Optional[jax.Array] = None,
                 *, topk_backend: str = "xla") -> tuple[jax.Array, jax.Array]:
  """Top-k of probs [..., E] (+ bias [E] for the choice only) -> (ids [..., K] int32, gates
  [..., K] = probs at ids, renormalised over them if `renormalize`). `topk_backend`: the ids'
  `umoe_jax.ops.topk` backend (`router.topk_backend`); gradients reach probs through the gather."""
  ids = top_k_ids(probs if bias is None else probs + bias, k, backend=topk_backend)
  gates = jnp.take_along_axis(probs, ids, axis=-1)
  if renormalize:
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
  return ids, gates
