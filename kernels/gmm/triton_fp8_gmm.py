"""FP8 grouped matmuls in Triton (NVIDIA sm90, through jax-triton): the triton backend's `fp8_gmm` /
`fp8_tgmm` forms (`umoe_jax.ops.gmm_backends.GmmBackend`), on float8_e4m3fn operands with float32
scales as `umoe_jax.ops.fp8` makes them (`umoe_jax.ops.fp8_gmm` quantises and differentiates):

  gmm    out[rows of g] = (a * sa)[rows of g] @ (b * sb)[g]      a [M, C] in 1 x 128 tiles along C,
         b [G, K, N] in 128 x 128 blocks; C = K -> [M, N], or with transpose_rhs C = N and b[g].T -> [M, K]
  tgmm   out[g] = (a * sa)[rows of g].T @ (b * sb)[rows of g]    a [M, K], b [M, N], both in 128-row
         tiles of one column (scales [ceil(M/128), K] and [ceil(M/128), N]) -> [G, K, N]

Both contract in chunks of 128, one scale piece each: a chunk is one FP8 `tl.dot` into a fresh float32
partial product, which is multiplied by its two scales and added to the float32 accumulator
(DeepSeek-V3's promotion every 128 elements of the contraction), so no product is ever summed across
two scales. Inside a chunk the tensor cores accumulate at their own FP8 precision (Triton's default
`max_num_imprecise_acc` on sm_90 leaves the whole dot to them): a chunk is exactly one promotion.
A piece holding inf or NaN has a non-finite scale, which multiplies every partial product it enters:
such outputs are inf or NaN, never finite. The gmm also takes the row-wise recipe (`rowwise`: one
scale a row of a and a column of the product's b): the scales multiply the sum once, after the
contraction, whose chunks accumulate on the tensor cores (the forward) or in float32 (the input
gradient; ROWWISE_PROMOTE).

gmm: the bf16 kernel's schedule (`triton_gmm._row_schedule` / `_locate`: group-aligned row tiles, one
zero tail for the rows past sum(group_sizes), column tile fastest); the output column tile may be two
powers of two (BN + BN2, 192 = 128 + 64), each column's weight scale read per 128-wide block.
tgmm: one program per (group, K tile, N tile) in `triton_gmm.tile_order`; its steps are the aligned
128-row scale tiles that overlap the group (a tile may span two groups: the other group's rows are
selected to zero, the tile's scales are the rows' own), so each step has one scale row per column;
empty groups write zeros. Only a group's first and last tile can hold other rows: they are steps of
their own, and the tiles wholly inside the group load without row masks in a loop Triton
pipelines (asynchronous copies into shared memory).

Both kernels read their dot operands K-major (the contraction contiguous), the only layout FP8 wgmma
takes from shared memory: gmm's weights as a transposed copy when they are not already (`transpose_rhs`
is), tgmm's operands as transposed copies aT [K, M] and bT [N, M].

Launches go through `_launch`, which the CPU tests replace by the Triton interpreter.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels import triton_launch
from kernels.gmm import triton_gmm, tuning
from kernels.triton_base import HAVE_JAX_TRITON, HAVE_TRITON, gpu_available, pow2_at_least, split_width

if HAVE_TRITON:
  import triton
  import triton.language as tl
if HAVE_JAX_TRITON:
  import jax_triton as jt

# The scale piece (umoe_jax.ops.fp8.TILE): the contraction chunk of one tl.dot, the rows of one
# weight-gradient step.
TILE = 128
DTYPE = jnp.dtype(jnp.float8_e4m3fn)


if HAVE_TRITON:

  @triton.jit
  def _fp8_gmm_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, gs_ptr, idx_ptr, o_ptr,
                      M: tl.constexpr, KC: tl.constexpr, NO: tl.constexpr, KB: tl.constexpr,
                      G: tl.constexpr, GP: tl.constexpr, s_bg: tl.constexpr, s_bk: tl.constexpr,
                      s_bn: tl.constexpr, s_sg: tl.constexpr, s_sk: tl.constexpr,
                      s_sn: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BN2: tl.constexpr,
                      BK: tl.constexpr, N_TILES: tl.constexpr, HAS_INDEX: tl.constexpr,
                      ROWWISE: tl.constexpr, SA_W: tl.constexpr, PROMOTE: tl.constexpr):
    # out[M, NO] = (a * sa)[M, KC] @ (b * sb)[g][KC, NO]: a row-major with scales sa [M, KB] (with
    # HAS_INDEX, output row r reads a's row idx[r] and its scales: idx_ptr [M] int32);
    # b[g][c, o] at b_ptr + g*s_bg + c*s_bk + o*s_bn, its scale for chunk c // BK and column block
    # o // BK at sb_ptr + g*s_sg + (c // BK)*s_sk + (o // BK)*s_sn. BK = TILE (one chunk a scale).
    # SA_W: sa's row stride (KB; 1 under ROWWISE). ROWWISE: one scale a row (sa [M, 1]) and a
    # column (sb at g*s_sg + o*s_sn): the chunks accumulate on the tensor cores and the two scales
    # multiply the sum once, after the loop. PROMOTE (ROWWISE): each chunk's product is added to the
    # float32 accumulator on the CUDA cores (no scale), as the fine-grained path's; without it the
    # tensor cores carry the whole contraction in their own accumulator (~14 bits on Hopper).
    pid = tl.program_id(0)
    offs_g, sizes, tiles, cum_tiles, cum_sizes = triton_gmm._row_schedule(gs_ptr, M, G, GP, BM)
    pid_m = pid // N_TILES
    if pid_m < tl.sum(tiles, axis=0):
      g, row0, row_end = triton_gmm._locate(pid_m, offs_g, sizes, tiles, cum_tiles, cum_sizes, BM)
      compute = g < G  # the zero tail's tiles write zeros
      g = tl.minimum(g, G - 1).to(tl.int64)
      offs_m = row0 + tl.arange(0, BM)
      rows = tl.minimum(offs_m, M - 1)  # rows past the tile's end are never stored
      if HAS_INDEX:
        rows = tl.load(idx_ptr + rows)
      rows = rows.to(tl.int64)
      offs_k = tl.arange(0, BK)
      offs_n = (pid % N_TILES) * (BN + BN2) + tl.arange(0, BN)
      a_ptrs = a_ptr + rows[:, None] * KC + offs_k[None, :]
      sa_ptrs = sa_ptr + rows * SA_W
      b_ptrs = b_ptr + g * s_bg + offs_k[:, None] * s_bk + offs_n[None, :] * s_bn
      if ROWWISE:
        sb_ptrs = sb_ptr + g * s_sg + offs_n * s_sn
      else:
        sb_ptrs = sb_ptr + g * s_sg + (offs_n // BK) * s_sn
      acc = tl.zeros((BM, BN), dtype=tl.float32)
      if BN2 > 0:
        offs_n2 = (pid % N_TILES) * (BN + BN2) + BN + tl.arange(0, BN2)
        b2_ptrs = b_ptr + g * s_bg + offs_k[:, None] * s_bk + offs_n2[None, :] * s_bn
        if ROWWISE:
          sb2_ptrs = sb_ptr + g * s_sg + offs_n2 * s_sn
        else:
          sb2_ptrs = sb_ptr + g * s_sg + (offs_n2 // BK) * s_sn
        acc2 = tl.zeros((BM, BN2), dtype=tl.float32)
      if compute:
        for ks in range(0, KB):
          k_ok = offs_k < KC - ks * BK
          if KC % BK == 0:
            a = tl.load(a_ptrs)
          else:
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
          b = tl.load(b_ptrs, mask=k_ok[:, None] & (offs_n[None, :] < NO), other=0.0)
          if ROWWISE and PROMOTE:
            acc += tl.dot(a, b)
          elif ROWWISE:
            acc = tl.dot(a, b, acc)
          else:
            sa = tl.load(sa_ptrs + ks)
            sb = tl.load(sb_ptrs + ks * s_sk, mask=offs_n < NO, other=0.0)
            acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
          if BN2 > 0:
            b2 = tl.load(b2_ptrs, mask=k_ok[:, None] & (offs_n2[None, :] < NO), other=0.0)
            if ROWWISE and PROMOTE:
              acc2 += tl.dot(a, b2)
            elif ROWWISE:
              acc2 = tl.dot(a, b2, acc2)
            else:
              sb2 = tl.load(sb2_ptrs + ks * s_sk, mask=offs_n2 < NO, other=0.0)
              acc2 += tl.dot(a, b2) * (sa[:, None] * sb2[None, :])
            b2_ptrs += BK * s_bk
          a_ptrs += BK
          b_ptrs += BK * s_bk
        if ROWWISE:
          sa = tl.load(sa_ptrs)
          acc = acc * (sa[:, None] * tl.load(sb_ptrs, mask=offs_n < NO, other=0.0)[None, :])
          if BN2 > 0:
            acc2 = acc2 * (sa[:, None] * tl.load(sb2_ptrs, mask=offs_n2 < NO, other=0.0)[None, :])
      row_ok = (offs_m < row_end)[:, None]
      o_rows = o_ptr + offs_m.to(tl.int64)[:, None] * NO
      tl.store(o_rows + offs_n[None, :], acc.to(o_ptr.dtype.element_ty),
               mask=row_ok & (offs_n[None, :] < NO))
      if BN2 > 0:
        tl.store(o_rows + offs_n2[None, :], acc2.to(o_ptr.dtype.element_ty),
                 mask=row_ok & (offs_n2[None, :] < NO))

  @triton.jit
  def _load_2d(ptrs, ok0, ok1, MASK0: tl.constexpr, MASK1: tl.constexpr):
    # A 2-D load masked by ok0 along its first axis and / or ok1 along its second, as the flags say:
    # no mask where a flag is off, so a load without flags is one the pipeliner can make async.
    if MASK0 and MASK1:
      x = tl.load(ptrs, mask=ok0[:, None] & ok1[None, :], other=0.0)
    elif MASK0:
      x = tl.load(ptrs, mask=ok0[:, None], other=0.0)
    elif MASK1:
      x = tl.load(ptrs, mask=ok1[None, :], other=0.0)
    else:
      x = tl.load(ptrs)
    return x

  @triton.jit
  def _fp8_tgmm_step(acc, acc2, t, start, end, a_ptr, sa_ptr, b_ptr, sb_ptr, offs_k, offs_n,
                     offs_n2, K: tl.constexpr, N: tl.constexpr, M: tl.constexpr, BR: tl.constexpr,
                     BN2: tl.constexpr, MASK_ROWS: tl.constexpr, MASK_K: tl.constexpr,
                     MASK_N: tl.constexpr):
    # One step: the rows of scale tile t, their partial dot scaled by the tile's scales (one row a
    # column) and added to the accumulators. MASK_ROWS: the tile holds rows outside [start, end)
    # (another group's, or past the groups), read as zeros; the loads of a step without it carry
    # only the column masks MASK_K / MASK_N (off where K / N fill their tiles).
    t = tl.cast(t, tl.int64)  # (a Python int under the interpreter's loops)
    rows = t * BR + tl.arange(0, BR)
    # A shared tile is read whole (but rows past M: the last tile may be partial) and the rows
    # outside [start, end) selected away after the load: a mask on the array's end is constant over
    # 16 contiguous rows when M is a multiple of 16 (vector loads), one on a group's bounds is not.
    r_ok = rows < M
    PAST_M: tl.constexpr = MASK_ROWS and (M % BR != 0)
    k_ok = offs_k < K
    n_ok = offs_n < N
    a = _load_2d(a_ptr + offs_k.to(tl.int64)[:, None] * M + rows[None, :], k_ok, r_ok, MASK_K,
                 PAST_M)
    b = _load_2d(b_ptr + offs_n.to(tl.int64)[None, :] * M + rows[:, None], r_ok, n_ok, PAST_M,
                 MASK_N)
    if MASK_ROWS:
      r_in = (rows >= start) & (rows < end)
      a = tl.where(r_in[None, :], a, tl.zeros_like(a))
      b = tl.where(r_in[:, None], b, tl.zeros_like(b))
    sa = tl.load(sa_ptr + t * K + offs_k, mask=k_ok, other=0.0)
    sb = tl.load(sb_ptr + t * N + offs_n, mask=n_ok, other=0.0)
    acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
    if BN2 > 0:
      n2_ok = offs_n2 < N
      b2 = _load_2d(b_ptr + offs_n2.to(tl.int64)[None, :] * M + rows[:, None], r_ok, n2_ok,
                    PAST_M, MASK_N)
      if MASK_ROWS:
        b2 = tl.where(r_in[:, None], b2, tl.zeros_like(b2))
      sb2 = tl.load(sb_ptr + t * N + offs_n2, mask=n2_ok, other=0.0)
      acc2 += tl.dot(a, b2) * (sa[:, None] * sb2[None, :])
    return acc, acc2

  @triton.jit
  def _fp8_tgmm_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, gs_ptr, order_ptr, o_ptr,
                       M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, G: tl.constexpr,
                       GP: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
                       BN2: tl.constexpr, K_TILES: tl.constexpr, N_TILES: tl.constexpr):
    # out[g] = (a * sa)[rows of g].T @ (b * sb)[rows of g], from the transposed copies aT [K, M] and
    # bT [N, M] (rows contiguous: both dot operands K-major, as FP8 wgmma reads them); sa
    # [cdiv(M, BR), K], sb [cdiv(M, BR), N]; BR = TILE rows a step, aligned to the scale tiles.
    tile = tl.program_id(0)
    slot = tile // (K_TILES * N_TILES)
    pid_k = (tile % (K_TILES * N_TILES)) // N_TILES
    pid_n = tile % N_TILES
    offs_g = tl.arange(0, GP)
    sizes = tl.load(gs_ptr + offs_g, mask=offs_g < G, other=0)
    g = tl.load(order_ptr + slot)
    sel = offs_g == g
    end = tl.minimum(tl.sum(tl.where(sel, tl.cumsum(sizes, axis=0), 0), axis=0), M)
    start = tl.minimum(end - tl.sum(tl.where(sel, sizes, 0), axis=0), end)

    offs_k = pid_k * BK + tl.arange(0, BK)
    offs_n = pid_n * (BN + BN2) + tl.arange(0, BN)
    MASK_K: tl.constexpr = K % BK != 0
    MASK_N: tl.constexpr = N % (BN + BN2) != 0
    acc = tl.zeros((BK, BN), dtype=tl.float32)
    if BN2 > 0:
      offs_n2 = pid_n * (BN + BN2) + BN + tl.arange(0, BN2)
      acc2 = tl.zeros((BK, BN2), dtype=tl.float32)
    else:  # unused stand-ins (one column tile)
      offs_n2 = offs_n
      acc2 = tl.zeros((BK, 16), dtype=tl.float32)
    # The group's scale tiles in order: a head tile shared with the rows before the group (start
    # not aligned), the tiles wholly inside it [lo, hi), a tail tile shared with the rows after it
    # (end not aligned; the head's own tile when the group starts and ends inside one tile).
    # Only head and tail mask rows: the interior loop's loads are the pipelined ones.
    lo = (start + BR - 1) // BR
    hi = end // BR
    has_head = (end > start) & (start % BR != 0)
    has_tail = (end > start) & (end % BR != 0) & ((start % BR == 0) | (start // BR != hi))
    if has_head:
      acc, acc2 = _fp8_tgmm_step(acc, acc2, start // BR, start, end, a_ptr, sa_ptr, b_ptr, sb_ptr,
                                 offs_k, offs_n, offs_n2, K, N, M, BR, BN2, True, MASK_K, MASK_N)
    for t in range(lo, hi):
      acc, acc2 = _fp8_tgmm_step(acc, acc2, t, start, end, a_ptr, sa_ptr, b_ptr, sb_ptr, offs_k,
                                 offs_n, offs_n2, K, N, M, BR, BN2, False, MASK_K, MASK_N)
    if has_tail:
      acc, acc2 = _fp8_tgmm_step(acc, acc2, hi, start, end, a_ptr, sa_ptr, b_ptr, sb_ptr, offs_k,
                                 offs_n, offs_n2, K, N, M, BR, BN2, True, MASK_K, MASK_N)

    k_ok = offs_k < K
    o_base = o_ptr + g.to(tl.int64) * (K * N) + offs_k.to(tl.int64)[:, None] * N
    tl.store(o_base + offs_n[None, :], acc.to(o_ptr.dtype.element_ty),
             mask=k_ok[:, None] & (offs_n[None, :] < N))
    if BN2 > 0:
      tl.store(o_base + offs_n2[None, :], acc2.to(o_ptr.dtype.element_ty),
               mask=k_ok[:, None] & (offs_n2[None, :] < N))


# ----------------------------------------------------------------------------------------------
# Tiles and launch geometry (pure Python: tested on CPU).


def _tile_width(n: int) -> int:
  """An output tile width for n columns: n itself where it is at most 256 and a power of two or two
  of them each >= 16 (tl.dot's least width; 192 = 128 + 64), else a power of two <= 128."""
  if 16 <= n <= 256:
    try:
      hi, lo = split_width(n)
    except ValueError:
      hi, lo = 0, 0
    if hi and (lo == 0 or lo >= 16):
      return n
  return min(128, pow2_at_least(max(n, 16)))


# The most shared memory one block may ask on an H100 / H200 (227 KiB).
SMEM_LIMIT = 232448


def shared_memory(cfg: tuning.TileConfig) -> int:
  """Bytes of shared memory a config may ask, from above: `num_stages` buffers of both operand tiles
  ((bm + bn) x TILE FP8 bytes each: what Triton allocates for the pipelined loop) plus a float32
  output tile for the epilogue's layout change. Triton lays that tile over the loop's buffers, dead
  by then, so a compiled kernel asks about the first term alone."""
  return cfg.num_stages * (cfg.bm + cfg.bn) * TILE + cfg.bm * cfg.bn * 4


def default_config(op: str, kc: int, no: int) -> tuning.TileConfig:
  """The FP8 kernels' tiles, not yet measured: gmm / gmm_t 128 rows x the output's width (up to
  192: a 256-wide tile's float32 accumulator and partial product spill registers), tgmm a 128 x
  width output tile, 64 x width above 128 columns (128 x 192 spills); the
  contraction chunk (gmm: bk) and the rows a step (tgmm: bk) are the scale piece, TILE. Every
  default stays within SMEM_LIMIT by `shared_memory`."""
  bn = _tile_width(no)
  if op == "tgmm":
    bm = min(128 if bn <= 128 else 64, pow2_at_least(max(kc, 16)))
    return tuning.TileConfig(bm=bm, bn=bn, bk=TILE, num_warps=8, num_stages=3)
  bn = bn if bn <= 192 else 128
  return tuning.TileConfig(bm=128, bn=bn, bk=TILE, num_warps=8, num_stages=4 if bn <= 128 else 3)


# Measured tiles (bench/gmm.py --sweep-fp8, operands quantised beforehand): (op, kc, no) ->
# TileConfig, op "gmm" / "gmm_t" / "tgmm" and kc / no as in kernels/gmm/tuning.py; a shape not here
# takes `default_config`.
TABLE: dict[tuple, tuning.TileConfig] = {}


def config_for(op: str, kc: int, no: int) -> tuning.TileConfig:
  """The tile an FP8 kernel launches with: TABLE's row, else `default_config`."""
  return TABLE.get((op, kc, no)) or default_config(op, kc, no)


def candidates(op: str, kc: int, no: int) -> list[tuning.TileConfig]:
  """The tiles bench/gmm.py --sweep-fp8 times for one (op, kc, no), `config_for`'s first: output
  tiles of 64-256 rows by the output's width (W) or 64 / 128 columns, 4 or 8 warps, 2-5 stages;
  none past SMEM_LIMIT, none wider than W, and none whose two float32 tiles (the accumulator and
  a chunk's partial product) pass 192 registers a thread (the default 128 x 192 tile's on 8
  warps; 256 x 128 spills)."""
  width = _tile_width(no)
  if op == "tgmm":
    shapes = ((128, 128, 8, 3), (128, 128, 8, 4), (64, 128, 4, 4), (64, 128, 4, 5), (64, width, 8, 3),
              (64, width, 8, 4), (128, 64, 4, 4), (128, 64, 4, 5), (64, 64, 4, 5), (256, 64, 8, 3))
  elif op in ("gmm", "gmm_t"):
    shapes = ((128, width, 8, 3), (128, width, 8, 4), (128, 128, 8, 4), (128, 128, 8, 5),
              (128, 128, 4, 4), (64, width, 4, 4), (64, width, 8, 5), (64, 128, 4, 5),
              (256, 64, 8, 4), (128, 64, 4, 5), (256, 128, 8, 3))
  else:
    raise ValueError(f"FP8 tiles: unknown op {op!r} (gmm, gmm_t or tgmm)")
  out = [config_for(op, kc, no)]
  for bm, bn, nw, ns in shapes:
    if op == "tgmm":
      bm = min(bm, pow2_at_least(max(kc, 16)))
    cfg = tuning.TileConfig(bm=bm, bn=min(bn, width), bk=TILE, num_warps=nw, num_stages=ns)
    if (cfg not in out and shared_memory(cfg) <= SMEM_LIMIT
        and 2 * cfg.bm * cfg.bn <= 192 * 32 * cfg.num_warps):
      out.append(cfg)
  return out


def gmm_launch(m: int, kc: int, no: int, g: int, cfg: tuning.TileConfig) -> dict:
  """The gmm kernel's grid and meta-parameters: the bf16 kernel's one program per (row tile,
  column tile) (`triton_gmm.gmm_launch`), the contraction in TILE-wide chunks."""
  if cfg.bk != TILE:
    raise ValueError(f"FP8 gmm tile {cfg}: bk must be {TILE}, the scale piece (one chunk, one scale)")
  if cfg.persistent:
    raise ValueError(f"FP8 gmm tile {cfg}: one program a tile (no persistent grid)")
  base = triton_gmm.gmm_launch(m, kc, no, g, cfg)
  return dict(grid=base["grid"], BM=cfg.bm, BN=base["BN"], BN2=base["BN2"], BK=TILE,
              N_TILES=base["N_TILES"], GP=base["GP"], num_warps=cfg.num_warps,
              num_stages=cfg.num_stages)


def tgmm_launch(m: int, k: int, n: int, g: int, cfg: tuning.TileConfig) -> dict:
  """The tgmm kernel's grid: one program per (group, K tile, N tile); cfg.bm x cfg.bn the output
  tile (bm a power of two, bn one or two), cfg.bk the rows a step (= TILE)."""
  if cfg.bk != TILE:
    raise ValueError(f"FP8 tgmm tile {cfg}: bk (rows a step) must be {TILE}, the scale tile")
  if cfg.bm & (cfg.bm - 1):
    raise ValueError(f"FP8 tgmm tile {cfg}: bm (output rows) must be a power of two")
  base = triton_gmm.tgmm_launch(m, k, n, g, cfg)
  return dict(grid=base["grid"], BR=TILE, BK=cfg.bm, BN=base["BN"], BN2=base["BN2"],
              K_TILES=base["K_TILES"], N_TILES=base["N_TILES"], GP=base["GP"],
              num_warps=cfg.num_warps, num_stages=cfg.num_stages)


# ----------------------------------------------------------------------------------------------
# JAX entry points.


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _check(what: str, name: str, x, shape, dtype) -> None:
  if tuple(x.shape) != tuple(shape) or jnp.dtype(x.dtype) != jnp.dtype(dtype):
    raise ValueError(f"{what}: {name} is {jnp.dtype(x.dtype).name}{list(x.shape)}, expected "
                     f"{jnp.dtype(dtype).name}{list(shape)}")


if not HAVE_TRITON:
  # Names for the launches' arguments; `_launch` refuses them in one line (tests replace `_launch`).
  _fp8_gmm_kernel = _fp8_tgmm_kernel = None


def _check_device(what: str) -> None:
  """FP8 tensor cores: sm_89 and later (a GPU launch elsewhere would fail inside Triton)."""
  dev = jax.devices()[0]
  cc = getattr(dev, "compute_capability", None)
  if dev.platform == "gpu" and cc and tuple(int(v) for v in str(cc).split(".")[:2]) < (8, 9):
    raise ValueError(f"{what}: {dev.device_kind} (sm_{str(cc).replace('.', '')}) has no FP8 tensor "
                     "cores (sm_89 or later); use the xla backend's emulation")


def _launch(kernel, grid, args, out_shape, **meta):
  """One kernel launch through jax-triton (replaced by the interpreter in the CPU tests)."""
  if kernel is None or not HAVE_JAX_TRITON:
    raise RuntimeError("triton fp8 gmm: needs Triton and jax-triton (pip install -r requirements-gpu.txt); "
                       "the xla backend's emulation runs without them")
  return jt.triton_call(*args, kernel=kernel, grid=grid, out_shape=out_shape, **meta,
                        **triton_launch.launch_kwargs())


# Per op (gmm: the forward, gmm_t: the input gradient), whether a row-wise launch sums its chunks'
# products in float32: torchao's row-wise recipe keeps the tensor cores' fast accumulation for the
# forward and turns it off for the input gradient.
ROWWISE_PROMOTE = {"gmm": False, "gmm_t": True}


def triton_fp8_gmm(lhs_q, lhs_scale, rhs_q, rhs_scale, group_sizes, *, transpose_rhs=False,
                   out_dtype=jnp.bfloat16, config=None, lhs_index=None, rowwise=False):
  """The raw FP8 gmm (module docstring): lhs_q [M, C] float8_e4m3fn, lhs_scale [M, ceil(C/128)]
  float32, rhs_q [G, K, N], rhs_scale [G, ceil(K/128), ceil(N/128)]; C = K -> [M, N], or with
  `transpose_rhs` C = N -> [M, K]; rows past sum(group_sizes) are zeros. With `lhs_index` [M]
  int32 (entries in [0, S)), lhs_q [S, C] / lhs_scale [S, ...] and row r of the product reads
  their row lhs_index[r]: the gmm of the gathered operands without the gathered copy. `rowwise`
  (`umoe_jax.ops.fp8.quantize_rowwise`): lhs_scale [M, 1] and one scale a column of the product's
  weights, rhs_scale [G, 1, N] ([G, K, 1] with `transpose_rhs`), applied once after the sum; the
  chunks' products summed in float32 where ROWWISE_PROMOTE says, else on the tensor cores."""
  what = "triton fp8 gmm" + ("^T" if transpose_rhs else "")
  src = lhs_q.shape[0]
  m = src if lhs_index is None else lhs_index.shape[0]
  g, k, n = rhs_q.shape
  kc, no = (n, k) if transpose_rhs else (k, n)
  _check(what, "lhs_q", lhs_q, (src, kc), DTYPE)
  _check(what, "lhs_scale", lhs_scale, (src, 1 if rowwise else _cdiv(kc, TILE)), jnp.float32)
  if lhs_index is not None and (lhs_index.ndim != 1 or not jnp.issubdtype(lhs_index.dtype, jnp.integer)):
    raise ValueError(f"{what}: lhs_index is {jnp.dtype(lhs_index.dtype).name}{list(lhs_index.shape)}, "
                     "expected an integer vector (a product row's source row)")
  _check(what, "rhs_q", rhs_q, (g, k, n), DTYPE)
  if rowwise:
    kb, nb = (k, 1) if transpose_rhs else (1, n)
  else:
    kb, nb = _cdiv(k, TILE), _cdiv(n, TILE)
  _check(what, "rhs_scale", rhs_scale, (g, kb, nb), jnp.float32)
  _check_device(what)
  op = "gmm_t" if transpose_rhs else "gmm"
  cfg = config or config_for(op, kc, no)
  launch = gmm_launch(m, kc, no, g, cfg)
  grid = launch.pop("grid")
  # (group, contraction, output column) strides of the weights and of their scales. FP8 wgmma
  # reads its operands K-major: with N-major weights the same kernel ran 2-3x slower on an H100, so
  # without the transpose it reads a transposed copy ([G, N, K], one pass over the FP8 weights).
  if transpose_rhs:
    strides, s_strides = (k * n, 1, n), (kb * nb, 1, nb)
  else:
    rhs_q, rhs_scale = jnp.swapaxes(rhs_q, 1, 2), jnp.swapaxes(rhs_scale, 1, 2)
    strides, s_strides = (k * n, 1, k), (kb * nb, 1, kb)
  sizes = group_sizes.astype(jnp.int32)
  index = sizes if lhs_index is None else lhs_index.astype(jnp.int32)  # (a stand-in: never read)
  chunks = _cdiv(kc, TILE)
  return _launch(_fp8_gmm_kernel, grid, (lhs_q, lhs_scale, rhs_q, rhs_scale, sizes, index),
                 jax.ShapeDtypeStruct((m, no), jnp.dtype(out_dtype)),
                 HAS_INDEX=lhs_index is not None, M=m, KC=kc, NO=no, KB=chunks, G=g,
                 s_bg=strides[0], s_bk=strides[1], s_bn=strides[2], s_sg=s_strides[0],
                 s_sk=s_strides[1], s_sn=s_strides[2], ROWWISE=bool(rowwise),
                 SA_W=1 if rowwise else chunks, PROMOTE=bool(rowwise) and ROWWISE_PROMOTE[op],
                 **launch)


def triton_fp8_tgmm(lhs_q, lhs_scale, rhs_q, rhs_scale, group_sizes, *, num_groups=None,
                    out_dtype=jnp.float32, config=None):
  """The raw FP8 weight-gradient form (module docstring): lhs_q [M, K], rhs_q [M, N]
  float8_e4m3fn in 128-row tiles of one column, scales [ceil(M/128), K] / [ceil(M/128), N] float32
  -> [G, K, N], zero for empty groups."""
  what = "triton fp8 tgmm"
  m, k = lhs_q.shape
  n = rhs_q.shape[1]
  g = int(num_groups or group_sizes.shape[0])
  mb = _cdiv(m, TILE)
  _check(what, "lhs_q", lhs_q, (m, k), DTYPE)
  _check(what, "rhs_q", rhs_q, (m, n), DTYPE)
  _check(what, "lhs_scale", lhs_scale, (mb, k), jnp.float32)
  _check(what, "rhs_scale", rhs_scale, (mb, n), jnp.float32)
  _check_device(what)
  cfg = config or config_for("tgmm", k, n)
  launch = tgmm_launch(m, k, n, g, cfg)
  grid = launch.pop("grid")
  order = triton_gmm.tile_order(group_sizes, g, triton_gmm.TGMM_BIG_FIRST_SKEW)
  sizes = jnp.pad(group_sizes.astype(jnp.int32), (0, max(0, g - group_sizes.shape[0])))[:g]
  # Rows contiguous (K-major dot operands): XLA writes the transposes, fused with the quantisation
  # that produces the operands where both run in one program.
  return _launch(_fp8_tgmm_kernel, grid, (lhs_q.T, lhs_scale, rhs_q.T, rhs_scale, sizes, order),
                 jax.ShapeDtypeStruct((g, k, n), jnp.dtype(out_dtype)),
                 M=m, K=k, N=n, G=g, **launch)


available = gpu_available

FP8_GMM = triton_fp8_gmm
FP8_TGMM = triton_fp8_tgmm
