"""Statistics of the FFN kinds: a dense MLP ("dense"), routed experts from the layer's pool ("moe"),
no FFN sub-layer ("none"). Per layer; MACs per token."""
from __future__ import annotations

from umoe_jax.counting import Count, mlp
from umoe_jax.stats.kinds import FFN_STATS, FFNStats
from umoe_jax.stats.router_counts import router_macs, router_params


@FFN_STATS.register("dense")
class DenseFFNStats(FFNStats):
  """A dense MLP D -> d_ff -> D (2 matrices, 3 when `moe.gated`) and its RMSNorm."""

  @classmethod
  def params(cls, cfg):
    return {"ffn": Count(mlp(cfg, cfg.ffn.d_ff)), "norms": Count(cfg.d_model)}

  @classmethod
  def token_macs(cls, cfg):
    return {"ffn": mlp(cfg, cfg.ffn.d_ff)}


@FFN_STATS.register("moe")
class MoEFFNStats(FFNStats):
  """Router + k_ffn picks from the layer's pool + the always-on expert (width n_shared * d_e).

  `router.share_att_ffn` (reuse the attention router's weights) and `moe.share_always_on` (reuse
  the attention's always-on expert) remove those parameters, not their MACs (new inputs)."""

  @classmethod
  def _reuses(cls, cfg, flag_owner, flag) -> bool:
    return bool(getattr(flag_owner, flag, False)) and cfg.attention_uses_experts

  @classmethod
  def token_macs(cls, cfg):
    return {"routers": router_macs(cfg, cfg.moe.n_experts, "ffn"),
            "shared_experts": mlp(cfg, cfg.moe.d_expert * cfg.ffn.n_shared_experts)}

  @classmethod
  def params(cls, cfg):
    macs = cls.token_macs(cfg)
    return {"routers": Count(0 if cls._reuses(cfg, cfg.router, "share_att_ffn")
                             else router_params(cfg, cfg.moe.n_experts, "ffn")),
            "shared_experts": Count(0 if cls._reuses(cfg, cfg.moe, "share_always_on")
                                    else macs["shared_experts"]),
            "norms": Count(cfg.d_model)}

  @classmethod
  def pool_picks(cls, cfg):
    return cfg.ffn.top_k


@FFN_STATS.register("none")
class NoFFNStats(FFNStats):
  """No FFN sub-layer (and no FFN norm)."""

  @classmethod
  def params(cls, cfg):
    return {}

  @classmethod
  def token_macs(cls, cfg):
    return {}
