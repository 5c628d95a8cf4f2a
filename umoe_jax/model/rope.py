"""Rotary position embedding over the whole query/key head dimension.

Two layouts of the same rotation (they differ only in which channels form a rotating pair):
  "interleaved": pairs (x[2i], x[2i+1]) rotate by angle pos * theta^(-2i/Dh) (DeepSeek, the official
                 UMoE code: it de-interleaves then rotates halves, which is this rotation up to a fixed
                 channel permutation applied to both q and k, so scores are identical);
  "half":        pairs (x[i], x[i + Dh/2]) (GPT-NeoX / Llama).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_angles(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
  """cos, sin of shape [..., Dh/2] for integer positions [...] (computed in float32)."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))  # [Dh/2]
  angles = positions.astype(jnp.float32)[..., None] * inv_freq
  return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, positions: jax.Array, *, theta: float, layout: str) -> jax.Array:
  """Rotates x [B, T, H, Dh] (or [B, T, Dh]) by positions [B, T]; returns x's dtype.

  Each pair (a, b) becomes (a cos - b sin, b cos + a sin), written as x * cos + swap(x) * sin with
  swap(a, b) = (-b, a): a reverse on the pair axis and a sign, elementwise ops XLA can fuse into
  one pass each way (the strided slices and the stack of the form before ran as separate slice
  and concatenate passes, ~1.6 ms of the UMoE-base step's forward on an H200).
  """
  if layout not in ("interleaved", "half"):
    raise ValueError(f"rope layout {layout!r}; valid: interleaved, half")
  squeeze = x.ndim == 3
  if squeeze:
    x = x[:, :, None, :]
  b, t, h, dh = x.shape
  cos, sin = rope_angles(positions, dh, theta)                  # [B, T, Dh/2]
  if layout == "interleaved":   # channel 2i + j of a head is pairs[..., i, j]
    pair_shape, pair_axis, sign = (dh // 2, 2), -1, jnp.array([-1.0, 1.0], jnp.float32)
    cos, sin = cos[:, :, None, :, None], sin[:, :, None, :, None]            # [B, T, 1, Dh/2, 1]
  else:                         # channel j * Dh/2 + i of a head is pairs[..., j, i]
    pair_shape, pair_axis, sign = (2, dh // 2), -2, jnp.array([[-1.0], [1.0]], jnp.float32)
    cos, sin = cos[:, :, None, None, :], sin[:, :, None, None, :]            # [B, T, 1, 1, Dh/2]
  pairs = x.astype(jnp.float32).reshape(b, t, h, *pair_shape)
  out = pairs * cos + (jnp.flip(pairs, pair_axis) * sign) * sin
  out = out.reshape(x.shape).astype(x.dtype)
  return out[:, :, 0, :] if squeeze else out
