"""The K-way fan-in of gathered rows in Triton, called from JAX through jax-triton.

  gather_sum(rows [M, D], index [N, K], weights [N, K] or None) -> [N, D] in rows.dtype
      out[n] = sum_k weights[n, k] * rows[index[n, k]]     (accumulated in float32)

The expert pool's two fan-ins have this form (`umoe_jax.ops.fused_dispatch`): the input gradient of
the first grouped matmul (rows = per-slot gradients in expert order, index = the plan's inverse
permutation, no weights) and the gate-weighted combine of the last one's outputs (weights = the
gates). Both read M = N * K rows of width D (K = 15, D = 768 at UMoE-base: 755 MB a layer) to write
N; XLA lowers take + reshape + sum to a gather-reduce fusion. Here one program owns a
[BLOCK_N, BLOCK_D] float32 accumulator and adds its tokens' K rows into it, the K loads unrolled
(independent, so they are in flight together): one read of every row and one write of the output,
the memory floor.

`gather_sum` is the JAX entry (no gradient: callers differentiate around it, the fan-in's
transpose being a gather again). It runs where the triton gmm backend runs, as that backend's
`gather_sum` (umoe_jax/ops/gmm_backends.py). Launches go through `_launch`, which the CPU tests replace by
the Triton interpreter.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kernels import triton_launch
from kernels.triton_base import HAVE_JAX_TRITON, HAVE_TRITON, default_backend_is_gpu, placeholder, pow2_at_least

if HAVE_TRITON:
  import triton
  import triton.language as tl
if HAVE_JAX_TRITON:
  import jax_triton as jt


@dataclasses.dataclass(frozen=True)
class FanInConfig:
  """Launch parameters: tokens and columns per program (powers of two), warps per program."""
  block_n: int = 16
  block_d: int = 256
  num_warps: int = 4


if HAVE_TRITON:

  @triton.jit
  def _gather_sum_kernel(rows_ptr, index_ptr, weights_ptr, out_ptr, N: tl.constexpr,
                         K: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr, WEIGHTED: tl.constexpr):
    # rows [M, D], index / weights [N, K], out [N, D], all row-major (module docstring).
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    token_ok = tokens < N
    mask = token_ok[:, None] & (cols < D)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    for k in tl.static_range(K):
      src = tl.load(index_ptr + tokens * K + k, mask=token_ok, other=0).to(tl.int64)
      row = tl.load(rows_ptr + src[:, None] * D + cols[None, :], mask=mask, other=0.0)
      if WEIGHTED:
        w = tl.load(weights_ptr + tokens * K + k, mask=token_ok, other=0.0).to(tl.float32)
        acc += row.to(tl.float32) * w[:, None]
      else:
        acc += row.to(tl.float32)
    tl.store(out_ptr + tokens[:, None] * D + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask)


def launch_params(n: int, k: int, d: int, config: FanInConfig | None = None) -> dict:
  """Grid and constexprs of one launch for N tokens of K rows of width D."""
  cfg = config or FanInConfig()
  for name, v in (("block_n", cfg.block_n), ("block_d", cfg.block_d)):
    if v < 1 or v & (v - 1):
      raise ValueError(f"fan-in kernel: {name}={v} must be a power of two")
  block_d = min(cfg.block_d, pow2_at_least(max(d, 16)))  # no wider than the rows need
  return dict(grid=(max(1, -(-n // cfg.block_n)), -(-d // block_d)), N=n, K=k, D=d,
              BLOCK_N=cfg.block_n, BLOCK_D=block_d, num_warps=cfg.num_warps)


def _launch(kernel, grid, args, out_shape, **meta):
  """One kernel launch through jax-triton (replaced by the interpreter in the CPU tests)."""
  return jt.triton_call(*args, kernel=kernel, grid=grid, out_shape=out_shape, **meta,
                        **triton_launch.launch_kwargs())


def gather_sum(rows: jax.Array, index: jax.Array, weights: jax.Array | None = None, *,
               config: FanInConfig | None = None) -> jax.Array:
  """rows [M, D], index [N, K] int (each in [0, M)), weights [N, K] float or None -> [N, D] in
  rows.dtype: out[n] = sum_k weights[n, k] * rows[index[n, k]], summed in float32 in k order.
  No gradient (module docstring)."""
  if rows.ndim != 2 or index.ndim != 2:
    raise ValueError(f"gather_sum wants rows [M, D] and index [N, K]; got {rows.shape}, {index.shape}")
  if weights is not None and weights.shape != index.shape:
    raise ValueError(f"gather_sum: weights {weights.shape} must match index {index.shape}")
  n, k = index.shape
  meta = launch_params(n, k, rows.shape[1], config)
  grid = meta.pop("grid")
  args = (jax.lax.stop_gradient(rows), index.astype(jnp.int32),
          placeholder() if weights is None else jax.lax.stop_gradient(weights))
  return _launch(_gather_sum_kernel, grid, args, jax.ShapeDtypeStruct((n, rows.shape[1]), rows.dtype),
                 WEIGHTED=weights is not None, **meta)


available = default_backend_is_gpu  # (tests replace it to run the kernel in the interpreter)
