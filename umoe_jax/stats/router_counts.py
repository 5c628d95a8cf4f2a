"""Parameters and MACs of the routers, read off the router classes (`RouterStats` of
`umoe_jax.model.routers`: each family states its own counts beside its code; `router_params` and
`router_macs` of one sub-layer's router live there too, for the attention classes' statistics)."""
from __future__ import annotations

from umoe_jax.config import ModelConfig, router_mixing
from umoe_jax.model.routers import router_macs, router_params  # noqa: F401  (re-exported)
from umoe_jax.stats.real_model import _layer_routers


def router_pair_macs(cfg: ModelConfig) -> int:
  """Forward MACs per (query token, key token) pair of one layer's routers (`pair_mac_count` of
  their class: the mixing routers'; 0 for every other kind). The routers of a layer (with their own
  configs) are read off the model, when any of them mixes (the model is not built otherwise)."""
  if all(router_mixing(cfg.router_for(s)) == "none" for s in cfg.routed_sublayers):
    return 0
  return sum(cls.pair_mac_count(cfg, router, e) for cls, router, e in _layer_routers(cfg))
