"""FFN sub-layers: the dense MLP and the routed MoE FFN (fine-grained experts + always-on expert)."""
from __future__ import annotations

import jax
from flax import nnx

from umoe_jax.config import ModelConfig
from umoe_jax.model.layers import MLP
from umoe_jax.model.routers import call_router, make_router


class DenseFFN(nnx.Module):
  """x [B, T, D] -> (MLP(x), {})."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.mlp = MLP(cfg.d_model, cfg.ffn.d_ff, activation=cfg.moe.activation, std=cfg.init_std,
                   param_dtype=cfg.param_dtype, compute_dtype=cfg.compute_dtype, rngs=rngs,
                   gated=cfg.moe.gated, fp8=cfg.fp8)

  def __call__(self, x: jax.Array, *, experts=None, route_context=None):
    del experts, route_context
    return self.mlp(x), {}


class MoEFFN(nnx.Module):
  """sum_k g_k E_k(x) + E_shared(x): DeepSeekMoE-style routed experts plus an always-on expert.

  The routed experts are the layer's pool, passed in at call time: in UMoE the same pool serves the
  attention sub-layer; this sub-layer owns only its router and its always-on expert.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    moe, ffn = cfg.moe, cfg.ffn
    self.router = make_router(cfg.router_for("ffn"), cfg.d_model, moe.n_experts, ffn.top_k,
                              param_dtype=cfg.param_dtype, rngs=rngs)
    self.shared_expert = (
        MLP(cfg.d_model, moe.d_expert * ffn.n_shared_experts, activation=moe.activation,
            std=cfg.init_std, param_dtype=cfg.param_dtype, compute_dtype=cfg.compute_dtype, rngs=rngs,
            gated=moe.gated, fp8=cfg.fp8)
        if ffn.n_shared_experts and not moe.share_always_on else None)  # shared: set by the block

  def __call__(self, x: jax.Array, *, experts=None, route_context=None):
    """x [B, T, D] (normed) -> (y [B, T, D], {"ffn": RouterOutput}); `route_context` goes to the router."""
    if experts is None:
      raise ValueError("the MoE FFN needs the layer's expert pool (experts=...)")
    b, t, d = x.shape
    x = x.astype(self.cfg.compute_dtype)
    route = call_router(self.router, x, route_context)
    k = route.expert_ids.shape[-1]
    # Slots without a pick (top-P, SMoE-Dropout, expert choice: gate 0) go through no expert.
    mask = None if route.slot_mask is None else route.slot_mask.reshape(-1, k)
    y = experts.route(x.reshape(b * t, d), route.expert_ids.reshape(-1, k),
                      route.gates.reshape(-1, k), slot_mask=mask).reshape(b, t, d)
    if self.shared_expert is not None:
      y = y + self.shared_expert(x)
    return y, {"ffn": route}
