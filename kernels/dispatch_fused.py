"""Gather-only token dispatch: an optional faster drop-in for umoe_jax.ops.dispatch.apply_experts.

Measured on an H200 (BENCHMARKS.md), the library's dispatch (argsort, gather, *scatter* unpermute, einsum
combine) costs more than the expert matmuls it feeds. Two things make it slow: the unpermute is a
scatter ([M, D] written through an index), and autodiff turns both the permute gather and the combine
into scatter-adds in the backward pass.

Here every data movement is a gather, forward and backward, using the inverse permutation
`inv` (inv[order[i]] = i, one scatter of M int32s):
  permute   rows[i] = x[order[i] // K]                    bwd: dx[n] = sum_k drows[inv[n*K+k]]
  combine   out[n] = sum_k gates[n,k] * y[inv[n*K+k]]     bwd: dy[i] = gates.flat[order[i]] * dout[order[i] // K]
                                                             dgates[n,k] = <dout[n], y[inv[n*K+k]]>
and the unpermute is folded into the combine (no [M, D] intermediate in (token, slot) order is
written). XLA fuses each gather into the reduction that consumes it. Pure jnp: runs on any backend.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from umoe_jax.ops import dispatch as _dispatch


def inverse_order(order: jax.Array) -> jax.Array:
  """inv with inv[order[i]] = i ([M] int32)."""
  m = order.shape[0]
  return jnp.zeros((m,), jnp.int32).at[order].set(jnp.arange(m, dtype=jnp.int32), unique_indices=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def permute_rows(x, order, inv, slots):
  """rows[i] = x[order[i] // slots]: x [N, D] -> [M, D] in expert order."""
  return jnp.take(x, order // slots, axis=0)


def _permute_fwd(x, order, inv, slots):
  return permute_rows(x, order, inv, slots), (order, inv, x.shape[0])


def _permute_bwd(slots, res, drows):
  order, inv, n = res
  d = drows.shape[-1]
  dx = jnp.take(drows, inv, axis=0).reshape(n, slots, d).astype(jnp.float32).sum(1)
  return dx.astype(drows.dtype), None, None


permute_rows.defvjp(_permute_fwd, _permute_bwd)


@jax.custom_vjp
def combine_sorted(y_sorted, order, inv, gates):
  """out[n] = sum_k gates[n, k] * y_sorted[inv[n*K + k]]: y [M, D] (expert order), gates [N, K] -> [N, D]."""
  n, k = gates.shape
  y = jnp.take(y_sorted, inv, axis=0).reshape(n, k, -1).astype(jnp.float32)
  return jnp.sum(y * gates.astype(jnp.float32)[..., None], axis=1).astype(y_sorted.dtype)


def _combine_fwd(y_sorted, order, inv, gates):
  return combine_sorted(y_sorted, order, inv, gates), (y_sorted, order, inv, gates)


def _combine_bwd(res, dout):
  y_sorted, order, inv, gates = res
  n, k = gates.shape
  g_sorted = jnp.take(gates.reshape(-1), order).astype(jnp.float32)          # [M]
  dy = (jnp.take(dout, order // k, axis=0).astype(jnp.float32) * g_sorted[:, None]).astype(y_sorted.dtype)
  y = jnp.take(y_sorted, inv, axis=0).reshape(n, k, -1).astype(jnp.float32)
  dgates = jnp.einsum("nkd,nd->nk", y, dout.astype(jnp.float32)).astype(gates.dtype)
  return dy, None, None, dgates


combine_sorted.defvjp(_combine_fwd, _combine_bwd)


def apply_experts_fused(x: jax.Array, plan: _dispatch.DispatchPlan, gates: jax.Array,
                        expert_fn: Callable[[jax.Array, jax.Array], jax.Array]) -> jax.Array:
  """Same contract as `umoe_jax.ops.dispatch.apply_experts` for x [N, D] (one row per token)."""
  n, k = gates.shape
  if x.ndim != 2:
    return _dispatch.apply_experts(x, plan, gates, expert_fn)
  order = jax.lax.stop_gradient(plan.order)
  inv = inverse_order(order)
  with jax.named_scope("dispatch_fused"):
    rows = permute_rows(x, order, inv, k)
  y_sorted = expert_fn(rows, plan.group_sizes)
  with jax.named_scope("combine_fused"):
    return combine_sorted(y_sorted, order, inv, gates)
