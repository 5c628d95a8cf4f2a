"""The router contract: `RouterOutput`, the route context, construction, the logged statistics, the
router-input jitter and the parameter / MAC counts every router class carries (`RouterStats`)."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
from flax import nnx, struct

from umoe_jax.config import RouterConfig, router_mixing
from umoe_jax.kinds import ROUTERS
from umoe_jax.model.routers.losses import sequence_pick_counts
from umoe_jax.counting import linear


@struct.dataclass
class RouterOutput:
  expert_ids: jax.Array      # [B, T, K] int32
  gates: jax.Array           # [B, T, K] float32
  probs: jax.Array           # [B, T, E] float32, the distribution the top-k was taken from
  balance_loss: jax.Array    # [] float32, coefficient applied
  # The router's other losses by name ("z_loss", ...), [] float32 each, coefficients applied;
  # reported one by one and added to the training objective. Empty for most routers.
  aux_losses: Mapping[str, jax.Array] = dataclasses.field(default_factory=dict)
  # [B, T, K] bool: the slots that carry a pick (top-P's and expert choice's unused slots have gate
  # 0 and are left out of the load); None = every slot.
  slot_mask: Optional[jax.Array] = None
  # [B, E] float32: the picks per sequence and expert (active slots only), when the router counted
  # them for its balance loss (`ScoreRouter.output`); `pick_counts` reuses them. None otherwise.
  sequence_counts: Optional[jax.Array] = None


def route_context(token_ids: jax.Array, *, step: Optional[jax.Array] = None,
                  decoding: bool = False, rng: Optional[jax.Array] = None) -> dict[str, Any]:
  """The extras every router call receives.

    "token_ids": [B, T] int32, always;
    "step":      [] int32, the training step, only when the caller passes one (routers with a
                 schedule: smoe_dropout, stablemoe; without it they act as at the end of training);
    "decoding":  True, only while decoding with a KV cache (routers that mix over earlier tokens
                 refuse: the cache does not keep their routing inputs);
    "rng":       a PRNG key, only in training (the trainer passes one): the router-input jitter's
                 noise (`router.jitter_eps`); the LM and the block fold in the layer and the
                 sub-layer (`fold_rng`), a sub-layer with several routers (SwitchHead) each
                 router's index, so every router draws its own noise.
  """
  context: dict[str, Any] = {"token_ids": token_ids}
  if step is not None:
    context["step"] = jnp.asarray(step, jnp.int32)
  if decoding:
    context["decoding"] = True
  if rng is not None:
    context["rng"] = rng
  return context


def fold_rng(context: Optional[Mapping[str, Any]], index: int) -> Optional[Mapping[str, Any]]:
  """The context with its "rng" (if any) folded with `index` (a layer, a sub-layer)."""
  if not context or context.get("rng") is None:
    return context
  return {**context, "rng": jax.random.fold_in(context["rng"], index)}


def jitter(x: jax.Array, eps: float, rng: Optional[jax.Array]) -> jax.Array:
  """Switch Transformer's multiplicative router-input noise: x * U(1 - eps, 1 + eps) in float32,
  drawn per element, in training only (an `rng` in the route context); x unchanged otherwise or
  with eps = 0. Only the router sees it (the experts get the clean x)."""
  if rng is None or eps == 0:
    return x
  noise = jax.random.uniform(rng, x.shape, jnp.float32, 1.0 - eps, 1.0 + eps)
  return x.astype(jnp.float32) * noise


def call_router(router: nnx.Module, x: jax.Array,
                context: Optional[Mapping[str, Any]] = None) -> RouterOutput:
  """router(x [B, T, D], **context): the one way sub-layers call their routers."""
  with jax.named_scope("router"):
    return router(x, **(context or {}))


def make_router(cfg: RouterConfig, d_model: int, n_experts: int, top_k: int, *, param_dtype,
                rngs: nnx.Rngs) -> nnx.Module:
  return ROUTERS.get(cfg.kind)(d_model, n_experts, top_k, cfg, param_dtype=param_dtype, rngs=rngs)


def pick_counts(out: RouterOutput, n_experts: int,
                token_mask: Optional[jax.Array] = None) -> jax.Array:
  """Per-expert pick counts [E] float32 of the active slots (`slot_mask`) of the tokens in
  token_mask [B, T] bool (None: every token); expert ids [B, T, K]."""
  if token_mask is None and out.sequence_counts is not None:
    return out.sequence_counts.sum(axis=0)
  weights = out.slot_mask
  if token_mask is not None:
    tokens = jnp.broadcast_to(token_mask[..., None], out.expert_ids.shape)
    weights = tokens if weights is None else weights & tokens
  ids = out.expert_ids
  if ids.ndim != 3:  # [B, T, K] by the contract; anything else counts as one sequence
    ids = ids.reshape(1, -1, ids.shape[-1])
    weights = None if weights is None else weights.reshape(ids.shape)
  return sequence_pick_counts(jax.lax.stop_gradient(ids), n_experts, weights).sum(axis=0)


def routing_stats(out: RouterOutput, n_experts: int) -> dict[str, jax.Array]:
  """What the trainer logs for one router: its balance loss, per-expert pick counts [E] (active
  slots only), mean entropy, and each of its other losses by name (`aux_losses`: "z_loss", ...)."""
  counts = pick_counts(out, n_experts)
  entropy = -jnp.sum(out.probs * jnp.log(out.probs + 1e-20), axis=-1).mean()
  return {"balance_loss": out.balance_loss, "expert_counts": counts, "entropy": entropy,
          **out.aux_losses}


def need_token_ids(kind: str, token_ids: Optional[jax.Array], x: jax.Array) -> jax.Array:
  """The route context's token ids [B, T], checked against the router input x [B, T, D]."""
  if token_ids is None:
    raise ValueError(f"router.kind={kind!r} routes by token id: call the router with token_ids=[B, T] "
                     "(CausalLM passes route_context={'token_ids': tokens} to every sub-layer)")
  if token_ids.shape != x.shape[:-1]:
    raise ValueError(f"token_ids {token_ids.shape} must match the router input's [B, T] "
                     f"{x.shape[:-1]}")
  return token_ids


class RouterStats:
  """Parameter and MAC counts of one router (`umoe_jax.stats` reads them by `router.kind`). Every
  router class inherits these and overrides what differs; `cfg` is the ModelConfig, `router` the
  sub-layer's RouterConfig. Default: a D x E map."""

  @classmethod
  def param_count(cls, cfg, router: RouterConfig, n_experts: int) -> int:
    return linear(cfg.d_model, n_experts)

  @classmethod
  def token_mac_count(cls, cfg, router: RouterConfig, n_experts: int) -> int:
    """Forward MACs per token (the scores of every expert)."""
    return linear(cfg.d_model, n_experts)

  @classmethod
  def pair_mac_count(cls, cfg, router: RouterConfig, n_experts: int) -> int:
    """Forward MACs per (query token, earlier token) pair: the mixing over tokens
    (`router.mixing`; `mutual_inform.pair_macs`), 0 without."""
    from umoe_jax.model.routers.mutual_inform import pair_macs
    return pair_macs(router_mixing(router), cfg.d_model, n_experts)


def router_params(cfg, n_experts: int, sublayer: str) -> int:
  """Parameters of one router of `sublayer` ("attention" / "ffn") over `n_experts` experts: its
  class's `param_count` (a D x E map unless the family says otherwise), for the sub-layer's router
  config (`ModelConfig.router_for`), plus the aux-loss-free balancing's selection bias [E] when
  `router.bias_update_rate` > 0."""
  router = cfg.router_for(sublayer)
  bias = n_experts if router.bias_update_rate > 0 else 0
  return ROUTERS.get(router.kind).param_count(cfg, router, n_experts) + bias


def router_macs(cfg, n_experts: int, sublayer: str) -> int:
  """Forward MACs per token of one router of `sublayer` (`token_mac_count` of its class). The
  mixing over earlier tokens of similarity_aware / attention_aware depends on T: `pair_mac_count`."""
  router = cfg.router_for(sublayer)
  return ROUTERS.get(router.kind).token_mac_count(cfg, router, n_experts)


class Router(RouterStats, nnx.Module):
  """Base of every router class: the constructor of the contract, keeping E (`n_experts`), the
  sub-layer's K (`top_k`) and the RouterConfig (`cfg`); subclasses add their weights after it."""

  def __init__(self, d_model: int, n_experts: int, top_k: int, cfg: RouterConfig, *, param_dtype,
               rngs: nnx.Rngs):
    del d_model, param_dtype, rngs
    self.n_experts = n_experts
    self.top_k = top_k
    self.cfg = cfg


class ParameterFreeRouter(Router):
  """Base of routers without weights of their own (hash routing)."""

  @classmethod
  def param_count(cls, cfg, router, n_experts):
    return 0
