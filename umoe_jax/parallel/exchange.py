"""The expert-parallel token exchanges, per device, that `expert_parallel.expert_map` runs inside its
shard_map: "ragged" (below), and the dense "all_to_all" / "all_gather" (at the end; described in
`expert_parallel`'s module docstring).

"ragged", the exact-size exchange: `jax.lax.ragged_all_to_all` of the routed rows. Per device (n tokens, K slots, M = n*K rows,
EP expert shards of E_local experts, D / D_out row widths in / out):

  1. the local dispatch sorts the device's M (token, slot) rows by global expert, so the rows for
     shard d form one contiguous run (`start[d]`, `total[d]` rows) -- the send buffer is the sorted
     rows themselves, no packing copy;
  2. one tiny `all_gather` of the per-(shard, local expert) row counts [EP, E_local] gives every
     device the global count matrix [EP src, EP dst, E_local]; from it each device computes, without
     any further collective, its send sizes, where its slices land on the receivers, its receive
     sizes and offsets, and the capacity cut (`ragged_layout`). (The textbook recipe sends the
     counts with an `all_to_all` and the receivers' offsets back with a second one; the all-gather is
     one latency instead of two and EP*E_local int32s per device.)
  3. `ragged_all_to_all` moves exactly the routed rows: one slice per peer, sender-major on the
     receiver; `receive_plan` reorders them by local expert with index arithmetic on the counts (no
     sort), the local experts run on the buffer with `gmm` (rows past sum(group_sizes) are padding:
     the kernels skip them and write zeros);
  4. the reverse `ragged_all_to_all` sends each output row back to the slot it came from.

$UMOE_RAGGED_SLICES=expert (read when tracing) sends one slice per (peer, local expert) instead,
with offsets that put the rows straight into local-expert order (`ragged_layout_by_expert`): no
reordering gathers over the receive buffer, forward or backward, for EP*E_local (mostly small)
transfers instead of EP. Which is faster depends on XLA's GPU ragged all-to-all (per-slice costs,
openxla/xla#46982); both are to be measured.

Rows on the wire per device and direction (balanced routing; all_to_all / all_gather for comparison):
    ragged      n*K rows in total, (EP-1)/EP of them off-device: exact, whatever the routing
    all_to_all  EP * n*min(K, E_local) rows (dense chunks padded to the dropless worst case)
    all_gather  (EP-1) * n token rows out and back (per-slot x or outputs: (EP-1) * n*K)
ragged sends a subset of dense all_to_all's rows (never more), and fewer than all_gather when
K < EP, or for per-slot inputs / outputs (the pre-mixing queries) at any K.

Static shapes: JAX needs a static receive buffer. Dropless (the default) it holds the worst case,
R = EP * n*min(K, E_local) rows (every sender's distinct-id rows all on this shard, as all_gather's
local buffer); only the real rows cross the links and only the real rows are multiplied (the gmm
kernels skip the padded tail), the tail costs its memory and a zero fill. With a capacity factor c
the buffer is R = ceil(c * n*K) rows (c x the balanced load); a receiver then takes each sender's
slice in sender order until R is full, the senders know the cut from the count matrix and send
only what fits; the rest (the tail of a sender's slice, i.e. its highest local experts) is dropped,
counted, and contributes zero.

Backends: XLA:CPU has no ragged-all-to-all (jax 0.10.2: "UNIMPLEMENTED: HLO opcode
ragged-all-to-all"), so on CPU (and wherever `ragged_impl` says "dense") `ragged_all_to_all` is
emulated with the same arguments: slices packed into [EP, S, D] (S = the largest possible slice), a
dense `all_to_all`, and a gather into the output at the received offsets. The emulation pins the
exchange's offsets and sizes in the CPU tests; the native collective runs on GPU / TPU.
`UMOE_RAGGED_ALL_TO_ALL=native|dense` (read when tracing) overrides the choice (tests/gpu compares
the two). On GPU, XLA's ragged all-to-all has slow paths (openxla/xla#33386: low NVLink utilisation
in the default mode; #46982: per-peer costs even for empty slices), which is why `auto` does not pick
it until it is measured (`expert_parallel.AUTO_RAGGED_PLATFORMS`).
"""
from __future__ import annotations

import os
from typing import Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp

from umoe_jax.ops import dispatch
from umoe_jax.ops.varying import varying_axes, vary_like

IMPL_ENV = "UMOE_RAGGED_ALL_TO_ALL"
SLICES_ENV = "UMOE_RAGGED_SLICES"
NATIVE_PLATFORMS = ("gpu", "tpu")


def ragged_impl(platform: str) -> str:
  """"native" (jax.lax.ragged_all_to_all) on GPU / TPU, "dense" (the emulation) elsewhere, unless
  $UMOE_RAGGED_ALL_TO_ALL says otherwise."""
  choice = os.environ.get(IMPL_ENV, "auto") or "auto"
  if choice not in ("auto", "native", "dense"):
    raise ValueError(f"{IMPL_ENV}={choice!r} must be auto, native or dense")
  if choice == "auto":
    return "native" if platform in NATIVE_PLATFORMS else "dense"
  return choice


def axis_arg(axes: Sequence[str]):
  """The axis-name argument of a collective over mesh axes `axes`: the name alone, or the tuple."""
  axes = tuple(axes)
  return axes[0] if len(axes) == 1 else axes


def _exclusive_cumsum(x: jax.Array, axis: int) -> jax.Array:
  return jnp.cumsum(x, axis=axis) - x


class RaggedLayout(NamedTuple):
  """One device's side of a ragged exchange (all [EP] int32 unless noted; d = receiver, s = sender).

  input_offsets[d]: start of my rows for d in my expert-sorted rows;  send_sizes[d]: rows I send.
  output_offsets[d]: where they land in d's receive buffer.
  recv_offsets[s], recv_sizes[s]: where sender s's rows lie in my buffer, how many.
  recv_counts [EP, E_local]: those rows per local expert.
  back_offsets[s]: where my outputs for s land in its rows (its input_offsets[me]).
  dropped []: my rows that did not fit their receiver's buffer.
  """
  input_offsets: jax.Array
  send_sizes: jax.Array
  output_offsets: jax.Array
  recv_offsets: jax.Array
  recv_sizes: jax.Array
  recv_counts: jax.Array
  back_offsets: jax.Array
  dropped: jax.Array


def ragged_layout(counts_all: jax.Array, me, cap: int) -> RaggedLayout:
  """Offsets and sizes for device `me` from the global counts.

  Args:
    counts_all: [EP src, EP dst, E_local] int, rows sender s has for local expert e of shard d
      (before any capacity cut).
    me: this device's shard index (an int or a traced scalar).
    cap: receive-buffer rows per device. Each receiver takes its senders' slices in sender order
      until `cap` rows; a sender's kept rows are the head of its slice (lowest local experts first).
  """
  counts_all, total, start, kept, kept_counts = _kept(counts_all, cap)
  landed = _exclusive_cumsum(kept, 0)                               # [S, D] offsets in the receiver
  return RaggedLayout(input_offsets=start[me], send_sizes=kept[me], output_offsets=landed[me],
                      recv_offsets=landed[:, me], recv_sizes=kept[:, me],
                      recv_counts=kept_counts[:, me], back_offsets=start[:, me],
                      dropped=jnp.sum(total[me] - kept[me]))


def _kept(counts_all: jax.Array, cap: int):
  """(counts [S, D, E_l], totals [S, D], sender offsets [S, D], kept [S, D], kept counts
  [S, D, E_l]) under the receive-buffer cut of `ragged_layout`."""
  counts_all = counts_all.astype(jnp.int32)
  total = counts_all.sum(-1)                                        # [S, D]
  start = _exclusive_cumsum(total, 1)                               # [S, D] offsets in the sender
  before = _exclusive_cumsum(total, 0)                              # [S, D] rows of earlier senders
  kept = jnp.clip(cap - before, 0, total)                           # [S, D]
  kept_counts = jnp.diff(jnp.minimum(jnp.cumsum(counts_all, -1), kept[..., None]), axis=-1,
                         prepend=0)                                 # [S, D, E_l]
  return counts_all, total, start, kept, kept_counts


def ragged_layout_by_expert(counts_all: jax.Array, me, cap: int) -> RaggedLayout:
  """`ragged_layout` with one slice per (peer, local expert) instead of per peer: the offsets put
  the received rows straight into local-expert-major order (inside an expert, senders in order), so
  the receiver needs no reordering. Same kept rows; the offset / size fields are [EP * E_local],
  slice d*E_local + e for (peer d, expert e); recv_counts as in `ragged_layout`."""
  counts_all, total, start, kept, kept_counts = _kept(counts_all, cap)
  sender_at = start[..., None] + _exclusive_cumsum(counts_all, -1)  # [S, D, E_l] in the sender
  group = kept_counts.sum(0)                                        # [D, E_l] rows per expert
  landed = (_exclusive_cumsum(group, 1)[None] +
            _exclusive_cumsum(kept_counts, 0))                      # [S, D, E_l] in the receiver
  flat = lambda a: a.reshape(-1)
  return RaggedLayout(input_offsets=flat(sender_at[me]), send_sizes=flat(kept_counts[me]),
                      output_offsets=flat(landed[me]), recv_offsets=flat(landed[:, me]),
                      recv_sizes=flat(kept_counts[:, me]), recv_counts=kept_counts[:, me],
                      back_offsets=flat(sender_at[:, me]), dropped=jnp.sum(total[me] - kept[me]))


def receive_plan(recv_counts: jax.Array, rows: int) -> dispatch.DispatchPlan:
  """The permutation of a receive buffer of `rows` rows from sender-major order (sender s's run,
  inside it local experts in order) to local-expert-major order (inside an expert, senders in
  order), by index arithmetic on recv_counts [EP, E_local] (sum <= rows); rows past the received
  ones stay in place. `dispatch.permute(buffer, plan, 1)` sorts, `unpermute` undoes it."""
  c = recv_counts.astype(jnp.int32)
  ep, e_local = c.shape
  sizes = c.sum(1)                                                  # [EP]
  s_start = _exclusive_cumsum(sizes, 0)                             # [EP]
  e_in_s = _exclusive_cumsum(c, 1)                                  # [EP, E_l] expert offset in s
  group = c.sum(0)                                                  # [E_l]
  g_start = _exclusive_cumsum(group, 0)                             # [E_l]
  s_in_e = _exclusive_cumsum(c, 0)                                  # [EP, E_l] sender offset in e
  total = group.sum()
  pos = jnp.arange(rows, dtype=jnp.int32)

  # inverse: sender-major row r -> expert-major position.
  s = jnp.minimum(jnp.sum(pos[:, None] >= (s_start + sizes)[None, :], 1), ep - 1)      # [R]
  u = pos - s_start[s]
  e = jnp.minimum(jnp.sum(u[:, None] >= (e_in_s + c)[s], 1), e_local - 1)             # [R]
  inverse = jnp.where(pos < total, g_start[e] + s_in_e[s, e] + u - e_in_s[s, e], pos)
  # order: expert-major position p -> sender-major row.
  e = jnp.minimum(jnp.sum(pos[:, None] >= (g_start + group)[None, :], 1), e_local - 1)  # [R]
  q = pos - g_start[e]
  s = jnp.minimum(jnp.sum(q[:, None] >= (s_in_e + c)[:, e].T, 1), ep - 1)              # [R]
  order = jnp.where(pos < total, s_start[s] + e_in_s[s, e] + q - s_in_e[s, e], pos)
  return dispatch.DispatchPlan(order=order.astype(jnp.int32), inverse=inverse.astype(jnp.int32),
                               group_sizes=group)


def _dense_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                             recv_sizes, *, axis, max_slice: int):
  """`jax.lax.ragged_all_to_all`'s contract (slice i goes to peer i // (N / EP); non-overlapping
  writes) with a dense all_to_all of [N, max_slice, ...] packed slices; max_slice >= every size."""
  n = send_sizes.shape[0]
  i = jnp.arange(max_slice, dtype=jnp.int32)
  src = jnp.clip(input_offsets[:, None] + i[None, :], 0, operand.shape[0] - 1)          # [N, S]
  valid = i[None, :] < send_sizes[:, None]
  packed = jnp.take(operand, src, axis=0)                                               # [N, S, .]
  packed = jnp.where(valid.reshape(valid.shape + (1,) * (operand.ndim - 1)), packed,
                     jnp.zeros((), operand.dtype))
  recv = jax.lax.all_to_all(packed, axis, 0, 0, tiled=True)                             # [N, S, .]
  landed = jax.lax.all_to_all(output_offsets, axis, 0, 0, tiled=True)  # [N] in my output
  r = jnp.arange(output.shape[0], dtype=jnp.int32)
  inside = (r[None, :] >= landed[:, None]) & (r[None, :] < (landed + recv_sizes)[:, None])  # [N, R]
  piece = jnp.argmax(inside, axis=0)
  hit = jnp.any(inside, axis=0)
  idx = piece * max_slice + jnp.clip(r - landed[piece], 0, max_slice - 1)
  got = jnp.take(recv.reshape((n * max_slice,) + recv.shape[2:]), idx, axis=0)
  return jnp.where(hit.reshape(hit.shape + (1,) * (output.ndim - 1)), got, output)


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                      axes: Sequence[str], impl: str, max_slice: int):
  """`jax.lax.ragged_all_to_all` over `axes` ("native") or its dense emulation ("dense")."""
  axis = axis_arg(axes)
  args = (input_offsets.astype(jnp.int32), send_sizes.astype(jnp.int32),
          output_offsets.astype(jnp.int32), recv_sizes.astype(jnp.int32))
  output = vary_like(output, varying_axes(operand))
  if impl == "native":
    return jax.lax.ragged_all_to_all(operand, output, *args, axis_name=axis)
  if impl != "dense":
    raise ValueError(f"ragged_all_to_all impl={impl!r} must be native or dense")
  return _dense_ragged_all_to_all(operand, output, *args, axis=axis, max_slice=max_slice)


def ragged_slices() -> str:
  """$UMOE_RAGGED_SLICES (read when tracing): "peer" (default; EP slices per ragged all-to-all, the
  receiver reorders rows by expert with `receive_plan`) or "expert" (EP * E_local slices that land
  in expert order: no reordering pass over the receive buffer, more, smaller transfers)."""
  choice = os.environ.get(SLICES_ENV, "peer") or "peer"
  if choice not in ("peer", "expert"):
    raise ValueError(f"{SLICES_ENV}={choice!r} must be peer or expert")
  return choice


def ragged_exchange(rows: jax.Array, group_sizes: jax.Array, local_fn: Callable, weights, *,
                    ep: int, axes: Sequence[str], cap: int, tokens: int, impl: str,
                    slices: str = "peer"):
  """Steps 2-4 of the module docstring for one device.

  Args:
    rows: [M, D] this device's (token, slot) rows sorted by global expert.
    group_sizes: [E] rows per global expert (E = EP * E_local); masked slots (sorted last, in no
      group) are never sent and come back zero.
    local_fn: `(rows [cap, D] by local expert, group_sizes [E_local], *weights) -> [cap, D_out]`.
    cap: receive-buffer rows.
    tokens: n, the tokens behind the M = n*K rows (distinct experts per token: a slice for one
      peer has at most n*min(K, E_local) rows, for one expert at most n; the dense emulation's
      slice size).
    slices: "peer" or "expert" (`ragged_slices`).
  Returns:
    (out [M, D_out] in `rows`' order, zero for dropped rows; dropped rows []; rows sent per
    shard [EP]).
  """
  m, d = rows.shape
  axis = axis_arg(axes)
  e_local = group_sizes.shape[0] // ep
  counts = group_sizes.reshape(ep, e_local).astype(jnp.int32)                  # [EP, E_l]
  with jax.named_scope("ep_ragged_counts"):
    counts_all = jax.lax.all_gather(counts, axis, axis=0)                      # [EP, EP, E_l]
  me = jax.lax.axis_index(axis)
  if slices == "expert":
    lay = ragged_layout_by_expert(counts_all, me, cap)
    slice_rows = max(1, min(tokens, cap))
  else:
    lay = ragged_layout(counts_all, me, cap)
    slice_rows = max(1, min(tokens * min(m // tokens, e_local), cap, m))
  with jax.named_scope("ep_ragged_all_to_all"):
    recv = ragged_all_to_all(rows, jnp.zeros((cap, d), rows.dtype), lay.input_offsets,
                             lay.send_sizes, lay.output_offsets, lay.recv_sizes, axes=axes,
                             impl=impl, max_slice=slice_rows)                  # [cap, D]
  if slices == "expert":   # already in local-expert order
    back = local_fn(recv, lay.recv_counts.sum(0), *weights)                   # [cap, D_out]
  else:
    plan = receive_plan(lay.recv_counts, cap)
    local_out = local_fn(dispatch.permute(recv, plan, 1), plan.group_sizes, *weights)
    back = dispatch.unpermute(local_out, plan)                                 # sender-major
  with jax.named_scope("ep_ragged_all_to_all"):
    out = ragged_all_to_all(back, jnp.zeros((m, back.shape[-1]), back.dtype), lay.recv_offsets,
                            lay.recv_sizes, lay.back_offsets, lay.send_sizes, axes=axes,
                            impl=impl, max_slice=slice_rows)                   # [M, D_out]
  return out, lay.dropped, lay.send_sizes.reshape(ep, -1).sum(1)


# ----------------------------------------------------------------------------------------------
# The dense exchanges ("all_to_all", "all_gather"; `expert_parallel`'s module docstring): fixed-size
# collectives that run on every backend, CPU included.


def fit_sizes(group_sizes: jax.Array, cap: int) -> jax.Array:
  """Group sizes [..., G] clipped (along the last axis, in order) so that they sum to <= cap."""
  return jnp.diff(jnp.minimum(jnp.cumsum(group_sizes, axis=-1), cap), axis=-1, prepend=0)


def to_tokens(out: jax.Array, plan: dispatch.DispatchPlan, slots: int,
               gates: Optional[jax.Array]) -> jax.Array:
  """Expert-sorted outputs [M, D_out] -> [M/K, K, D_out] in (token, slot) order, or with gates
  [M/K, K] their gate-weighted sum [M/K, D_out]."""
  with jax.named_scope("combine"):
    y = dispatch.unpermute(out, plan).reshape(-1, slots, out.shape[-1])
    return y if gates is None else dispatch.combine(y, gates)


def all_to_all_exchange(rows, expert_sorted, group_sizes, local_fn, weights, *, ep, axis, cap):
  """Steps 2-4 of "all_to_all" for one device: rows [M, D] sorted by global expert (expert_sorted
  [M]; id E = masked slots, last, not in group_sizes [E]) -> outputs [M, D_out] (same order;
  dropped and masked rows zero) and the number of dropped rows."""
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
  sent_counts = fit_sizes(counts, cap)                                             # [EP, E_l]

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

  # Masked slots (expert id E = EP * E_l, sorted last) were not sent: their dest is EP.
  real = expert_sorted < ep * e_local                                         # [M]
  dest = jnp.minimum(expert_sorted // e_local, ep - 1)                        # [M]
  pos = jnp.arange(m, dtype=jnp.int32) - start[dest]                          # [M]
  ok = real & (pos < cap)
  out = jnp.take(ret.reshape(ep * cap, -1), dest * cap + jnp.clip(pos, 0, cap - 1), axis=0)
  out = jnp.where(ok[:, None], out, 0).astype(local_out.dtype)                # [M, D_out]
  dropped = jnp.sum(jnp.maximum(send_total - cap, 0))
  return out, dropped


def all_gather_exchange(x, ids, gates, local_fn, weights, *, e_local, axes, cap):
  """"all_gather" for one device: its tokens x [n, D] or [n, K, D], ids [n, K], gates [n, K] or
  None -> (out [n, D_out] (gates None: [n, K, D_out]), number of rows this shard dropped)."""
  k = ids.shape[1]
  axis = axis_arg(axes)
  with jax.named_scope("ep_all_gather"):
    x_all = jax.lax.all_gather(x, axis, axis=0, tiled=True)                   # [EP*n, (K,) D]
    ids_all = jax.lax.all_gather(ids, axis, axis=0, tiled=True)               # [EP*n, K]
    gates_all = None if gates is None else jax.lax.all_gather(gates, axis, axis=0, tiled=True)
  # This shard's index, linearised over `axes` like the collectives and the weights' EXPERT dim.
  # Masked slots (id EP * E_l) are no shard's.
  shard = jax.lax.axis_index(axis)
  local = ids_all.astype(jnp.int32) - shard * e_local                         # [EP*n, K]
  mine = (local >= 0) & (local < e_local)
  plan = dispatch.make_plan(jnp.where(mine, local, e_local), e_local + 1)     # others sort last
  with jax.named_scope("dispatch"):
    rows = dispatch.permute(x_all, plan, k)                                   # [M = EP*n*K, D]
  m = rows.shape[0]
  cap = min(cap, m)
  sizes = fit_sizes(plan.group_sizes[:e_local], cap)                               # [E_l]
  kept = jnp.sum(sizes)
  out = local_fn(rows[:cap], sizes, *weights)                                 # [M_buf, D_out]
  # Rows past `kept` are other shards' slots, dropped rows or padding: local_fn may have left
  # anything there, so select (garbage * 0 can be NaN).
  out = jnp.pad(out, ((0, m - cap), (0, 0)))                                  # [M, D_out]
  out = jnp.where(jnp.arange(m)[:, None] < kept, out, jnp.zeros((), out.dtype))
  partial = to_tokens(out, plan, k, gates_all)                               # [EP*n, (K,) D_out]
  with jax.named_scope("ep_reduce_scatter"):
    y = jax.lax.psum_scatter(vary_like(partial, frozenset(axes)), axis, scatter_dimension=0,
                             tiled=True)                                      # [n, (K,) D_out]
  return y, jnp.sum(plan.group_sizes[:e_local]) - kept

