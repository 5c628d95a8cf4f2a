"""The shared path of the routers that score every expert from the router input.

    x'      = jitter(x)                        training only (`router.jitter_eps`, route context "rng")
    logits  = self.logits(x', **context)       [B, T, E] float32, per family
    probs   = self.distribution(logits)        [B, T, E], softmax unless the family says otherwise
    probs   = mix(probs, x')                   `router.mixing` over earlier tokens (mutual_inform)
    ids, gates = self.select(probs, ...)       `router.selection`: top-k of probs (+ the selection
                                               bias), top-P, or expert choice; gates = probs there
                                               (renormalised if `router.renormalize`)
    balance_loss = balance_coef * BALANCE_LOSSES[balance_loss](self.balance_probs(...), ids)
    aux_losses["z_loss"] = z_loss_coef * router_z_loss(logits)       when z_loss_coef > 0
    aux_losses["entropy_loss"] = entropy_coef * mean_t H(probs)      when entropy_coef > 0 (AoE top-P)

Aux-loss-free balancing (DeepSeek-V3, `router.bias_update_rate` > 0): a per-expert bias b [E],
added to the scores for the selection only (the gates stay the unbiased probabilities), a parameter
without gradient (tagged `norm`: replicated, never weight-decayed, so AdamW leaves it as it is) that
the training step moves after each update (`bias_balance.update_selection_biases`). Being a
parameter, it is part of the train state and of every checkpoint.
"""
from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from umoe_jax.config import RouterConfig, router_mixing
from umoe_jax.model.routers.base import Router, RouterOutput, jitter
from umoe_jax.model.routers.expert_choice import expert_choice_select
from umoe_jax.model.routers.losses import BALANCE_LOSSES, router_z_loss, sequence_pick_counts
from umoe_jax.model.routers.mutual_inform import mix_distribution
from umoe_jax.model.routers.selection import biased_top_k, entropy_loss, top_p_select
from umoe_jax.parallel import rules as ax


def selection_bias_param(n_experts: int) -> nnx.Param:
  """The aux-loss-free balancing bias b [E], zeros, float32 (its updates are ~1e-3 steps)."""
  return nnx.Param(jnp.zeros((n_experts,), jnp.float32), out_sharding=(ax.NORM,),
                   eager_sharding=False)


class ScoreRouter(Router):
  """Base of the routers with scores (module docstring). Subclasses set up their weights after
  `super().__init__` and define `logits`; they may override `distribution`, `mix`,
  `balance_probs` and `select`."""

  balance_loss_applies = True   # False: no balance loss whatever `router.balance_loss` says

  def __init__(self, d_model: int, n_experts: int, top_k: int, cfg: RouterConfig, *, param_dtype,
               rngs: nnx.Rngs):
    super().__init__(d_model, n_experts, top_k, cfg, param_dtype=param_dtype, rngs=rngs)
    self.selection_bias = selection_bias_param(n_experts) if cfg.bias_update_rate > 0 else None

  def logits(self, x: jax.Array, **context) -> jax.Array:
    """x [B, T, D] -> float32 scores [B, T, E]."""
    raise NotImplementedError

  def distribution(self, logits: jax.Array) -> jax.Array:
    return jax.nn.softmax(logits, axis=-1)

  def balance_probs(self, probs: jax.Array, x: jax.Array) -> jax.Array:
    """The distribution the balance loss sees, from the routed probs and the router input x (X-MoE:
    its scores at the fixed temperature)."""
    del x
    return probs

  def bias(self) -> Optional[jax.Array]:
    """The selection bias [E] (no gradient), or None."""
    if self.selection_bias is None:
      return None
    return jax.lax.stop_gradient(self.selection_bias.value.astype(jnp.float32))

  def select(self, probs: jax.Array, *, decoding: bool = False, **context):
    """probs [B, T, E] -> (expert ids [B, T, K] int32, gates [B, T, K] float32, active-slot mask
    [B, T, K] bool or None = all) by `router.selection`: "top_k" of probs + bias (gates = probs at
    the picks, renormalised over them if `router.renormalize`), "top_p" within the sub-layer's
    top_k slots (`selection.top_p_select`), "expert_choice" (`expert_choice.expert_choice_select`,
    K = `router.expert_choice_slots` or E)."""
    del context
    cfg = self.cfg
    if cfg.selection == "top_p":
      return top_p_select(probs, cfg.top_p, self.top_k, cfg.renormalize,
                          topk_backend=cfg.topk_backend)
    if cfg.selection == "expert_choice":
      if decoding:
        raise NotImplementedError("router.selection='expert_choice' picks among all tokens of the "
                                  "batch, later ones included: cached decoding is not supported")
      return expert_choice_select(probs, cfg.expert_choice_capacity or self.top_k,
                                  cfg.expert_choice_slots or self.n_experts, cfg.renormalize)
    return (*biased_top_k(probs, self.top_k, cfg.renormalize, self.bias(),
                          topk_backend=cfg.topk_backend), None)

  def mix(self, probs: jax.Array, x: jax.Array, *, decoding: bool = False,
          attention_probs: Optional[jax.Array] = None, **context) -> jax.Array:
    """The distribution each token routes by, from every token's own probs [B, T, E] and the
    router input x [B, T, D]: probs itself unless the router mixes over earlier tokens
    (`router.mixing`, `mutual_inform.mix_distribution`)."""
    del context
    mixing = router_mixing(self.cfg)
    if mixing == "none":
      return probs
    if decoding:
      raise NotImplementedError(
          f"router.kind={self.cfg.kind!r} with mixing {mixing!r} mixes the routing of earlier "
          "tokens, which the KV cache does not keep: cached decoding is not supported (run full "
          "forward passes instead)")
    return mix_distribution(mixing, probs, x, self.cfg, attention_probs=attention_probs)

  def __call__(self, x: jax.Array, *, rng: Optional[jax.Array] = None, **context) -> RouterOutput:
    x = jitter(x, self.cfg.jitter_eps, rng)
    logits = self.logits(x, **context)                                                # [B, T, E]
    probs = self.mix(self.distribution(logits), x, **context)
    ids, gates, mask = self.select(probs, **context)
    return self.output(logits, probs, ids, gates, balance_probs=self.balance_probs(probs, x),
                       mask=mask)

  def output(self, logits, probs, ids, gates, *, balance_probs, mask=None) -> RouterOutput:
    """The RouterOutput with the balance loss on `balance_probs` (over the active slots `mask`),
    the z-loss of `logits` and the entropy loss of `probs`."""
    cfg = self.cfg
    # The picks per sequence, once: the balance loss and the logged loads (`pick_counts`) share them.
    counts = None
    if ids.ndim == 3:
      counts = jax.lax.stop_gradient(sequence_pick_counts(ids, self.n_experts, mask))  # [B, E]
    if self.balance_loss_applies:
      loss = cfg.balance_coef * BALANCE_LOSSES[cfg.balance_loss](
          balance_probs, jax.lax.stop_gradient(ids), self.n_experts, mask=mask, counts=counts)
    else:
      loss = jnp.zeros((), jnp.float32)
    aux = z_loss_terms(logits, cfg)
    if cfg.entropy_coef:
      aux["entropy_loss"] = cfg.entropy_coef * entropy_loss(probs)
    return RouterOutput(expert_ids=ids, gates=gates, probs=probs, balance_loss=loss,
                        aux_losses=aux, slot_mask=mask, sequence_counts=counts)


def z_loss_terms(logits: jax.Array, cfg: RouterConfig) -> dict[str, Any]:
  """{"z_loss": z_loss_coef * router_z_loss(logits)} when the coefficient is set, else {}."""
  if cfg.z_loss_coef == 0:
    return {}
  return {"z_loss": cfg.z_loss_coef * router_z_loss(logits)}
