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

from umoe_jax.ops.fp8 import fp8_dot
from umoe_jax.ops.fp8_gmm import fp8_backend, fp8_gmm
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


def fp8_dense_impl() -> str:
  """How a dense FP8 product runs here: "emulate" off GPU (a CPU has no FP8 arithmetic to gain
  from; the values are the same); on one GPU, the FP8 grouped-matmul kernel that auto takes
  (`umoe_jax.ops.fp8_gmm.AUTO_FP8`) with a single group, when there is one; else "xla" (FP8
  dot_generals per 128-wide chunk of the contraction). The kernel is a custom call the SPMD
  partitioner cannot split, so several devices keep the partitionable dot_generals."""
  if jax.default_backend() != "gpu":
    return "emulate"
  backend = fp8_backend("auto")
  return backend if backend != "xla" and jax.device_count() == 1 else "xla"


def fp8_dense(x: jax.Array, w: jax.Array, impl: str) -> jax.Array:
  """x [..., K] @ w [K, N] with FP8 operands in the forward and input-gradient products (scales as
  `umoe_jax.ops.fp8`'s; the weight gradient in x's dtype), by `impl`: "emulate" / "xla"
  (`fp8_dot`) or a gmm backend's FP8 form over one group of all rows."""
  if impl in ("emulate", "xla"):
    return fp8_dot(x, w, impl=impl)
  rows = x.reshape(-1, x.shape[-1])
  y = fp8_gmm(rows, w[None], jnp.array([rows.shape[0]], jnp.int32), backend=impl)
  return y.reshape(x.shape[:-1] + (w.shape[1],))


class Linear(nnx.Module):
  """y = x @ W (no bias). W [in, out], N(0, std^2). With `fp8` (train.precision=fp8) the product
  and its input gradient take FP8 operands (`fp8_dense`)."""

  def __init__(self, d_in: int, d_out: int, axes: Sequence[str], *, std: float, param_dtype,
               compute_dtype, rngs: nnx.Rngs, fp8: bool = False):
    self.compute_dtype = compute_dtype
    self.fp8 = fp8
    self.kernel = make_param(rngs, normal_init(std), (d_in, d_out), axes, param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    x, w = x.astype(self.compute_dtype), self.kernel.value.astype(self.compute_dtype)
    if self.fp8:
      return fp8_dense(x, w, fp8_dense_impl())
    return jnp.dot(x, w)


@jax.custom_vjp
def logits_dot(h: jax.Array, w: jax.Array) -> jax.Array:
  """The LM head: h [..., D] @ w [D, V] -> float32 logits [..., V] (products in the inputs' dtype,
  float32 accumulation and output, for a float32 softmax).

  The backward rounds the float32 logit cotangent to the inputs' dtype before its two matmuls
  (dh = g w^T, dw = h^T g, float32 accumulation), as every other layer's backward runs: autodiff of
  the plain dot would contract a float32 [N, V] cotangent with float32 / TF32 matmuls, which on an
  H200 takes 10 ms of the UMoE-base step against 2.1 ms for the forward.
  """
  return jnp.dot(h, w, preferred_element_type=jnp.float32)


def _logits_dot_fwd(h, w):
  return logits_dot(h, w), (h, w)


def _logits_dot_bwd(res, g):
  h, w = res
  g = g.astype(jnp.result_type(h.dtype, w.dtype))
  dh = jnp.dot(g, w.T, preferred_element_type=jnp.float32).astype(h.dtype)            # [..., D]
  h2, g2 = h.reshape(-1, h.shape[-1]), g.reshape(-1, g.shape[-1])
  dw = jnp.dot(h2.T, g2, preferred_element_type=jnp.float32).astype(w.dtype)         # [D, V]
  return dh, dw


logits_dot.defvjp(_logits_dot_fwd, _logits_dot_bwd)


class MLP(nnx.Module):
  """Two-matrix MLP D -> F -> D with an activation between (non-gated, as in the official code).

  With `gated`: down(act(gate(x)) * up(x)) (SwiGLU for silu); `fp8`: its Linears'. Used for the
  dense FFN and for always-on (shared) experts.
  """

  def __init__(self, d_model: int, d_hidden: int, *, activation: str, std: float, param_dtype,
               compute_dtype, rngs: nnx.Rngs, gated: bool = False, fp8: bool = False):
    self.activation = activation
    kw = dict(std=std, param_dtype=param_dtype, compute_dtype=compute_dtype, rngs=rngs, fp8=fp8)
    self.gate = Linear(d_model, d_hidden, (ax.EMBED, ax.MLP), **kw) if gated else None
    self.up = Linear(d_model, d_hidden, (ax.EMBED, ax.MLP), **kw)
    self.down = Linear(d_hidden, d_model, (ax.MLP, ax.EMBED), **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    """x [..., D] -> [..., D]."""
    act = ACTIVATION_FNS[self.activation]
    if self.gate is not None:
      return self.down(act(self.gate(x)) * self.up(x))
    return self.down(act(self.up(x)))
