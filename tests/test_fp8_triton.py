"""CPU tests of the FP8 Triton grouped matmul (kernels/gmm/triton_fp8_gmm.py): tiles and launch geometry,
bad operands, the triton backend's FP8 form; and the kernel itself under the Triton interpreter
(TRITON_INTERPRET=1, in a subprocess), every launch routed through `jax.pure_callback` into it, against
the emulation (`umoe_jax.ops.fp8.emulated_gmm`) on fresh random operands whose rows and columns differ
in magnitude by orders (so every scale piece has its own scale): ragged, empty and skewed groups, rows
past the groups, K and N not multiples of 128, split column tiles, both transposes, all-zero pieces,
inf and NaN, rows read through an index; then `fp8_gmm(..., backend="triton")`'s values and gradients
(the weight gradient by the bf16 tgmm kernel, under the interpreter too) against backend="xla" and the
weight gradient against a float64 loop. GPU runs: tests/gpu/test_fp8_gpu.py.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import (INTERPRETER_LOCK, exact_interpreter_cast, interpreter_loop_bounds,
                      run_in_triton_interpreter)
from kernels.gmm import triton_fp8_gmm as tf
from kernels.gmm import triton_fp8_quant as tq
from kernels.gmm import triton_gmm, tuning
from umoe_jax.ops import fp8
from umoe_jax.ops import gmm_backends as gb
from umoe_jax.ops.fp8_gmm import fp8_backend

F8 = jnp.float8_e4m3fn


def test_scale_piece_is_the_quantisers():
  assert tf.TILE == fp8.TILE == 128
  assert tf.DTYPE == jnp.dtype(fp8.DTYPE)


def test_tiles_and_launch_geometry():
  # widths: one power of two or two of them >= 16 (192 = 128 + 64), else a power of two <= 128
  assert [tf._tile_width(n) for n in (192, 128, 256, 48, 144, 40, 768, 300, 8)] == [
      192, 128, 256, 48, 144, 64, 128, 128, 16]
  cfg = tf.default_config("gmm", 768, 192)
  launch = tf.gmm_launch(1000, 768, 192, 8, cfg)
  assert (launch["BM"], launch["BN"], launch["BN2"], launch["BK"], launch["N_TILES"]) == (
      128, 128, 64, 128, 1)
  assert launch["grid"] == ((-(-1000 // 128) + 8 + 1) * 1,)  # group-aligned row tiles + the zero tail
  for bad in (tuning.TileConfig(128, 128, 64), tuning.TileConfig(128, 128, 128, persistent=1)):
    with pytest.raises(ValueError, match="FP8 gmm tile"):
      tf.gmm_launch(256, 256, 256, 2, bad)


def test_the_last_short_piece_is_one_narrower_dot():
  # (whole chunks in the loop, the tail dot's width): the last piece shorter than 128 as one dot of
  # the next power of two >= 32 (FP8 wgmma's K step), none where kc is whole pieces
  assert [tf.chunks(kc) for kc in (192, 256, 200, 136, 40, 8, 768, 128)] == [
      (1, 64), (2, 0), (1, 128), (1, 32), (0, 64), (0, 32), (6, 0), (1, 0)]
  launch = tf.gmm_launch(1000, 192, 768, 8, tf.default_config("gmm", 192, 768))
  assert (launch["KF"], launch["TAIL"]) == (1, 64)


def test_column_parts_in_one_weight_block(monkeypatch):
  # each column part (BN, then BN2) of every output tile inside one 128-column block of the weights
  assert tf.parts_in_one_block(128, 64, 1) and tf.parts_in_one_block(128, 0, 6)
  assert tf.parts_in_one_block(64, 32, 1) and tf.parts_in_one_block(32, 16, 3)
  assert not tf.parts_in_one_block(32, 16, 6)      # the sixth tile, columns 240-271, spans two
  assert not tf.parts_in_one_block(256, 0, 1) and not tf.parts_in_one_block(128, 64, 2)
  cfg = tf.default_config("gmm", 768, 192)        # 128 + 64 over 192 columns
  assert tf.gmm_launch(1000, 768, 192, 8, cfg)["ONE_BLOCK"] is False
  monkeypatch.setattr(tf, "ONE_BLOCK_SCALES", True)
  assert tf.gmm_launch(1000, 768, 192, 8, cfg)["ONE_BLOCK"] is True
  assert tf.gmm_launch(1000, 768, 300, 8, tuning.TileConfig(128, 48, 128))["ONE_BLOCK"] is False


def test_epilogue_quantisation_needs_whole_scale_pieces():
  # each column part of the tile one whole 128-wide piece of the row (or its last, shorter one)
  piece = lambda no, bn: tf.quantizes_pieces(
      tf.gmm_launch(512, 256, no, 4, tuning.TileConfig(128, bn, 128)), no)
  assert piece(192, 192) and piece(256, 128) and piece(300, 128) and piece(96, 128) and piece(128, 128)
  # 96 = 64 + 32 is one piece in two parts: each part's amax alone is not the piece's; a 128 + 64
  # tile over 96 columns has a second part past the output, whose piece the row does not have
  assert not piece(96, 96) and not piece(192, 64) and not piece(144, 48) and not piece(256, 256)
  assert not piece(384, 192) and not piece(96, 192)
  assert tf.QUANTIZE_OUT == {"silu": 1, "relu": 2}
  # the tile a quantising launch takes: the given one where it can, else 128 wide, and never one
  # past shared memory or the register bound (256 x 128 is both): then the default, 128 wide
  tile = lambda no, cfg: tf.quantizing_tile("gmm", 512, 256, no, 4, cfg)
  t = tuning.TileConfig
  assert tile(192, t(128, 192, 128, 8, 3)) == t(128, 192, 128, 8, 3)
  assert tile(144, t(32, 48, 128, 4, 2)) == t(32, 128, 128, 4, 2)
  assert tile(96, t(32, 192, 128, 4, 2)) == t(32, 128, 128, 4, 2)
  assert tile(384, t(256, 64, 128, 8, 4)) == t(128, 128, 128, 8, 4) == tf.default_config("gmm", 256, 384)
  for width in range(1, 4097):   # the last resort, every default 128 wide, always fits
    for op in ("gmm", "gmm_t"):
      assert tf.fits(dataclasses.replace(tf.default_config(op, width, width), bn=tf.TILE)), (op, width)


def test_table_rows_are_tiles_the_kernel_can_take():
  # within shared memory and the two float32 tiles' register bound (`candidates`), bk the scale
  # piece, one program a tile (gmm_launch refuses others), no wider than the output's tile width
  for (op, kc, no), cfg in tf.TABLE.items():
    tf.gmm_launch(4096, kc, no, 8, cfg)
    assert tf.shared_memory(cfg) <= tf.SMEM_LIMIT, (op, kc, no)
    assert 2 * cfg.bm * cfg.bn <= 192 * 32 * cfg.num_warps and cfg.bn <= tf._tile_width(no), (op, kc, no)


def test_default_tiles_fit_shared_memory():
  """Every default tile fits an H100's shared memory with room for a float32 epilogue tile
  (`shared_memory`): at bench/gmm.py's shapes, each of the forward and its transpose (dgrad), and at
  every width; tiles stay <= 192 wide (256 spills). The operand buffers, the first term, are what a
  compiled kernel asks: sm_90a compiles gave exactly them at the shapes below."""
  import os
  import sys
  bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
  if bench not in sys.path:
    sys.path.insert(0, bench)
  from gmm_common import SHAPES
  assert tf.SMEM_LIMIT == 232448
  cfg = lambda *a: dataclasses.astuple(tf.default_config(*a))[:5]   # bm, bn, bk, warps, stages
  for name, _, k, n, _ in SHAPES:
    for op, kc, no in (("gmm", k, n), ("gmm_t", n, k)):
      c = tf.default_config(op, kc, no)
      assert tf.shared_memory(c) <= tf.SMEM_LIMIT, (name, op, c)
  assert cfg("gmm", 768, 192) == (128, 192, 128, 8, 3)    # 122880 B of operand buffers compiled
  assert cfg("gmm_t", 192, 768) == (128, 128, 128, 8, 4)  # 131072 B
  for c in (tf.default_config("gmm", 768, 192), tf.default_config("gmm_t", 192, 768)):
    assert tf.shared_memory(c) - c.bm * c.bn * 4 == c.num_stages * (c.bm + c.bn) * 128
  # 3 stages of a 128 x 256 gmm tile and its float32 epilogue: the 278528 B an H100 refuses
  assert tf.shared_memory(tuning.TileConfig(128, 256, 128, 8, 3)) == 278528 > tf.SMEM_LIMIT
  for width in range(1, 4097):
    for op in ("gmm", "gmm_t"):
      c = tf.default_config(op, width, width)
      assert tf.shared_memory(c) <= tf.SMEM_LIMIT and c.bn <= 192, (op, c)


def test_sweep_candidates_are_valid_tiles_and_the_table_reaches_the_launch(monkeypatch):
  """`candidates` (bench/gmm.py --sweep-fp8) starts with the tile the kernel launches with and
  holds only distinct tiles that launch (bk the scale piece, one program a tile), fit shared
  memory, stay within the output's width and keep their two float32 tiles within 192 registers a
  thread; a TABLE row is what `config_for`, the candidates' first and the launch take; an op other
  than the forward ("gmm") and the input gradient ("gmm_t") has no tiles."""
  import os
  import sys
  bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
  if bench not in sys.path:
    sys.path.insert(0, bench)
  from gmm_common import SHAPES
  for name, m, k, n, g in SHAPES:
    for op, kc, no in (("gmm", k, n), ("gmm_t", n, k)):
      cands = tf.candidates(op, kc, no)
      assert cands[0] == tf.config_for(op, kc, no)
      assert tf.config_for(op, kc, no) == tf.default_config(op, kc, no) or (op, kc, no) in tf.TABLE
      assert len(cands) >= 6 and len(set(cands)) == len(cands), (name, op, cands)
      for c in cands:
        tf.gmm_launch(m, kc, no, g, c)
        assert c.bk == tf.TILE and tf.shared_memory(c) <= tf.SMEM_LIMIT, (name, op, c)
        assert c.bn <= tf._tile_width(no) and 2 * c.bm * c.bn <= 192 * 32 * c.num_warps, (op, c)
  for op in ("dot", "tgmm"):
    for fn in (tf.candidates, tf.default_config, tf.config_for):
      with pytest.raises(ValueError, match=rf"^FP8 tiles: unknown op '{op}' \(gmm or gmm_t\)$"):
        fn(op, 128, 128)
  tile = tuning.TileConfig(64, 128, 128, 4, 5)
  monkeypatch.setitem(tf.TABLE, ("gmm", 256, 384), tile)
  assert tf.config_for("gmm", 256, 384) == tf.candidates("gmm", 256, 384)[0] == tile
  assert tf.config_for("gmm_t", 384, 256) == tf.default_config("gmm_t", 384, 256)
  launched = []
  monkeypatch.setattr(tf, "_launch", lambda kernel, grid, args, out_shape, **meta: (
      launched.append(meta), jnp.zeros(out_shape.shape, out_shape.dtype))[1])
  sizes = jnp.asarray([100, 156], jnp.int32)
  a = fp8.quantize_tiles(jnp.ones((256, 256), jnp.float32), axis=1)
  w = fp8.quantize_blocks(jnp.ones((2, 256, 384), jnp.float32))
  tf.triton_fp8_gmm(*a, *w, sizes)
  assert [(x["BM"], x["BN"] + x["BN2"], x["num_warps"], x["num_stages"]) for x in launched] == [
      (64, 128, 4, 5)]


def test_bad_operands_name_the_array():
  """A wrong dtype or scale layout fails before any launch, naming the array and both shapes."""
  lq, ls = fp8.quantize_tiles(jnp.ones((40, 200)), axis=1)
  rq, rs = fp8.quantize_blocks(jnp.ones((3, 200, 72)))
  gs = jnp.asarray([10, 20, 10], jnp.int32)
  with pytest.raises(ValueError, match=r"lhs_scale is float32\[40, 1\], expected float32\[40, 2\]"):
    tf.triton_fp8_gmm(lq, ls[:, :1], rq, rs, gs)
  with pytest.raises(ValueError, match=r"lhs_q is bfloat16\[40, 200\], expected float8_e4m3fn"):
    tf.triton_fp8_gmm(lq.astype(jnp.bfloat16), ls, rq, rs, gs)
  with pytest.raises(ValueError,
                     match=r"gmm\^T: lhs_q is float8_e4m3fn\[40, 200\], expected float8_e4m3fn\[40, 72\]"):
    tf.triton_fp8_gmm(lq, ls, rq, rs, gs, transpose_rhs=True)
  with pytest.raises(ValueError, match=r"lhs_index is float32\[40\], expected an integer vector"):
    tf.triton_fp8_gmm(lq, ls, rq, rs, gs, lhs_index=jnp.zeros((40,)))
  with pytest.raises(ValueError, match=r"lhs_index is int32\[40, 1\], expected an integer vector"):
    tf.triton_fp8_gmm(lq, ls, rq, rs, gs, lhs_index=jnp.zeros((40, 1), jnp.int32))
  with pytest.raises(ValueError, match=r"rhs_scale is float32\[3, 1, 2\], expected float32\[3, 2, 1\]"):
    tf.triton_fp8_gmm(lq, ls, rq, jnp.swapaxes(rs, 1, 2), gs)   # the blocks' scales transposed


def test_gpus_without_fp8_tensor_cores_are_refused_before_a_launch(monkeypatch):
  """Devices faked: the kernel's entry point refuses a GPU below compute capability 8.9 (no FP8
  tensor cores) in one line naming it and its sm_, before any launch; Ada (8.9), Hopper (9.0) and
  later GPUs launch."""
  import types
  launched = []
  monkeypatch.setattr(tf, "_launch", lambda kernel, grid, args, out_shape, **meta: (
      launched.append(kernel), jnp.zeros(out_shape.shape, out_shape.dtype))[1])
  sizes = jnp.asarray([100, 156], jnp.int32)
  operand = lambda q_shape, s_shape: (jnp.zeros(q_shape, F8), jnp.zeros(s_shape, jnp.float32))
  lhs, rhs = operand((256, 200), (256, 2)), operand((2, 200, 72), (2, 2, 1))
  lhs_t = operand((256, 72), (256, 1))
  for cc, refused in (("8.0", True), ("8.6", True), ("8.9", False), ("9.0", False), ("10.0", False)):
    gpu = types.SimpleNamespace(platform="gpu", device_kind=f"NVIDIA sm{cc}", compute_capability=cc)
    monkeypatch.setattr(tf.jax, "devices", lambda gpu=gpu: [gpu])
    launched.clear()
    for what, call in (("gmm", lambda: tf.triton_fp8_gmm(*lhs, *rhs, sizes)),
                       (r"gmm\^T", lambda: tf.triton_fp8_gmm(*lhs_t, *rhs, sizes, transpose_rhs=True))):
      if refused:
        with pytest.raises(ValueError, match=rf"^triton fp8 {what}: NVIDIA sm{cc} \(sm_{cc.replace('.', '')}\) "
                                             r"has no FP8 tensor cores \(sm_89 or later\)"):
          call()
      else:
        call()
    assert len(launched) == (0 if refused else 2), cc
  monkeypatch.undo()
  monkeypatch.setattr(tf, "HAVE_JAX_TRITON", False)
  with pytest.raises(RuntimeError, match=r"^triton fp8 gmm: needs Triton and jax-triton"):
    tf.triton_fp8_gmm(*lhs, *rhs, sizes)


def test_fp8_backends_lists_the_kernels_in_a_fresh_process():
  """fp8_backends() registers the kernel backends itself (bench/fp8_dense.py lists its impls with it
  before anything else has registered them)."""
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  r = subprocess.run([sys.executable, "-c", "from umoe_jax.ops.fp8_gmm import fp8_backends; "
                      "print(sorted(fp8_backends()))"], cwd=root, capture_output=True, text=True,
                     timeout=120)
  from kernels.gmm import mosaic_fp8_gmm   # the mosaic backend's FP8 form, where jax has Mosaic GPU
  want = sorted(["triton", "xla"] + (["mosaic"] if mosaic_fp8_gmm.HAVE_MGPU_FP8 else []))
  assert r.stdout.strip() == str(want), r.stdout + r.stderr[-2000:]


def test_registered_as_the_triton_backends_fp8_forms():
  gb.register_builtin_kernels()
  triton = gb.BACKENDS.get("triton")
  assert triton.fp8_gmm is tf.triton_fp8_gmm and triton.fp8_quantize is tq.quantize_rows
  assert triton.fp8_quantize_blocks is tq.quantize_blocks
  assert triton.tgmm is triton_gmm.triton_tgmm   # the weight gradient's, in bf16
  assert triton.platforms == ("gpu",)
  if jax.devices()[0].platform == "cpu":  # auto keeps the emulation off GPU; triton is GPU-only
    assert fp8_backend("auto") == "xla"
    with pytest.raises(ValueError, match="does not run on platform 'cpu'"):
      fp8_backend("triton")


# ----------------------------------------------------------------------------------------------
# Under the interpreter (a fresh process: TRITON_INTERPRET must be set before Triton is imported).

LAUNCHES = []   # kernel names, in launch order
REVERSED = [False]   # whether the launches traced now run their programs last to first


@contextlib.contextmanager
def _program_order(reverse):
  """The interpreter runs a launch's programs first to last; with `reverse`, last to first. A GPU
  runs them in no set order: a program that stores into another's part of the output passes in
  the order where the other stores after it, and fails in the other order."""
  if not reverse:
    yield
    return
  import triton.runtime.interpreter as interp
  b = interp.interpreter_builder
  b.set_grid_idx = lambda x, y, z: type(b).set_grid_idx(b, b.grid_dim[0] - 1 - x, y, z)
  try:
    yield
  finally:
    del b.set_grid_idx


def _interpreter_launch(kernel, grid, args, out_shape, num_warps=None, num_stages=None, **meta):
  """`triton_fp8_gmm._launch` (and the bf16 tgmm's jax-triton call, `_interpreter_triton_call`)
  through the interpreter; the output poisoned with NaN first, so an output the kernel never writes
  fails, and guarded (`test_fp8_quant_triton.guarded`), so a store outside it fails too; its
  programs last to first while REVERSED (at the trace)."""
  from test_fp8_quant_triton import check_guards, guarded
  from test_kernels import _NpTensor
  reverse = REVERSED[0]
  several = isinstance(out_shape, (tuple, list))
  shapes = tuple(out_shape) if several else (out_shape,)
  poison = lambda s: 0x7F if s.dtype == F8 else np.nan   # (e4m3's NaN code, as bytes)

  def host(*arrays):
    ins = [_NpTensor(np.asarray(a)) for a in arrays]
    bufs = [guarded(s.shape, np.uint8 if s.dtype == F8 else s.dtype, poison(s)) for s in shapes]
    outs = [_NpTensor(arr.view(F8) if s.dtype == F8 else arr) for s, (_, arr) in zip(shapes, bufs)]
    with INTERPRETER_LOCK, _program_order(reverse):
      kernel[grid](*ins, *outs, **meta)
    for s, (flat, _) in zip(shapes, bufs):
      check_guards(flat, poison(s), kernel.fn.__name__)
    return tuple(o.arr for o in outs) if several else outs[0].arr

  LAUNCHES.append(kernel.fn.__name__)
  return jax.pure_callback(host, out_shape, *args)


def _interpreter_triton_call(*args, kernel, grid, out_shape, **meta):
  """`jax_triton.triton_call` for kernels/gmm/triton_gmm.py's weight gradient (`triton_tgmm`, one
  output), which fp8_gmm's backward runs in bf16: through `_interpreter_launch`."""
  assert isinstance(out_shape, jax.ShapeDtypeStruct), "one output (the tgmm kernel's)"
  return _interpreter_launch(kernel, grid, args, out_shape, **meta)


def _operand(rng, shape, axes, spread=2.0):
  """Normal values times a log-normal magnitude (log's deviation `spread`) along each of `axes`
  (rows, columns): scale pieces orders apart, so a piece read with another piece's scale is far
  off. Also tests/gpu/test_fp8_gpu.py's."""
  x = rng.standard_normal(shape)
  for ax in axes:
    mag_shape = [1] * len(shape)
    mag_shape[ax] = shape[ax]
    x = x * np.exp(spread * rng.standard_normal(mag_shape))
  return x.astype(np.float32)


def _compare(got, want, bound, rows, what, rel=1e-5):
  """got against want (their first `rows`; None: all) within `rel` times bound (the product of the
  absolute values; 1e-5: float32 summation error); non-finite exactly where want is (either inf or
  NaN). Also tests/gpu/test_fp8_gpu.py's, with the GPU's FP8 MMA bound."""
  got, want, bound = (np.asarray(a, np.float64)[:rows] for a in (got, want, bound))
  bad = ~np.isfinite(want)
  assert np.array_equal(~np.isfinite(got), bad), (what, np.argwhere(np.isfinite(got) != ~bad)[:5])
  err = np.abs(got - want)[~bad]
  tol = rel * bound[~bad] + 1e-30
  assert np.all(err <= tol), (what, float(np.max(err / tol)))


def _loop_gmm(lhs, rhs, gs, transpose):
  """float64, one product a group; rows past the groups zero."""
  out = np.zeros((lhs.shape[0], rhs.shape[1] if transpose else rhs.shape[2]))
  ends = np.cumsum(gs)
  for g, (s, e) in enumerate(zip(ends - gs, ends)):
    w = rhs[g].T if transpose else rhs[g]
    out[s:e] = lhs[s:e].astype(np.float64) @ w.astype(np.float64)
  return out


def _loop_tgmm(a, b, gs):
  """float64 a[rows of g].T @ b[rows of g], one product a group (zeros for an empty one): the weight
  gradient's reference; rows past the groups left out."""
  ends = np.cumsum(gs)
  return np.stack([a[s:e].T.astype(np.float64) @ b[s:e].astype(np.float64)
                   for s, e in zip(ends - gs, ends)])


GMM_CASES = [  # M, K, N, group sizes, (bm, bn) or None for the default tiles
    (260, 200, 144, [70, 0, 133, 40], (32, 48)),   # ragged, an empty group, 17 rows past the groups;
                                                   # 48 = 32 + 16 columns, a tile across a scale block
    (200, 384, 160, [0, 190, 3, 0, 7], (16, 64)),  # skewed, empty first group, no row past the groups;
                                                   # K 3 scale blocks, N 2: their strides differ
    (150, 136, 96, [40, 60, 30], None),            # default tiles (128 x 96 = 64 + 32)
    (150, 192, 192, [40, 0, 90], None),            # UMoE-base's 192: a 64-wide tail dot, 128 + 64 columns
]


def _gmm_operands(rng, m, k, n, gs, transpose, special):
  g = len(gs)
  kc = n if transpose else k
  lhs = _operand(rng, (m, kc), (0, 1))
  rhs = _operand(rng, (g, k, n), (1, 2))
  if special:
    busy = int(np.argmax(gs))
    r0 = int(np.sum(gs[:busy]))
    lhs[int(np.sum(gs)):] = np.nan            # rows past the groups are never read
    lhs[r0 + 1] = 0.0                         # a row of zero pieces (scale 0)
    lhs[r0 + 4, kc - 1] = np.inf              # an inf in the last (partial) chunk
    rhs[busy, :128, :128] = 0.0               # a zero block
    rhs[busy, min(130, k - 1), 5] = np.inf    # an inf block
  return lhs, rhs


def _nan_pieces(scales, pieces):
  """NaN scales at `pieces` (index tuples): pieces holding a NaN, as `umoe_jax.ops.fp8` quantises
  them. Set here rather than quantised from NaN inputs: the interpreter reads e4m3's NaN code as
  480 (it has no NaN for the format; a GPU's tensor cores do), so only the scale carries a NaN
  through the kernel on CPU."""
  scales = np.array(scales)
  for p in pieces:
    scales[p] = np.nan
  return jnp.asarray(scales)


def _quantized(lhs, rhs):
  """(lhs_q, lhs_scale, rhs_q, rhs_scale): lhs in 1 x 128 tiles along its contraction (axis 1),
  rhs in 128 x 128 blocks."""
  return (*fp8.quantize_tiles(jnp.asarray(lhs), axis=1), *fp8.quantize_blocks(jnp.asarray(rhs)))


def _dequantized(lq, ls, rq, rs):
  return np.asarray(fp8.dequantize_tiles(lq, ls, axis=1)), np.asarray(fp8.dequantize_blocks(rq, rs))


def _check_gmm(rng, m, k, n, gs, tile, transpose, special, out_dtype=jnp.float32, reverse=False):
  """One launch against the emulation (`_compare`), its programs last to first with `reverse`."""
  gs = np.asarray(gs, np.int32)
  lhs, rhs = _gmm_operands(rng, m, k, n, gs, transpose, special)
  lq, ls, rq, rs = _quantized(lhs, rhs)
  if special:  # a NaN piece in a row of the largest group and a NaN block of its weights
    busy = int(np.argmax(gs))
    ls = _nan_pieces(ls, [(int(np.sum(gs[:busy])) + 2, 0)])
    rs = _nan_pieces(rs, [(busy, 0, rs.shape[2] - 1)])
  cfg = None if tile is None else tuning.TileConfig(tile[0], tile[1], tf.TILE)
  n0 = len(LAUNCHES)
  REVERSED[0] = reverse
  got = jax.jit(lambda *a: tf.triton_fp8_gmm(*a, transpose_rhs=transpose, out_dtype=out_dtype,
                                             config=cfg))(lq, ls, rq, rs, jnp.asarray(gs))
  REVERSED[0] = False
  assert LAUNCHES[n0:] == ["_fp8_gmm_kernel"]
  deq_l, deq_r = _dequantized(lq, ls, rq, rs)
  if special:  # (XLA's ragged_dot on CPU spreads one group's NaN to every row: a float64 loop)
    want = _loop_gmm(deq_l, deq_r, gs, transpose)
  else:
    want = fp8.emulated_gmm(lq, ls, rq, rs, jnp.asarray(gs), transpose_rhs=transpose,
                            out_dtype=jnp.float32)
  bound = _loop_gmm(np.abs(deq_l), np.abs(deq_r), gs, transpose)
  rows = int(gs.sum())
  what = (f"gmm M={m} K={k} N={n} gs={gs.tolist()} tile={tile} transpose={transpose} special={special} "
          f"reverse={reverse}")
  assert got.shape == (m, k if transpose else n) and got.dtype == out_dtype, what
  got = np.asarray(got.astype(jnp.float32))
  if out_dtype == jnp.float32:
    _compare(got, want, bound, rows, what)
  else:  # one rounding to the output dtype
    _compare(got, want, bound + np.abs(np.asarray(want)) * 2.0 ** -7 / 1e-5, rows, what)
  assert np.all(got[rows:] == 0), f"{what}: rows past the groups are zero"
  if special:
    assert not np.all(np.isfinite(got[:rows])), f"{what}: the inf / NaN pieces reached no output"


def _check_one_block_bits(rng, m, k, n, gs, tile, transpose, special):
  """ONE_BLOCK_SCALES: the launch gives the bits of the outer-product promotion's launch on the same
  operands (NaN and inf scales included), where its tiles' parts lie in one block and where not."""
  gs = np.asarray(gs, np.int32)
  lq, ls, rq, rs = _quantized(*_gmm_operands(rng, m, k, n, gs, transpose, special))
  if special:
    busy = int(np.argmax(gs))
    rs = _nan_pieces(rs, [(busy, 0, rs.shape[2] - 1)])
  cfg = None if tile is None else tuning.TileConfig(tile[0], tile[1], tf.TILE)
  run = lambda: np.asarray(jax.jit(lambda *a: tf.triton_fp8_gmm(
      *a, transpose_rhs=transpose, out_dtype=jnp.float32, config=cfg))(lq, ls, rq, rs, jnp.asarray(gs)))
  outer = run()
  tf.ONE_BLOCK_SCALES = True
  one = run()
  tf.ONE_BLOCK_SCALES = False
  np.testing.assert_array_equal(one, outer, err_msg=f"one-block scales {m} {k} {n} {tile} {transpose}")


def _check_gmm_index(rng, transpose):
  """The kernel reading its rows through `lhs_index` (the fused dispatch's sort order: every source
  row read by several product rows, in another order) gives the bits of the same launch on the
  gathered operands, and the float64 loop's values; rows past the groups zero."""
  src, k, n, fan_out, gs = 70, 200, 144, 3, np.asarray([80, 0, 95, 20], np.int32)   # 15 rows past
  kc = n if transpose else k
  lq, ls, rq, rs = _quantized(_operand(rng, (src, kc), (0, 1)), _operand(rng, (len(gs), k, n), (1, 2)))
  index = jnp.asarray(rng.permutation(src * fan_out) // fan_out, jnp.int32)
  cfg = tuning.TileConfig(32, 48, tf.TILE)
  run = jax.jit(lambda q, sc, i: tf.triton_fp8_gmm(q, sc, rq, rs, jnp.asarray(gs), transpose_rhs=transpose,
                                                   out_dtype=jnp.float32, config=cfg, lhs_index=i))
  n0 = len(LAUNCHES)
  got = np.asarray(run(lq, ls, index))
  assert LAUNCHES[n0:] == ["_fp8_gmm_kernel"]
  gathered = np.asarray(tf.triton_fp8_gmm(jnp.take(lq, index, axis=0), jnp.take(ls, index, axis=0), rq,
                                          rs, jnp.asarray(gs), transpose_rhs=transpose,
                                          out_dtype=jnp.float32, config=cfg))
  what = f"gmm lhs_index transpose={transpose}"
  assert got.shape == (src * fan_out, k if transpose else n), what
  np.testing.assert_array_equal(got, gathered, err_msg=what)
  deq_l, deq_r = _dequantized(lq, ls, rq, rs)
  deq_l = deq_l[np.asarray(index)]
  rows = int(gs.sum())
  _compare(got, _loop_gmm(deq_l, deq_r, gs, transpose), _loop_gmm(np.abs(deq_l), np.abs(deq_r), gs, transpose),
           rows, what)
  assert np.all(got[rows:] == 0), what


QUANT_OUT_CASES = [  # M, K, N, group sizes, (bm, bn) or None, activation, through an index
    (150, 136, 192, [40, 0, 90], None, "silu", False),   # 128 + 64 columns: two whole pieces
    (260, 200, 144, [70, 0, 133, 40], (32, 48), "silu", True),   # 32 + 16: narrowed to 128 wide
    (150, 136, 96, [40, 60, 30], None, "relu", False),   # one short piece
    (200, 144, 300, [0, 190, 3, 0, 7], (32, 128), "silu", False),   # three column tiles of 128
    (150, 136, 96, [40, 60, 30], (32, 192), "silu", False),   # 128 + 64 over 96: narrowed to 128
]


def _check_gmm_quant_out(rng, m, k, n, gs, tile, act, through_index, reverse=False):
  """`triton_fp8_gmm(quantize_out=act)`: out within float32 summation order of the plain launch;
  (q, scale) the bits of the one-pass quantiser's on act(out) (XLA's activation of the kernel's own
  out) except where the two activations round apart, there one e4m3 step; rows past the groups
  zero in all three."""
  from umoe_jax.ops import epilogue
  gs = np.asarray(gs, np.int32)
  lhs = _operand(rng, (m, k), (0, 1))
  rhs = _operand(rng, (len(gs), k, n), (1, 2))
  lq, ls, rq, rs = _quantized(lhs, rhs)
  index = None
  if through_index:
    index = jnp.asarray(rng.permutation(m), jnp.int32)
  cfg = None if tile is None else tuning.TileConfig(tile[0], tile[1], tf.TILE)
  call = lambda c, **kw: jax.jit(lambda *a: tf.triton_fp8_gmm(
      *a, out_dtype=jnp.bfloat16, config=c, lhs_index=index, **kw))(lq, ls, rq, rs, jnp.asarray(gs))
  n0 = len(LAUNCHES)
  REVERSED[0] = reverse
  out, q, scale = call(cfg, quantize_out=act)
  REVERSED[0] = False
  # the plain launch of the tile the quantising one took: the same chunks in the same order
  plain = call(tf.quantizing_tile("gmm", m, k, n, len(gs), cfg or tf.config_for("gmm", k, n)))
  assert LAUNCHES[n0:] == ["_fp8_gmm_quant_kernel", "_fp8_gmm_kernel"], LAUNCHES[n0:]
  what = f"quantize_out M={m} K={k} N={n} tile={tile} act={act} index={through_index}"
  assert q.shape == out.shape == (m, n) and q.dtype == F8 and scale.shape == (m, -(-n // 128)), what
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(plain, np.float32), err_msg=what)
  want_q, want_s = tq.quantize_rows(epilogue.activate(act, out))
  got_s, want_s = np.asarray(scale), np.asarray(want_s)
  np.testing.assert_allclose(got_s, want_s, rtol=2 ** -7, err_msg=what)
  deq = lambda a, sc: np.asarray(fp8.dequantize_tiles(a, jnp.asarray(sc), axis=1), np.float64)
  got, want = deq(q, got_s), deq(want_q, want_s)
  apart = got != want
  assert apart.mean() < 0.002, (what, apart.mean())
  step = 2 ** -3 * np.abs(want) + 2 ** -9 * np.repeat(want_s, 128, 1)[:, :n]   # one e4m3 step
  assert np.all(np.abs(got - want) <= step), what
  rows = int(gs.sum())
  for a in (out, q.astype(jnp.float32), scale):
    assert np.all(np.asarray(a, np.float32)[rows:] == 0), f"{what}: rows past the groups"
  if act == "relu":
    assert np.all(got >= 0), what


def _differentiable_check():
  """fp8_gmm through the triton backend (its FP8 form: this kernel; its weight gradient: the bf16
  tgmm kernel on the operands as they are) against the xla backend (the emulation, XLA's tgmm): the
  same quantised operands, so values and both gradients agree to float32 summation order, and the
  weight gradient is the float64 loop's over the unquantised operands; the forward and the input
  gradient ran as this kernel, the weight gradient as the tgmm kernel."""
  from umoe_jax.ops import fp8_gmm as fg
  gb.register_builtin_kernels()
  triton = gb.BACKENDS.get("triton")
  assert triton.fp8_gmm is tf.FP8_GMM and triton.tgmm is triton_gmm.TGMM
  gb.BACKENDS._entries["triton"] = dataclasses.replace(triton, platforms=("cpu", "gpu"))
  rng = np.random.default_rng(7)
  m, k, n, gs = 230, 144, 136, np.asarray([60, 0, 100, 25, 30], np.int32)   # 15 rows past the groups
  rhs = jnp.asarray(_operand(rng, (len(gs), k, n), (1, 2)))
  for transpose in (False, True):
    lhs = jnp.asarray(_operand(rng, (m, n if transpose else k), (0, 1)))
    cot = jnp.asarray(_operand(rng, (m, k if transpose else n), (0,)))

    def loss(x, w, backend):
      return jnp.sum(fg.fp8_gmm(x, w, jnp.asarray(gs), backend=backend, transpose_rhs=transpose) * cot)

    n0 = len(LAUNCHES)
    got = jax.jit(jax.value_and_grad(lambda x, w: loss(x, w, "triton"), argnums=(0, 1)))(lhs, rhs)
    assert sorted(LAUNCHES[n0:]) == ["_fp8_gmm_kernel", "_fp8_gmm_kernel", "_tgmm_kernel"], LAUNCHES[n0:]
    want = jax.jit(jax.value_and_grad(lambda x, w: loss(x, w, "xla"), argnums=(0, 1)))(lhs, rhs)
    (v, (dx, dw)), (wv, (wdx, wdw)) = got, want
    what = f"fp8_gmm transpose={transpose}"
    np.testing.assert_allclose(float(v), float(wv), rtol=1e-5, err_msg=what)
    for name, x, y in (("dlhs", dx, wdx), ("drhs", dw, wdw)):
      x, y = np.asarray(x), np.asarray(y)
      assert np.all(np.isfinite(x)), (what, name)
      np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5 * np.max(np.abs(y)), err_msg=f"{what} {name}")
    # the weight gradient from lhs and the cotangent as they are (no FP8 rounding): the float64 loop's
    a, b = (np.asarray(cot), np.asarray(lhs)) if transpose else (np.asarray(lhs), np.asarray(cot))
    assert dw.shape == rhs.shape and dw.dtype == rhs.dtype, what
    _compare(dw, _loop_tgmm(a, b, gs), _loop_tgmm(np.abs(a), np.abs(b), gs), None, f"{what} drhs")
    assert np.all(np.asarray(dx)[gs.sum():] == 0), f"{what}: rows past the groups get no gradient"
    assert np.all(np.asarray(dw)[gs == 0] == 0), f"{what}: an empty group's weights get no gradient"
  # A dense product through the kernel (one group of every row; umoe_jax.model.layers.fp8_dense):
  # values and both gradients against fp8_dot's float32 emulation of the same quantised operands; the
  # weight gradient of one group is XLA's dot, not a kernel.
  from umoe_jax.model.layers import fp8_dense
  x = jnp.asarray(_operand(rng, (3, 70, k), (1, 2)))     # 210 rows: not a multiple of the row tile
  w = jnp.asarray(_operand(rng, (k, n), (0, 1)))
  cot = jnp.asarray(_operand(rng, (3, 70, n), (1,)))
  dense = lambda impl: jax.jit(jax.value_and_grad(
      lambda a, b: jnp.sum(fp8_dense(a, b, impl).astype(jnp.float32) * cot), argnums=(0, 1)))(x, w)
  wv, (wdx, wdw) = dense("emulate")
  n0 = len(LAUNCHES)
  v, (dx, dw) = dense("triton")
  assert LAUNCHES[n0:] == ["_fp8_gmm_kernel", "_fp8_gmm_kernel"], LAUNCHES[n0:]
  np.testing.assert_allclose(float(v), float(wv), rtol=1e-5, err_msg="fp8_dense")
  for name, a, b in (("dx", dx, wdx), ("dw", dw, wdw)):
    assert a.shape == b.shape and a.dtype == b.dtype, name
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4,
                               atol=1e-5 * np.max(np.abs(np.asarray(b))), err_msg=f"fp8_dense {name}")
  # gmm_combine's FP8 form (fused_dispatch._fp8_gmm_combine_fn): the kernels read dout's token rows
  # through the sort order (the FP8 gmm's lhs_index, the bf16 tgmm's rhs_index); the fan-in in XLA
  # here (the gather-sum kernel is bf16's, tested on its own).
  from umoe_jax.ops import dispatch, fused_dispatch
  gb.BACKENDS._entries["triton"] = dataclasses.replace(gb.BACKENDS.get("triton"), gather_sum=None)
  n_tok, slots, f, d, e = 50, 3, 144, 136, 4
  plan = dispatch.make_plan(jnp.asarray(rng.integers(0, e, (n_tok, slots)), jnp.int32), e)
  z = jnp.asarray(_operand(rng, (n_tok * slots, f), (0, 1)))
  w2 = jnp.asarray(_operand(rng, (e, f, d), (1, 2)))
  gates = jnp.asarray(rng.uniform(0.05, 1.0, (n_tok, slots)).astype(np.float32))
  cot = jnp.asarray(_operand(rng, (n_tok, d), (0,)))
  combined = lambda backend: jax.jit(jax.value_and_grad(lambda a, b, c: jnp.sum(
      fused_dispatch.gmm_combine(a, b, plan, c, backend=backend, activation="silu", fp8=True) * cot),
      argnums=(0, 1, 2)))(z, w2, gates)
  n0 = len(LAUNCHES)
  v, grads = combined("triton")
  assert sorted(LAUNCHES[n0:]) == ["_fp8_gmm_kernel", "_fp8_gmm_kernel", "_tgmm_kernel"], LAUNCHES[n0:]
  wv, wgrads = combined("xla")
  np.testing.assert_allclose(float(v), float(wv), rtol=1e-5, err_msg="fp8 gmm_combine")
  for name, a, b in zip(("dz", "dw", "dgates"), grads, wgrads):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4,
                               atol=1e-5 * np.max(np.abs(np.asarray(b))), err_msg=f"fp8 gmm_combine {name}")


def _interpreter_check():
  from test_kernels import _NP_DTYPES, _NpDtype
  from umoe_jax.ops import fp8_gmm
  fp8_gmm.MIN_CONTRACTION = 0   # every product in FP8 at these widths (as tests/conftest.py)
  _NP_DTYPES.setdefault(np.dtype(F8), _NpDtype("float8_e4m3fn"))
  _NP_DTYPES.setdefault(np.dtype(jnp.bfloat16), _NpDtype("bfloat16"))
  interpreter_loop_bounds()
  tf._launch = _interpreter_launch
  # fp8_gmm's weight gradient: the bf16 tgmm kernel's jax-triton call, through the interpreter too
  triton_gmm.jt = type("InterpreterJT", (), {"triton_call": staticmethod(_interpreter_triton_call)})
  rng = np.random.default_rng(0)
  # each case's transposed launch with its programs last to first (`_program_order`), so a program
  # storing into another's rows or columns fails in one order or the other
  for m, k, n, gs, tile in GMM_CASES:
    for transpose in (False, True):
      _check_gmm(rng, m, k, n, gs, tile, transpose, special=False, reverse=transpose)
  for transpose in (False, True):
    _check_gmm(rng, *GMM_CASES[0], transpose, special=True)
  _check_gmm(rng, *GMM_CASES[2], False, special=False, out_dtype=jnp.bfloat16)
  for transpose in (False, True):
    _check_gmm_index(rng, transpose)
  # the promotion's row scales where the weights' block scale is one number a part: the
  # (32, 48) tile's parts span blocks at some tiles, the others' never
  for case in GMM_CASES:
    for transpose in (False, True):
      _check_one_block_bits(rng, *case, transpose, special=False)
  _check_one_block_bits(rng, *GMM_CASES[3], False, special=True)
  # the epilogue's act(out) in FP8 tiles (`quantize_out`); the one-pass quantiser (its reference
  # here, and fp8_gmm's below) through the interpreter too, with its correctly rounded e4m3 cast
  # (test_fp8_quant_triton's)
  import test_fp8_quant_triton as tqt
  tqt._exact_e4m3()
  tq._launch = tqt._interpreter_launch
  exact_interpreter_cast("bfloat16", jnp.bfloat16)   # an epilogue's bf16 rounding, as XLA's
  for i, case in enumerate(QUANT_OUT_CASES):   # every other one with its programs last to first
    _check_gmm_quant_out(rng, *case, reverse=i % 2 == 1)
  # fp8_gmm's triton backend quantises with its own kernel (kernels/gmm/triton_fp8_quant.py), through
  # the interpreter (set above)
  n0 = len(tqt.LAUNCHES)
  _differentiable_check()
  ran = tqt.LAUNCHES[n0:]
  # three products (fp8_gmm in both layouts, the dense one): the forward's and the input gradient's
  # row-tile operands each; then gmm_combine's FP8 form: act(z), and dout's N token rows (read
  # through the sort order by the gmm); nothing quantised for a weight gradient
  assert ran == ["_rows_kernel"] * 8, ran
  _expert_pool_check(tqt)
  print("FP8_TRITON_INTERPRETER_OK")


def fp8_pools(plan, slots: int, backend: str) -> dict:
  """The FP8 expert pool two ways, each f(x, w_up, w_down, gates) with a SiLU: False, gather_gmm
  and gmm_combine composed, the last matmul quantising act(up) by its own pass; True, routed_mlp,
  which hands it act(up)'s tiles from the first matmul. Also tests/test_fp8.py's."""
  from umoe_jax.model.expert_mlp import routed_mlp
  from umoe_jax.ops import fused_dispatch
  return {
      False: lambda x, a, b, g: fused_dispatch.gmm_combine(
          fused_dispatch.gather_gmm(x, a, plan, slots, backend=backend, fp8=True), b, plan, g,
          backend=backend, activation="silu", fp8=True),
      True: lambda x, a, b, g: routed_mlp(x, plan, g, a, b, activation="silu", backend=backend,
                                          fuse_activation=True, fp8=True)}


def _expert_pool_check(tqt):
  """The expert pool's FP8 path (routed_mlp: act(up) quantised in the first matmul's epilogue)
  against its two ops composed without it (act(up) quantised by a pass of its own): the same values
  and gradients up to the activation's rounding, one quantiser launch fewer, and the first matmul's
  launch the quantising kernel."""
  from umoe_jax.ops import dispatch
  rng = np.random.default_rng(11)
  n_tok, slots, d, f, e = 50, 3, 136, 192, 4
  plan = dispatch.make_plan(jnp.asarray(rng.integers(0, e, (n_tok, slots)), jnp.int32), e)
  x = jnp.asarray(_operand(rng, (n_tok, d), (0, 1)), jnp.bfloat16)
  w1 = jnp.asarray(_operand(rng, (e, d, f), (1, 2)) / 10)
  w2 = jnp.asarray(_operand(rng, (e, f, d), (1, 2)) / 10)
  gates = jnp.asarray(rng.uniform(0.05, 1.0, (n_tok, slots)).astype(np.float32))
  cot = jnp.asarray(_operand(rng, (n_tok, d), (0,)), jnp.bfloat16)
  runs = {}
  for fused, pool in fp8_pools(plan, slots, "triton").items():
    n0, q0 = len(LAUNCHES), len(tqt.LAUNCHES)
    runs[fused] = jax.jit(jax.value_and_grad(
        lambda *a: jnp.sum(pool(*a).astype(jnp.float32) * cot), argnums=(0, 1, 2, 3)))(x, w1, w2, gates)
    runs[fused, "launches"] = (sorted(LAUNCHES[n0:]), tqt.LAUNCHES[q0:])
  (plain, fused) = runs[False], runs[True]
  np.testing.assert_allclose(float(fused[0]), float(plain[0]), rtol=1e-3)
  for name, a, b in zip(("dx", "dw1", "dw2", "dgates"), fused[1], plain[1]):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.all(np.isfinite(a)), name
    assert np.linalg.norm(a - b) <= 1e-3 * np.linalg.norm(b), name
  (gmms, rows), (gmms0, rows0) = runs[True, "launches"], runs[False, "launches"]
  assert gmms.count("_fp8_gmm_quant_kernel") == 1 and gmms0.count("_fp8_gmm_quant_kernel") == 0, gmms
  assert len(gmms) == len(gmms0) and len(rows) == len(rows0) - 1, (gmms, rows, gmms0, rows0)


@pytest.mark.extras("triton")
def test_fp8_kernels_in_interpreter_match_the_emulation():
  run_in_triton_interpreter("test_fp8_triton", "_interpreter_check", "FP8_TRITON_INTERPRETER_OK",
                            timeout=600)
