"""Attention sub-layers, one class per variant, chosen by `model.attention.kind`.

Contract of a variant (a class registered in `ATTENTIONS`):
  uses_expert_pool: bool                      class attribute: routes into the layer's expert pool
  validate(cfg: ModelConfig) -> None          classmethod: raise ConfigError naming key and value
  __init__(cfg: ModelConfig, *, rngs)
  __call__(x [B, T, D] (normed), positions [B, T], *, experts=None)
      -> (y [B, T, D], {router_name: RouterOutput})
"""
from umoe_jax.model.attention.common import ATTENTIONS, causal_attention  # noqa: F401
from umoe_jax.model.attention import mha, premix  # noqa: F401  (register the variants)
