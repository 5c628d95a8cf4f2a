"""Pieces every attention variant uses: the registry and causal softmax attention."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from umoe_jax.registry import Registry

ATTENTIONS: Registry[type] = Registry("attention kind")


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array,
                     k_positions: jax.Array) -> jax.Array:
  """softmax(q k^T / sqrt(Dk) + causal mask) v, softmax in float32.

  Args:
    q: [B, T, H, Dk].
    k: [B, S, Hk, Dk] with Hk == H or Hk == 1 (one key head shared by all query heads).
    v: [B, S, Hk, Dv] (Dv may differ from Dk: pre-mixing mixes whole hidden states).
    q_positions: [B, T], k_positions: [B, S]; query t sees key s iff 0 <= k_pos[s] <= q_pos[t]
      (a negative key position marks padding or an empty cache slot).
  Returns:
    [B, T, H, Dv] in v's dtype.
  """
  if k.shape[2] not in (1, q.shape[2]):
    raise ValueError(f"key heads {k.shape[2]} must be 1 or equal query heads {q.shape[2]}")
  scale = 1.0 / math.sqrt(q.shape[-1])
  if k.shape[2] == 1:
    scores = jnp.einsum("bthd,bsd->bhts", q, k[:, :, 0], preferred_element_type=jnp.float32)
  else:
    scores = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32)
  scores = scores * scale
  k_pos = k_positions[:, None, None, :]
  visible = (k_pos >= 0) & (k_pos <= q_positions[:, None, :, None])              # [B, 1, T, S]
  scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)                       # [B, H, T, S]
  if v.shape[2] == 1:
    return jnp.einsum("bhts,bsd->bthd", probs, v[:, :, 0])
  return jnp.einsum("bhts,bshd->bthd", probs, v)
