"""The registries of the attention and FFN kinds' statistics and their lookup (the contract itself,
`AttentionStats` / `FFNStats`, is in the leaf `umoe_jax.counting`).

Adding an attention kind
------------------------
Statistics are looked up by `model.attention.kind` in `ATTENTION_STATS` (FFN kinds in `FFN_STATS`).
The model class of a new variant carries its statistics as a class attribute, `stats = MoAStats`
(or registers them in `ATTENTION_STATS`); the model imports the contract from the leaf
`umoe_jax.counting`, never `umoe_jax.stats` (which imports the model)::

  from umoe_jax.counting import AttentionStats, Count, linear

  class MoAStats(AttentionStats):       # then `stats = MoAStats` on the model class
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
does not attend over all T x T pairs (sliding window, ...). Component names are those of
`COMPONENTS` / `MAC_COMPONENTS`; the cross-check against the real model sorts a parameter into
"attention_routed" when it lives under the attention module and has an `expert` logical axis, into
"norms" when its logical axis is `norm`, and anything it cannot place into "other:<path>", which
shows up as a mismatch (`umoe_jax.stats.real_model`).

The attention kinds carry theirs on their model classes (`umoe_jax/model/attention/`; mha's and
premix's in `umoe_jax.model.attention.stats`); the FFN kinds' are in `ffn_kinds` (dense, moe, none).
"""
from __future__ import annotations

from umoe_jax.counting import AttentionStats, FFNStats, SublayerStats  # noqa: F401  (the contract)
from umoe_jax.registry import Registry
from umoe_jax.stats.real_model import attention_classes


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
