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
                     (schedules of smoe_dropout and stablemoe; the trainer's `train_step` passes
                     the applied updates, the learning-rate schedule's count; absent = as at the
                     end of training: evaluation, decoding);
  "decoding"         True during cached decoding (the mixing routers refuse it);
  "attention_probs"  [B, H, T, S] float32, added by the block to its FFN router's context when the
                     router class sets `needs_attention_probs` (attention_aware).
  "expert_pool"      the FFN's expert pool, added by the block when the router class sets
                     `needs_expert_pool` (aoe: the experts score themselves).
A router that needs another extra adds a key there; no call site changes.

A new router is one class registered in `ROUTERS`; `model.router.kind` selects it. Its constructor is
`(d_model, n_experts, top_k, cfg: RouterConfig, *, param_dtype, rngs)`; an optional classmethod
`validate(model_cfg)` raises `ConfigError` for combinations the router cannot serve.

Routers here:
  "topk_softmax", "topk_sigmoid"   softmax / sigmoid of x W_r, top-k
  "xmoe"              X-MoE cosine routing in a low-dimensional space (Chi et al. 2022)
  "hash"              fixed token-id hashing (Roller et al. 2021)
  "smoe_dropout"      SMoE-Dropout (Chen et al. 2023): fixed random router, k grows linearly with the
                      step from `smoe_dropout_k_start` to the sub-layer's top_k
  "stablemoe"         StableMoE (Dai et al. 2022): learned centroids distilled into a token-id router
                      (stage 1), routing frozen to that router from `stablemoe_stage2_step` (stage 2)
  "similarity_aware"  Similarity-aware routing (Nguyen et al. 2025, "Graph of Tokens" / Mutual-Inform
                      SMoE): softmax-router distributions mixed over similar earlier tokens
  "attention_aware"   Attention-aware routing (same paper): mixed over the tokens the block's MHA
                      attends to (FFN router; MHA attention only)
  "aoe"               Autonomy-of-Experts (Lv et al. 2025): no router; each expert's low-rank code
                      norm |x A^e| is its score (the block builds an `AoEExpertPool`)
The mixing routers are causal (a token mixes itself and earlier tokens) and refuse cached decoding.
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

  kernel_axes = (ax.EMBED, ax.ROUTER_OUT)  # logical axes of W_r

  def __init__(self, d_model: int, n_experts: int, top_k: int, cfg: RouterConfig, *, param_dtype,
               rngs: nnx.Rngs):
    self.n_experts = n_experts
    self.top_k = top_k
    self.cfg = cfg
    self.kernel = make_param(rngs, kaiming_uniform_init(d_model), (d_model, n_experts),
                             self.kernel_axes, param_dtype)

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


class ParameterFreeRouter(nnx.Module):
  """Base of routers without weights of their own (hash routing, AoE)."""

  def __init__(self, d_model: int, n_experts: int, top_k: int, cfg: RouterConfig, *, param_dtype,
               rngs: nnx.Rngs):
    del d_model, param_dtype, rngs
    self.n_experts = n_experts
    self.top_k = top_k
    self.cfg = cfg


@ROUTERS.register("hash")
class HashRouter(ParameterFreeRouter):
  """Hash layers (Roller et al. 2021): each token id always goes to the same K distinct experts.

  No learned parameters and no state: the map is `hash_expert_ids(token_ids, E, K,
  router.hash_seed)` (default seed 42, as ParlAI's). Gates are 1/K each (the paper: top-1, weight 1);
  `probs` [B, T, E] is the one-hot mixture (1/K on each picked expert); the balance loss is 0 (nothing
  to balance by gradient). Needs `token_ids` [B, T] in the route context (`CausalLM` passes them).
  """

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


# SMoE-Dropout (Chen et al., ICLR 2023). A fixed random router; the number of active experts grows
# linearly over training. Shapes must stay static under jit while the step is traced, so the router
# always returns the sub-layer's K slots and zeroes the gates of the slots beyond k(step).


def linear_k_schedule(step: jax.Array, k_start: int, k_end: int, steps: int) -> jax.Array:
  """k(t) = k_start + round((k_end - k_start) * min(t / steps, 1)), int32 [] (the paper's
  `linear_increase`; round half to even, like Python's round)."""
  frac = jnp.clip(jnp.asarray(step, jnp.float32) / steps, 0.0, 1.0)
  return (k_start + jnp.round((k_end - k_start) * frac)).astype(jnp.int32)


@ROUTERS.register("smoe_dropout")
class SMoEDropoutRouter(TopKSoftmaxRouter):
  """SMoE-Dropout: probs = softmax(x W_r) with W_r [D, E] random and never trained; top-K of probs,
  of which only the first k(step) slots are active (the others get gate 0):

    k(step) = linear_k_schedule(step, min(router.smoe_dropout_k_start, K), K, router.smoe_dropout_steps)
    gates   = probs of the k(step) best experts (renormalised over them if router.renormalize;
              the paper's softmax over the top-k logits is renormalize=True), 0 for the rest

  K is the sub-layer's top_k (the schedule's end; the paper grows k to all E experts: top_k = E).
  Without a "step" in the route context (evaluation, decoding) k = K. No balance loss (the router is
  fixed, as in the paper). All K slots go through the experts even while k(step) < K (zero gates;
  the logged expert counts include them); the paper's early-training saving needs shapes that
  change with the step.
  W_r is initialised like `topk_softmax` (no bias, unlike the paper's nn.Linear) and tagged `norm`:
  replicated and never weight-decayed, so with its zero gradient Adam leaves it exactly as drawn.
  """

  kernel_axes = (ax.NORM, ax.ROUTER_OUT)

  def logits(self, x: jax.Array) -> jax.Array:
    """x [B, T, D] -> float32 logits [B, T, E]; no gradient reaches W_r (fixed router)."""
    w = jax.lax.stop_gradient(self.kernel.value.astype(jnp.float32))
    return jnp.dot(x.astype(jnp.float32), w)

  def active_k(self, step: Optional[jax.Array]) -> jax.Array:
    """Active experts per token at `step` (None: the end of the schedule, K), int32 []."""
    if step is None:
      return jnp.asarray(self.top_k, jnp.int32)
    k_start = min(self.cfg.smoe_dropout_k_start, self.top_k)
    return linear_k_schedule(step, k_start, self.top_k, self.cfg.smoe_dropout_steps)

  def __call__(self, x: jax.Array, *, step: Optional[jax.Array] = None, **context) -> RouterOutput:
    del context
    probs = jax.nn.softmax(self.logits(x), axis=-1)                                    # [B, T, E]
    top, ids = jax.lax.top_k(probs, self.top_k)                                        # [B, T, K]
    active = jnp.arange(self.top_k) < self.active_k(step)                              # [K]
    gates = jnp.where(active, top, 0.0)
    if self.cfg.renormalize:
      gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    return RouterOutput(expert_ids=ids.astype(jnp.int32), gates=gates, probs=probs,
                        balance_loss=jnp.zeros((), jnp.float32))


# StableMoE (Dai et al., ACL 2022): learn routing with the backbone, distil it into a lightweight
# token-id router, then freeze routing to that router.


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
class StableMoERouter(nnx.Module):
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
  for stage 1, `step` in the route context.
  """

  def __init__(self, d_model: int, n_experts: int, top_k: int, cfg: RouterConfig, *, param_dtype,
               rngs: nnx.Rngs):
    if cfg.stablemoe_vocab_size is None:
      raise ValueError("router.kind='stablemoe' needs router.stablemoe_vocab_size (model_config() "
                       "sets it to model.vocab_size)")
    self.n_experts = n_experts
    self.top_k = top_k
    self.cfg = cfg
    d_w = cfg.stablemoe_distill_dim
    self.centroids = make_param(rngs, _orthogonal_init(0.1), (n_experts, d_model),
                                (ax.ROUTER_OUT, ax.EMBED), param_dtype)
    self.token_embed = make_param(rngs, lambda key, shape, dtype: jax.random.normal(key, shape, dtype),
                                  (cfg.stablemoe_vocab_size, d_w), (ax.VOCAB, ax.LORA), param_dtype)
    self.distill_centroids = make_param(rngs, _orthogonal_init(0.1), (n_experts, d_w),
                                        (ax.ROUTER_OUT, ax.LORA), param_dtype)

  def affinities(self, x: jax.Array) -> jax.Array:
    """x [B, T, D] -> s [B, T, E] float32."""
    return jnp.dot(x.astype(jnp.float32), self.centroids.value.astype(jnp.float32).T)

  def distilled(self, token_ids: jax.Array) -> jax.Array:
    """token ids [B, T] -> the distilled router's scores d [B, T, E] float32."""
    emb = jnp.take(self.token_embed.value, token_ids, axis=0).astype(jnp.float32)      # [B, T, d_w]
    return jnp.dot(emb, self.distill_centroids.value.astype(jnp.float32).T)

  def __call__(self, x: jax.Array, *, token_ids: Optional[jax.Array] = None,
               step: Optional[jax.Array] = None, **context) -> RouterOutput:
    del context
    token_ids = _need_token_ids("stablemoe", token_ids, x)
    s, d = self.affinities(x), self.distilled(token_ids)                                # [B, T, E]
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
                        balance_loss=jnp.where(stage1, loss, 0.0))


# Similarity- and attention-aware routing (Nguyen et al., "Improving Routing in Sparse Mixture of
# Experts with Graph of Tokens", arXiv 2505.00792; ICLR 2025 submission "Mutual-Inform SMoE"):
# a token's routing distribution is the mixture of the softmax-router distributions G of the tokens
# it is linked to, P = S G, then top-k of P. Causal here: S only links a token to itself and
# earlier tokens (mixing later ones would leak the future into next-token prediction).


class _TokenMixingRouter(TopKSoftmaxRouter):
  """Base of the routers that mix G = softmax(x W_r) over earlier tokens: P = `mix`(G) [B, T, E],
  then top-k of P, `router.renormalize` and the configured balance loss on P. Row i of the mixing
  matrix needs every token j <= i of the sequence in one call: cached decoding (one new token per
  call) is refused, because the cache keeps no routing inputs of earlier tokens."""

  def mix(self, g: jax.Array, x: jax.Array, **context) -> jax.Array:
    """g [B, T, E] (row-stochastic), x [B, T, D] -> the mixed distribution [B, T, E]."""
    raise NotImplementedError

  def __call__(self, x: jax.Array, *, decoding: bool = False, **context) -> RouterOutput:
    if decoding:
      raise NotImplementedError(
          f"router.kind={self.cfg.kind!r} mixes the routing of earlier tokens, which the KV cache "
          "does not keep: cached decoding is not supported (run full forward passes instead)")
    g = jax.nn.softmax(self.logits(x), axis=-1)                                          # [B, T, E]
    return probs_route(self.mix(g, x, **context), self.top_k, self.cfg, self.n_experts)


def causal_softmax(scores: jax.Array) -> jax.Array:
  """Row softmax of scores [..., T, T] over the columns j <= i (float32)."""
  t = scores.shape[-1]
  causal = jnp.tril(jnp.ones((t, t), jnp.bool_))
  return jax.nn.softmax(jnp.where(causal, scores.astype(jnp.float32), -jnp.inf), axis=-1)


@ROUTERS.register("similarity_aware")
class SimilarityAwareRouter(_TokenMixingRouter):
  """Similarity-aware routing: S = causal softmax_j(u_i . u_j / tau) over the router inputs u = x
  (the rebuttal's S = softmax(U U^T / tau); no learned W_s), P = S G.

  tau = `router.similarity_temperature`, default sqrt(D) (dot-product attention's scale; the
  authors report tau in {0.1, 1, 2, sqrt(D)} to matter little). O(T^2 (D + E)) per router.
  """

  def __init__(self, d_model: int, n_experts: int, top_k: int, cfg: RouterConfig, *, param_dtype,
               rngs: nnx.Rngs):
    super().__init__(d_model, n_experts, top_k, cfg, param_dtype=param_dtype, rngs=rngs)
    self.temperature = cfg.similarity_temperature or math.sqrt(d_model)

  def mix(self, g: jax.Array, x: jax.Array, **context) -> jax.Array:
    del context
    u = x.astype(jnp.float32)
    s = causal_softmax(jnp.einsum("btd,bsd->bts", u, u) / self.temperature)            # [B, T, T]
    return jnp.einsum("bts,bse->bte", s, g)


@ROUTERS.register("attention_aware")
class AttentionAwareRouter(_TokenMixingRouter):
  """Attention-aware routing: P = A' G with A the causal attention probabilities of the block's own
  attention (route context "attention_probs" [B, H, T, T], added by the block for the FFN router).

  Row t uses the head h*(t) of lowest mean row entropy over rows 0..t (the paper picks the head of
  least entropy; averaging only over the rows so far keeps routing causal; chosen without
  gradient); A' = A_{h*}^(1/sigma), rows renormalised, sigma = `router.attention_temperature`
  (1: the probabilities themselves; sigma -> 0: each token follows its most attended token). The
  paper's Gaussian "posterior" attention is not public; this keeps its sigma -> 0 limit.
  Only behind attention that exposes its probabilities (`model.attention.kind='mha'`) and only for
  an MoE FFN: attention variants with their own routers route before their attention runs.
  """

  needs_attention_probs = True

  @classmethod
  def validate(cls, model_cfg) -> None:
    from umoe_jax.config import ConfigError
    from umoe_jax.model.attention import ATTENTIONS
    att = model_cfg.attention.kind
    if not getattr(ATTENTIONS.get(att), "exposes_attention_probs", False):
      raise ConfigError(
          f"model.router.kind='attention_aware' with model.attention.kind={att!r}: its routers run "
          "before its attention probabilities exist; use model.attention.kind='mha' (an FFN-MoE)")
    if model_cfg.ffn.kind != "moe":
      raise ConfigError(f"model.router.kind='attention_aware' with model.ffn.kind="
                        f"{model_cfg.ffn.kind!r}: it informs an MoE FFN's router (model.ffn.kind='moe')")

  def mix(self, g: jax.Array, x: jax.Array, *, attention_probs: Optional[jax.Array] = None,
          **context) -> jax.Array:
    del x, context
    if attention_probs is None:
      raise ValueError("router.kind='attention_aware' needs attention_probs=[B, H, T, T] in the "
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
    sigma = self.cfg.attention_temperature
    if sigma != 1.0:  # A^(1/sigma) renormalised = a softmax of log A / sigma over the visible keys
      a = jax.nn.softmax(jnp.where(a > 0, pick(log_a) / sigma, -jnp.inf), axis=-1)
    return jnp.einsum("bts,bse->bte", a, g)


# Autonomy-of-Experts (Lv et al., ICML 2025): no router weights; the experts' own low-rank codes
# score them. The scores need the pool's weights, which the block puts into the route context.


@ROUTERS.register("aoe")
class AoERouter(ParameterFreeRouter):
  """AoE: p_e = |x A^e|_2, the norm of expert e's rank-r code (`AoEExpertPool.codes`, route context
  "expert_pool"); probs = softmax(p) over all E (float32), top-k of probs. The paper's gates, a
  softmax over the K chosen norms, are `router.renormalize=True`; the megablocks code's are False.
  Its balance loss (Eq. 6) is the Switch loss on softmax(p): `router.balance_loss='switch'`.
  No parameters: the codes' A^e belong to the pool (and learn through the gates and the experts).
  Serves an MoE FFN behind router-free attention (`model.attention.kind='mha'`); the block builds the
  layer's pool as an `AoEExpertPool` of rank `router.aoe_dim` (default d_model // 3, the paper's best).
  """

  needs_expert_pool = True

  @classmethod
  def validate(cls, model_cfg) -> None:
    from umoe_jax.config import ConfigError
    if model_cfg.attention.kind != "mha":
      raise ConfigError(f"model.router.kind='aoe' with model.attention.kind={model_cfg.attention.kind!r}: "
                        "AoE experts score themselves in an MoE FFN; the attention must have no "
                        "router (model.attention.kind='mha')")
    if model_cfg.ffn.kind != "moe":
      raise ConfigError(f"model.router.kind='aoe' with model.ffn.kind={model_cfg.ffn.kind!r}: "
                        "AoE routes an MoE FFN (model.ffn.kind='moe')")

  def __call__(self, x: jax.Array, *, expert_pool: Optional[nnx.Module] = None,
               **context) -> RouterOutput:
    del context
    if expert_pool is None or not hasattr(expert_pool, "codes"):
      raise ValueError("router.kind='aoe' scores the experts by their own codes: call it with "
                       "expert_pool=<an AoEExpertPool> (the block adds the FFN's pool to the context)")
    codes = expert_pool.codes(x)                                                       # [B, T, E, r]
    # +tiny under the root: its gradient at an all-zero code (a zero input row) would be inf * 0.
    norms = jnp.sqrt(jnp.sum(jnp.square(codes), axis=-1) + 1e-12)                      # [B, T, E]
    return probs_route(jax.nn.softmax(norms, axis=-1), self.top_k, self.cfg, self.n_experts)


def make_router(cfg: RouterConfig, d_model: int, n_experts: int, top_k: int, *, param_dtype,
                rngs: nnx.Rngs) -> nnx.Module:
  return ROUTERS.get(cfg.kind)(d_model, n_experts, top_k, cfg, param_dtype=param_dtype, rngs=rngs)


def routing_stats(out: RouterOutput, n_experts: int) -> dict[str, jax.Array]:
  """What the trainer logs for one router: its loss, per-expert pick counts [E], mean entropy."""
  counts = jnp.bincount(out.expert_ids.reshape(-1), length=n_experts).astype(jnp.float32)
  entropy = -jnp.sum(out.probs * jnp.log(out.probs + 1e-20), axis=-1).mean()
  return {"balance_loss": out.balance_loss, "expert_counts": counts, "entropy": entropy}
