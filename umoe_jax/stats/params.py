"""Analytic parameter counts (total and active, by component) and their check against the real model.

The definitions of total and active parameters are in the `umoe_jax.stats` docstring. Per layer the
attention and FFN kinds state their own parameters (`umoe_jax.stats.kinds`); the routed expert pools
are counted here, once per pool, since UMoE's attention and FFN pick from the same one.
"""
from __future__ import annotations

from typing import Any

from umoe_jax.config import ModelConfig
from umoe_jax.counting import (COMPONENTS, Count, as_model_config, linear, merge, ordered,
                               routed_expert)
from umoe_jax.stats.kinds import attention_stats, ffn_stats
from umoe_jax.stats.real_model import model_params


def layer_pools(cfg: ModelConfig) -> list[tuple[int, bool]]:
  """Routed expert pools of one layer, as (picks per token it receives, whether it is an AoE pool:
  the FFN routes into it with kind 'aoe') (mirrors block.py)."""
  att_uses, ffn_uses = cfg.attention_uses_experts, cfg.ffn_uses_experts
  picks_att = attention_stats(cfg.attention.kind).pool_picks(cfg) if att_uses else 0
  picks_ffn = ffn_stats(cfg.ffn.kind).pool_picks(cfg) if ffn_uses else 0
  aoe = ffn_uses and cfg.router_for("ffn").kind == "aoe"
  if att_uses and ffn_uses and not cfg.moe.share_pool:
    return [(picks_att, False), (picks_ffn, aoe)]
  if att_uses or ffn_uses:
    return [(picks_att + picks_ffn, aoe)]
  return []


def _pool_params(cfg: ModelConfig) -> list[Count]:
  """The routed pools of the model with the distinct experts one token can touch in each."""
  e, out = cfg.moe.n_experts, []
  for picks, aoe in layer_pools(cfg):
    per_expert, scoring = routed_expert(cfg, aoe)
    # every token also reads the scoring part of the experts it does not pick (AoE's codes)
    active = lambda picked: picked * per_expert + (e - picked) * scoring
    if cfg.moe.share_across_layers:  # one pool, every layer picks from it
      out.append(Count(e * per_expert, active(min(e, picks * cfg.n_layers))))
    else:
      out.append(Count(e * per_expert, active(min(e, picks))) * cfg.n_layers)
  return out


def layer_params(cfg: Any) -> dict[str, Count]:
  """Analytic parameters of one decoder layer, by component, without the routed pools."""
  cfg = as_model_config(cfg)
  out: dict[str, Count] = {"norms": Count(cfg.d_model)}  # the attention norm; the FFN's has its own
  merge(out, attention_stats(cfg.attention.kind).params(cfg))
  merge(out, ffn_stats(cfg.ffn.kind).params(cfg))
  return ordered(out, COMPONENTS)


def analytic_params(cfg: Any) -> dict[str, Count]:
  """Analytic parameters of the whole model, by component (zeros left out)."""
  cfg = as_model_config(cfg)
  v, d = cfg.vocab_size, cfg.d_model
  out = {"embedding": Count(v * d), "lm_head": Count(linear(d, v)), "norms": Count(d)}
  merge(out, {name: c * cfg.n_layers for name, c in layer_params(cfg).items()})
  for pool in _pool_params(cfg):
    merge(out, {"experts": pool})
  return ordered(out, COMPONENTS)


def param_mismatches(cfg: Any) -> dict[str, tuple[int, int]]:
  """Components where the real model and the analytic count differ: {name: (model, analytic)}."""
  real, analytic = model_params(cfg), analytic_params(cfg)
  names = set(real) | set(analytic)
  out = {}
  for n in names:
    r, a = real.get(n, 0), analytic[n].total if n in analytic else 0
    if r != a:
      out[n] = (r, a)
  return out


def total_params(cfg: Any, *, from_model: bool = True) -> int:
  """All parameters; counted on the real model unless `from_model=False` (analytic)."""
  if from_model:
    return sum(model_params(cfg).values())
  return sum(c.total for c in analytic_params(cfg).values())


def active_params(cfg: Any, *, non_embedding: bool = False) -> int:
  """Parameters one token's forward pass reads (defined in the `umoe_jax.stats` docstring)."""
  comps = analytic_params(cfg)
  skip = ("embedding", "lm_head") if non_embedding else ()
  return sum(c.active for n, c in comps.items() if n not in skip)
