"""GPU checks of the FP8 Triton grouped matmul (kernels/gmm/triton_fp8_gmm.py; CPU interpreter runs:
tests/test_fp8_triton.py): the raw gmm and transposed gmm at UMoE-base's FFN shapes (Dirichlet-skewed
groups, an empty group, rows past the groups) and at widths that are not multiples of 128, against a
float64 loop over the dequantised operands; NaN and inf inputs quantised on the GPU (whose tensor
cores read e4m3's NaN code, which the interpreter cannot); the one-pass quantiser against the CPU's
bits; and `fp8_gmm(..., backend="triton")` and the dense products through it, values and gradients
(the weight gradient in the operands' dtype, by the bf16 kernels), against float64 loops. Skipped
without a GPU with FP8 tensor cores, Triton and jax-triton. Timing: bench/gmm.py --precision=bf16,fp8.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.gmm import triton_fp8_gmm as tf
from test_fp8_triton import _compare, _loop_gmm, _loop_tgmm, _operand
from umoe_jax.ops import fp8
from umoe_jax.ops import gmm_backends as gb


def _fp8_gpu() -> bool:
  if not tf.available():
    return False
  cc = getattr(jax.devices()[0], "compute_capability", None)
  return bool(cc) and tuple(int(v) for v in str(cc).split(".")[:2]) >= (8, 9)


# the quick tier: `pytest -m gpu_quick tests/gpu` (the FP8 kernel in both layouts, the quantiser and
# the bf16 weight gradient once)
QUICK = pytest.mark.gpu_quick

pytestmark = pytest.mark.skipif(not _fp8_gpu(), reason="needs a GPU with FP8 tensor cores (sm_89+), "
                                                       "Triton and jax-triton")

SHAPES = {  # M, K, N, group sizes
    # UMoE-base's FFN experts: 768 -> 192, 64 groups, Dirichlet-skewed, group 5 empty, 37 rows past
    "base": (8192, 768, 192, None),
    # K and N not multiples of 128 (last pieces of 72 and 16: 128- and 32-wide tail dots; base's
    # input gradient a 64-wide one), a split column tile (144 = 128 + 16), an empty group
    "odd": (1000, 200, 144, [300, 0, 451, 7, 200]),
}
# Within a 128-wide chunk Hopper's FP8 MMA adds with fewer mantissa bits than float32 (DeepSeek-V3
# measured ~14; hence the float32 promotion every 128 elements): the kernel's error against the float64
# loop, over the sum of the products' absolute values, allows that. A scale read for the wrong piece
# is off by orders of magnitude (`_operand`).
REL_BOUND = 5e-3
# Normwise error against the float64 loops: the FP8 MMA's accumulation inside a chunk (~1e-4); a second
# FP8 rounding or a wrong scale is 1e-2 or more.
NORM_BOUND = 3e-3


def _group_sizes(m, spec, seed):
  if spec is not None:
    return np.asarray(spec, np.int32)
  rng = np.random.default_rng(seed)
  gs = np.floor(rng.dirichlet(np.full(64, 2.0)) * (m - 37)).astype(np.int32)
  gs[5] = 0
  gs[-1] += m - 37 - gs.sum()
  return gs


# The operands' log-magnitude spread (`_operand`; it, the float64 loops and `_compare` are
# tests/test_fp8_triton.py's).
SPREAD = 1.5


def _raw(op, shape, special):
  """The kernel's output and the float64 loop's (and its absolute-value bound) for one op (the
  forward "gmm" or the transposed "gmm_t"), the rows in the groups."""
  m, k, n, spec = SHAPES[shape]
  gs = _group_sizes(m, spec, seed=m + k)
  rng = np.random.default_rng(m * 7 + k + n + special)
  rows = int(gs.sum())
  transpose = op == "gmm_t"
  lhs = _operand(rng, (m, n if transpose else k), (0, 1), SPREAD)
  rhs = _operand(rng, (len(gs), k, n), (1, 2), SPREAD)
  if special:
    busy = int(np.argmax(gs))
    r0 = int(gs[:busy].sum())
    lhs[rows:] = np.nan                    # never read
    lhs[r0 + 1] = 0.0
    lhs[r0 + 2, 3] = np.nan
    lhs[r0 + 4, -1] = np.inf
    rhs[busy, :128, :128] = 0.0
    rhs[busy, 130 % k, 5] = np.inf
    rhs[busy, 2, n - 1] = np.nan
  lq, ls = fp8.quantize_tiles(jnp.asarray(lhs), axis=1)
  rq, rs = fp8.quantize_blocks(jnp.asarray(rhs))
  got = jax.jit(lambda *x: tf.triton_fp8_gmm(*x, transpose_rhs=transpose, out_dtype=jnp.float32))(
      lq, ls, rq, rs, jnp.asarray(gs))
  dl, dr = np.asarray(fp8.dequantize_tiles(lq, ls, axis=1)), np.asarray(fp8.dequantize_blocks(rq, rs))
  got = np.asarray(got)
  assert np.all(got[rows:] == 0), f"{op} {shape}: rows past the groups are zero"
  return (gs, got[:rows], _loop_gmm(dl, dr, gs, transpose)[:rows],
          _loop_gmm(np.abs(dl), np.abs(dr), gs, transpose)[:rows])


# ONE_BLOCK_SCALES: the promotion's row scales where a tile's column part is in one weight block
@pytest.mark.parametrize("one_block", [False, True])
@pytest.mark.parametrize("shape", ["base", "odd"])
@pytest.mark.parametrize("op", ["gmm", "gmm_t"])
def test_raw_op_matches_float64_loop(op, shape, one_block, monkeypatch):
  monkeypatch.setattr(tf, "ONE_BLOCK_SCALES", one_block)
  gs, got, want, bound = _raw(op, shape, special=False)
  _compare(got, want, bound, None, f"{op} {shape}", rel=REL_BOUND)
  assert np.all(np.isfinite(got))
  # Normwise too: with random signs a sum of K products is ~sqrt(K) times smaller than the sum of
  # their absolute values, so the elementwise bound alone lets through an error of the size of a
  # second FP8 rounding (2.5%, measured on an H100 with N-major weights).
  rel = np.linalg.norm(got - want) / np.linalg.norm(want)
  assert rel <= NORM_BOUND, (op, shape, rel)


@pytest.mark.parametrize("op", ["gmm", "gmm_t"])
def test_zero_and_nonfinite_pieces(op):
  """Zero pieces (scale 0), NaN and inf inputs quantised on the GPU: non-finite exactly where the
  float64 loop's are, the rest within the bound (the inf in the last, partial piece)."""
  _, got, want, bound = _raw(op, "odd", special=True)
  assert not np.all(np.isfinite(want))
  _compare(got, want, bound, None, f"{op} special", rel=REL_BOUND)


CPU = jax.devices("cpu")[0]


def _deq_tiles(x, axis):
  """x quantised in 1 x 128 tiles along `axis` and dequantised, float64, computed on the host's CPU
  device: the reference must not depend on the GPU compiler it checks."""
  x = jax.device_put(np.asarray(x), CPU)
  return np.asarray(jax.jit(lambda a: fp8.dequantize_tiles(*fp8.quantize_tiles(a, axis=axis),
                                                           axis=axis))(x), np.float64)


def _deq_blocks(w):
  w = jax.device_put(np.asarray(w), CPU)
  return np.asarray(jax.jit(lambda a: fp8.dequantize_blocks(*fp8.quantize_blocks(a)))(w), np.float64)


def test_emulation_quantises_on_the_gpu():
  """The emulation's quantise-dequantise pairs compiled for the GPU give the CPU's bits: XLA's GPU
  compiler folds a convert to FP8 and back into nothing unless fp8.py keeps the pair apart."""
  rng = np.random.default_rng(5)
  x = _operand(rng, (512, 300), (0, 1), SPREAD)
  for f in (lambda a: fp8.fake_quant_tiles(a, axis=1), lambda a: fp8.fake_quant_tiles(a, axis=0),
            fp8.fake_quant_blocks):
    on_gpu = np.asarray(jax.jit(f)(jnp.asarray(x)))
    on_cpu = np.asarray(jax.jit(f)(jax.device_put(x, CPU)))
    assert not np.array_equal(on_cpu, x), "the CPU reference quantises"
    np.testing.assert_array_equal(on_gpu, on_cpu)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_one_pass_quantisers_give_the_cpus_bits(dtype):
  """kernels/gmm/triton_fp8_quant.py on the GPU (the backend's form, `GmmBackend.fp8_quantize`)
  against `fp8.quantize_tiles(x, axis=1)` on the CPU device, bit for bit (its correctly rounded
  reciprocal), at a width and a row count that leave partial tiles, with zero, NaN and inf tiles."""
  from kernels.gmm import triton_fp8_quant as tq
  rng = np.random.default_rng(9)
  x = _operand(rng, (1000, 200), (0, 1), SPREAD)
  x[3, :128] = 0.0
  x[7, 130] = np.nan
  x[600:728, 5] = 0.0
  x[900, 150] = np.inf
  cpu_rows = jax.device_put(np.asarray(jnp.asarray(x, dtype)), CPU)
  q, s = jax.jit(tq.QUANTIZE_ROWS)(jnp.asarray(x, dtype))
  wq, ws = jax.jit(lambda a: fp8.quantize_tiles(a, axis=1))(cpu_rows)
  what = jnp.dtype(dtype).name
  np.testing.assert_array_equal(np.asarray(q).view(np.uint8) & 0x7F == 0x7F,
                                np.asarray(wq).view(np.uint8) & 0x7F == 0x7F, err_msg=what)  # NaN codes
  ok = (np.asarray(wq).view(np.uint8) & 0x7F) != 0x7F
  np.testing.assert_array_equal(np.asarray(q).view(np.uint8)[ok], np.asarray(wq).view(np.uint8)[ok],
                                err_msg=what)
  np.testing.assert_array_equal(np.asarray(s), np.asarray(ws), err_msg=what)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_block_quantiser_gives_the_cpus_bits(dtype):
  """The one-pass block quantiser (`GmmBackend.fp8_quantize_blocks`) on the GPU against
  `fp8.quantize_blocks` on the CPU device, bit for bit, at UMoE-base's expert weights [128, 768,
  192] (a part-filled block column) with an inf, a NaN and a zero block."""
  from kernels.gmm import triton_fp8_quant as tq
  rng = np.random.default_rng(10)
  w = _operand(rng, (128, 768, 192), (0, 1, 2), SPREAD)
  w[3, :128, :128] = 0.0
  w[5, 300, 150] = np.nan
  w[7, 700, 10] = np.inf
  q, s = jax.jit(tq.QUANTIZE_BLOCKS)(jnp.asarray(w, dtype))
  wq, ws = jax.jit(fp8.quantize_blocks)(jax.device_put(np.asarray(jnp.asarray(w, dtype)), CPU))
  q, wq = np.asarray(q).view(np.uint8), np.asarray(wq).view(np.uint8)
  nan = (wq & 0x7F) == 0x7F
  np.testing.assert_array_equal((q & 0x7F) == 0x7F, nan)
  np.testing.assert_array_equal(q[~nan], wq[~nan])
  np.testing.assert_array_equal(np.asarray(s), np.asarray(ws))


@pytest.mark.parametrize("transpose", [False, True])
def test_gmm_through_a_row_index_gives_the_gathered_launchs_bits(transpose):
  """The gmm kernel reading its rows through `lhs_index` (top-k dispatch's sort order: each source
  row read by K product rows) gives the bits of the same launch on the gathered operands."""
  m, k, n, _ = SHAPES["base"]
  fan_out, gs = 3, _group_sizes(m, None, seed=11)
  rng = np.random.default_rng(12)
  kc = n if transpose else k
  lq, ls = fp8.quantize_tiles(jnp.asarray(_operand(rng, (-(-m // fan_out), kc), (0, 1), SPREAD)), axis=1)
  rq, rs = fp8.quantize_blocks(jnp.asarray(_operand(rng, (len(gs), k, n), (1, 2), SPREAD)))
  index = jnp.asarray(rng.permutation(m) % lq.shape[0], jnp.int32)
  run = jax.jit(lambda q, sc, i: tf.triton_fp8_gmm(q, sc, rq, rs, jnp.asarray(gs), transpose_rhs=transpose,
                                                   out_dtype=jnp.float32, lhs_index=i))
  got = np.asarray(run(lq, ls, index))
  want = np.asarray(run(jnp.take(lq, index, axis=0), jnp.take(ls, index, axis=0), None))
  assert np.all(np.isfinite(want))
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("act", ["silu", "relu"])
def test_epilogue_quantises_act_out_as_the_quantiser(act):
  """`triton_fp8_gmm(quantize_out=act)` at UMoE-base's up projection, rows through the sort order:
  out the bits of the plain launch (the same tile), (q, scale) those of the one-pass quantiser on
  XLA's act(out) except where the two activations round apart (one e4m3 step there); rows past
  the groups zero."""
  from kernels.gmm import triton_fp8_quant as tq
  from umoe_jax.ops import epilogue
  m, k, n, _ = SHAPES["base"]
  gs = _group_sizes(m, None, seed=21)
  rng = np.random.default_rng(22)
  lq, ls = fp8.quantize_tiles(jnp.asarray(_operand(rng, (m // 3, k), (0, 1), SPREAD)), axis=1)
  rq, rs = fp8.quantize_blocks(jnp.asarray(_operand(rng, (len(gs), k, n), (1, 2), SPREAD)))
  index = jnp.asarray(rng.permutation(m) % lq.shape[0], jnp.int32)
  run = lambda **kw: jax.jit(lambda i: tf.triton_fp8_gmm(lq, ls, rq, rs, jnp.asarray(gs),
                                                         out_dtype=jnp.bfloat16, lhs_index=i, **kw))(index)
  out, q, scale = run(quantize_out=act)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(run(), np.float32))
  wq, ws = jax.jit(lambda o: tq.quantize_rows(epilogue.activate(act, o)))(out)
  scale, ws = np.asarray(scale), np.asarray(ws)
  np.testing.assert_allclose(scale, ws, rtol=2 ** -7)
  deq = lambda a, sc: np.asarray(fp8.dequantize_tiles(a, jnp.asarray(sc), axis=1), np.float64)
  got, want = deq(q, scale), deq(wq, ws)
  assert np.mean(got != want) < 2e-3, np.mean(got != want)
  assert np.all(np.abs(got - want) <= 2 ** -3 * np.abs(want) + 2 ** -9 * np.repeat(ws, 128, 1)[:, :n])
  rows = int(gs.sum())
  assert np.all(np.asarray(q.astype(jnp.float32))[rows:] == 0) and np.all(scale[rows:] == 0)


def _host_refs(lhs, rhs, cot, gs, transpose):
  """fp8_gmm's output and input gradient from the FP8 values (the quantisation on the CPU device),
  and its weight gradient from lhs and the cotangent as they are, in float64 loops on the host."""
  gs = np.asarray(gs)
  w = _deq_blocks(rhs)
  out = _loop_gmm(_deq_tiles(lhs, 1), w, gs, transpose)
  dlhs = _loop_gmm(_deq_tiles(cot, 1), w, gs, not transpose)
  a, b = (cot, lhs) if transpose else (lhs, cot)
  drhs = _loop_tgmm(np.asarray(a, np.float64), np.asarray(b, np.float64), gs)
  return out, dlhs, drhs


@pytest.mark.parametrize("transpose", [pytest.param(False, marks=QUICK), True])
def test_fp8_gmm_gradients_match_float64_loops(transpose):
  """fp8_gmm on the triton backend with bf16 operands, as training runs it: the output and the
  input gradient against the float64 loops over the FP8 values, the weight gradient (the bf16 tgmm
  kernel on the operands as they are) against the float64 loop over the bf16 values. A result's
  rounding to bf16 (~1e-3 normwise) is within the bound, a second FP8 rounding is not.
  (bf16, not float32: the bf16 kernel's default weight-gradient tile at these shapes takes more
  shared memory than an H100 has with float32 operands.)"""
  from umoe_jax.ops import fp8_gmm as fg
  gb.register_builtin_kernels()
  assert gb.BACKENDS.get("triton").fp8_gmm is tf.FP8_GMM
  m, k, n, _ = SHAPES["base"]
  gs = jnp.asarray(_group_sizes(m, None, seed=3))
  rng = np.random.default_rng(11 + transpose)
  lhs = jnp.asarray(_operand(rng, (m, n if transpose else k), (0,), SPREAD), jnp.bfloat16)
  rhs = jnp.asarray(_operand(rng, (64, k, n), (0,), SPREAD) / np.sqrt(k), jnp.bfloat16)
  cot = jnp.asarray(rng.standard_normal((m, k if transpose else n)), jnp.bfloat16)
  f = lambda x, w, c, s: jnp.sum(fg.fp8_gmm(x, w, s, backend="triton", transpose_rhs=transpose)
                                 * c.astype(jnp.float32))
  out = jax.jit(lambda x, w, s: fg.fp8_gmm(x, w, s, backend="triton", transpose_rhs=transpose))(lhs, rhs, gs)
  got = (out, *jax.jit(jax.grad(f, argnums=(0, 1)))(lhs, rhs, cot, gs))
  for name, g, w in zip(("out", "dlhs", "drhs"), got, _host_refs(lhs, rhs, cot, gs, transpose)):
    g = np.asarray(g, np.float64)
    assert g.shape == w.shape and np.all(np.isfinite(g)), name
    rel = np.linalg.norm(g - w) / np.linalg.norm(w)
    assert rel <= NORM_BOUND, (name, rel)
  assert np.all(np.asarray(got[2], np.float64)[np.asarray(gs) == 0] == 0), "an empty group's weights"


def test_dense_product_through_the_kernel_matches_float64_loops():
  """train.precision=fp8's dense projections on one GPU (`umoe_jax.model.layers.fp8_dense` with the
  kernel, one group of every row) against float64 products: output and input gradient of the FP8
  values, weight gradient (one group: XLA's dot) of the operands as they are; and in bf16 the
  weight gradient of the bf16 values."""
  from umoe_jax.model.layers import fp8_dense
  rng = np.random.default_rng(21)
  x = jnp.asarray(_operand(rng, (4, 1000, 768), (1, 2), SPREAD))
  w = jnp.asarray(_operand(rng, (768, 3072), (0, 1), SPREAD) / np.sqrt(768))
  cot = jnp.asarray(rng.standard_normal((4, 1000, 3072)), jnp.float32)
  f = lambda a, b, c: jnp.sum(fp8_dense(a, b, "triton") * c)  # cot an argument: no constant folding
  got = (jax.jit(lambda a, b: fp8_dense(a, b, "triton"))(x, w), *jax.jit(jax.grad(f, argnums=(0, 1)))(x, w, cot))
  x2, c2 = x.reshape(4000, 768), cot.reshape(4000, 3072)
  out, dx, dw = _host_refs(x2, w[None], c2, jnp.asarray([4000]), False)
  for name, g, want in zip(("out", "dx", "dw"), got, (out.reshape(4, 1000, 3072), dx.reshape(x.shape), dw[0])):
    g = np.asarray(g, np.float64)
    assert g.shape == want.shape and np.all(np.isfinite(g)), name
    rel = np.linalg.norm(g - want) / np.linalg.norm(want)
    assert rel <= NORM_BOUND, (name, rel)
  x = jnp.asarray(_operand(rng, (4000, 768), (0, 1), SPREAD), jnp.bfloat16)
  w = jnp.asarray(_operand(rng, (768, 1024), (0, 1), SPREAD) / np.sqrt(768), jnp.bfloat16)
  c = jnp.asarray(rng.standard_normal((4000, 1024)), jnp.bfloat16)
  dw = jax.jit(jax.grad(lambda a, b: jnp.sum(fp8_dense(a, b, "triton").astype(jnp.float32)
                                              * c.astype(jnp.float32)), argnums=1))(x, w)
  want = np.asarray(x, np.float64).T @ np.asarray(c, np.float64)
  assert np.linalg.norm(np.asarray(dw, np.float64) - want) / np.linalg.norm(want) <= NORM_BOUND
