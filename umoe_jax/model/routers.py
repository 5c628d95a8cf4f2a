"""Routers: pick K of E experts per token and give each pick a gate weight.

The contract every router keeps (the dispatch code relies on nothing else):
  __call__(x [B, T, D], **context) -> RouterOutput
with `expert_ids [B, T, K]`, `gates [B, T, K]`, the full routing distribution `probs [B, T, E]` and a
scalar `balance_loss` (already multiplied by its coefficient). `context` carries optional extras a
router may use (token ids for hash routing, attention probabilities for attention-informed routing);
routers ignore what they do not need.

The route context: `CausalLM` builds one dict (`route_context`) and hands it through every block to
every sub-layer, which calls `self.router(x, **route_context)`:
  "token_ids"        [B, T] int32, always (during cached decoding: the ids of the new tokens);
  "step"             [] int32, the training step, when the caller passes `CausalLM(..., step=)`
                     (schedules of smoe_dropout and stablemoe; absent = as at the end of training);
  "decoding"         True during cached decoding (the mixing routers refuse it);
  "attention_probs"  [B, H, T, S] float32, added by the block to its FFN router's context when the
                     router class sets `needs_attention_probs` (attention_aware).
A router that needs another extra adds a key there; no call site changes.

A new router is one class registered in `ROUTERS`; `model.router.kind` selects it. Its constructor is
`(d_model, n_experts, top_k, cfg: RouterConfig, *, param_dtype, rngs)`; an optional classmethod
`validate(model_cfg)` raises `ConfigError` for combinations the router cannot serve.

Routers here:
  "topk_softmax", "topk_sigmoid"   softmax / sigmoid of x W_r, top-k
  "xmoe"              X-MoE cosine routing in a low-dimensional space (Chi et al. 2022)
  "hash"              fixed token-id hashing (Roller et al. 2021)
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional

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


def route_context(token_ids: jax.Array, *, step: Optional[jax.Array] = None,
                  decoding: bool = False) -> dict[str, Any]:
  """The extras every router call receives.

    "token_ids": [B, T] int32, always;
    "step":      [] int32, the training step, only when the caller passes one (routers with a
                 schedule: smoe_dropout, stablemoe; without it they act as at the end of training);
    "decoding":  True, only while decoding with a KV cache (routers that mix over earlier tokens
                 refuse: the cache does not keep their routing inputs).
  """
  context: dict[str, Any] = {"token_ids": token_ids}
  if step is not None:
    context["step"] = jnp.asarray(step, jnp.int32)
  if decoding:
    context["decoding"] = True
  return context


def call_router(router: nnx.Module, x: jax.Array,
                context: Optional[Mapping[str, Any]] = None) -> "RouterOutput":
  """router(x [B, T, D], **context): the one way sub-layers call their routers."""
  return router(x, **(context or {}))


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


def probs_route(probs: jax.Array, k: int, cfg: RouterConfig, n_experts: int) -> "RouterOutput":
  """Top-k of a routing distribution probs [B, T, E] with `router.renormalize` and the configured
  balance loss on probs (the counts are constants): the tail of every softmax-style router."""
  gates, ids = topk_gates(probs, k, cfg.renormalize)                                 # [B, T, K]
  loss = BALANCE_LOSSES[cfg.balance_loss](probs, jax.lax.stop_gradient(ids), n_experts)
  return RouterOutput(expert_ids=ids, gates=gates, probs=probs, balance_loss=cfg.balance_coef * loss)


def _need_token_ids(kind: str, token_ids: Optional[jax.Array], x: jax.Array) -> jax.Array:
  """The route context's token ids [B, T], checked against the router input x [B, T, D]."""
  if token_ids is None:
    raise ValueError(f"router.kind={kind!r} routes by token id: call the router with token_ids=[B, T] "
                     "(CausalLM passes route_context={'token_ids': tokens} to every sub-layer)")
  if token_ids.shape != x.shape[:-1]:
    raise ValueError(f"token_ids {token_ids.shape} must match the router input's [B, T] "
                     f"{x.shape[:-1]}")
  return token_ids


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
    return probs_route(probs, self.top_k, self.cfg, self.n_experts)


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


def l2_normalize(x: jax.Array, eps: float = 1e-12) -> jax.Array:
  """x / max(||x||_2, eps) over the last axis (PyTorch's F.normalize)."""
  norm = jnp.sqrt(jnp.sum(jnp.square(x), axis=-1, keepdims=True))
  return x / jnp.maximum(norm, eps)


def _orthogonal_init(scale: float):
  init = jax.nn.initializers.orthogonal(scale=scale)
  return lambda key, shape, dtype: init(key, shape, dtype)


@ROUTERS.register("xmoe")
class XMoERouter(nnx.Module):
  """X-MoE (Chi et al. 2022, Eqs. 6-8): cosine routing in a low-dimensional space.

    z = x W_proj                         W_proj [D, d_r] (router.xmoe_dim = d_r, default 16)
    s_e = <z / |z|, e_e / |e_e|>         expert embeddings [E, d_r], learned; s in [-1, 1]
    probs = softmax(s / tau)  (float32), top-k of probs (renormalised if router.renormalize)

  tau: learned (the paper; `router.xmoe_learn_temperature`, stored as log tau, initialised to
  `router.xmoe_temperature`) or fixed at `router.xmoe_temperature` (torchscale / LibMoE: 0.3). The
  balance loss always uses softmax(s / tau_0) with the fixed tau_0 = `router.xmoe_temperature`
  (paper Eq. 8). Unlike torchscale, both z and e are normalised (the paper's cosine).
  Init: W_proj like PyTorch's Linear (kaiming_uniform, a=sqrt(5)); embeddings orthogonal, gain 0.32
  (torchscale).
  """

  def __init__(self, d_model: int, n_experts: int, top_k: int, cfg: RouterConfig, *, param_dtype,
               rngs: nnx.Rngs):
    self.n_experts = n_experts
    self.top_k = top_k
    self.cfg = cfg
    d_r = cfg.xmoe_dim
    # d_r is small and replicated like the low-rank codes (logical axis LORA).
    self.proj = make_param(rngs, kaiming_uniform_init(d_model), (d_model, d_r), (ax.EMBED, ax.LORA),
                           param_dtype)
    self.expert_embed = make_param(rngs, _orthogonal_init(0.32), (n_experts, d_r),
                                   (ax.ROUTER_OUT, ax.LORA), param_dtype)
    if cfg.xmoe_learn_temperature:
      log_t0 = math.log(cfg.xmoe_temperature)
      # [1] tagged NORM: replicated and, like the norm scales, never weight-decayed.
      self.log_temperature = make_param(rngs, lambda key, shape, dtype: jnp.full(shape, log_t0, dtype),
                                        (1,), (ax.NORM,), param_dtype)
    else:
      self.log_temperature = None

  def scores(self, x: jax.Array) -> jax.Array:
    """x [B, T, D] -> float32 cosine scores [B, T, E] in [-1, 1]."""
    z = jnp.dot(x.astype(jnp.float32), self.proj.value.astype(jnp.float32))          # [B, T, d_r]
    e = l2_normalize(self.expert_embed.value.astype(jnp.float32))                    # [E, d_r]
    return jnp.dot(l2_normalize(z), e.T)

  def temperature(self) -> jax.Array:
    """The gating temperature tau [] float32."""
    if self.log_temperature is None:
      return jnp.float32(self.cfg.xmoe_temperature)
    return jnp.exp(self.log_temperature.value.astype(jnp.float32)[0])

  def __call__(self, x: jax.Array, **context) -> RouterOutput:
    del context
    s = self.scores(x)                                                                 # [B, T, E]
    probs = jax.nn.softmax(s / self.temperature(), axis=-1)
    gates, ids = topk_gates(probs, self.top_k, self.cfg.renormalize)                   # [B, T, K]
    balance_probs = (jax.nn.softmax(s / self.cfg.xmoe_temperature, axis=-1)
                     if self.log_temperature is not None else probs)
    loss = BALANCE_LOSSES[self.cfg.balance_loss](balance_probs, jax.lax.stop_gradient(ids),
                                                 self.n_experts)
    return RouterOutput(expert_ids=ids, gates=gates, probs=probs,
                        balance_loss=self.cfg.balance_coef * loss)


# Hash routing. A fixed pseudo-random permutation of the experts per token id; the first K are the
# token's experts. Integer arithmetic of our own (murmur3's 32-bit finaliser), so the map never
# changes with the JAX version or the PRNG implementation, and needs no stored table.

_GOLDEN = 0x9E3779B1
_EXPERT_MUL, _EXPERT_ADD = 0x27D4EB2F, 0x165667B1


def _fmix32(h: jax.Array) -> jax.Array:
  """murmur3's finaliser on uint32 (a bijection of uint32 with full avalanche)."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def hash_expert_ids(token_ids: jax.Array, n_experts: int, k: int, seed: int) -> jax.Array:
  """token ids [...] -> K distinct expert ids [..., K] int32, a fixed function of (id, seed).

    base    = fmix32(id * 0x9E3779B1 + fmix32(seed))                          (uint32 arithmetic)
    score_e = fmix32(base XOR (e * 0x27D4EB2F + 0x165667B1)) >> 1              e = 0 .. E-1
    ids     = top-k of score (K distinct experts; their order is part of the map)

  The K experts of a token are the first K of one pseudo-random ordering of all experts, so routers
  with different K (attention, FFN) give nested sets for the same token.
  """
  seed_mix = _fmix32(jnp.asarray(seed, jnp.uint32))
  base = _fmix32(token_ids.astype(jnp.uint32) * jnp.uint32(_GOLDEN) + seed_mix)      # [...]
  experts = jnp.arange(n_experts, dtype=jnp.uint32) * jnp.uint32(_EXPERT_MUL) + jnp.uint32(_EXPERT_ADD)
  scores = _fmix32(base[..., None] ^ experts)                                         # [..., E]
  _, ids = jax.lax.top_k((scores >> 1).astype(jnp.int32), k)
  return ids.astype(jnp.int32)


@ROUTERS.register("hash")
class HashRouter(nnx.Module):
  """Hash layers (Roller et al. 2021): each token id always goes to the same K distinct experts.

  No learned parameters and no state: the map is `hash_expert_ids(token_ids, E, K,
  router.hash_seed)` (default seed 42, as ParlAI's). Gates are 1/K each (the paper: top-1, weight 1);
  `probs` [B, T, E] is the one-hot mixture (1/K on each picked expert); the balance loss is 0 (nothing
  to balance by gradient). Needs `token_ids` [B, T] in the route context (`CausalLM` passes them).
  """

  def __init__(self, d_model: int, n_experts: int, top_k: int, cfg: RouterConfig, *, param_dtype,
               rngs: nnx.Rngs):
    del d_model, param_dtype, rngs
    self.n_experts = n_experts
    self.top_k = top_k
    self.cfg = cfg

  @classmethod
  def validate(cls, model_cfg) -> None:
    from umoe_jax.config import ConfigError
    if model_cfg.router.share_att_ffn:
      raise ConfigError(f"model.router.share_att_ffn={model_cfg.router.share_att_ffn!r} with "
                        f"model.router.kind='hash': hash routers have no weights to share")

  def __call__(self, x: jax.Array, *, token_ids: Optional[jax.Array] = None, **context) -> RouterOutput:
    del context
    token_ids = _need_token_ids("hash", token_ids, x)
    ids = hash_expert_ids(token_ids, self.n_experts, self.top_k, self.cfg.hash_seed)   # [B, T, K]
    gates = jnp.full(ids.shape, 1.0 / self.top_k, jnp.float32)
    probs = jax.nn.one_hot(ids, self.n_experts, dtype=jnp.float32).sum(axis=-2) / self.top_k
    return RouterOutput(expert_ids=ids, gates=gates, probs=probs,
                        balance_loss=jnp.zeros((), jnp.float32))


def make_router(cfg: RouterConfig, d_model: int, n_experts: int, top_k: int, *, param_dtype,
                rngs: nnx.Rngs) -> nnx.Module:
  return ROUTERS.get(cfg.kind)(d_model, n_experts, top_k, cfg, param_dtype=param_dtype, rngs=rngs)


def routing_stats(out: RouterOutput, n_experts: int) -> dict[str, jax.Array]:
  """What the trainer logs for one router: its loss, per-expert pick counts [E], mean entropy."""
  counts = jnp.bincount(out.expert_ids.reshape(-1), length=n_experts).astype(jnp.float32)
  entropy = -jnp.sum(out.probs * jnp.log(out.probs + 1e-20), axis=-1).mean()
  return {"balance_loss": out.balance_loss, "expert_counts": counts, "entropy": entropy}
