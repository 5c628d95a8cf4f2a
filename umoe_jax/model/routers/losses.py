"""Balance losses on a routing distribution (unscaled; routers apply `router.balance_coef`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _picks(expert_ids: jax.Array, n_experts: int, mask) -> jax.Array:
  """One-hot picks [..., K, E], zero on masked-out slots (mask [..., K] or None)."""
  one_hot = jax.nn.one_hot(expert_ids, n_experts, dtype=jnp.float32)
  return one_hot if mask is None else one_hot * mask[..., None].astype(jnp.float32)


def seq_aux_balance_loss(probs: jax.Array, expert_ids: jax.Array, n_experts: int,
                         mask=None) -> jax.Array:
  """DeepSeek-V2's sequence-wise balance loss (unscaled).

    ce[b, e] = count[b, e] / (picks[b] / E)        picks[b] = T * K (the active slots with a mask)
    loss     = mean_b sum_e ce[b, e] * mean_t probs[b, t, e]

  Args: probs [B, T, E] float32; expert_ids [B, T, K]; mask [B, T, K] (active slots) or None.
  """
  counts = _picks(expert_ids, n_experts, mask).sum(axis=(1, 2))                      # [B, E]
  picks = jnp.sum(counts, axis=-1, keepdims=True)                                      # [B, 1]
  ce = counts / (jnp.maximum(picks, 1.0) / n_experts)
  return jnp.mean(jnp.sum(ce * jnp.mean(probs, axis=1), axis=-1))


def switch_balance_loss(probs: jax.Array, expert_ids: jax.Array, n_experts: int,
                        mask=None) -> jax.Array:
  """Switch Transformer's balance loss over all tokens (unscaled): sum_e (E * f_e) * P_e.

  f_e = fraction of the picks (the N*K slots, or the active ones of `mask`) that went to e;
  P_e = mean routing probability of e.
  """
  e = n_experts
  counts = _picks(expert_ids, e, mask).reshape(-1, e).sum(axis=0)                     # [E]
  f = counts / jnp.maximum(jnp.sum(counts), 1.0)
  p = probs.reshape(-1, e).mean(axis=0)                                                # [E]
  return jnp.sum(e * f * p)


BALANCE_LOSSES = {
    "seq_aux": seq_aux_balance_loss,
    "switch": switch_balance_loss,
    "none": lambda probs, ids, e, mask=None: jnp.zeros((), jnp.float32),
}


def router_z_loss(logits: jax.Array) -> jax.Array:
  """ST-MoE's router z-loss (unscaled): mean over tokens of logsumexp_e(logits)^2; pushes the
  router logits toward small magnitudes. Args: logits [B, T, E] float32."""
  return jnp.mean(jnp.square(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)))
