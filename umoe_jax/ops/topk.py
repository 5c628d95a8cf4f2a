"""Top-k ids over the last axis, the routers' pick of experts: `top_k_ids`.

    top_k_ids(x [..., E], k) -> ids [..., k] int32

the columns of the k largest values, descending, ties toward the lower index: `jax.lax.top_k`'s
ids. Backends (`BACKENDS`, `model.router.topk_backend`):
  "xla"     `jax.lax.top_k` (XLA lowers it to a full sort of every row on GPU), anywhere;
  "triton"  kernels/router/triton_topk.py, one pass over x, where it runs (a GPU with Triton and
            jax-triton, a float dtype, E <= 1024); `jax.lax.top_k` for what it does not take
            (the same ids);
  "auto"    the best-ranked backend of the default platform (`Registry.ranked`), among those that
            run sharded programs when the program spans several devices: XLA does not partition
            the kernel's custom call, so there it would gather x whole to every device (inside
            shard_map, where each device holds its own rows, "triton" by name is fine).
The ids carry no gradient; callers gather the values they need (`jnp.take_along_axis(x, ids, -1)`),
through which gradients reach x as through `jax.lax.top_k`'s values: `biased_top_k` is that for the
routers (ids of probs + the selection bias, gates gathered from probs).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from umoe_jax.kinds import TOPK_BACKENDS
from umoe_jax.ops.varying import vary_like, varying_axes
from umoe_jax.registry import Registry


@dataclasses.dataclass(frozen=True)
class TopKBackend:
  """ids: `(x [N, E], k) -> ids [N, k] int32`, or None for a shape it does not take (the caller
  then takes `jax.lax.top_k`). `single_device`: auto takes it only for programs on one device."""
  ids: Callable[[jax.Array, int], Optional[jax.Array]]
  platforms: tuple[str, ...]
  auto_priority: int = 0
  available: Callable[[], bool] = lambda: True
  single_device: bool = False


def _lax_ids(x, k):
  return jax.lax.top_k(x, k)[1].astype(jnp.int32)


BACKENDS: Registry[TopKBackend] = Registry("top-k backend", names=TOPK_BACKENDS)
BACKENDS.register("xla")(TopKBackend(ids=_lax_ids, platforms=("cpu", "gpu", "tpu")))


@functools.cache
def register_builtin_kernels() -> None:
  """Registers the Triton kernel (kernels/router/triton_topk.py) where its module imports (once)."""
  try:
    from kernels.router import triton_topk as kernel
  except Exception:  # noqa: BLE001  (no kernels package or toolchain: "xla" answers)
    return

  def ids(x, k):
    return kernel.top_k_ids(x, k) if kernel.supported(x, k) else None

  # Priority from its H200 rows: 4x / 17x faster than the sort at k = 15 / 3.
  BACKENDS.register("triton")(TopKBackend(ids=ids, platforms=("gpu",), auto_priority=20,
                                          available=lambda: kernel.available(), single_device=True))


def resolve_backend(name: str) -> str:
  """The backend `name` ("auto" or one of BACKENDS) runs as for a program on this process's
  devices; a backend not registered here (no Triton) runs as "xla", which gives the same ids."""
  register_builtin_kernels()
  if name != "auto":
    return name if name in BACKENDS else "xla"
  several = jax.device_count() > 1
  return next(n for n in BACKENDS.ranked(jax.default_backend())
              if not (several and BACKENDS.get(n).single_device))


def top_k_ids(x: jax.Array, k: int, *, backend: str = "auto") -> jax.Array:
  """ids [..., k] int32 of the k largest entries of x [..., E] along the last axis (module
  docstring); `backend` "auto" or a name of BACKENDS. NaN entries: see kernels/router/triton_topk.py."""
  if backend not in TOPK_BACKENDS:
    raise ValueError(f"top_k_ids backend={backend!r}; valid: {', '.join(TOPK_BACKENDS)}")
  if x.ndim < 1 or not 1 <= k <= x.shape[-1]:
    raise ValueError(f"top_k_ids: k={k} must be in [1, E] for x of shape {x.shape} (E = last axis)")
  x = jax.lax.stop_gradient(x)
  name = resolve_backend(backend)
  if name != "xla":
    ids = BACKENDS.get(name).ids(x.reshape(-1, x.shape[-1]), k)
    if ids is not None:
      # A custom call drops shard_map's varying type.
      return vary_like(ids.reshape(*x.shape[:-1], k), varying_axes(x))
  return _lax_ids(x, k)


def biased_top_k(probs: jax.Array, k: int, renormalize: bool, bias: Optional[jax.Array] = None,
                 *, topk_backend: str = "xla") -> tuple[jax.Array, jax.Array]:
  """Top-k of probs [..., E] (+ bias [E] for the choice only) -> (ids [..., K] int32, gates
  [..., K] = probs at ids, renormalised over them if `renormalize`). `topk_backend`: the ids'
  backend (`router.topk_backend`); gradients reach probs through the gather."""
  ids = top_k_ids(probs if bias is None else probs + bias, k, backend=topk_backend)
  gates = jnp.take_along_axis(probs, ids, axis=-1)
  if renormalize:
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
  return ids, gates
