"""The decoder-only language model: embed -> blocks -> final RMSNorm -> untied LM head."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from umoe_jax.config import ModelConfig, model_config
from umoe_jax.model.block import DecoderBlock
from umoe_jax.model.layers import RMSNorm, make_param, normal_init
from umoe_jax.model.routers import RouterOutput, routing_stats
from umoe_jax.parallel import rules as ax


class CausalLM(nnx.Module):
  """Returns float32 logits and an aux record of every router of every layer."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    cfg = model_config(cfg)
    self.cfg = cfg
    self.embed = make_param(rngs, normal_init(cfg.init_std), (cfg.vocab_size, cfg.d_model),
                            (ax.VOCAB, ax.EMBED), cfg.param_dtype)
    self.layers = nnx.List([DecoderBlock(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
    self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=cfg.param_dtype, rngs=rngs)
    self.lm_head = make_param(rngs, normal_init(cfg.init_std), (cfg.d_model, cfg.vocab_size),
                              (ax.EMBED, ax.VOCAB), cfg.param_dtype)

  def __call__(self, tokens: jax.Array, positions: Optional[jax.Array] = None):
    """tokens [B, T] int -> (logits [B, T, V] float32, aux).

    aux = {"balance_loss": [] float32 (sum over routers, coefficients applied),
           "routers": {"layer_{i}/{attention|ffn}": {"balance_loss", "expert_counts" [E], "entropy"}}}
    """
    cfg = self.cfg
    b, t = tokens.shape
    if t > cfg.max_seq_len:
      raise ValueError(f"sequence length {t} exceeds model.max_seq_len={cfg.max_seq_len}")
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    h = jnp.take(self.embed.value, tokens, axis=0).astype(cfg.compute_dtype)        # [B, T, D]
    routes: dict[str, RouterOutput] = {}
    for i, layer in enumerate(self.layers):
      h, layer_routes = layer(h, positions)
      routes.update({f"layer_{i}/{name}": r for name, r in layer_routes.items()})
    h = self.final_norm(h)
    logits = jnp.dot(h, self.lm_head.value.astype(cfg.compute_dtype),
                     preferred_element_type=jnp.float32)                           # [B, T, V]
    stats = {name: routing_stats(r, r.probs.shape[-1]) for name, r in routes.items()}
    total = sum((s["balance_loss"] for s in stats.values()), jnp.zeros((), jnp.float32))
    return logits, {"balance_loss": total, "routers": stats}


def build_model(cfg, seed: int = 0) -> CausalLM:
  """Builds and initialises a model from a ModelConfig or a `config.model` ConfigDict."""
  return CausalLM(model_config(cfg), rngs=nnx.Rngs(params=seed))


def abstract_model(cfg) -> CausalLM:
  """The model with ShapeDtypeStruct parameters: no memory, for statistics and sharding plans."""
  cfg = model_config(cfg)
  return nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(params=0)))
