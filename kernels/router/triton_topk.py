"""Exact top-k ids of short rows in Triton, called from JAX through jax-triton (the routers' top-k).

For x [N, E] (E small: the router's experts, up to MAX_E) and a compile-time k, ids [N, k] int32
are the columns of the k largest values of each row in descending order, ties toward the lower
column: the order of `jax.lax.top_k`. XLA lowers that to a full sort of every row; this is one
pass over x.

Program = BLOCK_ROWS rows, each held whole in registers (E padded to a power of two E_PAD; the
padding columns start out taken, so they are never picked). Then k times: m = the largest key
among the not-yet-taken entries of the row, id = the lowest not-taken column whose key is m, mark
it taken. A separate taken mask (not overwriting picked values with -inf) keeps the picks distinct
and lowest-index-first in rows that hold -inf. The ids collect in a [BLOCK_ROWS, K_PAD] register
tile stored once.

Keys: values are compared in IEEE total order (the float32 bits with the low 31 bits flipped for
negative values, as signed int32): -NaN < -inf < ... < -0.0 < +0.0 < ... < +inf < +NaN, which is
how `jax.lax.top_k` orders them on the CPU. NaN inputs are not a supported case for routers
(lax.top_k on another platform may order them differently); the ids are always distinct and in
[0, E).

`top_k_ids` is the JAX entry (no gradient: integer output); `supported` says whether it runs here
(callers fall back to `jax.lax.top_k` otherwise). Launches go through `_launch`, which the CPU tests
replace by the Triton interpreter.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kernels import triton_launch
from kernels.triton_base import HAVE_JAX_TRITON, HAVE_TRITON, default_backend_is_gpu, pow2_at_least

if HAVE_TRITON:
  import triton
  import triton.language as tl
if HAVE_JAX_TRITON:
  import jax_triton as jt

MAX_E = 1024                     # a row of E_PAD keys lives in registers
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
ROW_ELEMENTS = 2048              # default BLOCK_ROWS * E_PAD per program (16 rows of 128)


@dataclasses.dataclass(frozen=True)
class TopKConfig:
  """Launch parameters: rows per program (a power of two) and warps per program."""
  block_rows: int = 0            # 0 = ROW_ELEMENTS // E_PAD (at least 1)
  num_warps: int = 4


if HAVE_TRITON:

  @triton.jit
  def ordered_keys(x):
    """float32 x -> int32 keys in IEEE total order (module docstring), compared as signed ints."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)

  @triton.jit
  def pick_top_k(key, values, cols, E: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr):
    """The K largest keys of each row of key [R, E_PAD] (columns `cols` [E_PAD], those >= E never
    picked): (ids [R, K_PAD] int32, values at the ids [R, K_PAD] from values [R, E_PAD], taken
    [R, E_PAD] bool = the picks and the padding columns); slots >= K hold 0."""
    rows: tl.constexpr = key.shape[0]
    e_pad: tl.constexpr = key.shape[1]
    lowest = tl.full((rows, e_pad), -2147483648, tl.int32)
    taken = tl.broadcast_to((cols >= E)[None, :], (rows, e_pad))
    col_ids = tl.broadcast_to(cols[None, :], (rows, e_pad))
    slots = tl.arange(0, K_PAD)
    out = tl.zeros((rows, K_PAD), tl.int32)
    picked = tl.zeros((rows, K_PAD), values.dtype)
    for j in tl.static_range(K):
      best = tl.max(tl.where(taken, lowest, key), axis=1)
      hit = (key == best[:, None]) & ~taken
      pick = tl.min(tl.where(hit, col_ids, e_pad), axis=1)
      is_pick = col_ids == pick[:, None]
      taken = taken | is_pick
      out = tl.where(slots[None, :] == j, pick[:, None], out)
      value = tl.sum(tl.where(is_pick, values, 0.0), axis=1)
      picked = tl.where(slots[None, :] == j, value[:, None], picked)
    return out, picked, taken

  @triton.jit
  def _topk_kernel(x_ptr, ids_ptr, N: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr, K: tl.constexpr,
                   K_PAD: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    # x [N, E] row-major -> ids [N, K] int32 (module docstring).
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, E_PAD)
    row_ok = rows < N
    x = tl.load(x_ptr + rows[:, None] * E + cols[None, :],
                mask=row_ok[:, None] & (cols < E)[None, :], other=0.0).to(tl.float32)
    out, _, _ = pick_top_k(ordered_keys(x), x, cols, E, K, K_PAD)
    slots = tl.arange(0, K_PAD)
    tl.store(ids_ptr + rows[:, None] * K + slots[None, :], out,
             mask=row_ok[:, None] & (slots < K)[None, :])


def row_tiles(e: int, k: int, config: TopKConfig | None = None, *, kernel: str = "top-k",
              row_elements: int = ROW_ELEMENTS) -> dict:
  """The constexprs E, E_PAD, K, K_PAD, BLOCK_ROWS and num_warps of a kernel that holds rows of e
  values whole and picks k of them (this one), checked: 1 <= k <= e <=
  MAX_E, block_rows a power of two (default: row_elements // E_PAD). `kernel` names it in the
  errors."""
  if not 1 <= k <= e:
    raise ValueError(f"{kernel}: k={k} must be in [1, E={e}]")
  if e > MAX_E:
    raise ValueError(f"{kernel} kernel: E={e} exceeds MAX_E={MAX_E}")
  cfg = config or TopKConfig()
  e_pad = pow2_at_least(max(e, 2))  # no 1-wide aranges
  block_rows = cfg.block_rows or max(1, row_elements // e_pad)
  if block_rows & (block_rows - 1):
    raise ValueError(f"{kernel} kernel: block_rows={block_rows} must be a power of two")
  return dict(E=e, E_PAD=e_pad, K=k, K_PAD=pow2_at_least(max(k, 2)), BLOCK_ROWS=block_rows,
              num_warps=cfg.num_warps)


def launch_params(n_rows: int, e: int, k: int, config: TopKConfig | None = None) -> dict:
  """Grid and constexprs of one launch for x [n_rows, e] and k (`row_tiles`)."""
  tiles = row_tiles(e, k, config)
  return dict(grid=(max(1, -(-n_rows // tiles["BLOCK_ROWS"])),), **tiles)


def _launch(kernel, grid, args, out_shape, **meta):
  """One kernel launch through jax-triton (replaced by the interpreter in the CPU tests)."""
  return jt.triton_call(*args, kernel=kernel, grid=grid, out_shape=out_shape, **meta,
                        **triton_launch.launch_kwargs())


def top_k_ids(x: jax.Array, k: int, *, config: TopKConfig | None = None) -> jax.Array:
  """x [N, E] (a float dtype in DTYPES) -> ids [N, k] int32 of each row's k largest values,
  descending, ties toward the lower index (`jax.lax.top_k`'s order). No gradient."""
  if x.ndim != 2:
    raise ValueError(f"triton top_k_ids wants x [N, E]; got {x.shape}")
  n, e = x.shape
  meta = launch_params(n, e, k, config)
  grid = meta.pop("grid")
  return _launch(_topk_kernel, grid, (jax.lax.stop_gradient(x),),
                 jax.ShapeDtypeStruct((n, k), jnp.int32), N=n, **meta)


def supported_shapes(x: jax.Array, k: int) -> bool:
  """x [N, E] of a dtype in DTYPES, N >= 1, 1 <= k <= E <= MAX_E."""
  return x.ndim == 2 and x.dtype in DTYPES and x.shape[0] >= 1 and 1 <= k <= x.shape[1] <= MAX_E


available = default_backend_is_gpu  # (tests replace it to run the kernel in the interpreter)


def supported(x: jax.Array, k: int) -> bool:
  """Whether the kernel takes x [N, E] and k here: a GPU with Triton and jax-triton, and
  `supported_shapes`."""
  return available() and supported_shapes(x, k)


