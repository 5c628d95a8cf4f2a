"""KV-cache sizes: the values one token caches per layer (by the attention kind's `kv_cache`),
in bytes of the cache dtype, and their check against the model's own cache layout."""
from __future__ import annotations

import math
from typing import Any, Optional

from umoe_jax.counting import as_model_config
from umoe_jax.stats.kinds import attention_stats
from umoe_jax.stats.real_model import model_cache_shapes


def itemsize(dtype: Any) -> int:
  """Bytes of one value of `dtype` ("bfloat16" -> 2); a TypeError for a dtype that is not a number
  (str, object, bool: no cache holds them; numpy gives str 0 bytes)."""
  import jax.numpy as jnp  # late: importing the statistics does not load jax
  dt = jnp.dtype(dtype)
  if not jnp.issubdtype(dt, jnp.number):
    raise TypeError(f"dtype {dtype!r} is not a number type")
  return int(dt.itemsize)


def kv_cache_values_per_token(cfg: Any) -> dict[str, int]:
  """Values cached per token per layer, by name (e.g. {"key": d_k, "value": d} for pre-mixing)."""
  cfg = as_model_config(cfg)
  stats_cls = attention_stats(cfg.attention.kind)
  values = stats_cls.kv_cache(cfg)
  if values is None:  # the contract's default: the model class's own cache layout
    shapes = model_cache_shapes(cfg)
    if shapes is None:
      raise NotImplementedError(f"{stats_cls.__name__}.kv_cache: the model class of attention kind "
                                f"{cfg.attention.kind!r} declares no cache_shapes")
    values = {name: math.prod(shape) for name, shape in shapes.items()}
  return dict(values)


def model_kv_cache_values_per_token(cfg: Any) -> Optional[int]:
  """Values per token per layer of the model's own cache layout (`cache_shapes` of its attention
  class), or None where the class declares none: the cross-check of `kv_cache_values_per_token`."""
  shapes = model_cache_shapes(as_model_config(cfg))
  return None if shapes is None else sum(math.prod(s) for s in shapes.values())


def kv_cache_bytes_per_token(cfg: Any, dtype: Any = "bfloat16") -> dict[str, int]:
  """KV-cache bytes of one token: {"per_layer": bytes in one layer, "total": all layers}."""
  cfg = as_model_config(cfg)
  per_layer = sum(kv_cache_values_per_token(cfg).values()) * itemsize(dtype)
  return {"per_layer": per_layer, "total": per_layer * cfg.n_layers}
