"""Grouped matmul kernels in Pallas Mosaic GPU (Hopper: wgmma, TMA, pipelined), backend "mosaic".

  gmm      out[rows of g] = a[rows of g] @ w[g]        (a [M,K], w [G,K,N] -> [M,N])
  gmm^T    out[rows of g] = a[rows of g] @ w[g].T      (a [M,N], w [G,K,N] -> [M,K])
  tgmm     out[g] = a[rows of g].T @ b[rows of g]      (a [M,K], b [M,N] -> [G,K,N])

gmm / gmm^T: a persistent kernel (one program per SM) walks a work list of (row block, segment) items
computed on device by `kernels.schedule.row_block_items` (segments = groups + the zero tail past
sum(group_sizes)), times the output column tiles. Each item runs a TMA + wgmma pipeline over the
contraction (A block at an aligned row offset, B = w[g] tile, transposed in shared memory for gmm^T), then
writes only its rows [lo, hi) of the block: TMA stores need static box sizes, so the row count is
decomposed into powers of two, one store each (at most log2(bm)+1 stores). Tail items skip the main
loop and write zeros. The work list is looked up (one scalar load each), not recomputed per tile.

tgmm: a persistent loop over (group, K tile, N tile); the group's rows are covered by aligned blocks of
`bk` rows, and the first and last blocks are masked in shared memory (rows outside the group zeroed in
both operands) before the wgmma; an empty group writes zeros.

Rows are padded to a multiple of 8 when M is not (the TMA tiling needs it; measured on the H200:
M = 97, 700, 1337 were refused without it). Requirements (else the call falls back to the Triton backend when available, or to XLA): contraction
and output widths divisible by the tile sizes chosen in kernels/gmm/tuning.py, 16-bit inputs.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels.gmm import schedule, tuning
from umoe_jax.ops import ragged

try:
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  HAVE_MGPU = all(hasattr(plgpu, a) for a in (
      "kernel", "emit_pipeline", "wgmma", "ACC", "nd_loop", "copy_smem_to_gmem", "transpose_ref"))
except Exception:  # noqa: BLE001
  HAVE_MGPU = False


def _num_sms() -> int:
  try:
    return int(getattr(jax.devices()[0], "core_count", 132) or 132)
  except Exception:  # noqa: BLE001
    return 132


def _store_rows(acc, o_gmem, row0, lo, hi, col0, bm, bn, m_rows, out_dtype):
  """Writes rows [lo, hi) of the (bm, bn) tile `acc` to o_gmem[row0 + lo : row0 + hi, col0 : col0 + bn]."""

  @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bm, bn), dtype=out_dtype))
  def _(o_smem):
    o_smem[...] = acc.astype(out_dtype)
    plgpu.commit_smem()
    count = hi - lo
    start = lo
    p = 1 << (min(bm, m_rows).bit_length() - 1)  # largest power of two <= min(bm, M)
    while p >= 1:
      size = p

      @pl.when((count & size) != 0)
      def _():
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(start, size)],
                                o_gmem.at[pl.ds(row0 + start, size), pl.ds(col0, bn)])

      start = start + (count & size)
      p //= 2
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _gmm_kernel_call(lhs, rhs, group_sizes, transpose_rhs, out_dtype, cfg):
  m, kc = lhs.shape
  g, k, n = rhs.shape
  no = k if transpose_rhs else n
  bm, bn, bk = cfg.bm, cfg.bn, cfg.bk
  n_tiles = no // bn
  k_steps = kc // bk
  stages = max(2, min(cfg.num_stages, k_steps))
  n_items = schedule.max_row_block_items(m, bm, g)
  items = schedule.row_block_items(group_sizes, m, bm)

  def body(ig_ref, ib_ref, lo_ref, hi_ref, lhs_gmem, rhs_gmem, o_gmem):
    @plgpu.nd_loop((n_items * n_tiles,), collective_axes="sm")
    def _loop(info):
      idx = info.index[0]
      t = lax.div(idx, jnp.int32(n_tiles))
      ni = lax.rem(idx, jnp.int32(n_tiles))
      grp = ig_ref[t]
      blk = ib_ref[t]
      lo = lo_ref[t]
      hi = hi_ref[t]

      @pl.when(hi > lo)
      def _():
        def acc_scope(acc_ref):
          def step(_, a_smem, b_smem):
            b = plgpu.transpose_ref(b_smem, (1, 0)) if transpose_rhs else b_smem
            plgpu.wgmma(acc_ref, a_smem, b)

          @pl.when(grp < g)
          def _():
            plgpu.emit_pipeline(
                step,
                grid=(k_steps,),
                in_specs=[
                    plgpu.BlockSpec((bm, bk), lambda kk: (blk, kk), delay_release=1),
                    plgpu.BlockSpec((bn, bk) if transpose_rhs else (bk, bn),
                                    (lambda kk: (ni, kk)) if transpose_rhs else (lambda kk: (kk, ni)),
                                    delay_release=1),
                ],
                max_concurrent_steps=stages,
            )(lhs_gmem, rhs_gmem.at[jnp.minimum(grp, g - 1)])
          return acc_ref[...]

        acc = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn)))
        _store_rows(acc, o_gmem, blk * bm, lo, hi, ni * bn, bm, bn, m, out_dtype)

  kernel = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((m, no), out_dtype),
      grid=(_num_sms(),),
      grid_names=("sm",),
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )
  return kernel(*items, lhs, rhs)


def _tgmm_kernel_call(lhs, rhs, group_sizes, num_groups, out_dtype, cfg):
  m, k = lhs.shape
  n = rhs.shape[1]
  g = num_groups
  bko, bn, br, stages = cfg.bm, cfg.bn, cfg.bk, max(2, cfg.num_stages)
  k_tiles, n_tiles = k // bko, n // bn
  starts, ends, first, nblk = schedule.group_row_blocks(group_sizes, m, br)

  def body(st_ref, en_ref, fb_ref, nb_ref, lhs_gmem, rhs_gmem, o_gmem):
    @plgpu.nd_loop((g * k_tiles * n_tiles,), collective_axes="sm")
    def _loop(info):
      idx = info.index[0]
      gi = lax.div(idx, jnp.int32(k_tiles * n_tiles))
      r = lax.rem(idx, jnp.int32(k_tiles * n_tiles))
      ki = lax.div(r, jnp.int32(n_tiles))
      ni = lax.rem(r, jnp.int32(n_tiles))
      st, en, fb, nb = st_ref[gi], en_ref[gi], fb_ref[gi], nb_ref[gi]

      def acc_scope(acc_ref):
        def step(idxs, a_smem, b_smem):
          j = idxs[0]
          row0 = (fb + j) * br

          @pl.when((j == 0) | (j == nb - 1))
          def _():
            # Zero the rows of this block that lie outside [st, en) in both operands.
            for ref, width in ((a_smem, bko), (b_smem, bn)):
              rows = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (br, width), 0),
                                       plgpu.Layout.WGMMA) + row0
              keep = ((rows >= st) & (rows < en)).astype(ref.dtype)
              ref[...] = ref[...] * keep
            plgpu.commit_smem()

          plgpu.wgmma(acc_ref, plgpu.transpose_ref(a_smem, (1, 0)), b_smem)

        @pl.when(nb > 0)
        def _():
          plgpu.emit_pipeline(
              step,
              grid=(nb,),
              in_specs=[
                  plgpu.BlockSpec((br, bko), lambda j: (fb + j, ki), delay_release=1),
                  plgpu.BlockSpec((br, bn), lambda j: (fb + j, ni), delay_release=1),
              ],
              max_concurrent_steps=stages,
          )(lhs_gmem, rhs_gmem)
        return acc_ref[...]

      acc = pl.run_scoped(acc_scope, plgpu.ACC((bko, bn)))

      @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bko, bn), dtype=out_dtype))
      def _(o_smem):
        o_smem[...] = acc.astype(out_dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[gi, pl.ds(ki * bko, bko), pl.ds(ni * bn, bn)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  kernel = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((g, k, n), out_dtype),
      grid=(_num_sms(),),
      grid_names=("sm",),
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )
  return kernel(starts, ends, first, nblk, lhs, rhs)


# ----------------------------------------------------------------------------------------------


def gmm_supported(m, kc, no, dtype, cfg) -> bool:
  return (jnp.dtype(dtype).itemsize == 2 and kc % cfg.bk == 0 and no % cfg.bn == 0
          and cfg.bm in (64, 128) and m >= cfg.bm)


def tgmm_supported(m, k, n, dtype, cfg) -> bool:
  return (jnp.dtype(dtype).itemsize == 2 and k % cfg.bm == 0 and n % cfg.bn == 0
          and cfg.bk in (32, 64, 128) and m >= cfg.bk)


def _fallback():
  """What runs a shape these kernels do not take: the Triton kernels where they run, else XLA."""
  from kernels.gmm import triton_gmm
  if triton_gmm.available():
    return triton_gmm.triton_gmm, triton_gmm.triton_tgmm
  return ragged.xla_gmm, ragged.xla_tgmm


_ROW_ALIGN = 8


def _pad_rows(x, pad):
  return jnp.pad(x, ((0, pad), (0, 0))) if pad else x


def mgpu_gmm(lhs, rhs, group_sizes, *, transpose_rhs=False, out_dtype=None, config=None):
  m, kc = lhs.shape
  g, k, n = rhs.shape
  no = k if transpose_rhs else n
  out_dtype = jnp.dtype(out_dtype or lhs.dtype)
  cfg = config or tuning.lookup("mosaic", "gmm_t" if transpose_rhs else "gmm", m, kc, no, g)
  if not gmm_supported(m + (-m) % _ROW_ALIGN, kc, no, lhs.dtype, cfg):
    return _fallback()[0](lhs, rhs, group_sizes, transpose_rhs=transpose_rhs, out_dtype=out_dtype)
  # TMA's (8, swizzle) tiling wants the row count a multiple of 8: pad (rows past sum(group_sizes)
  # are the zero tail anyway) and cut the padding off the result. Free when M % 8 == 0.
  pad = (-m) % _ROW_ALIGN
  out = _gmm_kernel_call(_pad_rows(lhs, pad), rhs.astype(lhs.dtype), group_sizes.astype(jnp.int32),
                         transpose_rhs, out_dtype, cfg)
  return out[:m] if pad else out


def mgpu_tgmm(lhs, rhs, group_sizes, *, num_groups=None, out_dtype=None, config=None):
  m, k = lhs.shape
  n = rhs.shape[1]
  g = int(num_groups or group_sizes.shape[0])
  out_dtype = jnp.dtype(out_dtype or lhs.dtype)
  cfg = config or tuning.lookup("mosaic", "tgmm", m, k, n, g)
  if not tgmm_supported(m + (-m) % _ROW_ALIGN, k, n, lhs.dtype, cfg):
    return _fallback()[1](lhs, rhs, group_sizes, num_groups=g, out_dtype=out_dtype)
  pad = (-m) % _ROW_ALIGN  # padded rows lie outside every group: never accumulated
  return _tgmm_kernel_call(_pad_rows(lhs, pad), _pad_rows(rhs.astype(lhs.dtype), pad),
                           group_sizes.astype(jnp.int32), g, out_dtype, cfg)


GMM = mgpu_gmm
TGMM = mgpu_tgmm


def available() -> bool:
  if not HAVE_MGPU:
    return False
  try:
    d = jax.devices()[0]
    if d.platform != "gpu":
      return False
    cc = getattr(d, "compute_capability", None)  # wgmma kernels: Hopper (sm_90) only
    return str(cc).startswith("9") if cc else "H100" in d.device_kind or "H200" in d.device_kind
  except Exception:  # noqa: BLE001
    return False
