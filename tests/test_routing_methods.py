"""Routing methods composed per sub-layer: each sub-layer's own router, z-loss, jitter, bias
balancing, mixing over any distribution router, top-P and expert-choice selection, and AoE's
completion (parameter matching, meshes). Float64 NumPy references; tiny shapes, few compiles."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import random_module, tiny_config
from umoe_jax import stats
from umoe_jax.model import CausalLM
from umoe_jax.model.routers import AoERouter, HashRouter, TopKSoftmaxRouter, XMoERouter


# ------------------------------------------------------------------------------------------------
# Per sub-layer routers: model.attention.router / model.ffn.router over model.router.


def test_sub_layers_build_their_own_router_kinds():
  """UMoE with an X-MoE attention router and an AoE FFN router sharing one (AoE) pool, and with a
  hash FFN: each sub-layer gets its kind; the analytic parameter count matches the real model."""
  cfg = tiny_config("umoe", **{"attention.router.kind": "xmoe", "attention.router.xmoe_dim": 4,
                               "attention.router.xmoe_learn_temperature": False,
                               "ffn.router.kind": "aoe", "ffn.router.aoe_dim": 5})
  model = random_module(lambda: CausalLM(cfg, rngs=nnx.Rngs(params=0)), seed=1)
  layer = model.layers[0]
  assert isinstance(layer.attention.router, XMoERouter) and layer.attention.router.proj.shape[1] == 4
  assert isinstance(layer.ffn.router, AoERouter)
  assert layer.experts.w_a.shape[-1] == 5           # the shared pool is AoE's (rank 5)
  assert stats.param_mismatches(cfg) == {}
  hashed = tiny_config("umoe", **{"ffn.router.kind": "hash"})
  assert stats.param_mismatches(hashed) == {}
  # The aux-loss-free selection biases ([E] per router with a bias_update_rate) are counted.
  biased = tiny_config("umoe", **{"attention.router.bias_update_rate": 1e-3})
  assert stats.param_mismatches(biased) == {}
  assert (stats.model_params(biased)["routers"] - stats.model_params(tiny_config("umoe"))["routers"]
          == biased.moe.n_experts * biased.n_layers)
  assert stats.model_params(hashed)["routers"] < stats.model_params(tiny_config("umoe"))["routers"]
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 6)), jnp.int32)
  logits, aux = nnx.jit(lambda m, t: m(t))(model, tokens)
  assert np.isfinite(np.asarray(logits)).all()
  assert set(aux["routers"]) == {"layer_0/attention", "layer_0/ffn"}
  # share_att_ffn with the same router on both sides: one set of weights
  shared = tiny_config("umoe", **{"router.share_att_ffn": True, "attention.router.kind": "xmoe",
                                  "ffn.router.kind": "xmoe"})
  m2 = nnx.eval_shape(lambda: CausalLM(shared, rngs=nnx.Rngs(params=0)))
  assert m2.layers[0].ffn.router.proj is m2.layers[0].attention.router.proj
  assert isinstance(nnx.eval_shape(lambda: CausalLM(hashed, rngs=nnx.Rngs(params=0))).layers[0].ffn.router,
                    HashRouter)
  assert isinstance(m2.layers[0].attention.router, XMoERouter) and not isinstance(
      model.layers[0].attention.router, TopKSoftmaxRouter)


# ------------------------------------------------------------------------------------------------
# Router-level helpers: routers built abstractly with given float64-friendly parameters.


def _router(kind, d, e, k, params, **cfg):
  from umoe_jax.config import RouterConfig
  from umoe_jax.model.routers import make_router
  r = nnx.eval_shape(lambda: make_router(RouterConfig(kind=kind, **cfg), d, e, k,
                                         param_dtype="float32", rngs=nnx.Rngs(params=0)))
  for name, value in params.items():
    getattr(r, name).set_value(jnp.asarray(value, jnp.float32))
  return r


def _softmax(v):
  v = np.exp(v - v.max(-1, keepdims=True))
  return v / v.sum(-1, keepdims=True)


def _logsumexp(v):
  m = v.max(-1, keepdims=True)
  return (m + np.log(np.exp(v - m).sum(-1, keepdims=True)))[..., 0]


def _top_k(scores, k):
  ids = np.argsort(-scores, axis=-1, kind="stable")[..., :k]
  return ids


# ------------------------------------------------------------------------------------------------
# Router z-loss (ST-MoE), jitter (Switch), aux-loss-free bias balancing (DeepSeek-V3).


@pytest.mark.parametrize("kind", ["topk_softmax", "topk_sigmoid", "xmoe", "stablemoe"])
def test_z_loss_matches_float64_reference(kind):
  """z_loss = coef * mean_t logsumexp(logits)^2 on each kind's logits (x W_r; X-MoE s / tau;
  StableMoE's affinities x C^T), reported apart from the balance loss, which it leaves unchanged."""
  b, t, d, e, k, coef = 2, 5, 8, 6, 2, 0.01
  rng = np.random.default_rng(3)
  x = rng.standard_normal((b, t, d))
  if kind in ("topk_softmax", "topk_sigmoid"):
    w = rng.standard_normal((d, e)) * 2
    params, logits = {"kernel": w}, x @ w
  elif kind == "xmoe":
    proj, emb = rng.standard_normal((d, 4)), rng.standard_normal((e, 4))
    params = {"proj": proj, "expert_embed": emb}
    z = x @ proj
    s = (z / np.linalg.norm(z, axis=-1, keepdims=True)) @ (emb / np.linalg.norm(emb, axis=-1,
                                                                                keepdims=True)).T
    logits = s / 0.3
  else:
    c = rng.standard_normal((e, d))
    params = {"centroids": c, "token_embed": rng.standard_normal((20, 3)),
              "distill_centroids": rng.standard_normal((e, 3))}
    logits = x @ c.T
  extra = dict(xmoe_dim=4, xmoe_learn_temperature=False) if kind == "xmoe" else {}
  if kind == "stablemoe":
    extra.update(stablemoe_vocab_size=20, stablemoe_distill_dim=3)
  r = _router(kind, d, e, k, params, z_loss_coef=coef, **extra)
  base = _router(kind, d, e, k, params, **extra)
  ctx = dict(token_ids=jnp.zeros((b, t), jnp.int32), step=jnp.int32(0))
  out, ref = r(jnp.asarray(x, jnp.float32), **ctx), base(jnp.asarray(x, jnp.float32), **ctx)
  expected = coef * np.mean(_logsumexp(logits) ** 2)
  np.testing.assert_allclose(float(out.aux_losses["z_loss"]), expected, rtol=1e-5)
  assert base.cfg.z_loss_coef == 0 and dict(ref.aux_losses) == {}
  np.testing.assert_allclose(float(out.balance_loss), float(ref.balance_loss), rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(out.expert_ids), np.asarray(ref.expert_ids))


def test_jitter_multiplies_the_router_input_only_with_a_key():
  """With an rng (training) the router sees x * U(1 - eps, 1 + eps) (the same draw as
  jax.random.uniform of that key); without one (evaluation, decoding) it routes the clean x."""
  b, t, d, e, k, eps = 2, 7, 8, 6, 2, 0.2
  rng = np.random.default_rng(4)
  w, x = rng.standard_normal((d, e)) * 2, rng.standard_normal((b, t, d))
  r = _router("topk_softmax", d, e, k, {"kernel": w}, jitter_eps=eps)
  key = jax.random.key(5)
  noisy = r(jnp.asarray(x, jnp.float32), rng=key)
  noise = np.asarray(jax.random.uniform(key, x.shape, jnp.float32, 1 - eps, 1 + eps), np.float64)
  assert noise.min() >= 1 - eps and noise.max() <= 1 + eps and noise.std() > eps / 4
  probs = _softmax((x.astype(np.float32).astype(np.float64) * noise) @ w)
  np.testing.assert_allclose(np.asarray(noisy.probs), probs, rtol=2e-5, atol=1e-7)
  np.testing.assert_array_equal(np.asarray(noisy.expert_ids), _top_k(probs, k))
  clean = r(jnp.asarray(x, jnp.float32))
  np.testing.assert_allclose(np.asarray(clean.probs), _softmax(x @ w), rtol=2e-5, atol=1e-7)
  assert not np.allclose(np.asarray(clean.probs), np.asarray(noisy.probs))


def test_jitter_noise_is_drawn_per_router_of_a_sub_layer():
  """SwitchHead's 2H routers (V and O of every head) share one sub-layer: with the same weights
  they must still draw independent jitter noise (one key folded per router), so their noisy
  distributions differ; without a key (evaluation) they agree exactly."""
  from umoe_jax.model.attention import ATTENTIONS
  from umoe_jax.model.routers import route_context
  cfg = tiny_config("switchhead", **{"attention.n_experts": 4, "attention.top_k": 2,
                                     "router.jitter_eps": 0.5})
  att = random_module(lambda: ATTENTIONS.get("switchhead")(cfg, rngs=nnx.Rngs(params=0)), 12)
  rng = np.random.default_rng(12)
  w = rng.standard_normal((cfg.d_model, 4)) * 2
  for r in (*att.v_experts.router, *att.o_experts.router):
    r.kernel.set_value(jnp.asarray(w, jnp.float32))
  x = jnp.asarray(rng.standard_normal((2, 5, cfg.d_model)), jnp.float32)
  tokens, positions = jnp.zeros((2, 5), jnp.int32), jnp.broadcast_to(jnp.arange(5), (2, 5))
  routes = lambda ctx: [np.asarray(o.probs) for o in att(x, positions, route_context=ctx)[1].values()]
  clean = routes(route_context(tokens))
  assert all(np.array_equal(p, clean[0]) for p in clean)
  noisy = routes(route_context(tokens, rng=jax.random.key(13)))
  assert len(noisy) == 2 * cfg.attention.n_heads
  for i in range(len(noisy)):
    for j in range(i):
      assert np.abs(noisy[i] - noisy[j]).max() > 1e-3, (i, j)


def test_selection_bias_moves_the_choice_not_the_gates():
  """top-k of probs + b picks the experts; the gates are the unbiased probabilities there."""
  b, t, d, e, k = 1, 6, 8, 5, 2
  rng = np.random.default_rng(6)
  w, x = rng.standard_normal((d, e)), rng.standard_normal((b, t, d))
  bias = np.array([0.0, 0.0, 0.0, 0.0, 10.0])           # expert 4 wins every first slot
  r = _router("topk_softmax", d, e, k, {"kernel": w, "selection_bias": bias},
              bias_update_rate=1e-3, renormalize=True)
  out = r(jnp.asarray(x, jnp.float32))
  probs = _softmax(x @ w)
  ids = _top_k(probs + bias, k)
  np.testing.assert_array_equal(np.asarray(out.expert_ids), ids)
  assert (ids[..., 0] == 4).all()
  gates = np.take_along_axis(probs, ids, -1)
  np.testing.assert_allclose(np.asarray(out.gates), gates / gates.sum(-1, keepdims=True), rtol=1e-5)
  grads = nnx.grad(lambda m: jnp.sum(m(jnp.asarray(x, jnp.float32)).gates ** 2))(r)
  assert float(jnp.abs(grads["selection_bias"][...]).max()) == 0.0


def _tiny_moe_model_cfg(**router):
  """An MHA + MoE-FFN LM of one layer, width 16 (cheap to compile), float32."""
  import configs.common as common
  from umoe_jax.config import model_config
  c = common.model("ffn_moe", "tiny")
  c.update(dict(n_layers=1, d_model=16, vocab_size=64, compute_dtype="float32", gmm_backend="xla"))
  c.attention.update(dict(n_heads=2, head_dim=8, v_head_dim=8))
  c.ffn.update(dict(top_k=2, n_shared_experts=0))
  c.moe.update(dict(n_experts=4, d_expert=8))
  c.router.update(router)
  return model_config(c)


def test_train_step_bias_balancing_jitter_and_z_loss():
  """Over 3 AdamW steps (weight decay on): each router's selection bias moves by exactly
  rate * sign(mean load - load) of that step's batch (the hand computation; the optimizer never
  touches it), it lives in the params (so in every checkpoint); the step's forward jitters the
  router input with its key, evaluation never does; the z-loss is reported on its own."""
  import optax
  from umoe_jax.eval.perplexity import eval_step
  from umoe_jax.train import metrics as metrics_lib, optimizer as opt_lib, state as state_lib, \
      step as step_lib
  rate = 0.05
  cfg = _tiny_moe_model_cfg(bias_update_rate=rate, jitter_eps=0.3, z_loss_coef=1e-2)
  parts = state_lib.model_parts(cfg)
  params = nnx.to_pure_dict(nnx.state(random_module(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)), 0),
                                      nnx.Param))
  bias_of = lambda p: np.asarray(p["layers"][0]["ffn"]["router"]["selection_bias"], np.float64)
  assert (bias_of(params) == 0).all()
  tx = optax.adamw(1e-2, weight_decay=0.1, mask=opt_lib.decay_mask(parts.abstract_params))
  state = state_lib.state_with_params(params, tx, 0)
  assert "selection_bias" in str(jax.tree_util.tree_structure(state_lib.checkpoint_tree(state)))
  step = jax.jit(lambda st, b: step_lib.train_step(st, b, graphdef=parts.graphdef, tx=tx,
                                                   schedule=optax.constant_schedule(1e-2)))
  rng = np.random.default_rng(7)
  expected = bias_of(params)
  for i in range(3):
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (4, 9)), jnp.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    if i == 0:   # the step's forward is the model's with the step's key, never the clean one
      model = nnx.merge(parts.graphdef, state.params)
      key = jax.random.fold_in(step_lib.step_rng(state), 0)
      noisy, _ = model(batch["inputs"], rng=key)
      clean, _ = model(batch["inputs"])
      lm = lambda logits: float(jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(
          logits, batch["targets"][..., None], -1)[..., 0]))
    state, m = step(state, batch)
    if i == 0:
      np.testing.assert_allclose(float(m["lm_loss"]), lm(noisy), rtol=1e-5)
      assert abs(lm(noisy) - lm(clean)) > 1e-4
      plain = _tiny_moe_model_cfg(bias_update_rate=rate, z_loss_coef=1e-2)   # no jitter
      ev = lambda c: eval_step(state.params, batch, graphdef=state_lib.model_parts(c).graphdef)
      np.testing.assert_array_equal(np.asarray(ev(cfg)[0]), np.asarray(ev(plain)[0]))
    counts = np.asarray(m["routers"]["layer_0/ffn"]["expert_counts"], np.float64)
    assert counts.sum() == 4 * 8 * 2 and counts.std() > 0
    expected = expected + rate * np.sign(counts.mean() - counts)
    np.testing.assert_allclose(bias_of(state.params), expected, rtol=0, atol=1e-7)
    np.testing.assert_allclose(float(m["routers"]["layer_0/ffn"]["bias_spread"]),
                               expected.max() - expected.min(), atol=1e-7)
    z = float(m["router_losses"]["z_loss"])
    assert z > 0 and float(m["routers"]["layer_0/ffn"]["z_loss"]) == z
    np.testing.assert_allclose(float(m["loss"]), float(m["lm_loss"]) + float(m["balance_loss"]) + z,
                               rtol=1e-6)
  host = jax.tree.map(np.asarray, m)
  scalars, _ = metrics_lib.summarize([host])
  assert scalars["train/z_loss"] == pytest.approx(z) and "moe/layer_0/ffn/bias_spread" in scalars
  # The console line shows every term of the loss, the z-loss among them.
  line = metrics_lib.console_line(3, 3, {**scalars, "perf/step_time_s": 0.1})
  assert (f"(lm {scalars['train/lm_loss']:.4f} bal {scalars['train/balance_loss']:.4f} "
          f"z {z:.4f})") in line, line


# ------------------------------------------------------------------------------------------------
# Mutual-Inform mixing (router.mixing) over any router with a distribution.


def _causal_mix_np(g, s_scores):
  """P[b, i] = sum_{j <= i} softmax_j(s[b, i, :i+1]) g[b, j], as loops."""
  b, t, _ = g.shape
  p = np.zeros_like(g)
  for bi in range(b):
    for i in range(t):
      p[bi, i] = _softmax(s_scores[bi, i, :i + 1]) @ g[bi, :i + 1]
  return p


def test_similarity_inform_xmoe_matches_float64_reference():
  """The seed's "Similarity-inform X-MoE": X-MoE's softmax(s / tau) mixed over earlier similar
  tokens (x_i . x_j / tau_s), then top-k of the mixture; the balance loss on the mixture."""
  b, t, d, e, k, tau_s = 2, 6, 8, 6, 2, 1.5
  rng = np.random.default_rng(8)
  proj, emb, x = rng.standard_normal((d, 4)), rng.standard_normal((e, 4)), rng.standard_normal((b, t, d))
  r = _router("xmoe", d, e, k, {"proj": proj, "expert_embed": emb}, xmoe_dim=4,
              xmoe_learn_temperature=False, mixing="similarity", similarity_temperature=tau_s,
              balance_loss="switch", balance_coef=0.5)
  out = r(jnp.asarray(x, jnp.float32))
  x32 = x.astype(np.float32).astype(np.float64)
  z = x32 @ proj
  s = (z / np.linalg.norm(z, axis=-1, keepdims=True)) @ (emb / np.linalg.norm(emb, axis=-1,
                                                                              keepdims=True)).T
  p = _causal_mix_np(_softmax(s / 0.3), np.einsum("bid,bjd->bij", x32, x32) / tau_s)
  ids = _top_k(p, k)
  np.testing.assert_allclose(np.asarray(out.probs), p, rtol=2e-5, atol=1e-7)
  np.testing.assert_array_equal(np.asarray(out.expert_ids), ids)
  np.testing.assert_allclose(np.asarray(out.gates), np.take_along_axis(p, ids, -1), rtol=2e-5)
  f = np.bincount(ids.reshape(-1), minlength=e) / ids.size
  np.testing.assert_allclose(float(out.balance_loss), 0.5 * e * np.sum(f * p.reshape(-1, e).mean(0)),
                             rtol=2e-5)
  with pytest.raises(NotImplementedError, match="cached decoding"):
    r(jnp.asarray(x, jnp.float32), decoding=True)


def test_attention_inform_smoe_dropout_matches_float64_reference():
  """The seed's "Attention-inform SMoE-Dropout": the fixed router's softmax mixed by the block's
  attention head of least (running) entropy, then SMoE-Dropout's k(step) active slots."""
  b, h, t, d, e, k = 1, 2, 5, 8, 6, 3
  rng = np.random.default_rng(9)
  w, x = rng.standard_normal((d, e)) * 2, rng.standard_normal((b, t, d))
  logits_a = rng.standard_normal((b, h, t, t)) * np.array([3.0, 0.3])[None, :, None, None]
  a = np.where(np.tril(np.ones((t, t), bool)), np.exp(logits_a), 0.0)
  a = a / a.sum(-1, keepdims=True)
  r = _router("smoe_dropout", d, e, k, {"kernel": w}, mixing="attention", smoe_dropout_k_start=1,
              smoe_dropout_steps=4)
  out = r(jnp.asarray(x, jnp.float32), attention_probs=jnp.asarray(a, jnp.float32),
          step=jnp.int32(2))
  ent = -np.sum(np.where(a > 0, a * np.log(np.where(a > 0, a, 1)), 0), -1)         # [B, H, T]
  running = np.cumsum(ent, -1) / np.arange(1, t + 1)
  head = running.argmin(1)                                                          # [B, T]
  g = _softmax(x.astype(np.float32).astype(np.float64) @ w)
  p = np.stack([[a[bi, head[bi, i], i] @ g[bi] for i in range(t)] for bi in range(b)])
  ids = _top_k(p, k)
  gates = np.where(np.arange(k) < 2, np.take_along_axis(p, ids, -1), 0.0)        # k(2) = 1 + 1
  np.testing.assert_allclose(np.asarray(out.probs), p, rtol=2e-5, atol=1e-7)
  np.testing.assert_array_equal(np.asarray(out.expert_ids), ids)
  np.testing.assert_allclose(np.asarray(out.gates), gates, rtol=2e-5, atol=1e-7)
  assert float(out.balance_loss) == 0.0


# ------------------------------------------------------------------------------------------------
# AoE completed: top-P with its entropy loss, expert choice, parameter matching.


def _aoe_router_and_pool(d, e, k, r, rng, **cfg):
  from umoe_jax.model.experts import AoEExpertPool
  pool = nnx.eval_shape(lambda: AoEExpertPool(e, d, 5, rank=r, activation="silu", std=0.02,
                                              param_dtype="float32", compute_dtype="float32",
                                              gmm_backend="xla", rngs=nnx.Rngs(params=0)))
  w_a = rng.standard_normal((e, d, r)) / np.sqrt(d) * np.linspace(0.5, 2.0, e)[:, None, None]
  pool.w_a.set_value(jnp.asarray(w_a, jnp.float32))
  return _router("aoe", d, e, k, {}, aoe_dim=r, **cfg), pool, w_a


def test_aoe_top_p_matches_a_loop():
  """AoE top-P (P = 0.6, at most K slots): per token, experts by softmax(|x A^e|) until the sum
  reaches P; the rest of the K slots masked (gate 0, out of the load and the balance loss); the
  entropy loss is mean_t H(softmax(norms)); all against float64 loops."""
  b, t, d, e, k, r, p_top, coef = 2, 6, 8, 6, 4, 3, 0.6, 1e-2
  rng = np.random.default_rng(10)
  router, pool, w_a = _aoe_router_and_pool(d, e, k, r, rng, selection="top_p", top_p=p_top,
                                           entropy_coef=coef, renormalize=True,
                                           balance_loss="switch", balance_coef=1.0)
  x = rng.standard_normal((b, t, d))
  out = router(jnp.asarray(x, jnp.float32), expert_pool=pool)
  x32 = x.astype(np.float32).astype(np.float64)
  norms = np.sqrt(np.sum(np.einsum("btd,edr->bter", x32, w_a) ** 2, -1) + 1e-12)
  probs = _softmax(norms)
  ids, gates, mask = np.zeros((b, t, k), int), np.zeros((b, t, k)), np.zeros((b, t, k), bool)
  for bi in range(b):
    for ti in range(t):
      order = np.argsort(-probs[bi, ti], kind="stable")
      total, used = 0.0, 0
      while used < k and (used == 0 or total < p_top):
        total += probs[bi, ti, order[used]]
        used += 1
      ids[bi, ti] = order[:k]
      mask[bi, ti, :used] = True
      chosen = probs[bi, ti, order[:used]]
      gates[bi, ti, :used] = chosen / chosen.sum()
  np.testing.assert_array_equal(np.asarray(out.slot_mask), mask)
  assert 1 < mask.sum(-1).max() and mask.sum(-1).min() >= 1       # a varying number of experts
  np.testing.assert_array_equal(np.where(mask, np.asarray(out.expert_ids), -1), np.where(mask, ids, -1))
  np.testing.assert_allclose(np.asarray(out.gates), gates, rtol=2e-5, atol=1e-7)
  entropy = np.mean(-np.sum(probs * np.log(probs), -1))
  np.testing.assert_allclose(float(out.aux_losses["entropy_loss"]), coef * entropy, rtol=2e-5)
  counts = np.zeros(e)
  for bi, ti, j in zip(*np.nonzero(mask)):
    counts[ids[bi, ti, j]] += 1
  from umoe_jax.model.routers import routing_stats
  np.testing.assert_array_equal(np.asarray(routing_stats(out, e)["expert_counts"]), counts)
  np.testing.assert_allclose(float(out.balance_loss),
                             e * np.sum(counts / counts.sum() * probs.reshape(-1, e).mean(0)), rtol=2e-5)


@pytest.mark.parametrize("slots", [None, 2])
def test_expert_choice_capacity_and_selection(slots):
  """Every expert takes exactly C = ceil(c N / E) of the batch's N tokens, those of highest
  probability (a loop over experts); a token's picks fill its slots best first (with fewer slots
  than E, its best ones: experts may then end below C). AoE with expert choice: by its norms."""
  b, t, d, e, c_f = 2, 5, 8, 4, 1.5
  rng = np.random.default_rng(11)
  w, x = rng.standard_normal((d, e)) * 2, rng.standard_normal((b, t, d))
  r = _router("topk_softmax", d, e, 2, {"kernel": w}, selection="expert_choice",
              expert_choice_capacity=c_f, expert_choice_slots=slots, balance_loss="none")
  aoe, pool, w_a = _aoe_router_and_pool(d, e, 2, 3, rng, selection="expert_choice",
                                        expert_choice_capacity=c_f, expert_choice_slots=slots,
                                        balance_loss="none")
  x32 = x.astype(np.float32).astype(np.float64)
  norms = np.sqrt(np.sum(np.einsum("btd,edr->bter", x32, w_a) ** 2, -1) + 1e-12)
  n, cap = b * t, int(np.ceil(c_f * b * t / e))
  for out, probs in ((r(jnp.asarray(x, jnp.float32)), _softmax(x32 @ w)),
                     (aoe(jnp.asarray(x, jnp.float32), expert_pool=pool), _softmax(norms))):
    flat = probs.reshape(n, e)
    picked = np.zeros((n, e), bool)
    for ex in range(e):                                  # each expert: its top-C tokens
      picked[np.argsort(-flat[:, ex], kind="stable")[:cap], ex] = True
    s = slots or e
    ids = np.asarray(out.expert_ids).reshape(n, s)
    mask = np.asarray(out.slot_mask).reshape(n, s)
    gates = np.asarray(out.gates).reshape(n, s)
    got = np.zeros((n, e), bool)
    for tok in range(n):
      want = sorted(np.nonzero(picked[tok])[0], key=lambda ex: -flat[tok, ex])[:s]
      assert list(ids[tok][mask[tok]]) == want, tok
      got[tok, ids[tok][mask[tok]]] = True
      np.testing.assert_allclose(gates[tok][mask[tok]], flat[tok, want], rtol=2e-5)
      assert (gates[tok][~mask[tok]] == 0).all()
    if slots is None:
      np.testing.assert_array_equal(got, picked)
      assert (got.sum(0) == cap).all()                     # every expert exactly full
    else:
      assert (got.sum(0) <= cap).all() and (got.sum(1) <= slots).all()
    assert got.sum(1).max() > got.sum(1).min()             # tokens get different numbers


@pytest.mark.parametrize("family,over", [
    ("umoe", {}),                                                  # pre-mixing queries + FFN pool
    ("moa", {"attention.n_experts": 5}),
    ("switchhead", {"attention.n_experts": 4, "attention.top_k": 2}),
])
def test_unused_top_p_slots_run_through_no_expert(family, over, monkeypatch):
  """Top-P's unused slots (gate 0) take no expert rows in every routed sub-layer (the dispatch's
  masked ids), and the logits equal those of the same model running every slot through its
  expert (slot masks ignored)."""
  from umoe_jax.ops import dispatch
  cfg = tiny_config(family, **over, **{"router.selection": "top_p", "router.entropy_coef": 1e-4})
  model = random_module(lambda: CausalLM(cfg, rngs=nnx.Rngs(params=0)), seed=4)
  tokens = jnp.asarray(np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 11)), jnp.int32)
  forward = lambda: nnx.jit(lambda m, t: m(t, return_routes=True))(model, tokens)
  logits, aux = forward()
  masks = [np.asarray(r.slot_mask) for r in aux["routes"].values() if r.slot_mask is not None]
  assert masks and any(not m.all() for m in masks)          # slots were left unused
  if family == "switchhead":   # its H*E groups: a masked slot gets the id of no group
    x = jnp.asarray(np.random.default_rng(6).standard_normal((2, 11, cfg.d_model)), jnp.float32)
    experts = model.layers[0].attention.v_experts
    ids, _, outs = experts.route(x)
    mask = np.concatenate([np.asarray(o.slot_mask) for o in outs], -1).reshape(ids.shape)
    assert not mask.all()
    np.testing.assert_array_equal(np.asarray(ids) == experts.n_experts * experts.n_heads, ~mask)
  monkeypatch.setattr(dispatch, "mask_slots", lambda ids, mask, e: ids)
  every_slot, _ = forward()
  assert np.abs(np.asarray(logits) - np.asarray(every_slot)).max() <= 1e-5 * np.abs(
      np.asarray(every_slot)).max()


def test_aoe_parameter_matching():
  """Eq. 5: the widened expert of AoE has the parameters of its SMoE baseline (rounded up): the
  paper's numbers, and a gated / plain tiny model counted on the real modules."""
  from umoe_jax.model.routers.aoe import matched_expert_width
  assert matched_expert_width(768, 3072, 256, gated=True) == 3840      # the paper's small models
  assert matched_expert_width(1280, 5120, 400, gated=True) == 6470     # its 4B model
  for gated in (True, False):
    d, f, r = 128, 32, 40
    wide = matched_expert_width(d, f, r, gated)
    base = tiny_config("ffn_moe", **{"d_model": d, "moe.d_expert": f, "moe.gated": gated})
    aoe = tiny_config("ffn_moe", **{"d_model": d, "moe.d_expert": wide, "moe.gated": gated,
                                    "router.kind": "aoe", "router.aoe_dim": r})
    e = base.moe.n_experts
    per_expert = lambda cfg: stats.model_params(cfg)["experts"] / (e * cfg.n_layers)
    extra = per_expert(aoe) - per_expert(base)
    assert 0 <= extra < r + (2 if gated else 1) * d, (gated, extra)   # within one column of F'
    assert stats.param_mismatches(aoe) == {}
