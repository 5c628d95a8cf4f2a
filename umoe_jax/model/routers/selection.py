"""How a router with a distribution picks experts (`router.selection`), per token:

  "top_k"  the K most probable experts (+ the selection bias of aux-loss-free balancing):
           `umoe_jax.ops.topk.biased_top_k`, which the one-pass router's fallback shares;
  "top_p"  experts in order of probability until their cumulative probability reaches
           `router.top_p` (at least one, at most the sub-layer's top_k slots; Huang et al. 2024,
           "Harder tasks need more experts"; the AoE paper's top-P with P = 0.6). The unused slots
           get gate 0 and are masked out of the load (`RouterOutput.slot_mask`) and out of the
           dispatch (no expert rows, no expert-parallel buffer room). Needs the entropy
           loss (`router.entropy_coef`, the AoE paper's 1e-4), or the scores flatten and every
           token takes all its slots.
Expert choice (each expert picks its tokens) is `expert_choice.expert_choice_select`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from umoe_jax.ops.topk import biased_top_k, top_k_ids  # noqa: F401  (biased_top_k: the routers')


def top_p_select(probs: jax.Array, p: float, max_k: int, renormalize: bool, *,
                 topk_backend: str = "xla") -> tuple[jax.Array, jax.Array, jax.Array]:
  """probs [..., E] -> (ids [..., K], gates [..., K], mask [..., K] bool), K = max_k: slot j of a
  token (its j-th most probable expert) is active iff the probabilities of slots 0..j-1 sum to
  less than p; gates are probs there, 0 elsewhere (renormalised over the active ones if asked)."""
  ids = top_k_ids(probs, max_k, backend=topk_backend)                            # [..., K]
  top = jnp.take_along_axis(probs, ids, axis=-1)
  before = jnp.cumsum(top, axis=-1) - top
  mask = before < p
  mask = mask.at[..., 0].set(True)                        # at least one expert per token
  gates = jnp.where(mask, top, 0.0)
  if renormalize:
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
  return ids, gates, mask


def entropy_loss(probs: jax.Array) -> jax.Array:
  """Mean over tokens of the entropy of probs [..., E] (unscaled; the AoE paper's Ent_conf, Eq. 8)."""
  p = probs.astype(jnp.float32)
  return jnp.mean(-jnp.sum(p * jnp.log(jnp.where(p > 0, p, 1.0)), axis=-1))
