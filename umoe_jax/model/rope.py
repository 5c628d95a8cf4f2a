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
  """Rotates x [B, T, H, Dh] (or [B, T, Dh]) by positions [B, T]; returns x's dtype."""
  squeeze = x.ndim == 3
  if squeeze:
    x = x[:, :, None, :]
  dh = x.shape[-1]
  cos, sin = rope_angles(positions, dh, theta)                  # [B, T, Dh/2]
  cos, sin = cos[:, :, None, :], sin[:, :, None, :]             # [B, T, 1, Dh/2]
  x32 = x.astype(jnp.float32)
  if layout == "interleaved":
    a, b = x32[..., 0::2], x32[..., 1::2]
    out = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(x.shape)
  elif layout == "half":
    a, b = x32[..., : dh // 2], x32[..., dh // 2:]
    out = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
  else:
    raise ValueError(f"rope layout {layout!r}; valid: interleaved, half")
  out = out.astype(x.dtype)
  return out[:, :, 0, :] if squeeze else out
