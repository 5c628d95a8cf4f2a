"""Splash attention (JAX's Pallas TPU flash-attention kernel) as the attention core "splash".

`causal_attention(..., core="splash")` calls `splash_attention` on TPU (or in the Pallas interpreter,
UMOE_PALLAS_TPU_INTERPRET=1) when queries attend to their own keys (training, prefill without a cache)
and nobody asks for the probabilities; the XLA form runs everywhere else. Which kernel:
  * key heads == query heads (MHA, SwitchHead): `make_splash_mha`, one key/value head per query head;
  * one key head (pre-mixing, post-mixing, MoA): `make_splash_mqa`, every query head reads the one
    key and value. Splash takes a value width other than the key's, so pre-mixing's values (the
    normed hidden states, D wide, or the MLA latent) go through as they are: no chunking and no
    recomputed scores, unlike the cuDNN core. The whole pre-mixing core is therefore this kernel.
The causal mask is splash's `CausalMask` (fully masked blocks are skipped, not computed); queries are
scaled by 1/sqrt(Dk) before the kernel (splash applies no scale). Sequence lengths must be a multiple
of 128 (the block sizes below), else the XLA form runs.

Under `parallel.use_mesh` the kernel runs inside `shard_map` (`local_shards.on_local_shards`): batch split
like the activations (BATCH), query heads over HEADS' mesh axes when they divide them (MQA keys and
values whole on every head shard), sequence whole.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp

from umoe_jax.model.attention.local_shards import on_local_shards
from umoe_jax.ops import pallas_tpu

BLOCKS = (512, 256, 128)  # q / kv block sizes tried, largest first (must divide the length)


def block_size(t: int) -> Optional[int]:
  """The q/kv block for length t: the largest of BLOCKS dividing it, else None (splash computes in
  128-lane key blocks, in the interpreter too)."""
  return next((b for b in BLOCKS if t % b == 0), None)


def _kernel(t: int, heads: int, mqa: bool, block: int, interpret: bool):
  """A splash kernel for [heads, t, .] operands. Built per call, inside the trace: it holds its block
  tables as arrays (constants of the trace that builds it); the numpy mask processing behind them is
  cached by the library."""
  from jax.experimental.pallas.ops.tpu import splash_attention as sa
  mask = sa.MultiHeadMask([sa.CausalMask((t, t)) for _ in range(heads)])
  sizes = sa.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                        block_q_dq=block, block_kv_dq=block)
  make = sa.make_splash_mqa_single_device if mqa else sa.make_splash_mha_single_device
  return make(mask, block_sizes=sizes, interpret=interpret)


def _local(q, k, v, *, mqa: bool, block: int, interpret: bool):
  """q [B, T, H, Dk], k / v [B, T, Hk, D] -> [B, T, H, Dv] through the kernel, on local shards.
  mqa: one key head over all query heads (decided on the global shapes: a head shard of one query
  head over its own key head is still multi-head)."""
  _, t, h, dk = q.shape
  q = (q.astype(jnp.float32) / math.sqrt(dk)).astype(q.dtype).transpose(0, 2, 1, 3)  # [B, H, T, Dk]
  if mqa:
    k, v = k[:, :, 0], v[:, :, 0]                                                # [B, T, D]
  else:
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)                      # [B, H, T, D]
  kernel = _kernel(t, h, mqa, block, interpret)
  return jax.vmap(kernel)(q, k, v).transpose(0, 2, 1, 3)                         # [B, T, H, Dv]


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                     interpret: Optional[bool] = None) -> Optional[jax.Array]:
  """Causal softmax(q k^T / sqrt(Dk)) v through splash attention, or None when it cannot run.

  Args:
    q [B, T, H, Dk]; k [B, T, Hk, Dk], v [B, T, Hk, Dv] with Hk == H or Hk == 1.
    interpret: run in the Pallas interpreter (default: UMOE_PALLAS_TPU_INTERPRET).
  Returns:
    [B, T, H, Dv] in q's dtype, or None (keys not the queries' own length, a length no block
    divides, unsupported dtype).
  """
  interpret = pallas_tpu.interpret() if interpret is None else interpret
  t, h = q.shape[1], q.shape[2]
  hk = k.shape[2]
  block = block_size(t)
  if (k.shape[1] != t or hk not in (1, h) or block is None
      or q.dtype not in (jnp.bfloat16, jnp.float32)):
    return None
  return on_local_shards(functools.partial(_local, mqa=hk == 1, block=block, interpret=interpret),
                         q, k, v)
