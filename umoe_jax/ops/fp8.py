"""FP8 quantisation with fine-grained scales, and the matmuls that take it (DeepSeek-V3's recipe).

Operands are cast to float8_e4m3fn with one float32 scale per small piece, so one outlier costs the
precision of its piece only:

  tiles   1 x 128 along one axis (activations and gradients: along the contraction of the matmul
          that consumes them)
  blocks  128 x 128 over the last two axes (weights; the same blocks serve the transposed product)

scale = amax(|piece|) * (1/448), q = round_to_e4m3(x * (1/scale)), x ~= q * scale (in float32, the
reciprocals rounded once: the same bits on every platform). A piece of zeros has scale 0 and
quantises to zeros. A piece holding inf or NaN gets a non-finite scale, so every value of it, and
every product it enters, comes out NaN: a non-finite input never turns into a finite output.

`fp8_dot` (here) and `umoe_jax.ops.fp8_gmm.fp8_gmm` (the experts) are differentiable: the forward
product and the input gradient take quantised operands, the weight gradient (a contraction over
tokens) the operands as they are (`umoe_jax.ops.fp8_gmm` says why); all accumulate in float32 and
return the output dtype asked for; master weights and their gradients keep their own dtype. The
emulated forms form the products from the dequantised operands in float32: the
reference every FP8 kernel is compared with. `fp8_dot(..., impl="xla")` forms them from the FP8
values, one FP8 dot_general per 128-wide contraction chunk, each chunk's float32 partial sum scaled.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from umoe_jax.ops.ragged import xla_gmm

DTYPE = jnp.float8_e4m3fn
MAX = float(jnp.finfo(DTYPE).max)  # 448
TILE = 128


def _pad_to(x: jax.Array, axis: int, multiple: int) -> jax.Array:
  extra = -x.shape[axis] % multiple
  if not extra:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths)


def _to_fp8(x: jax.Array, scale: jax.Array) -> jax.Array:
  """x * (1 / scale) on the e4m3 grid; scale 0 (a piece of zeros) gives zeros. The reciprocal is
  taken once per piece and multiplied, as kernels do (XLA's CPU backend rewrites a division so
  anyway), so every platform rounds alike. The clip only catches a product rounded a hair past
  the largest value (the cast would make it NaN); NaN passes it."""
  inv = 1.0 / jnp.where(scale == 0, 1.0, scale)
  return jnp.clip(x.astype(jnp.float32) * inv, -MAX, MAX).astype(DTYPE)


def _amax(pieces: jax.Array, axis) -> jax.Array:
  """max |x| over each piece, NaN where the piece holds a NaN: XLA's CPU max reduction may drop a
  NaN of a wide enough array, while a sum never does."""
  amax = jnp.max(jnp.abs(pieces), axis=axis)
  return jnp.where(jnp.isnan(jnp.sum(pieces, axis=axis)), jnp.nan, amax)


def _scale(amax: jax.Array) -> jax.Array:
  # A product by the rounded reciprocal, not a division, which XLA rewrites so on some backends
  # only. amax of a piece holding inf is inf (inf * 0 = NaN below); NaN stays NaN.
  return amax.astype(jnp.float32) * jnp.float32(1.0 / MAX)


def quantize_tiles(x: jax.Array, axis: int = -1, tile: int = TILE) -> tuple[jax.Array, jax.Array]:
  """x in 1 x `tile` pieces along `axis`: (q like x in float8_e4m3fn, scales float32 with `axis`
  of size ceil(n / tile)). A last piece shorter than `tile` has its own scale."""
  axis = axis % x.ndim
  n = x.shape[axis]
  xp = _pad_to(x.astype(jnp.float32), axis, tile)
  pieces = xp.reshape(xp.shape[:axis] + (xp.shape[axis] // tile, tile) + xp.shape[axis + 1:])
  scale = _scale(_amax(pieces, axis + 1))
  q = _to_fp8(pieces, jnp.expand_dims(scale, axis + 1)).reshape(xp.shape)
  return jax.lax.slice_in_dim(q, 0, n, axis=axis), scale


def _opaque(q: jax.Array) -> jax.Array:
  """q, through an optimisation barrier: XLA's GPU compiler (with its default excess precision)
  folds a convert to FP8 and straight back into nothing, so without it a quantise-dequantise pair
  computes in float32 on a GPU and the emulation is not FP8 there (2.5% off on an H100)."""
  return jax.lax.optimization_barrier(q)


def dequantize_tiles(q: jax.Array, scale: jax.Array, axis: int = -1, tile: int = TILE) -> jax.Array:
  """float32 q * scale, each scale repeated over its tile."""
  axis = axis % q.ndim
  q = _opaque(q)
  full = jnp.repeat(scale, tile, axis=axis)
  return q.astype(jnp.float32) * jax.lax.slice_in_dim(full, 0, q.shape[axis], axis=axis)


def quantize_blocks(w: jax.Array, block: int = TILE) -> tuple[jax.Array, jax.Array]:
  """w [..., K, N] in `block` x `block` pieces: (q, scales [..., ceil(K/b), ceil(N/b)] float32)."""
  k, n = w.shape[-2:]
  wp = _pad_to(_pad_to(w.astype(jnp.float32), -2, block), -1, block)
  lead = wp.shape[:-2]
  pieces = wp.reshape(lead + (wp.shape[-2] // block, block, wp.shape[-1] // block, block))
  scale = _scale(_amax(pieces, (-3, -1)))
  q = _to_fp8(pieces, scale[..., :, None, :, None]).reshape(wp.shape)
  return q[..., :k, :n], scale


def dequantize_blocks(q: jax.Array, scale: jax.Array, block: int = TILE) -> jax.Array:
  k, n = q.shape[-2:]
  q = _opaque(q)
  full = jnp.repeat(jnp.repeat(scale, block, axis=-2), block, axis=-1)[..., :k, :n]
  return q.astype(jnp.float32) * full


def fake_quant_tiles(x: jax.Array, axis: int = -1) -> jax.Array:
  """x through the tile quantisation and back, float32: what an FP8 product sees of it."""
  return dequantize_tiles(*quantize_tiles(x, axis), axis=axis)


def fake_quant_blocks(w: jax.Array) -> jax.Array:
  return dequantize_blocks(*quantize_blocks(w))


# ----------------------------------------------------------------------------------------------
# Dense products: x [..., K] @ w [K, N].


def _chunked_product(qa, sa, qb, sb):
  """qa [M, K] with scales [M, kb] (tiles along K) @ qb [K, N] with scales [kb, N] (one per chunk of
  K and column): one FP8 dot per 128-wide chunk of K, each float32 partial sum scaled, then summed."""
  m, k = qa.shape
  n = qb.shape[1]
  kb = math.ceil(k / TILE)
  qa = _pad_to(qa, 1, TILE).reshape(m, kb, TILE)
  qb = _pad_to(qb, 0, TILE).reshape(kb, TILE, n)
  partial = jax.lax.dot_general(qa, qb, (((2,), (1,)), ((1,), (0,))),
                                preferred_element_type=jnp.float32)          # [kb, M, N]
  return jnp.einsum("bmn,mb,bn->mn", partial, sa, sb)


def _xla_matmul(x, w):
  """x [M, K] in tiles along K @ w [K, N] in blocks, from the FP8 values."""
  qw, sw = quantize_blocks(w)
  return _chunked_product(*quantize_tiles(x, axis=1), qw, jnp.repeat(sw, TILE, axis=1)[:, :w.shape[1]])


def _emulated_matmul(x, w):
  return jnp.matmul(fake_quant_tiles(x, axis=1), fake_quant_blocks(w),
                    precision=jax.lax.Precision.HIGHEST)


_MATMULS = {"emulate": _emulated_matmul, "xla": _xla_matmul}


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _fp8_dot(x, w, out_dtype, impl):
  return _MATMULS[impl](x, w).astype(out_dtype)


def _fp8_dot_fwd(x, w, out_dtype, impl):
  return _fp8_dot(x, w, out_dtype, impl), (x, w)


def _fp8_dot_bwd(out_dtype, impl, res, dy):
  x, w = res
  dx = _MATMULS[impl](dy, w.T)    # dy in tiles along N; w's blocks, transposed, are the same blocks
  dw = jax.lax.dot_general(x, dy.astype(x.dtype), (((0,), (0,)), ((), ())),
                           preferred_element_type=jnp.float32)  # over tokens, as fp8_gmm's: bf16
  return dx.astype(x.dtype), dw.astype(w.dtype)


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


def fp8_dot(x: jax.Array, w: jax.Array, *, out_dtype=None, impl: str = "emulate") -> jax.Array:
  """x [..., K] @ w [K, N] with FP8 operands (tiles for x, blocks for w), float32 accumulation,
  output in `out_dtype` (default x.dtype); the input gradient through an FP8 product too, the
  weight gradient in x's dtype. `impl`: "emulate"
  (dequantised float32 products, the reference) or "xla" (FP8 dot_general per K chunk)."""
  if impl not in _MATMULS:
    raise ValueError(f"fp8_dot: impl {impl!r} is not one of {sorted(_MATMULS)}")
  lead = x.shape[:-1]
  y = _fp8_dot(x.reshape(-1, x.shape[-1]), w, jnp.dtype(out_dtype or x.dtype), impl)
  return y.reshape(lead + (w.shape[1],))


# ----------------------------------------------------------------------------------------------
# Grouped products (the experts): the raw FP8 gmm of a `umoe_jax.ops.gmm_backends.GmmBackend`,
# on operands quantised by the caller (`umoe_jax.ops.fp8_gmm`), emulated: what every FP8 kernel is
# compared with, and the xla backend's FP8 gmm.


def emulated_gmm(lhs_q, lhs_scale, rhs_q, rhs_scale, group_sizes, *, transpose_rhs, out_dtype):
  """lhs_q [M, C] in tiles along C (its contraction; scales [M, ceil(C/128)]), rhs_q [G, K, N] in
  blocks (scales [G, ceil(K/128), ceil(N/128)]); C = K, or N with `transpose_rhs`."""
  lhs, rhs = dequantize_tiles(lhs_q, lhs_scale, axis=1), dequantize_blocks(rhs_q, rhs_scale)
  return xla_gmm(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs,
                 out_dtype=jnp.float32).astype(out_dtype)
