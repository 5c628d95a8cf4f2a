"""Small building blocks shared by every module: parameter creation, initialisers, norms, MLPs.

Parameters are float32 (`param_dtype`) and carry logical axis names (`umoe_jax.parallel.rules`);
computation casts them to `compute_dtype` at use.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from umoe_jax.parallel import rules as ax

Initializer = Callable[[jax.Array, Sequence[int], jnp.dtype], jax.Array]


def normal_init(std: float) -> Initializer:
  """N(0, std^2): every linear and embedding weight of the official code (std 0.02)."""
  return lambda key, shape, dtype: std * jax.random.normal(key, shape, dtype)


def kaiming_uniform_init(fan_in: int) -> Initializer:
  """PyTorch's `kaiming_uniform_(a=sqrt(5))`: U(-b, b), b = 1/sqrt(fan_in) (the routers' init)."""
  bound = 1.0 / math.sqrt(fan_in)
  return lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)


def ones_init(key, shape, dtype):
  del key
  return jnp.ones(shape, dtype)


def make_param(rngs: nnx.Rngs, init: Initializer, shape: Sequence[int], axes: Sequence[str],
               dtype) -> nnx.Param:
  """A parameter tagged with logical axis names (one per dimension)."""
  if len(axes) != len(shape):
    raise ValueError(f"parameter of shape {tuple(shape)} needs {len(shape)} axis names, got {axes}")
  return nnx.Param(init(rngs.params(), tuple(shape), jnp.dtype(dtype)),
                   out_sharding=tuple(axes), eager_sharding=False)


ACTIVATION_FNS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "gelu": jax.nn.gelu,
    "relu": jax.nn.relu,
    "none": lambda x: x,
}


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """x / rms(x) * scale, computed in float32, returned in x's dtype."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
  return (y * scale.astype(jnp.float32)).astype(x.dtype)


class RMSNorm(nnx.Module):
  """Root-mean-square norm over the last axis with a learned scale (init 1)."""

  def __init__(self, dim: int, *, eps: float, param_dtype, rngs: nnx.Rngs):
    self.eps = eps
    self.scale = make_param(rngs, ones_init, (dim,), (ax.NORM,), param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    return rms_norm(x, self.scale.value, self.eps)


class Linear(nnx.Module):
  """y = x @ W (no bias). W [in, out], N(0, std^2)."""

  def __init__(self, d_in: int, d_out: int, axes: Sequence[str], *, std: float, param_dtype,
               compute_dtype, rngs: nnx.Rngs):
    self.compute_dtype = compute_dtype
    self.kernel = make_param(rngs, normal_init(std), (d_in, d_out), axes, param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    return jnp.dot(x.astype(self.compute_dtype), self.kernel.value.astype(self.compute_dtype))


class MLP(nnx.Module):
  """Two-matrix MLP D -> F -> D with an activation between (non-gated, as in the official code).

  With `gated`: down(act(gate(x)) * up(x)) (SwiGLU for silu). Used for the dense FFN and for
  always-on (shared) experts.
  """

  def __init__(self, d_model: int, d_hidden: int, *, activation: str, std: float, param_dtype,
               compute_dtype, rngs: nnx.Rngs, gated: bool = False):
    self.activation = activation
    self.gate = (Linear(d_model, d_hidden, (ax.EMBED, ax.MLP), std=std, param_dtype=param_dtype,
                        compute_dtype=compute_dtype, rngs=rngs) if gated else None)
    self.up = Linear(d_model, d_hidden, (ax.EMBED, ax.MLP), std=std, param_dtype=param_dtype,
                     compute_dtype=compute_dtype, rngs=rngs)
    self.down = Linear(d_hidden, d_model, (ax.MLP, ax.EMBED), std=std, param_dtype=param_dtype,
                       compute_dtype=compute_dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    """x [..., D] -> [..., D]."""
    act = ACTIVATION_FNS[self.activation]
    if self.gate is not None:
      return self.down(act(self.gate(x)) * self.up(x))
    return self.down(act(self.up(x)))
