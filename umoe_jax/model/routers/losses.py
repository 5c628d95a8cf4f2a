"""Balance losses on a routing distribution (unscaled; routers apply `router.balance_coef`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def seq_aux_balance_loss(probs: jax.Array, expert_ids: jax.Array, n_experts: int) -> jax.Array:
  """DeepSeek-V2's sequence-wise balance loss (unscaled).

    ce[b, e] = count[b, e] / (T * K / E)
    loss     = mean_b sum_e ce[b, e] * mean_t probs[b, t, e]

  Args: probs [B, T, E] float32; expert_ids [B, T, K].
  """
  _, t, k = expert_ids.shape
  counts = jax.nn.one_hot(expert_ids, n_experts, dtype=jnp.float32).sum(axis=(1, 2))   # [B, E]
  ce = counts / (t * k / n_experts)
  return jnp.mean(jnp.sum(ce * jnp.mean(probs, axis=1), axis=-1))


def switch_balance_loss(probs: jax.Array, expert_ids: jax.Array, n_experts: int) -> jax.Array:
  """Switch Transformer's balance loss over all tokens (unscaled): sum_e (E * f_e) * P_e.

  f_e = fraction of the N*K picks that went to e; P_e = mean routing probability of e.
  """
  e = n_experts
  f = jax.nn.one_hot(expert_ids.reshape(-1), e, dtype=jnp.float32).mean(axis=0)      # [E]
  p = probs.reshape(-1, e).mean(axis=0)                                                # [E]
  return jnp.sum(e * f * p)


BALANCE_LOSSES = {
    "seq_aux": seq_aux_balance_loss,
    "switch": switch_balance_loss,
    "none": lambda probs, ids, e: jnp.zeros((), jnp.float32),
}


def router_z_loss(logits: jax.Array) -> jax.Array:
  """ST-MoE's router z-loss (unscaled): mean over tokens of logsumexp_e(logits)^2; pushes the
  router logits toward small magnitudes. Args: logits [B, T, E] float32."""
  return jnp.mean(jnp.square(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)))
