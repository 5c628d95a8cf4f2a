"""Key/value caches for incremental decoding.

One cache holds S slots per sequence. A forward pass with a cache writes its T new tokens into slots
[index, index + T) of every layer and attends over all S slots; slots whose key position is negative
(never written, or padding) are never attended (`causal_attention` masks them).

What a layer caches depends on its attention kind: each variant declares it with the class method
`cache_shapes(cfg) -> {name: per-token shape}` (see `umoe_jax.model.attention`), e.g. pre-mixing
attention caches one key [d_k] and the normed hidden state [d] (or an MLA latent), MHA keys and
values [H, d_k] and [H, d_v]. `cache_values_per_token(cfg)` is their total size per token and layer,
the number the statistics report.

Batches of prompts of different lengths are **left-padded** (see `umoe_jax.model.decode`): every row
then writes its next token into the same slot, so one scalar `index` serves the whole batch, and
padding slots carry position -1.
"""
from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct

from umoe_jax.config import check_cached_decoding
# The registry, not the attention package: the attention classes import this module (for EMPTY). They
# are registered by the time a cache is sized, since importing this module runs `umoe_jax.model`'s
# `__init__`, which builds on every attention kind.
from umoe_jax.kinds import ATTENTIONS

EMPTY = -1  # key position of an unwritten or padding slot


@struct.dataclass
class LayerCache:
  """One layer's cache during one forward pass.

  Attributes:
    index: [] int32, the slot of the first new token.
    key_positions: [B, S] int32, the position of the token in every slot *after* this pass's write
      (EMPTY for unwritten/padding slots); shared by all layers.
    arrays: {name: [B, S, ...]} the layer's cached tensors (before this pass's write until `append`).
  """
  index: jax.Array
  key_positions: jax.Array
  arrays: dict

  def append(self, **new: jax.Array) -> "LayerCache":
    """Writes new[name] [B, T, ...] into slots [index, index + T) of arrays[name]."""
    arrays = dict(self.arrays)
    for name, value in new.items():
      old = arrays[name]
      start = (0, self.index) + (0,) * (old.ndim - 2)
      arrays[name] = jax.lax.dynamic_update_slice(old, value.astype(old.dtype), start)
    return self.replace(arrays=arrays)


@struct.dataclass
class DecodeCache:
  """The whole model's cache.

  Attributes:
    index: [] int32, slots filled so far (the next pass writes from here).
    key_positions: [B, S] int32 positions of the cached tokens, EMPTY where nothing (or padding) is.
    layers: one {name: [B, S, ...]} per layer.
  """
  index: jax.Array
  key_positions: jax.Array
  layers: tuple

  @property
  def max_len(self) -> int:
    return self.key_positions.shape[1]

  def layer(self, i: int, key_positions: jax.Array) -> LayerCache:
    return LayerCache(index=self.index, key_positions=key_positions, arrays=self.layers[i])


def cache_shapes(cfg) -> dict[str, tuple[int, ...]]:
  """Per-token, per-layer cached tensors of the model's attention kind: {name: shape}."""
  return dict(ATTENTIONS.get(cfg.attention.kind).cache_shapes(cfg))


def cache_values_per_token(cfg) -> int:
  """Values cached per token and layer (multiply by n_layers and the dtype's bytes for bytes)."""
  return sum(math.prod(s) for s in cache_shapes(cfg).values())


def init_cache(cfg, batch: int, max_len: int, dtype: Optional[str] = None) -> DecodeCache:
  """An empty cache of `max_len` slots for `batch` sequences (dtype: default the compute dtype).
  Raises ConfigError first if a router of `cfg` cannot decode token by token."""
  check_cached_decoding(cfg)
  dtype = jnp.dtype(dtype or cfg.compute_dtype)
  shapes = cache_shapes(cfg)
  layer = lambda: {n: jnp.zeros((batch, max_len) + tuple(s), dtype) for n, s in shapes.items()}
  return DecodeCache(index=jnp.zeros((), jnp.int32),
                     key_positions=jnp.full((batch, max_len), EMPTY, jnp.int32),
                     layers=tuple(layer() for _ in range(cfg.n_layers)))


def cache_bytes(cache: DecodeCache) -> int:
  """Bytes of the cached tensors (not counting the positions)."""
  return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(cache.layers))
