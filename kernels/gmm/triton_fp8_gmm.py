"""The FP8 grouped matmul in Triton (NVIDIA sm90, through jax-triton): the triton backend's `fp8_gmm`
form (`umoe_jax.ops.gmm_backends.GmmBackend`), on float8_e4m3fn operands with float32 scales as
`umoe_jax.ops.fp8` makes them (`umoe_jax.ops.fp8_gmm` quantises and differentiates; the weight
gradient runs in bf16 by the bf16 kernels):

  out[rows of g] = (a * sa)[rows of g] @ (b * sb)[g]      a [M, C] in 1 x 128 tiles along C,
  b [G, K, N] in 128 x 128 blocks; C = K -> [M, N], or with transpose_rhs C = N and b[g].T -> [M, K]

It contracts in chunks of 128, one scale piece each: a chunk is one FP8 `tl.dot` into a fresh float32
partial product, which is multiplied by its two scales and added to the float32 accumulator
(DeepSeek-V3's promotion every 128 elements of the contraction), so no product is ever summed across
two scales. A last piece shorter than 128 is one dot of its own width after the loop (`chunks`).
Inside a chunk the tensor cores accumulate at their own FP8 precision (Triton's default
`max_num_imprecise_acc` on sm_90 leaves the whole dot to them): a chunk is exactly one promotion.
A piece holding inf or NaN has a non-finite scale, which multiplies every partial product it enters:
such outputs are inf or NaN, never finite.

The schedule is the bf16 kernel's (`triton_gmm._row_schedule` / `_locate`: group-aligned row tiles,
one zero tail for the rows past sum(group_sizes), column tile fastest); the output column tile may be
two powers of two (BN + BN2, 192 = 128 + 64), each column's weight scale read per 128-wide block.
The dot operands are read K-major (the contraction contiguous), the only layout FP8 wgmma takes from
shared memory: the weights as a transposed copy when they are not already (`transpose_rhs` is).

Launches go through `_launch`, which the CPU tests replace by the Triton interpreter.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kernels import triton_launch
from kernels.gmm import triton_fp8_quant, triton_gmm, tuning
from kernels.triton_base import HAVE_JAX_TRITON, HAVE_TRITON, gpu_available, pow2_at_least, split_width

if HAVE_TRITON:
  import triton
  import triton.language as tl
if HAVE_JAX_TRITON:
  import jax_triton as jt

# The scale piece (umoe_jax.ops.fp8.TILE): the contraction chunk of one tl.dot.
TILE = 128
DTYPE = jnp.dtype(jnp.float8_e4m3fn)


if HAVE_TRITON:

  @triton.jit
  def _quantized_act(acc, o_ptr, q_ptr, qs_ptr, offs_m, offs_n, row_ok, piece, NO: tl.constexpr,
                     QB: tl.constexpr, Q_ACT: tl.constexpr):
    # act(out) in 1 x 128 tiles, as the unfused path has it: the output rounded to its dtype, the
    # activation in float32 rounded to that dtype again (`umoe_jax.ops.epilogue.activate`), then the
    # one-pass quantiser's arithmetic on the tile's row (its columns are one whole scale piece).
    z = acc.to(o_ptr.dtype.element_ty).to(tl.float32)
    y = triton_gmm._act(z, Q_ACT, False).to(o_ptr.dtype.element_ty).to(tl.float32)
    q, scale = triton_fp8_quant._quantize(y, triton_fp8_quant._amax(y, 1)[:, None])
    rows = offs_m.to(tl.int64)[:, None]
    tl.store(q_ptr + rows * NO + offs_n[None, :], q, mask=row_ok & (offs_n[None, :] < NO))
    tl.store(qs_ptr + rows * QB + piece, scale, mask=row_ok)

  @triton.jit
  def _scales(sa, sb_ptrs, sb_part, n0, offs_n, k_off, NO: tl.constexpr, ONE_BLOCK: tl.constexpr):
    # A chunk's scales for the column part starting at n0: sa [BM] times the weights' block scales.
    # With ONE_BLOCK the part lies in one 128-column block, whose one scale (at sb_part) joins sa
    # first: the promotion is then one multiply-add an element, not an outer product as well; the
    # products are the same floats, sa[i] * sb.
    if ONE_BLOCK:
      sb = tl.load(sb_part + k_off, mask=n0 < NO, other=0.0)
      s = (sa * sb)[:, None]
    else:
      sb = tl.load(sb_ptrs + k_off, mask=offs_n < NO, other=0.0)
      s = sa[:, None] * sb[None, :]
    return s

  @triton.jit
  def _fp8_gmm_tile(a_ptr, sa_ptr, b_ptr, sb_ptr, gs_ptr, idx_ptr, o_ptr, q_ptr, qs_ptr,
                    M: tl.constexpr, KC: tl.constexpr, NO: tl.constexpr, KB: tl.constexpr,
                    G: tl.constexpr, GP: tl.constexpr, s_bg: tl.constexpr, s_bk: tl.constexpr,
                    s_bn: tl.constexpr, s_sg: tl.constexpr, s_sk: tl.constexpr,
                    s_sn: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BN2: tl.constexpr,
                    BK: tl.constexpr, N_TILES: tl.constexpr, HAS_INDEX: tl.constexpr,
                    KF: tl.constexpr, TAIL: tl.constexpr, QB: tl.constexpr, Q_ACT: tl.constexpr,
                    ONE_BLOCK: tl.constexpr):
    # out[M, NO] = (a * sa)[M, KC] @ (b * sb)[g][KC, NO]: a row-major with scales sa [M, KB] (with
    # HAS_INDEX, output row r reads a's row idx[r] and its scales: idx_ptr [M] int32);
    # b[g][c, o] at b_ptr + g*s_bg + c*s_bk + o*s_bn, its scale for chunk c // BK and column block
    # o // BK at sb_ptr + g*s_sg + (c // BK)*s_sk + (o // BK)*s_sn. BK = TILE (one chunk a scale).
    # The loop takes the KF whole chunks; with TAIL > 0 the last piece (KC % BK wide) is one
    # TAIL-wide dot after it.
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
      n0 = (pid % N_TILES) * (BN + BN2)
      offs_n = n0 + tl.arange(0, BN)
      a_ptrs = a_ptr + rows[:, None] * KC + offs_k[None, :]
      sa_ptrs = sa_ptr + rows * KB
      b_ptrs = b_ptr + g * s_bg + offs_k[:, None] * s_bk + offs_n[None, :] * s_bn
      sb_ptrs = sb_ptr + g * s_sg + (offs_n // BK) * s_sn
      sb_part = sb_ptr + g * s_sg + (n0 // BK) * s_sn
      acc = tl.zeros((BM, BN), dtype=tl.float32)
      if BN2 > 0:
        offs_n2 = n0 + BN + tl.arange(0, BN2)
        b2_ptrs = b_ptr + g * s_bg + offs_k[:, None] * s_bk + offs_n2[None, :] * s_bn
        sb2_ptrs = sb_ptr + g * s_sg + (offs_n2 // BK) * s_sn
        sb2_part = sb_ptr + g * s_sg + ((n0 + BN) // BK) * s_sn
        acc2 = tl.zeros((BM, BN2), dtype=tl.float32)
      if compute:
        for ks in range(0, KF):
          a = tl.load(a_ptrs)
          b = tl.load(b_ptrs, mask=offs_n[None, :] < NO, other=0.0)
          sa = tl.load(sa_ptrs + ks)
          acc += tl.dot(a, b) * _scales(sa, sb_ptrs, sb_part, n0, offs_n, ks * s_sk, NO, ONE_BLOCK)
          if BN2 > 0:
            b2 = tl.load(b2_ptrs, mask=offs_n2[None, :] < NO, other=0.0)
            acc2 += tl.dot(a, b2) * _scales(sa, sb2_ptrs, sb2_part, n0 + BN, offs_n2, ks * s_sk,
                                            NO, ONE_BLOCK)
            b2_ptrs += BK * s_bk
          a_ptrs += BK
          b_ptrs += BK * s_bk
        if TAIL > 0:  # the last scale piece, KC - KF*BK wide
          offs_t = tl.arange(0, TAIL)
          t_ok = offs_t < KC - KF * BK
          a = tl.load(a_ptr + rows[:, None] * KC + KF * BK + offs_t[None, :], mask=t_ok[None, :],
                      other=0.0)
          bt_ptrs = b_ptr + g * s_bg + (KF * BK + offs_t)[:, None] * s_bk
          b = tl.load(bt_ptrs + offs_n[None, :] * s_bn, mask=t_ok[:, None] & (offs_n[None, :] < NO),
                      other=0.0)
          sa = tl.load(sa_ptrs + KF)
          acc += tl.dot(a, b) * _scales(sa, sb_ptrs, sb_part, n0, offs_n, KF * s_sk, NO, ONE_BLOCK)
          if BN2 > 0:
            b2 = tl.load(bt_ptrs + offs_n2[None, :] * s_bn,
                         mask=t_ok[:, None] & (offs_n2[None, :] < NO), other=0.0)
            acc2 += tl.dot(a, b2) * _scales(sa, sb2_ptrs, sb2_part, n0 + BN, offs_n2, KF * s_sk,
                                            NO, ONE_BLOCK)
      row_ok = (offs_m < row_end)[:, None]
      o_rows = o_ptr + offs_m.to(tl.int64)[:, None] * NO
      tl.store(o_rows + offs_n[None, :], acc.to(o_ptr.dtype.element_ty),
               mask=row_ok & (offs_n[None, :] < NO))
      if BN2 > 0:
        tl.store(o_rows + offs_n2[None, :], acc2.to(o_ptr.dtype.element_ty),
                 mask=row_ok & (offs_n2[None, :] < NO))
      if Q_ACT >= 0:  # each column part one whole scale piece (`quantizing_tile`)
        piece = n0 // BK
        _quantized_act(acc, o_ptr, q_ptr, qs_ptr, offs_m, offs_n, row_ok, piece, NO, QB, Q_ACT)
        if BN2 > 0:
          _quantized_act(acc2, o_ptr, q_ptr, qs_ptr, offs_m, offs_n2, row_ok, piece + 1, NO, QB,
                         Q_ACT)

  @triton.jit
  def _fp8_gmm_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, gs_ptr, idx_ptr, o_ptr,
                      M: tl.constexpr, KC: tl.constexpr, NO: tl.constexpr, KB: tl.constexpr,
                      G: tl.constexpr, GP: tl.constexpr, s_bg: tl.constexpr, s_bk: tl.constexpr,
                      s_bn: tl.constexpr, s_sg: tl.constexpr, s_sk: tl.constexpr,
                      s_sn: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BN2: tl.constexpr,
                      BK: tl.constexpr, N_TILES: tl.constexpr, HAS_INDEX: tl.constexpr,
                      KF: tl.constexpr, TAIL: tl.constexpr, ONE_BLOCK: tl.constexpr):
    _fp8_gmm_tile(a_ptr, sa_ptr, b_ptr, sb_ptr, gs_ptr, idx_ptr, o_ptr, o_ptr, o_ptr, M, KC, NO,
                  KB, G, GP, s_bg, s_bk, s_bn, s_sg, s_sk, s_sn, BM, BN, BN2, BK, N_TILES,
                  HAS_INDEX, KF, TAIL, 1, -1, ONE_BLOCK)

  @triton.jit
  def _fp8_gmm_quant_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, gs_ptr, idx_ptr, o_ptr, q_ptr, qs_ptr,
                            M: tl.constexpr, KC: tl.constexpr, NO: tl.constexpr, KB: tl.constexpr,
                            G: tl.constexpr, GP: tl.constexpr, s_bg: tl.constexpr,
                            s_bk: tl.constexpr, s_bn: tl.constexpr, s_sg: tl.constexpr,
                            s_sk: tl.constexpr, s_sn: tl.constexpr, BM: tl.constexpr,
                            BN: tl.constexpr, BN2: tl.constexpr, BK: tl.constexpr,
                            N_TILES: tl.constexpr, HAS_INDEX: tl.constexpr, KF: tl.constexpr,
                            TAIL: tl.constexpr, QB: tl.constexpr, Q_ACT: tl.constexpr,
                            ONE_BLOCK: tl.constexpr):
    # _fp8_gmm_kernel that also writes act(out) quantised (`triton_fp8_gmm(quantize_out=...)`):
    # q [M, NO] float8_e4m3fn, qs [M, QB] float32; rows past the groups zero, as out's.
    _fp8_gmm_tile(a_ptr, sa_ptr, b_ptr, sb_ptr, gs_ptr, idx_ptr, o_ptr, q_ptr, qs_ptr, M, KC, NO,
                  KB, G, GP, s_bg, s_bk, s_bn, s_sg, s_sk, s_sn, BM, BN, BN2, BK, N_TILES,
                  HAS_INDEX, KF, TAIL, QB, Q_ACT, ONE_BLOCK)


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


def chunks(kc: int) -> tuple[int, int]:
  """(KF, TAIL): the loop's whole TILE-wide chunks of a contraction of kc and the width of the one
  dot after it (0: none) for its last, shorter piece: the next power of two >= 32 (FP8 wgmma's K
  step), not a TILE-wide chunk masked past kc. At UMoE-base's 192-wide contractions (the down
  projection's forward, the up projection's input gradient) the tensor cores then do 192 of K, not
  256: the base-down forward ran at 189 against 174 TFLOP/s, the UMoE-base step in 145.9 against
  148.0 ms (one H100, rows of 2026-12-07)."""
  rest = kc % TILE
  return kc // TILE, (max(32, pow2_at_least(rest)) if rest else 0)


# The most shared memory one block may ask on an H100 / H200 (227 KiB).
SMEM_LIMIT = 232448


def shared_memory(cfg: tuning.TileConfig) -> int:
  """Bytes of shared memory a config may ask, from above: `num_stages` buffers of both operand tiles
  ((bm + bn) x TILE FP8 bytes each: what Triton allocates for the pipelined loop) plus a float32
  output tile for the epilogue's layout change. Triton lays that tile over the loop's buffers, dead
  by then, so a compiled kernel asks about the first term alone."""
  return cfg.num_stages * (cfg.bm + cfg.bn) * TILE + cfg.bm * cfg.bn * 4


def default_config(op: str, kc: int, no: int) -> tuning.TileConfig:
  """The FP8 kernel's tiles where TABLE has none: 128 rows x the output's width (up to 192: a
  256-wide tile's float32 accumulator and partial product spill registers); the contraction chunk
  bk is the scale piece, TILE. Every default stays within SMEM_LIMIT by `shared_memory`."""
  _check_op(op)
  bn = _tile_width(no)
  bn = bn if bn <= 192 else 128
  return tuning.TileConfig(bm=128, bn=bn, bk=TILE, num_warps=8, num_stages=4 if bn <= 128 else 3)


# Measured tiles (bench/gmm.py --sweep-fp8, operands quantised beforehand): (op, kc, no) ->
# TileConfig, op "gmm" (the forward) / "gmm_t" (the input gradient) and kc / no as in
# kernels/gmm/tuning.py; a shape not here takes `default_config`.
# The sweep of 2026-12-07 on one H100 (bench/results) found the defaults fastest, or within 2%,
# everywhere but the input gradient of a 768 -> 192 product (its contraction 192 wide), where 64-row
# tiles on 4 warps ran 4-6% faster (182 vs 175 TFLOP/s at base-up's rows, 171 vs 162 at base-att's).
TABLE: dict[tuple, tuning.TileConfig] = {
    ("gmm_t", 192, 768): tuning.TileConfig(64, 128, 128, 4, 4),
}


def _check_op(op: str) -> None:
  if op not in ("gmm", "gmm_t"):
    raise ValueError(f"FP8 tiles: unknown op {op!r} (gmm or gmm_t)")


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
  _check_op(op)
  shapes = ((128, width, 8, 3), (128, width, 8, 4), (128, 128, 8, 4), (128, 128, 8, 5),
            (128, 128, 4, 4), (64, width, 4, 4), (64, width, 8, 5), (64, 128, 4, 5),
            (256, 64, 8, 4), (128, 64, 4, 5), (256, 128, 8, 3))
  out = [config_for(op, kc, no)]
  for bm, bn, nw, ns in shapes:
    cfg = tuning.TileConfig(bm=bm, bn=min(bn, width), bk=TILE, num_warps=nw, num_stages=ns)
    if cfg not in out and fits(cfg):
      out.append(cfg)
  return out


def fits(cfg: tuning.TileConfig) -> bool:
  """Within SMEM_LIMIT (`shared_memory`) and with the tile's two float32 tiles (the accumulator and
  a chunk's partial product) within 192 registers a thread."""
  return shared_memory(cfg) <= SMEM_LIMIT and 2 * cfg.bm * cfg.bn <= 192 * 32 * cfg.num_warps


def gmm_launch(m: int, kc: int, no: int, g: int, cfg: tuning.TileConfig) -> dict:
  """The gmm kernel's grid and meta-parameters: the bf16 kernel's one program per (row tile,
  column tile) (`triton_gmm.gmm_launch`), the contraction in TILE-wide chunks (`chunks`)."""
  if cfg.bk != TILE:
    raise ValueError(f"FP8 gmm tile {cfg}: bk must be {TILE}, the scale piece (one chunk, one scale)")
  if cfg.persistent:
    raise ValueError(f"FP8 gmm tile {cfg}: one program a tile (no persistent grid)")
  base = triton_gmm.gmm_launch(m, kc, no, g, cfg)
  kf, tail = chunks(kc)
  one_block = ONE_BLOCK_SCALES and parts_in_one_block(base["BN"], base["BN2"], base["N_TILES"])
  return dict(grid=base["grid"], BM=cfg.bm, BN=base["BN"], BN2=base["BN2"], BK=TILE,
              N_TILES=base["N_TILES"], GP=base["GP"], num_warps=cfg.num_warps,
              num_stages=cfg.num_stages, KF=kf, TAIL=tail, ONE_BLOCK=one_block)


# Where every column part of the output tiles lies in one 128-column block of the weights, a
# chunk's weight scale is one number a part, so the promotion scales each row once (sa * sb) and
# adds with one multiply-add an element, instead of forming the outer product sa x sb as well: the
# same floats, fewer CUDA-core instructions in the step that follows every chunk's MMA. Off until
# its rows are measured (bench/train_step.py --fp8_one_block_scales).
ONE_BLOCK_SCALES = False


def parts_in_one_block(bn: int, bn2: int, tiles: int) -> bool:
  """Whether each column part of every output tile (BN then BN2 columns, tile t from t*(BN+BN2))
  lies in one TILE-wide block of columns."""
  for t in range(tiles):
    for lo, width in ((t * (bn + bn2), bn), (t * (bn + bn2) + bn, bn2)):
      if width and lo // TILE != (lo + width - 1) // TILE:
        return False
  return True


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
  _fp8_gmm_kernel = _fp8_gmm_quant_kernel = None


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


def quantizes_pieces(launch: dict, no: int) -> bool:
  """Whether each column part of a launch's output tile (BN, then BN2) over `no` output columns is
  one whole 128-wide scale piece of the output row (or the row's last, shorter piece), so its
  epilogue can quantise it."""
  bn, bn2, tiles = launch["BN"], launch["BN2"], launch["N_TILES"]
  if bn2 == 0:
    return bn == TILE or (tiles == 1 and bn <= TILE)
  return bn == TILE and tiles == 1 and no > TILE   # (else BN2 holds no column of the output)


def quantizing_tile(op: str, m: int, kc: int, no: int, g: int, cfg: tuning.TileConfig) -> tuning.TileConfig:
  """The tile a `quantize_out` launch takes: `cfg` where its column parts are whole scale pieces
  (`quantizes_pieces`), else `cfg` 128 columns wide, or the default tile 128 wide (128 rows on 8
  warps: it always fits) where that one does not fit (`fits`)."""
  if quantizes_pieces(gmm_launch(m, kc, no, g, cfg), no):
    return cfg
  tile = dataclasses.replace(cfg, bn=TILE)
  return tile if fits(tile) else dataclasses.replace(default_config(op, kc, no), bn=TILE)


def triton_fp8_gmm(lhs_q, lhs_scale, rhs_q, rhs_scale, group_sizes, *, transpose_rhs=False,
                   out_dtype=jnp.bfloat16, config=None, lhs_index=None, quantize_out=None):
  """The raw FP8 gmm (module docstring): lhs_q [M, C] float8_e4m3fn, lhs_scale [M, ceil(C/128)]
  float32, rhs_q [G, K, N], rhs_scale [G, ceil(K/128), ceil(N/128)]; C = K -> [M, N], or with
  `transpose_rhs` C = N -> [M, K]; rows past sum(group_sizes) are zeros. With `lhs_index` [M]
  int32 (entries in [0, S)), lhs_q [S, C] / lhs_scale [S, ...] and row r of the product reads
  their row lhs_index[r]: the gmm of the gathered operands without the gathered copy.

  With `quantize_out` (a QUANTIZE_OUT name) it returns (out, q, scale): also act(out) in 1 x 128
  tiles, the bits of `triton_fp8_quant.quantize_rows(epilogue.activate(name, out))` up to the
  activation's rounding, written by the epilogue from the tile it holds (the next FP8 product's
  operand without a pass over out). Its tile is `quantizing_tile`'s: 128 columns wide where the
  given one's column parts are not whole scale pieces."""
  what = "triton fp8 gmm" + ("^T" if transpose_rhs else "")
  src = lhs_q.shape[0]
  m = src if lhs_index is None else lhs_index.shape[0]
  g, k, n = rhs_q.shape
  kc, no = (n, k) if transpose_rhs else (k, n)
  _check(what, "lhs_q", lhs_q, (src, kc), DTYPE)
  _check(what, "lhs_scale", lhs_scale, (src, _cdiv(kc, TILE)), jnp.float32)
  if lhs_index is not None and (lhs_index.ndim != 1 or not jnp.issubdtype(lhs_index.dtype, jnp.integer)):
    raise ValueError(f"{what}: lhs_index is {jnp.dtype(lhs_index.dtype).name}{list(lhs_index.shape)}, "
                     "expected an integer vector (a product row's source row)")
  _check(what, "rhs_q", rhs_q, (g, k, n), DTYPE)
  kb, nb = _cdiv(k, TILE), _cdiv(n, TILE)
  _check(what, "rhs_scale", rhs_scale, (g, kb, nb), jnp.float32)
  _check_device(what)
  op = "gmm_t" if transpose_rhs else "gmm"
  cfg = config or config_for(op, kc, no)
  out_shape = jax.ShapeDtypeStruct((m, no), jnp.dtype(out_dtype))
  kernel, extra = _fp8_gmm_kernel, {}
  if quantize_out is not None:
    if quantize_out not in QUANTIZE_OUT:
      raise ValueError(f"{what}: quantize_out={quantize_out!r}; the epilogue quantises act(out) for "
                       f"{', '.join(QUANTIZE_OUT)}")
    cfg = quantizing_tile(op, m, kc, no, g, cfg)
    kernel, extra = _fp8_gmm_quant_kernel, dict(QB=_cdiv(no, TILE), Q_ACT=QUANTIZE_OUT[quantize_out])
    out_shape = (out_shape, jax.ShapeDtypeStruct((m, no), DTYPE),
                 jax.ShapeDtypeStruct((m, _cdiv(no, TILE)), jnp.float32))
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
  out = _launch(kernel, grid, (lhs_q, lhs_scale, rhs_q, rhs_scale, sizes, index), out_shape,
                HAS_INDEX=lhs_index is not None, M=m, KC=kc, NO=no, KB=_cdiv(kc, TILE), G=g,
                s_bg=strides[0], s_bk=strides[1], s_bn=strides[2], s_sg=s_strides[0],
                s_sk=s_strides[1], s_sn=s_strides[2], **launch, **extra)
  return tuple(out) if quantize_out is not None else out


available = gpu_available

# The activations whose FP8 tiles the epilogue writes (`quantize_out`), by the kernels' code
# (triton_gmm._act's; SiLU through tl.sigmoid, not the tanh.approx form, to stay within rounding of
# XLA's activation, which the unfused path applies).
QUANTIZE_OUT = dict(triton_gmm.FUSED_ACTIVATIONS)

FP8_GMM = triton_fp8_gmm
