"""The statistics contract of an attention kind and of an FFN kind, their registries and lookup.

Adding an attention kind
------------------------
Statistics are looked up by `model.attention.kind` in `ATTENTION_STATS` (FFN kinds in `FFN_STATS`).
A new variant adds one class, in `umoe_jax.stats` or in its own module (importing `umoe_jax.stats`
is cheap: it loads the model lazily)::

  from umoe_jax.stats import AttentionStats, Count, linear

  class MoAStats(AttentionStats):       # then `stats = MoAStats` on the model class, or
                                        # `ATTENTION_STATS.register("moa")(MoAStats)`
    @classmethod
    def params(cls, cfg):            # per layer, by component; the layer's shared expert pool excluded
      ...
      return {"attention": Count(shared_k_v), "attention_routed": Count(total=E * per_expert,
              active=k * per_expert), "routers": Count(linear(d, E))}
    @classmethod
    def token_macs(cls, cfg):        # per token, independent of the sequence length
      return {"attention": ..., "attention_routed": k * per_expert_macs, "routers": linear(d, E)}
    @classmethod
    def pair_macs(cls, cfg):         # per (query token, visible key) pair
      return {"attention_scores": n_query_heads * d_k, "attention_mix": n_query_heads * d_v}
    @classmethod
    def kv_cache(cls, cfg):          # values cached per token per layer (optional: by default the
      return {"key": d_k, "value": d_v}  # sizes of the model class's `cache_shapes(cfg)`)

Override `pool_picks` if the variant runs tokens through the layer's routed expert pool (its
parameters and MACs are then counted once, at the layer, with the FFN's picks), and `pairs` if it
does not attend over all T x T pairs (sliding window, ...). Alternatively the model class can carry
the statistics itself as a class attribute `stats = MoAStats`. Component names are those of
`COMPONENTS` / `MAC_COMPONENTS`; the cross-check against the real model sorts a parameter into
"attention_routed" when it lives under the attention module and has an `expert` logical axis, into
"norms" when its logical axis is `norm`, and anything it cannot place into "other:<path>", which
shows up as a mismatch (`umoe_jax.stats.real_model`).

The built-in kinds are in `attention_kinds` (mha, premix) and `ffn_kinds` (dense, moe, none); the
other attention variants carry theirs on their model classes (`umoe_jax/model/attention/`).
"""
from __future__ import annotations

import math

from umoe_jax.config import ModelConfig
from umoe_jax.registry import Registry
from umoe_jax.stats.counting import Count
from umoe_jax.stats.real_model import attention_classes, model_cache_shapes


class SublayerStats:
  """What every sub-layer kind (attention or FFN) states, per layer; class methods of a
  `ModelConfig`."""

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

  Subclass, register with `@ATTENTION_STATS.register(kind)`, and fill in `params`, `token_macs`,
  `pair_macs`, `kv_cache` (see the module docstring).
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
  def kv_cache(cls, cfg: ModelConfig) -> dict[str, int]:
    """Values cached per token per layer for decoding, by name. Default: the sizes of the model
    class's `cache_shapes(cfg)` (the decoding cache's layout, `umoe_jax.model.cache`)."""
    shapes = model_cache_shapes(cfg)
    if shapes is None:
      raise NotImplementedError(f"{cls.__name__}.kv_cache: the model class of attention kind "
                                f"{cfg.attention.kind!r} declares no cache_shapes")
    return {name: math.prod(shape) for name, shape in shapes.items()}


class FFNStats(SublayerStats):
  """Statistics of one FFN kind, per layer (same conventions as `AttentionStats`): `params`,
  `token_macs` and, for a routed pool, `pool_picks`."""


ATTENTION_STATS: Registry[type] = Registry("attention statistics")
FFN_STATS: Registry[type] = Registry("ffn statistics")


def attention_stats(kind: str) -> type:
  """The statistics class of an attention kind: `ATTENTION_STATS[kind]`, else the model class's
  `stats` attribute."""
  if kind in ATTENTION_STATS:
    return ATTENTION_STATS.get(kind)
  classes = attention_classes()
  model_cls = classes.get(kind) if kind in classes else None
  stats = getattr(model_cls, "stats", None)
  if isinstance(stats, type) and issubclass(stats, AttentionStats):
    return stats
  raise ValueError(
      f"no statistics for attention kind {kind!r} (known: {', '.join(ATTENTION_STATS.names())}); "
      f"register an AttentionStats subclass with @ATTENTION_STATS.register({kind!r}) "
      "(see the docstring of umoe_jax/stats/kinds.py)")


def ffn_stats(kind: str) -> type:
  """The statistics class of an FFN kind: `FFN_STATS[kind]`."""
  return FFN_STATS.get(kind)
