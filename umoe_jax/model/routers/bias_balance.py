"""Aux-loss-free load balancing (DeepSeek-V3, Wang et al. 2024): the training step moves every
router's selection bias b [E] (`router.bias_update_rate` = gamma > 0) after each update, by the
sign of that router's load error over the step's whole batch:

    b_e <- b_e + gamma * sign(mean_e' c_e' - c_e)        c = the router's expert pick counts [E]

(underloaded experts gain score for the selection, overloaded ones lose it; the gates never see b).
"""
from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx


def bias_update(bias: jax.Array, counts: jax.Array, rate: float) -> jax.Array:
  """One update of b [E] from the pick counts [E] (float32)."""
  counts = counts.astype(jnp.float32)
  return bias + rate * jnp.sign(jnp.mean(counts) - counts)


def update_selection_biases(params: Any, graphdef: Any,
                            router_stats: Mapping[str, Mapping[str, jax.Array]]
                            ) -> tuple[Any, dict[str, jax.Array]]:
  """(params with every router's selection bias updated from `router_stats[name]["expert_counts"]`
  (the LM's aux record, summed over the step's micro-batches), {route name: max b - min b after the
  update}). `params` is the pure-dict parameter tree of the model `graphdef` describes; routers
  without a bias leave it unchanged (and the result is `params` itself when none has one)."""
  model = nnx.merge(graphdef, params)
  spreads = {}
  for name, router in model.named_routers().items():
    if getattr(router, "selection_bias", None) is None:
      continue
    b = bias_update(router.selection_bias.value, router_stats[name]["expert_counts"],
                    router.cfg.bias_update_rate)
    router.selection_bias.set_value(b)
    spreads[name] = jnp.max(b) - jnp.min(b)
  if not spreads:
    return params, spreads
  return nnx.to_pure_dict(nnx.state(model, nnx.Param)), spreads
