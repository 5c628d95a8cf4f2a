"""Sequence classification: the pretrained decoder, a pooling of its final hidden states, a linear head.

    logits [B, C] = pool(CausalLM.hidden_states(tokens) [B, T, D], lengths) W [D, C] + b

Rows are right-padded: row i's tokens are tokens[i, :lengths[i]]. Attention is causal and routing is
per token (the mixing routers mix over earlier tokens only), so padding after a row never changes
its real tokens' hidden states; the pooling reads only those:
  "last"  h[i, lengths[i] - 1]  (the EOS appended to every text, by default: the decoder has read
          the whole text there);
  "mean"  the mean of h[i, :lengths[i]].
Padding tokens are still routed, and count in the routers' balance losses and logged expert counts
(the backbone's aux, as in pretraining); `return_routes=True` gives the routes themselves, from which
the fine-tuning step takes the real tokens' load for the aux-loss-free selection biases.

The backbone keeps its LM head (unused here, frozen by the fine-tuning optimizer), so its parameters
stay a complete `CausalLM` that loads from and saves to the usual layouts. Routers see no `step`:
they route as at the end of pretraining (SMoE-Dropout with all k experts, StableMoE's frozen stage 2).
In training they get a key (`router_rng`: `router.jitter_eps`'s noise), as in pretraining.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from umoe_jax.config import ModelConfig, model_config
from umoe_jax.model.layers import make_param, normal_init
from umoe_jax.model.lm import CausalLM, _ShapeOnlyRngs  # shapes only: no traced key counter
from umoe_jax.finetune.config import POOLINGS
from umoe_jax.parallel import rules as ax


def pool(h: jax.Array, lengths: jax.Array, pooling: str) -> jax.Array:
  """h [B, T, D], lengths [B] int (>= 1) -> float32 [B, D] (see the module docstring)."""
  h = h.astype(jnp.float32)
  if pooling == "last":
    index = jnp.clip(lengths - 1, 0, h.shape[1] - 1).astype(jnp.int32)
    return jnp.take_along_axis(h, index[:, None, None], axis=1)[:, 0]
  if pooling == "mean":
    mask = jnp.arange(h.shape[1])[None, :] < lengths[:, None]                      # [B, T]
    total = jnp.sum(jnp.where(mask[..., None], h, 0.0), axis=1)
    return total / jnp.maximum(lengths, 1)[:, None].astype(jnp.float32)
  raise ValueError(f"model.pooling={pooling!r}; valid: {', '.join(POOLINGS)}")


class ClassificationHead(nnx.Module):
  """Dropout then a linear map, float32: pooled [B, D] -> logits [B, C]."""

  def __init__(self, d_model: int, num_classes: int, *, dropout: float = 0.0, std: float = 0.02,
               rngs: nnx.Rngs):
    self.dropout = float(dropout)
    self.kernel = make_param(rngs, normal_init(std), (d_model, num_classes), (ax.EMBED, None),
                             jnp.float32)
    self.bias = nnx.Param(jnp.zeros((num_classes,), jnp.float32))

  def __call__(self, pooled: jax.Array, dropout_rng: Optional[jax.Array] = None) -> jax.Array:
    if dropout_rng is not None and self.dropout > 0:
      keep = jax.random.bernoulli(dropout_rng, 1.0 - self.dropout, pooled.shape)
      pooled = jnp.where(keep, pooled / (1.0 - self.dropout), 0.0)
    return pooled @ self.kernel.value + self.bias.value


class SequenceClassifier(nnx.Module):
  """`backbone` (a CausalLM) + `head`; returns float32 logits [B, C] and the backbone's aux."""

  def __init__(self, cfg: ModelConfig, num_classes: int, *, pooling: str = "last",
               dropout: float = 0.0, rngs: nnx.Rngs):
    if pooling not in POOLINGS:
      raise ValueError(f"model.pooling={pooling!r}; valid: {', '.join(POOLINGS)}")
    if num_classes < 2:
      raise ValueError(f"a classifier needs at least 2 classes, got {num_classes}")
    cfg = model_config(cfg)
    self.pooling = pooling
    self.backbone = CausalLM(cfg, rngs=rngs)
    self.head = ClassificationHead(cfg.d_model, num_classes, dropout=dropout, std=cfg.init_std,
                                   rngs=rngs)

  def __call__(self, tokens: jax.Array, lengths: jax.Array, *,
               dropout_rng: Optional[jax.Array] = None, router_rng: Optional[jax.Array] = None,
               remat: bool | str = False, return_routes: bool = False):
    """tokens [B, T] int, lengths [B] int -> (logits [B, C] float32, aux of `CausalLM`).

    `dropout_rng`: a key for the head's dropout (training); None = no dropout (evaluation).
    `router_rng`: the routers' key (training: their input jitter); None = no router noise.
    `remat`: the backbone's rematerialisation policy (`CausalLM.__call__`).
    `return_routes`: also aux["routes"] ({name: RouterOutput}, `CausalLM.__call__`).
    """
    h, aux = self.backbone.hidden_states(tokens, remat=remat, rng=router_rng,
                                         return_routes=return_routes)
    return self.head(pool(h, lengths, self.pooling), dropout_rng), aux

  def named_routers(self) -> dict[str, nnx.Module]:
    """The backbone's routers by route name (`CausalLM.named_routers`; the aux-loss-free bias update
    finds them here)."""
    return self.backbone.named_routers()


def abstract_classifier(cfg, num_classes: int, **kw) -> SequenceClassifier:
  """The classifier with ShapeDtypeStruct parameters (no memory): the restore target."""
  cfg = model_config(cfg)
  return nnx.eval_shape(lambda: SequenceClassifier(cfg, num_classes, rngs=_ShapeOnlyRngs(), **kw))


def init_head(cfg, num_classes: int, *, seed: int, dropout: float = 0.0) -> dict:
  """Pure dict of freshly initialised head parameters {"kernel" [D, C], "bias" [C]}."""
  cfg = model_config(cfg)
  head = ClassificationHead(cfg.d_model, num_classes, dropout=dropout, std=cfg.init_std,
                            rngs=nnx.Rngs(params=seed))
  return nnx.to_pure_dict(nnx.state(head, nnx.Param))
