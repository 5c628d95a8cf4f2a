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
  Stored scores (optional, `FlashTiles.dq_ds` / `dx_p` / `ds`): dQ and dX need the same P and
  dS = P * (dO X^T - delta) that the dK pass builds, and recomputing them costs a D-deep dO X^T
  contraction (dQ) or the scores once per D chunk (dX). So the dK pass may store dS^T and P^T as
  key-major [B, T, T*H] arrays in the operands' dtype (the values the passes feed their tensor
  cores anyway; only entries of keys at or before the row's position are written, readers mask the
  rest), and then
  _bwd_dq_ds  program = row tile: dQ[rows] = scale * dS[rows] k, a causal [BM, T] x [T, dk] product;
  _bwd_dx     with LOAD_P reads P^T instead of recomputing it.
  With `ds`, _bwd_ds (program = one causal (row tile, key tile) pair, nothing accumulated across
  tiles) makes the two arrays instead of the dK pass, and _bwd_dk_ds (program = key tile) forms
  dK = scale * dS^T q from them. The arrays grow with T^2 (UMoE-base: 268 MB each in bf16), so they
  are stored only within `STORED_BYTES_LIMIT`; past it the passes recompute.
delta[r] = <dO[r], out[r]> (float32) is one XLA reduction before the backward kernels.

Chunk widths (D chunk, `bd`) may be two powers of two (256 + 128 = 384), like the grouped matmul's
column tiles; the key width dk is padded to a power of two >= 16 inside the kernels (masked loads).

`premix_attention` is the differentiable JAX entry (jax.custom_vjp); `supported` says whether the
kernels take given arrays (callers fall back to XLA otherwise). Kernel launches go through
`_launch`, which tests replace by the Triton interpreter.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from kernels.attention_tiles import (FlashTiles, PassTiles, default_tiles, dk_ds_launch, dk_launch,
                                     dq_ds_launch, dq_launch, ds_launch, dx_launch, fwd_launch,
                                     with_backward)
from kernels.triton_gmm import HAVE_JAX_TRITON, HAVE_TRITON, _placeholder, default_backend_is_gpu

if HAVE_TRITON:
  import triton
  import triton.language as tl
if HAVE_JAX_TRITON:
  import jax_triton as jt

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 512  # a [BN, dk] key tile and [BM, dk] query tile must fit in shared memory


# ----------------------------------------------------------------------------------------------
# Kernels.

if HAVE_TRITON:

  @triton.jit
  def _scores(q, k_ptrs, keys, pos, offs_dk, T, DK: tl.constexpr, qk_scale, MASK: tl.constexpr):
    """[BM, BN] base-2 scores of the row tile q [BM, DKP] against keys (masked past the diagonal
    and past T when MASK), and the key tile [BN, DKP] (reused by the dQ pass)."""
    if MASK:
      k = tl.load(k_ptrs, mask=(keys < T)[:, None] & (offs_dk < DK)[None, :], other=0.0)
    else:
      k = tl.load(k_ptrs, mask=(offs_dk < DK)[None, :], other=0.0)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    if MASK:
      s = tl.where((keys[None, :] <= pos[:, None]) & (keys < T)[None, :], s, float("-inf"))
    return s, k

  @triton.jit
  def _fwd_step(q, k_base, v_base, s0, offs_n, offs_dk, d1, d2, pos, m_i, l_i, acc1, acc2, T,
                DK: tl.constexpr, D: tl.constexpr, BD2: tl.constexpr, qk_scale,
                MASK: tl.constexpr):
    keys = s0 + offs_n
    s, _ = _scores(q, k_base + keys[:, None] * DK + offs_dk[None, :], keys, pos, offs_dk, T, DK,
                   qk_scale, MASK)
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p = p.to(v_base.dtype.element_ty)
    key_ok = keys < T
    v1 = tl.load(v_base + keys[:, None] * D + d1[None, :], mask=key_ok[:, None] & (d1 < D)[None, :],
                 other=0.0)
    acc1 = tl.dot(p, v1, acc1 * alpha[:, None])
    if BD2 > 0:
      v2 = tl.load(v_base + keys[:, None] * D + d2[None, :],
                   mask=key_ok[:, None] & (d2 < D)[None, :], other=0.0)
      acc2 = tl.dot(p, v2, acc2 * alpha[:, None])
    return m_new, l_i, acc1, acc2

  @triton.jit
  def _fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, T: tl.constexpr, H: tl.constexpr,
                  DK: tl.constexpr, D: tl.constexpr, qk_scale: tl.constexpr, DKP: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, BD1: tl.constexpr, BD2: tl.constexpr,
                  BD2S: tl.constexpr, N_ROW_TILES: tl.constexpr, N_CHUNKS: tl.constexpr):
    # q [B, T*H, DK], k [B, T, DK], v [B, T, D] -> o [B, T*H, D], lse [B, T*H] (base 2).
    pid, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    TH: tl.constexpr = T * H
    tile = N_ROW_TILES - 1 - pid // N_CHUNKS  # the longest rows (most keys) first
    c = pid % N_CHUNKS
    r0 = tile * BM
    rows = r0 + tl.arange(0, BM)
    row_ok = rows < TH
    pos = rows // H
    offs_dk = tl.arange(0, DKP)
    offs_n = tl.arange(0, BN)
    d1 = c * (BD1 + BD2) + tl.arange(0, BD1)
    d2 = c * (BD1 + BD2) + BD1 + tl.arange(0, BD2S)
    q = tl.load(q_ptr + b * (TH * DK) + rows[:, None] * DK + offs_dk[None, :],
                mask=row_ok[:, None] & (offs_dk < DK)[None, :], other=0.0)
    k_base = k_ptr + b * (T * DK)
    v_base = v_ptr + b * (T * D)
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    acc1 = tl.zeros((BM, BD1), tl.float32)
    acc2 = tl.zeros((BM, BD2S), tl.float32)
    pos_min = r0 // H
    pos_end = tl.minimum((r0 + BM - 1) // H, T - 1) + 1  # keys [0, pos_end) are seen by some row
    n_full = (pos_min + 1) // BN  # tiles every row of the tile sees whole
    for j in range(0, n_full):
      m_i, l_i, acc1, acc2 = _fwd_step(q, k_base, v_base, j * BN, offs_n, offs_dk, d1, d2, pos,
                                       m_i, l_i, acc1, acc2, T, DK, D, BD2, qk_scale, False)
    for j in range(n_full, tl.cdiv(pos_end, BN)):
      m_i, l_i, acc1, acc2 = _fwd_step(q, k_base, v_base, j * BN, offs_n, offs_dk, d1, d2, pos,
                                       m_i, l_i, acc1, acc2, T, DK, D, BD2, qk_scale, True)
    inv = 1.0 / l_i
    o_rows = o_ptr + b * (TH * D) + rows[:, None] * D
    tl.store(o_rows + d1[None, :], (acc1 * inv[:, None]).to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (d1 < D)[None, :])
    if BD2 > 0:
      tl.store(o_rows + d2[None, :], (acc2 * inv[:, None]).to(o_ptr.dtype.element_ty),
               mask=row_ok[:, None] & (d2 < D)[None, :])
    if c == 0:
      tl.store(lse_ptr + b * TH + rows, m_i + tl.math.log2(l_i), mask=row_ok)

  @triton.jit
  def _probs_t(k, q_base, lse_base, rows, keys, offs_dk, TH, T, H: tl.constexpr, DK: tl.constexpr,
               qk_scale, MASK: tl.constexpr):
    """Key-major passes: P^T [BN, BM] for the key tile k [BN, DKP] and query rows, and q [BM, DKP]."""
    if MASK:
      row_ok = rows < TH
      q = tl.load(q_base + rows[:, None] * DK + offs_dk[None, :],
                  mask=row_ok[:, None] & (offs_dk < DK)[None, :], other=0.0)
      lse = tl.load(lse_base + rows, mask=row_ok, other=0.0)
    else:
      q = tl.load(q_base + rows[:, None] * DK + offs_dk[None, :], mask=(offs_dk < DK)[None, :],
                  other=0.0)
      lse = tl.load(lse_base + rows)
    pt = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :])
    if MASK:
      pos = rows // H
      pt = tl.where((keys[:, None] <= pos[None, :]) & row_ok[None, :], pt, 0.0)
    return pt, q

  @triton.jit
  def _stored_t(base, rows, keys, TH, T, H: tl.constexpr, MASK: tl.constexpr):
    """A [BN keys, BM rows] tile of a key-major [T, T*H] array the dK pass stored (P^T or dS^T):
    zeros past the diagonal, past T and past T*H when MASK (the dK pass left those unwritten)."""
    key_ok = keys < T
    ptrs = base + keys.to(tl.int64)[:, None] * TH + rows[None, :]
    if MASK:
      ok = key_ok[:, None] & (rows < TH)[None, :] & (keys[:, None] <= (rows // H)[None, :])
    else:  # (rows past T*H: a reader's partial last row tile, which may run past the array's end)
      ok = key_ok[:, None] & (rows < TH)[None, :]
    return tl.load(ptrs, mask=ok, other=0.0)

  @triton.jit
  def _store_t(base, rows, keys, tile, TH, T):
    """`_stored_t`'s writer: a [BN keys, BM rows] tile into a key-major [T, T*H] array (the keys
    past T and rows past T*H left out)."""
    tl.store(base + keys.to(tl.int64)[:, None] * TH + rows[None, :], tile,
             mask=(keys < T)[:, None] & (rows < TH)[None, :])

  @triton.jit
  def _dx_step(k, q_base, lse_base, do_base, p_base, r, offs_m, keys, offs_dk, d1, d2, acc1, acc2,
               TH, T, H: tl.constexpr, DK: tl.constexpr, D: tl.constexpr, BD2: tl.constexpr,
               qk_scale, MASK: tl.constexpr, LOAD_P: tl.constexpr):
    rows = r + offs_m
    if LOAD_P:
      pt = _stored_t(p_base, rows, keys, TH, T, H, MASK)
    else:
      pt, _ = _probs_t(k, q_base, lse_base, rows, keys, offs_dk, TH, T, H, DK, qk_scale, MASK)
      pt = pt.to(do_base.dtype.element_ty)
    row_ok = rows < TH
    do1 = tl.load(do_base + rows[:, None] * D + d1[None, :],
                  mask=row_ok[:, None] & (d1 < D)[None, :], other=0.0)
    acc1 = tl.dot(pt, do1, acc1)
    if BD2 > 0:
      do2 = tl.load(do_base + rows[:, None] * D + d2[None, :],
                    mask=row_ok[:, None] & (d2 < D)[None, :], other=0.0)
      acc2 = tl.dot(pt, do2, acc2)
    return acc1, acc2

  @triton.jit
  def _row_blocks(s0, TH, H: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Key-major passes over the rows that see key tile [s0, s0 + BN): rows from s0 * H on; the
    first `n_diag` BM-blocks straddle the diagonal (masked), then `n_full` whole unmasked blocks,
    then at most one partial block (masked) up to T * H."""
    r_start = s0 * H
    n_diag = tl.cdiv(tl.minimum(BN * H, TH - r_start), BM)
    r_full = r_start + n_diag * BM
    n_full = tl.maximum(TH - r_full, 0) // BM
    r_tail = r_full + n_full * BM
    return r_start, n_diag, r_full, n_full, r_tail

  @triton.jit
  def _bwd_dx_kernel(q_ptr, k_ptr, do_ptr, lse_ptr, p_ptr, dx_ptr, T: tl.constexpr, H: tl.constexpr,
                     DK: tl.constexpr, D: tl.constexpr, qk_scale: tl.constexpr, DKP: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BD1: tl.constexpr, BD2: tl.constexpr,
                     BD2S: tl.constexpr, N_CHUNKS: tl.constexpr, LOAD_P: tl.constexpr = False):
    # dX [B, T, D] = sum over rows of P^T dO (values = X: its whole gradient through the mix);
    # P^T recomputed from q, k and lse, or with LOAD_P read from the dK pass's key-major copy.
    pid, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    TH: tl.constexpr = T * H
    s0 = (pid // N_CHUNKS) * BN  # the first key tiles see the most rows: they start first
    c = pid % N_CHUNKS
    keys = s0 + tl.arange(0, BN)
    key_ok = keys < T
    offs_m = tl.arange(0, BM)
    offs_dk = tl.arange(0, DKP)
    d1 = c * (BD1 + BD2) + tl.arange(0, BD1)
    d2 = c * (BD1 + BD2) + BD1 + tl.arange(0, BD2S)
    k = tl.load(k_ptr + b * (T * DK) + keys[:, None] * DK + offs_dk[None, :],
                mask=key_ok[:, None] & (offs_dk < DK)[None, :], other=0.0)
    q_base, lse_base, do_base = q_ptr + b * (TH * DK), lse_ptr + b * TH, do_ptr + b * (TH * D)
    p_base = p_ptr + b * (T * TH)
    acc1 = tl.zeros((BN, BD1), tl.float32)
    acc2 = tl.zeros((BN, BD2S), tl.float32)
    r_start, n_diag, r_full, n_full, r_tail = _row_blocks(s0, TH, H, BM, BN)
    for i in range(0, n_diag):
      acc1, acc2 = _dx_step(k, q_base, lse_base, do_base, p_base, r_start + i * BM, offs_m, keys,
                            offs_dk, d1, d2, acc1, acc2, TH, T, H, DK, D, BD2, qk_scale, True,
                            LOAD_P)
    for i in range(0, n_full):
      acc1, acc2 = _dx_step(k, q_base, lse_base, do_base, p_base, r_full + i * BM, offs_m, keys,
                            offs_dk, d1, d2, acc1, acc2, TH, T, H, DK, D, BD2, qk_scale, False,
                            LOAD_P)
    for r in range(r_tail, TH, BM):
      acc1, acc2 = _dx_step(k, q_base, lse_base, do_base, p_base, r, offs_m, keys, offs_dk,
                            d1, d2, acc1, acc2, TH, T, H, DK, D, BD2, qk_scale, True, LOAD_P)
    dx_rows = dx_ptr + b * (T * D) + keys[:, None] * D
    tl.store(dx_rows + d1[None, :], acc1.to(dx_ptr.dtype.element_ty),
             mask=key_ok[:, None] & (d1 < D)[None, :])
    if BD2 > 0:
      tl.store(dx_rows + d2[None, :], acc2.to(dx_ptr.dtype.element_ty),
               mask=key_ok[:, None] & (d2 < D)[None, :])

  @triton.jit
  def _dp(a_base, a_rows, a_ok, b_base, b_rows, b_ok, D: tl.constexpr, BDK: tl.constexpr,
          M: tl.constexpr, N: tl.constexpr):
    """[M, N] float32 = a[a_rows, :D] @ b[b_rows, :D]^T, contracted in BDK-wide steps."""
    acc = tl.zeros((M, N), tl.float32)
    offs_d = tl.arange(0, BDK)
    a_ptrs = a_base + a_rows[:, None] * D + offs_d[None, :]
    b_ptrs = b_base + b_rows[:, None] * D + offs_d[None, :]
    for d0 in range(0, D, BDK):
      if D % BDK == 0:
        a = tl.load(a_ptrs, mask=a_ok[:, None], other=0.0)
        bb = tl.load(b_ptrs, mask=b_ok[:, None], other=0.0)
      else:
        d_ok = (d0 + offs_d) < D
        a = tl.load(a_ptrs, mask=a_ok[:, None] & d_ok[None, :], other=0.0)
        bb = tl.load(b_ptrs, mask=b_ok[:, None] & d_ok[None, :], other=0.0)
      acc = tl.dot(a, tl.trans(bb), acc)
      a_ptrs += BDK
      b_ptrs += BDK
    return acc

  @triton.jit
  def _dk_step(k, q_base, lse_base, delta_base, do_base, x_base, ds_base, p_base, r, offs_m, keys,
               offs_dk, acc, TH, T, H: tl.constexpr, DK: tl.constexpr, D: tl.constexpr,
               BDK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, qk_scale, MASK: tl.constexpr,
               STORE_DS: tl.constexpr, STORE_P: tl.constexpr):
    rows = r + offs_m
    row_ok = rows < TH
    pt, q = _probs_t(k, q_base, lse_base, rows, keys, offs_dk, TH, T, H, DK, qk_scale, MASK)
    delta = tl.load(delta_base + rows, mask=row_ok, other=0.0)
    dpt = _dp(x_base, keys, keys < T, do_base, rows, row_ok, D, BDK, BN, BM)    # [BN, BM]
    dst = (pt * (dpt - delta[None, :])).to(q.dtype)
    # key-major [T, T*H] tiles for the dQ / dX passes (zeros past the diagonal)
    if STORE_DS:
      _store_t(ds_base, rows, keys, dst, TH, T)
    if STORE_P:
      _store_t(p_base, rows, keys, pt.to(q.dtype), TH, T)
    return tl.dot(dst, q, acc)

  @triton.jit
  def _bwd_dk_kernel(q_ptr, k_ptr, x_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, ds_ptr, p_ptr,
                     T: tl.constexpr, H: tl.constexpr, DK: tl.constexpr, D: tl.constexpr,
                     qk_scale: tl.constexpr, sm_scale: tl.constexpr, DKP: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BDK: tl.constexpr,
                     STORE_DS: tl.constexpr = False, STORE_P: tl.constexpr = False):
    # dK [B, T, DK]; with STORE_DS / STORE_P also dS^T / P^T [B, T, T*H] (key-major; only the
    # entries of keys s <= the row's position are written: readers mask the others).
    pid, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    TH: tl.constexpr = T * H
    s0 = pid * BN
    keys = s0 + tl.arange(0, BN)
    key_ok = keys < T
    offs_m = tl.arange(0, BM)
    offs_dk = tl.arange(0, DKP)
    k = tl.load(k_ptr + b * (T * DK) + keys[:, None] * DK + offs_dk[None, :],
                mask=key_ok[:, None] & (offs_dk < DK)[None, :], other=0.0)
    q_base, lse_base, delta_base = q_ptr + b * (TH * DK), lse_ptr + b * TH, delta_ptr + b * TH
    do_base, x_base = do_ptr + b * (TH * D), x_ptr + b * (T * D)
    ds_base, p_base = ds_ptr + b * (T * TH), p_ptr + b * (T * TH)
    acc = tl.zeros((BN, DKP), tl.float32)
    r_start, n_diag, r_full, n_full, r_tail = _row_blocks(s0, TH, H, BM, BN)
    for i in range(0, n_diag):
      acc = _dk_step(k, q_base, lse_base, delta_base, do_base, x_base, ds_base, p_base,
                     r_start + i * BM, offs_m, keys, offs_dk, acc, TH, T, H, DK, D, BDK, BM, BN,
                     qk_scale, True, STORE_DS, STORE_P)
    for i in range(0, n_full):
      acc = _dk_step(k, q_base, lse_base, delta_base, do_base, x_base, ds_base, p_base,
                     r_full + i * BM, offs_m, keys, offs_dk, acc, TH, T, H, DK, D, BDK, BM, BN,
                     qk_scale, False, STORE_DS, STORE_P)
    for r in range(r_tail, TH, BM):
      acc = _dk_step(k, q_base, lse_base, delta_base, do_base, x_base, ds_base, p_base, r, offs_m,
                     keys, offs_dk, acc, TH, T, H, DK, D, BDK, BM, BN, qk_scale, True, STORE_DS,
                     STORE_P)
    tl.store(dk_ptr + b * (T * DK) + keys[:, None] * DK + offs_dk[None, :],
             (acc * sm_scale).to(dk_ptr.dtype.element_ty),
             mask=key_ok[:, None] & (offs_dk < DK)[None, :])

  @triton.jit
  def _dxdk_step(k, x1, x2, q_base, lse_base, delta_base, do_base, r, offs_m, keys, offs_dk, d1, d2,
                 first_chunk, acc1, acc2, acc_dk, TH, T, H: tl.constexpr, DK: tl.constexpr,
                 D: tl.constexpr, BD2: tl.constexpr, qk_scale, MASK: tl.constexpr):
    rows = r + offs_m
    row_ok = rows < TH
    pt, q = _probs_t(k, q_base, lse_base, rows, keys, offs_dk, TH, T, H, DK, qk_scale, MASK)
    ptb = pt.to(do_base.dtype.element_ty)
    do1 = tl.load(do_base + rows[:, None] * D + d1[None, :],
                  mask=row_ok[:, None] & (d1 < D)[None, :], other=0.0)
    acc1 = tl.dot(ptb, do1, acc1)
    dpt = tl.dot(x1, tl.trans(do1))                  # this chunk's part of (dO X^T)^T [BN, BM]
    if BD2 > 0:
      do2 = tl.load(do_base + rows[:, None] * D + d2[None, :],
                    mask=row_ok[:, None] & (d2 < D)[None, :], other=0.0)
      acc2 = tl.dot(ptb, do2, acc2)
      dpt = tl.dot(x2, tl.trans(do2), dpt)
    delta = tl.load(delta_base + rows, mask=row_ok & first_chunk, other=0.0)
    acc_dk = tl.dot((pt * (dpt - delta[None, :])).to(q.dtype), q, acc_dk)
    return acc1, acc2, acc_dk

  @triton.jit
  def _bwd_dxdk_kernel(q_ptr, k_ptr, x_ptr, do_ptr, lse_ptr, delta_ptr, dx_ptr, dkp_ptr,
                       T: tl.constexpr, H: tl.constexpr, DK: tl.constexpr, D: tl.constexpr,
                       qk_scale: tl.constexpr, DKP: tl.constexpr, BM: tl.constexpr,
                       BN: tl.constexpr, BD1: tl.constexpr, BD2: tl.constexpr, BD2S: tl.constexpr,
                       N_CHUNKS: tl.constexpr):
    # Program (key tile, D chunk c): dX[keys, chunk] as _bwd_dx_kernel, and chunk c's share of
    # dK / scale, sum_rows (P * (dO_c X_c^T - [c == 0] delta))^T q, into dkp [B, C, T, DK] float32
    # (dS is linear in dO X^T, so the chunks' shares add up to dS^T q).
    pid, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    TH: tl.constexpr = T * H
    s0 = (pid // N_CHUNKS) * BN
    c = pid % N_CHUNKS
    keys = s0 + tl.arange(0, BN)
    key_ok = keys < T
    offs_m = tl.arange(0, BM)
    offs_dk = tl.arange(0, DKP)
    d1 = c * (BD1 + BD2) + tl.arange(0, BD1)
    d2 = c * (BD1 + BD2) + BD1 + tl.arange(0, BD2S)
    k = tl.load(k_ptr + b * (T * DK) + keys[:, None] * DK + offs_dk[None, :],
                mask=key_ok[:, None] & (offs_dk < DK)[None, :], other=0.0)
    x_rows = x_ptr + b * (T * D) + keys[:, None] * D
    x1 = tl.load(x_rows + d1[None, :], mask=key_ok[:, None] & (d1 < D)[None, :], other=0.0)
    if BD2 > 0:
      x2 = tl.load(x_rows + d2[None, :], mask=key_ok[:, None] & (d2 < D)[None, :], other=0.0)
    else:
      x2 = tl.zeros((BN, BD2S), x_ptr.dtype.element_ty)
    q_base, lse_base, delta_base = q_ptr + b * (TH * DK), lse_ptr + b * TH, delta_ptr + b * TH
    do_base = do_ptr + b * (TH * D)
    first_chunk = c == 0
    acc1 = tl.zeros((BN, BD1), tl.float32)
    acc2 = tl.zeros((BN, BD2S), tl.float32)
    acc_dk = tl.zeros((BN, DKP), tl.float32)
    r_start, n_diag, r_full, n_full, r_tail = _row_blocks(s0, TH, H, BM, BN)
    for i in range(0, n_diag):
      acc1, acc2, acc_dk = _dxdk_step(k, x1, x2, q_base, lse_base, delta_base, do_base,
                                      r_start + i * BM, offs_m, keys, offs_dk, d1, d2, first_chunk,
                                      acc1, acc2, acc_dk, TH, T, H, DK, D, BD2, qk_scale, True)
    for i in range(0, n_full):
      acc1, acc2, acc_dk = _dxdk_step(k, x1, x2, q_base, lse_base, delta_base, do_base,
                                      r_full + i * BM, offs_m, keys, offs_dk, d1, d2, first_chunk,
                                      acc1, acc2, acc_dk, TH, T, H, DK, D, BD2, qk_scale, False)
    for r in range(r_tail, TH, BM):
      acc1, acc2, acc_dk = _dxdk_step(k, x1, x2, q_base, lse_base, delta_base, do_base, r, offs_m,
                                      keys, offs_dk, d1, d2, first_chunk, acc1, acc2, acc_dk, TH, T,
                                      H, DK, D, BD2, qk_scale, True)
    dx_rows = dx_ptr + b * (T * D) + keys[:, None] * D
    tl.store(dx_rows + d1[None, :], acc1.to(dx_ptr.dtype.element_ty),
             mask=key_ok[:, None] & (d1 < D)[None, :])
    if BD2 > 0:
      tl.store(dx_rows + d2[None, :], acc2.to(dx_ptr.dtype.element_ty),
               mask=key_ok[:, None] & (d2 < D)[None, :])
    tl.store(dkp_ptr + (b * N_CHUNKS + c) * (T * DK) + keys[:, None] * DK + offs_dk[None, :], acc_dk,
             mask=key_ok[:, None] & (offs_dk < DK)[None, :])

  @triton.jit
  def _dq_step(q, k_base, x_base, do_base, s0, offs_n, offs_dk, rows, row_ok, pos, lse, delta, acc,
               T, DK: tl.constexpr, D: tl.constexpr, BDK: tl.constexpr, BM: tl.constexpr,
               BN: tl.constexpr, qk_scale, MASK: tl.constexpr):
    keys = s0 + offs_n
    s, k = _scores(q, k_base + keys[:, None] * DK + offs_dk[None, :], keys, pos, offs_dk, T, DK,
                   qk_scale, MASK)
    p = tl.math.exp2(s - lse[:, None])  # masked scores are -inf: p = 0
    dp = _dp(do_base, rows, row_ok, x_base, keys, keys < T, D, BDK, BM, BN)       # [BM, BN]
    ds = p * (dp - delta[:, None])
    return tl.dot(ds.to(k.dtype), k, acc)

  @triton.jit
  def _bwd_dq_kernel(q_ptr, k_ptr, x_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, T: tl.constexpr,
                     H: tl.constexpr, DK: tl.constexpr, D: tl.constexpr, qk_scale: tl.constexpr,
                     sm_scale: tl.constexpr, DKP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     BDK: tl.constexpr, N_ROW_TILES: tl.constexpr):
    pid, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    TH: tl.constexpr = T * H
    r0 = (N_ROW_TILES - 1 - pid) * BM
    rows = r0 + tl.arange(0, BM)
    row_ok = rows < TH
    pos = rows // H
    offs_dk = tl.arange(0, DKP)
    offs_n = tl.arange(0, BN)
    q = tl.load(q_ptr + b * (TH * DK) + rows[:, None] * DK + offs_dk[None, :],
                mask=row_ok[:, None] & (offs_dk < DK)[None, :], other=0.0)
    lse = tl.load(lse_ptr + b * TH + rows, mask=row_ok, other=0.0)
    delta = tl.load(delta_ptr + b * TH + rows, mask=row_ok, other=0.0)
    k_base, x_base, do_base = k_ptr + b * (T * DK), x_ptr + b * (T * D), do_ptr + b * (TH * D)
    acc = tl.zeros((BM, DKP), tl.float32)
    pos_end = tl.minimum((r0 + BM - 1) // H, T - 1) + 1
    n_full = (r0 // H + 1) // BN
    for j in range(0, n_full):
      acc = _dq_step(q, k_base, x_base, do_base, j * BN, offs_n, offs_dk, rows, row_ok, pos, lse,
                     delta, acc, T, DK, D, BDK, BM, BN, qk_scale, False)
    for j in range(n_full, tl.cdiv(pos_end, BN)):
      acc = _dq_step(q, k_base, x_base, do_base, j * BN, offs_n, offs_dk, rows, row_ok, pos, lse,
                     delta, acc, T, DK, D, BDK, BM, BN, qk_scale, True)
    tl.store(dq_ptr + b * (TH * DK) + rows[:, None] * DK + offs_dk[None, :],
             (acc * sm_scale).to(dq_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dk < DK)[None, :])


  @triton.jit
  def _bwd_ds_kernel(q_ptr, k_ptr, x_ptr, do_ptr, lse_ptr, delta_ptr, ds_ptr, p_ptr,
                     T: tl.constexpr, H: tl.constexpr, DK: tl.constexpr, D: tl.constexpr,
                     qk_scale: tl.constexpr, DKP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     BDK: tl.constexpr, N_KEY_TILES: tl.constexpr):
    # Program = (row tile, key tile): dS^T and P^T [BN, BM] of one causal tile pair into the
    # key-major [B, T, T*H] arrays (as the dK pass's STORE_DS / STORE_P), no accumulation across
    # tiles: a wide output tile with a D-deep dO X^T contraction, where the dK pass's per-key-tile
    # loop keeps its output tile small. Pairs wholly past the diagonal exit at once.
    pid, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    TH: tl.constexpr = T * H
    r0 = (pid // N_KEY_TILES) * BM
    s0 = (pid % N_KEY_TILES) * BN
    if s0 <= tl.minimum((r0 + BM - 1) // H, T - 1):
      rows = r0 + tl.arange(0, BM)
      row_ok = rows < TH
      keys = s0 + tl.arange(0, BN)
      offs_dk = tl.arange(0, DKP)
      k = tl.load(k_ptr + b * (T * DK) + keys[:, None] * DK + offs_dk[None, :],
                  mask=(keys < T)[:, None] & (offs_dk < DK)[None, :], other=0.0)
      # dO X^T first: P^T is not live across its D-deep loop (register pressure)
      dpt = _dp(x_ptr + b * (T * D), keys, keys < T, do_ptr + b * (TH * D), rows, row_ok, D, BDK,
                BN, BM)                                                                  # [BN, BM]
      pt, q = _probs_t(k, q_ptr + b * (TH * DK), lse_ptr + b * TH, rows, keys, offs_dk, TH, T, H,
                       DK, qk_scale, True)
      delta = tl.load(delta_ptr + b * TH + rows, mask=row_ok, other=0.0)
      _store_t(ds_ptr + b * (T * TH), rows, keys, (pt * (dpt - delta[None, :])).to(q.dtype), TH, T)
      _store_t(p_ptr + b * (T * TH), rows, keys, pt.to(q.dtype), TH, T)

  @triton.jit
  def _dk_ds_step(ds_base, q_base, r, offs_m, keys, offs_dk, acc, TH, T, H: tl.constexpr,
                  DK: tl.constexpr, MASK: tl.constexpr):
    rows = r + offs_m
    dst = _stored_t(ds_base, rows, keys, TH, T, H, MASK)                                # [BN, BM]
    q = tl.load(q_base + rows[:, None] * DK + offs_dk[None, :],
                mask=(rows < TH)[:, None] & (offs_dk < DK)[None, :], other=0.0)
    return tl.dot(dst, q, acc)

  @triton.jit
  def _bwd_dk_ds_kernel(ds_ptr, q_ptr, dk_ptr, T: tl.constexpr, H: tl.constexpr, DK: tl.constexpr,
                        sm_scale: tl.constexpr, DKP: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr):
    # dK[keys] = scale * sum_rows dS^T q from the stored dS^T (program = key tile).
    pid, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    TH: tl.constexpr = T * H
    s0 = pid * BN
    keys = s0 + tl.arange(0, BN)
    offs_m = tl.arange(0, BM)
    offs_dk = tl.arange(0, DKP)
    ds_base, q_base = ds_ptr + b * (T * TH), q_ptr + b * (TH * DK)
    acc = tl.zeros((BN, DKP), tl.float32)
    r_start, n_diag, r_full, n_full, r_tail = _row_blocks(s0, TH, H, BM, BN)
    for i in range(0, n_diag):
      acc = _dk_ds_step(ds_base, q_base, r_start + i * BM, offs_m, keys, offs_dk, acc, TH, T, H,
                        DK, True)
    for i in range(0, n_full):
      acc = _dk_ds_step(ds_base, q_base, r_full + i * BM, offs_m, keys, offs_dk, acc, TH, T, H,
                        DK, False)
    for r in range(r_tail, TH, BM):
      acc = _dk_ds_step(ds_base, q_base, r, offs_m, keys, offs_dk, acc, TH, T, H, DK, True)
    tl.store(dk_ptr + b * (T * DK) + keys[:, None] * DK + offs_dk[None, :],
             (acc * sm_scale).to(dk_ptr.dtype.element_ty),
             mask=(keys < T)[:, None] & (offs_dk < DK)[None, :])

  @triton.jit
  def _dq_ds_step(ds_base, k_base, rows, keys, offs_dk, acc, TH, T, H: tl.constexpr,
                  DK: tl.constexpr, MASK: tl.constexpr):
    dst = _stored_t(ds_base, rows, keys, TH, T, H, MASK)                                # [BN, BM]
    k = tl.load(k_base + keys[:, None] * DK + offs_dk[None, :],
                mask=(keys < T)[:, None] & (offs_dk < DK)[None, :], other=0.0)
    return tl.dot(tl.trans(dst), k, acc)

  @triton.jit
  def _bwd_dq_ds_kernel(ds_ptr, k_ptr, dq_ptr, T: tl.constexpr, H: tl.constexpr, DK: tl.constexpr,
                        sm_scale: tl.constexpr, DKP: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr, N_ROW_TILES: tl.constexpr):
    # dQ[rows] = scale * sum_keys dS k, dS read from the dK pass's key-major dS^T [B, T, T*H]
    # (no scores, no dO X^T: a causal [BM, T] x [T, dk] product).
    pid, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    TH: tl.constexpr = T * H
    r0 = (N_ROW_TILES - 1 - pid) * BM
    rows = r0 + tl.arange(0, BM)
    offs_dk = tl.arange(0, DKP)
    offs_n = tl.arange(0, BN)
    ds_base, k_base = ds_ptr + b * (T * TH), k_ptr + b * (T * DK)
    acc = tl.zeros((BM, DKP), tl.float32)
    pos_end = tl.minimum((r0 + BM - 1) // H, T - 1) + 1
    n_full = (r0 // H + 1) // BN
    for j in range(0, n_full):  # key tiles every row of the tile sees whole
      acc = _dq_ds_step(ds_base, k_base, rows, j * BN + offs_n, offs_dk, acc, TH, T, H, DK, False)
    for j in range(n_full, tl.cdiv(pos_end, BN)):
      acc = _dq_ds_step(ds_base, k_base, rows, j * BN + offs_n, offs_dk, acc, TH, T, H, DK, True)
    tl.store(dq_ptr + b * (TH * DK) + rows[:, None] * DK + offs_dk[None, :],
             (acc * sm_scale).to(dq_ptr.dtype.element_ty),
             mask=(rows < TH)[:, None] & (offs_dk < DK)[None, :])


# ----------------------------------------------------------------------------------------------
# JAX entry.


def _launch(kernel, grid, args, out_shape, **meta):
  """One kernel launch through jax-triton (replaced by the interpreter in the CPU tests)."""
  return jt.triton_call(*args, kernel=kernel, grid=grid, out_shape=out_shape, **meta)


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
  """dX [B, T, D] (v's dtype); with `probs_t` (the dK pass's P^T [B, T, T*H]) P is read, not
  recomputed."""
  b, t, h, dk = q.shape
  grid, meta = _meta(dx_launch(t, h, dk, v.shape[-1], tiles), b)
  p = _placeholder() if probs_t is None else probs_t
  return _launch(_bwd_dx_kernel, grid, (q, k, dout, lse, p), jax.ShapeDtypeStruct(v.shape, v.dtype),
                 LOAD_P=probs_t is not None, **_common(q, v), **meta)


def _bwd_dk(q, k, v, dout, lse, delta, tiles: PassTiles, *, store_ds=False, store_p=False):
  """dK [B, T, dk] (k's dtype); with `store_ds` / `store_p` returns (dK, dS^T, P^T), the two
  [B, T, T*H] in q's dtype (key-major; entries past the diagonal unwritten), else dK alone."""
  b, t, h, dk = q.shape
  grid, meta = _meta(dk_launch(t, h, dk, v.shape[-1], tiles), b)
  stored = lambda on: jax.ShapeDtypeStruct((b, t, t * h) if on else (1,), q.dtype)
  dkey, ds_t, p_t = _launch(
      _bwd_dk_kernel, grid, (q, k, v, dout, lse, delta),
      [jax.ShapeDtypeStruct(k.shape, k.dtype), stored(store_ds), stored(store_p)],
      sm_scale=1 / math.sqrt(dk), STORE_DS=store_ds, STORE_P=store_p, **_common(q, v), **meta)
  if not (store_ds or store_p):
    return dkey
  return dkey, ds_t if store_ds else None, p_t if store_p else None


def _bwd_ds(q, k, v, dout, lse, delta, tiles: PassTiles):
  """(dS^T, P^T) [B, T, T*H] in q's dtype from the pass over causal (row tile, key tile) pairs
  (key-major, entries past the diagonal unwritten, as `_bwd_dk`'s stores)."""
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
  """dQ [B, T, H, dk] (q's dtype) from the dK pass's dS^T [B, T, T*H]."""
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


# The dK pass stores dS^T / P^T ([B, T, T*H] each, `FlashTiles.dq_ds` / `dx_p`) only while both fit in
# this many bytes: they grow with T^2 (UMoE-base, B=32 T=1024 H=4 in bf16: 268 MB each).
STORED_BYTES_LIMIT = 2 << 30


def stores_probs(tiles: FlashTiles, q_shape, itemsize: int) -> tuple[bool, bool]:
  """(store dS^T for the dQ pass, store P^T for the dX pass) for q [B, T, H, dk]: as `tiles` asks,
  within STORED_BYTES_LIMIT."""
  b, t, h, _ = q_shape
  want_ds, want_p = tiles.dq_ds is not None, tiles.dx_p
  fits = (want_ds + want_p) * b * t * t * h * itemsize <= STORED_BYTES_LIMIT
  return want_ds and fits, want_p and fits


def _backward(q, k, v, out, lse, dout, tiles: FlashTiles):
  dout = dout.astype(q.dtype)
  delta = _delta(out, dout)
  store_ds, store_p = stores_probs(tiles, q.shape, q.dtype.itemsize)
  if tiles.ds is not None and store_ds and store_p:  # every gradient from the stored dS and P
    ds_t, p_t = _bwd_ds(q, k, v, dout, lse, delta, tiles.ds)
    return (_bwd_dq_ds(ds_t, q, k, tiles.dq_ds), _bwd_dk_ds(ds_t, q, k, tiles.dk_ds),
            _bwd_dx(q, k, v, dout, lse, tiles.dx_tiles(reads_p=True), probs_t=p_t))
  if store_ds or store_p:  # the dK pass keeps dS / P for the dQ / dX passes (no recomputation)
    dkey, ds_t, p_t = _bwd_dk(q, k, v, dout, lse, delta, tiles.dk, store_ds=store_ds,
                              store_p=store_p)
    dq = (_bwd_dq_ds(ds_t, q, k, tiles.dq_ds) if store_ds
          else _bwd_dq(q, k, v, dout, lse, delta, tiles.dq))
    return dq, dkey, _bwd_dx(q, k, v, dout, lse, tiles.dx_tiles(reads_p=store_p), probs_t=p_t)
  dq = _bwd_dq(q, k, v, dout, lse, delta, tiles.dq)
  if tiles.dxdk is not None:
    dx, dkey = _bwd_dxdk(q, k, v, dout, lse, delta, tiles.dxdk)
    return dq, dkey, dx
  return dq, _bwd_dk(q, k, v, dout, lse, delta, tiles.dk), _bwd_dx(q, k, v, dout, lse, tiles.dx)


@functools.lru_cache(maxsize=None)
def _differentiable(tiles: FlashTiles):
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
    backward: the backward's form over those tiles (`attention_tiles.with_backward`): "auto" (the
      tiles' own), "recompute", "stored", "stored_pairs".
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
