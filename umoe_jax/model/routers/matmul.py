"""x W for a router's scores, in the precision `router.logits_dtype` asks for.

"float32" (default): float32 operands, as the official MoEGate computes its logits. XLA on an H200
runs these dots at ~130 TFLOP/s (TF32 at best), about a third of UMoE-base's router time
(six such dots a layer, forward and backward, 3.6 ms a step).
"bfloat16": bf16 operands with float32 accumulation, in the forward and in both backward dots (the
scores' cotangent rounded to bf16 for them, as every other matmul of a bf16 step). The scores, the
softmax and the weight gradient stay float32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from umoe_jax.kinds import ROUTER_LOGITS_DTYPES


def router_matmul(x: jax.Array, w: jax.Array, logits_dtype: str = "float32") -> jax.Array:
  """x [..., D] @ w [D, E] -> float32 [..., E]; gradients to x and w in their own dtypes."""
  if logits_dtype == "float32":
    return jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32))
  if logits_dtype == "bfloat16":
    return _bf16_matmul(x, w)
  raise ValueError(f"router logits_dtype={logits_dtype!r}; valid: {', '.join(ROUTER_LOGITS_DTYPES)}")


def _dot_f32(a: jax.Array, b: jax.Array, dims) -> jax.Array:
  return jax.lax.dot_general(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), (dims, ((), ())),
                             preferred_element_type=jnp.float32)


@jax.custom_vjp
def _bf16_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  return _dot_f32(x, w, ((x.ndim - 1,), (0,)))


def _bf16_matmul_fwd(x, w):
  return _bf16_matmul(x, w), (x, w)


def _bf16_matmul_bwd(res, g):
  x, w = res
  # Without this rule JAX's transpose would multiply the float32 cotangent by the bf16 operand,
  # which XLA runs as a float32 dot again.
  d = x.shape[-1]
  dx = _dot_f32(g, w, ((g.ndim - 1,), (1,)))                                      # [..., D]
  dw = _dot_f32(x.reshape(-1, d), g.reshape(-1, g.shape[-1]), ((0,), (0,)))       # [D, E]
  return dx.astype(x.dtype), dw.astype(w.dtype)


_bf16_matmul.defvjp(_bf16_matmul_fwd, _bf16_matmul_bwd)
