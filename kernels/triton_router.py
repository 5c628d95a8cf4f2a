"""A softmax router's forward in one pass over its logits, in Triton (called from JAX through
jax-triton): `router.one_pass` (umoe_jax/ops/router_pass.py is the JAX side).

For logits [B, T, E] float32 (E up to MAX_E) a program takes BLOCK_ROWS positions of one sequence,
each row whole in registers (E padded to a power of two E_PAD), and writes

    probs   [B, T, E]  float32   softmax over the experts, exp(x - max) / sum
    ids     [B, T, K]  int32     the K largest probs (+ bias [E], the aux-loss-free selection bias,
                                 for the choice only), descending, ties toward the lower expert:
                                 `jax.lax.top_k`'s order (kernels/triton_topk.pick_top_k)
    gates   [B, T, K]  float32   probs at the ids, over their sum when RENORMALIZE
    sums    [B, NB, E] float32   the block's probs summed over its positions (NB = blocks a sequence)
    counts  [B, NB, E] float32   the block's picks per expert

so the balance losses' per-sequence statistics (mean probs, picks per expert) are finished by a
sum over NB blocks, not by passes over [B, T, E] and a one-hot [B, T, K, E]. The separate forms
(XLA softmax, the top-k kernel, the gather of the gates, the statistics' reductions) are four or
more kernels a router call. Per-block partial sums, not atomics: the statistics come out the same
on every run.

`softmax_top_k` is the JAX entry (no gradient; router_pass.py owns the backward); `supported` says
whether it runs here. Launches go through `_launch`, which the CPU tests replace by the Triton
interpreter.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels import triton_launch
from kernels.triton_gmm import HAVE_JAX_TRITON, HAVE_TRITON, default_backend_is_gpu
from kernels.triton_topk import MAX_E, row_tiles
from kernels.triton_topk import TopKConfig as RouterPassConfig  # (positions per program, warps)

if HAVE_TRITON:
  import triton
  import triton.language as tl

  from kernels.triton_topk import ordered_keys, pick_top_k
if HAVE_JAX_TRITON:
  import jax_triton as jt


if HAVE_TRITON:

  @triton.jit
  def _softmax_top_k_kernel(logits_ptr, bias_ptr, probs_ptr, ids_ptr, gates_ptr, sums_ptr,
                            counts_ptr, T: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr,
                            K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                            N_BLOCKS: tl.constexpr, HAS_BIAS: tl.constexpr,
                            RENORMALIZE: tl.constexpr):
    # Program (block j, sequence b): positions [j * BLOCK_ROWS, ...) of sequence b (module docstring).
    j, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    pos = j * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = pos < T
    rows = b * T + pos
    cols = tl.arange(0, E_PAD)
    col_ok = cols < E
    ok = row_ok[:, None] & col_ok[None, :]
    x = tl.load(logits_ptr + rows[:, None] * E + cols[None, :], mask=ok, other=0.0)
    x = tl.where(col_ok[None, :], x, float("-inf"))          # padding experts: probability 0
    p = tl.exp(x - tl.max(x, axis=1)[:, None])
    probs = p / tl.sum(p, axis=1)[:, None]
    tl.store(probs_ptr + rows[:, None] * E + cols[None, :], probs, mask=ok)
    scores = probs
    if HAS_BIAS:
      scores = probs + tl.load(bias_ptr + cols, mask=col_ok, other=0.0)[None, :]
    ids, gates, taken = pick_top_k(ordered_keys(scores), probs, cols, E, K, K_PAD)
    if RENORMALIZE:
      gates = gates / tl.sum(gates, axis=1)[:, None]
    slots = tl.arange(0, K_PAD)
    slot_ok = row_ok[:, None] & (slots < K)[None, :]
    tl.store(ids_ptr + rows[:, None] * K + slots[None, :], ids, mask=slot_ok)
    tl.store(gates_ptr + rows[:, None] * K + slots[None, :], gates, mask=slot_ok)
    stats = (b * N_BLOCKS + j) * E + cols
    tl.store(sums_ptr + stats, tl.sum(tl.where(ok, probs, 0.0), axis=0), mask=col_ok)
    tl.store(counts_ptr + stats, tl.sum(tl.where(ok & taken, 1.0, 0.0), axis=0), mask=col_ok)


# The default launch: 1024 logits (8 positions of 128 experts) and 2 warps a program. On one H200
# at [32, 1024, 128] that is 15% (k=3) and 6% (k=15) faster than the top-k kernel's 16 x 4
# (BENCHMARKS.md run 81's sweep).
DEFAULT_CONFIG = RouterPassConfig(block_rows=0, num_warps=2)
ROW_ELEMENTS = 1024


def launch_params(t: int, e: int, k: int, config: RouterPassConfig | None = None) -> dict:
  """Blocks per sequence and constexprs of one launch for logits [B, t, e] and k (checked: t >= 1
  and, as the top-k kernel's, 1 <= k <= e <= MAX_E: `triton_topk.row_tiles`)."""
  if t < 1:
    raise ValueError(f"router pass kernel: T={t} must be >= 1")
  tiles = row_tiles(e, k, config or DEFAULT_CONFIG, kernel="router pass", row_elements=ROW_ELEMENTS)
  return dict(N_BLOCKS=-(-t // tiles["BLOCK_ROWS"]), **tiles)


def _launch(kernel, grid, args, out_shape, **meta):
  """One kernel launch through jax-triton (replaced by the interpreter in the CPU tests)."""
  return jt.triton_call(*args, kernel=kernel, grid=grid, out_shape=out_shape, **meta,
                        **triton_launch.launch_kwargs())


def softmax_top_k(logits: jax.Array, k: int, *, bias: jax.Array | None = None,
                  renormalize: bool = False, config: RouterPassConfig | None = None):
  """logits [B, T, E] float32 (bias [E] or None) -> (probs [B, T, E], ids [B, T, k] int32,
  gates [B, T, k], sums [B, NB, E], counts [B, NB, E]) as the module docstring says. No gradient."""
  if logits.ndim != 3 or logits.dtype != jnp.float32:
    raise ValueError(f"router pass kernel wants float32 logits [B, T, E]; got {logits.dtype} "
                     f"{logits.shape}")
  b, t, e = logits.shape
  meta = launch_params(t, e, k, config)
  nb = meta["N_BLOCKS"]
  has_bias = bias is not None
  bias = (jnp.zeros((e,), jnp.float32) if bias is None
          else jax.lax.stop_gradient(bias).astype(jnp.float32).reshape(e))
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  out_shape = [f32(b, t, e), jax.ShapeDtypeStruct((b, t, k), jnp.int32), f32(b, t, k),
               f32(b, nb, e), f32(b, nb, e)]
  return tuple(_launch(_softmax_top_k_kernel, (nb, b), (jax.lax.stop_gradient(logits), bias),
                       out_shape, T=t, HAS_BIAS=has_bias, RENORMALIZE=bool(renormalize), **meta))


def supported_shapes(logits: jax.Array, k: int) -> bool:
  """logits [B, T, E] float32, B, T >= 1, 1 <= k <= E <= MAX_E."""
  return (logits.ndim == 3 and logits.dtype == jnp.float32 and min(logits.shape[:2]) >= 1
          and 1 <= k <= logits.shape[2] <= MAX_E)


available = default_backend_is_gpu  # (tests replace it to run the kernel in the interpreter)


def supported(logits: jax.Array, k: int) -> bool:
  """Whether the kernel takes logits [B, T, E] and k here: a GPU with Triton and jax-triton, and
  `supported_shapes`."""
  return available() and supported_shapes(logits, k)
