"""CPU tests of the one-pass FP8 tile quantiser (kernels/gmm/triton_fp8_quant.py: 1 x 128 tiles along
the rows): launch geometry and bad input; its kernels under the Triton interpreter (TRITON_INTERPRET=1,
in a subprocess, every launch through `jax.pure_callback` as in tests/test_fp8_triton.py) against
`umoe_jax.ops.fp8.quantize_tiles(x, axis=1)` bit for bit, on fresh random bfloat16 and float32 inputs
whose magnitudes spread over orders (within a tile, and between rows and columns, so every tile has
its own scale), row counts that are and are not multiples of the row block and widths that are and
are not multiples of 128, zero, NaN and inf tiles, and values placed where a division instead of the
reciprocal's product rounds to another FP8 value; and the kernel compiled for sm_90a, whose PTX must
hold the exact arithmetic the interpreter cannot tell from the approximate one.
"""
from __future__ import annotations

import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import INTERPRETER_LOCK, exact_interpreter_cast, run_in_triton_interpreter
from kernels.gmm import triton_fp8_quant as tq
from umoe_jax.ops import fp8

F8 = jnp.float8_e4m3fn


def test_constants_are_the_quantisers():
  assert tq.TILE == fp8.TILE == 128 and tq.MAX == fp8.MAX == 448.0
  assert tq.DTYPE == jnp.dtype(fp8.DTYPE)


def test_launch_geometry():
  rows = tq.rows_launch(200, 1000)   # 7 row blocks (the last of 8 rows); 8 tiles, the last 104 wide
  assert (rows["grid"], rows["CB"], rows["CBP"], rows["BM"]) == ((7,), 8, 8, tq.ROWS_BM) == ((7,), 8, 8, 32)
  assert (tq.rows_launch(64, 768)["CB"], tq.rows_launch(64, 768)["CBP"]) == (6, 8)
  assert (tq.rows_launch(5, 40)["grid"], tq.rows_launch(5, 40)["CB"], tq.rows_launch(5, 40)["CBP"]) == ((1,), 1, 1)
  blocks = tq.blocks_launch(3, 300, 200)   # 3 x 2 blocks a matrix, the last ones part-filled
  assert (blocks["grid"], blocks["KB"], blocks["NB"]) == ((18,), 3, 2)


def test_bad_weights_are_one_line_naming_the_array():
  for w, shown in ((jnp.ones((2, 3, 4, 5)), r"float32\[2, 3, 4, 5\]"), (jnp.ones((8,)), r"float32\[8\]"),
                   (jnp.ones((8, 128), jnp.float16), r"float16\[8, 128\]")):
    with pytest.raises(ValueError, match=rf"^triton fp8 quantize_blocks: w is {shown}, expected a 3-D "
                                         r"\[G, K, N\] or 2-D \[K, N\] bfloat16 or float32 array$"):
      tq.quantize_blocks(w)


def test_bad_input_is_one_line_naming_the_array():
  for x, shown in ((jnp.ones((2, 3, 4)), r"float32\[2, 3, 4\]"), (jnp.ones((8, 128), jnp.int32), r"int32\[8, 128\]"),
                   (jnp.ones((8, 128), jnp.float16), r"float16\[8, 128\]"), (jnp.ones((128,)), r"float32\[128\]")):
    with pytest.raises(ValueError, match=rf"^triton fp8 quantize_rows: x is {shown}, expected a 2-D \[M, C\] "
                                         r"bfloat16 or float32 array$"):
      tq.quantize_rows(x)


def test_empty_arrays_launch_nothing(monkeypatch):
  monkeypatch.setattr(tq, "_launch", lambda *a, **k: pytest.fail("an empty array launched a kernel"))
  for shape in ((0, 200), (5, 0)):
    x = jnp.zeros(shape, jnp.bfloat16)
    got, want = tq.quantize_rows(x), fp8.quantize_tiles(x, axis=1)
    assert [(a.shape, a.dtype) for a in got] == [(a.shape, a.dtype) for a in want]
  for shape in ((0, 128, 64), (2, 0, 64), (3, 5, 0), (0, 7)):
    w = jnp.zeros(shape, jnp.float32)
    got, want = tq.quantize_blocks(w), fp8.quantize_blocks(w)
    assert [(a.shape, a.dtype) for a in got] == [(a.shape, a.dtype) for a in want]


# ----------------------------------------------------------------------------------------------
# Under the interpreter (a fresh process: TRITON_INTERPRET must be set before Triton is imported).

LAUNCHES = []   # kernel names, in launch order
CONVERSIONS = []  # float32 -> e4m3 conversions the interpreter made through `_exact_e4m3`


GUARD = 4096   # poisoned elements on either side of every output (`guarded`)


def guarded(shape, dtype, poison):
  """(flat buffer, its middle as an array of `shape`): the output lies between GUARD poisoned
  elements on either side, which `check_guards` asserts a launch left alone (a store that
  overshoots its output hits them, instead of memory the interpreter does not own)."""
  size = int(np.prod(shape))
  flat = np.full(size + 2 * GUARD, poison, dtype)
  return flat, flat[GUARD:GUARD + size].reshape(shape)


def check_guards(flat, poison, what):
  edges = np.concatenate([flat[:GUARD], flat[-GUARD:]]).view(np.uint8)
  want = np.full(2 * GUARD, poison, flat.dtype).view(np.uint8)
  assert np.array_equal(edges, want), f"{what} wrote outside its output"


def _interpreter_launch(kernel, grid, args, out_shape, num_warps=None, num_stages=None, **meta):
  """`triton_fp8_quant._launch` through the interpreter. The outputs are poisoned first (q with e4m3's
  NaN code, scales with -1, which no tile has), so an element the kernel never writes fails, and
  guarded by poisoned elements (`guarded`), so one written outside an output fails too."""
  from test_kernels import _NpTensor
  shapes = tuple(out_shape)

  def host(*arrays):
    ins = [_NpTensor(np.asarray(a)) for a in arrays]
    bufs = [guarded(s.shape, np.uint8, 0x7F) if s.dtype == F8 else guarded(s.shape, s.dtype, -1.0)
            for s in shapes]
    outs = [_NpTensor(arr.view(F8) if s.dtype == F8 else arr) for s, (_, arr) in zip(shapes, bufs)]
    with INTERPRETER_LOCK:
      kernel[grid](*ins, *outs, **meta)
    for s, (flat, _) in zip(shapes, bufs):
      check_guards(flat, 0x7F if s.dtype == F8 else -1.0, kernel.fn.__name__)
    return tuple(o.arr for o in outs)

  LAUNCHES.append(kernel.fn.__name__)
  return jax.pure_callback(host, shapes, *args)


def _exact_e4m3():
  """The interpreter's float32 -> e4m3 cast correctly rounded (`conftest.exact_interpreter_cast`):
  without it the kernels' bits could not be compared with `quantize_tiles`'."""
  exact_interpreter_cast("float8e4nv", F8, CONVERSIONS)


def _operand(rng, m, c):
  """float32 [m, c]: normal values times a log-normal magnitude per element (deviation 3: values
  orders below their tile's amax, down to e4m3's subnormals and zero, both signs), per row and per
  column (deviation 2: every tile its own scale)."""
  x = rng.standard_normal((m, c)) * np.exp(3.0 * rng.standard_normal((m, c)))
  x *= np.exp(2.0 * rng.standard_normal((m, 1))) * np.exp(2.0 * rng.standard_normal((1, c)))
  return x.astype(np.float32)


def _straddlers(rng, n):
  """n (amax, v) float32 pairs: in a tile whose largest magnitude is amax, v * (1 / scale) and
  v / scale round to different e4m3 values (v lies within a few float32 steps of a rounding midpoint
  times the scale)."""
  f = np.float32
  grid = np.arange(0, 127, dtype=np.uint8).view(F8).astype(f)    # e4m3's non-negative finite values
  mids = (grid[1:] + grid[:-1]) / f(2)
  out = []
  while len(out) < n:
    amax = f(np.exp(rng.uniform(-12.0, 12.0)))
    scale = amax * f(1.0 / fp8.MAX)
    near = f(mids[rng.integers(len(mids))] * np.float64(scale))
    vs = [near]
    for step in (np.inf, 0.0):
      v = near
      for _ in range(4):
        v = np.nextafter(v, f(step))
        vs.append(v)
    vs = np.asarray(vs, f)
    differ = (vs * (f(1) / scale)).astype(F8).view(np.uint8) != (vs / scale).astype(F8).view(np.uint8)
    out += [(amax, v) for v in vs[differ][:1]]
  return out


def _special(x, rng, straddle):
  """x [R, T] (tiles along T) with: +inf among finite values (an inf scale), a zero tile, a NaN
  tile, a tile holding +inf and -inf (a NaN scale: the reference tests the sum), -inf in the last
  (possibly partial) tile, and with `straddle` one (amax, v) pair of `_straddlers` at the head of a
  tile of each further row."""
  r, t = x.shape
  tiles = -(-t // fp8.TILE)
  x = x.copy()
  x[0, 7 % t] = np.inf
  x[1, :fp8.TILE] = 0.0
  x[2, min(t - 1, fp8.TILE + 3)] = np.nan
  x[3, 5 % t], x[3, 9 % t] = np.inf, -np.inf
  x[4, t - 1] = -np.inf
  if straddle:
    for i, (amax, v) in enumerate(_straddlers(rng, min(r - 5, 24))):
      j = (i % tiles) * fp8.TILE
      x[5 + i, j:j + fp8.TILE] *= 1e-3 * amax / np.nanmax(np.abs(x[5 + i, j:j + fp8.TILE]))
      x[5 + i, j], x[5 + i, min(j + 1, t - 1)] = -amax, v
  return x


def _same_bits(got, want, what):
  """q bits equal (e4m3fn's two NaN codes, 0x7F and 0xFF, as one: XLA's CPU gives inf * 0 a negative
  NaN, a GPU's conversion a positive one); scales' float32 bits equal, NaN where want is NaN."""
  (gq, gs), (wq, ws) = got, want
  assert (gq.shape, gq.dtype, gs.shape, gs.dtype) == (wq.shape, F8, ws.shape, jnp.float32), what
  gq, wq = (np.asarray(a).view(np.uint8) for a in (gq, wq))
  nan = (wq & 0x7F) == 0x7F
  bad = np.argwhere(((gq & 0x7F) == 0x7F) != nan)
  assert bad.size == 0, (what, "q NaN at other places", bad[:5])
  bad = np.argwhere((gq != wq) & ~nan)
  assert bad.size == 0, (what, "q differs", [(tuple(i), gq[tuple(i)], wq[tuple(i)]) for i in bad[:5]])
  gs, ws = np.asarray(gs), np.asarray(ws)
  assert np.array_equal(np.isnan(gs), np.isnan(ws)), (what, "scale NaN at other places")
  bad = np.argwhere((gs.view(np.uint32) != ws.view(np.uint32)) & ~np.isnan(ws))
  assert bad.size == 0, (what, "scale differs", [(tuple(i), gs[tuple(i)], ws[tuple(i)]) for i in bad[:5]])


ROW_CASES = [  # M, C, input dtype: M not a multiple of the row block but in the last; C = 6 tiles,
    (200, 768, jnp.bfloat16),   # 1 tile + 72, 7 tiles + 104, one tile of 40
    (144, 200, jnp.float32),
    (37, 1000, jnp.float32),
    (64, 40, jnp.bfloat16),
]


def _special_blocks(w, rng, straddle):
  """w [G, K, N] with, in its blocks taken in turn: +inf among finite values (an inf scale), all
  zeros, a NaN, +inf and -inf (a NaN scale), -inf in the last (possibly part-filled) block; with
  `straddle` the further blocks each hold one (amax, v) pair of `_straddlers` (the rest far below)."""
  t = fp8.TILE
  w = w.copy()
  blocks = [(g, i, j) for g in range(w.shape[0]) for i in range(0, w.shape[1], t)
            for j in range(0, w.shape[2], t)]
  block = lambda b: w[b[0], b[1]:b[1] + t, b[2]:b[2] + t]
  specials = [lambda x: x.__setitem__((0, 0), np.inf), lambda x: x.fill(0.0),
              lambda x: x.__setitem__((-1, -1), np.nan),
              lambda x: (x.__setitem__((0, -1), np.inf), x.__setitem__((-1, 0), -np.inf))]
  for b, put in zip(blocks[:-1], specials):
    put(block(b))
  block(blocks[-1])[-1, -1] = -np.inf
  if straddle:
    for b, (amax, v) in zip(blocks[len(specials):-1], _straddlers(rng, len(blocks))):
      x = block(b)
      x *= 1e-3 * amax / np.abs(x).max()
      x[0, 0], x[-1, -1] = -amax, v
  return w


BLOCK_CASES = [  # w's shape and dtype: blocks part-filled along K and N, one and several matrices, 2-D
    ((3, 300, 200), jnp.bfloat16),
    ((2, 128, 384), jnp.float32),
    ((1, 40, 136), jnp.float32),
    ((200, 130), jnp.float32),
    ((4, 256, 256), jnp.float32),   # 16 blocks: 11 with a rounding straddler
]


def _interpreter_check():
  from test_kernels import _NP_DTYPES, _NpDtype
  _NP_DTYPES.setdefault(np.dtype(F8), _NpDtype("float8_e4m3fn"))
  _NP_DTYPES.setdefault(np.dtype(jnp.bfloat16), _NpDtype("bfloat16"))
  _exact_e4m3()
  tq._launch = _interpreter_launch
  rng = np.random.default_rng(0)
  for m, c, dtype in ROW_CASES:
    straddle = dtype == jnp.float32   # (the pairs are float32 values)
    for special in (False, True):
      x = _operand(rng, m, c)
      x = jnp.asarray(_special(x, rng, straddle) if special else x, dtype)
      n0 = len(LAUNCHES)
      got = jax.jit(lambda a: tq.quantize_rows(a))(x)   # (a fresh trace: one launch each)
      assert LAUNCHES[n0:] == ["_rows_kernel"]
      _same_bits(got, fp8.quantize_tiles(x, axis=1), f"quantize_rows M={m} C={c} {x.dtype} special={special}")
  assert sum(CONVERSIONS) >= sum(m * c for m, c, _ in ROW_CASES) * 2, "casts not seen"
  for shape, dtype in BLOCK_CASES:
    for special in (False, True):
      w = _operand(rng, int(np.prod(shape[:-1])), shape[-1]).reshape(shape)
      if special:
        w = _special_blocks(w.reshape((-1,) + shape[-2:]), rng, dtype == jnp.float32).reshape(shape)
      w = jnp.asarray(w, dtype)
      n0 = len(LAUNCHES)
      got = jax.jit(lambda a: tq.QUANTIZE_BLOCKS(a))(w)   # (a fresh trace: one launch each)
      assert LAUNCHES[n0:] == ["_blocks_kernel"]
      _same_bits(got, fp8.quantize_blocks(w), f"quantize_blocks {shape} {w.dtype} special={special}")
  # the backend's form (`GmmBackend.fp8_quantize`) is the kernel
  m, c, dtype = ROW_CASES[1]
  x = jnp.asarray(_operand(rng, m, c), dtype)
  n0 = len(LAUNCHES)
  got = jax.jit(tq.QUANTIZE_ROWS)(x)
  assert LAUNCHES[n0:] == ["_rows_kernel"]
  _same_bits(got, fp8.quantize_tiles(x, axis=1), "QUANTIZE_ROWS")
  print("FP8_QUANT_INTERPRETER_OK")


@pytest.mark.extras("triton")
def test_kernels_in_interpreter_match_quantize_tiles_bit_for_bit():
  run_in_triton_interpreter("test_fp8_quant_triton", "_interpreter_check", "FP8_QUANT_INTERPRETER_OK",
                            timeout=300)


# ----------------------------------------------------------------------------------------------
# Compiled for Hopper (no GPU needed): what the interpreter's numpy arithmetic cannot show.


def _compile(kernel, launch, x_type, x_name="x_ptr"):
  """(ptxas's resources, PTX) of `kernel` for sm_90a at `launch`, through bench/kernel_resources.py."""
  import triton
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
  import kernel_resources as kr
  try:
    kr._ptxas()
  except FileNotFoundError as e:
    pytest.skip(str(e))
  meta = dict(launch)
  meta.pop("grid")
  warps, stages = meta.pop("num_warps"), meta.pop("num_stages")
  compiled = []
  compile_ = triton.compile

  def keep(*a, **k):
    compiled.append(compile_(*a, **k))
    return compiled[-1]
  triton.compile = keep
  try:
    res = kr.compile_resources(kernel, {x_name: x_type, "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}, meta,
                               num_warps=warps, num_stages=stages)
  finally:
    triton.compile = compile_
  return res, compiled[-1].asm["ptx"]


@pytest.mark.extras("triton")
@pytest.mark.parametrize("x_type", ["*bf16", "*fp32"])
def test_kernels_compile_for_hopper_with_exact_arithmetic_and_no_spills(x_type):
  m, c = 491520, 768   # UMoE-base's FFN rows (32768 tokens x top-15) by d_model
  res, ptx = _compile(tq._rows_kernel, tq.rows_launch(m, c), x_type)
  what = (x_type, res)
  assert res["spill_stores"] == res["spill_loads"] == res["stack"] == 0, what
  assert res["registers"] <= 128, what      # >= 16 warps an SM: enough loads in flight
  # The reciprocal correctly rounded: Triton's `/` would give div.full.f32 (approximate).
  assert "div.rn.f32" in ptx and not re.search(r"div\.(full|approx)", ptx), what
  # A NaN-propagating clip (a plain min / max would turn NaN into a bound): min(|y|, 448) with y's
  # sign, NaN kept.
  assert re.search(r"min\.NaN\.xorsign\.abs\.f32", ptx) and not re.search(r"\bmin(\.ftz)?\.f32", ptx), what
  assert "cvt.rn.satfinite.e4m3x2.f32" in ptx, what   # round to nearest even
  # 16-byte loads and stores, no byte stores: a row's FP8 values stored 16 at a time.
  assert re.search(r"ld\.global(\.\w+)*\.v4\.b32", ptx) and re.search(r"st\.global\.v4\.b32", ptx), what
  assert not re.search(r"st\.global(\.\w+)*\.(b8|u8|b16)\b", ptx), what
  loads = ["v4.b32" if op.endswith(".v4.b32") else op.split(".")[-1]
           for op in re.findall(r"\bld\.global[\w.]*", ptx)]
  assert set(loads) == {"v4.b32"}, (what, loads)


@pytest.mark.extras("triton")
@pytest.mark.parametrize("x_type", ["*bf16", "*fp32"])
def test_block_kernel_compiles_for_hopper_with_exact_arithmetic_and_no_spills(x_type):
  res, ptx = _compile(tq._blocks_kernel, tq.blocks_launch(128, 192, 768), x_type, "w_ptr")
  what = (x_type, res)
  assert res["spill_stores"] == res["spill_loads"] == res["stack"] == 0, what
  assert "div.rn.f32" in ptx and not re.search(r"div\.(full|approx)", ptx), what
  assert re.search(r"min\.NaN\.xorsign\.abs\.f32", ptx) and not re.search(r"\bmin(\.ftz)?\.f32", ptx), what
  assert "cvt.rn.satfinite.e4m3x2.f32" in ptx, what
