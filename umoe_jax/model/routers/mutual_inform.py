"""Similarity- and attention-aware routing (Nguyen et al., "Improving Routing in Sparse Mixture of
Experts with Graph of Tokens", arXiv 2505.00792; ICLR 2025 submission "Mutual-Inform SMoE"): a
token's routing distribution is the mixture of the distributions G of the tokens it is linked to,
P = S G, then the selection acts on P. Causal here: S only links a token to itself and earlier
tokens (mixing later ones would leak the future into next-token prediction).

Any router with a distribution mixes (`router.mixing = "similarity" | "attention"`; the seed's
"Similarity-inform X-MoE", "Attention-inform SMoE-Dropout", ... are `router.kind=xmoe,
router.mixing=similarity` and so on): `ScoreRouter.mix` calls `mix_distribution` below. The kinds
"similarity_aware" / "attention_aware" are shorthands of `topk_softmax` with that mixing (their
classes are in `topk`: this module holds only the mixing, so the scoring base class can use it).
Row i of S needs every token j <= i of the sequence in one call: cached decoding (one new token per
call) is refused, because the cache keeps no routing inputs of earlier tokens.
"""
from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp

from umoe_jax.config import RouterConfig


def causal_softmax(scores: jax.Array) -> jax.Array:
  """Row softmax of scores [..., T, T] over the columns j <= i (float32)."""
  t = scores.shape[-1]
  causal = jnp.tril(jnp.ones((t, t), jnp.bool_))
  return jax.nn.softmax(jnp.where(causal, scores.astype(jnp.float32), -jnp.inf), axis=-1)


def similarity_mix(g: jax.Array, x: jax.Array, temperature: float) -> jax.Array:
  """Similarity-aware: S = causal softmax_j(u_i . u_j / tau) over the router inputs u = x (the
  rebuttal's S = softmax(U U^T / tau); no learned W_s), P = S G. g [B, T, E], x [B, T, D].

  tau = `router.similarity_temperature`, default sqrt(D) (dot-product attention's scale; the
  authors report tau in {0.1, 1, 2, sqrt(D)} to matter little). O(T^2 (D + E)) per router.
  """
  u = x.astype(jnp.float32)
  s = causal_softmax(jnp.einsum("btd,bsd->bts", u, u) / temperature)                  # [B, T, T]
  return jnp.einsum("bts,bse->bte", s, g)


def attention_mix(g: jax.Array, attention_probs: Optional[jax.Array], sigma: float) -> jax.Array:
  """Attention-aware: P = A' G with A the causal attention probabilities of the block's own
  attention (route context "attention_probs" [B, H, T, T], added by the block for the FFN router).

  Row t uses the head h*(t) of lowest mean row entropy over rows 0..t (the paper picks the head of
  least entropy; averaging only over the rows so far keeps routing causal; chosen without
  gradient); A' = A_{h*}^(1/sigma), rows renormalised, sigma = `router.attention_temperature`
  (1: the probabilities themselves; sigma -> 0: each token follows its most attended token). The
  paper's Gaussian "posterior" attention is not public; this keeps its sigma -> 0 limit.
  Only behind attention that exposes its probabilities (`model.attention.kind='mha'`) and only for
  an MoE FFN: attention variants with their own routers route before their attention runs.
  """
  if attention_probs is None:
    raise ValueError("router.mixing='attention' needs attention_probs=[B, H, T, T] in the "
                     "route context (the block adds its MHA's probabilities for the FFN router)")
  a = attention_probs.astype(jnp.float32)                                             # [B, H, T, S]
  if a.shape[-1] != a.shape[-2]:
    raise ValueError(f"attention_probs {a.shape}: expected [B, H, T, T] (a full causal pass)")
  log_a = jnp.log(jnp.where(a > 0, a, 1.0))               # 0 where a == 0: finite gradients
  # The head of least mean row entropy, chosen for row t from rows 0..t only: a choice over the
  # whole sequence would let later tokens change how earlier ones route.
  row_entropy = -jnp.sum(a * log_a, axis=-1)                                            # [B, H, T]
  t = row_entropy.shape[-1]
  running = jnp.cumsum(row_entropy, axis=-1) / jnp.arange(1, t + 1, dtype=jnp.float32)
  head = jnp.argmin(jax.lax.stop_gradient(running), axis=1)                             # [B, T]
  pick = lambda arr: jnp.take_along_axis(arr, head[:, None, :, None], axis=1)[:, 0]     # [B, T, S]
  a = pick(a)
  if sigma != 1.0:  # A^(1/sigma) renormalised = a softmax of log A / sigma over the visible keys
    a = jax.nn.softmax(jnp.where(a > 0, pick(log_a) / sigma, -jnp.inf), axis=-1)
  return jnp.einsum("bts,bse->bte", a, g)


def mix_distribution(mixing: str, g: jax.Array, x: jax.Array, cfg: RouterConfig, *,
                     attention_probs: Optional[jax.Array] = None) -> jax.Array:
  """`router.mixing` of the distributions g [B, T, E] (row-stochastic) given the router input x."""
  if mixing == "similarity":
    return similarity_mix(g, x, cfg.similarity_temperature or math.sqrt(x.shape[-1]))
  if mixing == "attention":
    return attention_mix(g, attention_probs, cfg.attention_temperature)
  raise ValueError(f"router.mixing={mixing!r}; valid: similarity, attention")


def pair_macs(mixing: str, d_model: int, n_experts: int) -> int:
  """Forward MACs of the mixing per (token, earlier token) pair: u_i . u_j (D) and the mix of G
  (E) for "similarity", the mix for "attention" (the probabilities are the attention's), 0 else."""
  return {"similarity": d_model + n_experts, "attention": n_experts}.get(mixing, 0)
