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


def test_registry_has_xmoe_and_hash():
  assert ROUTERS.get("xmoe") is routers_lib.XMoERouter
  assert ROUTERS.get("hash") is routers_lib.HashRouter
