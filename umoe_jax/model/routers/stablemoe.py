"""StableMoE (Dai et al., ACL 2022): learn routing with the backbone, distil it into a lightweight
token-id router, then freeze routing to that router."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from umoe_jax.config import RouterConfig
from umoe_jax.kinds import ROUTERS
from umoe_jax.model.layers import make_param
from umoe_jax.model.routers.base import Router, RouterOutput, jitter, need_token_ids
from umoe_jax.model.routers.matmul import router_matmul
from umoe_jax.model.routers.scoring import z_loss_terms
from umoe_jax.model.routers.xmoe import orthogonal_init
from umoe_jax.parallel import rules as ax
from umoe_jax.counting import linear


def stablemoe_balance_loss(scores: jax.Array, expert_ids: jax.Array, n_experts: int) -> jax.Array:
  """StableMoE's balance loss (unscaled), over all N tokens and K picks:

    L = (1/N) sum_e (c_e - n) / n * sum_{t picks e} sigmoid(scores[t, e]),    n = N K / E

  with c_e the picks of expert e (constants): overloaded experts' scores are pushed down,
  underloaded ones' up. Args: scores [B, T, E] float32; expert_ids [B, T, K].
  """
  e = n_experts
  picked = jax.nn.one_hot(expert_ids, e, dtype=jnp.float32).sum(axis=-2).reshape(-1, e)  # [N, E]
  n_tok = picked.shape[0]
  mean_load = n_tok * expert_ids.shape[-1] / e
  excess = (picked.sum(axis=0) - mean_load) / mean_load                                   # [E]
  score_sums = jnp.sum(picked * jax.nn.sigmoid(scores.reshape(-1, e)), axis=0)            # [E]
  return jnp.sum(jax.lax.stop_gradient(excess) * score_sums) / n_tok


@ROUTERS.register("stablemoe")
class StableMoERouter(Router):
  """StableMoE (top-k generalisation of the paper's top-1).

    s = x C^T                               affinities, expert centroids C [E, D]
    d = emb[token_id] C_d^T                 the distilled router: token table emb [V, d_w]
                                            (router.stablemoe_distill_dim = d_w), centroids C_d [E, d_w]
    stage 1 (step < router.stablemoe_stage2_step):
      ids  = top-K of s (greedy, no gradient)
      loss = balance_coef * stablemoe_balance_loss(s, ids)
             + stablemoe_distill_coef * mean_t CE(d_t, argmax_e s_t)   (trains emb, C_d only)
    stage 2 (step >= stage2_step, and always without a "step": evaluation, decoding):
      ids  = top-K of d (no gradient: routing is a frozen function of the token id); loss 0
    gates = sigmoid(s at ids) in both stages (C keeps learning through them); probs = softmax of the
    scores the top-K was taken from.

  Deviations: the paper's layer returns g FFN(x) + (1 - g) x; here the block adds x itself, so the
  (1 - g) x term is dropped. Greedy top-K, not the BASE balanced assignment. `router.balance_loss`
  is not used (StableMoE's own loss). "Frozen" means no gradient; AdamW's momentum can still move
  emb / C_d for a few updates after the switch (fairseq skips the parameters entirely).
  Init: C and C_d orthogonal with gain 0.1, emb N(0, 1) (the official code). Needs `token_ids` and,
  for stage 1, `step` in the route context. Jitter perturbs the affinities' input; the z-loss is on s.
  """

  def __init__(self, d_model: int, n_experts: int, top_k: int, cfg: RouterConfig, *, param_dtype,
               rngs: nnx.Rngs):
    if cfg.stablemoe_vocab_size is None:
      raise ValueError("router.kind='stablemoe' needs router.stablemoe_vocab_size (model_config() "
                       "sets it to model.vocab_size)")
    super().__init__(d_model, n_experts, top_k, cfg, param_dtype=param_dtype, rngs=rngs)
    d_w = cfg.stablemoe_distill_dim
    self.centroids = make_param(rngs, orthogonal_init(0.1), (n_experts, d_model),
                                (ax.ROUTER_OUT, ax.EMBED), param_dtype)
    self.token_embed = make_param(rngs, lambda key, shape, dtype: jax.random.normal(key, shape, dtype),
                                  (cfg.stablemoe_vocab_size, d_w), (ax.VOCAB, ax.LORA), param_dtype)
    self.distill_centroids = make_param(rngs, orthogonal_init(0.1), (n_experts, d_w),
                                        (ax.ROUTER_OUT, ax.LORA), param_dtype)

  def affinities(self, x: jax.Array) -> jax.Array:
    """x [B, T, D] -> s [B, T, E] float32."""
    return router_matmul(x, self.centroids.value.T, self.cfg.logits_dtype)

  def distilled(self, token_ids: jax.Array) -> jax.Array:
    """token ids [B, T] -> the distilled router's scores d [B, T, E] float32."""
    emb = jnp.take(self.token_embed.value, token_ids, axis=0).astype(jnp.float32)      # [B, T, d_w]
    return jnp.dot(emb, self.distill_centroids.value.astype(jnp.float32).T)

  def __call__(self, x: jax.Array, *, token_ids: Optional[jax.Array] = None,
               step: Optional[jax.Array] = None, rng: Optional[jax.Array] = None,
               **context) -> RouterOutput:
    del context
    token_ids = need_token_ids("stablemoe", token_ids, x)
    s = self.affinities(jitter(x, self.cfg.jitter_eps, rng))                           # [B, T, E]
    d = self.distilled(token_ids)
    stage1 = (jnp.asarray(False) if step is None
              else jnp.asarray(step) < self.cfg.stablemoe_stage2_step)
    route_scores = jax.lax.stop_gradient(jnp.where(stage1, s, d))
    _, ids = jax.lax.top_k(route_scores, self.top_k)                                   # [B, T, K]
    ids = ids.astype(jnp.int32)
    gates = jax.nn.sigmoid(jnp.take_along_axis(s, ids, axis=-1))
    target = jnp.argmax(jax.lax.stop_gradient(s), axis=-1)                              # [B, T]
    distill = jnp.mean(jax.nn.logsumexp(d, axis=-1)
                       - jnp.take_along_axis(d, target[..., None], axis=-1)[..., 0])
    loss = (self.cfg.balance_coef * stablemoe_balance_loss(s, ids, self.n_experts)
            + self.cfg.stablemoe_distill_coef * distill)
    return RouterOutput(expert_ids=ids, gates=gates, probs=jax.nn.softmax(route_scores, axis=-1),
                        balance_loss=jnp.where(stage1, loss, 0.0), aux_losses=z_loss_terms(s, self.cfg))

  @classmethod
  def param_count(cls, cfg, router, n_experts):
    """E x D centroids, the V x d_w token table and the E x d_w distilled centroids."""
    vocab = router.stablemoe_vocab_size or cfg.vocab_size
    return (linear(n_experts, cfg.d_model) + linear(vocab, router.stablemoe_distill_dim)
            + linear(n_experts, router.stablemoe_distill_dim))

  @classmethod
  def token_mac_count(cls, cfg, router, n_experts):
    """The affinities and the distilled scores (the table lookup is free)."""
    return linear(cfg.d_model, n_experts) + linear(router.stablemoe_distill_dim, n_experts)
