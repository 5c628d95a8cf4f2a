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
Backends register in `umoe_jax.ops.gmm_backends.BACKENDS` (the kernels of `kernels/gmm/` among
them); `backend="auto"` takes the best available backend for the platform of the default device,
falling back to the portable XLA one.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from umoe_jax.ops.fp8_gmm import fp8_gmm
from umoe_jax.ops.gmm_backends import (BACKENDS, GmmBackend, register_builtin_kernels,  # noqa: F401  (API)
                                       resolve_backend)
from umoe_jax.ops.varying import vary_like, varying_axes


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
        transpose_rhs: bool = False, preferred_element_type=None, fp8: bool = False) -> jax.Array:
  """Grouped matmul `out[rows of g] = lhs[rows of g] @ rhs[g]` (or `@ rhs[g].T`), differentiable.

  Args:
    lhs: [M, K] rows sorted by group ([M, N] with `transpose_rhs`).
    rhs: [G, K, N] one matrix per group.
    group_sizes: [G] int32, sum <= M.
    backend: a name in `BACKENDS` or "auto".
    transpose_rhs: multiply by `rhs[g].T` instead.
    preferred_element_type: output dtype (default: lhs.dtype); accumulation is always float32.
    fp8: FP8 operands in the forward and input-gradient products, the weight gradient in lhs's
      dtype (`umoe_jax.ops.fp8_gmm.fp8_gmm`; train.precision=fp8).
  Returns:
    [M, N] ([M, K] with `transpose_rhs`).
  """
  _check_shapes(lhs, rhs, group_sizes, transpose_rhs)
  if fp8:
    return fp8_gmm(lhs, rhs, group_sizes, backend=backend, transpose_rhs=transpose_rhs,
                   preferred_element_type=preferred_element_type)
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
