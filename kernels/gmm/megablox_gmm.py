"""Grouped matmul on TPU: JAX's Pallas TPU megablox kernels as the gmm backend "megablox".

  megablox_gmm(lhs [M,K], rhs [G,K,N], group_sizes [G])                     -> [M,N]
  megablox_gmm(lhs [M,N], rhs [G,K,N], group_sizes, transpose_rhs=True)     -> [M,K]
  megablox_tgmm(lhs [M,K], rhs [M,N], group_sizes [G])                      -> [G,K,N]

The kernels are `jax.experimental.pallas.ops.tpu.megablox.gmm.{gmm, tgmm}` (the raw, non-differentiable
ones: the backward rule is `umoe_jax.ops.gmm`'s, shared by every backend). They walk the row tiles a
group touches (a tile that straddles a group boundary is visited once per group, with the store or
operand rows masked to the group), so empty groups cost nothing in gmm and give zeros in tgmm.
What this wrapper adds to make them honour the `umoe_jax.ops.gmm` contract:
  * M is padded with zero rows to a multiple of the row tile (the kernels require it);
  * rows past sum(group_sizes) are zeroed in the gmm output (the kernel never writes them);
  * tiles are clamped to the operand (a width below the tile becomes one full-width block, which
    Mosaic accepts whatever its size; a wider one keeps the 128-multiple tile, last block partial).
Tiles come from `kernels.gmm.tuning` under the backend key "megablox/<TPU generation>" (see there).
Operands must be bfloat16 or float32 (the kernels' dtypes). No row-index (gather / scale) variants:
`umoe_jax.ops.fused_dispatch` does the gathers in XLA around these calls. Inside expert parallelism's
`shard_map(check_vma=True)` the calls run with the check off (`pallas_tpu.outside_vma_check`: the
kernels do not declare their outputs' varying axes); `umoe_jax.ops.gmm` restores them after.

On CPU the kernels run in the Pallas interpreter when UMOE_PALLAS_TPU_INTERPRET=1
(`umoe_jax.ops.pallas_tpu`); the backend then also registers for the CPU platform.
"""
from __future__ import annotations

import importlib
from typing import Optional

import jax
import jax.numpy as jnp

from kernels.gmm import tuning
from umoe_jax.ops import pallas_tpu

# The package's __init__ rebinds `megablox.gmm` to the custom-VJP op; the raw kernels live in the
# module of the same name.
_mb = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")

PLATFORMS = ("tpu", "cpu") if pallas_tpu.interpret() else ("tpu",)
_SUBLANES = 16  # row tiles a multiple of 16: bfloat16 packs 16 rows per (8, 128) vreg tile
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def tuning_key(device_kind: Optional[str] = None) -> str:
  """The backend key of this TPU's rows in `kernels.gmm.tuning.TABLE`: "megablox/v5e", ..."""
  return f"megablox/{pallas_tpu.generation(device_kind) or 'v5e'}"


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _lane_tile(width: int, tile: int) -> int:
  """A lane-dim block: the whole width when it fits in one tile, else the (128-multiple) tile."""
  return width if width <= tile else tile


def _check_dtypes(*arrays) -> None:
  for a in arrays:
    if jnp.dtype(a.dtype) not in _DTYPES:
      raise ValueError(f"gmm backend 'megablox' takes bfloat16 or float32 operands; got {a.dtype} "
                       f"(shape {a.shape})")


def _pad_rows(x: jax.Array, rows: int) -> jax.Array:
  return x if x.shape[0] == rows else jnp.pad(x, ((0, rows - x.shape[0]), (0, 0)))


def megablox_gmm(lhs, rhs, group_sizes, *, transpose_rhs=False, out_dtype=None, config=None,
                 interpret: Optional[bool] = None):
  """Raw grouped matmul (the `GmmBackend.gmm` contract); `config` overrides the tuned tiles."""
  _check_dtypes(lhs, rhs)
  m = lhs.shape[0]
  g, k, n = rhs.shape
  kc, no = (n, k) if transpose_rhs else (k, n)
  out_dtype = jnp.dtype(out_dtype or lhs.dtype)
  if m == 0:
    return jnp.zeros((0, no), out_dtype)
  cfg = config or tuning.lookup(tuning_key(), "gmm_t" if transpose_rhs else "gmm", m, kc, no, g)
  tm = min(cfg.bm, _round_up(m, _SUBLANES))
  mp = _round_up(m, tm)
  interpret = pallas_tpu.interpret() if interpret is None else interpret
  with pallas_tpu.outside_vma_check():
    out = _mb.gmm(_pad_rows(lhs, mp), rhs, group_sizes.astype(jnp.int32), out_dtype,
                  (tm, _lane_tile(kc, cfg.bk), _lane_tile(no, cfg.bn)),
                  transpose_rhs=transpose_rhs, interpret=interpret)
  # Rows past the last group are never written by the kernel (uninitialised memory).
  valid = jnp.arange(mp, dtype=jnp.int32) < jnp.sum(group_sizes.astype(jnp.int32))
  return jnp.where(valid[:, None], out, jnp.zeros((), out_dtype))[:m]


def megablox_tgmm(lhs, rhs, group_sizes, *, num_groups=None, out_dtype=None, config=None,
                  interpret: Optional[bool] = None):
  """Raw weight-gradient form: out[g] = lhs[rows of g].T @ rhs[rows of g] (rows past the groups and
  empty groups contribute nothing: the kernel masks operand rows to each group)."""
  _check_dtypes(lhs, rhs)
  m, k = lhs.shape
  n = rhs.shape[1]
  g = int(num_groups or group_sizes.shape[0])
  out_dtype = jnp.dtype(out_dtype or lhs.dtype)
  if m == 0:
    return jnp.zeros((g, k, n), out_dtype)
  # tuning's tgmm convention: bm x bn = the output tile (K rows, N cols), bk = rows per step.
  cfg = config or tuning.lookup(tuning_key(), "tgmm", m, k, n, g)
  tm = min(cfg.bk, _round_up(m, _SUBLANES))
  mp = _round_up(m, tm)
  interpret = pallas_tpu.interpret() if interpret is None else interpret
  with pallas_tpu.outside_vma_check():
    return _mb.tgmm(_pad_rows(lhs, mp).swapaxes(0, 1), _pad_rows(rhs, mp),
                    group_sizes.astype(jnp.int32), out_dtype,
                    (tm, _lane_tile(k, cfg.bm), _lane_tile(n, cfg.bn)), num_actual_groups=g,
                    interpret=interpret)


GMM, TGMM = megablox_gmm, megablox_tgmm  # the names bench/gmm.py --sweep calls


def available() -> bool:
  try:
    return pallas_tpu.runs_here()
  except RuntimeError:
    return False
