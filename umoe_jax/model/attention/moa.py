"""Mixture of Attention heads (MoA; Zhang et al., EMNLP 2022), as re-implemented in the UMoE repository.

Every token t picks K of E expert heads with the model's router (top-k of a softmax over E, gates not
renormalised: `model.router`). Expert i owns a query projection W_q^i [D, Dk] and an output projection
W_o^i [Dv, D]; one key head K = X W_k and one value head V = X W_v (single head, RoPE over all of Dk on
queries and key) are shared by all experts:

    o_{t,i} = softmax(x_t W_q^i K^T / sqrt(Dk)) V                      [Dv]
    y_t     = sum_{i in topK(t)} g_{t,i} o_{t,i} W_o^i  +  o_{t,s} W_o^s

The last term is the UMoE repository's always-on head (`attention.n_shared_experts=1`: its own query
W_q^s and output W_o^s, weight 1); the original MoA has none (`attention.n_shared_experts=0`).
`attention.n_experts` = E, `attention.top_k` = K, `attention.head_dim` = Dk, `attention.v_head_dim` = Dv.

Expert projections run through the project's dispatch (sort (token, slot) pairs by expert) and grouped
matmuls; one dispatch plan serves the queries and the output projections. Decoding caches the shared
key [Dk] and value [Dv] per token and layer.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from umoe_jax.config import ModelConfig
from umoe_jax.counting import AttentionStats, Count, linear
from umoe_jax.model.attention.common import ATTENTIONS, projection_kw
from umoe_jax.model.attention.cores import causal_attention
from umoe_jax.model.layers import Linear, make_param, normal_init
from umoe_jax.model.rope import apply_rope
from umoe_jax.model.routers import call_router, make_router, router_macs, router_params
from umoe_jax.ops import dispatch
from umoe_jax.ops.gmm import gmm
from umoe_jax.parallel import rules as ax


class MoAStats(AttentionStats):
  """Shared k, v (one head); shared-head q and o; K routed (W_q^i, W_o^i) of E; the router."""

  @classmethod
  def params(cls, cfg):
    a, d = cfg.attention, cfg.d_model
    dense = linear(d, a.head_dim) + linear(d, a.v_head_dim)
    if a.n_shared_experts:
      dense += linear(d, a.head_dim) + linear(a.v_head_dim, d)
    per_expert = linear(d, a.head_dim) + linear(a.v_head_dim, d)
    return {"attention": Count(dense),
            "attention_routed": Count(a.n_experts * per_expert, a.top_k * per_expert),
            "routers": Count(router_params(cfg, a.n_experts, "attention"))}

  @classmethod
  def token_macs(cls, cfg):
    p = cls.params(cfg)
    return {"attention": p["attention"].total, "attention_routed": p["attention_routed"].active,
            "routers": router_macs(cfg, cfg.attention.n_experts, "attention")}

  @classmethod
  def pair_macs(cls, cfg):
    a = cfg.attention
    n = a.top_k + (1 if a.n_shared_experts else 0)
    return {"attention_scores": n * a.head_dim, "attention_mix": n * a.v_head_dim}

  @classmethod
  def kv_cache(cls, cfg):
    return {"key": cfg.attention.head_dim, "value": cfg.attention.v_head_dim}


@ATTENTIONS.register("moa")
class MoAAttention(nnx.Module):
  """Per-expert W_q, W_o; shared single-head W_k, W_v; optional always-on head."""

  stats = MoAStats

  @classmethod
  def cache_shapes(cls, cfg: ModelConfig) -> dict:
    return {"k": (cfg.attention.head_dim,), "v": (cfg.attention.v_head_dim,)}

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    att = cfg.attention
    self.cfg = cfg
    self.top_k, self.n_experts = att.top_k, att.n_experts
    kw = projection_kw(cfg, rngs)
    d, dk, dv, e = cfg.d_model, att.head_dim, att.v_head_dim, att.n_experts
    init = normal_init(cfg.init_std)
    self.router = make_router(cfg.router_for("attention"), d, e, att.top_k,
                              param_dtype=cfg.param_dtype, rngs=rngs)
    self.q_experts = make_param(rngs, init, (e, d, dk), (ax.EXPERT, ax.EMBED, ax.HEAD_DIM),
                                cfg.param_dtype)
    self.o_experts = make_param(rngs, init, (e, dv, d), (ax.EXPERT, ax.HEAD_DIM, ax.EMBED),
                                cfg.param_dtype)
    self.k_proj = Linear(d, dk, (ax.EMBED, ax.HEAD_DIM), **kw)
    self.v_proj = Linear(d, dv, (ax.EMBED, ax.HEAD_DIM), **kw)
    if att.n_shared_experts:
      self.shared_q_proj = Linear(d, dk, (ax.EMBED, ax.HEAD_DIM), **kw)
      self.shared_o_proj = Linear(dv, d, (ax.HEAD_DIM, ax.EMBED), **kw)
    else:
      self.shared_q_proj = self.shared_o_proj = None

  def __call__(self, x: jax.Array, positions: jax.Array, *, experts=None, cache=None,
               route_context=None):
    """x [B, T, D] (normed) -> (y [B, T, D], {"attention": RouterOutput}) (+ cache)."""
    del experts
    b, t, d = x.shape
    n, k = b * t, self.top_k
    dt, backend = self.cfg.compute_dtype, self.cfg.gmm_backend
    x = x.astype(dt)
    route = call_router(self.router, x, route_context)
    ids, gates = route.expert_ids.reshape(n, k), route.gates.reshape(n, k)
    # Slots without a pick (top-P, SMoE-Dropout: gate 0) get no query or output rows.
    plan = dispatch.make_plan(ids, self.n_experts,
                              None if route.slot_mask is None else route.slot_mask.reshape(n, k))

    with jax.named_scope("queries"):
      rows = dispatch.permute(x.reshape(n, d), plan, k)                                # [M, D]
      q = gmm(rows, self.q_experts.value.astype(dt), plan.group_sizes, backend=backend,
              fp8=self.cfg.fp8)                                                         # [M, Dk]
      q = dispatch.unpermute(q, plan).reshape(b, t, k, -1)                              # [B,T,K,Dk]
      if self.shared_q_proj is not None:
        q = jnp.concatenate([self.shared_q_proj(x)[:, :, None, :], q], axis=2)        # [B,T,1+K,Dk]
      rope = dict(theta=self.cfg.rope_theta, layout=self.cfg.rope_layout)
      q = apply_rope(q, positions, **rope)
      key = apply_rope(self.k_proj(x), positions, **rope)                              # [B, T, Dk]
      value = self.v_proj(x)                                                           # [B, T, Dv]

    k_pos = positions
    if cache is not None:
      cache = cache.append(k=key, v=value)
      key, value, k_pos = cache.arrays["k"], cache.arrays["v"], cache.key_positions
    o = causal_attention(q, key[:, :, None, :], value[:, :, None, :], positions, k_pos,
                         core=self.cfg.attention.core,
                         core_backward=self.cfg.attention.core_backward)        # [B,T,1+K,Dv]

    n_shared = 1 if self.shared_q_proj is not None else 0
    w_o = self.o_experts.value.astype(dt)
    out_fn = lambda r, sizes: gmm(r, w_o, sizes, backend=backend, fp8=self.cfg.fp8)
    y = dispatch.apply_experts(o[:, :, n_shared:].reshape(n, k, -1), plan, gates, out_fn)
    y = y.reshape(b, t, d)
    if self.shared_o_proj is not None:
      y = y + self.shared_o_proj(o[:, :, 0])
    routes = {"attention": route}
    return (y, routes) if cache is None else (y, routes, cache)
