"""Post-mixing attention MoE (the UMoE paper's ablation, Eq. 8): apply the experts, then mix.

Pre-mixing (UMoE, `premix.py`) mixes the hidden states first and sends the mixture to the experts,
y = sum_i g_i E_i(a_i X). Post-mixing swaps the order, y = sum_i a_i (X E_i): each expert is applied to
the tokens, and attention mixes the expert outputs. Taken literally with experts chosen by the *query*
token, every expert picked by any token would have to run on every token: up to E x T expert
evaluations per sequence (E/K times an FFN-MoE layer: ~43x at base) and a cache of every expert's
output for every token. We use the cost-feasible form of the official code (`PostMixMoEAttention`):
experts are picked by the *source* token, so each token runs through K experts exactly as in an
FFN-MoE, and a single query attends over all (token, expert) entries with one softmax:

    for every token s, its router picks T_s (top-K of softmax over E, gates g_{s,j} not renormalised)
    values  v_{s,j} = g_{s,j} E_j(x_s)                                    j in T_s   [D]
            v_{s,0} = E_shared(x_s)                                       (always-on slot, weight 1)
    keys    k_{s,j} = x_s W_k_res + RMSNorm_r(x_s W_a^j) W_b^j            (low-rank expert keys,
            k_{s,0} = x_s W_k_shared                                       mirroring UMoE's queries)
    query   q_t     = x_t W_q                                             (one head; RoPE over d_k on
                                                                            q and every key)
    y_t = sum_{s <= t} sum_{j in {0} u T_s} a_{t,(s,j)} v_{s,j},   a_t = softmax over all visible
                                                                   (s, j) of q_t . k_{s,j} / sqrt(d_k)

A router that leaves slots without a pick (`RouterOutput.slot_mask`: top-P's unused slots,
SMoE-Dropout's beyond k(step)) makes T_s smaller than K for some tokens: those slots are no entries at
all. They take no expert rows (`dispatch.make_plan` with the mask) and get zero attention weight (their
key position is EMPTY, which the causal mask never shows), so y_t does not depend on how many slots
were left unused. Decoding then also caches each entry's mask (`slot_mask` [1 + K] per token).

The routed E_j are the layer's pool (shared with the FFN in UMoE). With linear experts
(`moe.activation="none"`) and one routed slot this is pre-mixing with the gate moved onto the value;
with non-linear experts the two differ, which is the point of the ablation. Decoding caches (1 + K)
keys [d_k] and values [D] per token and layer (`attention.q_lora_rank=None`: full per-expert keys).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from umoe_jax.config import ModelConfig
from umoe_jax.kinds import router_masks_slots
from umoe_jax.model.attention.common import (ATTENTIONS, low_rank_expert_apply,
                                             low_rank_expert_params, projection_kw)
from umoe_jax.model.attention.cores import causal_attention
from umoe_jax.model.attention.stats import PreMixStats
from umoe_jax.model.cache import EMPTY
from umoe_jax.model.layers import MLP, Linear
from umoe_jax.model.rope import apply_rope
from umoe_jax.model.routers import call_router, make_router
from umoe_jax.ops import dispatch
from umoe_jax.parallel import rules as ax


class PostMixStats(PreMixStats):
  """One query; shared + residual keys; K routed low-rank keys; (1 + K) entries per key token of
  width d_k (scores) and D (mix); the always-on expert; K picks from the layer's pool. Counted as
  pre-mixing's with the roles of queries and keys swapped (the same projections, routers and
  experts; no latent values); the cache holds every slot's key and value."""

  @classmethod
  def _latent(cls, cfg):
    return None

  @classmethod
  def kv_cache(cls, cfg):
    n = cls._n_queries(cfg)
    cached = {"key": n * cfg.attention.head_dim, "value": n * cfg.d_model}
    if router_masks_slots(cfg.router_for("attention")):
      cached["slot_mask"] = n
    return cached


@ATTENTIONS.register("postmix")
class PostMixAttention(nnx.Module):
  """Experts on every token first (routed by that token), then one query mixes the expert outputs."""

  stats = PostMixStats

  @classmethod
  def cache_shapes(cls, cfg: ModelConfig) -> dict:
    """(1 + K) keys and values per token; with a router that masks slots also their masks (1 = an
    entry, 0 = a slot without a pick), so cached masked slots stay out of the softmax."""
    n = cfg.attention.top_k + (1 if cfg.attention.n_shared_experts else 0)
    shapes = {"k": (n, cfg.attention.head_dim), "v": (n, cfg.d_model)}
    if router_masks_slots(cfg.router_for("attention")):
      shapes["slot_mask"] = (n,)
    return shapes

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    att, moe = cfg.attention, cfg.moe
    self.cfg = cfg
    self.top_k, self.n_experts = att.top_k, moe.n_experts
    kw = projection_kw(cfg, rngs)
    d, dk = cfg.d_model, att.head_dim
    self.router = make_router(cfg.router_for("attention"), d, moe.n_experts, att.top_k,
                              param_dtype=cfg.param_dtype, rngs=rngs)
    self.q_proj = Linear(d, dk, (ax.EMBED, ax.HEAD_DIM), **kw)
    self.shared_k_proj = Linear(d, dk, (ax.EMBED, ax.HEAD_DIM), **kw) if att.n_shared_experts else None
    self.k_res_proj, self.k_a, self.k_a_norm, self.k_b = low_rank_expert_params(
        cfg, rngs=rngs, linear_kw=kw)
    self.shared_expert = (
        MLP(d, moe.d_expert * att.n_shared_experts, activation=moe.activation, gated=moe.gated,
            **{**kw, "fp8": cfg.fp8})
        if att.n_shared_experts else None)

  def __call__(self, x: jax.Array, positions: jax.Array, *, experts=None, cache=None,
               route_context=None):
    """x [B, T, D] (normed layer input) -> (y [B, T, D], {"attention": RouterOutput}) (+ cache)."""
    if experts is None:
      raise ValueError("post-mixing attention needs the layer's expert pool (experts=...)")
    b, t, d = x.shape
    n, k = b * t, self.top_k
    dt, backend = self.cfg.compute_dtype, self.cfg.gmm_backend
    x = x.astype(dt)
    route = call_router(self.router, x, route_context)
    ids, gates = route.expert_ids.reshape(n, k), route.gates.reshape(n, k)
    # Slots without a pick (top-P, SMoE-Dropout: gate 0) get no expert rows and no attention.
    mask = None if route.slot_mask is None else route.slot_mask.reshape(n, k)
    plan = dispatch.make_plan(ids, self.n_experts, mask)
    rows = dispatch.permute(x.reshape(n, d), plan, k)                              # [M, D]

    with jax.named_scope("expert_values"):                                         # g_{s,j} E_j(x_s)
      values = dispatch.unpermute(experts(rows, plan.group_sizes), plan).reshape(n, k, d)
      values = (values.astype(jnp.float32) * gates[:, :, None]).astype(dt).reshape(b, t, k, d)
    with jax.named_scope("expert_keys"):
      keys = low_rank_expert_apply(rows, plan.group_sizes, self.k_a, self.k_a_norm, self.k_b,
                                   dtype=dt, backend=backend, fp8=self.cfg.fp8)    # [M, Dk]
      keys = dispatch.unpermute(keys, plan).reshape(b, t, k, -1)                   # [B, T, K, Dk]
      if self.k_res_proj is not None:
        keys = keys + self.k_res_proj(x)[:, :, None, :]
    entries = None if mask is None else mask.reshape(b, t, k)                      # [B, T, K] bool
    if self.shared_expert is not None:
      values = jnp.concatenate([self.shared_expert(x)[:, :, None, :], values], axis=2)
      keys = jnp.concatenate([self.shared_k_proj(x)[:, :, None, :], keys], axis=2)  # [B,T,1+K,Dk]
      if entries is not None:                                  # the always-on slot is always an entry
        entries = jnp.concatenate([jnp.ones((b, t, 1), bool), entries], axis=2)
    rope = dict(theta=self.cfg.rope_theta, layout=self.cfg.rope_layout)
    keys = apply_rope(keys, positions, **rope)
    q = apply_rope(self.q_proj(x), positions, **rope)[:, :, None, :]              # [B, T, 1, Dk]

    k_pos = positions
    if cache is not None:
      keys, values, entries, k_pos, cache = self._cached(cache, keys, values, entries)
    s, slots = keys.shape[1], keys.shape[2]
    entry_pos = jnp.repeat(k_pos, slots, axis=1)                                   # [B, S*(1+K)]
    if entries is not None:  # a slot without a pick is no entry: EMPTY, which no query sees
      entry_pos = jnp.where(entries.reshape(b, s * slots), entry_pos, EMPTY)
    with jax.named_scope("mix"):  # one softmax over every (token, entry)
      # (the keys are never the queries' own positions: every core runs the XLA form here)
      y = causal_attention(q, keys.reshape(b, s * slots, 1, -1), values.reshape(b, s * slots, 1, d),
                           positions, entry_pos, core=self.cfg.attention.core)[:, :, 0]  # [B, T, D]
    routes = {"attention": route}
    return (y, routes) if cache is None else (y, routes, cache)

  def _cached(self, cache, keys, values, entries):
    """Appends this pass's keys, values (and entry masks) to the layer cache; -> the whole cache's
    (keys [B, S, 1+K, Dk], values [B, S, 1+K, D], entries [B, S, 1+K] bool or None, key positions
    [B, S], the updated cache)."""
    if "slot_mask" not in cache.arrays:
      if entries is not None:
        r, key = self.cfg.router_for("attention"), self.cfg.router_key
        raise ValueError(
            f"post-mixing attention: the attention router ({key('attention', 'kind')}={r.kind!r}, "
            f"{key('attention', 'selection')}={r.selection!r}) left slots without a pick, but the "
            "decoding cache keeps no slot masks for it (umoe_jax.kinds.router_masks_slots does "
            "not know it can: set masks_slots=True in its ROUTER_KINDS row)")
      cache = cache.append(k=keys, v=values)
      return cache.arrays["k"], cache.arrays["v"], None, cache.key_positions, cache
    if entries is None:  # this router masks nothing in this pass: every slot is an entry
      entries = jnp.ones(keys.shape[:3], bool)
    cache = cache.append(k=keys, v=values, slot_mask=entries)
    cached_entries = cache.arrays["slot_mask"] > 0
    return cache.arrays["k"], cache.arrays["v"], cached_entries, cache.key_positions, cache
