"""One-pass FP8 quantisers in Triton (NVIDIA, through jax-triton): the same bits as
`umoe_jax.ops.fp8.quantize_tiles(x, axis=1)` and `quantize_blocks(w)`, each piece read once, its FP8
values and its scale written by the program that read it.

  quantize_rows(x)     x [M, C] -> q [M, C], scale [M, ceil(C/128)]     1 x 128 tiles along C
  quantize_blocks(w)   w [G, K, N] or [K, N] -> q like w, scale [G, ceil(K/128), ceil(N/128)]
                       (no G for a 2-D w)                               128 x 128 blocks

x and w are bfloat16 or float32. A last tile or block shorter than 128 has its own scale; rows or
columns past the array read as zeros, as `quantize_tiles` / `quantize_blocks` pad. The arithmetic is `umoe_jax.ops.fp8`'s, step for step:
scale = amax * float32(1/448); inv = 1 / (scale, or 1 where it is 0) rounded once; q = e4m3(clip(x *
inv, -448, 448)). A tile holding NaN (or +inf and -inf: the reference tests the tile's sum for NaN)
has a NaN scale and NaN values; one holding infs of one sign an inf scale, its finite values 0
(x * 0) and its infs NaN (inf * 0).

The bits are those of the correctly rounded reciprocal, which XLA's CPU backend computes; XLA's GPU
backend by default takes an approximate float32 division, so `quantize_tiles` on a GPU matches these
kernels only under XLA_FLAGS=--xla_backend_extra_options=-nvptx-prec-divf32=2 (see `_quantize`).

XLA runs the jnp forms as a reduction pass (amax and the NaN test) and a second pass that reads x again;
these kernels read it once. For the weights' blocks that reduction runs over two strided axes: on an
H100 XLA took 4.7 ms a UMoE-base step for it, several times what its bytes need. Launches go through `_launch`, which
the CPU tests replace by the Triton interpreter.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels import triton_launch
from kernels.triton_base import HAVE_JAX_TRITON, HAVE_TRITON, gpu_available, pow2_at_least

if HAVE_TRITON:
  import triton
  import triton.language as tl
if HAVE_JAX_TRITON:
  import jax_triton as jt

TILE = 128                       # umoe_jax.ops.fp8.TILE (kernels/ does not import umoe_jax.ops.fp8)
MAX = 448.0                      # float8_e4m3fn's largest finite value
DTYPE = jnp.dtype(jnp.float8_e4m3fn)
INPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))

# Rows a program of quantize_rows (it loops over the 128-wide tiles of C): [32, 128] blocks on 4
# warps, at most 80 registers a thread and no spills on sm_90a (bench/kernel_resources.py), so an SM
# holds 24-32 warps with ~48-64 KB of x in flight: many small programs stream x.
ROWS_BM, ROWS_WARPS = 32, 4
BLOCKS_WARPS = 8


if HAVE_TRITON:

  @triton.jit
  def _amax(x, axis: tl.constexpr):
    # max |x| along the tile, NaN where the tile's sum is NaN (fp8._amax's test, which also catches
    # the NaN that a GPU's max.f32 drops): a tile holding NaN, or +inf and -inf together, has a NaN
    # scale, one holding infs of one sign an inf scale.
    total = tl.sum(x, axis)
    return tl.where(total != total, float("nan"), tl.max(tl.abs(x), axis))

  @triton.jit
  def _quantize(x, amax):
    """x float32 and its tile's amax (broadcast against x) -> (q float8e4nv, scale float32)."""
    scale = amax * (1.0 / 448.0)   # a product by float32(1/448), as fp8._scale (not a division)
    # The reciprocal correctly rounded (div_rn), as fp8._to_fp8 defines it and XLA's CPU backend
    # computes it: Triton's `/` on float32 lowers to an approximate division on NVIDIA, off by an
    # ulp for some scales, and so then is q. (XLA's GPU backend divides approximately as well unless
    # run with XLA_FLAGS=--xla_backend_extra_options=-nvptx-prec-divf32=2: without it the jnp form on
    # a GPU differs from this kernel in ~7e-5 of the values, by one e4m3 step.) Then a product by
    # the reciprocal, not x / scale, which rounds differently.
    inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), tl.where(scale == 0, 1.0, scale))
    # The clip lets NaN through (a plain clamp's min/max would replace it by a bound).
    y = tl.clamp(x * inv, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    return y.to(tl.float8e4nv), scale

  @triton.jit
  def _blocks_kernel(w_ptr, q_ptr, s_ptr, K: tl.constexpr, N: tl.constexpr, KB: tl.constexpr,
                     NB: tl.constexpr, TILE: tl.constexpr):
    # w [G, K, N] in TILE x TILE blocks -> q [G, K, N], s [G, KB, NB]: one block a program, read
    # once; its amax and NaN test over both axes (fp8._amax's over the block).
    pid = tl.program_id(0)
    g = pid // (KB * NB)
    kb = (pid // NB) % KB
    nb = pid % NB
    rows = kb * TILE + tl.arange(0, TILE)
    cols = nb * TILE + tl.arange(0, TILE)
    ok = (rows < K)[:, None] & (cols < N)[None, :]
    offs = g.to(tl.int64) * (K * N) + rows.to(tl.int64)[:, None] * N + cols[None, :]
    x = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    total = tl.sum(tl.sum(x, 1), 0)
    amax = tl.where(total != total, float("nan"), tl.max(tl.max(tl.abs(x), 1), 0))
    q, _ = _quantize(x, tl.broadcast_to(amax, (TILE, TILE)))
    tl.store(q_ptr + offs, q, mask=ok)
    tl.store(s_ptr + pid, amax * (1.0 / 448.0))   # _quantize's scale, from the one amax

  @triton.jit
  def _rows_kernel(x_ptr, q_ptr, s_ptr, M: tl.constexpr, C: tl.constexpr, CB: tl.constexpr,
                   CBP: tl.constexpr, BM: tl.constexpr, TILE: tl.constexpr):
    # x [M, C] in 1 x TILE tiles along C -> q [M, C], s [M, CB]; BM rows a program, one tile of each
    # row a step; the CB scales of a row gathered in registers (CBP = CB rounded up to a power of
    # two) and stored once at the end, contiguous, instead of a strided 4-byte store a step.
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    row_ok = rows < M
    base = rows.to(tl.int64)[:, None] * C
    offs = tl.arange(0, TILE)
    slots = tl.arange(0, CBP)
    scales = tl.zeros((BM, CBP), tl.float32)
    for j in range(CB):
      cols = j * TILE + offs
      ok = row_ok[:, None] & (cols < C)[None, :]
      x = tl.load(x_ptr + base + cols[None, :], mask=ok, other=0.0).to(tl.float32)
      q, scale = _quantize(x, _amax(x, 1)[:, None])
      tl.store(q_ptr + base + cols[None, :], q, mask=ok)
      scales = tl.where(slots[None, :] == j, scale, scales)
    tl.store(s_ptr + rows.to(tl.int64)[:, None] * CB + slots[None, :], scales,
             mask=row_ok[:, None] & (slots < CB)[None, :])


# ----------------------------------------------------------------------------------------------
# Launch geometry (pure Python: tested on CPU).


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def rows_launch(m: int, c: int) -> dict:
  """quantize_rows' grid and meta-parameters: one program per ROWS_BM rows."""
  cb = _cdiv(c, TILE)
  return dict(grid=(_cdiv(m, ROWS_BM),), M=m, C=c, CB=cb, CBP=pow2_at_least(cb), BM=ROWS_BM,
              TILE=TILE, num_warps=ROWS_WARPS, num_stages=1)


def blocks_launch(g: int, k: int, n: int) -> dict:
  """quantize_blocks' grid and meta-parameters: one program per 128 x 128 block (64 KiB of float32
  over BLOCKS_WARPS warps)."""
  kb, nb = _cdiv(k, TILE), _cdiv(n, TILE)
  return dict(grid=(g * kb * nb,), K=k, N=n, KB=kb, NB=nb, TILE=TILE, num_warps=BLOCKS_WARPS,
              num_stages=1)


# ----------------------------------------------------------------------------------------------
# JAX entry points.


def _check(what: str, x) -> None:
  """Raises a one-line ValueError for a bad x."""
  if x.ndim != 2 or jnp.dtype(x.dtype) not in INPUT_DTYPES:
    raise ValueError(f"{what}: x is {jnp.dtype(x.dtype).name}{list(x.shape)}, expected a 2-D "
                     "[M, C] bfloat16 or float32 array")


def _launch(kernel, grid, args, out_shape, **meta):
  """One kernel launch through jax-triton (replaced by the interpreter in the CPU tests)."""
  return jt.triton_call(*args, kernel=kernel, grid=grid, out_shape=out_shape, **meta,
                        **triton_launch.launch_kwargs())


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """x [M, C] bfloat16 / float32 in 1 x 128 tiles along C -> (q [M, C] float8_e4m3fn, scale
  [M, ceil(C/128)] float32): `umoe_jax.ops.fp8.quantize_tiles(x, axis=1)`, bit for bit."""
  _check("triton fp8 quantize_rows", x)
  m, c = x.shape
  q_shape = jax.ShapeDtypeStruct((m, c), DTYPE)
  s_shape = jax.ShapeDtypeStruct((m, _cdiv(c, TILE)), jnp.float32)
  if m == 0 or c == 0:   # (no program to launch)
    return jnp.zeros(q_shape.shape, DTYPE), jnp.zeros(s_shape.shape, jnp.float32)
  launch = rows_launch(m, c)
  grid = launch.pop("grid")
  q, scale = _launch(_rows_kernel, grid, (x,), (q_shape, s_shape), **launch)
  return q, scale


def quantize_blocks(w: jax.Array) -> tuple[jax.Array, jax.Array]:
  """w [G, K, N] or [K, N] bfloat16 / float32 in 128 x 128 blocks over the last two axes -> (q like
  w float8_e4m3fn, scale [G, ceil(K/128), ceil(N/128)] float32, no G for a 2-D w):
  `umoe_jax.ops.fp8.quantize_blocks(w)`, bit for bit."""
  if w.ndim not in (2, 3) or jnp.dtype(w.dtype) not in INPUT_DTYPES:
    raise ValueError(f"triton fp8 quantize_blocks: w is {jnp.dtype(w.dtype).name}{list(w.shape)}, "
                     "expected a 3-D [G, K, N] or 2-D [K, N] bfloat16 or float32 array")
  w3 = w if w.ndim == 3 else w[None]
  g, k, n = w3.shape
  q_shape = jax.ShapeDtypeStruct((g, k, n), DTYPE)
  s_shape = jax.ShapeDtypeStruct((g, _cdiv(k, TILE), _cdiv(n, TILE)), jnp.float32)
  if g == 0 or k == 0 or n == 0:   # (no program to launch)
    q, scale = jnp.zeros(q_shape.shape, DTYPE), jnp.zeros(s_shape.shape, jnp.float32)
  else:
    launch = blocks_launch(g, k, n)
    grid = launch.pop("grid")
    q, scale = _launch(_blocks_kernel, grid, (w3,), (q_shape, s_shape), **launch)
  return (q, scale) if w.ndim == 3 else (q[0], scale[0])


available = gpu_available

QUANTIZE_ROWS = quantize_rows
QUANTIZE_BLOCKS = quantize_blocks
