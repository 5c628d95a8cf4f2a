"""Top-k softmax router: gates, choices, renormalization, balance losses and their gradients."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import reference as R
from conftest import rel_err
from umoe_jax.config import RouterConfig
from umoe_jax.model import routers as routers_lib
from umoe_jax.model.routers import (ROUTERS, TopKSoftmaxRouter, make_router, routing_stats,
                                    seq_aux_balance_loss, switch_balance_loss)


def _router(d, e, k, w=None, seed=0, **cfg):
  r = nnx.eval_shape(lambda: make_router(RouterConfig(**cfg), d, e, k, param_dtype="float32",
                                         rngs=nnx.Rngs(params=0)))
  if w is None:
    w = np.random.default_rng(seed).standard_normal((d, e)) * 2.0 / np.sqrt(d)
  r.kernel.set_value(jnp.asarray(w, jnp.float32))
  return r


@nnx.jit
def _call(router, x):
  return router(x)


# ------------------------------------------------------------------------------------------------
# A hand-computed case. Token j of the input is the one-hot e_j, so its logits are row j of W; each
# row is log(v) with sum(v) = 10, so the probabilities are v / 10 exactly.
#   seq 0: tokens e0, e1, e2 -> probs [.1 .2 .3 .4], [.4 .3 .2 .1], [.1 .5 .3 .1]
#   seq 1: tokens e3, e3, e3 -> probs [.1 .2 .3 .4] three times
# top-2: seq 0 -> {3, 2}, {0, 1}, {1, 2} with gates (.4, .3), (.4, .3), (.5, .3); seq 1 -> {3, 2} x3.
# Renormalized gates: (4/7, 3/7), (4/7, 3/7), (5/8, 3/8); seq 1 (4/7, 3/7).
#
# seq_aux (DeepSeek, ce = count / (T K / E) = count * 4 / 6):
#   seq 0: counts (1, 2, 2, 1) -> ce (2/3, 4/3, 4/3, 2/3); mean probs (.2, 1/3, 4/15, .2)
#          sum = 2/15 + 4/9 + 16/45 + 2/15 = 48/45 = 16/15
#   seq 1: counts (0, 0, 3, 3) -> ce (0, 0, 2, 2); mean probs (.1, .2, .3, .4) -> .6 + .8 = 21/15
#   loss = (16/15 + 21/15) / 2 = 37/30
# switch (all 6 tokens, 12 picks): counts (1, 2, 5, 4), f = counts / 12;
#   P = ((.6, 1, .8, .6) + (.3, .6, .9, 1.2)) / 6 = (.9, 1.6, 1.7, 1.8) / 6
#   loss = 4 * sum f P = (.9 + 3.2 + 8.5 + 7.2) / 18 = 19.8 / 18 = 1.1
# ------------------------------------------------------------------------------------------------

HAND_V = np.array([[1, 2, 3, 4], [4, 3, 2, 1], [1, 5, 3, 1], [1, 2, 3, 4]], np.float64)
HAND_X = np.zeros((2, 3, 4), np.float32)
for _t, _j in enumerate((0, 1, 2)):
  HAND_X[0, _t, _j] = 1.0
HAND_X[1, :, 3] = 1.0
HAND_PROBS = np.array([[[.1, .2, .3, .4], [.4, .3, .2, .1], [.1, .5, .3, .1]],
                       [[.1, .2, .3, .4]] * 3])
HAND_IDS = np.array([[[3, 2], [0, 1], [1, 2]], [[3, 2]] * 3])
HAND_GATES = np.array([[[.4, .3], [.4, .3], [.5, .3]], [[.4, .3]] * 3])
HAND_GATES_RENORM = np.array([[[4 / 7, 3 / 7], [4 / 7, 3 / 7], [5 / 8, 3 / 8]], [[4 / 7, 3 / 7]] * 3])


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("loss,expected", [("seq_aux", 37 / 30), ("switch", 1.1), ("none", 0.0)])
def test_hand_computed(renormalize, loss, expected):
  coef = 0.5
  r = _router(4, 4, 2, w=np.log(HAND_V), renormalize=renormalize, balance_loss=loss,
              balance_coef=coef)
  out = _call(r, jnp.asarray(HAND_X))
  np.testing.assert_allclose(np.asarray(out.probs), HAND_PROBS, rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(np.asarray(out.expert_ids), HAND_IDS)
  np.testing.assert_allclose(np.asarray(out.gates), HAND_GATES_RENORM if renormalize else HAND_GATES,
                             rtol=1e-6)
  np.testing.assert_allclose(float(out.balance_loss), coef * expected, rtol=1e-6, atol=1e-9)
  assert out.expert_ids.dtype == jnp.int32 and out.gates.dtype == jnp.float32


def test_hand_computed_loss_functions_directly():
  p, ids = jnp.asarray(HAND_PROBS, jnp.float32), jnp.asarray(HAND_IDS)
  np.testing.assert_allclose(float(seq_aux_balance_loss(p, ids, 4)), 37 / 30, rtol=1e-6)
  np.testing.assert_allclose(float(switch_balance_loss(p, ids, 4)), 1.1, rtol=1e-6)
  # The numpy oracles agree with the hand values too.
  assert abs(R.seq_aux_loss(HAND_PROBS, HAND_IDS) - 37 / 30) < 1e-12
  assert abs(R.switch_loss(HAND_PROBS, HAND_IDS) - 1.1) < 1e-12
  # With one sequence the two losses coincide (ce = E * f).
  one = (p[:1], ids[:1])
  np.testing.assert_allclose(float(seq_aux_balance_loss(*one, 4)), 16 / 15, rtol=1e-6)
  np.testing.assert_allclose(float(switch_balance_loss(*one, 4)), 16 / 15, rtol=1e-6)


def test_uniform_routing_gives_unit_loss():
  """Perfectly balanced counts with uniform probabilities: both losses equal exactly 1."""
  e = 4
  ids = jnp.asarray([[[0, 1], [2, 3], [1, 0], [3, 2]]])
  probs = jnp.full((1, 4, e), 1 / e)
  assert abs(float(seq_aux_balance_loss(probs, ids, e)) - 1.0) < 1e-6
  assert abs(float(switch_balance_loss(probs, ids, e)) - 1.0) < 1e-6


# ------------------------------------------------------------------------------------------------
# Random cases against the loop oracle.


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("loss", ["seq_aux", "switch"])
def test_random_against_loop_reference(renormalize, loss):
  b, t, d, e, k = 2, 9, 16, 8, 3
  coef = 0.001
  r = _router(d, e, k, seed=1, renormalize=renormalize, balance_loss=loss, balance_coef=coef)
  x = np.random.default_rng(2).standard_normal((b, t, d)).astype(np.float32)
  out = _call(r, jnp.asarray(x))
  w = np.asarray(r.kernel[...], np.float64)
  probs = np.zeros((b, t, e))
  ids = np.zeros((b, t, k), np.int64)
  gates = np.zeros((b, t, k))
  for bi in range(b):
    for ti in range(t):
      probs[bi, ti], ids[bi, ti], gates[bi, ti] = R.route_token(x[bi, ti], w, k, renormalize)
  assert rel_err(out.probs, probs) < 1e-6
  np.testing.assert_array_equal(np.asarray(out.expert_ids), ids)
  assert rel_err(out.gates, gates) < 1e-6
  ref_loss = coef * R.BALANCE[loss](probs, ids)
  np.testing.assert_allclose(float(out.balance_loss), ref_loss, rtol=1e-5)
  if renormalize:
    np.testing.assert_allclose(np.asarray(out.gates).sum(-1), 1.0, rtol=1e-6)
  else:
    assert np.all(np.asarray(out.gates).sum(-1) < 1.0)  # raw probabilities, not renormalized


def test_bfloat16_input_routes_in_float32():
  r = _router(16, 8, 3, seed=3)
  x = np.random.default_rng(4).standard_normal((1, 6, 16)).astype(np.float32)
  xb = jnp.asarray(x, jnp.bfloat16)
  out = _call(r, xb)
  assert out.probs.dtype == jnp.float32 and out.gates.dtype == jnp.float32
  # the router sees the bf16 values exactly, and computes in float32 from there
  w = np.asarray(r.kernel[...], np.float64)
  x_seen = np.asarray(xb.astype(jnp.float32), np.float64)
  ref = np.stack([R.route_token(x_seen[0, t], w, 3, False)[0] for t in range(6)])
  assert rel_err(out.probs[0], ref) < 1e-6


# ------------------------------------------------------------------------------------------------
# Gradients.


def _softmax_backward(p, g):
  """d loss / d logits from d loss / d probs for p = softmax(logits) (rows)."""
  return p * (g - np.sum(p * g, axis=-1, keepdims=True))


@pytest.mark.parametrize("loss", ["seq_aux", "switch"])
def test_balance_loss_gradient_flows_only_through_probs(loss):
  """grad W of the balance loss = the chain rule through probs alone, with counts held constant."""
  b, t, d, e, k = 2, 7, 12, 6, 2
  coef = 0.01
  r = _router(d, e, k, seed=5, balance_loss=loss, balance_coef=coef)
  x = np.random.default_rng(6).standard_normal((b, t, d)).astype(np.float32)
  grads = nnx.jit(nnx.grad(lambda m, x: m(x).balance_loss))(r, jnp.asarray(x))
  g_w = np.asarray(grads["kernel"][...], np.float64)

  out = _call(r, jnp.asarray(x))
  p, ids = np.asarray(out.probs, np.float64), np.asarray(out.expert_ids)
  counts = np.zeros((b, e))
  for bi in range(b):
    for ti in range(t):
      for j in range(k):
        counts[bi, ids[bi, ti, j]] += 1
  if loss == "seq_aux":
    ce = counts / (t * k / e)                                    # constants
    d_probs = coef * np.broadcast_to(ce[:, None, :], (b, t, e)) / t / b
  else:
    f = counts.sum(0) / (b * t * k)
    d_probs = coef * np.broadcast_to(e * f, (b, t, e)) / (b * t)
  d_logits = _softmax_backward(p, d_probs)
  ref = np.einsum("btd,bte->de", x.astype(np.float64), d_logits)
  assert rel_err(g_w, ref) < 1e-5


@pytest.mark.parametrize("renormalize", [False, True])
def test_gate_gradient_matches_finite_differences(renormalize):
  """Gates are differentiable functions of the router weights (through the chosen probabilities)."""
  b, t, d, e, k = 1, 4, 6, 5, 2
  r = _router(d, e, k, seed=7, renormalize=renormalize)
  x = np.random.default_rng(8).standard_normal((b, t, d))
  c = np.random.default_rng(9).standard_normal((b, t, k))
  grads = nnx.jit(nnx.grad(lambda m, x, c: jnp.sum(m(x).gates * c)))(
      r, jnp.asarray(x, jnp.float32), jnp.asarray(c, jnp.float32))
  g_w = np.asarray(grads["kernel"][...], np.float64)

  w0 = np.asarray(r.kernel[...], np.float64)

  def objective(w):
    total = 0.0
    for ti in range(t):
      _, _, gates = R.route_token(x[0, ti], w, k, renormalize)
      total += float(gates @ c[0, ti])
    return total

  eps = 1e-6
  fd = np.zeros_like(w0)
  for i in range(d):
    for j in range(e):
      wp, wm = w0.copy(), w0.copy()
      wp[i, j] += eps
      wm[i, j] -= eps
      fd[i, j] = (objective(wp) - objective(wm)) / (2 * eps)
  assert rel_err(g_w, fd) < 1e-4


# ------------------------------------------------------------------------------------------------
# Statistics and registry.


def test_routing_stats():
  r = _router(16, 8, 3, seed=10)
  x = np.random.default_rng(11).standard_normal((2, 5, 16)).astype(np.float32)
  out = _call(r, jnp.asarray(x))
  stats = routing_stats(out, 8)
  ids, p = np.asarray(out.expert_ids), np.asarray(out.probs, np.float64)
  counts = np.zeros(8)
  for i in ids.reshape(-1):
    counts[i] += 1
  np.testing.assert_array_equal(np.asarray(stats["expert_counts"]), counts)
  assert counts.sum() == 2 * 5 * 3
  entropy = np.mean([-sum(q * np.log(q) for q in row) for row in p.reshape(-1, 8)])
  np.testing.assert_allclose(float(stats["entropy"]), entropy, rtol=1e-5)
  assert float(stats["balance_loss"]) == float(out.balance_loss)


def test_registry():
  assert "topk_softmax" in ROUTERS
  assert ROUTERS.get("topk_softmax") is TopKSoftmaxRouter
  with pytest.raises(ValueError, match="'nope'"):
    ROUTERS.get("nope")
  assert set(routers_lib.BALANCE_LOSSES) >= {"seq_aux", "switch", "none"}
