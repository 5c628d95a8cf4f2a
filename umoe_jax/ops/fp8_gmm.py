"""The experts' grouped matmul with FP8 operands: `fp8_gmm`, differentiable like `umoe_jax.ops.gmm.gmm`.

The operands are quantised here (`umoe_jax.ops.fp8`: the tokens in 1 x 128 tiles along each product's
contraction, the expert weights in 128 x 128 blocks) and handed to the backend's raw FP8 forms
(`GmmBackend.fp8_gmm` / `fp8_tgmm`); the three products of a training step are

  forward   out  = gmm(tiles(lhs, along K), blocks(rhs))
  backward  dlhs = gmm(tiles(dout, along N), blocks(rhs), transposed)
            drhs = tgmm(row tiles(lhs), row tiles(dout))        (contraction over tokens)

each accumulating in float32; with FP8_WGRAD off the third takes lhs and dout as they are (bf16);
FP8_ROWWISE gives the first two one scale per row of lhs / dout and per column of the weights.
A backend without FP8 forms is refused (`fp8_backend`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from umoe_jax.ops import fp8
from umoe_jax.ops.gmm_backends import BACKENDS, GmmBackend, register_builtin_kernels, resolve_backend
from umoe_jax.ops.row_index import raw_fp8_gmm, raw_tgmm
from umoe_jax.ops.varying import vary_like, varying_axes


# The FP8 forms "auto" may take: those whose GPU tests (tests/gpu/test_fp8_gpu.py) pass on a GPU.
AUTO_FP8 = frozenset({"xla", "triton"})

# The weight gradient's product in FP8 (True) or in bf16 by the backend's own tgmm (False). In FP8 it
# needs both operands quantised again in 128-row column tiles (two more passes over [M, K] and
# [M, N]), and the FP8 tgmm kernel ran at 0.4x the bf16 one on pre-quantised operands (bench/gmm.py,
# H100); True until bench/train_step.py rows /fp8_wgrad=0 and =1 have timed the two.
FP8_WGRAD = True

# The row-wise recipe instead of the fine-grained one: one scale a token row along the forward's and
# the input gradient's contraction, one a weight column (`fp8.quantize_rowwise`), the weight
# gradient in bf16 (torchao's "rowwise with high-precision weight gradient"). A contraction with one
# scale runs whole on the tensor cores and is scaled once in the epilogue, where 128-wide scale pieces
# stop the tensor cores every 128 elements to promote. Coarser: an outlier costs its whole row, and
# the Triton forward sums its whole contraction in the tensor cores' accumulator (~14 bits;
# `triton_fp8_gmm.ROWWISE_PROMOTE`). Both switches here cover every fp8_gmm product: the experts',
# and the dense ones where they run through the kernel (`layers.fp8_dense` on one GPU). Off until
# bench/train_step.py rows /fp8_rowwise=1 have timed it and a fidelity run has trained with it.
FP8_ROWWISE = False


def fp8_wgrad() -> bool:
  """Whether the weight gradients take FP8 operands now (FP8_WGRAD, never under FP8_ROWWISE)."""
  return FP8_WGRAD and not FP8_ROWWISE


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


def quantize(backend_name: str, x, axis: int, index=None):
  """`fp8.quantize_tiles(x, axis)` (x [M, C], the same bits) by the backend's one-pass quantiser
  where it has one; with `index` [M'] that of x's rows `index` (`jnp.take(x, index, axis=0)`), which
  the backend's quantiser reads through the index instead of a gathered copy. Under FP8_ROWWISE the
  rows along a contraction (axis 1) take one scale each, by XLA (`fp8.quantize_rowwise`)."""
  if FP8_ROWWISE and axis == 1:
    return fp8.quantize_rowwise(x if index is None else jnp.take(x, index, axis=0), axis=1)
  own = BACKENDS.get(backend_name).fp8_quantize
  if own is not None:
    return own(x, axis) if index is None else own(x, axis, index=index)
  return fp8.quantize_tiles(x if index is None else jnp.take(x, index, axis=0), axis=axis)


def quantized_gmm(backend_name: str, lhs_q, lhs_scale, rhs, group_sizes, transpose_rhs: bool, out_dtype,
                  lhs_index=None):
  """The forward product from already quantised rows (`quantize(backend_name, lhs, 1)`): rows may
  be quantised before they are gathered into expert order, since their tiles run along the row.
  With `lhs_index` the product's rows are lhs_q[lhs_index] (and their scales), read through the
  index by a backend with `row_index`, gathered by XLA for the others. The weights are quantised
  here: in blocks, or under FP8_ROWWISE one scale per column of the product's weight matrix."""
  rhs_q = (fp8.quantize_rowwise(rhs, axis=2 if transpose_rhs else 1) if FP8_ROWWISE
           else fp8.quantize_blocks(rhs))
  return raw_fp8_gmm(BACKENDS.get(backend_name), lhs_q, lhs_scale, *rhs_q, group_sizes,
                     transpose_rhs=transpose_rhs, out_dtype=out_dtype, lhs_index=lhs_index,
                     rowwise=FP8_ROWWISE)


def row_blocks(rows, splits: int):
  """Sizes [splits] int32 of `rows` (a traced count) cut into `splits` consecutive blocks of whole
  128-row scale tiles (the last block takes the remainder; trailing blocks may be empty)."""
  tiles = -(-rows // (splits * fp8.TILE))
  starts = jnp.arange(splits, dtype=jnp.int32) * tiles * fp8.TILE
  return jnp.clip(rows - starts, 0, tiles * fp8.TILE).astype(jnp.int32)


def gradients(backend_name: str, lhs, rhs, group_sizes, transpose_rhs: bool, dout, row_splits: int = 1,
              lhs_index=None):
  """(dlhs, drhs) of `out = gmm(lhs, rhs, group_sizes)` (rhs[g].T with `transpose_rhs`) in FP8.
  With `lhs_index` the product's rows are lhs[lhs_index] (`quantize` reads them through it).
  `row_splits` > 1 (one group only; `fp8_wgrad()`) computes the weight gradient over that many row
  blocks, as that many groups, and sums their float32 partials: a kernel that gives each group its
  own programs has rows / 128 steps in each of K/bm x N/bn programs for one group, too few to fill
  a GPU."""
  backend: GmmBackend = BACKENDS.get(backend_name)
  dlhs = quantized_gmm(backend_name, *quantize(backend_name, dout, 1), rhs, group_sizes,
                       not transpose_rhs, lhs.dtype)
  if not fp8_wgrad():
    return dlhs, bf16_wgrad(backend, lhs, dout.astype(lhs.dtype), group_sizes, rhs, transpose_rhs,
                            lhs_index)
  rows_q, dout_q = quantize(backend_name, lhs, 0, lhs_index), quantize(backend_name, dout, 0)
  # out = lhs @ rhs[g].T: drhs[g] = dout.T @ lhs
  operands = (*dout_q, *rows_q) if transpose_rhs else (*rows_q, *dout_q)
  if row_splits > 1:
    if rhs.shape[0] != 1:
      raise ValueError(f"fp8_gmm: row_splits={row_splits} needs one group, got {rhs.shape[0]}")
    parts = backend.fp8_tgmm(*operands, row_blocks(group_sizes[0], row_splits), num_groups=row_splits,
                             out_dtype=jnp.float32)
    return dlhs, jnp.sum(parts, axis=0, keepdims=True).astype(rhs.dtype)
  drhs = backend.fp8_tgmm(*operands, group_sizes, num_groups=rhs.shape[0], out_dtype=rhs.dtype)
  return dlhs, drhs


def bf16_wgrad(backend: GmmBackend, lhs, dout, group_sizes, rhs, transpose_rhs: bool, lhs_index=None):
  """The weight gradient of `out = gmm(lhs, rhs, group_sizes)` with the operands as they are (bf16):
  the backend's tgmm (rows through `lhs_index` where given), or for one group XLA's dot over the
  group's rows (a tgmm kernel gives one group too few programs to fill a GPU; `row_splits`)."""
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
def _differentiable(backend_name: str, transpose_rhs: bool, out_dtype, row_splits: int):

  @jax.custom_vjp
  def fn(lhs, rhs, group_sizes):
    out = quantized_gmm(backend_name, *quantize(backend_name, lhs, 1), rhs, group_sizes,
                        transpose_rhs, out_dtype or lhs.dtype)
    return vary_like(out, varying_axes(lhs) | varying_axes(rhs) | varying_axes(group_sizes))

  def fwd(lhs, rhs, group_sizes):
    return fn(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)

  def bwd(res, dout):
    lhs, rhs, group_sizes = res
    dlhs, drhs = gradients(backend_name, lhs, rhs, group_sizes, transpose_rhs, dout, row_splits)
    # Kernels called through custom calls drop shard_map's varying-axes type; restore it (as gmm).
    return vary_like(dlhs, varying_axes(lhs)), vary_like(drhs, varying_axes(rhs)), None

  fn.defvjp(fwd, bwd)
  return fn


def fp8_gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, backend: str = "auto",
            transpose_rhs: bool = False, preferred_element_type=None, row_splits: int = 1) -> jax.Array:
  """`gmm(lhs, rhs, group_sizes)` (same shapes and arguments) with FP8 operands in all three
  products; float32 accumulation; output in `preferred_element_type` (default lhs.dtype).
  `row_splits`: one group's weight gradient over that many row blocks (`gradients`)."""
  name = fp8_backend(backend)
  if row_splits < 1 or (row_splits > 1 and rhs.shape[0] != 1):
    raise ValueError(f"fp8_gmm: row_splits={row_splits}: a count >= 1, above 1 only for one group "
                     f"(rhs has {rhs.shape[0]})")
  out_dtype = jnp.dtype(preferred_element_type) if preferred_element_type is not None else None
  return _differentiable(name, transpose_rhs, out_dtype, int(row_splits))(
      lhs, rhs, group_sizes.astype(jnp.int32))
