"""Token dispatch fused into the expert pool's first and last grouped matmuls.

`dispatch.apply_experts` moves rows with separate gathers: it writes the permuted copy of the tokens
[M, D] before the first matmul and the per-slot outputs [M, D] before the combine, and autodiff adds
two more [M, D] round trips backward. With M = N*K rows of width D (K = 15, D = 768 for UMoE-base) that
traffic costs as much as the expert matmuls themselves on an H200.
The two ops here give the same values and gradients while reading token rows straight from their
source inside the kernels (on backends with `GmmBackend.row_index`; elsewhere XLA does the gathers):

  gather_gmm(x, w, plan, K)        = gmm(permute(x, plan, K), w)                         -> [M, N]
  gmm_combine(h, w, plan, gates)   = combine(unpermute(gmm(h, w), plan), gates)         -> [N_tok, D]

Backward of gather_gmm: dw = tgmm(x[src], dy) with the gather in the kernel; dx = the fan-in of
gmm^T(dy, w) through the inverse permutation (a gather and a K-way sum). Backward of gmm_combine:
the per-row cotangent gate[r] * dout[token(r)] is never written: u = gmm^T(dout[token], w) is
computed once per row tile and gives dh = gate * u (scaled in the epilogue) and
dgate[r] = <dout[token(r)], y[r]> = <u[r], h[r]> (a row dot in the same epilogue), so the expert
outputs y [M, D] are neither kept for the backward nor read again; dw = tgmm(gate * h, dout[token])
with the gather in the kernel and the gate-scaled rows written by XLA (scaling the tiles inside the
kernel cost its tensor-core pipeline more than the extra pass). The two K-way fan-ins, combine's
gate-weighted sum and gather_gmm's input gradient, run as the backend's `gather_sum` kernel where
it has one (kernels/gmm/triton_fan_in.py), else as XLA's take + sum.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from umoe_jax.ops import epilogue
from umoe_jax.ops.dispatch import DispatchPlan, combine
from umoe_jax.ops.fp8 import DTYPE as FP8_DTYPE, TILE as FP8_TILE
from umoe_jax.ops.fp8_gmm import (fp8_backend, gradients, in_fp8, quantize, quantized_gmm,
                                  quantized_gmm_out, threshold_gmm)
from umoe_jax.ops.gmm import BACKENDS, resolve_backend
from umoe_jax.ops.row_index import raw_gmm, raw_tgmm
from umoe_jax.ops.varying import vary_like, varying_axes


def _fan_in(backend, rows: jax.Array, inverse: jax.Array, slots: int,
            gates: jax.Array | None = None) -> jax.Array:
  """rows [M, D] in expert order -> per source row [M / slots, D]: the sum over its slots (float32,
  weighted by gates [M / slots, slots] if given, as `dispatch.combine`), by the backend's
  `gather_sum` kernel where it has one."""
  if slots == 1 and gates is None:
    return jnp.take(rows, inverse, axis=0)
  index = inverse.reshape(-1, slots)                                                   # [N, K]
  if backend.gather_sum is not None:  # (the gates rounded to the rows' dtype, as `combine` takes them)
    return backend.gather_sum(rows, index, None if gates is None else gates.astype(rows.dtype))
  per_slot = jnp.take(rows, inverse, axis=0).reshape(-1, slots, rows.shape[-1])       # [N, K, D]
  if gates is not None:
    return combine(per_slot, gates)
  return per_slot.sum(axis=1, dtype=jnp.float32).astype(rows.dtype)


# ----------------------------------------------------------------------------------------------
# gather_gmm


@functools.lru_cache(maxsize=None)
def _gather_gmm_fn(backend_name: str, fan_out: int, slot_layout: tuple[int, int, int] | None = None):
  """fan_out: K for x [N, D] shared by a token's slots, 1 for one row per slot. slot_layout
  (S, first_slot, K): x is [N, S, D] flattened and slot k of token n reads row n*S + first_slot + k;
  the input gradient is zero at the other S - K slots (None: S = K, first_slot = 0)."""
  backend = BACKENDS.get(backend_name)

  @jax.custom_vjp
  def fn(x, rhs, gs, src, inverse):
    out = raw_gmm(backend, x, rhs, gs, transpose_rhs=False, out_dtype=x.dtype, lhs_index=src)
    return vary_like(out, varying_axes(x) | varying_axes(rhs))

  def fwd(x, rhs, gs, src, inverse):
    return fn(x, rhs, gs, src, inverse), (x, rhs, gs, src, inverse)

  def bwd(res, dout):
    x, rhs, gs, src, inverse = res
    dout = dout.astype(rhs.dtype)
    drows = raw_gmm(backend, dout, rhs, gs, transpose_rhs=True, out_dtype=x.dtype)   # [M, D]
    dx = _to_slot_layout(_fan_in(backend, drows, inverse, fan_out), slot_layout)
    drhs = raw_tgmm(backend, x, dout, gs, num_groups=rhs.shape[0], out_dtype=rhs.dtype,
                    lhs_index=src)
    return (vary_like(dx, varying_axes(x)), vary_like(drhs, varying_axes(rhs)), None, None, None)

  fn.defvjp(fwd, bwd)
  return fn


def _to_slot_layout(dx: jax.Array, slot_layout: tuple[int, int, int] | None) -> jax.Array:
  """The input gradient [N*K, D] of the slots read back into the [N*S, D] rows (zero at the slots
  not read; `_gather_gmm_fn`'s slot_layout); unchanged without a layout."""
  if slot_layout is None:
    return dx
  s, first, k = slot_layout
  dx = jnp.pad(dx.reshape(-1, k, dx.shape[-1]), ((0, 0), (first, s - first - k), (0, 0)))
  return dx.reshape(-1, dx.shape[-1])                                                    # [N*S, D]


@functools.lru_cache(maxsize=None)
def _fp8_gather_gmm_fn(backend_name: str, fan_out: int, slot_layout: tuple[int, int, int] | None = None,
                       quantize_out: str | None = None):
  """`_gather_gmm_fn` with FP8 operands (`umoe_jax.ops.fp8_gmm`). The token rows are quantised where
  they are (a row's tiles run along the row, so this equals quantising the gathered copy, at N
  source rows instead of M = N*K) and the FP8 gmm reads them and their scales through the sort
  order (`fp8_gmm.quantized_gmm` with an index; XLA gathers first for a backend without
  `row_index`), with no gathered copy of the rows (nor XLA's bounds selects of one). A forward
  whose contraction is short (`fp8_gmm.in_fp8`) is the bf16 form's product. Backward: fp8_gmm's
  gradients, the weight gradient's rows read through the sort order as the bf16 form's, the input
  gradient fanned in as `_gather_gmm_fn`'s. With `quantize_out` the op returns (out, q, scale),
  act(out)'s FP8 tiles too (`fp8_gmm.quantized_gmm_out`), whose cotangents it ignores: they are an
  operand of FP8 products, which pass no gradient to it."""
  backend = BACKENDS.get(backend_name)

  @jax.custom_vjp
  def fn(x, rhs, gs, src, inverse):
    axes = varying_axes(x) | varying_axes(rhs)
    if quantize_out is None:
      return vary_like(threshold_gmm(backend_name, x, rhs, gs, False, x.dtype, lhs_index=src), axes)
    if in_fp8(x.shape[1]):
      outs = quantized_gmm_out(backend_name, *quantize(backend_name, x), rhs, gs, x.dtype,
                               quantize_out, lhs_index=src)
    else:
      out = raw_gmm(backend, x, rhs, gs, transpose_rhs=False, out_dtype=x.dtype, lhs_index=src)
      outs = (out, *quantize(backend_name, epilogue.activate(quantize_out, out)))
    return tuple(vary_like(a, axes) for a in outs)

  def fwd(x, rhs, gs, src, inverse):
    return fn(x, rhs, gs, src, inverse), (x, rhs, gs, src, inverse)

  def bwd(res, dout):
    x, rhs, gs, src, inverse = res
    dout = dout if quantize_out is None else dout[0]
    drows, drhs = gradients(backend_name, x, rhs, gs, False, dout.astype(x.dtype), lhs_index=src)
    dx = _to_slot_layout(_fan_in(backend, drows, inverse, fan_out), slot_layout)
    return (vary_like(dx, varying_axes(x)), vary_like(drhs, varying_axes(rhs)), None, None, None)

  fn.defvjp(fwd, bwd)
  return fn


def gather_gmm(x: jax.Array, rhs: jax.Array, plan: DispatchPlan, slots: int, *,
               backend: str = "auto", first_slot: int = 0, fp8: bool = False,
               quantize_out: str | None = None):
  """`gmm(dispatch.permute(x, plan, slots), rhs, plan.group_sizes)` without the permuted copy.

  Args:
    x: [N, D] (every slot of a token reads its row) or [N, S, D] (one row per slot: slot k reads
      x[n, first_slot + k]; S = K unless the rows sit among others, as pre-mixing's routed mixed
      vectors after the always-on head's: S = 1 + K, first_slot = 1, read in place, no slice copy).
    rhs: [E, D, F].
    plan: `make_plan(expert_ids [N, K], E)`.
    slots: K.
    fp8: FP8 operands (train.precision=fp8): the rows quantised before they are gathered (or
      read through the sort order), then the backend's FP8 gmm (`_fp8_gather_gmm_fn`).
    quantize_out: with fp8, an activation name (`epilogue.FUSABLE_ACTIVATIONS`): the op also
      returns act(rows) in FP8 tiles, for `gmm_combine(..., quantized=)`.
  Returns:
    [M, F], rows in expert order (M = N*K); with `quantize_out`, (rows, (q [M, F] float8_e4m3fn,
    scale [M, ceil(F/128)] float32)).
  """
  layout = None
  if x.ndim == 3:
    per_token = x.shape[1]
    if first_slot < 0 or per_token < first_slot + slots:
      raise ValueError(f"gather_gmm wants x [N, D] or [N, {first_slot + slots}, D] (slots "
                       f"{first_slot}..{first_slot + slots - 1} read; more rows per token may "
                       f"follow); got {x.shape}")
    if (per_token, first_slot) != (slots, 0):
      layout = (per_token, first_slot, slots)
    x, fan_out = x.reshape(-1, x.shape[-1]), 1
  elif x.ndim == 2 and first_slot == 0:
    fan_out = slots
  else:
    raise ValueError(f"gather_gmm wants x [N, D] or [N, S, D] (first_slot={first_slot}); "
                     f"got {x.shape}")
  if rhs.ndim != 3 or rhs.shape[1] != x.shape[-1] or rhs.shape[0] != plan.group_sizes.shape[0]:
    raise ValueError(f"gather_gmm: rhs {rhs.shape} does not fit rows of width {x.shape[-1]} and "
                     f"{plan.group_sizes.shape[0]} groups")
  src = plan.order if fan_out == 1 else plan.order // fan_out  # the source row of each sorted row
  if layout is not None:
    src = (plan.order // slots) * layout[0] + first_slot + plan.order % slots
  if quantize_out is not None and (not fp8 or quantize_out not in epilogue.FUSABLE_ACTIVATIONS):
    raise ValueError(f"gather_gmm quantize_out={quantize_out!r}: FP8 only (fp8=True), one of "
                     f"{', '.join(epilogue.FUSABLE_ACTIVATIONS)}")
  if fp8:
    out = _fp8_gather_gmm_fn(fp8_backend(backend), fan_out, layout, quantize_out)(
        x, rhs.astype(x.dtype), plan.group_sizes, src, plan.inverse)
    return out if quantize_out is None else (out[0], out[1:])
  return _gather_gmm_fn(resolve_backend(backend), fan_out, layout)(
      x, rhs.astype(x.dtype), plan.group_sizes, src, plan.inverse)


# ----------------------------------------------------------------------------------------------
# gmm_combine


def _combine_vjp(backend, slots: int, product, gradients):
  """The differentiable `combine(unpermute(product(h, rhs, gs)), gates)` both gmm_combine forms
  share: product(h, rhs, gs) -> y_sorted [M, D]; gradients(h, rhs, gs, dout, token, gate_sorted)
  -> (dh, dgate_sorted [M], drhs) from the token rows' cotangent dout [N, D] (h's dtype), the sorted
  rows' tokens and their gates (float32). Only the inputs are kept: the backward needs no [M, D]
  expert outputs (module docstring). The op's last operand, `given` (None, or the product's
  operand already quantised: (q, scale)), goes to product as `given=`; it gets no gradient and is
  not kept."""

  @jax.custom_vjp
  def fn(h, rhs, gs, order, inverse, gates, given):
    mine = {} if given is None else {"given": given}
    y = _fan_in(backend, product(h, rhs, gs, **mine), inverse, slots, gates)              # [N, D]
    return vary_like(y, varying_axes(h) | varying_axes(rhs) | varying_axes(gates))

  def fwd(h, rhs, gs, order, inverse, gates, given):
    return fn(h, rhs, gs, order, inverse, gates, given), (h, rhs, gs, order, inverse, gates)

  def bwd(res, dout):
    h, rhs, gs, order, inverse, gates = res
    token = order // slots                                                                 # [M]
    gate_sorted = jnp.take(gates.reshape(-1), order).astype(h.dtype).astype(jnp.float32)   # [M]
    dh, dgate_sorted, drhs = gradients(h, rhs, gs, dout.astype(h.dtype), token, gate_sorted)
    dgates = jnp.take(dgate_sorted, inverse).reshape(gates.shape)                          # [N, K]
    return (vary_like(dh, varying_axes(h)), vary_like(drhs, varying_axes(rhs)), None, None, None,
            vary_like(dgates.astype(gates.dtype), varying_axes(gates)), None)

  fn.defvjp(fwd, bwd)
  return fn


def _operand(activation: str | None):
  return (lambda h: h) if activation is None else functools.partial(epilogue.activate, activation)


@functools.lru_cache(maxsize=None)
def _gmm_combine_fn(backend_name: str, slots: int, activation: str | None = None,
                    fuse_weight_rows: bool = False):
  """activation: h holds pre-activations z and the matmul's operand is act(z) (None: h itself).
  fuse_weight_rows: the weight gradient's gate-scaled operand rows come from the input-gradient
  matmul's epilogue (which loads h anyway) instead of their own XLA pass."""
  backend = BACKENDS.get(backend_name)
  operand = _operand(activation)

  def product(h, rhs, gs):
    return raw_gmm(backend, operand(h), rhs, gs, transpose_rhs=False, out_dtype=h.dtype)

  def gradients(h, rhs, gs, dout, token, gate_sorted):
    # With the activation: dz = gate * u * act'(z) and dgate = <u, act(z)> in the same epilogue.
    # The weight gradient reads pre-scaled rows hg = gate * act(z): scaling or activating tiles
    # inside its kernel, between their load and the tensor cores, costs it a quarter of its speed
    # (224 vs 302 TFLOP/s on an H200). They are written by this matmul's epilogue
    # (fuse_weight_rows) or by one XLA pass.
    grads = raw_gmm(backend, dout, rhs, gs, transpose_rhs=True, out_dtype=h.dtype,
                    lhs_index=token, row_scale=gate_sorted, row_dot=h, epi_act=activation,
                    scaled_rows=fuse_weight_rows)                                         # [M, F], [M]
    dh, dgate_sorted = grads[:2]
    hg = (grads[2] if fuse_weight_rows
          else epilogue.gate_scaled(h, gate_sorted, activation))                          # [M, F]
    drhs = raw_tgmm(backend, hg, dout, gs, num_groups=rhs.shape[0], out_dtype=rhs.dtype,
                    rhs_index=token)                                                      # [E, F, D]
    return dh, dgate_sorted, drhs

  return _combine_vjp(backend, slots, product, gradients)


@functools.lru_cache(maxsize=None)
def _fp8_gmm_combine_fn(backend_name: str, slots: int, activation: str | None = None):
  """`_gmm_combine_fn` with FP8 operands (`umoe_jax.ops.fp8_gmm`'s quantiser and raw gmm), the same
  algebra: u = dout[token] @ rhs[g].T from dout's N token rows quantised along D once (a row's tiles
  run along the row, so they are the per-slot rows' before the gate, which scales u instead) and
  read through the sort order, never the per-slot cotangent [M, D] (an FP8 gmm, unpermute and
  combine would quantise that whole copy); it gives dh = gate * u (* act'(z)) and
  dgate = <u, act(z)>; dw = tgmm(gate * act(z), dout[token]) in bf16, as the bf16 form's. Those
  elementwise passes run in XLA over the F-wide rows. A product whose contraction is short
  (`fp8_gmm.in_fp8`) takes bf16 operands, as the bf16 form's."""
  backend = BACKENDS.get(backend_name)
  operand = _operand(activation)

  def product(h, rhs, gs, given=None):
    if given is None:
      return threshold_gmm(backend_name, operand(h), rhs, gs, False, h.dtype)
    return quantized_gmm(backend_name, *given, rhs, gs, False, h.dtype)

  def gradients(h, rhs, gs, dout, token, gate_sorted):
    u = threshold_gmm(backend_name, dout, rhs, gs, True, jnp.float32, lhs_index=token)      # [M, F]
    dh, dgate_sorted = epilogue.row_dot_epilogue(u, gate_sorted, h, activation, h.dtype)
    hg = epilogue.gate_scaled(h, gate_sorted, activation)                                  # [M, F]
    return dh, dgate_sorted, raw_tgmm(backend, hg, dout, gs, num_groups=rhs.shape[0],
                                      out_dtype=rhs.dtype, rhs_index=token)               # [E, F, D]

  return _combine_vjp(backend, slots, product, gradients)


def gmm_combine(h: jax.Array, rhs: jax.Array, plan: DispatchPlan, gates: jax.Array, *,
                backend: str = "auto", activation: str | None = None,
                fuse_weight_rows: bool = False, fp8: bool = False, quantized=None) -> jax.Array:
  """`combine(unpermute(gmm(h, rhs, plan.group_sizes), plan), gates)`: the expert pool's last matmul,
  un-sort and gate-weighted sum over slots in one differentiable op. With `activation` (a
  FUSABLE_ACTIVATIONS name) h holds the pre-activations z and the op is the same with act(z) for h:
  the backward takes act'(z) in the input-gradient matmul's epilogue (on backends that fuse it,
  else XLA), so d act(z) is never written and act(z) is not kept (the forward and the weight
  gradient's gate-scaled operand recompute it in XLA passes they make anyway; under FP8 the forward
  reads `quantized` where given). With
  `fuse_weight_rows` (`moe.fuse_weight_rows`) that operand, gate * act(z), is written by the
  input-gradient matmul's epilogue instead (backends with `GmmBackend.scaled_row_dot`; act(z)
  rounded to h's dtype first, as the XLA pass has it; the Triton epilogue's sigmoid comes from
  tanh.approx, within 3.9e-6 of the exact sigmoid on an H200: `kernels.gmm.triton_gmm._sigmoid`).

  Args:
    h: [M, F] rows in expert order (pre-activations with `activation`).
    rhs: [E, F, D].
    plan: the plan that sorted the rows (expert ids [N, K]).
    gates: [N, K].
    fp8: FP8 operands in the two matmuls that take them (train.precision=fp8;
      `_fp8_gmm_combine_fn`; `fuse_weight_rows` does not apply).
    quantized: with fp8 and `activation`, the product's operand act(h) already in FP8 tiles,
      (q [M, F] float8_e4m3fn, scale [M, ceil(F/128)] float32), as `gather_gmm(...,
      quantize_out=activation)` returns it: read instead of quantising act(h) here. It gets no
      gradient.
  Returns:
    [N, D] in h.dtype (the K-way sum accumulated in float32).
  """
  n, k = gates.shape
  if h.ndim != 2 or h.shape[0] != n * k:
    raise ValueError(f"gmm_combine wants h [{n * k}, F] for gates {gates.shape}; got {h.shape}")
  if rhs.ndim != 3 or rhs.shape[1] != h.shape[1] or rhs.shape[0] != plan.group_sizes.shape[0]:
    raise ValueError(f"gmm_combine: rhs {rhs.shape} does not fit h {h.shape} and "
                     f"{plan.group_sizes.shape[0]} groups")
  if activation is not None and activation not in epilogue.FUSABLE_ACTIVATIONS:
    raise ValueError(f"gmm_combine activation={activation!r}; fusable: "
                     f"{', '.join(epilogue.FUSABLE_ACTIVATIONS)}")
  if quantized is not None:
    if activation is None:
      raise ValueError("gmm_combine quantized=...: the tiles of act(h) (gather_gmm's quantize_out), "
                       "so an activation is needed")
    want = ((h.shape, jnp.dtype(FP8_DTYPE)), ((h.shape[0], -(-h.shape[1] // FP8_TILE)),
                                              jnp.dtype(jnp.float32)))
    got = tuple((tuple(a.shape), jnp.dtype(a.dtype)) for a in quantized) if len(quantized) == 2 else ()
    if got != want:
      raise ValueError(f"gmm_combine quantized= must be (q float8_e4m3fn{list(h.shape)}, scale "
                       f"float32{list(want[1][0])}) for h {list(h.shape)}")
  if fp8:
    return _fp8_gmm_combine_fn(fp8_backend(backend), k, activation)(
        h, rhs.astype(h.dtype), plan.group_sizes, plan.order, plan.inverse, gates, quantized)
  if quantized is not None:
    raise ValueError("gmm_combine quantized=...: FP8 only (fp8=True)")
  return _gmm_combine_fn(resolve_backend(backend), k, activation, bool(fuse_weight_rows))(
      h, rhs.astype(h.dtype), plan.group_sizes, plan.order, plan.inverse, gates, None)
