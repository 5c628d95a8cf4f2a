"""Balance losses on a routing distribution (unscaled; routers apply `router.balance_coef`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _picks(expert_ids: jax.Array, n_experts: int, mask) -> jax.Array:
  """One-hot picks [..., K, E], zero on masked-out slots (mask [..., K] or None)."""
  one_hot = jax.nn.one_hot(expert_ids, n_experts, dtype=jnp.float32)
  return one_hot if mask is None else one_hot * mask[..., None].astype(jnp.float32)


def sequence_pick_counts(expert_ids: jax.Array, n_experts: int, mask=None) -> jax.Array:
  """Picks per sequence and expert [B, E] float32 of expert_ids [B, T, K] (slots in mask [B, T, K]
  only). A one-hot reduction, not a bincount: a scatter-add into E bins serialises on GPU atomics
  (0.065 ms a router at 32 x 1024 x 15 on an H200), and the routing statistics
  (`routers.pick_counts`) use the very same expression as the sequence-wise balance loss, so XLA
  computes it once for both."""
  return _picks(expert_ids, n_experts, mask).sum(axis=(1, 2))


def seq_aux_balance_loss(probs: jax.Array, expert_ids: jax.Array, n_experts: int,
                         mask=None, counts=None) -> jax.Array:
  """DeepSeek-V2's sequence-wise balance loss (unscaled).

    ce[b, e] = count[b, e] / (picks[b] / E)        picks[b] = T * K (the active slots with a mask)
    loss     = mean_b sum_e ce[b, e] * mean_t probs[b, t, e]

  Args: probs [B, T, E] float32; expert_ids [B, T, K]; mask [B, T, K] (active slots) or None;
    counts: `sequence_pick_counts(expert_ids, n_experts, mask)` [B, E] if the caller has them.
  """
  if counts is None:
    counts = sequence_pick_counts(expert_ids, n_experts, mask)                         # [B, E]
  picks = jnp.sum(counts, axis=-1, keepdims=True)                                      # [B, 1]
  ce = counts / (jnp.maximum(picks, 1.0) / n_experts)
  return jnp.mean(jnp.sum(ce * jnp.mean(probs, axis=1), axis=-1))


def switch_balance_loss(probs: jax.Array, expert_ids: jax.Array, n_experts: int,
                        mask=None, counts=None) -> jax.Array:
  """Switch Transformer's balance loss over all tokens (unscaled): sum_e (E * f_e) * P_e.

  f_e = fraction of the picks (the N*K slots, or the active ones of `mask`) that went to e;
  P_e = mean routing probability of e.
  """
  e = n_experts
  counts = (_picks(expert_ids, e, mask).reshape(-1, e).sum(axis=0) if counts is None
            else counts.sum(axis=0))                                                   # [E]
  f = counts / jnp.maximum(jnp.sum(counts), 1.0)
  p = probs.reshape(-1, e).mean(axis=0)                                                # [E]
  return jnp.sum(e * f * p)


BALANCE_LOSSES = {
    "seq_aux": seq_aux_balance_loss,
    "switch": switch_balance_loss,
    "none": lambda probs, ids, e, mask=None, counts=None: jnp.zeros((), jnp.float32),
}


def router_z_loss(logits: jax.Array) -> jax.Array:
  """ST-MoE's router z-loss (unscaled): mean over tokens of logsumexp_e(logits)^2; pushes the
  router logits toward small magnitudes. Args: logits [B, T, E] float32."""
  return jnp.mean(jnp.square(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)))
