"""Grouped matmul kernels in Triton, called from JAX through jax-triton (backend "triton").

Three raw ops, matching `umoe_jax.ops.gmm.GmmBackend`:
  gmm      out[rows of g] = a[rows of g] @ w[g]        (a [M,K], w [G,K,N] -> [M,N])
  gmm^T    out[rows of g] = a[rows of g] @ w[g].T      (a [M,N], w [G,K,N] -> [M,K])  same kernel, strides swapped
  tgmm     out[g] = a[rows of g].T @ b[rows of g]      (a [M,K], b [M,N] -> [G,K,N])

Schedule (gmm): M is cut into *group-aligned* row tiles: group g owns cdiv(size_g, BM) tiles that start at
its first row, so a tile never mixes groups; the rows past sum(group_sizes) form one more segment whose
tiles just write zeros. Every program recomputes this schedule itself from group_sizes (a prefix sum over
at most a few hundred ints in registers), so no extra XLA launches run before the kernel. Grid =
(upper bound on row tiles) x (column tiles), column tile fastest so that the column tiles of one row tile
run together and its rows are read from HBM once; programs past the real tile count exit at once.

Output column tiles may be two power-of-two pieces (BN + BN2, e.g. 128 + 64 = 192) because Triton blocks
must be powers of two while the expert widths here (192, 768) are not.

gmm / gmm^T may also run on a persistent grid (`TileConfig.persistent`): a fixed number of programs
stride over the tiles.

tgmm: one program per (group, K tile, N tile) accumulating over the group's rows in BM-row chunks,
the groups in `tile_order`; rows outside the group are masked to zero in both operands; empty groups
write zeros. Its output tile's rows may be two pieces as well (BK + BK2): a 192 x 128 tile covers all
of a 192-wide expert's rows, so each step's rows of the other operand are loaded once for the whole K
side, not once a piece.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kernels import triton_launch
from kernels.gmm import tuning
from kernels.triton_base import HAVE_JAX_TRITON, HAVE_TRITON, gpu_available, placeholder, pow2_at_least, split_width
from umoe_jax.ops import epilogue

if HAVE_TRITON:
  import triton
  import triton.language as tl
if HAVE_JAX_TRITON:
  import jax_triton as jt


if HAVE_TRITON:

  @triton.jit
  def _sigmoid(x, FAST_SIGMOID: tl.constexpr):
    """Sigmoid of float32 x. FAST_SIGMOID (the bf16 kernels' GPU launches): 0.5 + 0.5 * tanh(x / 2)
    through the one-instruction `tanh.approx.f32` (sm_75 and later; on an H200 within 7.8e-6 of
    tanh over [-12, 12], the sigmoid within 3.9e-6), instead of `tl.sigmoid`'s exponential and
    reciprocal: two special-function ops an element that a matmul epilogue cannot hide. False,
    `tl.sigmoid`: for Triton's interpreter, which runs no inline PTX (the CPU tests' launches), and
    for the FP8 kernel's act(out) tiles, which stand in for XLA's activation
    (`triton_fp8_gmm.QUANTIZE_OUT`)."""
    if FAST_SIGMOID:
      t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x * 0.5],
                                    dtype=tl.float32, is_pure=True, pack=1)
      y = 0.5 * t + 0.5
    else:
      y = tl.sigmoid(x)
    return y

  @triton.jit
  def _act(x, ACT: tl.constexpr, FAST_SIGMOID: tl.constexpr = False):
    """An activation of float32 x: ACT 1 = SiLU, 2 = ReLU, 0 = identity (FUSED_ACTIVATIONS);
    FAST_SIGMOID as in `_sigmoid`."""
    if ACT == 1:
      y = x * _sigmoid(x, FAST_SIGMOID)
    elif ACT == 2:
      y = tl.maximum(x, 0.0)
    else:
      y = x
    return y

  @triton.jit
  def _act_grad(x, ACT: tl.constexpr, FAST_SIGMOID: tl.constexpr = False):
    """The activation's derivative at float32 x (ACT and FAST_SIGMOID as in `_act`). With
    FAST_SIGMOID the compiler shares one tanh with `_act`'s at the same x; `tl.sigmoid`'s
    exponential and divide come twice (the PTX of the SiLU epilogue: two of each an element)."""
    if ACT == 1:
      sig = _sigmoid(x, FAST_SIGMOID)
      y = sig * (1.0 + x * (1.0 - sig))
    elif ACT == 2:
      y = (x > 0.0).to(tl.float32)
    else:
      y = x * 0.0 + 1.0
    return y

  @triton.jit
  def _row_schedule(gs_ptr, M, G: tl.constexpr, GP: tl.constexpr, BM: tl.constexpr):
    """Group-aligned row tiles: per segment (G groups + the zero tail) its size, tiles and prefix sums."""
    offs_g = tl.arange(0, GP)
    sizes = tl.load(gs_ptr + offs_g, mask=offs_g < G, other=0)
    total = tl.sum(sizes, axis=0)
    sizes = tl.where(offs_g == G, tl.maximum(M - total, 0), sizes)  # the zero-output tail segment
    tiles = (sizes + BM - 1) // BM
    return offs_g, sizes, tiles, tl.cumsum(tiles, axis=0), tl.cumsum(sizes, axis=0)

  @triton.jit
  def _locate(pid_m, offs_g, sizes, tiles, cum_tiles, cum_sizes, BM: tl.constexpr):
    """(group, first row, end row) of row tile `pid_m`; group == G for the zero tail."""
    g = tl.sum((cum_tiles <= pid_m).to(tl.int32), axis=0)
    sel = offs_g == g
    seg_end = tl.sum(tl.where(sel, cum_sizes, 0), axis=0)
    seg_start = seg_end - tl.sum(tl.where(sel, sizes, 0), axis=0)
    first_tile = tl.sum(tl.where(sel, cum_tiles - tiles, 0), axis=0)
    row0 = seg_start + (pid_m - first_tile) * BM
    return g, row0, tl.minimum(seg_end, row0 + BM)

  @triton.jit
  def _scaled_rows(ds_ptr, d, z, scale, offs_m, offs_n, row_mask, NO: tl.constexpr,
                   EPI_ACT: tl.constexpr, FAST_SIGMOID: tl.constexpr):
    """ds[rows, cols] = act(d) (or d) rounded to d's dtype, times scale[row], in ds's dtype: the
    gate-scaled operand rows of gmm_combine's weight gradient, as its XLA pass makes them (with
    FAST_SIGMOID, act(d) within `_sigmoid`'s error of the pass's)."""
    if EPI_ACT != 0:
      a = _act(z, EPI_ACT, FAST_SIGMOID).to(d.dtype).to(tl.float32)
    else:
      a = z
    tl.store(ds_ptr + offs_m.to(tl.int64)[:, None] * NO + offs_n[None, :],
             (a * scale[:, None]).to(ds_ptr.dtype.element_ty),
             mask=row_mask[:, None] & (offs_n[None, :] < NO))

  @triton.jit
  def _gmm_tile(a_ptr, b_ptr, o_ptr, a_idx_ptr, scale_ptr, d_ptr, rd_ptr, ds_ptr, g, row0, row_end,
                pid_n, compute, M, KC: tl.constexpr, NO: tl.constexpr, s_bg: tl.constexpr,
                s_bk: tl.constexpr, s_bn: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                BN2: tl.constexpr, BK: tl.constexpr, A_INDEX: tl.constexpr, ROW_SCALE: tl.constexpr,
                ROW_DOT: tl.constexpr, EPI_ACT: tl.constexpr, SCALED_D: tl.constexpr,
                PREFETCH_D: tl.constexpr, FAST_SIGMOID: tl.constexpr):
    """One (row tile, column tile): out[row0:row_end, cols] = a[rows] @ b[g][:, cols] (zeros when
    not `compute`); a's rows come through `a_idx` when A_INDEX, output rows are scaled by
    `scale[row]` when ROW_SCALE; with ROW_DOT, rd[pid_n, row] = <unscaled out[row, cols], d[row, cols]>.
    EPI_ACT (with ROW_DOT): d holds pre-activations: the dot is taken with act(d) and the output
    (before the scale) is multiplied by act'(d) (gmm_combine's backward with the activation fused).
    SCALED_D (with ROW_DOT and ROW_SCALE): also ds[rows, cols] = act(d) (or d) * scale[row].
    PREFETCH_D (with ROW_DOT): d's tile is loaded before the contraction instead of after it, so
    its latency hides behind the matmul (the tile stays live through the loop; compiled for sm_90a
    at the surveyed tiles it took no more registers than the load after it). FAST_SIGMOID: SiLU's
    sigmoid through tanh.approx (`_sigmoid`)."""
    offs_m = row0 + tl.arange(0, BM)
    offs_k = tl.arange(0, BK)
    offs_n = pid_n * (BN + BN2) + tl.arange(0, BN)
    rows_ld = tl.minimum(offs_m, M - 1)  # rows past the tile's end are computed but never stored
    if A_INDEX:
      rows_ld = tl.load(a_idx_ptr + rows_ld)
    a_ptrs = a_ptr + rows_ld.to(tl.int64)[:, None] * KC + offs_k[None, :]
    b_base = b_ptr + g.to(tl.int64) * s_bg
    b_ptrs = b_base + offs_k[:, None] * s_bk + offs_n[None, :] * s_bn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if BN2 > 0:
      offs_n2 = pid_n * (BN + BN2) + BN + tl.arange(0, BN2)
      b2_ptrs = b_base + offs_k[:, None] * s_bk + offs_n2[None, :] * s_bn
      acc2 = tl.zeros((BM, BN2), dtype=tl.float32)
    if ROW_DOT and PREFETCH_D:  # (without it the program is as before: d is loaded after the loop)
      pre_mask = (offs_m < row_end)[:, None]
      pre_rows = d_ptr + offs_m.to(tl.int64)[:, None] * NO
      d = tl.load(pre_rows + offs_n[None, :], mask=pre_mask & (offs_n[None, :] < NO), other=0.0)
      if BN2 > 0:
        d2 = tl.load(pre_rows + offs_n2[None, :], mask=pre_mask & (offs_n2[None, :] < NO), other=0.0)

    if compute:
      for ks in range(0, (KC + BK - 1) // BK):
        k_mask = offs_k < KC - ks * BK
        if KC % BK == 0:
          a = tl.load(a_ptrs)
        else:
          a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
        if (KC % BK == 0) and (NO % (BN + BN2) == 0):
          b = tl.load(b_ptrs)
        else:
          b = tl.load(b_ptrs, mask=k_mask[:, None] & (offs_n[None, :] < NO), other=0.0)
        acc = tl.dot(a, b, acc)
        if BN2 > 0:
          if (KC % BK == 0) and (NO % (BN + BN2) == 0):
            b2 = tl.load(b2_ptrs)
          else:
            b2 = tl.load(b2_ptrs, mask=k_mask[:, None] & (offs_n2[None, :] < NO), other=0.0)
          acc2 = tl.dot(a, b2, acc2)
          b2_ptrs += BK * s_bk
        a_ptrs += BK
        b_ptrs += BK * s_bk

    row_mask = offs_m < row_end
    if ROW_SCALE:
      scale = tl.load(scale_ptr + offs_m, mask=row_mask, other=0.0).to(tl.float32)
    # Each column piece's epilogue, then its store, before the next piece's: the first piece's
    # result is not live through the second's epilogue (fewer registers at the peak).
    if ROW_DOT:  # per-row dot with another [M, NO] array, before the scale (dgates of gmm_combine)
      d_rows = d_ptr + offs_m.to(tl.int64)[:, None] * NO
      if not PREFETCH_D:
        d = tl.load(d_rows + offs_n[None, :], mask=row_mask[:, None] & (offs_n[None, :] < NO),
                    other=0.0)
      z = d.to(tl.float32)
      if EPI_ACT != 0:  # d holds pre-activations z: the dot with act(z), the output times act'(z)
        part = tl.sum(acc * _act(z, EPI_ACT, FAST_SIGMOID), axis=1)
        acc = acc * _act_grad(z, EPI_ACT, FAST_SIGMOID)
      else:
        part = tl.sum(acc * z, axis=1)
      if SCALED_D:
        _scaled_rows(ds_ptr, d, z, scale, offs_m, offs_n, row_mask, NO, EPI_ACT, FAST_SIGMOID)
    if ROW_SCALE:
      acc = acc * scale[:, None]
    o_ptrs = o_ptr + offs_m.to(tl.int64)[:, None] * NO + offs_n[None, :]
    tl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=row_mask[:, None] & (offs_n[None, :] < NO))
    if BN2 > 0:
      if ROW_DOT:
        if not PREFETCH_D:
          d2 = tl.load(d_rows + offs_n2[None, :], mask=row_mask[:, None] & (offs_n2[None, :] < NO),
                       other=0.0)
        z2 = d2.to(tl.float32)
        if EPI_ACT != 0:
          part += tl.sum(acc2 * _act(z2, EPI_ACT, FAST_SIGMOID), axis=1)
          acc2 = acc2 * _act_grad(z2, EPI_ACT, FAST_SIGMOID)
        else:
          part += tl.sum(acc2 * z2, axis=1)
        if SCALED_D:
          _scaled_rows(ds_ptr, d2, z2, scale, offs_m, offs_n2, row_mask, NO, EPI_ACT,
                       FAST_SIGMOID)
      if ROW_SCALE:
        acc2 = acc2 * scale[:, None]
      o2_ptrs = o_ptr + offs_m.to(tl.int64)[:, None] * NO + offs_n2[None, :]
      tl.store(o2_ptrs, acc2.to(o_ptr.dtype.element_ty),
               mask=row_mask[:, None] & (offs_n2[None, :] < NO))
    if ROW_DOT:
      tl.store(rd_ptr + pid_n * M + offs_m, part, mask=row_mask)

  @triton.jit
  def _gmm_kernel(a_ptr, b_ptr, gs_ptr, a_idx_ptr, scale_ptr, d_ptr, o_ptr, rd_ptr, ds_ptr,
                  M: tl.constexpr, KC: tl.constexpr, NO: tl.constexpr, G: tl.constexpr,
                  GP: tl.constexpr, s_bg: tl.constexpr, s_bk: tl.constexpr, s_bn: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, BN2: tl.constexpr, BK: tl.constexpr,
                  N_TILES: tl.constexpr, NUM_PROGS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
                  A_INDEX: tl.constexpr, ROW_SCALE: tl.constexpr, ROW_DOT: tl.constexpr,
                  EPI_ACT: tl.constexpr = 0, SCALED_D: tl.constexpr = False,
                  PREFETCH_D: tl.constexpr = False, FAST_SIGMOID: tl.constexpr = False):
    # out[M, NO] = a[M, KC] @ b[g][KC, NO]; b[g][k, n] at b_ptr + g*s_bg + k*s_bk + n*s_bn.
    pid = tl.program_id(0)
    offs_g, sizes, tiles, cum_tiles, cum_sizes = _row_schedule(gs_ptr, M, G, GP, BM)
    num_tiles = tl.sum(tiles, axis=0)
    if NUM_PROGS == 0:
      # One program per (row tile, column tile); column tile fastest so a row tile's programs run
      # together and its rows come from HBM once. Programs past the real tile count exit at once.
      pid_m = pid // N_TILES
      if pid_m < num_tiles:
        g, row0, row_end = _locate(pid_m, offs_g, sizes, tiles, cum_tiles, cum_sizes, BM)
        _gmm_tile(a_ptr, b_ptr, o_ptr, a_idx_ptr, scale_ptr, d_ptr, rd_ptr, ds_ptr,
                  tl.minimum(g, G - 1), row0, row_end, pid % N_TILES, g < G,
                  M, KC, NO, s_bg, s_bk, s_bn, BM, BN, BN2, BK, A_INDEX, ROW_SCALE, ROW_DOT,
                  EPI_ACT, SCALED_D, PREFETCH_D, FAST_SIGMOID)
    else:
      # Persistent: NUM_PROGS programs stride over the tiles. The flattened loop lets the software
      # pipeline prefetch the next tile's operands while this tile's epilogue stores.
      tail_tiles = tl.sum(tl.where(offs_g == G, tiles, 0), axis=0)
      work = (num_tiles - tail_tiles) * N_TILES
      for t in tl.range(pid, work, NUM_PROGS, flatten=True, warp_specialize=WARP_SPECIALIZE):
        g, row0, row_end = _locate(t // N_TILES, offs_g, sizes, tiles, cum_tiles, cum_sizes, BM)
        _gmm_tile(a_ptr, b_ptr, o_ptr, a_idx_ptr, scale_ptr, d_ptr, rd_ptr, ds_ptr,
                  g, row0, row_end, t % N_TILES, True,
                  M, KC, NO, s_bg, s_bk, s_bn, BM, BN, BN2, BK, A_INDEX, ROW_SCALE, ROW_DOT,
                  EPI_ACT, SCALED_D, PREFETCH_D, FAST_SIGMOID)
      for t in range(work + pid, num_tiles * N_TILES, NUM_PROGS):  # the zero tail
        g, row0, row_end = _locate(t // N_TILES, offs_g, sizes, tiles, cum_tiles, cum_sizes, BM)
        _gmm_tile(a_ptr, b_ptr, o_ptr, a_idx_ptr, scale_ptr, d_ptr, rd_ptr, ds_ptr,
                  tl.minimum(g, G - 1), row0, row_end, t % N_TILES, False,
                  M, KC, NO, s_bg, s_bk, s_bn, BM, BN, BN2, BK, A_INDEX, ROW_SCALE, ROW_DOT,
                  EPI_ACT, SCALED_D, PREFETCH_D, FAST_SIGMOID)

  @triton.jit
  def _tgmm_tile(a_ptr, b_ptr, gs_ptr, a_idx_ptr, b_idx_ptr, a_scale_ptr, order_ptr, o_ptr,
                 tile,
                 M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, G: tl.constexpr,
                 GP: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BK2: tl.constexpr,
                 BN: tl.constexpr, BN2: tl.constexpr, K_TILES: tl.constexpr,
                 N_TILES: tl.constexpr, A_INDEX: tl.constexpr, B_INDEX: tl.constexpr,
                 A_SCALE: tl.constexpr):
    """Output tile `tile` = (group slot, K tile, N tile), slot slowest: out[g][k tile, n tile]
    summed over the group's rows in BM-row steps, g = order[slot] (`tile_order`). The tile's rows
    may be two pieces BK + BK2 (e.g. all 192 rows of a 192-wide expert as 128 + 64, two
    accumulators sharing each step's b), or its columns BN + BN2, not both."""
    slot = tile // (K_TILES * N_TILES)
    rest = tile % (K_TILES * N_TILES)
    pid_k = rest // N_TILES
    pid_n = rest % N_TILES

    offs_g = tl.arange(0, GP)
    sizes = tl.load(gs_ptr + offs_g, mask=offs_g < G, other=0)
    g = tl.load(order_ptr + slot)
    cum = tl.cumsum(sizes, axis=0)
    sel = offs_g == g
    end = tl.minimum(tl.sum(tl.where(sel, cum, 0), axis=0), M)
    start = tl.minimum(end - tl.sum(tl.where(sel, sizes, 0), axis=0), end)

    offs_k = pid_k * (BK + BK2) + tl.arange(0, BK)
    offs_n = pid_n * (BN + BN2) + tl.arange(0, BN)
    offs_r = tl.arange(0, BM)
    acc = tl.zeros((BK, BN), dtype=tl.float32)
    if BK2 > 0:
      offs_k2 = pid_k * (BK + BK2) + BK + tl.arange(0, BK2)
      acc_k2 = tl.zeros((BK2, BN), dtype=tl.float32)
    if BN2 > 0:
      offs_n2 = pid_n * (BN + BN2) + BN + tl.arange(0, BN2)
      acc2 = tl.zeros((BK, BN2), dtype=tl.float32)
    steps = (end - start + BM - 1) // BM
    for s in range(0, steps):
      rows = start + s * BM + offs_r
      rmask = rows < end
      if A_INDEX:
        a_rows = tl.load(a_idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
      else:
        a_rows = rows.to(tl.int64)
      if B_INDEX:
        b_rows = tl.load(b_idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
      else:
        b_rows = rows.to(tl.int64)
      # A K tile spans BK + BK2 rows of the output: only a K that is not a multiple of that masks.
      if K % (BK + BK2) == 0:
        a = tl.load(a_ptr + a_rows[:, None] * K + offs_k[None, :], mask=rmask[:, None], other=0.0)
      else:
        a = tl.load(a_ptr + a_rows[:, None] * K + offs_k[None, :],
                    mask=rmask[:, None] & (offs_k[None, :] < K), other=0.0)
      if A_SCALE:
        a_scale = tl.load(a_scale_ptr + rows, mask=rmask, other=0.0)
        a = (a.to(tl.float32) * a_scale[:, None]).to(a_ptr.dtype.element_ty)
      if BK2 > 0:
        if K % (BK + BK2) == 0:
          a2 = tl.load(a_ptr + a_rows[:, None] * K + offs_k2[None, :], mask=rmask[:, None],
                       other=0.0)
        else:
          a2 = tl.load(a_ptr + a_rows[:, None] * K + offs_k2[None, :],
                       mask=rmask[:, None] & (offs_k2[None, :] < K), other=0.0)
        if A_SCALE:
          a2 = (a2.to(tl.float32) * a_scale[:, None]).to(a_ptr.dtype.element_ty)
      if N % (BN + BN2) == 0:
        b = tl.load(b_ptr + b_rows[:, None] * N + offs_n[None, :], mask=rmask[:, None], other=0.0)
      else:
        b = tl.load(b_ptr + b_rows[:, None] * N + offs_n[None, :],
                    mask=rmask[:, None] & (offs_n[None, :] < N), other=0.0)
      at = tl.trans(a)
      acc = tl.dot(at, b, acc)
      if BK2 > 0:
        acc_k2 = tl.dot(tl.trans(a2), b, acc_k2)
      if BN2 > 0:
        if N % (BN + BN2) == 0:
          b2 = tl.load(b_ptr + b_rows[:, None] * N + offs_n2[None, :], mask=rmask[:, None], other=0.0)
        else:
          b2 = tl.load(b_ptr + b_rows[:, None] * N + offs_n2[None, :],
                       mask=rmask[:, None] & (offs_n2[None, :] < N), other=0.0)
        acc2 = tl.dot(at, b2, acc2)

    o_base = o_ptr + g.to(tl.int64) * (K * N)
    kmask = offs_k < K
    tl.store(o_base + offs_k[:, None] * N + offs_n[None, :], acc.to(o_ptr.dtype.element_ty),
             mask=kmask[:, None] & (offs_n[None, :] < N))
    if BN2 > 0:
      tl.store(o_base + offs_k[:, None] * N + offs_n2[None, :], acc2.to(o_ptr.dtype.element_ty),
               mask=kmask[:, None] & (offs_n2[None, :] < N))
    if BK2 > 0:
      tl.store(o_base + offs_k2[:, None] * N + offs_n[None, :], acc_k2.to(o_ptr.dtype.element_ty),
               mask=(offs_k2 < K)[:, None] & (offs_n[None, :] < N))

  @triton.jit
  def _tgmm_kernel(a_ptr, b_ptr, gs_ptr, a_idx_ptr, b_idx_ptr, a_scale_ptr, order_ptr, o_ptr,
                   M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, G: tl.constexpr,
                   GP: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BK2: tl.constexpr,
                   BN: tl.constexpr, BN2: tl.constexpr, K_TILES: tl.constexpr,
                   N_TILES: tl.constexpr, A_INDEX: tl.constexpr, B_INDEX: tl.constexpr,
                   A_SCALE: tl.constexpr):
    # out[g] = a[rows of g].T @ b[rows of g]; a [M, K], b [M, N], out [G, K, N]; with A_INDEX /
    # B_INDEX row r of a / b is read at a_idx[r] / b_idx[r]; with A_SCALE row r of a is multiplied
    # by a_scale[r] (float32, rounded back to a's dtype: the same values as a pre-scaled copy).
    # One program per output tile; the tiles of group order[slot] run in slot `slot` (`tile_order`).
    _tgmm_tile(a_ptr, b_ptr, gs_ptr, a_idx_ptr, b_idx_ptr, a_scale_ptr, order_ptr, o_ptr,
               tl.program_id(0), M, K, N, G, GP, BM, BK, BK2, BN, BN2, K_TILES, N_TILES, A_INDEX,
               B_INDEX, A_SCALE)


# ----------------------------------------------------------------------------------------------
# Launch geometry (pure Python: tested on CPU).

# The weight gradient's output tiles run largest groups first in a call whose largest group holds
# at least this many times the mean group's rows (`tile_order`), else in group order.
TGMM_BIG_FIRST_SKEW = 2


def gmm_launch(m: int, kc: int, no: int, g: int, cfg: tuning.TileConfig,
               num_sms: int = 132) -> dict:
  bn, bn2 = split_width(cfg.bn)
  n_tiles = -(-no // cfg.bn)
  m_tiles = -(-m // cfg.bm) + g + 1  # group-aligned tiles never exceed this (tail segment included)
  programs = m_tiles * n_tiles
  num_progs = min(cfg.persistent * num_sms, programs) if cfg.persistent else 0
  return dict(grid=(num_progs or programs,), BM=cfg.bm, BN=bn, BN2=bn2, BK=cfg.bk, N_TILES=n_tiles,
              GP=pow2_at_least(g + 1), NUM_PROGS=num_progs, WARP_SPECIALIZE=cfg.warp_specialize,
              PREFETCH_D=cfg.prefetch_row_dot, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def tgmm_launch(m: int, k: int, n: int, g: int, cfg: tuning.TileConfig) -> dict:
  # cfg.bm: output tile rows (over K); cfg.bn: output tile cols (over N); cfg.bk: rows per step.
  # Either side may be two powers of two (192 = 128 + 64), not both (four accumulators).
  if cfg.persistent:
    raise ValueError(f"tgmm tile {cfg}: the weight gradient runs one program a tile (persistent "
                     "grids are for gmm / gmm_t)")
  bk, bk2 = split_width(cfg.bm)
  bn, bn2 = split_width(cfg.bn)
  if bk2 and bn2:
    raise ValueError(f"tgmm tile {cfg.bm} x {cfg.bn}: at most one side may be a sum of two powers "
                     "of two")
  k_tiles = -(-k // cfg.bm)
  n_tiles = -(-n // cfg.bn)
  return dict(grid=(g * k_tiles * n_tiles,), BK=bk, BK2=bk2, BN=bn, BN2=bn2, BM=cfg.bk,
              K_TILES=k_tiles, N_TILES=n_tiles, GP=pow2_at_least(g), num_warps=cfg.num_warps,
              num_stages=cfg.num_stages)


def tile_order(group_sizes: jax.Array, num_groups: int, skew: int) -> jax.Array:
  """The weight gradient's tile order, [num_groups] int32: the group whose tiles run in slot s.
  Largest groups first (ties by index) where the largest group holds at least `skew` (>= 1) times
  the mean group's rows, else group order. A tile's time grows with its group's rows and programs
  start in id order: under skewed routing, starting the long tiles first leaves the short ones to
  fill the last wave (longest-first list scheduling) instead of a long one running alone at the
  end; balanced groups have no long tail to move. group_sizes [G]: missing groups count as empty."""
  if isinstance(skew, bool) or not isinstance(skew, int) or skew < 1:
    raise ValueError(f"tgmm tile order skew={skew!r}: a whole ratio >= 1 (largest group / mean)")
  sizes = group_sizes.astype(jnp.int32)
  sizes = jnp.pad(sizes, (0, max(0, num_groups - sizes.shape[0])))[:num_groups]
  ranked = jnp.argsort(-sizes, stable=True)
  # float32: max * G overflows int32 from 2^31 (e.g. 2^23 rows in one of 256 groups)
  skewed = sizes.max().astype(jnp.float32) * num_groups >= skew * sizes.sum().astype(jnp.float32)
  return jnp.where(skewed, ranked, jnp.arange(num_groups)).astype(jnp.int32)


def _num_sms() -> int:
  dev = jax.devices()[0]
  return int(getattr(dev, "core_count", 0) or 132)  # H100/H200: 132




# ----------------------------------------------------------------------------------------------
# JAX entry points.


# Activations the gmm epilogue takes (`epi_act`: act and act' of the row-dot operand), by kernel code.
FUSED_ACTIVATIONS = {"silu": 1, "relu": 2}


def _act_code(name, what):
  if name is None:
    return 0
  if name not in FUSED_ACTIVATIONS:
    raise ValueError(f"{what}={name!r}: the Triton kernels fuse {', '.join(FUSED_ACTIVATIONS)}")
  return FUSED_ACTIVATIONS[name]


def triton_gmm(lhs, rhs, group_sizes, *, transpose_rhs=False, out_dtype=None, config=None,
               lhs_index=None, row_scale=None, row_dot=None, epi_act=None, scaled_row_dot=False):
  """Raw grouped matmul (see module docstring). `lhs_index` [M] int32: the operand's row r is
  lhs[lhs_index[r]] (lhs [N_src, K]; the permute gather fused into the kernel); `row_scale` [M]:
  output row r is multiplied by row_scale[r] (in float32, before the cast). `row_dot` [M, N_out]:
  also return dots [M] float32, dots[r] = <output row r before the scale, row_dot[r]>.
  `epi_act` (a FUSED_ACTIVATIONS name, with `row_dot`): row_dot holds pre-activations z:
  dots[r] = <out[r], act(z[r])> and out[r] *= act'(z[r]) before the scale.
  `scaled_row_dot` (with `row_dot` and `row_scale`): return (out, dots, scaled) with scaled [M, N_out]
  in row_dot's dtype, scaled[r] = act(z[r]) (rounded to that dtype; z[r] itself without `epi_act`)
  * row_scale[r]: written from the tiles the epilogue loaded anyway. A tile with `xla_epilogue`
  (`kernels.gmm.tuning.TileConfig`) runs the kernel without the row-dot epilogue and XLA's after it
  (`_with_xla_epilogue`)."""
  if epi_act is not None and row_dot is None:
    raise ValueError("triton_gmm: epi_act needs row_dot (the pre-activations)")
  if scaled_row_dot and (row_dot is None or row_scale is None):
    raise ValueError("triton_gmm: scaled_row_dot needs row_dot and row_scale")
  m = lhs.shape[0] if lhs_index is None else lhs_index.shape[0]
  g, k, n = rhs.shape
  kc, no = (n, k) if transpose_rhs else (k, n)
  strides = (k * n, 1, n) if transpose_rhs else (k * n, n, 1)  # (g, contraction, output col)
  out_dtype = jnp.dtype(out_dtype or lhs.dtype)
  op = ("gmm_t" if transpose_rhs else "gmm") + ("" if lhs_index is None else "+gather")
  cfg = config or tuning.lookup("triton", op, m, kc, no, g)
  if row_dot is not None and row_dot.shape != (m, no):
    raise ValueError(f"row_dot {row_dot.shape} must be the output's shape {(m, no)}")
  act_code = _act_code(epi_act, "epi_act")
  if cfg.xla_epilogue and row_dot is not None:  # the plain float32 product, the epilogue in XLA
    return _with_xla_epilogue(lhs, rhs, group_sizes, transpose_rhs, out_dtype, cfg, lhs_index,
                              row_scale, row_dot, epi_act, scaled_row_dot)
  launch = gmm_launch(m, kc, no, g, cfg, _num_sms() if cfg.persistent else 132)
  grid = launch.pop("grid")
  index = placeholder() if lhs_index is None else lhs_index.astype(jnp.int32)
  scale = placeholder() if row_scale is None else row_scale.astype(jnp.float32)
  other = placeholder() if row_dot is None else row_dot
  # Column tiles write partial dots [N_TILES, M], summed here (deterministic, no atomics).
  dots_shape = (launch["N_TILES"], m) if row_dot is not None else (1,)
  scaled_shape = jax.ShapeDtypeStruct((m, no) if scaled_row_dot else (1,),
                                      row_dot.dtype if scaled_row_dot else jnp.int32)
  out, dots, scaled = jt.triton_call(
      lhs, rhs.astype(lhs.dtype), group_sizes.astype(jnp.int32), index, scale, other,
      kernel=_gmm_kernel, grid=grid,
      out_shape=[jax.ShapeDtypeStruct((m, no), out_dtype), jax.ShapeDtypeStruct(dots_shape, jnp.float32),
                 scaled_shape],
      M=m, KC=kc, NO=no, G=g, s_bg=strides[0], s_bk=strides[1], s_bn=strides[2],
      A_INDEX=lhs_index is not None, ROW_SCALE=row_scale is not None, ROW_DOT=row_dot is not None,
      EPI_ACT=act_code, SCALED_D=bool(scaled_row_dot), FAST_SIGMOID=True, **launch,
      **triton_launch.launch_kwargs())
  if row_dot is None:
    return out
  return (out, dots.sum(axis=0), scaled) if scaled_row_dot else (out, dots.sum(axis=0))


def _with_xla_epilogue(lhs, rhs, group_sizes, transpose_rhs, out_dtype, cfg, lhs_index, row_scale,
                       row_dot, epi_act, scaled_row_dot):
  """`triton_gmm` on a tile with `xla_epilogue`: the kernel without the row-dot epilogue (on the
  tile, the gathered rows as given) writes the float32 product u [M, N_out], then
  `umoe_jax.ops.epilogue` applies the epilogue in XLA: the kernel's results up to float32
  summation order, u written and read once more (4 bytes an element)."""
  u = triton_gmm(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs, out_dtype=jnp.float32,
                 config=dataclasses.replace(cfg, xla_epilogue=False), lhs_index=lhs_index)
  out, dots = epilogue.row_dot_epilogue(u, row_scale, row_dot, epi_act, out_dtype)
  if scaled_row_dot:
    return out, dots, epilogue.gate_scaled(row_dot, row_scale, epi_act)
  return out, dots


def triton_tgmm(lhs, rhs, group_sizes, *, num_groups=None, out_dtype=None, config=None,
                lhs_index=None, rhs_index=None, lhs_scale=None):
  """Raw weight-gradient form; with `lhs_index` / `rhs_index` [M] the operands' row r is read at
  lhs[lhs_index[r]] / rhs[rhs_index[r]] (gathers fused into the kernel); with `lhs_scale` [M] the
  lhs row r is multiplied by lhs_scale[r] (float32, rounded to lhs.dtype) before the product."""
  k, n = lhs.shape[1], rhs.shape[1]
  m = next((i.shape[0] for i in (lhs_index, rhs_index) if i is not None), lhs.shape[0])
  g = int(num_groups or group_sizes.shape[0])
  out_dtype = jnp.dtype(out_dtype or lhs.dtype)
  gathered = lhs_index is not None or rhs_index is not None
  cfg = config or tuning.lookup("triton", "tgmm+gather" if gathered else "tgmm", m, k, n, g)
  launch = tgmm_launch(m, k, n, g, cfg)
  grid = launch.pop("grid")
  a_index = placeholder() if lhs_index is None else lhs_index.astype(jnp.int32)
  b_index = placeholder() if rhs_index is None else rhs_index.astype(jnp.int32)
  a_scale = placeholder() if lhs_scale is None else lhs_scale.astype(jnp.float32)
  order = tile_order(group_sizes, g, TGMM_BIG_FIRST_SKEW)
  return jt.triton_call(
      lhs, rhs.astype(lhs.dtype), group_sizes.astype(jnp.int32), a_index, b_index, a_scale, order,
      kernel=_tgmm_kernel, out_shape=jax.ShapeDtypeStruct((g, k, n), out_dtype), grid=grid,
      M=m, K=k, N=n, G=g, A_INDEX=lhs_index is not None, B_INDEX=rhs_index is not None,
      A_SCALE=lhs_scale is not None, **launch, **triton_launch.launch_kwargs())


available = gpu_available


GMM = triton_gmm
TGMM = triton_tgmm
