"""The model's expert-parallel call sites: `ExpertPool.route`, `AoEExpertPool.route` and the
pre-mixing attention's routed queries under a mesh, each one `expert_parallel.expert_map` with its
per-device expert function (`local`: rows sorted by local expert -> outputs; `fused`: the whole
routed forward with the dispatch fused into the kernels, when nothing is exchanged).

The pools and the pre-mixing attention sow their dropped-row counts ("ep_dropped_rows",
`nnx.Intermediate`) when a capacity factor is set (`use_mesh(..., expert_capacity_factor=c)`); the
training step sums them (`train/ep_dropped_rows`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from umoe_jax.model.expert_mlp import aoe_expert_rows, aoe_routed_mlp, expert_hidden, routed_mlp
from umoe_jax.model.layers import rms_norm
from umoe_jax.ops.gmm import gmm
from umoe_jax.ops.varying import match_varying
from umoe_jax.parallel.exchange import axis_arg
from umoe_jax.parallel.expert_parallel import expert_map
from umoe_jax.parallel.sharding import current_context


def _pool_local(rows, group_sizes, w_up, w_down, w_gate=None, *, tensor_axes, activation, dtype,
                backend, fp8=False):
  rows, w_up, w_down, *rest = match_varying(rows.astype(dtype), w_up, w_down,
                                            *([] if w_gate is None else [w_gate]))
  w_gate = rest[0] if rest else None
  mm = functools.partial(gmm, group_sizes=group_sizes, backend=backend, fp8=fp8)
  up = mm(rows, w_up.astype(dtype))                                                      # [R, F_l]
  gate = None if w_gate is None else mm(rows, w_gate.astype(dtype))
  h = expert_hidden(up, gate, activation)
  if not tensor_axes:
    return mm(h, w_down.astype(dtype))                                                   # [R, D]
  part = mm(h, w_down.astype(dtype), preferred_element_type=jnp.float32)                 # partial
  return jax.lax.psum(part, axis_arg(tensor_axes)).astype(dtype)


def _pool_fused(x, plan, gates, w_up, w_down, w_gate=None, *, activation, dtype, backend,
                fuse_activation=False, fuse_weight_rows=False, fp8=False):
  x, gates, w_up, w_down, *rest = match_varying(
      x.astype(dtype), gates, w_up.astype(dtype), w_down.astype(dtype),
      *([] if w_gate is None else [w_gate.astype(dtype)]))
  return routed_mlp(x, plan, gates, w_up, w_down, rest[0] if rest else None,
                    activation=activation, backend=backend, fuse_activation=fuse_activation,
                    fuse_weight_rows=fuse_weight_rows, fp8=fp8)


def _route(pool, params, local, fused, x, expert_ids, gates, slot_mask=None) -> jax.Array:
  """expert_map of a pool's routed forward over its `params` (nnx.Params, expert-stacked), with
  the per-device `local` / `fused` functions; sows the dropped rows under a capacity factor."""
  kw = dict(activation=pool.activation, dtype=pool.compute_dtype, backend=pool.gmm_backend,
            fp8=pool.fp8)
  y, stats = expert_map(x, expert_ids, gates, tuple(_value(p) for p in params),
                        tuple(_names(p) for p in params), functools.partial(local, **kw),
                        num_experts=pool.n_experts, fused_local=functools.partial(fused, **kw),
                        slot_mask=slot_mask)
  _sow_dropped(pool, stats)
  return y


def _sow_dropped(module, stats: dict) -> None:
  """Sows expert_map's dropped-row count on `module` when a capacity factor can drop rows."""
  from flax import nnx
  ctx = current_context()
  if ctx is not None and ctx.expert_capacity_factor is not None:
    module.sow(nnx.Intermediate, "ep_dropped_rows", stats["dropped_rows"])


def route_pool(pool, x: jax.Array, expert_ids: jax.Array, gates: jax.Array,
               slot_mask: jax.Array | None = None) -> jax.Array:
  """`ExpertPool.route` under a mesh: sum_k gates * E_k(x) with experts split over the mesh (the
  slots outside `slot_mask` are not exchanged)."""
  params = [pool.w_up, pool.w_down] + ([pool.w_gate] if pool.w_gate is not None else [])
  fused = functools.partial(_pool_fused, fuse_activation=pool.fuse_activation,
                            fuse_weight_rows=pool.fuse_weight_rows)
  return _route(pool, params, _pool_local, fused, x, expert_ids, gates, slot_mask)


def _aoe_local(rows, group_sizes, w_a, w_b, w_down, w_up=None, *, tensor_axes, activation, dtype,
               backend, fp8=False):
  """One device's AoE experts (w_b / w_up / w_down's hidden width may be split over tensor)."""
  rows, w_a, w_b, w_down, *rest = match_varying(rows.astype(dtype), w_a, w_b, w_down,
                                                *([] if w_up is None else [w_up]))
  ws = [w.astype(dtype) for w in (w_a, w_b)] + [rest[0].astype(dtype) if rest else None,
                                                w_down.astype(dtype)]
  if not tensor_axes:
    return aoe_expert_rows(rows, group_sizes, *ws, activation=activation, backend=backend, fp8=fp8)
  part = aoe_expert_rows(rows, group_sizes, *ws, activation=activation, backend=backend, fp8=fp8,
                         preferred_element_type=jnp.float32)                             # partial
  return jax.lax.psum(part, axis_arg(tensor_axes)).astype(dtype)


def _aoe_fused(x, plan, gates, w_a, w_b, w_down, w_up=None, *, activation, dtype, backend,
               fp8=False):
  x, gates, w_a, w_b, w_down, *rest = match_varying(
      x.astype(dtype), gates, w_a.astype(dtype), w_b.astype(dtype), w_down.astype(dtype),
      *([] if w_up is None else [w_up.astype(dtype)]))
  return aoe_routed_mlp(x, plan, gates, w_a, w_b, rest[0] if rest else None, w_down,
                        activation=activation, backend=backend, fp8=fp8)


def route_aoe_pool(pool, x: jax.Array, expert_ids: jax.Array, gates: jax.Array,
                   slot_mask: jax.Array | None = None) -> jax.Array:
  """`AoEExpertPool.route` under a mesh: the codes' A^i, B^i and the up / down maps split over the
  expert axes like `route_pool`'s (the hidden width F over tensor)."""
  params = [pool.w_a, pool.w_b, pool.w_down] + ([pool.w_up] if pool.w_up is not None else [])
  return _route(pool, params, _aoe_local, _aoe_fused, x, expert_ids, gates, slot_mask)


def _queries_local(rows, group_sizes, *ws, tensor_axes, dtype, backend, eps, low_rank, norm,
                   fp8=False):
  del tensor_axes  # query weights have no EXPERT_MLP dim
  rows, *ws = match_varying(rows.astype(dtype), *ws)
  mm = functools.partial(gmm, group_sizes=group_sizes, backend=backend, fp8=fp8)
  if not low_rank:
    return mm(rows, ws[0].astype(dtype))                                                 # [R, Dk]
  code = mm(rows, ws[0].astype(dtype))                                                   # [R, r]
  if norm:
    code = rms_norm(code, ws[2], eps)
  return mm(code, ws[1].astype(dtype))                                                   # [R, Dk]


def premix_queries(att, x_flat: jax.Array, expert_ids: jax.Array,
                   slot_mask: jax.Array | None = None) -> jax.Array:
  """`PreMixAttention._routed_queries` under a mesh: x [N, D] -> per-slot queries [N, K, Dk], with
  q_a [E, D, r] / q_b [E, r, Dk] (or q_b [E, D, Dk]) split over the expert axis like the pool
  (zero at the slots outside `slot_mask`, which are not exchanged)."""
  if att.q_a is None:
    ws, names = (_value(att.q_b),), (_names(att.q_b),)
  else:
    ws, names = [_value(att.q_a), _value(att.q_b)], [_names(att.q_a), _names(att.q_b)]
    if att.q_a_norm is not None:
      ws.append(_value(att.q_a_norm.scale))
      names.append(_names(att.q_a_norm.scale))
  local = functools.partial(_queries_local, dtype=att.cfg.compute_dtype, backend=att.cfg.gmm_backend,
                            eps=att.cfg.norm_eps, low_rank=att.q_a is not None,
                            norm=att.q_a_norm is not None, fp8=att.cfg.fp8)
  q, stats = expert_map(x_flat, expert_ids, None, tuple(ws), tuple(names), local,
                        num_experts=att.n_experts, slot_mask=slot_mask)
  _sow_dropped(att, stats)   # a dropped slot's query is zero
  return q


def _value(param) -> jax.Array:
  return param.get_value() if hasattr(param, "get_value") else param.value


def _names(param) -> tuple:
  meta = param.get_metadata()
  for key in ("out_sharding", "sharding_names", "sharding"):
    if meta.get(key) is not None:
      return tuple(meta[key])
  return (None,) * _value(param).ndim

