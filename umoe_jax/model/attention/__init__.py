"""Attention sub-layers, one class per variant, chosen by `model.attention.kind`.

Contract of a variant (a class registered in `ATTENTIONS`; its name and the traits config validation
reads, e.g. whether it routes into the layer's expert pool, are one row of
`umoe_jax.kinds.ATTENTION_KINDS`, its config checks are in `umoe_jax.config.checks`):
  cache_shapes(cfg: ModelConfig) -> {name: per-token shape}
                                              classmethod: what one layer caches per token for
                                              decoding (`umoe_jax.model.cache`)
  __init__(cfg: ModelConfig, *, rngs)
  __call__(x [B, T, D] (normed), positions [B, T], *, experts=None, cache=None, route_context=None)
      -> (y [B, T, D], {router_name: RouterOutput})
      its routers are called as `call_router(router, x, route_context)` (the block's extras:
      token ids, step, jitter key; a variant with several routers folds the key per router)
      with cache (a `LayerCache`): -> (y, routes, cache.append(<this pass's entries>)), attending
      over every cached slot with key positions `cache.key_positions` (negative = never attend)
"""
from umoe_jax.model.attention.common import ATTENTIONS  # noqa: F401
from umoe_jax.model.attention.cores import causal_attention  # noqa: F401
from umoe_jax.model.attention import mha, moa, postmix, premix, switchhead  # noqa: F401  (register)
