"""The input-gradient matmul's row-dot epilogue of `fused_dispatch.gmm_combine`, in XLA.

gmm_combine's backward multiplies the output cotangent rows by the last expert matrix, u [M, F]
(float32), and then, per sorted row r with pre-activations z[r] and gate scale[r]:

    dots[r] = <u[r], act(z[r])>                   (z[r] itself without an activation) -> dgate
    out[r]  = u[r] * act'(z[r]) * scale[r]        -> dz, rounded to the output dtype once
    rows[r] = act(z[r]) rounded to z's dtype, * scale[r]    the weight gradient's operand rows

Kernels with the epilogue fused (kernels/gmm/triton_gmm.py `_gmm_tile`) compute the same from their
float32 accumulator; this module is the form for backends without it and for Triton tiles that
leave it to XLA (`kernels.gmm.tuning.TileConfig.xla_epilogue`).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp


def _silu_grad(z):
  sig = jax.nn.sigmoid(z)
  return sig * (1.0 + z * (1.0 - sig))


# Activations the epilogue takes: name -> (act, act') on float32 arrays (the same functions as the
# model's `layers.ACTIVATION_FNS` entries).
FUSABLE_ACTIVATIONS = {
    "silu": (jax.nn.silu, _silu_grad),
    "relu": (jax.nn.relu, lambda z: (z > 0).astype(z.dtype)),
}


def activate(name: str, x: jax.Array) -> jax.Array:
  """act(x) computed in float32 and returned in x's dtype."""
  return FUSABLE_ACTIVATIONS[name][0](x.astype(jnp.float32)).astype(x.dtype)


def gate_scaled(z: jax.Array, scale: jax.Array, activation: Optional[str]) -> jax.Array:
  """rows [M, F] in z's dtype: act(z) (z itself without an activation; act rounded to z's dtype)
  * scale[:, None], from z [M, F] and scale [M] float32."""
  rows = z if activation is None else activate(activation, z)
  return (rows.astype(jnp.float32) * scale[:, None]).astype(z.dtype)


def row_dot_epilogue(u: jax.Array, row_scale: Optional[jax.Array], row_dot: Optional[jax.Array],
                     activation: Optional[str], out_dtype) -> tuple[jax.Array, Optional[jax.Array]]:
  """(out [M, F] in out_dtype, dots [M] float32 or None without `row_dot`) from the product
  u [M, F] (float32), row_scale [M] or None, row_dot [M, F] (the pre-activations z with
  `activation`, else the rows the dots are taken with) or None (module docstring)."""
  out = u.astype(jnp.float32)
  dots = None
  if row_dot is not None:
    z = row_dot.astype(jnp.float32)
    act, dact = FUSABLE_ACTIVATIONS[activation] if activation is not None else (None, None)
    # The barrier keeps the row dots a pass of their own: left free, XLA on GPU fuses this
    # F-wide reduction into its consumer, the router backward's scatter-add, which then reduces
    # F elements per scattered value (UMoE-base with the XLA-epilogue tiles: 123.5 ms a step
    # without the barrier, 120.1 ms with it on an H200).
    dots = jax.lax.optimization_barrier(jnp.sum(out * (z if act is None else act(z)), axis=-1))
    if dact is not None:
      out = out * dact(z)
  if row_scale is not None:
    out = out * row_scale.astype(jnp.float32)[:, None]
  return out.astype(out_dtype), dots
