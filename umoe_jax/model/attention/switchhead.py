"""SwitchHead (Csordás et al., NeurIPS 2024): few heads whose value and output projections are MoEs.

H heads with dense queries and keys (q, k [H, Dk], RoPE over all of Dk). For head h, the value and the
output projections are each a mixture of E experts (`attention.n_experts` per head, for V and for O),
with their own router per head and per projection, `attention.top_k` picks each:

    v_s^h = sum_{e in top(s)} g^{h,V}_{s,e} x_s W_V^{h,e}                    (routed by the source token)
    o_t^h = softmax(q_t^h K^{hT} / sqrt(Dk)) V^h                             [Dv]
    y_t   = sum_h sum_{e in top(t)} g^{h,O}_{t,e} o_t^h W_O^{h,e}             (routed by the destination)

Both routers of a head read the layer's (normed) input x. The gate is the model's router
(`model.router`, or `model.attention.router`), which gives the two published variants:

  * UMoE repository's baseline (`configs.common.model("switchhead", ...)`): 4 heads, 15 experts per
    head, top-1 of a softmax router with DeepSeek's sequence-wise balance loss (0.001);
  * the original paper's (`"switchhead_sigmoid"`): non-competitive sigmoid gates
    (`router.kind="topk_sigmoid"`), top-2 of ~4 experts per head, no balance loss.

All H*E value experts (and all H*E output experts) are one grouped matmul: (head, expert) pairs are
groups h*E + e, each token has H*K slots. Decoding caches every head's key and its value *after* the
expert V projection: H (Dk + Dv) per token and layer, like dense MHA.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from umoe_jax.config import ModelConfig
from umoe_jax.counting import Count, linear
from umoe_jax.model.attention.common import ATTENTIONS
from umoe_jax.model.attention.cores import causal_attention
from umoe_jax.model.attention.mha import HeadsQK
from umoe_jax.model.attention.stats import MHAStats
from umoe_jax.model.layers import make_param, normal_init
from umoe_jax.model.routers import (RouterOutput, call_router, fold_rng, make_router, router_macs,
                                    router_params)
from umoe_jax.ops import dispatch
from umoe_jax.ops.gmm import gmm
from umoe_jax.parallel import rules as ax


class SwitchHeadStats(MHAStats):
  """Dense q, k (H heads); H x E value experts [D, Dv] and output experts [Dv, D], K picks each;
  2H routers of E logits. Scores, mixing and the cache as dense MHA's (`MHAStats`)."""

  @classmethod
  def params(cls, cfg):
    a, d = cfg.attention, cfg.d_model
    per_head = linear(d, a.v_head_dim) + linear(a.v_head_dim, d)        # one V and one O expert
    h, e = a.n_heads, a.n_experts
    return {"attention": Count(2 * linear(d, h * a.head_dim)),
            "attention_routed": Count(h * e * per_head, h * a.top_k * per_head),
            "routers": Count(2 * h * router_params(cfg, e, "attention"))}

  @classmethod
  def token_macs(cls, cfg):
    p = cls.params(cfg)
    return {"attention": p["attention"].total, "attention_routed": p["attention_routed"].active,
            "routers": 2 * cfg.attention.n_heads * router_macs(cfg, cfg.attention.n_experts, "attention")}


class HeadExperts(nnx.Module):
  """H independent projection MoEs (one per head) of E experts each, run as one grouped matmul.

  w [H*E, D_in, D_out] (group h*E + e = expert e of head h); router[h] picks K of head h's E.
  """

  def __init__(self, cfg: ModelConfig, d_in: int, d_out: int, axes, *, rngs: nnx.Rngs):
    att = cfg.attention
    self.cfg = cfg
    self.n_heads, self.n_experts, self.top_k = att.n_heads, att.n_experts, att.top_k
    router_cfg = cfg.router_for("attention")
    self.router = nnx.List([make_router(router_cfg, cfg.d_model, att.n_experts, att.top_k,
                                        param_dtype=cfg.param_dtype, rngs=rngs)
                            for _ in range(att.n_heads)])
    self.w = make_param(rngs, normal_init(cfg.init_std), (att.n_heads * att.n_experts, d_in, d_out),
                        axes, cfg.param_dtype)

  def route(self, gate_input: jax.Array, route_context=None):
    """gate_input [B, T, D] -> (ids [N, H*K] into the H*E groups, gates [N, H*K], RouterOutputs).
    Head h's router gets the context's key folded with h (its own jitter noise). Slots without a
    pick (a router's `slot_mask`: top-P, SMoE-Dropout; gate 0) get the id H*E of no group, so the
    dispatch gives them no rows (`dispatch.mask_slots`)."""
    outs = [call_router(r, gate_input, fold_rng(route_context, h)) for h, r in enumerate(self.router)]
    n = gate_input.shape[0] * gate_input.shape[1]
    ids = jnp.concatenate([o.expert_ids.reshape(n, -1) + h * self.n_experts
                           for h, o in enumerate(outs)], axis=1)                # [N, H*K]
    gates = jnp.concatenate([o.gates.reshape(n, -1) for o in outs], axis=1)    # [N, H*K]
    if any(o.slot_mask is not None for o in outs):
      mask = jnp.concatenate([jnp.ones(o.expert_ids.shape, bool) if o.slot_mask is None
                              else o.slot_mask for o in outs], axis=-1).reshape(n, -1)
      ids = dispatch.mask_slots(ids, mask, self.n_experts * self.n_heads)
    return ids, gates, outs

  def __call__(self, x: jax.Array, ids: jax.Array, gates: jax.Array, *, per_head_input: bool,
               sum_heads: bool) -> jax.Array:
    """Applies the picked experts and combines the K picks of each head with their gates.

    Args:
      x: [N, D_in] (every head reads the token) or [N, H, D_in] (head h reads x[:, h]).
      ids, gates: [N, H*K] from `route`.
      per_head_input: whether x is per head.
      sum_heads: also sum over heads -> [N, D_out]; else [N, H, D_out].
    """
    n, hk = ids.shape
    h, k = self.n_heads, self.top_k
    dt, backend = self.cfg.compute_dtype, self.cfg.gmm_backend
    w = self.w.value.astype(dt)
    plan = dispatch.make_plan(ids, self.n_experts * self.n_heads)
    if per_head_input:  # slot j of a token belongs to head j // K: repeat each head's row K times
      x = jnp.repeat(x, k, axis=1)                                              # [N, H*K, D_in]
    fn = lambda rows, sizes: gmm(rows, w, sizes, backend=backend, fp8=self.cfg.fp8)
    if sum_heads:
      return dispatch.apply_experts(x.astype(dt), plan, gates, fn)             # [N, D_out]
    rows = dispatch.permute(x.astype(dt), plan, hk)
    y = dispatch.unpermute(fn(rows, plan.group_sizes), plan).reshape(n, h, k, -1)
    return dispatch.combine(y.reshape(n * h, k, -1), gates.reshape(n * h, k)).reshape(n, h, -1)


@ATTENTIONS.register("switchhead")
class SwitchHeadAttention(HeadsQK):
  """Dense per-head q, k; per-head MoE value and output projections."""

  stats = SwitchHeadStats

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    super().__init__(cfg, rngs=rngs)
    att, d = cfg.attention, cfg.d_model
    self.v_experts = HeadExperts(cfg, d, att.v_head_dim, (ax.EXPERT, ax.EMBED, ax.HEAD_DIM), rngs=rngs)
    self.o_experts = HeadExperts(cfg, att.v_head_dim, d, (ax.EXPERT, ax.HEAD_DIM, ax.EMBED), rngs=rngs)

  def named_routers(self) -> dict[str, nnx.Module]:
    """{"attention_v{h}", "attention_o{h}": router}, the names of the routes it returns."""
    return {**{f"attention_v{h}": r for h, r in enumerate(self.v_experts.router)},
            **{f"attention_o{h}": r for h, r in enumerate(self.o_experts.router)}}

  def __call__(self, x: jax.Array, positions: jax.Array, *, experts=None, cache=None,
               route_context=None):
    """x [B, T, D] (normed) -> (y [B, T, D], {"attention_v{h}", "attention_o{h}": RouterOutput})."""
    del experts
    b, t, d = x.shape
    n, h = b * t, self.n_heads
    x = x.astype(self.cfg.compute_dtype)
    q, k = self.queries_keys(x, positions)

    # V's and O's routers draw their own jitter noise (keys folded with 0 / 1, then the head).
    v_ids, v_gates, v_routes = self.v_experts.route(x, fold_rng(route_context, 0))
    o_ids, o_gates, o_routes = self.o_experts.route(x, fold_rng(route_context, 1))
    with jax.named_scope("value_experts"):
      v = self.v_experts(x.reshape(n, d), v_ids, v_gates, per_head_input=False, sum_heads=False)
      v = v.reshape(b, t, h, self.v_head_dim)                                     # [B, T, H, Dv]

    k_pos = positions
    if cache is not None:
      cache = cache.append(k=k, v=v)
      k, v, k_pos = cache.arrays["k"], cache.arrays["v"], cache.key_positions
    o = causal_attention(q, k, v, positions, k_pos, core=self.cfg.attention.core,
                         core_backward=self.cfg.attention.core_backward)        # [B, T, H, Dv]

    with jax.named_scope("output_experts"):
      y = self.o_experts(o.reshape(n, h, -1), o_ids, o_gates, per_head_input=True, sum_heads=True)
    routes: dict[str, RouterOutput] = {}
    for i in range(h):
      routes[f"attention_v{i}"] = v_routes[i]
      routes[f"attention_o{i}"] = o_routes[i]
    y = y.reshape(b, t, d)
    return (y, routes) if cache is None else (y, routes, cache)
