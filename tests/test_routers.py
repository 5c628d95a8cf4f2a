"""Top-k softmax router: gates, choices, renormalization, balance losses and their gradients."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import reference as R
from conftest import rel_err
from umoe_jax.config import ConfigError, RouterConfig
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


def test_seq_aux_loss_with_a_slot_mask_counts_the_active_slots_only():
  """seq_aux with a slot mask (top-p, expert choice): per sequence, counts and the denominator
  T K / E both come from the active slots only (float64 loop); the mean probabilities still cover
  every position. Sequences have different numbers of active slots."""
  b, t, e, k = 3, 7, 5, 3
  rng = np.random.default_rng(6)
  probs = rng.dirichlet(np.ones(e), (b, t))
  ids = np.argsort(-probs, axis=-1)[..., :k]
  mask = rng.random((b, t, k)) < np.array([0.9, 0.5, 0.3])[:, None, None]
  mask[..., 0] = True
  want = 0.0
  for bi in range(b):
    counts = np.zeros(e)
    for ti, j in zip(*np.nonzero(mask[bi])):
      counts[ids[bi, ti, j]] += 1
    want += np.sum(counts / (mask[bi].sum() / e) * probs[bi].mean(0)) / b
  got = seq_aux_balance_loss(jnp.asarray(probs, jnp.float32), jnp.asarray(ids), e,
                             mask=jnp.asarray(mask))
  np.testing.assert_allclose(float(got), want, rtol=1e-5)


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


@pytest.mark.parametrize("renormalize", [False, True])
def test_topk_sigmoid_matches_float64_reference(renormalize):
  """SwitchHead's gates: s = sigmoid(x W) per expert, the top-k of s with gates s (or s
  renormalised over the k), and probs = s / sum_e s of each token (what the balance loss and the
  entropy read)."""
  b, t, d, e, k = 2, 5, 16, 8, 3
  r = _router(d, e, k, seed=3, kind="topk_sigmoid", renormalize=renormalize, balance_loss="seq_aux",
              balance_coef=1.0)
  x = np.random.default_rng(4).standard_normal((b, t, d)).astype(np.float32)
  out = _call(r, jnp.asarray(x))
  s = 1 / (1 + np.exp(-(x.astype(np.float64) @ np.asarray(r.kernel[...], np.float64))))
  ids = np.argsort(-s, axis=-1, kind="stable")[..., :k]
  gates = np.take_along_axis(s, ids, -1)
  if renormalize:
    gates /= gates.sum(-1, keepdims=True)
  probs = s / s.sum(-1, keepdims=True)
  np.testing.assert_array_equal(np.asarray(out.expert_ids), ids)
  assert rel_err(out.gates, gates) < 1e-6 and rel_err(out.probs, probs) < 1e-6
  np.testing.assert_allclose(float(out.balance_loss), R.seq_aux_loss(probs, ids), rtol=1e-5)


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


def test_router_matmul_bfloat16_against_float64():
  """router.logits_dtype="bfloat16": x W in bf16 operands with float32 accumulation, forward and
  both backward dots, against float64 (values and gradients, relative error < 1e-2); each gradient
  in its input's dtype; no float32 dot left in the gradient's program. "float32" matches float64
  to float32 round-off; an unknown dtype is refused naming the valid ones."""
  from umoe_jax.model.routers.matmul import router_matmul
  rng = np.random.default_rng(11)
  x = jnp.asarray(rng.standard_normal((2, 37, 48)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((48, 24)) / np.sqrt(48), jnp.float32)
  g = rng.standard_normal((2, 37, 24))                         # the scores' cotangent
  x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
  ref = x64 @ w64
  ref_dx, ref_dw = g @ w64.T, x64.reshape(-1, 48).T @ g.reshape(-1, 24)
  loss = lambda dt: (lambda x, w: jnp.sum(router_matmul(x, w, dt) * jnp.asarray(g, jnp.float32)))
  for dt, tol in (("bfloat16", 1e-2), ("float32", 1e-5)):
    y = jax.jit(lambda x, w: router_matmul(x, w, dt))(x, w)
    dx, dw = jax.jit(jax.grad(loss(dt), argnums=(0, 1)))(x, w)
    assert y.dtype == jnp.float32 and dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    assert rel_err(y, ref) < tol and rel_err(dw, ref_dw) < tol, dt
    assert rel_err(dx, ref_dx) < max(tol, 1e-2), dt            # dx is rounded to bf16 either way
  squares = lambda x, w: jnp.sum(jnp.square(router_matmul(x, w, "bfloat16")))  # keeps all 3 dots
  text = jax.jit(jax.grad(squares, argnums=(0, 1))).lower(x, w).as_text()
  operand_types = [re.search(r": \((.*)\) ->", ln).group(1) for ln in text.splitlines()
                   if "dot_general" in ln]
  assert len(operand_types) == 3, text                            # forward, dX, dW
  assert all(t.count("xbf16>") == 2 for t in operand_types), operand_types
  with pytest.raises(ValueError, match="valid: float32, bfloat16"):
    router_matmul(x, w, "float16")


def test_bfloat16_router_logits_pick_the_float32_experts():
  """A top-k softmax router with logits_dtype="bfloat16" on random tokens: probabilities within
  bf16 rounding of the float32 router's and the same experts for nearly every token."""
  x = jnp.asarray(np.random.default_rng(5).standard_normal((4, 64, 32)), jnp.bfloat16)
  out32 = _call(_router(32, 16, 3, seed=6), x)
  out16 = _call(_router(32, 16, 3, seed=6, logits_dtype="bfloat16"), x)
  assert out16.probs.dtype == jnp.float32 and rel_err(out16.probs, out32.probs) < 1e-2
  same = np.mean(np.sort(np.asarray(out16.expert_ids), -1) == np.sort(np.asarray(out32.expert_ids), -1))
  assert same > 0.97, same


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
  # the default loss (seq_aux, coefficient 0.001) by the loop formula
  np.testing.assert_allclose(float(stats["balance_loss"]), 0.001 * R.seq_aux_loss(p, ids), rtol=1e-5)


def test_registry():
  assert "topk_softmax" in ROUTERS
  assert ROUTERS.get("topk_softmax") is TopKSoftmaxRouter
  with pytest.raises(ValueError, match="'nope'"):
    ROUTERS.get("nope")
  assert set(routers_lib.BALANCE_LOSSES) >= {"seq_aux", "switch", "none"}


# ------------------------------------------------------------------------------------------------
# X-MoE (Chi et al. 2022): cosine routing in a low-dimensional space.


def _xmoe(d, e, k, seed=0, log_t=None, **cfg):
  """An X-MoE router with random W_proj [D, d_r], embeddings [E, d_r] (and log tau when learned)."""
  r = nnx.eval_shape(lambda: make_router(RouterConfig(kind="xmoe", **cfg), d, e, k,
                                         param_dtype="float32", rngs=nnx.Rngs(params=0)))
  rng = np.random.default_rng(seed)
  d_r = r.proj.shape[1]
  r.proj.set_value(jnp.asarray(rng.standard_normal((d, d_r)) / np.sqrt(d), jnp.float32))
  r.expert_embed.set_value(jnp.asarray(rng.standard_normal((e, d_r)), jnp.float32))
  if r.log_temperature is not None:
    r.log_temperature.set_value(jnp.full((1,), np.log(0.3) if log_t is None else log_t, jnp.float32))
  return r


def _xmoe_reference(x, w_proj, emb, k, tau, tau0, renormalize, loss):
  """float64 NumPy X-MoE: (probs, ids, gates, unscaled balance loss)."""
  x, w_proj, emb = (np.asarray(a, np.float64) for a in (x, w_proj, emb))
  z = x @ w_proj
  z = z / np.linalg.norm(z, axis=-1, keepdims=True)
  e = emb / np.linalg.norm(emb, axis=-1, keepdims=True)
  s = z @ e.T                                                                       # [B, T, E]

  def softmax(v):
    v = np.exp(v - v.max(-1, keepdims=True))
    return v / v.sum(-1, keepdims=True)

  probs = softmax(s / tau)
  ids = np.argsort(-probs, axis=-1, kind="stable")[..., :k]
  gates = np.take_along_axis(probs, ids, axis=-1)
  if renormalize:
    gates = gates / gates.sum(-1, keepdims=True)
  return probs, ids, gates, R.BALANCE[loss](softmax(s / tau0), ids)


@pytest.mark.parametrize("learn,renormalize,loss", [
    (True, False, "seq_aux"), (True, True, "switch"), (False, False, "seq_aux"), (False, True, "none")])
def test_xmoe_matches_numpy_reference(learn, renormalize, loss):
  b, t, d, e, k, d_r, coef = 2, 7, 20, 8, 2, 5, 0.01
  log_t = np.log(0.5)                      # learned tau (0.5) differs from the balance tau_0 (0.3)
  r = _xmoe(d, e, k, seed=21, log_t=log_t, xmoe_dim=d_r, xmoe_temperature=0.3,
            xmoe_learn_temperature=learn, renormalize=renormalize, balance_loss=loss, balance_coef=coef)
  assert r.proj.shape == (d, d_r) and r.expert_embed.shape == (e, d_r)
  x = np.random.default_rng(22).standard_normal((b, t, d)).astype(np.float32)
  out = _call(r, jnp.asarray(x))
  tau = 0.5 if learn else 0.3
  probs, ids, gates, ref_loss = _xmoe_reference(x, r.proj[...], r.expert_embed[...], k, tau, 0.3,
                                                renormalize, loss)
  np.testing.assert_array_equal(np.asarray(out.expert_ids), ids)
  np.testing.assert_allclose(np.asarray(out.gates), gates, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(out.probs), probs, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(float(out.balance_loss), coef * ref_loss, rtol=1e-5, atol=1e-9)
  assert out.expert_ids.dtype == jnp.int32 and out.gates.dtype == jnp.float32


def test_xmoe_scale_invariance_and_default_shapes():
  """Cosine scores ignore the norms of the token projection and of the expert embeddings."""
  r = _xmoe(12, 6, 2, seed=23)
  assert r.proj.shape == (12, 16) and r.expert_embed.shape == (6, 16)       # default d_r = 16
  x = jnp.asarray(np.random.default_rng(24).standard_normal((1, 5, 12)), jnp.float32)
  a = _call(r, x)
  r.expert_embed.set_value(r.expert_embed[...] * jnp.arange(1.0, 7.0)[:, None])
  b = _call(r, 3.0 * x)
  np.testing.assert_array_equal(np.asarray(a.expert_ids), np.asarray(b.expert_ids))
  np.testing.assert_allclose(np.asarray(a.gates), np.asarray(b.gates), rtol=1e-5)


def test_xmoe_gradients_reach_projection_embeddings_and_temperature():
  b, t, d, e, k = 2, 6, 16, 8, 2
  r = _xmoe(d, e, k, seed=25, balance_loss="seq_aux", balance_coef=0.1)
  x = jnp.asarray(np.random.default_rng(26).standard_normal((b, t, d)), jnp.float32)
  c = jnp.asarray(np.random.default_rng(27).standard_normal((b, t, k)), jnp.float32)
  objective = lambda m, x, c: jnp.sum(m(x).gates * c) + m(x).balance_loss
  grads = nnx.jit(nnx.grad(objective))(r, x, c)
  for name in ("proj", "expert_embed", "log_temperature"):
    g = np.asarray(grads[name][...])
    assert np.all(np.isfinite(g)) and np.abs(g).max() > 0, name
  # the balance loss alone: through W_proj and the embeddings, not tau (it uses the fixed tau_0)
  g_bal = nnx.jit(nnx.grad(lambda m, x: m(x).balance_loss))(r, x)
  assert np.abs(np.asarray(g_bal["proj"][...])).max() > 0
  assert np.abs(np.asarray(g_bal["expert_embed"][...])).max() > 0
  assert float(np.abs(np.asarray(g_bal["log_temperature"][...])).max()) == 0.0
  # a fixed temperature is no parameter
  fixed = _xmoe(d, e, k, xmoe_learn_temperature=False)
  assert fixed.log_temperature is None
  assert "log_temperature" not in nnx.to_pure_dict(nnx.state(fixed, nnx.Param))


# ------------------------------------------------------------------------------------------------
# Hash routing (Roller et al. 2021): a fixed token id -> K distinct experts map.


def _hash_router(e, k, seed=42):
  return make_router(RouterConfig(kind="hash", hash_seed=seed), 8, e, k, param_dtype="float32",
                     rngs=nnx.Rngs(params=0))


def _fmix32_np(h):
  h = np.asarray(h, np.uint64) & 0xFFFFFFFF
  h ^= h >> 16
  h = (h * 0x85EBCA6B) & 0xFFFFFFFF
  h ^= h >> 13
  h = (h * 0xC2B2AE35) & 0xFFFFFFFF
  return h ^ (h >> 16)


def _hash_reference(token_ids, e, k, seed):
  """NumPy of the documented map (`routers.hash_expert_ids`)."""
  base = _fmix32_np((np.asarray(token_ids, np.uint64) * 0x9E3779B1 + _fmix32_np(seed)) & 0xFFFFFFFF)
  experts = (np.arange(e, dtype=np.uint64) * 0x27D4EB2F + 0x165667B1) & 0xFFFFFFFF
  scores = (_fmix32_np(base[..., None] ^ experts) >> 1).astype(np.int64)
  return np.argsort(-scores, axis=-1, kind="stable")[..., :k]


def test_hash_router_outputs_and_reference():
  e, k = 8, 3
  r = _hash_router(e, k)
  ids = np.random.default_rng(30).integers(0, 1000, (3, 11)).astype(np.int32)
  x = jnp.zeros((3, 11, 8), jnp.float32)
  out = nnx.jit(lambda r, x, ids: r(x, token_ids=ids))(r, x, jnp.asarray(ids))
  got = np.asarray(out.expert_ids)
  assert got.shape == (3, 11, k) and out.expert_ids.dtype == jnp.int32
  np.testing.assert_array_equal(got, _hash_reference(ids, e, k, 42))
  assert all(len(set(row)) == k for row in got.reshape(-1, k))             # K distinct experts
  np.testing.assert_array_equal(np.asarray(out.gates), np.full((3, 11, k), 1 / k, np.float32))
  probs = np.zeros((3, 11, e))
  for (bi, ti, _), j in np.ndenumerate(got):
    probs[bi, ti, j] = 1 / k
  np.testing.assert_allclose(np.asarray(out.probs), probs, rtol=1e-7)
  assert float(out.balance_loss) == 0.0
  # the input does not matter, only the ids; another seed is another map
  again = r(jnp.asarray(np.random.default_rng(31).standard_normal((3, 11, 8)), jnp.float32),
            token_ids=jnp.asarray(ids))
  np.testing.assert_array_equal(np.asarray(again.expert_ids), got)
  other = _hash_router(e, k, seed=7)(x, token_ids=jnp.asarray(ids))
  assert (np.asarray(other.expert_ids) != got).any()
  with pytest.raises(ValueError, match="token_ids"):
    r(x)


def test_hash_same_id_same_experts_and_spread_over_vocab():
  e, k, vocab = 16, 2, 4096
  r = _hash_router(e, k)
  rng = np.random.default_rng(32)
  ids = rng.integers(0, 50, (4, 64)).astype(np.int32)              # many repeats across rows/positions
  got = np.asarray(r(jnp.zeros((4, 64, 8)), token_ids=jnp.asarray(ids)).expert_ids)
  fresh = np.asarray(_hash_router(e, k)(jnp.zeros((4, 64, 8)), token_ids=jnp.asarray(ids)).expert_ids)
  np.testing.assert_array_equal(got, fresh)                         # a fresh router, same map
  first = {}
  for (bi, ti), tok in np.ndenumerate(ids):
    first.setdefault(tok, got[bi, ti].tolist())
    assert got[bi, ti].tolist() == first[tok]
  sweep = np.asarray(r(jnp.zeros((1, vocab, 8)),
                       token_ids=jnp.arange(vocab, dtype=jnp.int32)[None]).expert_ids)[0]
  counts = np.bincount(sweep.reshape(-1), minlength=e)
  assert (counts > 0).all()
  assert np.abs(counts / (vocab * k / e) - 1).max() < 0.15           # near-uniform load
  assert len({tuple(sorted(s)) for s in sweep.tolist()}) == e * (e - 1) // 2   # every pair occurs
  # nested sets: the K=2 experts of a token are the first two of its K=5 experts
  five = np.asarray(_hash_router(e, 5)(jnp.zeros((1, vocab, 8)),
                                       token_ids=jnp.arange(vocab, dtype=jnp.int32)[None]).expert_ids)[0]
  np.testing.assert_array_equal(five[:, :2], sweep)


# ------------------------------------------------------------------------------------------------
# Both routers inside the LM: route context plumbing, no state beyond nnx.Param, one train step.


def _lm(family, kind, seed=35, **over):
  """A one-layer LM built abstractly (no eager init compilations), parameters filled at random:
  matrices N(0, 1/fan_in), embeddings N(0, 1), norm scales 1 +- 0.5, X-MoE log tau = log 0.3."""
  from conftest import tiny_config
  from umoe_jax.model import abstract_model
  cfg = tiny_config(family, **{"router.kind": kind, **over})
  model = abstract_model(cfg)
  state = nnx.state(model, nnx.Param)
  rng = np.random.default_rng(seed)

  def fill(path, x):
    name = str(getattr(path[-1], "key", path[-1]))
    if name == "log_temperature":
      new = np.full(x.shape, np.log(0.3))
    elif name == "scale":
      new = 1.0 + rng.uniform(-0.5, 0.5, x.shape)
    elif name == "embed":
      new = rng.standard_normal(x.shape)
    else:
      new = rng.standard_normal(x.shape) / np.sqrt(x.shape[-2])
    return jnp.asarray(new, x.dtype)

  filled = jax.tree_util.tree_map_with_path(fill, nnx.to_pure_dict(state))
  nnx.replace_by_pure_dict(state, filled)
  nnx.update(model, state)
  return cfg, model


# UMoE only: its FFN is the FFN-MoE's (the ffn_moe family adds only router-free MHA); cached decoding
# of both families with both routers is in test_decode.py (VARIANTS premix_* / ffn_moe_*).
@pytest.mark.parametrize("family", ["umoe"])
@pytest.mark.parametrize("kind", ["xmoe", "hash"])
def test_lm_with_router_trains_one_step(family, kind):
  """Only nnx.Param state (the trainer's split accepts the model; hash: no table, nothing learned);
  hash routes follow the token ids passed down by the LM; two Adam steps: finite, loss decreases."""
  import optax
  from umoe_jax.train.state import split_params
  cfg, model = _lm(family, kind)
  params = nnx.state(model, nnx.Param)
  assert jax.tree.structure(nnx.to_pure_dict(params)) == jax.tree.structure(
      nnx.to_pure_dict(nnx.state(model)))                                # no state but parameters
  split_params(model)
  if kind == "hash":
    assert "router" not in nnx.to_pure_dict(params)["layers"][0]["ffn"]
  tokens = jnp.asarray(np.random.default_rng(34).integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
  tx = optax.adam(1e-2)
  opt_state = tx.init(params)

  def loss_fn(model, tokens):
    logits, aux = model(tokens[:, :-1])
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    return nll + aux["balance_loss"], aux

  @nnx.jit
  def step(model, opt_state, tokens):
    (loss, aux), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, tokens)
    updates, opt_state = tx.update(grads, opt_state, nnx.state(model, nnx.Param))
    nnx.update(model, optax.apply_updates(nnx.state(model, nnx.Param), updates))
    return loss, aux, grads, opt_state

  before = jax.tree.map(np.asarray, nnx.to_pure_dict(params))
  loss, aux, grads, opt_state = step(model, opt_state, tokens)
  loss2, _, _, _ = step(model, opt_state, tokens)
  assert np.isfinite(float(loss)) and np.isfinite(float(loss2))
  assert float(loss2) < float(loss)
  grads = nnx.to_pure_dict(grads)
  after = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
  assert any((np.asarray(a) != b).any() for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before)))
  if kind == "xmoe":  # the LM loss reaches the routers' projection and embeddings
    for r in [grads["layers"][0]["ffn"]["router"]] + (
        [grads["layers"][0]["attention"]["router"]] if family == "umoe" else []):
      assert np.abs(np.asarray(r["proj"])).max() > 0 and np.abs(np.asarray(r["expert_embed"])).max() > 0
  else:               # every router routed the LM's token ids through the hash map
    for name, stats in aux["routers"].items():
      k = cfg.ffn.top_k if name.endswith("ffn") else cfg.attention.top_k
      want = np.bincount(_hash_reference(np.asarray(tokens[:, :-1]), cfg.moe.n_experts, k, 42).reshape(-1),
                         minlength=cfg.moe.n_experts)
      np.testing.assert_array_equal(np.asarray(stats["expert_counts"]), want, err_msg=name)
      assert float(stats["balance_loss"]) == 0.0


@pytest.mark.parametrize("kind", ["topk_softmax", "xmoe", "smoe_dropout", "stablemoe"])
def test_router_logits_dtype_reaches_every_router_with_a_matmul(kind):
  """model.router.logits_dtype="bfloat16" for each router whose scores are an x W (StableMoE in its
  stage 1, where x routes): the same parameters give probabilities moved by bf16 rounding (so the
  option is applied: identical ones would fail) and within 1e-2 of the float32 router's."""
  x = jnp.asarray(np.random.default_rng(5).standard_normal((2, 16, 32)), jnp.bfloat16)
  ids = jnp.asarray(np.random.default_rng(6).integers(0, 64, (2, 16)), jnp.int32)
  extra = dict(stablemoe_vocab_size=64) if kind == "stablemoe" else {}
  probs = {}
  for dtype in ("float32", "bfloat16"):
    r = make_router(RouterConfig(kind=kind, logits_dtype=dtype, **extra), 32, 8, 2,
                    param_dtype="float32", rngs=nnx.Rngs(params=0))
    out = nnx.jit(lambda r, x, ids: r(x, token_ids=ids, step=jnp.int32(0)))(r, x, ids)
    probs[dtype] = np.asarray(out.probs, np.float64)
  err = rel_err(probs["bfloat16"], probs["float32"])
  assert 0 < err < 1e-2, err


def test_registry_has_xmoe_and_hash():
  assert ROUTERS.get("xmoe") is routers_lib.XMoERouter
  assert ROUTERS.get("hash") is routers_lib.HashRouter


# ------------------------------------------------------------------------------------------------
# Shared helpers of the routers below: a router built abstractly with its parameters set from numpy.


def _np_softmax(v, axis=-1):
  v = np.exp(v - v.max(axis, keepdims=True))
  return v / v.sum(axis, keepdims=True)


def _topk_np(p, k):
  """Greedy top-k of p [..., E] (ties to the lower index): (values, ids)."""
  ids = np.argsort(-p, axis=-1, kind="stable")[..., :k]
  return np.take_along_axis(p, ids, axis=-1), ids


def _built(kind, d, e, k, params, **cfg):
  """A router of `kind` (abstract), its parameters replaced by the float32 numpy arrays `params`."""
  r = nnx.eval_shape(lambda: make_router(RouterConfig(kind=kind, **cfg), d, e, k,
                                         param_dtype="float32", rngs=nnx.Rngs(params=0)))
  for name, value in params.items():
    assert getattr(r, name).shape == value.shape, name
    getattr(r, name).set_value(jnp.asarray(value, jnp.float32))
  return r


def _softmax_router_reference(x, w, k, renormalize, mix=None):
  """float64: G = softmax(x W); P = mix(G) (identity by default); top-k of P -> (P, ids, gates)."""
  p = _np_softmax(np.asarray(x, np.float64) @ np.asarray(w, np.float64))
  if mix is not None:
    p = mix(p)
  gates, ids = _topk_np(p, k)
  if renormalize:
    gates = gates / gates.sum(-1, keepdims=True)
  return p, ids, gates


# ------------------------------------------------------------------------------------------------
# SMoE-Dropout (Chen et al. 2023): fixed random router, k grows linearly with the training step.


@pytest.mark.parametrize("renormalize", [False, True])
def test_smoe_dropout_matches_numpy_reference(renormalize):
  b, t, d, e, k, k0, steps = 2, 6, 12, 8, 6, 2, 40
  rng = np.random.default_rng(40)
  w = rng.standard_normal((d, e)) * 2 / np.sqrt(d)
  r = _built("smoe_dropout", d, e, k, {"kernel": w}, smoe_dropout_k_start=k0,
             smoe_dropout_steps=steps, renormalize=renormalize, balance_loss="switch", balance_coef=1.0)
  x = rng.standard_normal((b, t, d)).astype(np.float32)
  call = nnx.jit(lambda r, x, step: r(x, step=step))
  for step in (0, 7, 10, 30, 40, 1000, None):
    out = call(r, jnp.asarray(x), step) if step is not None else _call(r, jnp.asarray(x))
    active = k if step is None else k0 + round((k - k0) * min(step / steps, 1.0))
    p, ids, top = _softmax_router_reference(x, w, k, False)
    gates = np.where(np.arange(k) < active, top, 0.0)
    if renormalize:
      gates = gates / gates.sum(-1, keepdims=True)
    np.testing.assert_array_equal(np.asarray(out.expert_ids), ids)
    np.testing.assert_allclose(np.asarray(out.gates), gates, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(out.probs), p, rtol=1e-6, atol=1e-7)
    assert int((np.asarray(out.gates) > 0).sum(-1).max()) == active, step
    assert float(out.balance_loss) == 0.0
    # Only the k(step) active slots are routed: the mask, the logged load (what bias balancing reads)
    mask = np.broadcast_to(np.arange(k) < active, ids.shape)
    np.testing.assert_array_equal(np.asarray(out.slot_mask), mask)
    np.testing.assert_array_equal(np.asarray(routers_lib.routing_stats(out, e)["expert_counts"]),
                                  np.bincount(ids[mask], minlength=e))
  # the schedule itself: the paper's round((k_max - k_min) t / T) + k_min, clipped at T
  got = [int(routers_lib.linear_k_schedule(jnp.int32(s), 8, 16, 400)) for s in (0, 24, 25, 26, 200, 399, 400, 9999)]
  assert got == [8 + round(8 * min(s / 400, 1)) for s in (0, 24, 25, 26, 200, 399, 400, 9999)]


def test_smoe_dropout_router_gets_no_gradient_and_no_weight_decay():
  from umoe_jax.train.optimizer import decay_mask
  d, e, k = 10, 6, 3
  r = _built("smoe_dropout", d, e, k, {"kernel": np.random.default_rng(41).standard_normal((d, e))})
  x = jnp.asarray(np.random.default_rng(42).standard_normal((2, 5, d)), jnp.float32)
  grads = nnx.jit(nnx.grad(lambda m, x: jnp.sum(m(x, step=jnp.int32(3)).gates ** 2)))(r, x)
  assert float(np.abs(np.asarray(grads["kernel"][...])).max()) == 0.0
  # the gates still carry the gradient to the router input (the backbone)
  gx = jax.grad(lambda x: jnp.sum(r(x).gates ** 2))(x)
  assert float(jnp.abs(gx).max()) > 0
  assert decay_mask(nnx.state(r, nnx.Param)) == {"kernel": False}   # tagged like a norm scale


# ------------------------------------------------------------------------------------------------
# StableMoE (Dai et al. 2022): stage 1 routes by learned centroids and distils a token-id router,
# stage 2 routes by the frozen distilled router.


def _stablemoe_reference(x, ids_tok, c, emb, cd, k, stage1, coef, distill_coef):
  """float64 loops: (ids, gates, probs, loss)."""
  x, c, emb, cd = (np.asarray(a, np.float64) for a in (x, c, emb, cd))
  b, t, _ = x.shape
  e = c.shape[0]
  s = np.einsum("btd,ed->bte", x, c)
  dist = np.stack([[emb[ids_tok[bi, ti]] @ cd.T for ti in range(t)] for bi in range(b)])
  scores = s if stage1 else dist
  _, ids = _topk_np(scores, k)
  gates = 1 / (1 + np.exp(-np.take_along_axis(s, ids, axis=-1)))
  if not stage1:
    return ids, gates, _np_softmax(scores), 0.0
  n = b * t
  counts = np.zeros(e)
  for row in ids.reshape(n, k):
    for j in row:
      counts[j] += 1
  mean = n * k / e
  balance = 0.0
  for bi in range(b):
    for ti in range(t):
      for j in ids[bi, ti]:
        balance += (counts[j] - mean) / mean / (1 + np.exp(-s[bi, ti, j]))
  distill = np.mean([np.log(np.exp(dist[bi, ti]).sum()) - dist[bi, ti, np.argmax(s[bi, ti])]
                     for bi in range(b) for ti in range(t)])
  return ids, gates, _np_softmax(scores), coef * balance / n + distill_coef * distill


@pytest.mark.parametrize("step", [0, 4, 5, 9, None])
def test_stablemoe_matches_numpy_reference(step):
  b, t, d, e, k, v, d_w, switch = 2, 7, 12, 6, 2, 30, 5, 5
  rng = np.random.default_rng(43)
  params = {"centroids": rng.standard_normal((e, d)), "token_embed": rng.standard_normal((v, d_w)),
            "distill_centroids": rng.standard_normal((e, d_w))}
  r = _built("stablemoe", d, e, k, params, stablemoe_vocab_size=v, stablemoe_distill_dim=d_w,
             stablemoe_stage2_step=switch, stablemoe_distill_coef=0.3, balance_coef=0.2)
  x = rng.standard_normal((b, t, d)).astype(np.float32)
  tok = rng.integers(0, v, (b, t)).astype(np.int32)
  if step is None:
    out = nnx.jit(lambda r, x, i: r(x, token_ids=i))(r, jnp.asarray(x), jnp.asarray(tok))
  else:
    out = nnx.jit(lambda r, x, i, s: r(x, token_ids=i, step=s))(r, jnp.asarray(x), jnp.asarray(tok),
                                                                 jnp.int32(step))
  stage1 = step is not None and step < switch
  ids, gates, probs, loss = _stablemoe_reference(x, tok, *params.values(), k, stage1, 0.2, 0.3)
  np.testing.assert_array_equal(np.asarray(out.expert_ids), ids)
  np.testing.assert_allclose(np.asarray(out.gates), gates, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(out.probs), probs, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(float(out.balance_loss), loss, rtol=1e-5, atol=1e-7)
  if not stage1:  # stage 2: the experts of a token follow its id alone
    same = r(jnp.asarray(rng.standard_normal((b, t, d)), jnp.float32), token_ids=jnp.asarray(tok))
    np.testing.assert_array_equal(np.asarray(same.expert_ids), ids)
  with pytest.raises(ValueError, match="token_ids"):
    r(jnp.asarray(x))


def test_stablemoe_gradients_by_stage():
  """Stage 1: the distillation loss trains the token table and distilled centroids, the balance
  loss and gates the centroids; stage 2: only the gates' gradient (into the centroids) remains."""
  b, t, d, e, k, v = 2, 6, 10, 5, 2, 20
  rng = np.random.default_rng(44)
  params = {"centroids": rng.standard_normal((e, d)), "token_embed": rng.standard_normal((v, 4)),
            "distill_centroids": rng.standard_normal((e, 4))}
  r = _built("stablemoe", d, e, k, params, stablemoe_vocab_size=v, stablemoe_distill_dim=4,
             stablemoe_stage2_step=10, balance_coef=0.3)
  x = jnp.asarray(rng.standard_normal((b, t, d)), jnp.float32)
  tok = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
  c = jnp.asarray(rng.standard_normal((b, t, k)), jnp.float32)
  grad = nnx.jit(nnx.grad(lambda m, s: jnp.sum(m(x, token_ids=tok, step=s).gates * c)
                          + m(x, token_ids=tok, step=s).balance_loss))
  biggest = lambda g, n: float(np.abs(np.asarray(g[n][...])).max())
  g1 = grad(r, jnp.int32(9))
  assert min(biggest(g1, n) for n in params) > 0
  g_loss = nnx.jit(nnx.grad(lambda m: m(x, token_ids=tok, step=jnp.int32(0)).balance_loss))(r)
  assert biggest(g_loss, "centroids") > 0 and biggest(g_loss, "token_embed") > 0
  g2 = grad(r, jnp.int32(10))
  assert biggest(g2, "centroids") > 0
  assert biggest(g2, "token_embed") == 0.0 and biggest(g2, "distill_centroids") == 0.0


# ------------------------------------------------------------------------------------------------
# Similarity- and attention-aware routing (Graph of Tokens / Mutual-Inform SMoE): P = S G, causal.


def _causal_softmax_np(scores):
  t = scores.shape[-1]
  return _np_softmax(np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf))


@pytest.mark.parametrize("renormalize,loss,tau", [(False, "seq_aux", None), (True, "switch", 0.7)])
def test_similarity_aware_matches_numpy_reference(renormalize, loss, tau):
  b, t, d, e, k = 2, 7, 10, 6, 2
  rng = np.random.default_rng(45)
  w = rng.standard_normal((d, e)) * 2 / np.sqrt(d)
  r = _built("similarity_aware", d, e, k, {"kernel": w}, similarity_temperature=tau,
             renormalize=renormalize, balance_loss=loss, balance_coef=0.1)
  x = rng.standard_normal((b, t, d)).astype(np.float32)
  out = _call(r, jnp.asarray(x))
  x64 = x.astype(np.float64)

  def mix(g):  # row i: sum over j <= i of softmax_j(x_i . x_j / tau) g_j, as loops
    p = np.zeros_like(g)
    for bi in range(b):
      for i in range(t):
        sim = np.array([x64[bi, i] @ x64[bi, j] for j in range(i + 1)]) / (tau or np.sqrt(d))
        p[bi, i] = _np_softmax(sim) @ g[bi, :i + 1]
    return p

  p, ids, gates = _softmax_router_reference(x, w, k, renormalize, mix)
  np.testing.assert_array_equal(np.asarray(out.expert_ids), ids)
  np.testing.assert_allclose(np.asarray(out.gates), gates, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(out.probs), p, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(float(out.balance_loss), 0.1 * R.BALANCE[loss](p, ids), rtol=1e-5)
  # causal: changing the last token changes nothing before it
  x2 = x.copy()
  x2[:, -1] = rng.standard_normal((b, d))
  out2 = _call(r, jnp.asarray(x2))
  np.testing.assert_allclose(np.asarray(out2.probs)[:, :-1], np.asarray(out.probs)[:, :-1], rtol=1e-6)
  with pytest.raises(NotImplementedError, match="decoding"):
    r(jnp.asarray(x), decoding=True)


@pytest.mark.parametrize("sigma", [1.0, 0.5])
def test_attention_aware_matches_numpy_reference(sigma):
  b, h, t, d, e, k = 2, 3, 6, 8, 5, 2
  rng = np.random.default_rng(46)
  w = rng.standard_normal((d, e)) * 2 / np.sqrt(d)
  r = _built("attention_aware", d, e, k, {"kernel": w}, attention_temperature=sigma)
  x = rng.standard_normal((b, t, d)).astype(np.float32)
  sharp = np.array([0.5, 4.0, 1.5])[:, None, None]      # head 1 is the sharpest (least entropy)...
  scores = rng.standard_normal((b, h, t, t)) * sharp
  scores[1, 2] *= 6.0                                   # ...except in sequence 1: head 2
  a = _causal_softmax_np(scores)
  out = nnx.jit(lambda r, x, a: r(x, attention_probs=a))(r, jnp.asarray(x), jnp.asarray(a, jnp.float32))

  chosen = []

  def mix(g):
    p = np.zeros_like(g)
    for bi in range(b):
      ent = [[-sum(q * np.log(q) for q in a[bi, hi, i, :i + 1]) for i in range(t)] for hi in range(h)]
      for i in range(t):  # the head of least mean row entropy over rows 0..i
        hs = int(np.argmin([np.mean(ent[hi][:i + 1]) for hi in range(h)]))
        row = a[bi, hs, i, :i + 1] ** (1 / sigma)
        p[bi, i] = (row / row.sum()) @ g[bi, :i + 1]
      chosen.append(hs)
    return p

  p, ids, gates = _softmax_router_reference(x, w, k, False, mix)
  assert chosen == [1, 2]                               # at the last row: per sequence
  np.testing.assert_array_equal(np.asarray(out.expert_ids), ids)
  np.testing.assert_allclose(np.asarray(out.gates), gates, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(out.probs), p, rtol=1e-5, atol=1e-7)
  with pytest.raises(ValueError, match="attention_probs"):
    r(jnp.asarray(x))
  with pytest.raises(NotImplementedError, match="decoding"):
    r(jnp.asarray(x), attention_probs=jnp.asarray(a), decoding=True)


# ------------------------------------------------------------------------------------------------
# The related-work routers inside the LM: the training step reaches them through the route context.

NEW_KINDS = {  # kind: (family, overrides)
    "smoe_dropout": ("umoe", {"router.smoe_dropout_k_start": 1, "router.smoe_dropout_steps": 2}),
    "stablemoe": ("umoe", {"router.stablemoe_stage2_step": 1}),
    "similarity_aware": ("umoe", {}),
    "attention_aware": ("ffn_moe", {}),
    "aoe": ("ffn_moe", {"router.aoe_dim": 5}),
}


@pytest.mark.parametrize("kind", sorted(NEW_KINDS))
def test_lm_with_new_router_trains(kind):
  """Three Adam steps at training steps 0, 1, 2 (passed as `step`): only nnx.Param state, finite
  gradients, the loss falls; smoe_dropout's routers never move; stablemoe's losses stop at stage 2;
  the mixing routers keep the model causal; aoe's scores are the pool's codes."""
  import optax
  from umoe_jax.train.state import split_params
  family, over = NEW_KINDS[kind]
  cfg, model = _lm(family, kind, **over)
  split_params(model)
  params = nnx.state(model, nnx.Param)
  tokens = jnp.asarray(np.random.default_rng(47).integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
  tx = optax.adam(1e-2)
  opt_state = tx.init(params)

  def loss_fn(model, tokens, step):
    logits, aux = model(tokens[:, :-1], step=step)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    return nll + aux["balance_loss"], aux

  @nnx.jit
  def train_step(model, opt_state, tokens, step):
    (loss, aux), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, tokens, step)
    updates, opt_state = tx.update(grads, opt_state, nnx.state(model, nnx.Param))
    nnx.update(model, optax.apply_updates(nnx.state(model, nnx.Param), updates))
    return loss, aux, grads, opt_state

  before = jax.tree.map(np.asarray, nnx.to_pure_dict(params))
  losses, balances = [], []
  for step in range(3):
    loss, aux, grads, opt_state = train_step(model, opt_state, tokens, jnp.int32(step))
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(nnx.to_pure_dict(grads)))
    losses.append(float(loss))
    balances.append(float(aux["balance_loss"]))
  assert np.isfinite(losses).all() and losses[2] < losses[1], losses
  after = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  layer, layer0 = after["layers"][0], before["layers"][0]
  if kind == "smoe_dropout":
    for sub in ("attention", "ffn"):
      np.testing.assert_array_equal(np.asarray(layer[sub]["router"]["kernel"]),
                                    layer0[sub]["router"]["kernel"])
    assert balances == [0.0] * 3
  if kind == "stablemoe":                   # stage 1 at step 0 only
    assert balances[0] > 0 and balances[1:] == [0.0, 0.0]
  if kind == "aoe":                         # no router weights; the codes learn through the experts
    assert "router" not in layer["ffn"] and layer["experts"]["w_a"].shape == (cfg.moe.n_experts, cfg.d_model, 5)
    assert np.abs(np.asarray(nnx.to_pure_dict(grads)["layers"][0]["experts"]["w_a"])).max() > 0
  if kind in ("similarity_aware", "attention_aware"):
    full = nnx.jit(lambda m, x: m(x)[0])
    changed = tokens.at[:, 6:].set((tokens[:, 6:] + 1) % cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(full(model, changed))[:, :6],
                               np.asarray(full(model, tokens))[:, :6], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind,family", [("smoe_dropout", "umoe"), ("stablemoe", "umoe"), ("aoe", "ffn_moe")])
def test_cached_decoding_with_scheduled_router_matches_full(kind, family):
  """Without a step smoe_dropout and stablemoe act as at the end of training (k = K; the distilled
  token-id router), which cached decoding reproduces token by token; so does AoE."""
  from conftest import random_module, tiny_config
  from test_decode import assert_cached_decoding_matches_full
  from umoe_jax.model import CausalLM
  cfg = tiny_config(family, **{"router.kind": kind})
  assert_cached_decoding_matches_full(cfg, random_module(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)), 48))


@pytest.mark.parametrize("kind,family", [("similarity_aware", "umoe"), ("attention_aware", "ffn_moe")])
def test_cached_decoding_with_mixing_router_is_refused(kind, family):
  from umoe_jax.model.cache import init_cache
  cfg, model = _lm(family, kind)
  # refused when the cache is made, naming the key (the routers also refuse a decoding call)
  with pytest.raises(ConfigError, match=r"model\.router\.kind='%s'.*cached decoding" % kind):
    init_cache(cfg, 1, 4)


def test_attention_aware_head_choice_is_causal():
  """Making one head very sharp in later rows only changes the routing of those rows: the head is
  chosen for row t from rows 0..t (a choice over the whole sequence flips it for every row)."""
  b, h, t, d, e, k, t0 = 1, 2, 8, 8, 5, 2, 4
  rng = np.random.default_rng(47)
  r = _built("attention_aware", d, e, k, {"kernel": rng.standard_normal((d, e)) / np.sqrt(d)})
  x = jnp.asarray(rng.standard_normal((b, t, d)), jnp.float32)
  scores = rng.standard_normal((b, h, t, t)) * np.array([2.0, 0.5])[:, None, None]
  later = scores.copy()
  later[:, 1, t0:] *= 40.0                               # head 1: sharp from row t0 on
  route = nnx.jit(lambda r, x, a: r(x, attention_probs=a))
  before = route(r, x, jnp.asarray(_causal_softmax_np(scores), jnp.float32))
  after = route(r, x, jnp.asarray(_causal_softmax_np(later), jnp.float32))
  np.testing.assert_array_equal(np.asarray(after.probs)[:, :t0], np.asarray(before.probs)[:, :t0])
  assert not np.allclose(np.asarray(after.probs)[:, -1], np.asarray(before.probs)[:, -1])


def test_attention_aware_ffn_router_reads_the_blocks_attention():
  """The FFN router's distribution is the block's MHA head of least entropy mixing G over tokens."""
  from umoe_jax.model.routers import AttentionAwareRouter
  cfg, model = _lm("ffn_moe", "attention_aware")
  seen = {}
  original = AttentionAwareRouter.mix

  def spy(self, g, x, **context):
    seen["probs"] = context["attention_probs"]
    return original(self, g, x, **context)

  @nnx.jit
  def forward(model, tokens):
    model(tokens)
    return seen["probs"]                      # a value of this trace: returned, not leaked

  tokens = jnp.asarray(np.random.default_rng(49).integers(0, cfg.vocab_size, (2, 7)), jnp.int32)
  try:
    AttentionAwareRouter.mix = spy
    a = np.asarray(forward(model, tokens))
  finally:
    AttentionAwareRouter.mix = original
  assert a.shape == (2, cfg.attention.n_heads, 7, 7)
  np.testing.assert_allclose(a.sum(-1), 1.0, rtol=1e-5)
  assert np.all(np.triu(a, 1) == 0)                                    # causal


def test_registry_has_the_new_routers():
  assert ROUTERS.get("smoe_dropout") is routers_lib.SMoEDropoutRouter
  assert ROUTERS.get("stablemoe") is routers_lib.StableMoERouter
  assert ROUTERS.get("similarity_aware") is routers_lib.SimilarityAwareRouter
  assert ROUTERS.get("attention_aware") is routers_lib.AttentionAwareRouter
  assert ROUTERS.get("aoe") is routers_lib.AoERouter


# ------------------------------------------------------------------------------------------------
# Autonomy-of-Experts (Lv et al. 2025): experts score themselves by the norms of their low-rank codes.


@pytest.mark.parametrize("gated,renormalize", [(False, True), (True, False)])
def test_aoe_router_and_pool_match_numpy_reference(gated, renormalize):
  from umoe_jax.model.experts import AoEExpertPool
  b, t, d, e, k, r, f = 2, 5, 12, 6, 2, 4, 9
  rng = np.random.default_rng(50)
  pool = nnx.eval_shape(lambda: AoEExpertPool(e, d, f, rank=r, activation="silu", std=0.02,
                                              param_dtype="float32", compute_dtype="float32",
                                              gmm_backend="xla", rngs=nnx.Rngs(params=0), gated=gated))
  w = {"w_a": rng.standard_normal((e, d, r)) / np.sqrt(d), "w_b": rng.standard_normal((e, r, f)) / np.sqrt(r),
       "w_down": rng.standard_normal((e, f, d)) / np.sqrt(f)}
  if gated:
    w["w_up"] = rng.standard_normal((e, d, f)) / np.sqrt(d)
  for name, value in w.items():
    getattr(pool, name).set_value(jnp.asarray(value, jnp.float32))
  router = make_router(RouterConfig(kind="aoe", renormalize=renormalize, balance_loss="switch",
                                    balance_coef=0.01), d, e, k, param_dtype="float32", rngs=nnx.Rngs(0))
  x = rng.standard_normal((b, t, d)).astype(np.float32)

  @nnx.jit
  def forward(router, pool, x):
    out = router(x, expert_pool=pool)
    y = pool.route(x.reshape(b * t, d), out.expert_ids.reshape(-1, k), out.gates.reshape(-1, k))
    return out, y.reshape(b, t, d)

  out, y = forward(router, pool, jnp.asarray(x))
  x64 = x.astype(np.float64)
  silu = lambda v: v / (1 + np.exp(-v))
  norms = np.stack([[[np.linalg.norm(x64[bi, ti] @ w["w_a"][j]) for j in range(e)] for ti in range(t)]
                    for bi in range(b)])
  probs = _np_softmax(norms)
  gates, ids = _topk_np(probs, k)
  if renormalize:  # = the paper's softmax over the K chosen norms
    np.testing.assert_allclose(gates / gates.sum(-1, keepdims=True),
                               _np_softmax(np.take_along_axis(norms, ids, axis=-1)), rtol=1e-12)
    gates = gates / gates.sum(-1, keepdims=True)
  y_ref = np.zeros((b, t, d))
  for bi in range(b):
    for ti in range(t):
      for j, g in zip(ids[bi, ti], gates[bi, ti]):
        act = silu(x64[bi, ti] @ w["w_a"][j] @ w["w_b"][j])
        hidden = act * (x64[bi, ti] @ w["w_up"][j]) if gated else act
        y_ref[bi, ti] += g * hidden @ w["w_down"][j]
  np.testing.assert_array_equal(np.asarray(out.expert_ids), ids)
  np.testing.assert_allclose(np.asarray(out.gates), gates, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(out.probs), probs, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(float(out.balance_loss), 0.01 * R.switch_loss(probs, ids), rtol=1e-5)
  assert rel_err(y, y_ref) < 1e-5
  # the sorted-rows forward of the pool is the same experts
  rows = jnp.asarray(x.reshape(-1, d))                                # every row to expert 0
  one = np.zeros(e, np.int32)
  one[0] = rows.shape[0]
  y0 = np.asarray(pool(rows, jnp.asarray(one)))
  act0 = silu(x64.reshape(-1, d) @ w["w_a"][0] @ w["w_b"][0])
  ref0 = (act0 * (x64.reshape(-1, d) @ w["w_up"][0]) if gated else act0) @ w["w_down"][0]
  assert rel_err(y0, ref0) < 1e-5
  with pytest.raises(ValueError, match="expert_pool"):
    router(jnp.asarray(x))
  # An all-zero input row (zero codes, norm 0) still gives finite gradients of the pool's codes.
  x0 = jnp.asarray(x).at[0, 0].set(0.0)
  grad = nnx.grad(lambda pool: jnp.sum(router(x0, expert_pool=pool).probs ** 2))(pool)
  assert np.all(np.isfinite(np.asarray(grad.w_a.value)))
