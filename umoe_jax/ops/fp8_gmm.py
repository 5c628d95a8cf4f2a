"""The experts' grouped matmul with FP8 operands: `fp8_gmm`, differentiable like `umoe_jax.ops.gmm.gmm`.

The operands are quantised here (`umoe_jax.ops.fp8`: the tokens in 1 x 128 tiles along each product's
contraction, the expert weights in 128 x 128 blocks) and handed to the backend's raw FP8 gmm
(`GmmBackend.fp8_gmm`); the three products of a training step are

  forward   out  = gmm(tiles(lhs, along K), blocks(rhs))
  backward  dlhs = gmm(tiles(dout, along N), blocks(rhs), transposed)
            drhs = tgmm(lhs, dout)                               (bf16 operands, over tokens)

each accumulating in float32. The weight gradient takes its operands as they are, by the backend's
own tgmm: in FP8 it would need both operands quantised again in 128-row column tiles (two more
passes over [M, K] and [M, N]), and its FP8 kernel runs well below the bf16 one.
A backend without FP8 forms is refused (`fp8_backend`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from umoe_jax.ops import epilogue, fp8
from umoe_jax.ops.gmm_backends import BACKENDS, GmmBackend, register_builtin_kernels, resolve_backend
from umoe_jax.ops.row_index import raw_fp8_gmm, raw_gmm, raw_tgmm
from umoe_jax.ops.varying import vary_like, varying_axes


# The FP8 forms "auto" may take: those whose GPU tests (tests/gpu/test_fp8_gpu.py) pass on a GPU.
AUTO_FP8 = frozenset({"xla", "triton"})

# The forward and input-gradient products on the mosaic backend's FP8 kernel (where it is
# registered and available), the rest (quantisers, weight gradients, bf16 products) on the chosen
# backend: the Mosaic kernel overlaps the promotion with the tensor cores
# (kernels/gmm/mosaic_fp8_gmm.py). The dense FP8 projections (`model.layers`) go through fp8_gmm
# too, so they move with it. Off until a step is timed with it (bench/train_step.py
# --fp8_mosaic_products).
MOSAIC_PRODUCTS = False

# The weights' 128 x 128 blocks by the backend's one-pass kernel (`GmmBackend.fp8_quantize_blocks`,
# the same bits) instead of XLA's reduction over two strided axes. Off until a step is timed with it
# (bench/train_step.py --fp8_block_quantiser).
KERNEL_BLOCKS = False


# Products whose contraction is shorter than this take their operands in bf16, by the backend's bf16
# gmm (0: every forward and input-gradient product in FP8). A short contraction is one or two scale
# pieces, each promoted on the CUDA cores, so the FP8 kernel runs it at about half the bf16 kernel's
# speed while its operands still cost a quantiser pass. At UMoE-base's and FFN-MoE-base's experts
# (768 <-> 192) the products that contract over 192 are half the expert FLOPs (bench/results: the
# fp8 rows with fp8_min_contraction=0 ran every product in FP8).
MIN_CONTRACTION = 256


def in_fp8(contraction: int) -> bool:
  """Whether a product contracting over `contraction` takes FP8 operands (`MIN_CONTRACTION`)."""
  return contraction >= MIN_CONTRACTION


def fp8_backends() -> list[str]:
  """The gmm backends that have FP8 forms (the kernel backends registered first)."""
  register_builtin_kernels()
  return [n for n in BACKENDS.names() if BACKENDS.get(n).fp8_gmm is not None]


def fp8_backend(name: str) -> str:
  """`name` resolved ("auto": the best with FP8 forms for this platform that auto may take), or
  ValueError naming the alternatives when it has no FP8 forms."""
  register_builtin_kernels()
  if name == "auto":
    platform = jax.devices()[0].platform
    for candidate in BACKENDS.ranked(platform):
      if candidate in AUTO_FP8 and BACKENDS.get(candidate).fp8_gmm is not None:
        return candidate
    return "xla"
  name = resolve_backend(name)
  if BACKENDS.get(name).fp8_gmm is None:
    raise ValueError(f"gmm backend {name!r} has no FP8 form; the backends with one: "
                     f"{', '.join(repr(n) for n in fp8_backends())} (or 'auto')")
  return name


def _product_backend(backend_name: str) -> GmmBackend:
  """The backend whose raw FP8 gmm takes the products (`MOSAIC_PRODUCTS`)."""
  if MOSAIC_PRODUCTS and "mosaic" in BACKENDS.names():
    mosaic = BACKENDS.get("mosaic")
    if mosaic.fp8_gmm is not None and mosaic.available():
      return mosaic
  return BACKENDS.get(backend_name)


def quantize(backend_name: str, x):
  """`fp8.quantize_tiles(x, axis=1)` (x [M, C]: 1 x 128 tiles along the rows, the same bits) by the
  backend's one-pass quantiser where it has one."""
  own = BACKENDS.get(backend_name).fp8_quantize
  return own(x) if own is not None else fp8.quantize_tiles(x, axis=1)


def quantize_weights(backend_name: str, w):
  """`fp8.quantize_blocks(w)` (the same bits), by the backend's kernel under `KERNEL_BLOCKS`."""
  own = BACKENDS.get(backend_name).fp8_quantize_blocks if KERNEL_BLOCKS else None
  return own(w) if own is not None else fp8.quantize_blocks(w)


def quantized_gmm(backend_name: str, lhs_q, lhs_scale, rhs, group_sizes, transpose_rhs: bool, out_dtype,
                  lhs_index=None):
  """The forward product from already quantised rows (`quantize(backend_name, lhs)`): rows may be
  quantised before they are gathered into expert order, since their tiles run along the row. With
  `lhs_index` the product's rows are lhs_q[lhs_index] (and their scales), read through the index by
  a backend with `row_index`, gathered by XLA for the others. The weights are quantised here, in
  blocks (`quantize_weights`); within a step XLA computes a weight's blocks once for its forward
  and its input gradient (the same expression of the same weights)."""
  return raw_fp8_gmm(_product_backend(backend_name), lhs_q, lhs_scale,
                     *quantize_weights(backend_name, rhs), group_sizes, transpose_rhs=transpose_rhs,
                     out_dtype=out_dtype, lhs_index=lhs_index)


def quantized_gmm_out(backend_name: str, lhs_q, lhs_scale, rhs, group_sizes, out_dtype,
                      activation: str, lhs_index=None):
  """(out, q, scale): `quantized_gmm` (not transposed) and act(out) in 1 x 128 tiles along its rows
  (`quantize(backend_name, epilogue.activate(activation, out))`), the next FP8 product's operand:
  from the kernel's epilogue where the backend has it for `activation` (`fp8_quantize_out`:
  one [M, F] activation pass and one quantiser pass fewer), else by passes after the product.
  The expert pool's first matmul hands them to its last one."""
  backend = _product_backend(backend_name)
  if activation in backend.fp8_quantize_out:
    return raw_fp8_gmm(backend, lhs_q, lhs_scale, *quantize_weights(backend_name, rhs), group_sizes,
                       transpose_rhs=False, out_dtype=out_dtype, lhs_index=lhs_index,
                       quantize_out=activation)
  out = quantized_gmm(backend_name, lhs_q, lhs_scale, rhs, group_sizes, False, out_dtype, lhs_index)
  return (out, *quantize(backend_name, epilogue.activate(activation, out)))


def threshold_gmm(backend_name: str, lhs, rhs, group_sizes, transpose_rhs: bool, out_dtype,
                  lhs_index=None):
  """gmm(lhs, rhs, group_sizes) (rows through `lhs_index` where given): from lhs quantised here
  where its contraction, lhs's width, is long enough (`in_fp8`), else by the backend's bf16 gmm on
  the operands as they come."""
  if in_fp8(lhs.shape[1]):
    return quantized_gmm(backend_name, *quantize(backend_name, lhs), rhs, group_sizes,
                         transpose_rhs, out_dtype, lhs_index)
  return raw_gmm(BACKENDS.get(backend_name), lhs, rhs, group_sizes, transpose_rhs=transpose_rhs,
                 out_dtype=out_dtype, lhs_index=lhs_index)


def gradients(backend_name: str, lhs, rhs, group_sizes, transpose_rhs: bool, dout, lhs_index=None):
  """(dlhs, drhs) of `out = gmm(lhs, rhs, group_sizes)` (rhs[g].T with `transpose_rhs`): the input
  gradient in FP8 (in bf16 where its contraction, dout's width, is short: `in_fp8`), the weight
  gradient in the operands' dtype (`wgrad`). With `lhs_index` the product's rows are
  lhs[lhs_index], read through it."""
  backend, cast = BACKENDS.get(backend_name), dout.astype(lhs.dtype)
  if in_fp8(dout.shape[1]):
    dlhs = quantized_gmm(backend_name, *quantize(backend_name, dout), rhs, group_sizes,
                         not transpose_rhs, lhs.dtype)
  else:
    dlhs = raw_gmm(backend, cast, rhs, group_sizes, transpose_rhs=not transpose_rhs,
                   out_dtype=lhs.dtype)
  return dlhs, wgrad(backend, lhs, cast, group_sizes, rhs, transpose_rhs, lhs_index)


def wgrad(backend: GmmBackend, lhs, dout, group_sizes, rhs, transpose_rhs: bool, lhs_index=None):
  """The weight gradient of `out = gmm(lhs, rhs, group_sizes)` with the operands as they are (bf16):
  the backend's tgmm (rows through `lhs_index` where given), or for one group (the dense products)
  XLA's dot over the group's rows, since a tgmm kernel gives one group too few programs to fill a
  GPU."""
  num_groups = rhs.shape[0]
  if num_groups == 1:
    rows = lhs if lhs_index is None else jnp.take(lhs, lhs_index, axis=0)
    inside = (jnp.arange(rows.shape[0]) < group_sizes[0])[:, None]
    rows, dout = jnp.where(inside, rows, 0), jnp.where(inside, dout, 0)   # (no NaN from past it)
    a, b = (dout, rows) if transpose_rhs else (rows, dout)
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32)[None].astype(rhs.dtype)
  if transpose_rhs:  # out = lhs @ rhs[g].T: drhs[g] = dout.T @ lhs
    return raw_tgmm(backend, dout, lhs, group_sizes, num_groups=num_groups, out_dtype=rhs.dtype,
                    rhs_index=lhs_index)
  return raw_tgmm(backend, lhs, dout, group_sizes, num_groups=num_groups, out_dtype=rhs.dtype,
                  lhs_index=lhs_index)


@functools.lru_cache(maxsize=None)
def _differentiable(backend_name: str, transpose_rhs: bool, out_dtype):

  @jax.custom_vjp
  def fn(lhs, rhs, group_sizes):
    out = threshold_gmm(backend_name, lhs, rhs, group_sizes, transpose_rhs, out_dtype or lhs.dtype)
    return vary_like(out, varying_axes(lhs) | varying_axes(rhs) | varying_axes(group_sizes))

  def fwd(lhs, rhs, group_sizes):
    return fn(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)

  def bwd(res, dout):
    lhs, rhs, group_sizes = res
    dlhs, drhs = gradients(backend_name, lhs, rhs, group_sizes, transpose_rhs, dout)
    # Kernels called through custom calls drop shard_map's varying-axes type; restore it (as gmm).
    return vary_like(dlhs, varying_axes(lhs)), vary_like(drhs, varying_axes(rhs)), None

  fn.defvjp(fwd, bwd)
  return fn


def fp8_gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, backend: str = "auto",
            transpose_rhs: bool = False, preferred_element_type=None) -> jax.Array:
  """`gmm(lhs, rhs, group_sizes)` (same shapes and arguments) with FP8 operands in the forward and
  input-gradient products (those with a long enough contraction: `in_fp8`) and the weight
  gradient in lhs's dtype (module docstring); float32
  accumulation; output in `preferred_element_type` (default lhs.dtype)."""
  name = fp8_backend(backend)
  out_dtype = jnp.dtype(preferred_element_type) if preferred_element_type is not None else None
  return _differentiable(name, transpose_rhs, out_dtype)(lhs, rhs, group_sizes.astype(jnp.int32))
