"""The FP8 grouped matmul in Pallas Mosaic GPU (Hopper wgmma on e4m3 operands), the `mosaic`
backend's FP8 form: the same product as `kernels.gmm.triton_fp8_gmm` (operands quantised by
`umoe_jax.ops.fp8`: rows in 1 x 128 tiles along the contraction, weights in 128 x 128 blocks),
float32 accumulation promoted every 128 elements of the contraction.

Why a second kernel: each 128-wide chunk's partial product must be scaled and added to the float32
accumulator on the CUDA cores, and in the Triton kernel that promotion waits for the chunk's MMA
and the next MMA waits for the promotion, so a chunk costs its promotion as well as its MMA.
Here the partial products alternate between two wgmma accumulators: chunk k+1's wgmma is issued
before chunk k's partial is read (`wgmma_accumulator_load(..., wait_n=1)` waits for chunk k only),
so chunk k's promotion runs while the tensor cores compute chunk k+1. Three float32 tiles live in
registers (two partials and the sum), which bounds a warpgroup's tile at bm * bn <= 8192.

FP8 wgmma reads both operands contraction-major, so the weights go in as [G, N_out, K_contract]: the
transposed product (gmm^T) takes `rhs_q` as it is, the plain product a transposed copy (an XLA pass
over the FP8 weights, one byte an element each way). Scales: the rows' per chunk are staged into
shared memory with the operands (transposed to [chunks, M] so a chunk's row scales are one TMA box);
a tile's column part lies in one 128-column weight block (bn divides 128), whose scale per chunk is
one scalar read.

A contraction that is not whole chunks is padded with zeros to the next one (TMA's swizzled boxes
take an array dimension only in whole 128-byte tiles): UMoE-base's 192 becomes a chunk and a
half-empty one, at the price of an XLA pass that copies the FP8 rows and the weights padded. One
that is not whole pipeline steps (two chunks) ends in a step whose second chunk lies past it: TMA
fills its operands and row scales with zeros. What it takes (else `mosaic_fp8_gmm` hands the call
to the Triton FP8 kernel): an output of whole `bn`-wide tiles. Fewer rows than a tile are padded to
one.
The persistent schedule and the row-block work list are `kernels.gmm.mosaic_gmm`'s.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from kernels.gmm import mosaic_gmm, schedule

try:
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  HAVE_MGPU_FP8 = mosaic_gmm.HAVE_MGPU and all(
      hasattr(plgpu, a) for a in ("wgmma_accumulator_load",))
except Exception:  # noqa: BLE001
  HAVE_MGPU_FP8 = False

TILE = 128                      # umoe_jax.ops.fp8.TILE (kernels/ does not import umoe_jax.ops)
DTYPE = jnp.dtype(jnp.float8_e4m3fn)
STEP_K = 2 * TILE               # two chunks a pipeline step: one per partial accumulator
MAX_TILE_ELEMS = 8192           # bm * bn: three float32 tiles in one warpgroup's registers


SMEM_LIMIT = 232448             # the shared memory one block may ask on an H100 / H200 (227 KiB)
SMEM_RESERVED = 1024            # the driver's reservation per resident block


@dataclasses.dataclass(frozen=True)
class Fp8Tile:
  """bm x bn output tile of one warpgroup; `stages` shared-memory slots of a pipeline step (a slot
  is refilled only after the step after its own, so stages - 2 steps load ahead: 2 leaves each load
  exposed); `ctas_per_sm` persistent programs an SM (two let one program's epilogue and promotion
  overlap the other's MMAs, at the price of fewer stages); `overlap`: chunk k's promotion while
  chunk k+1's wgmma runs, or (False, for timing the overlap itself) each wgmma waited for at once."""
  bm: int = 64
  bn: int = 128
  stages: int = 3
  ctas_per_sm: int = 1
  overlap: bool = True


DEFAULT = Fp8Tile()


def shared_memory(t: Fp8Tile, out_bytes: int = 2) -> int:
  """Bytes of shared memory one program asks: `stages` x (A [bm, 256] + B [bn, 256] in e4m3 and
  the rows' scales [2, bm] float32), and the output tile staged for its TMA store."""
  return t.stages * (t.bm * STEP_K + t.bn * STEP_K + 2 * t.bm * 4) + t.bm * t.bn * out_bytes


def check_tile(t: Fp8Tile, out_bytes: int = 2) -> None:
  """ValueError naming a tile this kernel cannot run (for an output of `out_bytes` an element)."""
  smem = t.ctas_per_sm * (shared_memory(t, out_bytes) + SMEM_RESERVED)
  if (t.bm not in (64, 128) or t.bn not in (64, 128) or t.bm * t.bn > MAX_TILE_ELEMS
      or t.stages < 2 or t.ctas_per_sm < 1 or smem > SMEM_LIMIT):
    raise ValueError(f"mosaic FP8 gmm tile {t}: bm and bn in (64, 128), bm * bn <= {MAX_TILE_ELEMS}, "
                     f"stages >= 2, ctas_per_sm >= 1, ctas_per_sm * shared memory <= {SMEM_LIMIT} "
                     f"bytes (asks {smem})")


def candidates() -> list[Fp8Tile]:
  """The tiles `bench/gmm.py --sweep-fp8` times for this kernel: DEFAULT, DEFAULT without the
  overlap, then per tile shape the ones that load ahead (stages >= 3) before those that cannot."""
  out = [DEFAULT, dataclasses.replace(DEFAULT, overlap=False)]
  for stages_first in (True, False):
    for bm, bn in ((64, 128), (128, 64), (64, 64)):
      for ctas in (1, 2):
        for stages in (3, 4, 6) if stages_first else (2,):
          t = Fp8Tile(bm, bn, stages, ctas)
          try:
            check_tile(t)
          except ValueError:
            continue
          if t not in out:
            out.append(t)
  return out


def supported(kc: int, no: int, t: Fp8Tile = DEFAULT) -> bool:
  """Whether the kernel takes a product of contraction kc and output width no."""
  return kc > 0 and no > 0 and no % t.bn == 0


def tile_for(kc: int, no: int) -> Fp8Tile:
  """DEFAULT where it takes the shape, else the first candidate that does (64 columns wide where the
  output is not whole 128-wide tiles: 192 at UMoE-base; one that loads ahead), else DEFAULT (the
  shape goes to Triton)."""
  return next((t for t in candidates() if supported(kc, no, t)), DEFAULT)


# The partial accumulators go through these three (the CPU tests run them on shared memory: the
# Mosaic GPU interpreter has no accumulator store).
def _partial(bm: int, bn: int):
  """A scoped float32 wgmma accumulator."""
  return plgpu.ACC((bm, bn))


def _take(acc_ref, wait_n: int):
  """acc_ref's value once at most `wait_n` wgmmas are in flight (the later ones: not its own)."""
  return plgpu.wgmma_accumulator_load(acc_ref, wait_n=wait_n)


def _clear(acc_ref) -> None:
  acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)


# Warpgroup lowering takes no implicit broadcast: each is spelt out.
def _splat(x, shape):
  return lax.broadcast_in_dim(x, shape, ())


def _rows(v, bn: int):
  """v [bm] over the columns of a [bm, bn] tile."""
  return lax.broadcast_in_dim(v, (v.shape[0], bn), (0,))


def _kernel_call(lhs_q, sa_t, rhs_t, sb_t, group_sizes, out_dtype, t: Fp8Tile, programs: int):
  """lhs_q [M, Kc] e4m3 (M % 8 == 0, Kc % 128 == 0), sa_t [Kc/128, M] f32, rhs_t [G, No, Kc] e4m3,
  sb_t [G, No/128 (ceil), Kc/128] f32 -> out [M, No]: rows of group g times rhs_t[g].T, rows past
  the groups zero."""
  m, kc = lhs_q.shape
  g, no, _ = rhs_t.shape
  bm, bn = t.bm, t.bn
  n_tiles = no // bn
  k_steps = -(-kc // STEP_K)
  n_chunks = kc // TILE   # (padded to whole chunks by mosaic_fp8_gmm)
  stages = max(2, min(t.stages, k_steps))
  n_items = schedule.max_row_block_items(m, bm, g)
  items = schedule.row_block_items(group_sizes, m, bm)
  blocks_per_scale = TILE // bn   # column tiles of one 128-column weight block
  wait = 1 if t.overlap else 0    # wgmmas left in flight when a partial is read

  def body(ig_ref, ib_ref, lo_ref, hi_ref, sb_gmem, lhs_gmem, sa_gmem, rhs_gmem, o_gmem):
    @plgpu.nd_loop((n_items * n_tiles,), collective_axes="sm")
    def _loop(info):
      idx = info.index[0]
      item = lax.div(idx, jnp.int32(n_tiles))
      ni = lax.rem(idx, jnp.int32(n_tiles))
      grp, blk, lo, hi = ig_ref[item], ib_ref[item], lo_ref[item], hi_ref[item]
      nb = lax.div(ni, jnp.int32(blocks_per_scale))   # the column tile's weight block
      gc = jnp.minimum(grp, g - 1)

      @pl.when(hi > lo)
      def _():
        def scoped(p0, p1):
          # (scoped accumulators start at zero on a GPU; the tests' shared-memory stand-ins do not)
          _clear(p0)
          _clear(p1)
          def step(idxs, a_smem, b_smem, s_smem, carry):
            acc, prev = carry       # prev: chunk 2j-1's row scales (sa * sb), in p1 until read
            j = idxs[0]
            c0 = 2 * j
            sb0 = sb_gmem[gc, nb, c0]
            # a chunk past the contraction (an odd count's last): its operands and row scales are
            # TMA's zero fill, its weight scale read clamped into the array
            sb1 = sb_gmem[gc, nb, jnp.minimum(c0 + 1, n_chunks - 1)]
            b0 = plgpu.transpose_ref(b_smem.at[:, pl.ds(0, TILE)], (1, 0))     # K-major
            b1 = plgpu.transpose_ref(b_smem.at[:, pl.ds(TILE, TILE)], (1, 0))
            plgpu.wgmma(p0, a_smem.at[:, pl.ds(0, TILE)], b0)
            # chunk 2j-1 (the last step's second) is done once at most one wgmma is in flight
            part = _take(p1, wait)
            acc = acc + part * _rows(prev, bn)
            _clear(p1)
            plgpu.wgmma(p1, a_smem.at[:, pl.ds(TILE, TILE)], b1)
            part = _take(p0, wait)         # chunk 2j
            acc = acc + part * _rows(s_smem[0, :] * _splat(sb0, (bm,)), bn)
            _clear(p0)
            return acc, s_smem[1, :] * _splat(sb1, (bm,))

          init = (jnp.zeros((bm, bn), jnp.float32), jnp.zeros((bm,), jnp.float32))
          acc, prev = plgpu.emit_pipeline(
              step,
              grid=(k_steps,),
              in_specs=[
                  plgpu.BlockSpec((bm, STEP_K), lambda kk: (blk, kk), delay_release=1),
                  plgpu.BlockSpec((bn, STEP_K), lambda kk: (ni, kk), delay_release=1),
                  plgpu.BlockSpec((2, bm), lambda kk: (kk, blk), delay_release=1),
              ],
              max_concurrent_steps=stages,
              init_carry=init,
          )(lhs_gmem, rhs_gmem.at[gc], sa_gmem)
          part = _take(p1, 0)              # the last chunk
          return acc + part * _rows(prev, bn)

        # the zero tail (grp == G) runs the clamped last group's product and writes zeros: rows
        # past the groups are rare (a dropless dispatch has none), and one code path stays simple
        acc = pl.run_scoped(scoped, _partial(bm, bn), _partial(bm, bn))
        acc = lax.select(_splat(grp < g, (bm, bn)), acc, jnp.zeros((bm, bn), jnp.float32))
        mosaic_gmm._store_rows(acc, o_gmem, blk * bm, lo, hi, ni * bn, bm, bn, m, out_dtype)

  kernel = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((m, no), out_dtype),
      grid=(programs,),
      grid_names=("sm",),
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )
  return kernel(*items, sb_t, lhs_q, sa_t, rhs_t)


def _fallback(kc: int, no: int, t: Fp8Tile):
  """The Triton FP8 kernel, for a product this one does not take; ValueError where it is absent."""
  from kernels.gmm import triton_fp8_gmm
  if triton_fp8_gmm.available():
    return triton_fp8_gmm.triton_fp8_gmm
  raise ValueError(f"mosaic FP8 gmm: contraction {kc} / output width {no} not taken (an output of "
                   f"whole {t.bn}-wide tiles) and no Triton FP8 kernel here to take it")


def mosaic_fp8_gmm(lhs_q, lhs_scale, rhs_q, rhs_scale, group_sizes, *, transpose_rhs=False,
                   out_dtype=jnp.bfloat16, tile: Fp8Tile | None = None):
  """out[rows of g] = dequant(lhs_q) @ dequant(rhs_q[g]) (rhs_q[g].T with transpose_rhs): lhs_q
  [M, Kc] e4m3 with lhs_scale [M, Kc/128], rhs_q [G, K, N] e4m3 with rhs_scale [G, K/128, N/128]
  (ceil); the GmmBackend.fp8_gmm contract (`umoe_jax.ops.gmm_backends`). `tile`: default
  `tile_for` the shape."""
  m, kc = lhs_q.shape
  g, k, n = rhs_q.shape
  no = k if transpose_rhs else n
  t = tile or tile_for(kc, no)
  out_dtype = jnp.dtype(out_dtype)
  check_tile(t, out_dtype.itemsize)
  if m == 0:
    return jnp.zeros((0, no), out_dtype)
  if not supported(kc, no, t):
    return _fallback(kc, no, t)(lhs_q, lhs_scale, rhs_q, rhs_scale, group_sizes,
                       transpose_rhs=transpose_rhs, out_dtype=out_dtype)
  # contraction-major weights [G, No, Kc] and their block scales [G, ceil(No/128), Kc/128]
  rhs_t = rhs_q if transpose_rhs else jnp.swapaxes(rhs_q, 1, 2)
  sb_t = rhs_scale if transpose_rhs else jnp.swapaxes(rhs_scale, 1, 2)
  # TMA's row tiling wants M a multiple of 8, and a row box no taller than the array (as the bf16
  # kernel, which refuses M < bm); padded rows lie past every group
  pad = max((-m) % mosaic_gmm._ROW_ALIGN, t.bm - m)
  lhs_p = mosaic_gmm._pad_rows(lhs_q, pad)
  kp = -kc % TILE                      # whole chunks (module docstring)
  if kp:
    lhs_p = jnp.pad(lhs_p, ((0, 0), (0, kp)))
    rhs_t = jnp.pad(rhs_t, ((0, 0), (0, 0), (0, kp)))
  sa_t = jnp.swapaxes(mosaic_gmm._pad_rows(lhs_scale.astype(jnp.float32), pad), 0, 1)
  programs = mosaic_gmm._num_sms() * t.ctas_per_sm
  out = _kernel_call(lhs_p, sa_t, rhs_t, sb_t.astype(jnp.float32), group_sizes.astype(jnp.int32),
                     out_dtype, t, programs)
  return out[:m] if pad else out


def available() -> bool:
  return HAVE_MGPU_FP8 and mosaic_gmm.available()


FP8_GMM = mosaic_fp8_gmm if HAVE_MGPU_FP8 else None   # (no FP8 form where jax lacks the API)
