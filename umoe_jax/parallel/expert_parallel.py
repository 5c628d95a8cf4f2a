"""Expert parallelism: routed experts split over the mesh's expert axes, tokens exchanged between them.

Inside `use_mesh(...)` with more than one device, `ExpertPool.route` / `AoEExpertPool.route` and the
pre-mixing attention's routed queries call `expert_map` instead of the single-device dispatch. `expert_map` is one
`shard_map` over the whole mesh (the batch is split over the expert axes too). Two exchanges
(n = tokens per device, K = slots per token, D / D_out = row widths in / out, EP = expert-axes size,
E_local = experts per shard):

"all_to_all": every (token, slot) row travels to its expert's shard. Per device:
  1. local dispatch (`dispatch.make_plan` / `permute`) of its own (token, slot) rows, sorted by
     global expert id, so the rows for expert shard d form one contiguous run;
  2. pack the runs into a send buffer [EP, C, D] (run d -> chunk d, zero padding), `all_to_all` it
     and the per-local-expert row counts [EP, E_local] over the expert axes;
  3. sort the received rows by local expert (`make_plan` again; padding rows sort last) and run the
     local experts with `gmm` (rows past sum(group_sizes) are padding and come out zero);
  4. the reverse `all_to_all`, un-pack, `dispatch.unpermute`, gate-weighted `dispatch.combine`.
  Per (sender, receiver) pair: C*D rows out and C*D_out back, C = n*min(K, E_local) (dropless).

"all_gather" (token dedup): every token travels once to every shard. Per device:
  1. `all_gather` (tiled) its tokens x [n, D] (or [n, K, D]), ids and gates over the expert axes;
  2. keep the (token, slot) rows whose expert lives on this shard (the others get the extra group
     E_local, which sorts last), `make_plan` / `permute`, run the local experts on the first M_buf
     rows;
  3. `unpermute`, zero the other shards' and the dropped rows, `combine` this shard's slots into a
     partial output [EP*n, D_out] (gates None: [EP*n, K, D_out]) and `psum_scatter` (tiled) the
     partials back to the token owners.
  Per pair: n*D in (x [n, K, D]: n*K*D) and n*D_out back (gates None: n*K*D_out), whatever the
  routing. Memory: the gathered tokens' permuted copy has EP*n*K rows. Partial sums cross shards in
  the output dtype (the single-device path rounds once, after its float32 combine).

exchange="auto" (default) takes "all_gather" when K >= EP (then nearly every token has a slot on
every shard, and all_to_all would send each token's row ~K/EP times to each shard, padded to the
worst case), else "all_to_all". `use_mesh(..., expert_exchange=...)` / `config.expert_parallel.
exchange` pick one. With expert axes of size 1 (data / fsdp / tensor layouts) both collapse to the
local dispatch: no collective, every device runs all experts on its own tokens (weights are gathered
from their FSDP shards at the shard_map boundary). Tensor parallelism inside the experts: the hidden
width F stays split over the tensor axis, the down projection gives partial sums, `psum` over tensor
adds them.

Buffer policy (`capacity`): the expert buffer holds C rows per pair (all_to_all) or M_buf rows per
shard (all_gather).
  * default, dropless: C = n * min(K, E_local), M_buf = EP * n * min(K, E_local) -- the most rows
    that can reach one shard when a token's K expert ids are distinct (every top-k router). Up to
    EP x the balanced size (memory-heavy, never drops).
  * `capacity_factor=c` (`use_mesh(..., expert_capacity_factor=c)`, `config.expert_parallel`):
    c x the balanced load, C = ceil(c * n * K / EP) and M_buf = ceil(c * n * K) (at most the
    dropless size). Rows past the buffer are dropped (they contribute zero, like a token the router
    did not pick; all_gather drops the last rows in (local expert, token, slot) order) and counted:
    `stats["dropped_rows"]` (global count), sown by the pool as `nnx.Intermediate`
    "ep_dropped_rows".

The all-to-all is the dense `jax.lax.all_to_all` (fixed-size chunks): it runs on every backend
(CPU included) and on GPU avoids `ragged_all_to_all`'s slow paths (openxla/xla#33386).
"""
from __future__ import annotations

import functools
import logging
import math
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from umoe_jax.ops import dispatch
from umoe_jax.ops.gmm import gmm
from umoe_jax.ops.varying import match_varying, vary_like
from umoe_jax.parallel import rules as ax
from umoe_jax.parallel.sharding import EXPERT_EXCHANGES as EXCHANGES
from umoe_jax.parallel.sharding import current_context, normalize_rules

LocalFn = Callable[..., jax.Array]  # (rows [R, D], group_sizes [E_local], *weights) -> [R, D_out]


def _shard_map(f, mesh, in_specs, out_specs):
  if hasattr(jax, "shard_map"):
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=True)
  from jax.experimental.shard_map import shard_map  # jax < 0.7
  return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=True)


def is_active() -> bool:
  """True while tracing under `use_mesh` with a mesh of more than one device."""
  ctx = current_context()
  return ctx is not None and ctx.mesh.size > 1


def _mesh_axes(rules, name: str, mesh: Mesh) -> tuple[str, ...]:
  target = dict(rules).get(name)
  axes = () if target is None else (target,) if isinstance(target, str) else tuple(target)
  return tuple(a for a in axes if a in mesh.shape)


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
  if message not in _WARNED:
    _WARNED.add(message)
    logging.warning(message)


def _axis_arg(axes: tuple[str, ...]):
  return axes[0] if len(axes) == 1 else axes


def resolve_exchange(exchange: str, slots: int, ep: int) -> str:
  """The exchange `expert_map` runs: "local" when ep == 1 (no collective), "auto" -> "all_gather"
  when slots >= ep else "all_to_all", an explicit choice as given."""
  if exchange not in EXCHANGES:
    raise ValueError(f"expert-parallel exchange {exchange!r} must be one of {EXCHANGES}")
  if ep == 1:
    return "local"
  if exchange == "auto":
    return "all_gather" if slots >= ep else "all_to_all"
  return exchange


def capacity(tokens_per_device: int, slots: int, ep: int, experts_per_shard: int,
             capacity_factor: Optional[float], exchange: str = "all_to_all") -> int:
  """Expert buffer rows (see the module docstring): per (sender, receiver) pair for "all_to_all",
  per shard (all EP senders) for "all_gather". With ep == 1 there is no exchange and nothing can be
  dropped: the device's own M = tokens * slots rows."""
  if ep == 1:
    return tokens_per_device * slots
  senders = ep if exchange == "all_gather" else 1
  dropless = senders * tokens_per_device * min(slots, experts_per_shard)
  if capacity_factor is None:
    return max(dropless, 1)
  balanced = senders * tokens_per_device * slots / ep
  return max(1, min(dropless, math.ceil(capacity_factor * balanced)))


def _fit(group_sizes: jax.Array, cap: int) -> jax.Array:
  """Group sizes [..., G] clipped (along the last axis, in order) so that they sum to <= cap."""
  return jnp.diff(jnp.minimum(jnp.cumsum(group_sizes, axis=-1), cap), axis=-1, prepend=0)


def _to_tokens(out: jax.Array, plan: dispatch.DispatchPlan, slots: int,
               gates: Optional[jax.Array]) -> jax.Array:
  """Expert-sorted outputs [M, D_out] -> [M/K, K, D_out] in (token, slot) order, or with gates
  [M/K, K] their gate-weighted sum [M/K, D_out]."""
  with jax.named_scope("combine"):
    y = dispatch.unpermute(out, plan).reshape(-1, slots, out.shape[-1])
    return y if gates is None else dispatch.combine(y, gates)


def _all_to_all_exchange(rows, expert_sorted, group_sizes, local_fn, weights, *, ep, axis, cap):
  """Steps 2-4 of "all_to_all" for one device: rows [M, D] sorted by global expert -> outputs
  [M, D_out] (same order; dropped rows zero) and the number of dropped rows."""
  m, d = rows.shape
  e_local = group_sizes.shape[0] // ep
  counts = group_sizes.reshape(ep, e_local)                                   # [EP, E_l]
  send_total = counts.sum(axis=1)                                             # [EP]
  start = jnp.cumsum(send_total) - send_total                                 # [EP]
  slot = jnp.arange(cap, dtype=jnp.int32)                                     # [C]
  kept = jnp.minimum(send_total, cap)                                         # [EP]
  src = jnp.clip(start[:, None] + slot[None, :], 0, m - 1)                    # [EP, C]
  valid = slot[None, :] < kept[:, None]                                       # [EP, C]
  send = jnp.where(valid[..., None], jnp.take(rows, src, axis=0), 0).astype(rows.dtype)  # [EP, C, D]
  sent_counts = _fit(counts, cap)                                             # [EP, E_l]

  with jax.named_scope("ep_all_to_all"):
    recv = jax.lax.all_to_all(send, axis, 0, 0, tiled=True)                   # [EP, C, D]
    recv_counts = jax.lax.all_to_all(sent_counts, axis, 0, 0, tiled=True)     # [EP, E_l]

  # Local expert of every received row; padding rows get E_l and sort last.
  recv_cum = jnp.cumsum(recv_counts, axis=1)                                  # [EP, E_l]
  local_ids = jnp.sum(slot[None, :, None] >= recv_cum[:, None, :], axis=-1)   # [EP, C] in [0, E_l]
  plan = dispatch.make_plan(local_ids.reshape(-1, 1), e_local + 1)            # over EP*C rows
  local_rows = dispatch.permute(recv.reshape(ep * cap, d), plan, 1)           # [EP*C, D]
  local_out = local_fn(local_rows, plan.group_sizes[:e_local], *weights)      # [EP*C, D_out]
  back = dispatch.unpermute(local_out, plan).reshape(ep, cap, -1)             # [EP, C, D_out]

  with jax.named_scope("ep_all_to_all"):
    ret = jax.lax.all_to_all(back, axis, 0, 0, tiled=True)                    # [EP, C, D_out]

  dest = expert_sorted // e_local                                             # [M]
  pos = jnp.arange(m, dtype=jnp.int32) - start[dest]                          # [M]
  ok = pos < cap
  out = jnp.take(ret.reshape(ep * cap, -1), dest * cap + jnp.minimum(pos, cap - 1), axis=0)
  out = jnp.where(ok[:, None], out, 0).astype(local_out.dtype)                # [M, D_out]
  dropped = jnp.sum(jnp.maximum(send_total - cap, 0))
  return out, dropped


def _all_gather_exchange(x, ids, gates, local_fn, weights, *, e_local, axes, cap):
  """"all_gather" for one device: its tokens x [n, D] or [n, K, D], ids [n, K], gates [n, K] or
  None -> (out [n, D_out] (gates None: [n, K, D_out]), number of rows this shard dropped)."""
  k = ids.shape[1]
  axis = _axis_arg(axes)
  with jax.named_scope("ep_all_gather"):
    x_all = jax.lax.all_gather(x, axis, axis=0, tiled=True)                   # [EP*n, (K,) D]
    ids_all = jax.lax.all_gather(ids, axis, axis=0, tiled=True)               # [EP*n, K]
    gates_all = None if gates is None else jax.lax.all_gather(gates, axis, axis=0, tiled=True)
  # This shard's index, linearised over `axes` like the collectives and the weights' EXPERT dim.
  shard = jax.lax.axis_index(axis)
  local = ids_all.astype(jnp.int32) - shard * e_local                         # [EP*n, K]
  mine = (local >= 0) & (local < e_local)
  plan = dispatch.make_plan(jnp.where(mine, local, e_local), e_local + 1)     # others sort last
  with jax.named_scope("dispatch"):
    rows = dispatch.permute(x_all, plan, k)                                   # [M = EP*n*K, D]
  m = rows.shape[0]
  cap = min(cap, m)
  sizes = _fit(plan.group_sizes[:e_local], cap)                               # [E_l]
  kept = jnp.sum(sizes)
  out = local_fn(rows[:cap], sizes, *weights)                                 # [M_buf, D_out]
  # Rows past `kept` are other shards' slots, dropped rows or padding: local_fn may have left
  # anything there, so select (garbage * 0 can be NaN).
  out = jnp.pad(out, ((0, m - cap), (0, 0)))                                  # [M, D_out]
  out = jnp.where(jnp.arange(m)[:, None] < kept, out, jnp.zeros((), out.dtype))
  partial = _to_tokens(out, plan, k, gates_all)                               # [EP*n, (K,) D_out]
  with jax.named_scope("ep_reduce_scatter"):
    y = jax.lax.psum_scatter(vary_like(partial, frozenset(axes)), axis, scatter_dimension=0,
                             tiled=True)                                      # [n, (K,) D_out]
  return y, jnp.sum(plan.group_sizes[:e_local]) - kept


def expert_map(x: jax.Array, expert_ids: jax.Array, gates: Optional[jax.Array],
               weights: Sequence[jax.Array], weight_axes: Sequence[Sequence[Optional[str]]],
               local_fn: LocalFn, *, num_experts: int, mesh: Optional[Mesh] = None,
               rules: Any = None, capacity_factor: Any = "context",
               exchange: str = "context", fused_local: Optional[Callable] = None
               ) -> tuple[jax.Array, dict]:
  """Applies routed experts to every (token, slot) row across the mesh.

    gates given:  out[n] = sum_k gates[n, k] * f_{ids[n, k]}(x[n] or x[n, k])   -> [N, D_out]
    gates None:   out[n, k] = f_{ids[n, k]}(x[n] or x[n, k])                     -> [N, K, D_out]

  Args:
    x: [N, D] (all K slots of a token see x[n]) or [N, K, D] (one row per slot).
    expert_ids: [N, K] int in [0, num_experts), distinct per token; gates: [N, K] or None.
    weights: expert-stacked arrays (e.g. w_up [E, D, F]) and any small replicated ones.
    weight_axes: logical names of each weight (the `out_sharding` of its Param). Inside the
      shard_map a weight keeps only its EXPERT dim (split over the expert axis) and its EXPERT_MLP
      dim (split over the tensor axes when the rules say so); other dims are gathered.
    local_fn: `(rows [R, D] sorted by local expert, group_sizes [E_local], *local_weights,
      tensor_axes=(...)) -> [R, D_out]`; rows past sum(group_sizes) are padding (their outputs are
      discarded); `tensor_axes` are the mesh axes EXPERT_MLP is split over (psum partial sums over
      them).
    num_experts: E.
    mesh, rules: default from `use_mesh`.
    capacity_factor: None = dropless; a float = buffer capacity factor; default from `use_mesh`.
    exchange: "auto" | "all_to_all" | "all_gather" (module docstring); default from `use_mesh`.
    fused_local: optional `(x, plan, gates, *local_weights) -> [n, D_out]`, the whole routed
      forward with the dispatch fused into the kernels; used instead of permute + local_fn +
      combine when nothing is exchanged (expert axis 1), gates are given and the hidden width is
      not split over tensor axes.
  Returns:
    (out, stats) with stats = {"dropped_rows": [] int32 (global), "capacity": buffer rows (per pair
    for all_to_all, per shard for all_gather)}; `resolve_exchange` tells which exchange ran.
  """
  ctx = current_context()
  if mesh is None:
    if ctx is None:
      raise ValueError("expert_map needs a mesh (pass mesh= or run under parallel.use_mesh)")
    mesh = ctx.mesh
  rules = normalize_rules(rules if rules is not None else (ctx.rules if ctx else None))
  if capacity_factor == "context":
    capacity_factor = ctx.expert_capacity_factor if ctx is not None else None
  if exchange == "context":
    exchange = ctx.expert_exchange if ctx is not None else "auto"

  n, k = expert_ids.shape
  batch_axes = _mesh_axes(rules, ax.BATCH, mesh)
  expert_axes = tuple(a for a in _mesh_axes(rules, ax.EXPERT, mesh) if mesh.shape[a] > 1)
  tensor_axes = tuple(a for a in _mesh_axes(rules, ax.EXPERT_MLP, mesh)
                      if a not in batch_axes and a not in expert_axes and mesh.shape[a] > 1)
  ep = math.prod(mesh.shape[a] for a in expert_axes)
  shards = math.prod(mesh.shape[a] for a in batch_axes)
  missing = [a for a in expert_axes if a not in batch_axes]
  if missing:
    raise ValueError(f"expert parallelism over {missing} needs the batch split over it too: add "
                     f"{missing} to the {ax.BATCH!r} sharding rule (now {batch_axes})")
  if n % shards:
    raise ValueError(f"{n} tokens cannot be split over the batch axes {batch_axes} "
                     f"({shards} shards): make batch*length a multiple of {shards}")
  if num_experts % ep:
    # The params are replicated then too (`sharding.spec_for_shape` drops non-dividing axes): every
    # device runs all experts on its own tokens, no exchange.
    _warn_once(f"{num_experts} experts do not split over the expert axes {expert_axes} of size "
               f"{ep}: experts replicated, no expert parallelism for this pool")
    expert_axes, ep = (), 1
  tp = math.prod(mesh.shape[a] for a in tensor_axes)
  if any(dim % tp for w, names in zip(weights, weight_axes)
         for dim, name in zip(w.shape, names) if name == ax.EXPERT_MLP):
    tensor_axes = ()   # hidden width not divisible: replicated over tensor, like the params
  e_local = num_experts // ep
  strategy = resolve_exchange(exchange, k, ep)
  cap = capacity(n // shards, k, ep, e_local, capacity_factor, strategy)

  def weight_spec(names):
    spec = []
    for name in names:
      if name == ax.EXPERT and expert_axes:
        spec.append(_axis_arg(expert_axes))
      elif name == ax.EXPERT_MLP and tensor_axes:
        spec.append(_axis_arg(tensor_axes))
      else:
        spec.append(None)
    return P(*spec)

  bspec = _axis_arg(batch_axes) if batch_axes else None
  x_spec = P(bspec, *([None] * (x.ndim - 1)))
  in_specs = (x_spec, P(bspec, None), P(bspec, None) if gates is not None else None,
              tuple(weight_spec(names) for names in weight_axes))
  fn = functools.partial(local_fn, tensor_axes=tensor_axes)

  def per_device(x_l, ids_l, gates_l, ws):
    if strategy == "all_gather":
      y, dropped = _all_gather_exchange(x_l, ids_l, gates_l, fn, ws, e_local=e_local,
                                        axes=expert_axes, cap=cap)
    elif strategy == "local" and fused_local is not None and gates_l is not None and not tensor_axes:
      # No exchange: the single-device routed forward with the dispatch fused into the kernels.
      plan = dispatch.make_plan(ids_l, num_experts)
      y = fused_local(x_l, plan, gates_l, *ws)                                # [n, D_out]
      dropped = jnp.zeros((), jnp.int32)
    else:
      plan = dispatch.make_plan(ids_l, num_experts)
      with jax.named_scope("dispatch"):
        rows = dispatch.permute(x_l, plan, k)                                 # [M, D]
      if strategy == "local":
        out = fn(rows, plan.group_sizes, *ws)                                 # [M, D_out]
        dropped = jnp.zeros((), jnp.int32)
      else:
        expert_sorted = jnp.take(ids_l.reshape(-1).astype(jnp.int32), plan.order)
        out, dropped = _all_to_all_exchange(rows, expert_sorted, plan.group_sizes, fn, ws, ep=ep,
                                            axis=_axis_arg(expert_axes), cap=cap)
      y = _to_tokens(out, plan, k, gates_l)                                   # [n, (K,) D_out]
    if batch_axes:
      dropped = jax.lax.psum(dropped, _axis_arg(batch_axes))
    return y, dropped.astype(jnp.int32)

  out_spec = P(bspec, None) if gates is not None else P(bspec, None, None)
  if gates is None:
    run = _shard_map(lambda a, b, w: per_device(a, b, None, w), mesh,
                     (in_specs[0], in_specs[1], in_specs[3]), (out_spec, P()))
    y, dropped = run(x, expert_ids, tuple(weights))
  else:
    run = _shard_map(per_device, mesh, in_specs, (out_spec, P()))
    y, dropped = run(x, expert_ids, gates, tuple(weights))
  return y, {"dropped_rows": dropped, "capacity": cap}


# ----------------------------------------------------------------------------------------------
# The model call sites: the pool (ExpertPool, AoEExpertPool) and the pre-mixing queries.


def _pool_local(rows, group_sizes, w_up, w_down, w_gate=None, *, tensor_axes, activation, dtype,
                backend):
  rows, w_up, w_down, *rest = match_varying(rows.astype(dtype), w_up, w_down,
                                            *([] if w_gate is None else [w_gate]))
  w_gate = rest[0] if rest else None
  from umoe_jax.model.experts import expert_hidden
  up = gmm(rows, w_up.astype(dtype), group_sizes, backend=backend)                       # [R, F_l]
  gate = None if w_gate is None else gmm(rows, w_gate.astype(dtype), group_sizes, backend=backend)
  h = expert_hidden(up, gate, activation)
  if not tensor_axes:
    return gmm(h, w_down.astype(dtype), group_sizes, backend=backend)                    # [R, D]
  part = gmm(h, w_down.astype(dtype), group_sizes, backend=backend,
             preferred_element_type=jnp.float32)                                         # partial
  return jax.lax.psum(part, _axis_arg(tensor_axes)).astype(dtype)


def _pool_fused(x, plan, gates, w_up, w_down, w_gate=None, *, activation, dtype, backend):
  from umoe_jax.model.experts import routed_mlp
  x, gates, w_up, w_down, *rest = match_varying(
      x.astype(dtype), gates, w_up.astype(dtype), w_down.astype(dtype),
      *([] if w_gate is None else [w_gate.astype(dtype)]))
  return routed_mlp(x, plan, gates, w_up, w_down, rest[0] if rest else None,
                    activation=activation, backend=backend)


def route_pool(pool, x: jax.Array, expert_ids: jax.Array, gates: jax.Array) -> jax.Array:
  """`ExpertPool.route` under a mesh: sum_k gates * E_k(x) with experts split over the mesh."""
  from flax import nnx
  local = functools.partial(_pool_local, activation=pool.activation,
                            dtype=pool.compute_dtype, backend=pool.gmm_backend)
  params = [pool.w_up, pool.w_down]
  if getattr(pool, "w_gate", None) is not None:
    params.append(pool.w_gate)
  y, stats = expert_map(x, expert_ids, gates, tuple(_value(p) for p in params),
                        tuple(_names(p) for p in params), local, num_experts=pool.n_experts,
                        fused_local=functools.partial(_pool_fused, activation=pool.activation,
                                                      dtype=pool.compute_dtype,
                                                      backend=pool.gmm_backend))
  ctx = current_context()
  if ctx is not None and ctx.expert_capacity_factor is not None:
    pool.sow(nnx.Intermediate, "ep_dropped_rows", stats["dropped_rows"])
  return y


def _aoe_local(rows, group_sizes, w_a, w_b, w_down, w_up=None, *, tensor_axes, activation, dtype,
               backend):
  """One device's AoE experts (w_b / w_up / w_down's hidden width may be split over tensor)."""
  from umoe_jax.model.experts import aoe_expert_rows
  rows, w_a, w_b, w_down, *rest = match_varying(rows.astype(dtype), w_a, w_b, w_down,
                                                *([] if w_up is None else [w_up]))
  ws = [w.astype(dtype) for w in (w_a, w_b)] + [rest[0].astype(dtype) if rest else None,
                                                w_down.astype(dtype)]
  if not tensor_axes:
    return aoe_expert_rows(rows, group_sizes, *ws, activation=activation, backend=backend)
  part = aoe_expert_rows(rows, group_sizes, *ws, activation=activation, backend=backend,
                         preferred_element_type=jnp.float32)                             # partial
  return jax.lax.psum(part, _axis_arg(tensor_axes)).astype(dtype)


def _aoe_fused(x, plan, gates, w_a, w_b, w_down, w_up=None, *, activation, dtype, backend):
  from umoe_jax.model.experts import aoe_routed_mlp
  x, gates, w_a, w_b, w_down, *rest = match_varying(
      x.astype(dtype), gates, w_a.astype(dtype), w_b.astype(dtype), w_down.astype(dtype),
      *([] if w_up is None else [w_up.astype(dtype)]))
  return aoe_routed_mlp(x, plan, gates, w_a, w_b, rest[0] if rest else None, w_down,
                        activation=activation, backend=backend)


def route_aoe_pool(pool, x: jax.Array, expert_ids: jax.Array, gates: jax.Array) -> jax.Array:
  """`AoEExpertPool.route` under a mesh: the codes' A^i, B^i and the up / down maps split over the
  expert axes like `route_pool`'s (the hidden width F over tensor)."""
  from flax import nnx
  kw = dict(activation=pool.activation, dtype=pool.compute_dtype, backend=pool.gmm_backend)
  params = [pool.w_a, pool.w_b, pool.w_down] + ([pool.w_up] if pool.w_up is not None else [])
  y, stats = expert_map(x, expert_ids, gates, tuple(_value(p) for p in params),
                        tuple(_names(p) for p in params), functools.partial(_aoe_local, **kw),
                        num_experts=pool.n_experts, fused_local=functools.partial(_aoe_fused, **kw))
  ctx = current_context()
  if ctx is not None and ctx.expert_capacity_factor is not None:
    pool.sow(nnx.Intermediate, "ep_dropped_rows", stats["dropped_rows"])
  return y


def _queries_local(rows, group_sizes, *ws, tensor_axes, dtype, backend, eps, low_rank, norm):
  del tensor_axes  # query weights have no EXPERT_MLP dim
  from umoe_jax.model.layers import rms_norm
  rows, *ws = match_varying(rows.astype(dtype), *ws)
  if not low_rank:
    return gmm(rows, ws[0].astype(dtype), group_sizes, backend=backend)                  # [R, Dk]
  code = gmm(rows, ws[0].astype(dtype), group_sizes, backend=backend)                    # [R, r]
  if norm:
    code = rms_norm(code, ws[2], eps)
  return gmm(code, ws[1].astype(dtype), group_sizes, backend=backend)                    # [R, Dk]


def premix_queries(att, x_flat: jax.Array, expert_ids: jax.Array) -> jax.Array:
  """`PreMixAttention._routed_queries` under a mesh: x [N, D] -> per-slot queries [N, K, Dk], with
  q_a [E, D, r] / q_b [E, r, Dk] (or q_b [E, D, Dk]) split over the expert axis like the pool."""
  if att.q_a is None:
    ws, names = (_value(att.q_b),), (_names(att.q_b),)
  else:
    ws, names = [_value(att.q_a), _value(att.q_b)], [_names(att.q_a), _names(att.q_b)]
    if att.q_a_norm is not None:
      ws.append(_value(att.q_a_norm.scale))
      names.append(_names(att.q_a_norm.scale))
  local = functools.partial(_queries_local, dtype=att.cfg.compute_dtype, backend=att.cfg.gmm_backend,
                            eps=att.cfg.norm_eps, low_rank=att.q_a is not None,
                            norm=att.q_a_norm is not None)
  q, _ = expert_map(x_flat, expert_ids, None, tuple(ws), tuple(names), local,
                    num_experts=att.n_experts)
  return q


def _value(param) -> jax.Array:
  return param.get_value() if hasattr(param, "get_value") else param.value


def _names(param) -> tuple:
  meta = param.get_metadata()
  for key in ("out_sharding", "sharding_names", "sharding"):
    if meta.get(key) is not None:
      return tuple(meta[key])
  return (None,) * _value(param).ndim
