"""Dropless token dispatch: sort (token, slot) pairs by expert, run grouped matmuls, unsort, combine.

Every routed computation in the library goes through `route_to_experts`; routers and attention
variants only produce `expert_ids [N, K]` and `gates [N, K]`, and never see sorting or kernels.

Shapes: N tokens (rows), K slots per token (top-k), D input width, E experts, M = N*K sorted rows.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class DispatchPlan:
  """Where every (token, slot) pair goes.

  Attributes:
    order: [M] int32, `order[i]` = flat (token*K + slot) index of the i-th row after sorting by expert.
    group_sizes: [E] int32, rows per expert; sums to M (no row is ever dropped).
  """
  order: jax.Array
  group_sizes: jax.Array


def make_plan(expert_ids: jax.Array, num_experts: int) -> DispatchPlan:
  """Sorts the flat (token, slot) pairs by expert id.

  Args:
    expert_ids: [N, K] int, each in [0, E).
    num_experts: E.
  """
  flat = expert_ids.reshape(-1).astype(jnp.int32)                       # [M]
  # A stable sort keeps tokens in order inside each expert: reproducible and cache-friendly.
  order = jnp.argsort(flat, stable=True).astype(jnp.int32)              # [M]
  group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # [E]
  return DispatchPlan(order=order, group_sizes=group_sizes)


def permute(x: jax.Array, plan: DispatchPlan, slots: int) -> jax.Array:
  """Gathers rows into expert order.

  Args:
    x: [N, D] (one row per token, shared by its K slots) or [N, K, D] (one row per slot).
    plan: from `make_plan` on expert ids [N, K].
    slots: K.
  Returns:
    [M, D] rows sorted by expert.
  """
  if x.ndim == 2:
    return jnp.take(x, plan.order // slots, axis=0)                     # [M, D]
  if x.ndim == 3 and x.shape[1] == slots:
    return jnp.take(x.reshape(-1, x.shape[-1]), plan.order, axis=0)     # [M, D]
  raise ValueError(f"permute wants x [N, D] or [N, {slots}, D]; got {x.shape}")


def unpermute(y_sorted: jax.Array, plan: DispatchPlan) -> jax.Array:
  """Inverse of `permute` for per-slot rows: [M, D] expert order -> [M, D] (token, slot) order."""
  # Scatter by `order` == gather by its inverse permutation; the scatter needs no extra argsort.
  return jnp.zeros_like(y_sorted).at[plan.order].set(y_sorted, unique_indices=True)


def combine(y_slots: jax.Array, gates: jax.Array) -> jax.Array:
  """Gate-weighted sum over slots: y [N, K, D], gates [N, K] -> [N, D] (accumulated in float32)."""
  out = jnp.einsum("nkd,nk->nd", y_slots, gates.astype(y_slots.dtype),
                   preferred_element_type=jnp.float32)
  return out.astype(y_slots.dtype)


def apply_experts(x: jax.Array, plan: DispatchPlan, gates: jax.Array,
                  expert_fn: Callable[[jax.Array, jax.Array], jax.Array]) -> jax.Array:
  """Runs per-row experts along a dispatch plan and returns the gate-weighted sum per token.

    out[n] = sum_k gates[n, k] * Expert_{expert_ids[n, k]}(x[n] or x[n, k])

  Args:
    x: [N, D] or [N, K, D] (see `permute`).
    plan: `make_plan(expert_ids [N, K], E)`.
    gates: [N, K].
    expert_fn: `(rows [M, D] sorted by expert, group_sizes [E]) -> [M, D_out]`.
  Returns:
    [N, D_out].
  """
  n, k = gates.shape
  with jax.named_scope("dispatch"):
    rows = permute(x, plan, k)                                           # [M, D]
  y_sorted = expert_fn(rows, plan.group_sizes)                           # [M, D_out]
  with jax.named_scope("combine"):
    y = unpermute(y_sorted, plan).reshape(n, k, -1)                      # [N, K, D_out]
    return combine(y, gates)
