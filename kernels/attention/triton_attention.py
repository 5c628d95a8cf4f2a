"""Fused causal attention with one shared key head and wide values, in Triton (FlashAttention-2 style).

The pre-mixing attention core (UMoE): H query heads (always-on + routed) over one key head, values
= the normed hidden states X (D up to 2048 wide):

    out[b, t, h] = sum_{s <= t} softmax_s(q[b, t, h] . k[b, s] / sqrt(dk)) x[b, s]

Layout. The H heads of a position are consecutive rows of q [B, T, H, dk] viewed as [B, T*H, dk]
(row r is position r // H), so a tile of BM query rows covers BM / H positions and every head of
them, and all heads share one key/value tile load. The output is [B, T*H, D] the same way.

Kernels (grid axis 1 = batch; online softmax in float32, base-2 exponentials; scores only ever
live in registers; causal tiles past the diagonal are skipped; tiles that straddle it, the key
tile past T and the row tile past T*H are masked, the others are not):
  _fwd      program = (row tile, D chunk): out[rows, chunk], and lse[rows] (log2 of the softmax
            denominator, in base-2 units; written by chunk 0). The scores are recomputed per chunk
            (dk / chunk width more FLOPs): a whole D-wide float32 row accumulator does not fit.
  _bwd_dx   program = (key tile, D chunk): dX[keys, chunk] = sum_rows P^T dO[rows, chunk].
  _bwd_dk   program = key tile: dK[keys] = scale * sum_rows dS^T q, dS = P * (dO X^T - delta),
            dO X^T contracted over all of D in BDK-wide steps.
  _bwd_dq   program = row tile: dQ[rows] = scale * sum_keys dS k (the same dS, recomputed).
  _bwd_dxdk (optional, `FlashTiles.dxdk`) replaces _bwd_dx and _bwd_dk: program = (key tile, D
            chunk c) computes dX[keys, chunk] and, since dS is linear in dO X^T = sum_c dO_c X_c^T,
            chunk c's share of dK from the same P and dO_c tiles (shares summed by XLA). It reads
            each dO tile once for both and keeps X_c in registers, where _bwd_dk re-reads X[keys]
            across all of D for every row block.
  Stored scores (`FlashTiles.ds` / `dk_ds` / `dq_ds` / `dx_p`, the default): dQ, dK and dX need the
  same P and dS = P * (dO X^T - delta), and recomputing them costs a D-deep dO X^T contraction (dK,
  dQ) or the scores once per D chunk (dX). So
  _bwd_ds     program = one causal (row tile, key tile) pair, nothing accumulated across tiles:
              stores dS^T and P^T as key-major [B, T, T*H] arrays in the operands' dtype (the
              values the passes feed their tensor cores anyway; only entries of keys at or before
              the row's position are written, readers mask the rest), and then
  _bwd_dk_ds  program = key tile: dK[keys] = scale * dS^T q;
  _bwd_dq_ds  program = row tile: dQ[rows] = scale * dS[rows] k, a causal [BM, T] x [T, dk] product;
  _bwd_dx     with LOAD_P reads P^T instead of recomputing it.
  The arrays grow with T^2 (UMoE-base: 268 MB each in bf16), so they are stored only within
  `STORED_BYTES_LIMIT`; past it the passes recompute.
delta[r] = <dO[r], out[r]> (float32) is one XLA reduction before the backward kernels.

Chunk widths (D chunk, `bd`) may be two powers of two (256 + 128 = 384), like the grouped matmul's
column tiles; the key width dk is held as two exact pieces when it is a sum of two powers of two
(192 = 128 + 64; `tiles.key_pieces`), else padded to a power of two >= 16 inside the
kernels (masked loads).

The kernels themselves are in kernels/attention/triton_kernels.py; this module launches and composes
them. `premix_attention` is the differentiable JAX entry (jax.custom_vjp); `supported` says whether
the kernels take given arrays (callers fall back to XLA otherwise). Kernel launches go through
`_launch`, which tests replace by the Triton interpreter.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from kernels import triton_launch
from kernels.attention.tiles import (FlashTiles, PassTiles, default_tiles, dk_ds_launch, dk_launch,
                                     dq_ds_launch, dq_launch, ds_launch, dx_launch, fwd_launch,
                                     with_backward)
from kernels.attention.triton_kernels import LOG2E
from kernels.triton_base import HAVE_JAX_TRITON, HAVE_TRITON, default_backend_is_gpu, placeholder

if HAVE_JAX_TRITON:
  import jax_triton as jt

MAX_HEAD_DIM = 512  # a [BN, dk] key tile and [BM, dk] query tile must fit in shared memory


if HAVE_TRITON:
  from kernels.attention.triton_kernels import (_bwd_dk_ds_kernel, _bwd_dk_kernel, _bwd_dq_ds_kernel,
                                                         _bwd_dq_kernel, _bwd_ds_kernel, _bwd_dx_kernel,
                                                         _bwd_dxdk_kernel, _fwd_kernel)


# ----------------------------------------------------------------------------------------------
# JAX entry.


def _launch(kernel, grid, args, out_shape, **meta):
  """One kernel launch through jax-triton (replaced by the interpreter in the CPU tests)."""
  return jt.triton_call(*args, kernel=kernel, grid=grid, out_shape=out_shape, **meta,
                        **triton_launch.launch_kwargs())


def _meta(launch: dict, b: int):
  launch = dict(launch)
  return (launch.pop("grid0"), b), launch


def _forward(q, k, v, tiles: FlashTiles):
  """q [B, T, H, dk], k [B, T, dk], v [B, T, D] -> out [B, T, H, D] (q's dtype), lse [B, T*H]."""
  b, t, h, dk = q.shape
  d = v.shape[-1]
  grid, meta = _meta(fwd_launch(t, h, dk, d, tiles.fwd), b)
  out, lse = _launch(
      _fwd_kernel, grid, (q, k, v),
      [jax.ShapeDtypeStruct((b, t, h, d), q.dtype), jax.ShapeDtypeStruct((b, t * h), jnp.float32)],
      **_common(q, v), **meta)
  return out, lse


def _common(q, v) -> dict:
  _, t, h, dk = q.shape
  return dict(T=t, H=h, DK=dk, D=v.shape[-1], qk_scale=LOG2E / math.sqrt(dk))


def _bwd_dx(q, k, v, dout, lse, tiles: PassTiles, probs_t=None):
  """dX [B, T, D] (v's dtype); with `probs_t` (the stored P^T [B, T, T*H], `_bwd_ds`) P is read,
  not recomputed."""
  b, t, h, dk = q.shape
  grid, meta = _meta(dx_launch(t, h, dk, v.shape[-1], tiles), b)
  p = placeholder() if probs_t is None else probs_t
  return _launch(_bwd_dx_kernel, grid, (q, k, dout, lse, p), jax.ShapeDtypeStruct(v.shape, v.dtype),
                 LOAD_P=probs_t is not None, **_common(q, v), **meta)


def _bwd_dk(q, k, v, dout, lse, delta, tiles: PassTiles):
  """dK [B, T, dk] (k's dtype)."""
  b, t, h, dk = q.shape
  grid, meta = _meta(dk_launch(t, h, dk, v.shape[-1], tiles), b)
  return _launch(_bwd_dk_kernel, grid, (q, k, v, dout, lse, delta),
                 jax.ShapeDtypeStruct(k.shape, k.dtype), sm_scale=1 / math.sqrt(dk),
                 **_common(q, v), **meta)


def _bwd_ds(q, k, v, dout, lse, delta, tiles: PassTiles):
  """(dS^T, P^T) [B, T, T*H] in q's dtype from the pass over causal (row tile, key tile) pairs
  (key-major, entries past the diagonal unwritten)."""
  b, t, h, dk = q.shape
  grid, meta = _meta(ds_launch(t, h, dk, v.shape[-1], tiles), b)
  stored = jax.ShapeDtypeStruct((b, t, t * h), q.dtype)
  return tuple(_launch(_bwd_ds_kernel, grid, (q, k, v, dout, lse, delta), [stored, stored],
                       **_common(q, v), **meta))


def _bwd_dk_ds(ds_t, q, k, tiles: PassTiles):
  """dK [B, T, dk] (k's dtype) from the stored dS^T [B, T, T*H]."""
  b, t, h, dk = q.shape
  grid, meta = _meta(dk_ds_launch(t, h, dk, tiles), b)
  return _launch(_bwd_dk_ds_kernel, grid, (ds_t, q), jax.ShapeDtypeStruct(k.shape, k.dtype),
                 T=t, H=h, DK=dk, sm_scale=1 / math.sqrt(dk), **meta)


def _bwd_dq_ds(ds_t, q, k, tiles: PassTiles):
  """dQ [B, T, H, dk] (q's dtype) from the stored dS^T [B, T, T*H]."""
  b, t, h, dk = q.shape
  grid, meta = _meta(dq_ds_launch(t, h, dk, tiles), b)
  return _launch(_bwd_dq_ds_kernel, grid, (ds_t, k), jax.ShapeDtypeStruct(q.shape, q.dtype),
                 T=t, H=h, DK=dk, sm_scale=1 / math.sqrt(dk), **meta)


def _bwd_dq(q, k, v, dout, lse, delta, tiles: PassTiles):
  """dQ [B, T, H, dk] (q's dtype)."""
  b, t, h, dk = q.shape
  grid, meta = _meta(dq_launch(t, h, dk, v.shape[-1], tiles), b)
  return _launch(_bwd_dq_kernel, grid, (q, k, v, dout, lse, delta),
                 jax.ShapeDtypeStruct(q.shape, q.dtype), sm_scale=1 / math.sqrt(dk),
                 **_common(q, v), **meta)


def _bwd_dxdk(q, k, v, dout, lse, delta, tiles: PassTiles):
  """(dX [B, T, D] in v's dtype, dK [B, T, dk] in k's dtype) from the fused pass."""
  b, t, h, dk = q.shape
  grid, meta = _meta(dx_launch(t, h, dk, v.shape[-1], tiles, fused_dk=True), b)
  dx, parts = _launch(_bwd_dxdk_kernel, grid, (q, k, v, dout, lse, delta),
                      [jax.ShapeDtypeStruct(v.shape, v.dtype),
                       jax.ShapeDtypeStruct((b, meta["N_CHUNKS"], t, dk), jnp.float32)],
                      **_common(q, v), **meta)
  return dx, (parts.sum(axis=1) / math.sqrt(dk)).astype(k.dtype)


def _delta(out, dout):
  """delta [B, T*H] float32 = <dO[r], out[r]> per row."""
  b, t, h, _ = out.shape
  return jnp.einsum("bthd,bthd->bth", dout, out, preferred_element_type=jnp.float32).reshape(b, t * h)


# dS^T and P^T ([B, T, T*H] each, `FlashTiles.ds`) are stored only while both fit in this many
# bytes: they grow with T^2 (UMoE-base, B=32 T=1024 H=4 in bf16: 268 MB each).
STORED_BYTES_LIMIT = 2 << 30


def stores_scores(tiles: FlashTiles, q_shape, itemsize: int) -> bool:
  """Whether the backward stores dS^T and P^T for q [B, T, H, dk]: as `tiles` asks (`ds`), within
  STORED_BYTES_LIMIT."""
  b, t, h, _ = q_shape
  return tiles.ds is not None and 2 * b * t * t * h * itemsize <= STORED_BYTES_LIMIT


def _backward(q, k, v, out, lse, dout, tiles: FlashTiles):
  dout = dout.astype(q.dtype)
  delta = _delta(out, dout)
  if stores_scores(tiles, q.shape, q.dtype.itemsize):  # every gradient from the stored dS and P
    ds_t, p_t = _bwd_ds(q, k, v, dout, lse, delta, tiles.ds)
    return (_bwd_dq_ds(ds_t, q, k, tiles.dq_ds), _bwd_dk_ds(ds_t, q, k, tiles.dk_ds),
            _bwd_dx(q, k, v, dout, lse, tiles.dx_tiles(reads_p=True), probs_t=p_t))
  dq = _bwd_dq(q, k, v, dout, lse, delta, tiles.dq)
  if tiles.dxdk is not None:
    dx, dkey = _bwd_dxdk(q, k, v, dout, lse, delta, tiles.dxdk)
    return dq, dkey, dx
  return dq, _bwd_dk(q, k, v, dout, lse, delta, tiles.dk), _bwd_dx(q, k, v, dout, lse, tiles.dx)


@functools.lru_cache(maxsize=None)
def _differentiable(tiles: FlashTiles):
  """The custom-VJP core on `tiles`."""
  from umoe_jax.ops.varying import vary_like, varying_axes

  def typed_like(x, *refs):  # custom calls drop shard_map's varying-axes type: restore it
    return vary_like(x, frozenset().union(*(varying_axes(r) for r in refs)))

  @jax.custom_vjp
  def attend(q, k, v):
    return typed_like(_forward(q, k, v, tiles)[0], q, k, v)

  def fwd(q, k, v):
    out, lse = _forward(q, k, v, tiles)
    out = typed_like(out, q, k, v)
    return out, (q, k, v, out, lse)

  def bwd(res, dout):
    q, k, v, out, lse = res
    dq, dk, dv = _backward(q, k, v, out, lse, dout, tiles)
    return typed_like(dq, q), typed_like(dk, k), typed_like(dv, v)

  attend.defvjp(fwd, bwd)
  return attend


def premix_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, tiles: FlashTiles | None = None,
                     backward: str = "auto"):
  """Causal softmax(q k^T / sqrt(dk)) v with one key head shared by every query head.

  Args:
    q [B, T, H, dk]; k [B, T, dk]; v [B, T, D] (query t sees keys s <= t), same dtype.
    tiles: kernel tiles (default: `default_tiles(dk, D)`).
    backward: the backward's form over those tiles (`tiles.with_backward`): "auto" (the
      tiles' own), "recompute", "stored_pairs".
  Returns:
    [B, T, H, D] in q's dtype; differentiable in q, k, v.
  """
  b, t, h, dk = q.shape
  if k.shape != (b, t, dk) or v.shape[:2] != (b, t) or v.ndim != 3:
    raise ValueError(f"premix_attention wants q [B,T,H,dk], k [B,T,dk], v [B,T,D]; got "
                     f"{q.shape}, {k.shape}, {v.shape}")
  tiles = with_backward(tiles or default_tiles(dk, v.shape[-1]), backward, dk)
  return _differentiable(tiles)(q, k.astype(q.dtype), v.astype(q.dtype))


# Operand dtypes the kernels run in (a float32 tl.dot would be tf32: callers use XLA instead).
DTYPES = (jnp.bfloat16, jnp.float16)


def supported(q: jax.Array, k: jax.Array, v: jax.Array) -> bool:
  """Whether the kernels take q [B,T,H,dk], k [B,S,1,dk], v [B,S,1,D] here: a GPU with Triton and
  jax-triton, and `supported_shapes`."""
  return available() and supported_shapes(q, k, v)


def supported_shapes(q: jax.Array, k: jax.Array, v: jax.Array) -> bool:
  """Operands of one dtype in DTYPES, one key head, S == T, dk <= MAX_HEAD_DIM, and every offset
  within a sequence (row * width, T*H rows of D or dk) inside int32, as the kernels compute it."""
  return (q.dtype in DTYPES and k.dtype == q.dtype and v.dtype == q.dtype
          and q.ndim == k.ndim == v.ndim == 4 and k.shape[2] == 1 and v.shape[2] == 1
          and k.shape[1] == q.shape[1] == v.shape[1] and k.shape[-1] == q.shape[-1]
          and q.shape[-1] <= MAX_HEAD_DIM
          and q.shape[1] * q.shape[2] * max(v.shape[-1], q.shape[-1]) < 2**31)


available = default_backend_is_gpu  # (tests replace it to run the kernels in the interpreter)
