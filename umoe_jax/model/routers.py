"""Routers: pick K of E experts per token and give each pick a gate weight.

The contract every router keeps (the dispatch code relies on nothing else):
  __call__(x [B, T, D], **context) -> RouterOutput
with `expert_ids [B, T, K]`, `gates [B, T, K]`, the full routing distribution `probs [B, T, E]` and a
scalar `balance_loss` (already multiplied by its coefficient). `context` carries optional extras a
router may use (token ids for hash routing, attention probabilities for attention-informed routing);
routers ignore what they do not need.

A new router is one class registered in `ROUTERS`; `model.router.kind` selects it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from umoe_jax.config import RouterConfig
from umoe_jax.model.layers import kaiming_uniform_init, make_param
from umoe_jax.parallel import rules as ax
from umoe_jax.registry import Registry


@struct.dataclass
class RouterOutput:
  expert_ids: jax.Array      # [B, T, K] int32
  gates: jax.Array           # [B, T, K] float32
  probs: jax.Array           # [B, T, E] float32, the distribution the top-k was taken from
  balance_loss: jax.Array    # [] float32, coefficient applied


ROUTERS: Registry[type] = Registry("router")


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


def topk_gates(probs: jax.Array, k: int, renormalize: bool) -> tuple[jax.Array, jax.Array]:
  """Top-k of probs [..., E] -> (gates [..., K] float32, expert_ids [..., K] int32)."""
  gates, ids = jax.lax.top_k(probs, k)
  if renormalize:
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
  return gates, ids.astype(jnp.int32)


@ROUTERS.register("topk_softmax")
class TopKSoftmaxRouter(nnx.Module):
  """softmax(x W_r) over all experts in float32, top-k (the official UMoE / DeepSeekMoE router).

  W_r [D, E] is initialised like PyTorch's kaiming_uniform_(a=sqrt(5)); no bias.
  """

  def __init__(self, d_model: int, n_experts: int, top_k: int, cfg: RouterConfig, *, param_dtype,
               rngs: nnx.Rngs):
    self.n_experts = n_experts
    self.top_k = top_k
    self.cfg = cfg
    self.kernel = make_param(rngs, kaiming_uniform_init(d_model), (d_model, n_experts),
                             (ax.EMBED, ax.ROUTER_OUT), param_dtype)

  def logits(self, x: jax.Array) -> jax.Array:
    """x [B, T, D] -> float32 logits [B, T, E]."""
    return jnp.dot(x.astype(jnp.float32), self.kernel.value.astype(jnp.float32))

  def __call__(self, x: jax.Array, **context) -> RouterOutput:
    del context
    probs = jax.nn.softmax(self.logits(x), axis=-1)                                    # [B, T, E]
    gates, ids = topk_gates(probs, self.top_k, self.cfg.renormalize)                   # [B, T, K]
    loss = BALANCE_LOSSES[self.cfg.balance_loss](probs, jax.lax.stop_gradient(ids), self.n_experts)
    return RouterOutput(expert_ids=ids, gates=gates, probs=probs,
                        balance_loss=self.cfg.balance_coef * loss)


@ROUTERS.register("topk_sigmoid")
class TopKSigmoidRouter(TopKSoftmaxRouter):
  """Non-competitive gates (SwitchHead, Csordás et al. 2024): s = sigmoid(x W_r), top-k of s, gates = s.

  `probs` (for the balance loss and the logged entropy) is s normalised to sum to 1; the original
  SwitchHead trains without a balance loss (`router.balance_loss="none"`).
  """

  def __call__(self, x: jax.Array, **context) -> RouterOutput:
    del context
    scores = jax.nn.sigmoid(self.logits(x))                                            # [B, T, E]
    gates, ids = topk_gates(scores, self.top_k, self.cfg.renormalize)                  # [B, T, K]
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    loss = BALANCE_LOSSES[self.cfg.balance_loss](probs, jax.lax.stop_gradient(ids), self.n_experts)
    return RouterOutput(expert_ids=ids, gates=gates, probs=probs,
                        balance_loss=self.cfg.balance_coef * loss)


def make_router(cfg: RouterConfig, d_model: int, n_experts: int, top_k: int, *, param_dtype,
                rngs: nnx.Rngs) -> nnx.Module:
  return ROUTERS.get(cfg.kind)(d_model, n_experts, top_k, cfg, param_dtype=param_dtype, rngs=rngs)


def routing_stats(out: RouterOutput, n_experts: int) -> dict[str, jax.Array]:
  """What the trainer logs for one router: its loss, per-expert pick counts [E], mean entropy."""
  counts = jnp.bincount(out.expert_ids.reshape(-1), length=n_experts).astype(jnp.float32)
  entropy = -jnp.sum(out.probs * jnp.log(out.probs + 1e-20), axis=-1).mean()
  return {"balance_loss": out.balance_loss, "expert_counts": counts, "entropy": entropy}
