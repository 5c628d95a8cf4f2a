"""RoPE against the official DeepSeek rotation (float64 numpy), both layouts."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference as R
from conftest import rel_err
from umoe_jax.model import rope as rope_lib

# One compilation per shape and layout instead of one per eager op.
apply_rope = jax.jit(rope_lib.apply_rope, static_argnames=("theta", "layout"))

THETA = 10000.0


def _official(x, pos, layout, jax_order=True):
  """Loop over (batch, token, head): the official rotation of every head vector."""
  out = np.zeros(x.shape)
  for idx in np.ndindex(*x.shape[:-1]):
    b, t = idx[0], idx[1]
    v = R.rope_official(x[idx], int(pos[b, t]), THETA, layout)
    if layout == "interleaved" and jax_order:
      v = R.official_to_interleaved(v)
    out[idx] = v
  return out


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_rope_matches_official(layout):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((2, 7, 3, 16)).astype(np.float32)
  pos = rng.integers(0, 100, size=(2, 7))
  out = apply_rope(jnp.asarray(x), jnp.asarray(pos, jnp.int32), theta=THETA, layout=layout)
  assert out.dtype == jnp.float32 and out.shape == x.shape
  assert rel_err(out, _official(x, pos, layout)) < 2e-6


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_rope_three_dim_input(layout):
  """[B, T, Dh] (the single key head of pre-mixing) rotates like [B, T, 1, Dh]."""
  rng = np.random.default_rng(1)
  x = rng.standard_normal((2, 5, 8)).astype(np.float32)
  pos = np.tile(np.arange(5), (2, 1))
  out = apply_rope(jnp.asarray(x), jnp.asarray(pos, jnp.int32), theta=THETA, layout=layout)
  assert out.shape == x.shape
  ref = _official(x[:, :, None, :], pos, layout)[:, :, 0]
  assert rel_err(out, ref) < 2e-6


def test_interleaved_layout_is_a_channel_permutation_of_official():
  """The JAX interleaved output, de-interleaved, equals the official code's output exactly (and so
  every q.k score is the official one)."""
  rng = np.random.default_rng(2)
  q = rng.standard_normal((1, 6, 1, 12)).astype(np.float32)
  k = rng.standard_normal((1, 6, 1, 12)).astype(np.float32)
  pos = np.arange(6)[None]
  jq = np.asarray(apply_rope(jnp.asarray(q), jnp.asarray(pos), theta=THETA, layout="interleaved"))
  jk = np.asarray(apply_rope(jnp.asarray(k), jnp.asarray(pos), theta=THETA, layout="interleaved"))
  oq = _official(q, pos, "interleaved", jax_order=False)
  ok = _official(k, pos, "interleaved", jax_order=False)
  deinterleave = np.concatenate([np.arange(0, 12, 2), np.arange(1, 12, 2)])
  assert rel_err(jq[..., deinterleave], oq) < 2e-6
  scores = np.einsum("tk,sk->ts", jq[0, :, 0], jk[0, :, 0])
  ref_scores = np.einsum("tk,sk->ts", oq[0, :, 0], ok[0, :, 0])
  assert rel_err(scores, ref_scores) < 2e-6


def test_layouts_differ():
  """The two layouts are different rotations (a config switch that did nothing would pass the rest)."""
  x = jnp.asarray(np.random.default_rng(3).standard_normal((1, 4, 1, 8)), jnp.float32)
  pos = jnp.arange(4)[None]
  a = apply_rope(x, pos, theta=THETA, layout="interleaved")
  b = apply_rope(x, pos, theta=THETA, layout="half")
  assert rel_err(a, b) > 0.1


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_rope_properties(layout):
  rng = np.random.default_rng(4)
  q = jnp.asarray(rng.standard_normal((1, 1, 1, 16)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((1, 1, 1, 16)), jnp.float32)

  def rot(x, p):
    return np.asarray(apply_rope(x, jnp.full((1, 1), p, jnp.int32), theta=THETA, layout=layout),
                      np.float64).reshape(-1)

  # position 0 is the identity; norms are preserved
  np.testing.assert_allclose(rot(q, 0), np.asarray(q).reshape(-1), rtol=0, atol=1e-7)
  np.testing.assert_allclose(np.linalg.norm(rot(q, 37)), np.linalg.norm(np.asarray(q)), rtol=1e-6)
  # scores depend only on the relative position
  s1 = rot(q, 9) @ rot(k, 4)
  s2 = rot(q, 25) @ rot(k, 20)
  assert abs(s1 - s2) < 1e-5 * (1 + abs(s1))
  assert abs(s1 - rot(q, 9) @ rot(k, 5)) > 1e-4


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_rope_half_precision(layout, dtype):
  rng = np.random.default_rng(5)
  x = rng.standard_normal((2, 6, 2, 16)).astype(np.float32)
  pos = np.tile(np.arange(6), (2, 1))
  out = apply_rope(jnp.asarray(x, dtype), jnp.asarray(pos), theta=THETA, layout=layout)
  assert out.dtype == jnp.dtype(dtype)
  assert rel_err(np.asarray(out, np.float32), _official(x, pos, layout)) < 1e-2


def test_rope_unknown_layout():
  with pytest.raises(ValueError, match="neox"):
    rope_lib.apply_rope(jnp.zeros((1, 2, 4)), jnp.zeros((1, 2), jnp.int32), theta=THETA,
                        layout="neox")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_rope_gradient_is_the_inverse_rotation(layout, dtype):
  """The input gradient of <rope(x, p), g> is g rotated by -p (a rotation's transpose), per head
  vector against the official rotation in float64: the backward XLA derives from the rotation's
  elementwise form, in float32 and in the half-precision compute dtypes."""
  rng = np.random.default_rng(6)
  x = rng.standard_normal((2, 5, 3, 12)).astype(np.float32)
  g = rng.standard_normal(x.shape).astype(np.float32)
  pos = rng.integers(0, 50, size=(2, 5))
  grad = jax.jit(jax.grad(lambda x: jnp.sum(apply_rope(x, jnp.asarray(pos), theta=THETA,
                                                       layout=layout).astype(jnp.float32)
                                            * jnp.asarray(g))))(jnp.asarray(x, dtype))
  assert grad.dtype == jnp.dtype(dtype)
  assert rel_err(np.asarray(grad, np.float32), _official(g, -pos, layout)) < (
      2e-6 if dtype == "float32" else 1e-2)
