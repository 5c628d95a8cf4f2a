"""CPU tests of the FP8 grouped matmul in Pallas Mosaic GPU (kernels/gmm/mosaic_fp8_gmm.py): its tiles,
the shapes it takes, the hand-off of the others; the kernel under the Mosaic GPU interpreter against
the emulation (`umoe_jax.ops.fp8.emulated_gmm`) on fresh random operands whose scale pieces differ by
orders of magnitude (a scale read for the wrong chunk, row or weight block is far off): ragged and empty
groups, rows past the groups, M not a multiple of 8, several column tiles to one weight block, both
layouts, zero pieces and NaN; and the hardware path (wgmma accumulators, TMA boxes) lowered for CUDA.
GPU runs: tests/gpu/test_mosaic_fp8_gpu.py.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.gmm import mosaic_fp8_gmm as mf
from mgpu_interpret import fp8_partials_on_smem, mosaic_interpreter
from test_fp8_triton import _loop_gmm
from umoe_jax.ops import fp8

pytestmark = pytest.mark.skipif(not mf.HAVE_MGPU_FP8,
                                reason="this jax lacks the Pallas Mosaic GPU API the FP8 kernel uses")


def test_tiles_and_shared_memory():
  # stages x (A [64, 256] + B [128, 256] e4m3 + the rows' scales [2, 64] float32) + a bf16 64 x 128 tile
  assert mf.shared_memory(mf.Fp8Tile(64, 128, 3, 1)) == 3 * (64 * 256 + 128 * 256 + 2 * 64 * 4) + 64 * 128 * 2
  cands = mf.candidates()
  assert cands[0] == mf.DEFAULT and cands[1] == mf.Fp8Tile(64, 128, 3, 1, overlap=False)
  assert len(set(cands)) == len(cands) > 5
  # tiles that load ahead (stages >= 3) before those that cannot, so tile_for takes one
  first_two = next(i for i, t in enumerate(cands) if t.stages == 2)
  assert all(t.stages == 2 for t in cands[first_two:])
  for t in cands:
    mf.check_tile(t)
    assert t.ctas_per_sm * (mf.shared_memory(t) + mf.SMEM_RESERVED) <= mf.SMEM_LIMIT
  assert any(t.ctas_per_sm == 2 for t in cands) and any(t.bn == 64 for t in cands)
  for bad in (mf.Fp8Tile(32, 128), mf.Fp8Tile(64, 256), mf.Fp8Tile(128, 128), mf.Fp8Tile(64, 128, 1),
              mf.Fp8Tile(64, 128, 4, 2), mf.Fp8Tile(64, 128, 3, 0)):
    with pytest.raises(ValueError, match="mosaic FP8 gmm tile"):
      mf.check_tile(bad)
  with pytest.raises(ValueError, match="asks"):   # fits a bf16 output, not a float32 one
    mf.check_tile(mf.Fp8Tile(128, 64, 4, 1), out_bytes=4)


def test_shapes_it_takes():
  # output columns in whole tiles, each in one weight block; any contraction (padded to whole chunks)
  assert mf.supported(768, 192, mf.Fp8Tile(64, 64)) and not mf.supported(768, 192, mf.Fp8Tile(64, 128))
  assert mf.supported(2048, 512) and mf.supported(512, 2048) and mf.supported(192, 768)
  assert mf.supported(200, 128) and not mf.supported(0, 128)
  assert not mf.supported(256, 100) and not mf.supported(256, 0)
  assert mf.tile_for(2048, 512) == mf.DEFAULT and mf.tile_for(192, 768) == mf.DEFAULT
  assert mf.tile_for(256, 100) == mf.DEFAULT   # taken by none: the default, for the hand-off
  base = mf.tile_for(768, 192)
  assert base.bn == 64 and base.stages >= 3 and mf.supported(768, 192, base) and base in mf.candidates()


def _operands(rng, m, kc, no, g, transpose):
  """Quantised operands whose pieces' magnitudes differ by up to e^6 (every row tile and weight block
  its own scale), and rhs [G, K, N] in the layout the product reads."""
  x = rng.standard_normal((m, kc)) * np.exp(rng.uniform(-3, 3, (m, -(-kc // 128)))).repeat(
      128, axis=1)[:, :kc]
  shape = (g, no, kc) if transpose else (g, kc, no)
  w = rng.standard_normal(shape) * np.exp(rng.uniform(-3, 3, (g, 1, 1)))
  w *= np.exp(rng.uniform(-2, 2, (g, shape[1] // 64 + 1, shape[2] // 64 + 1))).repeat(
      64, axis=1)[:, :shape[1]].repeat(64, axis=2)[:, :, :shape[2]]
  lq, ls = fp8.quantize_tiles(jnp.asarray(x, jnp.float32), axis=1)
  wq, ws = fp8.quantize_blocks(jnp.asarray(w, jnp.float32))
  return lq, ls, wq, ws


CASES = {  # M, contraction, output width, group sizes, tile
    # M % 8 != 0, empty groups, a group of 2 rows inside a row block, 8 rows past the groups
    "ragged": (141, 512, 128, [0, 61, 2, 0, 70], mf.Fp8Tile(64, 64, 2, 1)),
    # output 192 in 64-wide tiles: two tiles in weight block 0, one in block 1; three pipeline steps
    "base-up": (130, 768, 192, [50, 80], mf.Fp8Tile(64, 64, 2, 2)),
    # 128-row tiles over 64 columns; one step (the last chunk read after the pipeline only)
    "tall": (200, 256, 128, [7, 0, 150, 43], mf.Fp8Tile(128, 64, 2, 1)),
    # 128-wide column tiles (one weight block each), every wgmma waited for at once
    "wide": (96, 512, 256, [40, 56], mf.Fp8Tile(64, 128, 2, 1, overlap=False)),
    # every TMA box inside its arrays (READS_PAST "raise"): the zero tail's product reads the
    # clamped last group's weights, not past them
    "inside": (128, 512, 128, [60, 0, 60], mf.Fp8Tile(64, 128, 3, 1)),
    # fewer rows than a tile (padded to one)
    "tiny": (20, 256, 128, [5, 0, 10], mf.Fp8Tile(64, 128, 3, 1)),
    # contractions of part chunks (padded to whole ones) and part steps (the last step's second
    # chunk past the array: TMA's zero fill, ZERO_FILL): a chunk and a half-empty one (UMoE-base's
    # 192); two and a half chunks; three chunks (an empty fourth)
    "k192": (150, 192, 256, [70, 0, 72], mf.Fp8Tile(64, 128, 2, 1)),
    "k336": (90, 336, 128, [30, 60], mf.Fp8Tile(64, 64, 2, 2)),
    "k384": (100, 384, 128, [60, 40], mf.Fp8Tile(128, 64, 3, 1)),
}
# What the interpreter gives a read past an array (`mgpu_interpret.mosaic_interpreter`): NaN, but
# zeros where operand boxes run past the contraction, as TMA's (and so then for memory never
# written), and an error where no box may.
READS_PAST = {"k336": "zero", "k384": "zero", "inside": "raise"}


def _case_operands(case, transpose, special=False):
  m, kc, no, gs, _ = CASES[case]
  rng = np.random.default_rng(abs(hash((case, transpose))) % 2**31)
  lq, ls, wq, ws = _operands(rng, m, kc, no, len(gs), transpose)
  if special:
    lq = lq.at[3, :128].set(0)                   # a zero piece: scale 0
    ls = ls.at[3, 0].set(0.0)
    ls = ls.at[5, 1].set(jnp.nan)                 # a NaN row-tile scale: row 5 all NaN
    ws = ws.at[-1, 0, 0].set(jnp.nan)             # a NaN weight block: the last group's first 128 columns
  return lq, ls, wq, ws


def _run(monkeypatch, case, transpose, special=False):
  """(the kernel's output under the interpreter, float32, the emulation's, rows in the groups)."""
  mosaic_interpreter(monkeypatch, reads_past=READS_PAST.get(case, "nan"))
  fp8_partials_on_smem(monkeypatch, mf)
  _, _, _, gs, tile = CASES[case]
  lq, ls, wq, ws = _case_operands(case, transpose, special)
  gsa = jnp.asarray(gs, jnp.int32)
  out = mf.mosaic_fp8_gmm(lq, ls, wq, ws, gsa, transpose_rhs=transpose, out_dtype=jnp.float32,
                          tile=tile)
  want = fp8.emulated_gmm(lq, ls, wq, ws, gsa, transpose_rhs=transpose, out_dtype=jnp.float32)
  return np.asarray(out), np.asarray(want), sum(gs)


@pytest.mark.parametrize("transpose", [False, True], ids=["gmm", "gmm_t"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_in_interpreter_matches_emulation(monkeypatch, case, transpose):
  out, want, rows = _run(monkeypatch, case, transpose)
  assert out.shape == want.shape
  assert np.all(out[rows:] == 0), "rows past the groups are zero"
  assert np.all(np.isfinite(out))
  # the same chunk products in float32, added in another order: rounding only, against the row's
  # largest term (a wrong scale is off by e^2 or more)
  scale = np.abs(want).max(axis=1, keepdims=True) + 1e-30
  np.testing.assert_array_less(np.abs(out - want) / scale, 1e-5)


def _loop(lq, ls, wq, ws, gs, transpose):
  """`test_fp8_triton._loop_gmm` (float64, one product a group, rows past the groups zero: where
  XLA's grouped product lets a NaN of one group reach every row, this keeps it in its group) on the
  dequantised operands."""
  return _loop_gmm(np.asarray(fp8.dequantize_tiles(lq, ls, axis=1)),
                   np.asarray(fp8.dequantize_blocks(wq, ws)), np.asarray(gs), transpose)


@pytest.mark.parametrize("transpose", [False, True], ids=["gmm", "gmm_t"])
def test_zero_pieces_and_nan_scales(monkeypatch, transpose):
  out, _, rows = _run(monkeypatch, "ragged", transpose, special=True)
  want = _loop(*_case_operands("ragged", transpose, special=True), CASES["ragged"][3], transpose)
  nan = np.isnan(want)
  assert nan[5].all() and nan[rows - 1].all() and not nan[:rows].all()
  np.testing.assert_array_equal(np.isnan(out), nan)   # NaN exactly where the float64 loop has it
  ok = ~nan
  scale = np.abs(np.where(ok, want, 0)).max(axis=1, keepdims=True) + 1e-30
  assert np.all(np.abs(np.where(ok, out - want, 0)) / scale < 1e-5)
  assert np.all(out[rows:] == 0)


def test_shapes_it_does_not_take_go_to_triton(monkeypatch):
  from kernels.gmm import triton_fp8_gmm
  rng = np.random.default_rng(1)
  lq, ls, wq, ws = _operands(rng, 64, 256, 96, 2, False)   # 96 columns: no whole tile of 64 or 128
  gs = jnp.asarray([30, 34], jnp.int32)
  monkeypatch.setattr(triton_fp8_gmm, "available", lambda: False)
  with pytest.raises(ValueError, match="contraction 256 / output width 96 not taken"):
    mf.mosaic_fp8_gmm(lq, ls, wq, ws, gs)
  calls = []

  def triton(*args, **kw):
    calls.append(kw)
    return fp8.emulated_gmm(*args, **kw)

  monkeypatch.setattr(triton_fp8_gmm, "available", lambda: True)
  monkeypatch.setattr(triton_fp8_gmm, "triton_fp8_gmm", triton)
  out = mf.mosaic_fp8_gmm(lq, ls, wq, ws, gs, out_dtype=jnp.float32)
  assert calls == [dict(transpose_rhs=False, out_dtype=jnp.dtype(jnp.float32))]
  assert out.shape == (64, 96)
  assert mf.mosaic_fp8_gmm(lq[:0], ls[:0], wq, ws, gs).shape == (0, 96)   # no rows: nothing to launch


@pytest.mark.parametrize("transpose", [False, True], ids=["gmm", "gmm_t"])
@pytest.mark.parametrize("m,kc,no,tile", [(1000, 512, 256, mf.DEFAULT), (1000, 192, 768, mf.DEFAULT),
                                          (1001, 200, 128, mf.DEFAULT),
                                          (1000, 768, 192, mf.Fp8Tile(64, 64, 2, 2)),
                                          (40, 384, 256, mf.Fp8Tile(128, 64, 3, 1, overlap=False))],
                         ids=str)
def test_hardware_path_lowers_for_cuda(transpose, m, kc, no, tile):
  """The kernel as a GPU runs it (wgmma accumulators and their stores, TMA boxes whose shapes must
  fit the arrays: M padded to 8, the contraction to whole chunks) through Pallas' Mosaic GPU
  lowering, on this machine: what the interpreter's stand-ins above do not reach. (The wait counts
  lower whatever they are: only the GPU tests see them.)"""
  g = 4
  f8 = jnp.float8_e4m3fn
  kb, nb = -(-kc // 128), -(-no // 128)
  args = (jax.ShapeDtypeStruct((m, kc), f8), jax.ShapeDtypeStruct((m, kb), jnp.float32),
          jax.ShapeDtypeStruct((g, no, kc) if transpose else (g, kc, no), f8),
          jax.ShapeDtypeStruct((g, nb, kb) if transpose else (g, kb, nb), jnp.float32),
          jax.ShapeDtypeStruct((g,), jnp.int32))
  fn = lambda *a: mf.mosaic_fp8_gmm(*a, transpose_rhs=transpose, out_dtype=jnp.bfloat16, tile=tile)
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def test_registered_as_the_mosaic_backends_fp8_form():
  from umoe_jax.ops import gmm_backends as gb
  from umoe_jax.ops.fp8_gmm import AUTO_FP8, fp8_backends
  gb.register_builtin_kernels()
  if "mosaic" not in gb.BACKENDS.names():
    pytest.skip("the mosaic backend is not registered in this jax")
  assert gb.BACKENDS.get("mosaic").fp8_gmm is mf.mosaic_fp8_gmm
  assert "mosaic" in fp8_backends() and "mosaic" not in AUTO_FP8   # auto takes it once GPU-timed


def test_mosaic_products_switch_takes_the_fp8_products_only(monkeypatch):
  """fp8_gmm.MOSAIC_PRODUCTS: the forward and input-gradient products go to the mosaic backend's FP8
  form, everything else stays the chosen backend's: its quantiser, its weight gradient (tgmm), its
  epilogue quantisation never asked of the mosaic form (which has none: act(out) by a pass and
  the chosen quantiser); rows read through an index are gathered for the mosaic form. Both
  backends here are recording stand-ins over the emulation; a mosaic backend that is not available
  takes nothing."""
  import dataclasses
  from umoe_jax.ops import fp8_gmm as F
  from umoe_jax.ops import gmm_backends as gb
  from umoe_jax.ops import ragged
  gb.register_builtin_kernels()
  calls = []

  def record(name, fn):
    def run(*args, **kw):
      calls.append((name, tuple(sorted(kw))))
      return fn(*args, **kw)
    return run

  xla = gb.BACKENDS.get("xla")
  strip = lambda fn: lambda *a, quantize_out=None, lhs_index=None, **kw: fn(*a, **kw)
  chosen = dataclasses.replace(
      xla, tgmm=record("chosen.tgmm", ragged.xla_tgmm),
      fp8_gmm=record("chosen.fp8_gmm", strip(fp8.emulated_gmm)),
      fp8_quantize=record("chosen.quantize", lambda a: fp8.quantize_tiles(a, axis=1)),
      fp8_quantize_out=("silu",))
  mosaic = dataclasses.replace(xla, fp8_gmm=record("mosaic.fp8_gmm", fp8.emulated_gmm),
                               available=lambda: True)
  entries = gb.BACKENDS._entries
  monkeypatch.setitem(entries, "chosen", chosen)
  monkeypatch.setitem(entries, "mosaic", mosaic)
  keys = jax.random.split(jax.random.key(5), 4)
  x = jax.random.normal(keys[0], (40, 256), jnp.float32)
  w = jax.random.normal(keys[1], (3, 256, 128), jnp.float32)
  dy = jax.random.normal(keys[2], (40, 128), jnp.float32)
  gs = jnp.asarray([10, 0, 26], jnp.int32)

  def run():
    y, pull = jax.vjp(lambda a, b: F._differentiable("chosen", False, None)(a, b, gs), x, w)
    return (y, *pull(dy))
  want = run()
  names = lambda: [n for n, _ in calls]
  assert sorted(names()) == ["chosen.fp8_gmm", "chosen.fp8_gmm", "chosen.quantize", "chosen.quantize",
                             "chosen.tgmm"]                         # off: all the chosen backend's
  calls.clear()
  monkeypatch.setattr(F, "MOSAIC_PRODUCTS", True)
  got = run()
  assert sorted(names()) == ["chosen.quantize", "chosen.quantize", "chosen.tgmm", "mosaic.fp8_gmm",
                             "mosaic.fp8_gmm"]
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  calls.clear()
  q, s = F.quantize("chosen", x)
  index = jnp.asarray(np.random.default_rng(0).permutation(40), jnp.int32)
  out = F.quantized_gmm("chosen", q, s, w, gs, False, jnp.float32, lhs_index=index)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(
      fp8.emulated_gmm(q[index], s[index], *fp8.quantize_blocks(w), gs, transpose_rhs=False,
                       out_dtype=jnp.float32)))
  out2, q2, _ = F.quantized_gmm_out("chosen", q, s, w, gs, jnp.float32, "silu")
  assert names() == ["chosen.quantize", "mosaic.fp8_gmm", "mosaic.fp8_gmm", "chosen.quantize"]
  assert all("lhs_index" not in kw and "quantize_out" not in kw for _, kw in calls)
  np.testing.assert_array_equal(np.asarray(q2), np.asarray(fp8.quantize_tiles(jax.nn.silu(out2), axis=1)[0]))
  calls.clear()
  monkeypatch.setitem(entries, "mosaic", dataclasses.replace(mosaic, available=lambda: False))
  F.quantized_gmm("chosen", q, s, w, gs, False, jnp.float32)
  assert names() == ["chosen.fp8_gmm"]
