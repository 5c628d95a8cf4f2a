"""train.precision=fp8: the FP8 quantisation (umoe_jax/ops/fp8.py), `fp8_dot` and the experts'
`fp8_gmm` against float64 products of operands quantised by naive loops here; the model's wiring
(every expert grouped matmul through fp8_gmm, the dense projections through fp8_dot); the config's
bad input; a checkpoint resumed in the other precision; tiny models trained in fp8 emulation against
bf16.

The loops quantise as the recipe says (one float32 scale amax / 448 per 1 x 128 tile or 128 x 128
block, x / scale rounded to e4m3 in float32, the reciprocals rounded once) and multiply in float64,
so a product that quantised another layout (per tensor, tiles along the other axis, the scale
inverted) misses them by percents against tolerances of 1e-5
(`test_the_references_tell_layouts_apart` shows the margins).
"""
from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs.common
from conftest import rel_err
from test_cli_errors import losses as train_losses
from test_train import small_config
from umoe_jax.config import ConfigError, model_config
from umoe_jax.ops import fp8
from umoe_jax.ops.fp8_gmm import fp8_gmm
from umoe_jax.train import config as train_config
from umoe_jax.train import precision as precision_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
E4M3 = jnp.float8_e4m3fn
MAX = 448.0
T = 128
# Products of the same quantised operands: float32 accumulation against float64 (measured at most
# 3.2e-7 for every product here; a product of another quantisation misses by 3e-2 or more).
TOL = 1e-5


# ----------------------------------------------------------------------------------------------
# The references: naive loops over pieces, float64 products.


def ref_piece(piece: np.ndarray) -> tuple[np.ndarray, np.float32]:
  """One piece (float32) -> (dequantised float64, its float32 scale): scale = amax * (1/448), q =
  round_e4m3(x * (1/scale)), in float32 (clipped to +-448, which the cast would make NaN)."""
  with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
    amax = np.max(np.abs(piece.astype(np.float32)))
    scale = np.float32(amax) * np.float32(1 / MAX)
    if scale == 0:
      return np.zeros(piece.shape), scale
    q = np.clip(piece.astype(np.float32) * (np.float32(1) / scale), -MAX, MAX).astype(E4M3)
    return q.astype(np.float64) * np.float64(scale), scale


def ref_tiles(x, axis: int) -> tuple[np.ndarray, np.ndarray]:
  """x in 1 x 128 pieces along `axis` -> (dequantised float64 like x, scales with `axis` of
  ceil(n / 128))."""
  x = np.moveaxis(np.asarray(x, np.float32), axis, -1)
  n = x.shape[-1]
  dq = np.zeros(x.shape)
  scales = np.zeros(x.shape[:-1] + (math.ceil(n / T),), np.float32)
  for idx in np.ndindex(*x.shape[:-1]):
    for j, start in enumerate(range(0, n, T)):
      dq[idx + (slice(start, start + T),)], scales[idx + (j,)] = ref_piece(x[idx][start:start + T])
  return np.moveaxis(dq, -1, axis), np.moveaxis(scales, -1, axis)


def ref_blocks(w) -> tuple[np.ndarray, np.ndarray]:
  """w [..., K, N] in 128 x 128 pieces -> (dequantised float64, scales [..., ceil(K/128),
  ceil(N/128)])."""
  w = np.asarray(w, np.float32)
  k, n = w.shape[-2:]
  dq = np.zeros(w.shape)
  scales = np.zeros(w.shape[:-2] + (math.ceil(k / T), math.ceil(n / T)), np.float32)
  for idx in np.ndindex(*w.shape[:-2]):
    for i, r in enumerate(range(0, k, T)):
      for j, c in enumerate(range(0, n, T)):
        block = idx + (slice(r, r + T), slice(c, c + T))
        dq[block], scales[idx + (i, j)] = ref_piece(w[block])
  return dq, scales


def wide_range(rng, shape, decades: float = 4.0) -> np.ndarray:
  """Normal values times 10^U(-decades, decades): the small ones fall among e4m3's subnormals."""
  return (rng.normal(size=shape) * 10.0 ** rng.uniform(-decades, decades, shape)).astype(np.float32)


def assert_within_e4m3(x, dq, scale_full):
  """|x - dq| <= max(|x| 2^-4, scale 2^-10): half a unit of e4m3's 3-bit mantissa, or half its
  smallest subnormal (2^-9) in units of the scale."""
  x, dq, s = (np.asarray(a, np.float64) for a in (x, dq, scale_full))
  bound = np.maximum(np.abs(x) * 2.0 ** -4, s * 2.0 ** -10) * (1 + 1e-6)
  worst = np.max(np.abs(x - dq) - bound)
  assert worst <= 0, f"error bound exceeded by {worst:.3g}"


# ----------------------------------------------------------------------------------------------
# Quantisation.


@pytest.mark.parametrize("axis", [0, 1])
def test_tiles_follow_the_loop_and_the_e4m3_bound(axis):
  rng = np.random.default_rng(1)
  x = wide_range(rng, (300, 5) if axis == 0 else (5, 300))
  # The last, shorter tile (44 values) is far smaller than the others: a scale shared with them
  # would flush it to zero.
  tail = [slice(None)] * 2
  tail[axis] = slice(256, None)
  x[tuple(tail)] *= 1e-4
  q, scale = fp8.quantize_tiles(jnp.asarray(x), axis=axis)
  want_dq, want_scale = ref_tiles(x, axis)
  assert q.dtype == E4M3 and q.shape == x.shape and scale.dtype == jnp.float32
  assert scale.shape == ((3, 5) if axis == 0 else (5, 3))
  np.testing.assert_allclose(np.asarray(scale), want_scale, rtol=1e-7)
  dq = np.asarray(fp8.dequantize_tiles(q, scale, axis=axis), np.float64)
  np.testing.assert_allclose(dq, want_dq, rtol=2e-7, atol=0)
  assert_within_e4m3(x, dq, np.repeat(np.asarray(scale), T, axis=axis)[tuple(
      slice(0, n) for n in x.shape)])
  # amax maps to the top of the e4m3 range in every tile (a scale applied the other way would not).
  top = np.abs(np.asarray(q, np.float32))
  top = np.moveaxis(top, axis, -1)
  for start in range(0, 300, T):
    np.testing.assert_array_equal(top[..., start:start + T].max(axis=-1), MAX)


def test_blocks_follow_the_loop_and_the_e4m3_bound():
  """Blocks 1e6 apart in magnitude: one scale for the whole tensor (or per row of blocks) would
  round the small ones to zero, past the bound."""
  rng = np.random.default_rng(2)
  w = rng.normal(size=(2, 300, 200)).astype(np.float32)
  mags = 10.0 ** rng.integers(-3, 4, size=(2, 3, 2))
  for g, i, j in np.ndindex(*mags.shape):
    w[g, i * T:(i + 1) * T, j * T:(j + 1) * T] *= mags[g, i, j]
  q, scale = fp8.quantize_blocks(jnp.asarray(w))
  want_dq, want_scale = ref_blocks(w)
  assert scale.shape == (2, 3, 2)
  np.testing.assert_allclose(np.asarray(scale), want_scale, rtol=1e-7)
  dq = np.asarray(fp8.dequantize_blocks(q, scale), np.float64)
  np.testing.assert_allclose(dq, want_dq, rtol=2e-7, atol=0)
  full = np.repeat(np.repeat(np.asarray(scale), T, axis=1), T, axis=2)[:, :300, :200]
  assert_within_e4m3(w, dq, full)


def test_zero_and_non_finite_pieces():
  """A piece of zeros has scale 0 and comes back zeros; a piece holding inf, -inf or NaN comes back
  NaN in every value (never a finite number), the pieces beside it untouched."""
  rng = np.random.default_rng(3)
  x = rng.normal(size=(4, 384)).astype(np.float32)
  x[0, 128:256] = 0.0
  x[1, 5], x[2, 300], x[3, 130] = np.inf, -np.inf, np.nan
  q, scale = fp8.quantize_tiles(jnp.asarray(x))
  dq = np.asarray(fp8.dequantize_tiles(q, scale))
  assert float(scale[0, 1]) == 0.0 and not dq[0, 128:256].any()
  for row, tile in ((1, 0), (2, 2), (3, 1)):
    piece = dq[row, tile * T:(tile + 1) * T]
    assert np.isnan(piece).all(), (row, tile)
    others = np.delete(dq[row], np.s_[tile * T:(tile + 1) * T])
    assert np.isfinite(others).all()
  w = rng.normal(size=(256, 256)).astype(np.float32)
  w[:128, 128:] = 0.0
  w[200, 10] = np.inf
  qw, sw = fp8.quantize_blocks(jnp.asarray(w))
  dqw = np.asarray(fp8.dequantize_blocks(qw, sw))
  assert float(sw[0, 1]) == 0.0 and not dqw[:128, 128:].any()
  assert np.isnan(dqw[128:, :128]).all() and np.isfinite(dqw[:128, :128]).all()
  assert np.isfinite(dqw[128:, 128:]).all()


def test_the_largest_value_of_a_piece_is_448_not_nan():
  """x / scale for the piece's amax may round a hair past 448 in float32, which the e4m3 cast would
  turn into NaN: 4000 pieces of random values (some exactly +-448 * 2^k) keep every value finite,
  and amax lands on +-448."""
  rng = np.random.default_rng(4)
  x = wide_range(rng, (4000, T), decades=1.0)
  x[::7, 3] = 448.0 * 2.0 ** rng.integers(-20, 20, size=x[::7].shape[0])
  x[1::7, 9] = -x[1::7, 9] * 1e3
  q, scale = fp8.quantize_tiles(jnp.asarray(x))
  qf = np.asarray(q, np.float32)
  assert not np.isnan(qf).any()
  np.testing.assert_array_equal(np.abs(qf).max(axis=1), MAX)
  assert_within_e4m3(x, np.asarray(fp8.dequantize_tiles(q, scale)), np.asarray(scale))


# ----------------------------------------------------------------------------------------------
# fp8_dot


def _dot_refs(x2, w, dy):
  """(y, dx, dw) of x2 [M, K] @ w [K, N] with cotangent dy [M, N], the FP8 layouts of fp8.py; the
  weight gradient from the operands as they are."""
  wq = ref_blocks(w)[0]
  y = ref_tiles(x2, 1)[0] @ wq
  dx = ref_tiles(dy, 1)[0] @ wq.T
  dw = np.asarray(x2, np.float64).T @ np.asarray(dy, np.float64)
  return y, dx, dw


def _fp8_dot_vjp(x, w, dy, impl, out_dtype=jnp.float32):
  y, vjp = jax.vjp(lambda a, b: fp8.fp8_dot(a, b, out_dtype=out_dtype, impl=impl), x, w)
  return (y,) + vjp(dy.astype(y.dtype))


@pytest.mark.parametrize("impl", ["emulate", "xla"])
def test_fp8_dot_matches_the_float64_reference(impl):
  """x [3, 50, 300] (K = 300: a last shorter tile) @ w [300, 200]: the forward product, the input
  gradient (dy in tiles along N, w's blocks transposed) and the weight gradient (x and dy as they
  are, the contraction over the 150 tokens) within float32 rounding of the reference."""
  rng = np.random.default_rng(5)
  x = wide_range(rng, (3, 50, 300), decades=2.0)
  w = wide_range(rng, (300, 200), decades=1.0)
  dy = wide_range(rng, (3, 50, 200), decades=2.0)
  y, dx, dw = _fp8_dot_vjp(jnp.asarray(x), jnp.asarray(w), jnp.asarray(dy), impl)
  ry, rdx, rdw = _dot_refs(x.reshape(150, 300), w, dy.reshape(150, 200))
  assert y.shape == (3, 50, 200) and dx.shape == x.shape and dw.shape == w.shape
  assert rel_err(np.asarray(y).reshape(150, 200), ry) < TOL
  assert rel_err(np.asarray(dx).reshape(150, 300), rdx) < TOL
  assert rel_err(np.asarray(dw), rdw) < TOL


def test_fp8_dot_impls_agree_and_keep_dtypes():
  """The FP8 dot_generals per 128-wide chunk (xla) and the dequantised float32 products (emulate)
  agree to float32 rounding; bf16 operands give a bf16 output and bf16 / float32 gradients in their
  own dtypes; a NaN in x makes its output row NaN."""
  rng = np.random.default_rng(6)
  x = jnp.asarray(wide_range(rng, (70, 260), decades=2.0))
  w = jnp.asarray(wide_range(rng, (260, 130), decades=1.0))
  dy = jnp.asarray(rng.normal(size=(70, 130)).astype(np.float32))
  a, b = _fp8_dot_vjp(x, w, dy, "emulate"), _fp8_dot_vjp(x, w, dy, "xla")
  for got, want in zip(b, a):
    assert rel_err(got, want) < 2e-6
  y, dxb, dwf = _fp8_dot_vjp(x.astype(jnp.bfloat16), w, dy, "emulate", out_dtype=None)
  assert (y.dtype, dxb.dtype, dwf.dtype) == (jnp.bfloat16, jnp.bfloat16, jnp.float32)
  bad = x.at[3, 100].set(jnp.nan)
  for impl in ("emulate", "xla"):
    out = np.asarray(fp8.fp8_dot(bad, w, impl=impl))
    assert np.isnan(out[3]).all() and np.isfinite(np.delete(out, 3, axis=0)).all()


def test_dense_fp8_impl_by_platform_and_devices(monkeypatch):
  """The emulation off GPU; on one GPU the FP8 kernel auto takes, when it takes one; the chunked
  dot_generals on several GPUs (the SPMD partitioner cannot split the kernel's custom call) or where
  auto keeps the emulation for the grouped products."""
  from umoe_jax.model import layers
  assert layers.fp8_dense_impl() == "emulate"
  monkeypatch.setattr(layers.jax, "default_backend", lambda: "gpu")
  for auto, devices, want in (("triton", 1, "triton"), ("triton", 8, "xla"), ("xla", 1, "xla")):
    monkeypatch.setattr(layers, "fp8_backend", lambda name, a=auto: a)
    monkeypatch.setattr(layers.jax, "device_count", lambda d=devices: d)
    assert layers.fp8_dense_impl() == want, (auto, devices)


def test_the_references_tell_layouts_apart():
  """The mistakes these tests are there to catch move the products by far more than TOL: the
  weight gradient from quantised operands (FP8's 128-row tiles over tokens), weights quantised per
  tensor, and x tiled along the wrong axis in the forward product."""
  rng = np.random.default_rng(7)
  x, w, dy = (wide_range(rng, s, decades=1.5) for s in ((150, 300), (300, 200), (150, 200)))
  y, _, dw = _dot_refs(x, w, dy)
  wrong_dw = ref_tiles(x, 0)[0].T @ ref_tiles(dy, 0)[0]
  scale = np.float32(np.abs(w).max()) / np.float32(MAX)
  per_tensor_w = np.clip(w / scale, -MAX, MAX).astype(E4M3).astype(np.float64) * scale
  wrong_y1 = ref_tiles(x, 1)[0] @ per_tensor_w
  wrong_y2 = ref_tiles(x, 0)[0] @ ref_blocks(w)[0]
  for wrong, right in ((wrong_dw, dw), (wrong_y1, y), (wrong_y2, y)):
    assert rel_err(wrong, right) > 100 * TOL
  got_y, _, got_dw = _fp8_dot_vjp(jnp.asarray(x), jnp.asarray(w), jnp.asarray(dy), "emulate")
  assert rel_err(got_dw, dw) < TOL and rel_err(got_y, y) < TOL


# ----------------------------------------------------------------------------------------------
# fp8_gmm


GROUPS = {"ragged": [37, 0, 90, 3],      # an empty group; 20 padding rows past the sum
          "empty": [0, 0, 0, 0],         # every row is padding
          "skewed": [0, 150, 0, 0]}      # one expert takes every row


def _gmm_refs(lhs, rhs, sizes, dout, transpose_rhs):
  """(out, dlhs, drhs) of the grouped product, group by group: out and dlhs from the loop-quantised
  operands (lhs tiles along its contraction, rhs blocks, dout tiles along its features), drhs from
  lhs and dout as they are."""
  m = lhs.shape[0]
  rq = ref_blocks(rhs)[0]
  lq, dq = ref_tiles(lhs, 1)[0], ref_tiles(dout, 1)[0]
  lr, dr = np.asarray(lhs, np.float64), np.asarray(dout, np.float64)
  out = np.zeros((m, rhs.shape[1] if transpose_rhs else rhs.shape[2]))
  dlhs, drhs = np.zeros(lhs.shape), np.zeros(rhs.shape)
  start = 0
  for g, size in enumerate(sizes):
    rows = slice(start, start + size)
    wg = rq[g].T if transpose_rhs else rq[g]
    out[rows] = lq[rows] @ wg
    dlhs[rows] = dq[rows] @ wg.T
    drhs[g] = dr[rows].T @ lr[rows] if transpose_rhs else lr[rows].T @ dr[rows]
    start += size
  return out, dlhs, drhs


@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("groups", list(GROUPS))
def test_fp8_gmm_matches_the_float64_reference(groups, transpose_rhs):
  sizes = GROUPS[groups]
  rng = np.random.default_rng(8)
  m, k, n = 150, 300, 200
  rhs = wide_range(rng, (4, k, n), decades=1.0)
  lhs = wide_range(rng, (m, n if transpose_rhs else k), decades=2.0)
  dout = wide_range(rng, (m, k if transpose_rhs else n), decades=2.0)

  def f(a, b):
    return fp8_gmm(a, b, jnp.asarray(sizes, jnp.int32), backend="xla", transpose_rhs=transpose_rhs,
                   preferred_element_type=jnp.float32)

  out, vjp = jax.vjp(f, jnp.asarray(lhs), jnp.asarray(rhs))
  dlhs, drhs = vjp(jnp.asarray(dout))
  ro, rdl, rdr = _gmm_refs(lhs, rhs, sizes, dout, transpose_rhs)
  rows = sum(sizes)
  for got, want in ((out, ro), (dlhs, rdl), (drhs, rdr)):
    got = np.asarray(got)
    assert got.shape == want.shape
    if not want.any():
      assert not got.any()
    else:
      assert rel_err(got, want) < TOL
  # padding rows: zero outputs and zero input gradients; empty groups: zero weight gradients
  assert not np.asarray(out)[rows:].any() and not np.asarray(dlhs)[rows:].any()
  for g, size in enumerate(sizes):
    assert np.asarray(drhs[g]).any() == (size > 0)


def test_fp8_gmm_through_gmm_and_the_fused_forms():
  """`gmm(..., fp8=True)` is fp8_gmm; the fused dispatch's gather_gmm under fp8 gives the values
  and gradients of its definition computed from fp8_gmm, gmm_combine under fp8 its forward (its
  gradients: test_fp8_fused_combine_matches_the_float64_reference)."""
  from umoe_jax.ops import dispatch
  from umoe_jax.ops.fused_dispatch import gather_gmm, gmm_combine
  from umoe_jax.ops.gmm import gmm
  rng = np.random.default_rng(9)
  n_tok, k, d, f, e = 40, 2, 96, 160, 4
  x = jnp.asarray(rng.normal(size=(n_tok, d)).astype(np.float32))
  ids = jnp.asarray(rng.integers(0, e, (n_tok, k)), jnp.int32)
  gates = jnp.asarray(rng.uniform(size=(n_tok, k)).astype(np.float32))
  w1 = jnp.asarray(rng.normal(size=(e, d, f)).astype(np.float32))
  w2 = jnp.asarray(rng.normal(size=(e, f, d)).astype(np.float32))
  plan = dispatch.make_plan(ids, e)

  def last(h, w2, gates):
    y = fp8_gmm(jax.nn.silu(h), w2, plan.group_sizes, backend="xla")
    return dispatch.combine(dispatch.unpermute(y, plan).reshape(n_tok, k, d), gates)

  def fused(x, w1, w2, gates):
    return last(gather_gmm(x, w1, plan, k, backend="xla", fp8=True), w2, gates)

  def plain(x, w1, w2, gates):
    return last(fp8_gmm(dispatch.permute(x, plan, k), w1, plan.group_sizes, backend="xla"), w2, gates)

  g = jnp.asarray(rng.normal(size=(n_tok, d)).astype(np.float32))
  a = jax.vjp(fused, x, w1, w2, gates)
  b = jax.vjp(plain, x, w1, w2, gates)
  assert rel_err(a[0], b[0]) < 1e-6
  for ga, gb in zip(a[1](g), b[1](g)):
    assert rel_err(ga, gb) < 1e-6
  h = fp8_gmm(dispatch.permute(x, plan, k), w1, plan.group_sizes, backend="xla")
  combined = gmm_combine(h, w2, plan, gates, backend="xla", activation="silu", fp8=True)
  assert rel_err(combined, last(h, w2, gates)) < 1e-6
  rows = dispatch.permute(x, plan, k)
  np.testing.assert_array_equal(gmm(rows, w1, plan.group_sizes, backend="xla", fp8=True),
                                fp8_gmm(rows, w1, plan.group_sizes, backend="xla"))
  # [N, S, D] rows read from slot 1 on (pre-mixing's routed mixed vectors)
  x3 = jnp.asarray(rng.normal(size=(n_tok, 1 + k, d)).astype(np.float32))
  slot_fused = lambda x3, w1: gather_gmm(x3, w1, plan, k, backend="xla", first_slot=1, fp8=True)
  slot_plain = lambda x3, w1: fp8_gmm(dispatch.permute(x3[:, 1:], plan, k), w1, plan.group_sizes,
                                      backend="xla")
  np.testing.assert_array_equal(slot_fused(x3, w1), slot_plain(x3, w1))
  dy = jnp.asarray(rng.normal(size=(n_tok * k, f)).astype(np.float32))
  (dx3, dw), (wdx3, wdw) = (jax.vjp(fn, x3, w1)[1](dy) for fn in (slot_fused, slot_plain))
  assert rel_err(dx3, wdx3) < 1e-6 and rel_err(dw, wdw) < 1e-6
  assert np.all(np.asarray(dx3)[:, 0] == 0)          # slot 0 is not read: no gradient there


def test_fp8_gather_gmm_quantises_the_tokens_before_the_gather(monkeypatch):
  """The forward quantises the N token rows, then gathers FP8 rows and scales: never the M = N*K
  gathered copy (a row's tiles run along the row, so both give the same values)."""
  from umoe_jax.ops import dispatch
  from umoe_jax.ops.fused_dispatch import gather_gmm
  shapes = []
  real = fp8.quantize_tiles
  monkeypatch.setattr(fp8, "quantize_tiles", lambda a, axis=-1, **kw: (shapes.append((a.shape, axis)),
                                                                        real(a, axis=axis, **kw))[1])
  rng = np.random.default_rng(10)
  n_tok, k, d, f, e = 24, 3, 128, 64, 4
  x = jnp.asarray(rng.normal(size=(n_tok, d)).astype(np.float32))
  plan = dispatch.make_plan(jnp.asarray(rng.integers(0, e, (n_tok, k)), jnp.int32), e)
  w = jnp.asarray(rng.normal(size=(e, d, f)).astype(np.float32))
  gather_gmm(x, w, plan, k, backend="xla", fp8=True)
  assert shapes == [((n_tok, d), 1)]


def test_a_wider_output_dtype_is_kept_unrounded():
  """bf16 operands: fp8_dot's out_dtype and fp8_gmm's preferred_element_type float32 give float32
  products within TOL of the float64 reference (rounded to bf16 on the way, they would miss by
  ~1e-3), fp8_gmm's gradients in the operands' own dtypes (fp8_dot's:
  test_fp8_dot_impls_agree_and_keep_dtypes)."""
  rng = np.random.default_rng(15)
  f32 = lambda a: np.asarray(a, np.float32)
  x, w, dy = (jnp.asarray(wide_range(rng, s, decades=1.0), jnp.bfloat16)
              for s in ((150, 300), (300, 200), (150, 200)))
  y = jax.jit(lambda a, b: fp8.fp8_dot(a, b, out_dtype=jnp.float32))(x, w)
  assert y.dtype == jnp.float32
  assert rel_err(y, _dot_refs(f32(x), f32(w), f32(dy))[0]) < TOL
  sizes = [37, 0, 90, 3]
  rhs = jnp.asarray(wide_range(rng, (4, 300, 200), decades=1.0), jnp.bfloat16)

  @jax.jit
  def value_and_pull(a, b, cot):
    out, pull = jax.vjp(lambda a, b: fp8_gmm(a, b, jnp.asarray(sizes, jnp.int32), backend="xla",
                                             preferred_element_type=jnp.float32), a, b)
    return (out, *pull(cot.astype(out.dtype)))
  out, dlhs, drhs = value_and_pull(x, rhs, dy)
  assert (out.dtype, dlhs.dtype, drhs.dtype) == (jnp.float32, jnp.bfloat16, jnp.bfloat16)
  assert rel_err(out, _gmm_refs(f32(x), f32(rhs), sizes, f32(dy), False)[0]) < TOL


def test_one_groups_weight_gradient_is_summed_in_float32():
  """One group's bf16 weight gradient (a dense product's) is one dot over the group's rows with a
  float32 sum: rows 128-255 are rows 0-127 negated (their cotangent rows within 10%), so the sum
  nearly cancels; it is within one bf16 unit (and float32 summation) of the float64 reference,
  where a bf16 sum misses by ~1e-3 of the terms; the 20 rows past the group are left out. Not
  jitted: inside a jit XLA's CPU compiler, allowed excess precision, drops a bf16 round trip."""
  from umoe_jax.ops.fp8_gmm import gradients
  rng = np.random.default_rng(16)
  a = wide_range(rng, (128, 96), decades=1.0)
  a = np.concatenate([a, -a, wide_range(rng, (20, 96))])             # 20 rows past the group
  d = wide_range(rng, (128, 64), decades=1.0)
  d = np.concatenate([d, d * rng.uniform(0.9, 1.1, d.shape), wide_range(rng, (20, 64))])
  a, d = (np.asarray(jnp.asarray(v, jnp.bfloat16), np.float32) for v in (a, d))
  w = jnp.asarray(wide_range(rng, (1, 96, 64), decades=1.0), jnp.bfloat16)
  got = gradients("xla", jnp.asarray(a, jnp.bfloat16), w, jnp.asarray([256], jnp.int32), False,
                  jnp.asarray(d, jnp.bfloat16))[1]
  assert got.shape == w.shape and got.dtype == jnp.bfloat16
  a64, d64 = np.asarray(a[:256], np.float64), np.asarray(d[:256], np.float64)
  want, bound = a64.T @ d64, np.abs(a64).T @ np.abs(d64)
  err = np.abs(np.asarray(got[0], np.float64) - want) / (np.abs(want) * 2.0 ** -7 + 1e-5 * bound)
  assert np.max(err) <= 1, float(np.max(err))


def test_fp8_dense_hands_one_group_of_all_rows_to_fp8_gmm(monkeypatch):
  from umoe_jax.model import layers
  seen = []
  monkeypatch.setattr(layers, "fp8_gmm", lambda rows, w, gs, backend: (
      seen.append((rows.shape, w.shape, np.asarray(gs).tolist(), backend)), rows @ w[0])[1])
  x, w = jnp.ones((2, 5, 8)), jnp.ones((8, 3))
  assert layers.fp8_dense(x, w, "triton").shape == (2, 5, 3)
  assert seen == [((10, 8), (1, 8, 3), [10], "triton")]


def _record_quantiser_calls(monkeypatch) -> list:
  """Gives the xla backend a quantiser of its own (`fp8.quantize_tiles` along the rows) that records
  the operand shape of each call in the list returned."""
  import dataclasses
  from umoe_jax.ops import gmm_backends
  calls = []

  def own(x):
    calls.append(x.shape)
    return fp8.quantize_tiles(x, axis=1)
  xla = gmm_backends.BACKENDS.get("xla")
  monkeypatch.setitem(gmm_backends.BACKENDS._entries, "xla", dataclasses.replace(xla, fp8_quantize=own))
  return calls


def test_fp8_gather_gmm_reads_the_token_rows_through_the_sort_order(monkeypatch):
  """The FP8 first matmul's forward reads the N quantised token rows through the plan's sort order
  (a row-index FP8 gmm; XLA gathers first for the others): the values and gradients of fp8_gmm on
  the permuted rows, bit for bit between the two kinds of backend; the backend's quantiser is
  handed the [N, D] tokens, never an [N*K, D] copy, and a row-index gmm the quantised tokens and
  the index."""
  import dataclasses
  from umoe_jax.ops import dispatch, fused_dispatch, gmm_backends
  rng = np.random.default_rng(14)
  n_tok, k, d, f, e = 40, 3, 200, 72, 4
  x = jnp.asarray(rng.normal(size=(n_tok, d)).astype(np.float32))
  plan = dispatch.make_plan(jnp.asarray(rng.integers(0, e, (n_tok, k)), jnp.int32), e)
  w = jnp.asarray(rng.normal(size=(e, d, f)).astype(np.float32) / 14)
  cot = jnp.asarray(rng.normal(size=(n_tok * k, f)).astype(np.float32))
  loss = lambda a, b: jnp.sum(fused_dispatch.gather_gmm(a, b, plan, k, backend="xla", fp8=True) * cot)
  fused_dispatch._fp8_gather_gmm_fn.cache_clear()
  want = jax.grad(loss, argnums=(0, 1))(x, w)
  definition = lambda a, b: jnp.sum(fp8_gmm(dispatch.permute(a, plan, k), b, plan.group_sizes,
                                            backend="xla") * cot)
  np.testing.assert_array_equal(np.asarray(loss(x, w)), np.asarray(definition(x, w)))
  for g, r in zip(want, jax.grad(definition, argnums=(0, 1))(x, w)):
    assert rel_err(g, r) < 1e-6
  calls = _record_quantiser_calls(monkeypatch)
  xla = gmm_backends.BACKENDS.get("xla")
  fused_dispatch._fp8_gather_gmm_fn.cache_clear()
  got = jax.grad(loss, argnums=(0, 1))(x, w)
  assert (n_tok, d) in calls and (n_tok * k, d) not in calls, calls
  for g, r in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
  # A backend whose FP8 gmm reads rows through an index (`row_index`, the triton kernel's
  # lhs_index) is handed the N quantised token rows and the sort order, not a gathered copy.
  forward = []

  def indexed_gmm(lhs_q, lhs_scale, *rest, lhs_index=None, **kw):
    forward.append((lhs_q.shape, lhs_scale.shape, None if lhs_index is None else lhs_index))
    if lhs_index is not None:
      lhs_q, lhs_scale = jnp.take(lhs_q, lhs_index, axis=0), jnp.take(lhs_scale, lhs_index, axis=0)
    return fp8.emulated_gmm(lhs_q, lhs_scale, *rest, **kw)

  def indexed_tgmm(lhs, rhs, gs, *, lhs_index=None, rhs_index=None, lhs_scale=None, **kw):
    assert rhs_index is None and lhs_scale is None
    return xla.tgmm(lhs if lhs_index is None else jnp.take(lhs, lhs_index, axis=0), rhs, gs, **kw)
  monkeypatch.setitem(gmm_backends.BACKENDS._entries, "xla",
                      dataclasses.replace(xla, fp8_gmm=indexed_gmm, tgmm=indexed_tgmm, row_index=True))
  fused_dispatch._fp8_gather_gmm_fn.cache_clear()
  got = jax.grad(loss, argnums=(0, 1))(x, w)
  for g, r in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
  (shape, scale_shape, index), = [c for c in forward if c[2] is not None]
  assert shape == (n_tok, d) and scale_shape == (n_tok, 2)
  np.testing.assert_array_equal(np.asarray(index), np.asarray(plan.order) // k)
  # One row a slot among others (pre-mixing's [N, 1 + K, D], slots 1..K read in place): the kernel
  # reads row n * (1 + K) + 1 + j for slot j of token n, as a gathering backend's copy has it.
  x3 = jnp.asarray(rng.normal(size=(n_tok, 1 + k, d)).astype(np.float32))
  loss3 = lambda a, b: jnp.sum(fused_dispatch.gather_gmm(a, b, plan, k, backend="xla", fp8=True,
                                                         first_slot=1) * cot)
  got3 = jax.value_and_grad(loss3, argnums=(0, 1))(x3, w)
  shape, _, index = [c for c in forward if c[2] is not None][-1]
  assert shape == (n_tok * (1 + k), d)
  order = np.asarray(plan.order)
  np.testing.assert_array_equal(np.asarray(index), order // k * (1 + k) + 1 + order % k)
  monkeypatch.setitem(gmm_backends.BACKENDS._entries, "xla", xla)
  fused_dispatch._fp8_gather_gmm_fn.cache_clear()
  want3 = jax.value_and_grad(loss3, argnums=(0, 1))(x3, w)
  for g, r in zip(jax.tree.leaves(got3), jax.tree.leaves(want3)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
  assert np.all(np.asarray(got3[1][0])[:, 0] == 0) and np.any(np.asarray(got3[1][0])[:, 1:] != 0)
  fused_dispatch._fp8_gather_gmm_fn.cache_clear()


@pytest.mark.parametrize("activation", [None, "silu"])
def test_fp8_fused_combine_matches_the_float64_reference(activation, monkeypatch):
  """gmm_combine in FP8 as its bf16 form runs. Forward: the values of an FP8 gmm, unpermute and
  combine. Backward against float64 loops over the loop-quantised operands: u = dout[token] @
  w[g].T from dout's N token rows in 1 x 128 tiles along D, dh = gate * u (* act'(z)), dgate =
  <u, act(z)>; dw[g] = sum over g's sorted rows of gate * act(z) and dout[token] as they are; every
  gradient within FP8 error of the float32 gradient; and the quantiser is handed dout's N rows,
  never an [M, D] per-slot copy."""
  from umoe_jax.ops import dispatch, epilogue, fused_dispatch
  rng = np.random.default_rng(21)
  n_tok, k, f, d, e = 48, 3, 200, 300, 4
  m = n_tok * k
  plan = dispatch.make_plan(jnp.asarray(rng.integers(0, e, (n_tok, k)), jnp.int32), e)
  z = jnp.asarray(wide_range(rng, (m, f), decades=1.0))
  w = jnp.asarray(wide_range(rng, (e, f, d), decades=1.0) / 10)
  gates = jnp.asarray(rng.uniform(0.05, 1.0, (n_tok, k)).astype(np.float32))
  g = jnp.asarray(wide_range(rng, (n_tok, d), decades=1.5))
  fn = lambda z_, w_, gt: fused_dispatch.gmm_combine(z_, w_, plan, gt, backend="xla",
                                                     activation=activation, fp8=True)
  rows = z if activation is None else epilogue.activate(activation, z)
  plain = dispatch.combine(dispatch.unpermute(fp8_gmm(rows, w, plan.group_sizes, backend="xla"), plan)
                           .reshape(n_tok, k, d), gates)
  out, pull = jax.vjp(fn, z, w, gates)
  dz, dw, dgates = (np.asarray(a, np.float64) for a in pull(g))
  assert rel_err(out, plain) < 1e-6
  # float64 loops
  order, inverse = np.asarray(plan.order), np.asarray(plan.inverse)
  sizes = np.asarray(plan.group_sizes)
  token = order // k
  gate_sorted = np.asarray(gates).reshape(-1)[order].astype(np.float64)
  zf = np.asarray(z, np.float64)
  a = np.asarray(z if activation is None else epilogue.activate(activation, z), np.float64)
  hg = np.asarray(epilogue.gate_scaled(z, jnp.asarray(gate_sorted, jnp.float32), activation))
  wq = ref_blocks(w)[0]
  aq, dq = ref_tiles(np.asarray(a, np.float32), 1)[0], ref_tiles(g, 1)[0]
  hq, gq = np.asarray(hg, np.float64), np.asarray(g, np.float64)[token]
  y_sorted, u, want_dw = np.zeros((m, d)), np.zeros((m, f)), np.zeros((e, f, d))
  start = 0
  for ex, size in enumerate(sizes):
    rows = slice(start, start + size)
    y_sorted[rows] = aq[rows] @ wq[ex]
    u[rows] = dq[token[rows]] @ wq[ex].T
    want_dw[ex] = hq[rows].T @ gq[rows]
    start += size
  want_out = np.einsum("nk,nkd->nd", np.asarray(gates, np.float64), y_sorted[inverse].reshape(n_tok, k, d))
  sig = 1 / (1 + np.exp(-zf))
  dact = np.ones_like(zf) if activation is None else sig * (1 + zf * (1 - sig))
  want_dz = gate_sorted[:, None] * u * dact
  want_dgates = np.sum(u * a, axis=1)[inverse].reshape(n_tok, k)
  for got, want in ((out, want_out), (dz, want_dz), (dw, want_dw), (dgates, want_dgates)):
    assert rel_err(np.asarray(got, np.float64), want) < TOL
  # the float32 gradient of the same function, within FP8's error
  exact = jax.vjp(lambda z_, w_, gt: fused_dispatch.gmm_combine(z_, w_, plan, gt, backend="xla",
                                                                activation=activation), z, w, gates)
  for got, want in zip((dz, dw, dgates), exact[1](g)):
    assert rel_err(got, np.asarray(want, np.float64)) < 0.08
  # what the backend's quantiser is handed
  calls = _record_quantiser_calls(monkeypatch)
  fused_dispatch._fp8_gmm_combine_fn.cache_clear()
  got = jax.vjp(fn, z, w, gates)[1](g)
  fused_dispatch._fp8_gmm_combine_fn.cache_clear()
  assert (n_tok, d) in calls and (m, d) not in calls, calls
  for x, y in zip(got, (dz, dw, dgates)):
    np.testing.assert_array_equal(np.asarray(x, np.float64), y)


@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("sizes", [[37, 0, 90, 3], [130]])
def test_the_weight_gradient_in_bf16(sizes, transpose_rhs, monkeypatch):
  """fp8_gmm's weight gradient is the product of the operands as they are (the float64 loop over
  each group's rows, rows past the groups nonzero and left out, as empty groups; one group by
  XLA's dot), and only the forward's and the input gradient's operands are quantised."""
  rng = np.random.default_rng(31)
  g, m, k, n = len(sizes), 150, 200, 72
  rhs = jnp.asarray(rng.normal(size=(g, k, n)) / 14, jnp.float32)
  lhs = jnp.asarray(rng.normal(size=(m, n if transpose_rhs else k)), jnp.float32)  # rows past the
  dout = jnp.asarray(rng.normal(size=(m, k if transpose_rhs else n)), jnp.float32)  # groups nonzero
  f = lambda a, b: fp8_gmm(a, b, jnp.asarray(sizes, jnp.int32), backend="xla",
                           transpose_rhs=transpose_rhs, preferred_element_type=jnp.float32)
  calls = _record_quantiser_calls(monkeypatch)
  _, pull = jax.vjp(f, lhs, rhs)
  _, drhs = pull(dout)
  assert calls == [lhs.shape, dout.shape], calls
  want, start = np.zeros((g, k, n)), 0
  a64, d64 = np.asarray(lhs, np.float64), np.asarray(dout, np.float64)
  for e, size in enumerate(sizes):
    rows = slice(start, start + size)
    want[e] = d64[rows].T @ a64[rows] if transpose_rhs else a64[rows].T @ d64[rows]
    start += size
  assert drhs.shape == rhs.shape and drhs.dtype == rhs.dtype
  assert rel_err(np.asarray(drhs, np.float64), want) < TOL
  for e, size in enumerate(sizes):
    assert np.asarray(drhs[e]).any() == (size > 0)


@pytest.mark.parametrize("sizes", [[37, 0, 40, 3], [70]])
def test_the_weight_gradient_reads_rows_through_an_index(sizes):
  """`fp8_gmm.wgrad` with `lhs_index` (the fused first matmul's rows in expert order), in both
  layouts and for one group: the float64 product of lhs's indexed rows and dout over each group,
  rows past the groups left out."""
  from umoe_jax.ops import fp8_gmm as fg, gmm_backends
  rng = np.random.default_rng(33)
  xla = gmm_backends.BACKENDS.get("xla")
  g, m, k, n = len(sizes), 90, 120, 56
  index = jnp.asarray(rng.integers(0, 60, m), jnp.int32)         # 60 source rows, repeats
  gs = jnp.asarray(sizes, jnp.int32)
  for transpose in (False, True):
    lhs = jnp.asarray(rng.normal(size=(60, n if transpose else k)), jnp.float32)
    dout = jnp.asarray(rng.normal(size=(m, k if transpose else n)), jnp.float32)
    rhs = jnp.zeros((g, k, n), jnp.float32)
    got = np.asarray(fg.wgrad(xla, lhs, dout, gs, rhs, transpose, index), np.float64)
    rows64 = np.asarray(lhs, np.float64)[np.asarray(index)]
    d64 = np.asarray(dout, np.float64)
    want, start = np.zeros(rhs.shape), 0
    for e, size in enumerate(sizes):
      r = slice(start, start + size)
      want[e] = d64[r].T @ rows64[r] if transpose else rows64[r].T @ d64[r]
      start += size
    assert got.shape == rhs.shape and rel_err(got, want) < TOL, transpose


def _expert_layer(rng):
  """An expert layer's inputs: 40 tokens [40, 200], a plan of 3 slots over 4 experts, w1 [4, 200,
  136], w2 [4, 136, 200], gates [40, 3] and a cotangent of the output [40, 200]."""
  from umoe_jax.ops import dispatch
  n_tok, k, d, f, e = 40, 3, 200, 136, 4
  x = jnp.asarray(rng.normal(size=(n_tok, d)), jnp.float32)
  plan = dispatch.make_plan(jnp.asarray(rng.integers(0, e, (n_tok, k)), jnp.int32), e)
  w1 = jnp.asarray(rng.normal(size=(e, d, f)) / 14, jnp.float32)
  w2 = jnp.asarray(rng.normal(size=(e, f, d)) / 12, jnp.float32)
  gates = jnp.asarray(rng.uniform(0.05, 1.0, (n_tok, k)), jnp.float32)
  return x, plan, w1, w2, gates, jnp.asarray(rng.normal(size=(n_tok, d)), jnp.float32)


def test_the_fused_forms_weight_gradients_in_bf16():
  """The fused dispatch's FP8 forms (gather_gmm, then gmm_combine): each weight gradient is the float64 product of its operands as they
  are (the sorted token rows and the per-slot cotangent; the gate-scaled activations and the token
  rows' cotangent)."""
  from umoe_jax.ops import fused_dispatch
  rng = np.random.default_rng(32)
  x, plan, w1, w2, gates, g = _expert_layer(rng)
  n_tok, k = gates.shape

  def hidden(x, w1):
    return fused_dispatch.gather_gmm(x, w1, plan, k, backend="xla", fp8=True)        # [M, F]

  def layer(x, w1, w2, gates):
    return fused_dispatch.gmm_combine(hidden(x, w1), w2, plan, gates, backend="xla",
                                      activation="silu", fp8=True)

  def grads():
    fused_dispatch._fp8_gather_gmm_fn.cache_clear()
    fused_dispatch._fp8_gmm_combine_fn.cache_clear()
    out, pull = jax.vjp(layer, x, w1, w2, gates)
    return out, pull(g)
  _, (_, dw1, dw2, _) = grads()
  # float64 loops: the sorted rows, their hidden pre-activations, the two cotangents
  order, sizes = np.asarray(plan.order), np.asarray(plan.group_sizes)
  token = order // k
  z, pull_h = jax.vjp(hidden, x, w1)
  z64 = np.asarray(z, np.float64)
  act = z64 / (1 + np.exp(-z64))
  gate_sorted = np.asarray(gates, np.float64).reshape(-1)[order]
  hg = np.asarray(jnp.asarray(act * gate_sorted[:, None], jnp.float32), np.float64)
  dz = np.asarray(jax.vjp(lambda z_: fused_dispatch.gmm_combine(
      z_, w2, plan, gates, backend="xla", activation="silu", fp8=True), z)[1](g)[0], np.float64)
  rows64, g64 = np.asarray(x, np.float64)[token], np.asarray(g, np.float64)[token]
  want1, want2, start = np.zeros(w1.shape), np.zeros(w2.shape), 0
  for ex, size in enumerate(sizes):
    r = slice(start, start + size)
    want1[ex], want2[ex] = rows64[r].T @ dz[r], hg[r].T @ g64[r]
    start += size
  assert rel_err(np.asarray(dw1, np.float64), want1) < TOL
  assert rel_err(np.asarray(dw2, np.float64), want2) < 1e-4   # hg rounded by two silu forms
  fused_dispatch._fp8_gather_gmm_fn.cache_clear()
  fused_dispatch._fp8_gmm_combine_fn.cache_clear()


def test_act_quantised_after_the_first_matmul_feeds_the_last(monkeypatch):
  """The FP8 pool's first matmul hands act(up) in FP8 tiles to the last one (routed_mlp:
  gather_gmm(quantize_out=) -> gmm_combine(quantized=)). On a backend without the epilogue form
  (xla) they come from the passes the last matmul would make, so values and gradients are the bits
  of the two ops composed without it, and the last matmul quantises nothing of its own in the
  forward; bad uses are one clear error."""
  from test_fp8_triton import fp8_pools
  from umoe_jax.ops import fused_dispatch
  rng = np.random.default_rng(46)
  x, plan, w1, w2, gates, g = _expert_layer(rng)
  k = gates.shape[1]
  runs = {}
  real, real_gmm = fused_dispatch.quantize, fused_dispatch.threshold_gmm
  for on, pool in fp8_pools(plan, k, "xla").items():
    calls = []
    monkeypatch.setattr(fused_dispatch, "quantize", lambda b, v: calls.append(v.shape) or real(b, v))
    monkeypatch.setattr(fused_dispatch, "threshold_gmm",
                        lambda b, v, *a, **kw: calls.append(v.shape) or real_gmm(b, v, *a, **kw))
    y, pull = jax.vjp(pool, x, w1, w2, gates)
    runs[on] = (y, pull(g), list(calls))
  for a, b in zip(jax.tree_util.tree_leaves(runs[False][:2]), jax.tree_util.tree_leaves(runs[True][:2])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  m = plan.order.shape[0]
  # what fused_dispatch quantises itself or hands to threshold_gmm (which quantises it at these
  # widths): the tokens, act(up) [M, F] (off only: on, the first matmul's op makes it), the
  # combine's cotangent
  assert (m, w1.shape[2]) in runs[False][2] and (m, w1.shape[2]) not in runs[True][2]
  assert len(runs[True][2]) == len(runs[False][2]) - 1
  with pytest.raises(ValueError, match="FP8 only"):
    fused_dispatch.gather_gmm(x, w1, plan, k, backend="xla", quantize_out="silu")
  with pytest.raises(ValueError, match="'gelu'"):
    fused_dispatch.gather_gmm(x, w1, plan, k, backend="xla", fp8=True, quantize_out="gelu")
  up, qs = fused_dispatch.gather_gmm(x, w1, plan, k, backend="xla", fp8=True, quantize_out="silu")
  with pytest.raises(ValueError, match="FP8 only"):
    fused_dispatch.gmm_combine(up, w2, plan, gates, backend="xla", activation="silu", quantized=qs)
  with pytest.raises(ValueError, match="an activation is needed"):
    fused_dispatch.gmm_combine(up, w2, plan, gates, backend="xla", fp8=True, quantized=qs)
  m_rows = up.shape[0]
  for bad in ((qs[0][:-1], qs[1]), (qs[0], qs[1].astype(jnp.bfloat16)), (qs[0].astype(jnp.bfloat16), qs[1]),
              qs[:1]):
    with pytest.raises(ValueError, match=rf"must be \(q float8_e4m3fn\[{m_rows}, 136\], "
                                         rf"scale float32\[{m_rows}, 2\]\)"):
      fused_dispatch.gmm_combine(up, w2, plan, gates, backend="xla", activation="silu", fp8=True,
                                 quantized=bad)


def test_a_backends_own_quantiser_makes_every_operand(monkeypatch):
  """A backend's `fp8_quantize` (the triton backend's one-pass kernel) quantises both token-row
  operands of fp8_gmm's FP8 products (the forward's lhs, the input gradient's dout) and the fused
  dispatch's token rows; its output is what the products take (a quantiser off by one tile's scale
  moves every product)."""
  import dataclasses
  from umoe_jax.ops import dispatch, gmm_backends
  from umoe_jax.ops.fused_dispatch import gather_gmm
  calls = []

  def own(a, scale_by=1.0):
    calls.append(a.shape)
    q, s = fp8.quantize_tiles(a, axis=1)
    return q, s * scale_by
  xla = gmm_backends.BACKENDS.get("xla")
  monkeypatch.setitem(gmm_backends.BACKENDS._entries, "xla", dataclasses.replace(xla, fp8_quantize=own))
  rng = np.random.default_rng(12)
  gs = jnp.asarray([100, 0, 140, 16], jnp.int32)
  x = jnp.asarray(rng.normal(size=(256, 200)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(4, 200, 72)) / 14, jnp.float32)
  dy = jnp.asarray(rng.normal(size=(256, 72)), jnp.float32)
  y, pull = jax.vjp(lambda a, b: fp8_gmm(a, b, gs, backend="xla"), x, w)
  dx, dw = pull(dy)
  assert sorted(calls) == [(256, 72), (256, 200)]
  monkeypatch.setitem(gmm_backends.BACKENDS._entries, "xla", xla)
  y0, pull0 = jax.vjp(lambda a, b: fp8_gmm(a, b, gs, backend="xla"), x, w)
  for got, want in zip((y, dx, dw), (y0, *pull0(dy))):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  doubled = dataclasses.replace(xla, fp8_quantize=lambda a: own(a, 2.0))
  monkeypatch.setitem(gmm_backends.BACKENDS._entries, "xla", doubled)
  np.testing.assert_allclose(np.asarray(fp8_gmm(x, w, gs, backend="xla")), 2 * np.asarray(y0), rtol=1e-6)
  calls.clear()
  plan = dispatch.make_plan(jnp.asarray(rng.integers(0, 4, (24, 3)), jnp.int32), 4)
  gather_gmm(x[:24], w, plan, 3, backend="xla", fp8=True)
  assert calls == [(24, 200)]


def test_a_backends_block_quantiser_makes_the_weights_under_its_switch(monkeypatch):
  """Under fp8_gmm.KERNEL_BLOCKS a backend's `fp8_quantize_blocks` (the triton backend's one-pass
  kernel) quantises the weights of both FP8 products, its output is what they take; off, XLA's
  quantize_blocks does."""
  import dataclasses
  from umoe_jax.ops import dispatch, fp8_gmm as F, gmm_backends
  from umoe_jax.ops.fused_dispatch import gather_gmm, gmm_combine
  calls = []

  def own(w, scale_by=1.0):
    calls.append(w.shape)
    q, s = fp8.quantize_blocks(w)
    return q, s * scale_by
  xla = gmm_backends.BACKENDS.get("xla")
  monkeypatch.setitem(gmm_backends.BACKENDS._entries, "xla",
                      dataclasses.replace(xla, fp8_quantize_blocks=own))
  rng = np.random.default_rng(13)
  gs = jnp.asarray([100, 0, 140, 16], jnp.int32)
  x = jnp.asarray(rng.normal(size=(256, 200)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(4, 200, 72)) / 14, jnp.float32)
  dy = jnp.asarray(rng.normal(size=(256, 72)), jnp.float32)

  def run():
    y, pull = jax.vjp(lambda a, b: fp8_gmm(a, b, gs, backend="xla"), x, w)
    return (y, *pull(dy))
  want = run()
  assert calls == []
  monkeypatch.setattr(F, "KERNEL_BLOCKS", True)
  got = run()
  assert calls == [(4, 200, 72)] * 2    # the forward's and the input gradient's
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  monkeypatch.setitem(gmm_backends.BACKENDS._entries, "xla",
                      dataclasses.replace(xla, fp8_quantize_blocks=lambda w: own(w, 2.0)))
  np.testing.assert_allclose(np.asarray(fp8_gmm(x, w, gs, backend="xla")), 2 * np.asarray(want[0]),
                             rtol=1e-6)
  calls.clear()   # the fused dispatch's two matmuls
  plan = dispatch.make_plan(jnp.asarray(rng.integers(0, 4, (24, 3)), jnp.int32), 4)
  h = gather_gmm(x[:24], w, plan, 3, backend="xla", fp8=True)
  gmm_combine(h, jnp.swapaxes(w, 1, 2), plan, jnp.ones((24, 3)) / 3, backend="xla", fp8=True)
  assert calls == [(4, 200, 72), (4, 72, 200)]


# ----------------------------------------------------------------------------------------------
# The model under train.precision=fp8.


def _eqns(jaxpr):
  """Every equation of a jaxpr and of the jaxprs inside it."""
  for eqn in jaxpr.eqns:
    yield eqn
    for p in eqn.params.values():
      for sub in (p if isinstance(p, (tuple, list)) else (p,)):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _eqns(inner)


def _count(monkeypatch, module, name, counts):
  real = getattr(module, name)

  def counted(*a, **kw):
    counts[name] = counts.get(name, 0) + 1
    return real(*a, **kw)
  monkeypatch.setattr(module, name, counted)


@pytest.mark.parametrize("family", ["umoe", "ffn_moe", "umoe_att", "moa", "switchhead", "dense"])
def test_fp8_model_routes_every_expert_matmul_and_mlp_through_fp8(family, monkeypatch):
  """One-layer tiny models (bf16 compute), their loss gradient traced in each precision: under fp8
  every grouped matmul of bf16 (the `gmm`, `gather_gmm` and `gmm_combine` calls) is an fp8_gmm call
  instead (gather_gmm's and gmm_combine's: their FP8 forms); of the gradient's grouped matmuls only
  the weight gradients, one a product, take bf16 operands (the emulation multiplies dequantised
  float32 in the other two); every `Linear` of an `MLP` (dense FFN, always-on experts) goes through
  fp8_dot, and the attention modules' own projections do not."""
  from umoe_jax.model import layers
  from umoe_jax.model.lm import CausalLM
  from umoe_jax.ops import fused_dispatch, gmm as gmm_mod
  c = configs.common.experiment(family, "tiny").model
  c.n_layers = 1
  base = model_config(c)
  tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, base.vocab_size)
  seen = {}
  for precision in ("bf16", "fp8"):
    counts = {}
    for module, name in ((gmm_mod, "fp8_gmm"), (gmm_mod, "_differentiable_gmm"), (layers, "fp8_dot"),
                         (fused_dispatch, "_gather_gmm_fn"), (fused_dispatch, "_gmm_combine_fn"),
                         (fused_dispatch, "_fp8_gather_gmm_fn"), (fused_dispatch, "_fp8_gmm_combine_fn")):
      _count(monkeypatch, module, name, counts)
    model = CausalLM(dataclasses.replace(base, matmul_precision=precision), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)

    def loss(p):
      logits, _ = nnx.merge(graphdef, p)(tokens)
      return jnp.mean(logits)
    jaxpr = jax.make_jaxpr(jax.grad(loss))(params).jaxpr
    ragged = [e for e in _eqns(jaxpr) if e.primitive.name == "ragged_dot_general"]
    linears = [m for _, m in nnx.iter_graph(model) if isinstance(m, layers.Linear)]
    in_mlps = {id(lin) for _, mlp in nnx.iter_graph(model) if isinstance(mlp, layers.MLP)
               for _, lin in nnx.iter_graph(mlp) if isinstance(lin, layers.Linear)}
    seen[precision] = dict(counts, ragged=sorted(tuple(str(v.aval.dtype) for v in e.invars[:2])
                                                 for e in ragged),
                           linears=len(linears), mlp_linears=len(in_mlps),
                           fp8_linears=sum(m.fp8 for m in linears),
                           fp8_outside_mlps=sum(m.fp8 for m in linears if id(m) not in in_mlps),
                           f8=sum(str(v.aval.dtype) == "float8_e4m3fn"
                                  for e in _eqns(jaxpr) for v in e.outvars))
    monkeypatch.undo()
  bf16, f8 = seen["bf16"], seen["fp8"]
  bf16_gmms = sum(bf16.get(k, 0) for k in ("_differentiable_gmm", "_gather_gmm_fn", "_gmm_combine_fn"))
  assert bf16.get("fp8_gmm", 0) == bf16.get("fp8_dot", 0) == bf16["fp8_linears"] == bf16["f8"] == 0
  assert bf16.get("_fp8_gather_gmm_fn", 0) == bf16.get("_fp8_gmm_combine_fn", 0) == 0
  # each gather_gmm / gmm_combine becomes its FP8 form (rows quantised before the gather), the rest
  # fp8_gmm
  assert f8.get("_fp8_gather_gmm_fn", 0) == bf16.get("_gather_gmm_fn", 0)
  assert f8.get("_fp8_gmm_combine_fn", 0) == bf16.get("_gmm_combine_fn", 0)
  assert (f8.get("fp8_gmm", 0) + f8.get("_fp8_gather_gmm_fn", 0) + f8.get("_fp8_gmm_combine_fn", 0)
          == bf16_gmms)
  assert not any(f8.get(k, 0) for k in ("_differentiable_gmm", "_gather_gmm_fn", "_gmm_combine_fn"))
  assert f8.get("fp8_dot", 0) == f8["fp8_linears"] == f8["mlp_linears"] > 0
  assert f8["fp8_outside_mlps"] == 0 and f8["linears"] > f8["mlp_linears"]   # attention projections
  assert f8["f8"] > 0
  if family != "dense":
    products = len(bf16["ragged"])               # forward, input and weight gradient of each
    assert bf16_gmms > 0 and bf16["ragged"] == [("bfloat16", "bfloat16")] * products
    assert f8["ragged"] == sorted([("bfloat16", "bfloat16")] * (products // 3) +
                                  [("float32", "float32")] * (2 * products // 3)), f8["ragged"]


@pytest.mark.parametrize("family", ["umoe", "ffn_moe"])
def test_fp8_fused_combine_in_the_model(family, monkeypatch):
  """Every gmm_combine of an fp8 model (attention and FFN experts) takes the fused FP8 form, and the
  loss and its gradient stay within FP8's rounding of the bf16 model's."""
  from umoe_jax.model.lm import CausalLM
  from umoe_jax.ops import fused_dispatch
  c = configs.common.experiment(family, "tiny").model
  c.n_layers = 1
  tokens = jax.random.randint(jax.random.key(3), (2, 32), 0, c.vocab_size)
  counts, out = {}, {}
  _count(monkeypatch, fused_dispatch, "_fp8_gmm_combine_fn", counts)
  for precision in ("bf16", "fp8"):
    cfg = dataclasses.replace(model_config(c), matmul_precision=precision)
    graphdef, params = nnx.split(CausalLM(cfg, rngs=nnx.Rngs(0)))

    def loss(p):
      logits, _ = nnx.merge(graphdef, p)(tokens)
      return jnp.mean(jax.nn.log_softmax(logits.astype(jnp.float32))[..., 0])
    out[precision] = jax.value_and_grad(loss)(params)
  # one layer: UMoE's attention and FFN experts each end in a gmm_combine, FFN-MoE's FFN experts
  assert counts.get("_fp8_gmm_combine_fn", 0) == {"umoe": 2, "ffn_moe": 1}[family]
  fp8_run, bf16_run = out["fp8"], out["bf16"]
  assert abs(float(fp8_run[0]) - float(bf16_run[0])) < 1e-2 * abs(float(bf16_run[0]))
  for a, b in zip(jax.tree.leaves(fp8_run[1]), jax.tree.leaves(bf16_run[1])):
    if np.any(np.asarray(b)):
      assert rel_err(np.asarray(a, np.float32), np.asarray(b, np.float32)) < 0.15


# ----------------------------------------------------------------------------------------------
# Bad input, before anything is built.


def test_unknown_precision_is_a_config_error():
  c = configs.common.experiment("umoe", "tiny")
  c.train.precision = "fp16"
  with pytest.raises(ConfigError, match=r"^train\.precision='fp16'; valid: bf16, fp8$"):
    train_config.validate(c)


def test_fp8_with_a_gmm_backend_without_fp8_form():
  c = configs.common.experiment("umoe", "tiny")
  c.train.precision, c.model.gmm_backend = "fp8", "masked"
  with pytest.raises(ConfigError, match=r"model\.gmm_backend='masked' with train\.precision='fp8': "
                     r"gmm backend 'masked' has no FP8 form; the backends with one: .*'xla'"):
    train_config.validate(c)


@pytest.mark.parametrize("device, match", [
    (dict(platform="tpu", device_kind="TPU v5 lite"), r"does not run on TPU \(device 'TPU v5 lite'\)"),
    (dict(platform="gpu", device_kind="NVIDIA A100-SXM4-80GB", compute_capability="8.0"),
     r"GPU 'NVIDIA A100-SXM4-80GB' has compute capability 8\.0"),
    (dict(platform="gpu", device_kind="NVIDIA GeForce RTX 3090", compute_capability="8.6"),
     r"GPU 'NVIDIA GeForce RTX 3090' has compute capability 8\.6"),
    (dict(platform="gpu", device_kind="AMD Instinct MI300X"), r"'AMD Instinct MI300X' has no compute"),
    (dict(platform="gpu", device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0"), None),
    (dict(platform="gpu", device_kind="NVIDIA L4", compute_capability="8.9"), None),
    (dict(platform="cpu", device_kind="cpu"), None),
])
def test_fp8_on_devices_without_fp8_tensor_cores(device, match, monkeypatch):
  """Devices faked: a TPU and GPUs below compute capability 8.9 are refused naming the device and
  its capability (bf16 runs there as before); Ada / Hopper GPUs and the CPU emulation pass."""
  monkeypatch.setattr(precision_lib, "_device", lambda: types.SimpleNamespace(**device))
  c = configs.common.experiment("ffn_moe", "tiny")
  assert not train_config.validate(c).fp8     # bf16: no device check
  c.train.precision = "fp8"
  if match is None:
    assert train_config.validate(c).matmul_precision == "fp8"
    return
  with pytest.raises(ConfigError, match=match + r".*use train\.precision='bf16'"):
    train_config.validate(c)


def test_train_py_reports_the_fp8_backend_error_in_one_line(tmp_path):
  """train.py's config-error path: exit 1, the line naming the backend and the one that has an FP8
  form, the hint; no traceback, no workdir."""
  r = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config=configs/umoe_tiny.py",
                      f"--workdir={tmp_path / 'w'}", "--config.train.precision=fp8",
                      "--config.model.gmm_backend=masked"],
                     cwd=ROOT, capture_output=True, text=True, timeout=300,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert r.returncode == 1, r.stderr[-2000:]
  lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
  assert lines[0].startswith("config error: model.gmm_backend='masked' with train.precision='fp8': "
                             "gmm backend 'masked' has no FP8 form; the backends with one: ")
  assert lines[0].endswith(" (or 'auto')") and "'xla'" in lines[0]
  assert lines[1].startswith("  hint: ") and "Traceback" not in r.stderr
  assert not (tmp_path / "w").exists()


# ----------------------------------------------------------------------------------------------
# Checkpoints across precisions.


def test_a_checkpoint_resumes_in_the_other_precision(tmp_path):
  """bf16 to step 4, fp8 on to step 6, bf16 on to step 8, one workdir: each run resumes from the
  last's checkpoint (float32 parameters and optimizer state either way) and trains on, its loss
  where the last left it."""
  import orbax.checkpoint as ocp
  from umoe_jax.train import loop
  workdir = str(tmp_path / "w")
  starts = []
  for precision, steps in (("bf16", 4), ("fp8", 6), ("bf16", 8)):
    result = loop.run(small_config(precision=precision, num_steps=steps, eval_every=0), workdir)
    assert result["step"] == steps and not result["stopped"]
    starts.append(result["start"])
    state = ocp.StandardCheckpointer().restore(os.path.join(workdir, "checkpoints", str(steps),
                                                            "state"))
    dtypes = {str(leaf.dtype) for leaf in jax.tree.leaves(state)
              if getattr(leaf, "dtype", None) is not None and jnp.issubdtype(leaf.dtype, jnp.floating)}
    assert dtypes == {"float32"}, (precision, dtypes)
  assert starts == ["scratch", "workdir", "workdir"]
  losses = train_losses(workdir)
  assert sorted(losses) == list(range(1, 9))
  assert all(np.isfinite(v) for v in losses.values())
  assert abs(losses[5] - losses[4]) < 0.25 * losses[4] and abs(losses[7] - losses[6]) < 0.25 * losses[6]


# ----------------------------------------------------------------------------------------------
# Training in fp8 emulation tracks bf16.


def _train_losses(family: str, precision: str, steps: int = 50) -> np.ndarray:
  """The trainer's compiled step (loop.config_programs) on the tiny config's model, 4 x 64 tokens of
  the built-in corpus a step, from the same seed and batches in either precision."""
  from umoe_jax import data as data_lib
  from umoe_jax.parallel import mesh as mesh_lib, sharding
  from umoe_jax.train import loop
  c = configs.common.experiment(family, "tiny")
  c.train.update(dict(global_batch_size=4, seq_len=64, num_steps=steps, warmup_steps=5,
                      precision=precision))
  model_cfg = train_config.validate(c)
  assert model_cfg.matmul_precision == precision
  mesh = mesh_lib.make_mesh(c.get("mesh"), devices=jax.devices()[:1])
  progs = loop.config_programs(c, model_cfg, mesh, sharding.normalize_rules(c.get("sharding_rules")))
  state = progs.init_fn(0)
  batches = data_lib.make_train_iterator(c.data, seq_len=64, global_batch_size=4, seed=0)
  out = []
  for _ in range(steps):
    state, metrics = progs.train_fn(state, next(batches))
    out.append(float(metrics["loss"]))
  return np.asarray(out)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["umoe", "ffn_moe"])
def test_tiny_model_in_fp8_emulation_tracks_bf16(family):
  """50 steps from the same seed and batches: the loss falls by half in both, the fp8 run's mean
  of its last 5 losses is within 2% of bf16's (measured 0.1% for umoe, 0.4% for ffn_moe) and every
  5-step window's mean within 4% (measured at most 1.9%, 0.4%); the runs differ (the switch took effect). Single steps
  are not bounded: one batch of 256 tokens whose routing flips under FP8 rounding moved 8.8%."""
  bf16, f8 = _train_losses(family, "bf16"), _train_losses(family, "fp8")
  assert np.isfinite(f8).all() and f8[-5:].mean() < 0.6 * f8[0] and bf16[-5:].mean() < 0.6 * bf16[0]
  assert abs(f8[-5:].mean() - bf16[-5:].mean()) < 0.02 * bf16[-5:].mean()
  window = lambda x: np.convolve(x, np.ones(5) / 5, mode="valid")
  assert np.max(np.abs(window(f8) - window(bf16)) / window(bf16)) < 0.04
  assert not np.array_equal(f8, bf16)


_EXPERT_PARALLEL = r'''
import dataclasses, os, sys
sys.path.insert(0, os.path.join(sys.argv[1], "tests", "parallel_scripts"))
import jax
import common
from umoe_jax.parallel import mesh as mesh_lib, sharding
from umoe_jax.ops import fp8_gmm
fp8_gmm.MIN_CONTRACTION = 0   # every product in FP8 at the tiny widths (tests/conftest.py)
cfg = dataclasses.replace(common.tiny_cfg("umoe"), matmul_precision="fp8")
graphdef, abstract = common.model_parts(cfg)
params, batch = common.init_params(cfg), common.tokens()
loss1, grads1 = jax.jit(common.loss_and_grads_fn(graphdef))(params, batch)
for layout in ("data=2,expert=2", "expert=2,tensor=2"):
  mesh = mesh_lib.make_mesh(common.parse_layout(layout))
  step, p_sh, o_sh = common.sharded_step(graphdef, abstract, mesh)
  with sharding.use_mesh(mesh):
    _, _, loss2, grads2 = step(jax.device_put(params, p_sh),
                               jax.device_put(common.TX.init(params), o_sh), batch)
  print("RESULT", layout, abs(float(loss2) / float(loss1) - 1), common.rel_diff(grads2, grads1))
'''


def test_fp8_under_expert_parallelism():
  """The expert-parallel routes (`expert_routes`: the pools and the pre-mixing queries per device,
  under shard_map) in fp8, on 4 virtual CPU devices against one: the loss agrees to 1e-4 (the
  forward's tiles and blocks are the same; measured 1e-7, and 3e-5 with the hidden width split over
  tensor, which splits blocks), the gradients to 6%: each device's weight-gradient tiles gather other
  rows, so their scales differ (measured 0.8% and 2.5%, the FP8 noise; a mislaid product is O(1))."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
             XLA_FLAGS="--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0")
  r = subprocess.run([sys.executable, "-c", _EXPERT_PARALLEL, ROOT], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=600)
  results = [ln.split()[1:] for ln in r.stdout.splitlines() if ln.startswith("RESULT")]
  assert len(results) == 2, r.stdout[-2000:] + r.stderr[-4000:]
  for layout, loss, grads in results:
    assert float(loss) < 1e-4 and float(grads) < 0.06, (layout, loss, grads)


def test_a_nan_in_a_wide_array_makes_its_pieces_scale_nan():
  """XLA's CPU max reduction drops a NaN of a wide enough array; the scale must not."""
  x = np.random.default_rng(7).standard_normal((16, 200)).astype(np.float32)
  x[3, 5] = np.nan
  _, s = fp8.quantize_tiles(jnp.asarray(x), axis=1)
  assert np.isnan(np.asarray(s)[3, 0]) and np.isfinite(np.delete(np.asarray(s), 3, 0)).all()
  w = np.random.default_rng(8).standard_normal((4, 300, 260)).astype(np.float32)
  w[1, 5, 7] = np.nan
  _, sw = fp8.quantize_blocks(jnp.asarray(w))
  assert np.isnan(np.asarray(sw)[1, 0, 0]) and np.isfinite(np.asarray(sw)).sum() == sw.size - 1
  y = np.asarray(fp8.fp8_dot(jnp.asarray(x), jnp.asarray(w[0, :200, :64])))
  assert not np.isfinite(y[3]).any() and np.isfinite(np.delete(y, 3, 0)).all()


def test_auto_takes_only_fp8_forms_validated_on_a_gpu(monkeypatch):
  """A kernel whose FP8 form ranks first is taken when named, and by auto only once listed in
  AUTO_FP8 (its GPU tests passed)."""
  from umoe_jax.ops import fp8_gmm as fg
  from umoe_jax.ops.gmm_backends import BACKENDS, GmmBackend
  xla = BACKENDS.get("xla")
  fake = GmmBackend(gmm=xla.gmm, tgmm=xla.tgmm, platforms=("cpu", "gpu", "tpu"), auto_priority=99,
                    fp8_gmm=xla.fp8_gmm)
  monkeypatch.setitem(BACKENDS._entries, "fast_fp8", fake)
  assert fg.fp8_backend("auto") == "xla" and fg.fp8_backend("fast_fp8") == "fast_fp8"
  monkeypatch.setattr(fg, "AUTO_FP8", fg.AUTO_FP8 | {"fast_fp8"})
  assert fg.fp8_backend("auto") == "fast_fp8"
