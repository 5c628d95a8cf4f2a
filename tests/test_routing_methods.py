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
