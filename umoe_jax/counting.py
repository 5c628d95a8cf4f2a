"""Counting primitives for parameters and MACs: the `Count` of a component, the counts of the
building blocks (a linear map, an MLP, a routed expert, a low-rank expert query), the component names,
the config input, and the statistics contract each attention / FFN kind fills in.

A leaf: it imports only the config, so the model's classes can carry their own counts (`stats` of an
attention class, `RouterStats` of a router) and `umoe_jax.stats`, which sums them up and reads the
model, imports this and the model, never the reverse.

Each building block's weights equal its forward MACs per token (bias-free matrices), so one
function serves both counts.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence

from umoe_jax.config import ModelConfig, model_config, resolve

# Parameter components, in table order.
COMPONENTS = ("embedding", "attention", "attention_routed", "routers", "experts", "shared_experts",
              "ffn", "norms", "lm_head")
# MAC components, in table order.
MAC_COMPONENTS = ("attention", "attention_routed", "attention_scores", "attention_mix", "routers",
                  "experts", "shared_experts", "ffn", "lm_head")


@dataclasses.dataclass(frozen=True)
class Count:
  """Parameters of one component: all of them, and those one token reads (the definition of
  active parameters is in the `umoe_jax.stats` docstring)."""
  total: int
  active: Optional[int] = None

  def __post_init__(self):
    if self.active is None:
      object.__setattr__(self, "active", self.total)

  def __add__(self, other: "Count") -> "Count":
    return Count(self.total + other.total, self.active + other.active)

  def __mul__(self, n: int) -> "Count":
    return Count(self.total * n, self.active * n)


def linear(d_in: int, d_out: int) -> int:
  """Weights of a bias-free linear map, = its MACs per token."""
  return int(d_in) * int(d_out)


def mlp(cfg: ModelConfig, d_hidden: int) -> int:
  """Weights (= MACs per token) of one MLP D -> d_hidden -> D: 2 matrices, 3 when `moe.gated`."""
  return (3 if cfg.moe.gated else 2) * linear(cfg.d_model, d_hidden)


def routed_expert(cfg: ModelConfig, aoe: bool = False) -> tuple[int, int]:
  """(weights of one routed pool expert = its MACs per pick, the part every token reads whether
  picked or not). An MLP D -> d_e -> D; in an AoE pool (`aoe`: an FFN router of kind 'aoe') the
  activated projection is factorised through rank r, D x r + r x d_e, and every token computes
  every expert's D x r code (its score)."""
  f = cfg.moe.d_expert
  if not aoe:
    return mlp(cfg, f), 0
  r = cfg.router_for("ffn").aoe_dim
  return linear(cfg.d_model, r) + linear(r, f) + (2 if cfg.moe.gated else 1) * linear(cfg.d_model, f), \
      linear(cfg.d_model, r)


def low_rank_expert_count(cfg: ModelConfig) -> tuple[int, int]:
  """(parameters of one routed low-rank query/key expert, of the rank-r code's RMSNorm): the
  projections of `attention.common.low_rank_expert_params` (pre- and post-mixing)."""
  a, d = cfg.attention, cfg.d_model
  if a.q_lora_rank is None:
    return linear(d, a.head_dim), 0
  return (linear(d, a.q_lora_rank) + linear(a.q_lora_rank, a.head_dim),
          a.q_lora_rank if a.q_lora_norm else 0)


def merge(into: dict, items: Mapping[str, Any]) -> dict:
  """Adds `items` into `into` by name (ints or `Count`s); returns `into`."""
  for name, value in items.items():
    into[name] = into[name] + value if name in into else value
  return into


def ordered(d: Mapping[str, Any], order: Sequence[str]) -> dict:
  """Known names in `order` first, unknown ones after; drops zeros."""
  names = [n for n in order if n in d] + sorted(n for n in d if n not in order)
  keep = lambda v: (v.total != 0 or v.active != 0) if isinstance(v, Count) else v != 0
  return {n: d[n] for n in names if keep(d[n])}


def as_model_config(cfg: Any, name: str = "") -> ModelConfig:
  """ModelConfig | config.model ConfigDict | experiment ConfigDict (uses .model) -> ModelConfig.
  `name` (e.g. the config's file) is what the error for a config with no model in it calls it."""
  if isinstance(cfg, ModelConfig):
    return resolve(cfg)  # fill the derived defaults (router.aoe_dim, ...) like the model does
  if isinstance(cfg, Mapping) or hasattr(cfg, "keys"):
    cfg = _model_section(cfg, name or "the config")
  return model_config(cfg)


def _model_section(cfg: Mapping, name: str) -> Mapping:
  """The `model` section of an experiment config, or `cfg` itself when it is one; a ConfigError
  for a config that is neither (were "unknown key model.<its first key>")."""
  if "model" in cfg and "d_model" not in cfg:
    return cfg["model"]
  keys = set(cfg.keys())
  if keys and not keys & {f.name for f in dataclasses.fields(ModelConfig)}:
    from umoe_jax.config import ConfigError
    raise ConfigError(f"{name} has no model section (config.model) and no model key such as "
                      f"d_model; its keys: {', '.join(sorted(keys))}")
  return cfg


class SublayerStats:
  """What every sub-layer kind (attention or FFN) states, per layer; class methods of a
  `ModelConfig`. How to add a kind: the docstring of `umoe_jax.stats.kinds`."""

  @classmethod
  def params(cls, cfg: ModelConfig) -> dict[str, Count]:
    """Parameters the sub-layer owns, by component (not the layer's routed expert pool)."""
    raise NotImplementedError

  @classmethod
  def pool_picks(cls, cfg: ModelConfig) -> int:
    """Experts of the layer's routed pool one token's sub-layer runs through (0: no pool)."""
    return 0

  @classmethod
  def token_macs(cls, cfg: ModelConfig) -> dict[str, int]:
    """Forward MACs per token that do not depend on the context (projections, routers, ...),
    excluding the pool experts (counted at the layer from `pool_picks`)."""
    raise NotImplementedError


class AttentionStats(SublayerStats):
  """Statistics of one attention kind, per layer; all class methods of a `ModelConfig`.

  Subclass, set it as the model class's `stats` (or register it in `umoe_jax.stats.ATTENTION_STATS`),
  and fill in `params`, `token_macs`, `pair_macs`, `kv_cache`.
  """

  @classmethod
  def pair_macs(cls, cfg: ModelConfig) -> dict[str, int]:
    """Forward MACs per (query token, attended key) pair: q.k^T and a.V over all query heads."""
    raise NotImplementedError

  @classmethod
  def pairs(cls, cfg: ModelConfig, seq_len: int, causal: bool) -> int:
    """(query, key) pairs of one sequence: T*T like the paper, or T(T+1)/2 visible ones."""
    return seq_len * (seq_len + 1) // 2 if causal else seq_len * seq_len

  @classmethod
  def kv_cache(cls, cfg: ModelConfig) -> Optional[dict[str, int]]:
    """Values cached per token per layer for decoding, by name. Default None: `umoe_jax.stats`
    then takes the sizes of the model class's `cache_shapes(cfg)` (the decoding cache's layout,
    `umoe_jax.model.cache`), which this leaf cannot read."""
    return None


class FFNStats(SublayerStats):
  """Statistics of one FFN kind, per layer (same conventions as `AttentionStats`): `params`,
  `token_macs` and, for a routed pool, `pool_picks`."""
