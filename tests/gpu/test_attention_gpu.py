"""GPU check of the fused attention core (`model.attention.core="cudnn"`) against the XLA form.

Skipped without a GPU. Fresh random bf16 inputs; values and the gradients of q, k, v within 2e-2
relative of `causal_attention`'s materialised-score form, at the base models' shapes (pre-mixing:
1 + 3 query heads over one key head and D = 768 wide values; MHA: 12 heads of 64). The fused
kernel runs when the queries attend to their own keys (the same positions array); with separate
key positions (a cache: offset queries, a padding key) the XLA form must run instead, and give
exactly its values.
"""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from umoe_jax.model.attention.common import causal_attention

pytestmark = pytest.mark.skipif(
    not any(d.platform == "gpu" for d in jax.devices()), reason="needs a GPU")


def _rel(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("h,hk,dk,dv", [(4, 1, 64, 768), (12, 12, 64, 64)], ids=["premix", "mha"])
@pytest.mark.parametrize("offset", [0, 64])
def test_cudnn_core_matches_xla(h, hk, dk, dv, offset):
  b, t = 2, 256
  s = t + offset
  kq, kk, kv, kc = jax.random.split(jax.random.key(h * 1000 + offset), 4)
  q = jax.random.normal(kq, (b, t, h, dk), jnp.float32).astype(jnp.bfloat16)
  k = jax.random.normal(kk, (b, s, hk, dk), jnp.float32).astype(jnp.bfloat16)
  v = jax.random.normal(kv, (b, s, hk, dv), jnp.float32).astype(jnp.bfloat16)
  cot = jax.random.normal(kc, (b, t, h, dv), jnp.float32)
  q_pos = jnp.broadcast_to(offset + jnp.arange(t, dtype=jnp.int32), (b, t))
  if offset:  # a cache: separate key positions, one of them padding
    k_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)).at[1, 3].set(-1)
  else:
    k_pos = None

  def run(core):
    def f(q, k, v, q_pos):
      return causal_attention(q, k, v, q_pos, q_pos if k_pos is None else k_pos, core=core)
    loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32) * cot)
    return jax.jit(f)(q, k, v, q_pos), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, q_pos)

  (out, grads), (want, want_grads) = run("cudnn"), run("xla")
  assert out.dtype == want.dtype and out.shape == want.shape
  if offset:
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
  assert _rel(out, want) < 2e-2
  for name, a, b_ in zip("qkv", grads, want_grads):
    assert _rel(a, b_) < 2e-2, name
