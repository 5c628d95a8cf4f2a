"""Parameters and MACs of the routers, read off the router classes (`RouterStats` of
`umoe_jax.model.routers`: each family states its own counts beside its code)."""
from __future__ import annotations

from umoe_jax.config import ModelConfig, router_mixing
from umoe_jax.stats.real_model import _layer_routers, router_class


def router_params(cfg: ModelConfig, n_experts: int, sublayer: str) -> int:
  """Parameters of one router of `sublayer` ("attention" / "ffn") over `n_experts` experts: its
  class's `param_count` (beside each router family in `umoe_jax.model.routers`; a D x E map unless
  the family says otherwise), for the sub-layer's router config (`ModelConfig.router_for`), plus
  the aux-loss-free balancing's selection bias [E] when `router.bias_update_rate` > 0."""
  router = cfg.router_for(sublayer)
  bias = n_experts if router.bias_update_rate > 0 else 0
  return router_class(router.kind).param_count(cfg, router, n_experts) + bias


def router_macs(cfg: ModelConfig, n_experts: int, sublayer: str) -> int:
  """Forward MACs per token of one router of `sublayer` (`token_mac_count` of its class). The
  mixing over earlier tokens of similarity_aware / attention_aware depends on T: `router_pair_macs`."""
  router = cfg.router_for(sublayer)
  return router_class(router.kind).token_mac_count(cfg, router, n_experts)


def router_pair_macs(cfg: ModelConfig) -> int:
  """Forward MACs per (query token, key token) pair of one layer's routers (`pair_mac_count` of
  their class: the mixing routers'; 0 for every other kind). The routers of a layer (with their own
  configs) are read off the model, when any of them mixes (the model is not built otherwise)."""
  if all(router_mixing(cfg.router_for(s)) == "none" for s in cfg.routed_sublayers):
    return 0
  return sum(cls.pair_mac_count(cfg, router, e) for cls, router, e in _layer_routers(cfg))
