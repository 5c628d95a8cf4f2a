"""Grouped matrix multiplication: the one entry point for every expert computation.

Rows of `lhs` are sorted by group (expert); `group_sizes[g]` consecutive rows belong to group g.

  gmm(lhs [M, K], rhs [G, K, N], group_sizes [G])                    -> [M, N]
      out[rows of g] = lhs[rows of g] @ rhs[g]
  gmm(lhs [M, N], rhs [G, K, N], group_sizes [G], transpose_rhs=True) -> [M, K]
      out[rows of g] = lhs[rows of g] @ rhs[g].T          (the input-gradient form)
  tgmm(lhs [M, K], rhs [M, N], group_sizes [G])                       -> [G, K, N]
      out[g] = lhs[rows of g].T @ rhs[rows of g]          (the weight-gradient form)

Rows past `sum(group_sizes)` (padding) produce zero output rows and contribute nothing to `tgmm`.

A *backend* supplies the three raw operations; `gmm` wraps them in one `jax.custom_vjp` so that every
backend shares the same backward rule (dlhs = gmm(dout, rhs, transpose), drhs = tgmm(lhs, dout)).
Backends register in `BACKENDS`; GPU kernels live in `kernels/` and register themselves when imported
(`register_builtin_kernels`). `backend="auto"` takes the best available backend for the platform of
the default device, falling back to the portable XLA one.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from umoe_jax.ops.varying import vary_like, varying_axes
from umoe_jax.registry import Registry

GmmFn = Callable[..., jax.Array]


@dataclasses.dataclass(frozen=True)
class GmmBackend:
  """The raw (non-differentiable) operations of one backend.

  Attributes:
    gmm: `(lhs [M,K], rhs [G,K,N], group_sizes [G] int32, *, transpose_rhs: bool, out_dtype) -> [M,N]`
      (with transpose_rhs: lhs [M,N] -> [M,K]).
    tgmm: `(lhs [M,K], rhs [M,N], group_sizes [G] int32, *, num_groups: int, out_dtype) -> [G,K,N]`.
    platforms: platforms ("cpu", "gpu", "tpu") on which the backend runs.
    auto_priority: higher wins when `backend="auto"`; negative never picked automatically.
    available: optional probe (e.g. "is jax_triton importable") checked before `auto` picks it.
    row_index: the ops also take `lhs_index` [M] / `row_scale` [M] / `row_dot` [M, N] (gmm; with
      `row_dot` they return (out, dots [M] float32), dots[r] = <unscaled out[r], row_dot[r]>) and
      `lhs_index` / `rhs_index` / `lhs_scale` [M] (tgmm): operand rows read through an index, rows
      scaled and row dots taken inside the kernel, which lets `umoe_jax.ops.fused_dispatch` skip
      the permuted copies. Others get these done by XLA around the kernel.
    fused_activations: activation names the row-index gmm also takes into its epilogue as
      `epi_act` (with `row_dot`: the dot is taken with act(row_dot) and the output multiplied by
      act'(row_dot)); XLA does this for other names.
    scaled_row_dot: the row-index gmm with `row_dot` and `row_scale` also takes
      `scaled_row_dot=True` and returns (out, dots, scaled [M, N] in row_dot's dtype), scaled[r] =
      act(row_dot[r]) (rounded to its dtype; row_dot[r] without `epi_act`) * row_scale[r], written
      by the epilogue (gmm_combine's weight-gradient rows, `moe.fuse_weight_rows`).
    gather_sum: optional `(rows [M, D], index [N, K] int32, weights [N, K] or None) -> [N, D]`,
      out[n] = sum_k weights[n, k] * rows[index[n, k]] accumulated in float32 (no gradient): the
      fused dispatch's K-way fan-ins (`fused_dispatch._fan_in`); None: XLA's take + sum.
  """
  gmm: GmmFn
  tgmm: GmmFn
  platforms: tuple[str, ...]
  auto_priority: int = 0
  available: Callable[[], bool] = lambda: True
  row_index: bool = False
  fused_activations: tuple[str, ...] = ()
  scaled_row_dot: bool = False
  gather_sum: Optional[GmmFn] = None


BACKENDS: Registry[GmmBackend] = Registry("gmm backend")


# ----------------------------------------------------------------------------------------------
# Portable backends.


def _xla_gmm(lhs, rhs, group_sizes, *, transpose_rhs, out_dtype):
  contract_rhs = 2 if transpose_rhs else 1
  dims = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(([1], [contract_rhs]), ([], [])),
      lhs_ragged_dimensions=[0],
      rhs_group_dimensions=[0])
  return jax.lax.ragged_dot_general(
      lhs, rhs, group_sizes, dims, preferred_element_type=out_dtype)


def _xla_tgmm(lhs, rhs, group_sizes, *, num_groups, out_dtype):
  del num_groups  # implied by group_sizes
  dims = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(([0], [0]), ([], [])),
      lhs_ragged_dimensions=[0],
      rhs_group_dimensions=[])
  return jax.lax.ragged_dot_general(
      lhs, rhs, group_sizes, dims, preferred_element_type=out_dtype)


BACKENDS.register("xla")(GmmBackend(
    gmm=_xla_gmm, tgmm=_xla_tgmm, platforms=("cpu", "gpu", "tpu"), auto_priority=0))


def _group_ids(group_sizes, num_rows):
  """Group index of every row [M] (rows past the last group get `G`, i.e. no group)."""
  ends = jnp.cumsum(group_sizes)
  return jnp.searchsorted(ends, jnp.arange(num_rows), side="right")


def _masked_gmm(lhs, rhs, group_sizes, *, transpose_rhs, out_dtype):
  # One dense product per group over all rows, masked: G times the FLOPs, but only O(M*N) memory and
  # nothing but dot + select, so it lowers anywhere. Useful as an independent cross-check.
  ids = _group_ids(group_sizes, lhs.shape[0])
  out_dim = rhs.shape[1] if transpose_rhs else rhs.shape[2]

  def body(g, acc):
    w = rhs[g].T if transpose_rhs else rhs[g]
    part = jnp.dot(lhs, w, preferred_element_type=jnp.float32)
    return acc + jnp.where((ids == g)[:, None], part, 0.0)

  acc = jax.lax.fori_loop(0, rhs.shape[0], body, jnp.zeros((lhs.shape[0], out_dim), jnp.float32))
  return acc.astype(out_dtype)


def _masked_tgmm(lhs, rhs, group_sizes, *, num_groups, out_dtype):
  ids = _group_ids(group_sizes, lhs.shape[0])
  one_hot = (ids[:, None] == jnp.arange(num_groups)[None, :]).astype(lhs.dtype)  # [M, G]
  out = jnp.einsum("mg,mk,mn->gkn", one_hot, lhs, rhs, preferred_element_type=jnp.float32)
  return out.astype(out_dtype)


BACKENDS.register("masked")(GmmBackend(
    gmm=_masked_gmm, tgmm=_masked_tgmm, platforms=("cpu", "gpu", "tpu"), auto_priority=-1))


# ----------------------------------------------------------------------------------------------
# Backend choice.

_BUILTIN_KERNELS_LOADED = False


def register_builtin_kernels() -> None:
  """Imports `kernels/` so that GPU/TPU kernel backends register themselves (once, lazily)."""
  global _BUILTIN_KERNELS_LOADED
  if _BUILTIN_KERNELS_LOADED:
    return
  _BUILTIN_KERNELS_LOADED = True
  try:
    import kernels  # noqa: F401  (registers backends on import; absent in a library-only install)
  except ImportError:
    pass


def resolve_backend(name: str, platform: Optional[str] = None) -> str:
  """Maps `name` (a backend or "auto") to a concrete backend name for `platform`.

  Raises ValueError naming the backend when it is unknown or cannot run on the platform.
  """
  register_builtin_kernels()
  platform = platform or jax.devices()[0].platform
  if name != "auto":
    backend = BACKENDS.get(name)
    if platform not in backend.platforms:
      raise ValueError(f"gmm backend {name!r} does not run on platform {platform!r} "
                       f"(it runs on {', '.join(backend.platforms)})")
    return name
  candidates = [(BACKENDS.get(n).auto_priority, n) for n in BACKENDS.names()
                if platform in BACKENDS.get(n).platforms and BACKENDS.get(n).auto_priority >= 0
                and BACKENDS.get(n).available()]
  return max(candidates)[1]


# ----------------------------------------------------------------------------------------------
# The differentiable API.


def _check_shapes(lhs, rhs, group_sizes, transpose_rhs):
  if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.ndim != 1:
    raise ValueError(f"gmm wants lhs [M,K], rhs [G,K,N], group_sizes [G]; got lhs {lhs.shape}, "
                     f"rhs {rhs.shape}, group_sizes {group_sizes.shape}")
  contract = rhs.shape[2] if transpose_rhs else rhs.shape[1]
  if lhs.shape[1] != contract:
    raise ValueError(f"gmm contraction mismatch: lhs {lhs.shape} vs rhs {rhs.shape} "
                     f"(transpose_rhs={transpose_rhs})")
  if group_sizes.shape[0] != rhs.shape[0]:
    raise ValueError(f"gmm: group_sizes has {group_sizes.shape[0]} groups but rhs has {rhs.shape[0]}")
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(f"gmm: group_sizes must be integer, got {group_sizes.dtype}")


@functools.lru_cache(maxsize=None)
def _differentiable_gmm(backend_name: str, transpose_rhs: bool, out_dtype) -> Callable:
  backend = BACKENDS.get(backend_name)

  @jax.custom_vjp
  def fn(lhs, rhs, group_sizes):
    out = backend.gmm(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs,
                      out_dtype=out_dtype or lhs.dtype)
    return vary_like(out, varying_axes(lhs) | varying_axes(rhs) | varying_axes(group_sizes))

  def fwd(lhs, rhs, group_sizes):
    return fn(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)

  def bwd(res, dout):
    lhs, rhs, group_sizes = res
    dlhs = backend.gmm(dout.astype(rhs.dtype), rhs, group_sizes, transpose_rhs=not transpose_rhs,
                       out_dtype=lhs.dtype)
    if transpose_rhs:  # out = lhs @ rhs[g].T  =>  drhs[g] = dout[g].T @ lhs[g]
      drhs = backend.tgmm(dout.astype(lhs.dtype), lhs, group_sizes, num_groups=rhs.shape[0],
                          out_dtype=rhs.dtype)
    else:
      drhs = backend.tgmm(lhs, dout.astype(lhs.dtype), group_sizes, num_groups=rhs.shape[0],
                          out_dtype=rhs.dtype)
    # Kernels called through custom calls drop shard_map's varying-axes type; restore it.
    return vary_like(dlhs, varying_axes(lhs)), vary_like(drhs, varying_axes(rhs)), None

  fn.defvjp(fwd, bwd)
  return fn


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, backend: str = "auto",
        transpose_rhs: bool = False, preferred_element_type=None) -> jax.Array:
  """Grouped matmul `out[rows of g] = lhs[rows of g] @ rhs[g]` (or `@ rhs[g].T`), differentiable.

  Args:
    lhs: [M, K] rows sorted by group ([M, N] with `transpose_rhs`).
    rhs: [G, K, N] one matrix per group.
    group_sizes: [G] int32, sum <= M.
    backend: a name in `BACKENDS` or "auto".
    transpose_rhs: multiply by `rhs[g].T` instead.
    preferred_element_type: output dtype (default: lhs.dtype); accumulation is always float32.
  Returns:
    [M, N] ([M, K] with `transpose_rhs`).
  """
  _check_shapes(lhs, rhs, group_sizes, transpose_rhs)
  name = resolve_backend(backend)
  out_dtype = jnp.dtype(preferred_element_type) if preferred_element_type is not None else None
  return _differentiable_gmm(name, transpose_rhs, out_dtype)(lhs, rhs, group_sizes.astype(jnp.int32))


def tgmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, backend: str = "auto",
         preferred_element_type=None) -> jax.Array:
  """Per-group `lhs[rows of g].T @ rhs[rows of g]`: lhs [M, K], rhs [M, N] -> [G, K, N].

  Not differentiable (it is the weight-gradient form; nothing differentiates through it).
  """
  if lhs.ndim != 2 or rhs.ndim != 2 or lhs.shape[0] != rhs.shape[0]:
    raise ValueError(f"tgmm wants lhs [M,K], rhs [M,N]; got {lhs.shape}, {rhs.shape}")
  name = resolve_backend(backend)
  return BACKENDS.get(name).tgmm(lhs, rhs, group_sizes.astype(jnp.int32),
                                 num_groups=group_sizes.shape[0],
                                 out_dtype=preferred_element_type or lhs.dtype)
