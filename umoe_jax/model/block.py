"""One pre-norm decoder layer: h += Attention(norm(h)); h += FFN(norm(h)).

The block owns the layer's routed expert pool. With `moe.share_pool` (UMoE) the attention and the FFN
sub-layers route into the same `ExpertPool`; otherwise each MoE sub-layer gets its own pool.
"""
from __future__ import annotations

import jax
from flax import nnx

from umoe_jax.config import ModelConfig
from umoe_jax.model.attention import ATTENTIONS
from umoe_jax.model.experts import ExpertPool
from umoe_jax.model.ffn import DenseFFN, MoEFFN
from umoe_jax.model.layers import RMSNorm


def make_expert_pool(cfg: ModelConfig, rngs: nnx.Rngs) -> ExpertPool:
  return ExpertPool(cfg.moe.n_experts, cfg.d_model, cfg.moe.d_expert, activation=cfg.moe.activation,
                    std=cfg.init_std, param_dtype=cfg.param_dtype, compute_dtype=cfg.compute_dtype,
                    gmm_backend=cfg.gmm_backend, rngs=rngs)


class DecoderBlock(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    norm = dict(eps=cfg.norm_eps, param_dtype=cfg.param_dtype, rngs=rngs)
    self.attention_norm = RMSNorm(cfg.d_model, **norm)
    self.attention = ATTENTIONS.get(cfg.attention.kind)(cfg, rngs=rngs)
    self.ffn_norm = RMSNorm(cfg.d_model, **norm)
    self.ffn = MoEFFN(cfg, rngs=rngs) if cfg.ffn_uses_experts else DenseFFN(cfg, rngs=rngs)

    att_pool, ffn_pool = cfg.attention_uses_experts, cfg.ffn_uses_experts
    self.experts = make_expert_pool(cfg, rngs) if (att_pool or ffn_pool) else None
    # A second pool only when both sub-layers route but must not share (an ablation).
    self.ffn_experts = (make_expert_pool(cfg, rngs)
                        if att_pool and ffn_pool and not cfg.moe.share_pool else None)

  def __call__(self, h: jax.Array, positions: jax.Array):
    """h [B, T, D] -> (h [B, T, D], {router_name: RouterOutput})."""
    a, att_routes = self.attention(self.attention_norm(h), positions, experts=self.experts)
    h = h + a.astype(h.dtype)
    ffn_pool = self.ffn_experts if self.ffn_experts is not None else self.experts
    f, ffn_routes = self.ffn(self.ffn_norm(h), experts=ffn_pool)
    h = h + f.astype(h.dtype)
    return h, {**att_routes, **ffn_routes}
