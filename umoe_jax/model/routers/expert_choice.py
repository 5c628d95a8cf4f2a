"""Expert-choice routing (Zhou et al. 2022, "Mixture-of-Experts with Expert Choice Routing"), as the
AoE paper compares it (`router.selection = "expert_choice"` over any router with a distribution,
AoE's norms included): every expert takes the C tokens of highest probability among all N = B T
tokens of the router call, C = ceil(c N / E) with the capacity factor c
(`router.expert_choice_capacity`, default the sub-layer's top_k: on average top_k experts per
token; the AoE paper's c = 2 of 8 experts is each expert taking 25% of the tokens). Every expert is
exactly full; a token may get no expert, or many.

It sees future tokens. An expert's choice of token t depends on the tokens after t (and on the
other sequences of the batch), so in a causal LM a token's output depends on later tokens: the
training loss leaks information from the future and the model cannot be decoded token by token
(cached decoding is refused). The AoE paper trains it for the comparison only; use it the same way.

A token's picks are laid out in `router.expert_choice_slots` slots (default E: every pick kept),
best first; unused slots have gate 0 and are masked out of the load (`RouterOutput.slot_mask`).
Fewer slots than E cap the picks a token keeps (its best ones): then an expert may end below C.
Cost: the layout is static (S slots per token), but the unused slots get no expert rows
(`ops.dispatch.make_plan` with the slot mask): the grouped-matmul kernels that skip their padding
tail (Triton, Mosaic GPU, megablox) and expert parallelism (no rows sent, no buffer room) pay for the
real picks only; the permutation still spans all N*S rows, so a smaller S (e.g. 2c) bounds that
memory at the price of capped picks.
Only for an MoE FFN (the attention sub-layers assume top_k slots per token).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def capacity(n_tokens: int, n_experts: int, capacity_factor: float) -> int:
  """Tokens per expert: ceil(c N / E), at most N."""
  return max(1, min(n_tokens, math.ceil(capacity_factor * n_tokens / n_experts)))


def expert_choice_select(probs: jax.Array, capacity_factor: float, slots: int,
                         renormalize: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
  """probs [B, T, E] -> (ids [B, T, S], gates [B, T, S], mask [B, T, S] bool): expert e picks the
  `capacity(B T, E, c)` tokens of highest probs[..., e] (ties: the earlier token); each token's
  picks fill its S slots by probability (gates = probs there, renormalised over them if asked;
  unpicked slots: gate 0, masked)."""
  b, t, e = probs.shape
  n = b * t
  flat = probs.reshape(n, e)
  c = capacity(n, e, capacity_factor)
  _, tokens = jax.lax.top_k(flat.T, c)                                             # [E, C]
  picked = jnp.zeros((e, n), jnp.bool_).at[jnp.arange(e)[:, None], tokens].set(True).T   # [N, E]
  top, ids = jax.lax.top_k(jnp.where(picked, flat, -1.0), slots)                   # [N, S]
  mask = top >= 0
  gates = jnp.where(mask, top, 0.0)
  if renormalize:
    gates = gates / jnp.maximum(jnp.sum(gates, axis=-1, keepdims=True), 1e-20)
  shape = (b, t, slots)
  return ids.astype(jnp.int32).reshape(shape), gates.reshape(shape), mask.reshape(shape)
