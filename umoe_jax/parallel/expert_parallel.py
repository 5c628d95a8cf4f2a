"""Expert parallelism: routed experts split over the mesh's expert axes, tokens exchanged between them.

Inside `use_mesh(...)` with more than one device, `ExpertPool.route` / `AoEExpertPool.route` and the
pre-mixing attention's routed queries call `expert_map` (through `expert_routes`) instead of the
single-device dispatch. `expert_map` is one `shard_map` over the whole mesh (the batch is split over
the expert axes too); each device runs one of the exchanges of `exchange.py`. Two dense exchanges
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

"ragged" (`exchange.py`): exact-size `jax.lax.ragged_all_to_all` of the same (token, slot) rows as
"all_to_all": per device n*K rows in total whatever the routing, instead of EP dense chunks of the
worst case; a receive buffer of the dropless worst case (EP * n*min(K, E_local) rows, only the real
rows multiplied) or of c x the balanced load with a capacity factor. Emulated with a dense
all_to_all on CPU, where XLA has no ragged all-to-all.

exchange="auto" (default) takes "all_gather" when K >= EP (then nearly every token has a slot on
every shard, and all_to_all would send each token's row ~K/EP times to each shard, padded to the
worst case), else "all_to_all" -- or "ragged" on the platforms in `AUTO_RAGGED_PLATFORMS`, where
ragged replaces all_to_all (it sends a subset of all_to_all's rows). That tuple is empty: XLA's GPU
ragged all-to-all has known slow paths, so auto stays with the dense exchanges (docs/performance.md
lists the measurement that would change it). `use_mesh(..., expert_exchange=...)` /
`config.expert_parallel.exchange` pick one.

Overlap (`chunks=C`, `use_mesh(..., expert_chunks=C)`, `config.expert_parallel.chunks`): each device's
tokens are split into C contiguous chunks, each exchanged and computed on its own (a Python-unrolled
loop: C independent collectives and gmm groups, forward and backward), so that XLA's scheduler can
issue chunk i+1's exchange while chunk i's experts compute. The values do not change (dropless);
with a capacity factor each chunk has its own buffers (c x a chunk's balanced load). The overlap
itself only happens on GPU / TPU with the latency-hiding scheduler
(`--xla_gpu_enable_latency_hiding_scheduler=true`) and must be measured there; on CPU the chunks run
one after the other.

With expert axes of size 1 (data / fsdp / tensor layouts) every exchange collapses to the local
dispatch (chunks ignored): no collective, every device runs all experts on its own tokens (weights
are gathered from their FSDP shards at the shard_map boundary). Tensor parallelism inside the
experts: the hidden width F stays split over the tensor axis, the down projection gives partial
sums, `psum` over tensor adds them.

Buffer policy (`capacity`): the expert buffer holds C rows per pair (all_to_all) or M_buf rows per
shard (all_gather).
  * default, dropless: C = n * min(K, E_local), M_buf = EP * n * min(K, E_local) -- the most rows
    that can reach one shard when a token's K expert ids are distinct (every top-k router). Up to
    EP x the balanced size (memory-heavy, never drops).
  * `capacity_factor=c` (`use_mesh(..., expert_capacity_factor=c)`, `config.expert_parallel`):
    c x the balanced load, C = ceil(c * n * K / EP) and M_buf = ceil(c * n * K) (at most the
    dropless size). Only slots that carry a pick are rows (`slot_mask`: top-P's unused slots,
    SMoE-Dropout's beyond k(step) and expert choice's empty ones take no room and are never
    dropped). Rows past the buffer are dropped (they contribute zero, like a token the router
    did not pick; all_gather drops the last rows in (local expert, token, slot) order) and counted:
    `stats["dropped_rows"]` (global count), sown by the pools and the pre-mixing queries as
    `nnx.Intermediate` "ep_dropped_rows" (`expert_routes`), logged as `train/ep_dropped_rows`.
  * "ragged" sizes its receive buffer per shard like all_gather (same two formulas); only the rows
    that fit are sent.

"all_to_all" is the dense `jax.lax.all_to_all` (fixed-size chunks): it runs on every backend
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
from umoe_jax.parallel import exchange as exchange_lib
from umoe_jax.parallel import rules as ax
from umoe_jax.parallel.exchange import axis_arg
from umoe_jax.parallel.sharding import EXPERT_EXCHANGES as EXCHANGES
from umoe_jax.parallel.sharding import current_context, normalize_rules, shard_map

LocalFn = Callable[..., jax.Array]  # (rows [R, D], group_sizes [E_local], *weights) -> [R, D_out]


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


# Platforms on which "auto" takes "ragged" where it would take "all_to_all": none, as no measurement
# shows ragged faster (docs/performance.md); add "gpu" / "tpu" where one does.
AUTO_RAGGED_PLATFORMS: tuple[str, ...] = ()


def resolve_exchange(exchange: str, slots: int, ep: int, platform: str = "cpu") -> str:
  """The exchange `expert_map` runs: "local" when ep == 1 (no collective), "auto" -> "all_gather"
  when slots >= ep, else "ragged" on `AUTO_RAGGED_PLATFORMS` and "all_to_all" elsewhere; an
  explicit choice as given."""
  if exchange not in EXCHANGES:
    raise ValueError(f"expert-parallel exchange {exchange!r} must be one of {EXCHANGES}")
  if ep == 1:
    return "local"
  if exchange == "auto":
    if slots >= ep:
      return "all_gather"
    return "ragged" if platform in AUTO_RAGGED_PLATFORMS else "all_to_all"
  return exchange


def capacity(tokens_per_device: int, slots: int, ep: int, experts_per_shard: int,
             capacity_factor: Optional[float], exchange: str = "all_to_all") -> int:
  """Expert buffer rows (see the module docstring): per (sender, receiver) pair for "all_to_all",
  per shard (all EP senders) for "all_gather" and "ragged". With ep == 1 there is no exchange and
  nothing can be dropped: the device's own M = tokens * slots rows."""
  if ep == 1:
    return tokens_per_device * slots
  senders = ep if exchange in ("all_gather", "ragged") else 1
  dropless = senders * tokens_per_device * min(slots, experts_per_shard)
  if capacity_factor is None:
    return max(dropless, 1)
  balanced = senders * tokens_per_device * slots / ep
  return max(1, min(dropless, math.ceil(capacity_factor * balanced)))


def expert_map(x: jax.Array, expert_ids: jax.Array, gates: Optional[jax.Array],
               weights: Sequence[jax.Array], weight_axes: Sequence[Sequence[Optional[str]]],
               local_fn: LocalFn, *, num_experts: int, mesh: Optional[Mesh] = None,
               rules: Any = None, capacity_factor: Any = "context",
               exchange: str = "context", chunks: Any = "context",
               fused_local: Optional[Callable] = None,
               slot_mask: Optional[jax.Array] = None) -> tuple[jax.Array, dict]:
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
    exchange: "auto" | "all_to_all" | "all_gather" | "ragged" (module docstring); default from
      `use_mesh`.
    chunks: token chunks per device, each exchanged on its own (overlap; module docstring); must
      divide the tokens per device; default from `use_mesh`.
    fused_local: optional `(x, plan, gates, *local_weights) -> [n, D_out]`, the whole routed
      forward with the dispatch fused into the kernels; used instead of permute + local_fn +
      combine when nothing is exchanged (expert axis 1), gates are given and the hidden width is
      not split over tensor axes.
    slot_mask: [N, K] bool, the slots that carry a pick (None: all). The others (gate 0: top-P's
      unused slots, SMoE-Dropout's beyond k(step), expert choice's empty ones) are no rows: never
      sent, no buffer room, not counted as dropped; their output is zero (gates None: out[n, k]).
  Returns:
    (out, stats) with stats = {"dropped_rows": [] int32 (global), "capacity": buffer rows (per pair
    for all_to_all, per shard for all_gather / ragged; per chunk), "sent_rows": [batch shards, EP]
    int32, rows each device puts on the wire for each expert shard (itself included; summed over
    chunks; all_to_all: its padded chunks, all_gather: its token rows, zeros without exchange)};
    `resolve_exchange` tells which exchange ran.
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
  if chunks == "context":
    chunks = ctx.expert_chunks if ctx is not None else 1

  n, k = expert_ids.shape
  # Masked slots get the id E of no expert: every exchange's plan sorts them last, outside the groups.
  expert_ids = dispatch.mask_slots(expert_ids, slot_mask, num_experts)
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
  platform = mesh.devices.flat[0].platform
  strategy = resolve_exchange(exchange, k, ep, platform)
  chunks = 1 if strategy == "local" else int(chunks)
  if chunks < 1 or (n // shards) % chunks:
    raise ValueError(f"expert-parallel chunks={chunks} must be >= 1 and divide the {n // shards} "
                     f"tokens per device ({n} tokens over {shards} batch shards)")
  n_chunk = n // shards // chunks
  cap = capacity(n_chunk, k, ep, e_local, capacity_factor, strategy)
  impl = exchange_lib.ragged_impl(platform) if strategy == "ragged" else None
  slices = exchange_lib.ragged_slices() if strategy == "ragged" else None

  def weight_spec(names):
    spec = []
    for name in names:
      if name == ax.EXPERT and expert_axes:
        spec.append(axis_arg(expert_axes))
      elif name == ax.EXPERT_MLP and tensor_axes:
        spec.append(axis_arg(tensor_axes))
      else:
        spec.append(None)
    return P(*spec)

  bspec = axis_arg(batch_axes) if batch_axes else None
  x_spec = P(bspec, *([None] * (x.ndim - 1)))
  in_specs = (x_spec, P(bspec, None), P(bspec, None) if gates is not None else None,
              tuple(weight_spec(names) for names in weight_axes))
  fn = functools.partial(local_fn, tensor_axes=tensor_axes)

  def one_chunk(x_l, ids_l, gates_l, ws):
    """(y, rows dropped here, rows sent per expert shard [EP]) for one chunk of tokens."""
    sent = jnp.zeros((ep,), jnp.int32)
    if strategy == "all_gather":
      y, dropped = exchange_lib.all_gather_exchange(x_l, ids_l, gates_l, fn, ws, e_local=e_local,
                                        axes=expert_axes, cap=cap)
      sent = sent + math.prod(x_l.shape[:-1])
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
      elif strategy == "ragged":
        out, dropped, sent = exchange_lib.ragged_exchange(
            rows, plan.group_sizes, fn, ws, ep=ep, axes=expert_axes, cap=cap,
            tokens=ids_l.shape[0], impl=impl, slices=slices)
      else:
        expert_sorted = jnp.take(ids_l.reshape(-1).astype(jnp.int32), plan.order)
        out, dropped = exchange_lib.all_to_all_exchange(rows, expert_sorted, plan.group_sizes, fn, ws, ep=ep,
                                            axis=axis_arg(expert_axes), cap=cap)
        sent = sent + cap
      y = exchange_lib.to_tokens(out, plan, k, gates_l)                                   # [n, (K,) D_out]
    return y, dropped.astype(jnp.int32), sent.astype(jnp.int32)

  def per_device(x_l, ids_l, gates_l, ws):
    # Independent exchanges per chunk (unrolled), so the scheduler may overlap chunk i+1's
    # collectives with chunk i's expert matmuls.
    parts = [one_chunk(*(None if a is None else a[c * n_chunk:(c + 1) * n_chunk]
                         for a in (x_l, ids_l, gates_l)), ws) for c in range(chunks)]
    y = parts[0][0] if chunks == 1 else jnp.concatenate([p[0] for p in parts], axis=0)
    dropped = sum(p[1] for p in parts)
    sent = sum(p[2] for p in parts)
    if batch_axes:
      dropped = jax.lax.psum(dropped, axis_arg(batch_axes))
    return y, dropped.astype(jnp.int32), sent[None]

  out_spec = P(bspec, None) if gates is not None else P(bspec, None, None)
  out_specs = (out_spec, P(), P(bspec, None))
  if gates is None:
    run = shard_map(lambda a, b, w: per_device(a, b, None, w), mesh,
                     (in_specs[0], in_specs[1], in_specs[3]), out_specs)
    y, dropped, sent = run(x, expert_ids, tuple(weights))
  else:
    run = shard_map(per_device, mesh, in_specs, out_specs)
    y, dropped, sent = run(x, expert_ids, gates, tuple(weights))
  return y, {"dropped_rows": dropped, "capacity": cap, "sent_rows": sent}

