"""Statistics of dense multi-head attention ("mha") and UMoE's pre-mixing attention ("premix"),
which their model classes carry as `stats` (SwitchHead's and post-mixing's extend them). Per layer;
MACs per token or per (query, key) pair; `umoe_jax.stats` sums them up."""
from __future__ import annotations

from typing import Optional

from umoe_jax.counting import AttentionStats, Count, linear, low_rank_expert_count, mlp
from umoe_jax.model.routers.base import router_macs, router_params


class MHAStats(AttentionStats):
  """Dense multi-head attention: q, k [H, d_k], v [H, d_v], o [H d_v -> d]."""

  @classmethod
  def params(cls, cfg):
    a, d = cfg.attention, cfg.d_model
    return {"attention": Count(2 * linear(d, a.n_heads * a.head_dim) + linear(d, a.n_heads * a.v_head_dim)
                               + linear(a.n_heads * a.v_head_dim, d))}

  @classmethod
  def token_macs(cls, cfg):
    return {"attention": cls.params(cfg)["attention"].total}

  @classmethod
  def pair_macs(cls, cfg):
    a = cfg.attention
    return {"attention_scores": a.n_heads * a.head_dim, "attention_mix": a.n_heads * a.v_head_dim}

  @classmethod
  def kv_cache(cls, cfg):
    a = cfg.attention
    return {"key": a.n_heads * a.head_dim, "value": a.n_heads * a.v_head_dim}


class PreMixStats(AttentionStats):
  """UMoE pre-mixing attention: router, one key head, shared + residual queries, k_att routed
  low-rank queries, 1 + k_att query heads mixing the hidden states (width d), the always-on expert;
  the k_att routed experts are picks from the layer's pool.

  With `attention.latent_dim` = c (the official `mla` variant) the values are X W_latent (d -> c,
  cached) and each mixed vector goes back to d through W_code2value (c -> d) before its expert.
  """

  @classmethod
  def _n_queries(cls, cfg) -> int:
    return cfg.attention.top_k + (1 if cfg.attention.n_shared_experts else 0)

  @classmethod
  def _latent(cls, cfg) -> Optional[int]:
    return cfg.attention.latent_dim

  @classmethod
  def params(cls, cfg):
    a, d, e = cfg.attention, cfg.d_model, cfg.moe.n_experts
    dense = linear(d, a.head_dim)                                       # k_proj
    dense += linear(d, a.head_dim) if a.n_shared_experts else 0         # shared_q_proj
    dense += linear(d, a.head_dim) if a.q_lora_rank is not None else 0  # q_res_proj
    if cls._latent(cfg):
      dense += 2 * linear(d, cls._latent(cfg))                          # latent_code, code2value
    per_expert, lora_norm = low_rank_expert_count(cfg)
    return {"attention": Count(dense),
            "attention_routed": Count(e * per_expert, a.top_k * per_expert),
            "routers": Count(router_params(cfg, e, "attention")),
            "shared_experts": Count(mlp(cfg, cfg.moe.d_expert * a.n_shared_experts)),
            "norms": Count(lora_norm)}

  @classmethod
  def pool_picks(cls, cfg):
    return cfg.attention.top_k

  @classmethod
  def token_macs(cls, cfg):
    a, d = cfg.attention, cfg.d_model
    p = cls.params(cfg)
    proj = linear(d, a.head_dim) * (1 + bool(a.n_shared_experts) + (a.q_lora_rank is not None))
    if cls._latent(cfg):  # latent code of every token, code -> d for every mixed vector
      proj += linear(d, cls._latent(cfg)) * (1 + cls._n_queries(cfg))
    return {"attention": proj, "attention_routed": p["attention_routed"].active,
            "routers": router_macs(cfg, cfg.moe.n_experts, "attention"),
            "shared_experts": p["shared_experts"].total}

  @classmethod
  def pair_macs(cls, cfg):
    n = cls._n_queries(cfg)
    return {"attention_scores": n * cfg.attention.head_dim,
            "attention_mix": n * (cls._latent(cfg) or cfg.d_model)}

  @classmethod
  def kv_cache(cls, cfg):
    return {"key": cfg.attention.head_dim, "value": cls._latent(cfg) or cfg.d_model}
