"""What the real model holds, for the cross-checks and the counts its classes carry: the attention
classes by kind, the decoding cache's layout, the abstract model's parameters and routers.

The model imports its counting primitives from the leaf `umoe_jax.counting`, never `umoe_jax.stats`,
so the statistics may import the model; this module does so inside its functions, which builds the
abstract model only when a count needs it. The abstract model has shapes only (no memory); its
counts are cached by (hashable) ModelConfig.
"""
from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

from umoe_jax.config import ModelConfig
from umoe_jax.counting import COMPONENTS, as_model_config, ordered


def attention_classes():
  """The registry of attention model classes by kind (`ATTENTIONS`, filled by the model's modules)."""
  from umoe_jax.model.attention import ATTENTIONS
  return ATTENTIONS


def model_cache_shapes(cfg: ModelConfig) -> Optional[dict]:
  """{name: per-token shape} the model's attention class caches, or None if it declares none."""
  model_cls = attention_classes().get(cfg.attention.kind)
  fn = getattr(model_cls, "cache_shapes", None)
  return None if fn is None else dict(fn(cfg))


@functools.lru_cache(maxsize=64)
def _layer_routers(cfg: ModelConfig) -> tuple[tuple[type, Any, int], ...]:
  """(class, RouterConfig, E) of every router module of one decoder layer (the abstract model's
  first layer)."""
  from flax import nnx
  from umoe_jax.model import abstract_model
  from umoe_jax.model.routers import RouterStats
  layer = abstract_model(cfg).layers[0]
  return tuple((type(m), m.cfg, m.n_experts) for _, m in nnx.iter_graph(layer)
               if isinstance(m, RouterStats))


def _component_of(path: Sequence[Any], axes: Sequence[Any]) -> str:
  """The component (`COMPONENTS`) of the parameter at `path` with logical axes `axes`, or
  "other:<path>" (a mismatch in the cross-check) when it cannot be placed."""
  names = [str(p) for p in path]
  axes = tuple(axes or ())
  if names[0] == "embed":
    return "embedding"
  if names[0] == "lm_head":
    return "lm_head"
  if "router" in names:  # before the norm test: X-MoE's temperature is tagged like a norm scale
    return "routers"
  if "norm" in axes:
    return "norms"
  if "shared_expert" in names:
    return "shared_experts"
  if "experts" in names or "ffn_experts" in names:
    return "experts"
  if names[0] == "layers" and len(names) > 2:
    module = names[2]
    if module == "attention":
      return "attention_routed" if "expert" in axes else "attention"
    if module == "ffn":
      return "ffn"
  return "other:" + "/".join(names)


@functools.lru_cache(maxsize=64)
def _model_params_cached(cfg: ModelConfig) -> tuple[tuple[str, int], ...]:
  from flax import nnx
  from umoe_jax.model import abstract_model
  state = nnx.state(abstract_model(cfg), nnx.Param)
  out: dict[str, int] = {}
  for path, var in nnx.to_flat_state(state):
    meta = var.get_metadata()
    axes = meta.get("out_sharding") or meta.get("sharding_names") or ()
    value = var.get_value() if hasattr(var, "get_value") else var.value
    size = 1
    for dim in value.shape:
      size *= int(dim)
    name = _component_of(path, axes)
    out[name] = out.get(name, 0) + size
  return tuple(ordered(out, COMPONENTS).items())


def model_params(cfg: Any) -> dict[str, int]:
  """Parameters of the real model (abstract: shapes only), by component."""
  return dict(_model_params_cached(as_model_config(cfg)))
