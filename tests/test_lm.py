"""Decoder block and 2-layer CausalLM end to end against a float64 loop oracle; causality; parameter
counts of the paper models; initialisation statistics."""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs.common as common
import reference as R
from conftest import numpy_params, positions_for, random_module, rel_err, tiny_config
from umoe_jax.config import model_config
from umoe_jax.model import CausalLM, abstract_model
from umoe_jax.model.block import DecoderBlock

F32_BOUND = 1e-5     # float32 against float64: observed ~2.5e-7 for the 2-layer LM
BF16_BOUND = 3e-2    # bfloat16 compute (2 layers, bf16 residual stream): observed ~7e-3
B, T = 2, 10
FAMILIES = ["dense", "ffn_moe", "umoe"]


@nnx.jit
def _forward(model, tokens):
  return model(tokens)


@nnx.jit
def _forward_and_ids(model, tokens):
  """The LM's logits, and the expert ids of every router of every layer (the aux record has only
  statistics), from the blocks run one by one as CausalLM runs them; one compilation for both."""
  logits, _ = model(tokens)
  h = jnp.take(model.embed[...], tokens, axis=0).astype(model.cfg.compute_dtype)
  pos = positions_for(*tokens.shape)
  ids = {}
  for i, layer in enumerate(model.layers):
    h, routes = layer(h, pos)
    ids.update({f"layer_{i}/{name}": r.expert_ids for name, r in routes.items()})
  return logits, ids


@nnx.jit
def _block_call(block, h):
  return block(h, positions_for(h.shape[0], h.shape[1]))


def _lm_config(family, **kw):
  return tiny_config(family, n_layers=2, **kw)


def _tokens(seed, vocab):
  return np.random.default_rng(seed).integers(0, vocab, size=(B, T)).astype(np.int32)


@pytest.fixture(scope="module", params=FAMILIES)
def f32_lm(request):
  cfg = _lm_config(request.param)
  model = random_module(lambda: CausalLM(cfg, rngs=nnx.Rngs(params=0)), 100)
  return request.param, cfg, model


# ------------------------------------------------------------------------------------------------
# Decoder block.


@pytest.mark.parametrize("family,overrides", [
    ("dense", {}), ("ffn_moe", {}), ("umoe", {}), ("umoe", {"moe.share_pool": False}),
], ids=["dense", "ffn_moe", "umoe", "umoe_separate_pools"])
def test_block_float32(family, overrides):
  cfg = tiny_config(family, **overrides)
  block = random_module(lambda: DecoderBlock(cfg, rngs=nnx.Rngs(params=0)), 1)
  h = 2.0 * np.random.default_rng(2).standard_normal((B, T, cfg.d_model)).astype(np.float32)
  out, routes = _block_call(block, jnp.asarray(h))
  p = numpy_params(block)
  refs = [R.block(h[b], p, cfg) for b in range(B)]
  assert rel_err(out, np.stack([r[0] for r in refs])) < F32_BOUND
  expected_routers = {"dense": set(), "ffn_moe": {"ffn"}, "umoe": {"attention", "ffn"}}[family]
  assert set(routes) == expected_routers
  for name in routes:
    np.testing.assert_array_equal(np.asarray(routes[name].expert_ids),
                                  np.stack([r[1][name][1] for r in refs]))


# ------------------------------------------------------------------------------------------------
# The LM end to end.


def test_lm_float32(f32_lm):
  family, cfg, model = f32_lm
  tokens = _tokens(3, cfg.vocab_size)
  logits, aux = _forward(model, jnp.asarray(tokens))
  assert logits.shape == (B, T, cfg.vocab_size) and logits.dtype == jnp.float32
  ref_logits, routes, loss = R.causal_lm(tokens, numpy_params(model), cfg)
  assert rel_err(logits, ref_logits) < F32_BOUND
  expected = {"dense": [], "ffn_moe": ["ffn"], "umoe": ["attention", "ffn"]}[family]
  assert set(aux["routers"]) == {f"layer_{i}/{n}" for i in range(cfg.n_layers) for n in expected}
  assert set(routes) == set(aux["routers"])
  np.testing.assert_allclose(float(aux["balance_loss"]), loss, rtol=1e-5, atol=1e-12)
  for name, (probs, ids, _) in routes.items():
    stats = aux["routers"][name]
    counts = np.bincount(ids.reshape(-1), minlength=cfg.moe.n_experts)
    np.testing.assert_array_equal(np.asarray(stats["expert_counts"]), counts)
    coef = cfg.router.balance_coef
    np.testing.assert_allclose(float(stats["balance_loss"]), coef * R.seq_aux_loss(probs, ids),
                               rtol=1e-5)
    entropy = float(np.mean(-np.sum(probs * np.log(probs), axis=-1)))
    np.testing.assert_allclose(float(stats["entropy"]), entropy, rtol=1e-5)


def test_lm_bfloat16_umoe():
  cfg = _lm_config("umoe", compute_dtype="bfloat16")
  model = random_module(lambda: CausalLM(cfg, rngs=nnx.Rngs(params=0)), 100)
  tokens = _tokens(4, cfg.vocab_size)
  logits, jax_ids = _forward_and_ids(model, jnp.asarray(tokens))
  assert logits.dtype == jnp.float32
  p = numpy_params(model)
  jax_ids = {k: np.asarray(v) for k, v in jax_ids.items()}
  _, free_routes, _ = R.causal_lm(tokens, p, cfg)
  agree = np.mean([np.mean(free_routes[k][1] == v) for k, v in jax_ids.items()])
  assert agree > 0.9, f"bf16 routing differs from float64 in {1 - agree:.0%} of the choices"
  ref_logits, _, _ = R.causal_lm(tokens, p, cfg, forced=jax_ids)
  assert rel_err(logits, ref_logits) < BF16_BOUND


def test_lm_length_limit():
  cfg = _lm_config("umoe")
  model = abstract_model(cfg)
  with pytest.raises(ValueError, match="max_seq_len"):
    model(jnp.zeros((1, cfg.max_seq_len + 1), jnp.int32))


def test_lm_gradient_matches_finite_differences():
  """d(LM loss + balance loss)/d(all parameters) along a random direction equals a central finite
  difference: checks the custom VJPs of the grouped matmuls, the dispatch scatter/gather and the
  routers inside the whole UMoE model. Valid only if the step flips no routing choice (top-k is
  piecewise constant), which is asserted through the per-router expert counts."""
  cfg = tiny_config("umoe")   # one layer: the compiled gradient is the costly part
  model = random_module(lambda: CausalLM(cfg, rngs=nnx.Rngs(params=0)), 300)
  tokens = jnp.asarray(_tokens(7, cfg.vocab_size))
  graphdef, params = nnx.split(model, nnx.Param)

  def loss_fn(params):
    logits, aux = nnx.merge(graphdef, params)(tokens[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))
    counts = {k: v["expert_counts"] for k, v in aux["routers"].items()}
    return nll + aux["balance_loss"], counts

  value_and_grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
  (_, counts), grads = value_and_grad(params)
  rng = np.random.default_rng(8)
  direction = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), params)
  analytic = sum(float(jnp.vdot(g, v)) for g, v in zip(jax.tree.leaves(grads),
                                                        jax.tree.leaves(direction)))
  eps = 1e-3
  values = []
  for sign in (1, -1):
    (value, c), _ = value_and_grad(jax.tree.map(lambda p, v: p + sign * eps * v, params, direction))
    for name in counts:
      np.testing.assert_array_equal(np.asarray(c[name]), np.asarray(counts[name]),
                                    err_msg=f"the step flips a routing choice of {name}")
    values.append(float(value))
  numeric = (values[0] - values[1]) / (2 * eps)
  print(f"directional derivative: analytic {analytic:.6f}, finite difference {numeric:.6f}")
  assert abs(analytic - numeric) < 2e-3 * abs(numeric), (analytic, numeric)
  assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))


# ------------------------------------------------------------------------------------------------
# Causality.


def test_lm_is_causal(f32_lm):
  """Changing token p changes no logit before p, changes the logits at p and after, and changes
  nothing in the other sequence of the batch (dropless routing: no cross-token interference)."""
  _, cfg, model = f32_lm
  tokens = _tokens(6, cfg.vocab_size)
  base, _ = _forward(model, jnp.asarray(tokens))
  for p in (3, 7):
    changed = tokens.copy()
    changed[0, p] = (changed[0, p] + 1) % cfg.vocab_size
    out, _ = _forward(model, jnp.asarray(changed))
    d = np.abs(np.asarray(out) - np.asarray(base)).max(-1)
    scale = np.abs(np.asarray(base)).max()
    assert np.all(d[0, :p] <= 1e-6 * scale), (p, d[0])
    assert np.all(d[0, p:] > 1e-4 * scale), (p, d[0])
    assert np.all(d[1] <= 1e-6 * scale), (p, d[1])


# ------------------------------------------------------------------------------------------------
# Parameter counts of the paper's models (umoe.md section 2, computed from the official configs).

PAPER_PARAMS = {
    ("dense", "base"): 134.1e6,
    ("ffn_moe", "base"): 535.2e6,
    ("umoe", "base"): 540.5e6,
    ("dense", "large"): 1087.5e6,
    ("ffn_moe", "large"): 3808.5e6,
    ("umoe", "large"): 3676.4e6,
}


def _count(model):
  return sum(math.prod(a.shape) for a in jax.tree.leaves(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize("family,scale", list(PAPER_PARAMS))
def test_parameter_counts(family, scale):
  model = abstract_model(common.model(family, scale))
  n = _count(model)
  want = PAPER_PARAMS[(family, scale)]
  assert abs(n - want) / want < 1e-3, f"{family} {scale}: {n / 1e6:.1f}M vs paper {want / 1e6:.1f}M"


def test_umoe_parameter_breakdown():
  """Count the UMoE base layer by hand from the official config: the pool is counted once although
  attention and FFN both route into it."""
  cfg = tiny_config("umoe")
  d, e, f, dk, r = (cfg.d_model, cfg.moe.n_experts, cfg.moe.d_expert, cfg.attention.head_dim,
                    cfg.attention.q_lora_rank)
  ns_att, ns_ffn = cfg.attention.n_shared_experts, cfg.ffn.n_shared_experts
  attention = d * e + d * dk + d * dk + e * d * r + r + e * r * dk + d * dk + 2 * d * f * ns_att
  ffn = d * e + 2 * d * f * ns_ffn
  pool = 2 * e * d * f
  layer = attention + ffn + pool + 2 * d
  total = 2 * cfg.vocab_size * d + cfg.n_layers * layer + d
  assert _count(abstract_model(cfg)) == total


# ------------------------------------------------------------------------------------------------
# Initialisation (umoe.md section 1.2 "Init"): linear/embedding N(0, 0.02), router weights
# kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(D), 1/sqrt(D)), RMSNorm scales 1.


def test_init_statistics():
  cfg = tiny_config("umoe", d_model=64, vocab_size=96, n_layers=1,
                    **{"moe.n_experts": 8, "moe.d_expert": 32, "attention.head_dim": 16})
  # An RBG key compiles much faster than threefry on CPU; the initialisers are the same.
  model = nnx.jit(lambda: CausalLM(cfg, rngs=nnx.Rngs(params=jax.random.key(0, impl="rbg"))))()
  flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))[0]
  normal, n_norm, n_router = [], 0, 0
  bound = 1.0 / math.sqrt(cfg.d_model)
  for path, value in flat:
    names = [str(getattr(k, "key", k)) for k in path]
    v = np.asarray(value, np.float64)
    if names[-1] == "scale":
      np.testing.assert_array_equal(v, 1.0)
      n_norm += 1
    elif "router" in names:
      assert v.shape == (cfg.d_model, cfg.moe.n_experts)
      assert np.all(np.abs(v) <= bound) and np.abs(v).max() > 0.9 * bound
      assert abs(v.std() - bound / math.sqrt(3)) < 0.15 * bound / math.sqrt(3)
      n_router += 1
    else:
      if v.size >= 2000:
        assert abs(v.std() - 0.02) < 0.002, ("/".join(names), v.std())
        assert abs(v.mean()) < 0.002, ("/".join(names), v.mean())
      normal.append(v.reshape(-1))
  # per layer: attention norm, FFN norm, q_a norm, 2 routers; + the final norm
  assert n_norm == 3 * cfg.n_layers + 1 and n_router == 2 * cfg.n_layers
  allw = np.concatenate(normal)
  assert abs(allw.std() - 0.02) < 0.0005 and abs(allw.mean()) < 0.0005
  # untied embeddings: the head is not the embedding transposed
  assert not np.allclose(np.asarray(model.embed[...]), np.asarray(model.lm_head[...]).T)


# ------------------------------------------------------------------------------------------------
# The LM head's mixed-precision backward.


def test_logits_dot_backward_runs_in_the_input_dtype_and_matches_float64():
  """`layers.logits_dot` (the LM head): float32 logits from bf16 inputs; its gradients match a
  float64 reference to bf16 precision, and the backward contracts the cotangent in bf16 (plain
  autodiff of the dot would run two float32 matmuls over the [N, V] cotangent)."""
  from umoe_jax.model.layers import logits_dot
  rng = np.random.default_rng(11)
  h64, w64 = rng.standard_normal((3, 5, 48)), rng.standard_normal((48, 200)) / 7
  cot64 = rng.standard_normal((3, 5, 200))
  h, w = jnp.asarray(h64, jnp.bfloat16), jnp.asarray(w64, jnp.bfloat16)
  cot = jnp.asarray(cot64, jnp.float32)
  loss = lambda h, w: jnp.sum(logits_dot(h, w) * cot)
  out = logits_dot(h, w)
  assert out.dtype == jnp.float32 and out.shape == (3, 5, 200)
  hb, wb = np.asarray(h, np.float64), np.asarray(w, np.float64)   # the rounded inputs
  assert rel_err(out, hb @ wb) < 1e-5
  dh, dw = jax.grad(loss, argnums=(0, 1))(h, w)
  assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
  assert rel_err(dh, cot64 @ wb.T) < 1e-2
  assert rel_err(dw, hb.reshape(-1, 48).T @ cot64.reshape(-1, 200)) < 1e-2
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(h, w)
  dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]   # the backward's
  assert len(dots) == 2
  for e in dots:
    assert all(v.aval.dtype == jnp.bfloat16 for v in e.invars), e
  # float32 inputs: an exact float32 backward
  h32, w32 = jnp.asarray(h64, jnp.float32), jnp.asarray(w64, jnp.float32)
  dh32, dw32 = jax.grad(loss, argnums=(0, 1))(h32, w32)
  assert rel_err(dh32, cot64 @ w64.T) < 1e-5 and rel_err(dw32, h64.reshape(-1, 48).T @ cot64.reshape(-1, 200)) < 1e-5


def test_fused_expert_activation_gives_the_same_model():
  """moe.fuse_activation=True (the default: the routed experts' SiLU derivative inside the last
  grouped matmul's backward), and with it moe.fuse_weight_rows=True, compute the same loss and
  parameter gradients as the plain pool (float32, a 2-layer UMoE)."""
  fused_cfg = _lm_config("umoe")
  assert fused_cfg.moe.fuse_activation
  cfg = model_config(dataclasses.replace(fused_cfg, moe=dataclasses.replace(fused_cfg.moe, fuse_activation=False)))
  model = random_module(lambda: CausalLM(cfg, rngs=nnx.Rngs(params=0)), 12)
  graphdef, params = nnx.split(model, nnx.Param)
  fused_graphdef, _ = nnx.split(CausalLM(fused_cfg, rngs=nnx.Rngs(params=0)), nnx.Param)
  tokens = jnp.asarray(_tokens(5, cfg.vocab_size))

  def loss(graphdef):
    def fn(params):
      logits, aux = nnx.merge(graphdef, params)(tokens[:, :-1])
      logp = jax.nn.log_softmax(logits, axis=-1)
      return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)) + aux["balance_loss"]
    return jax.jit(jax.value_and_grad(fn))

  assert not fused_cfg.moe.fuse_weight_rows
  rows_cfg = dataclasses.replace(fused_cfg, moe=dataclasses.replace(fused_cfg.moe, fuse_weight_rows=True))
  rows_graphdef, _ = nnx.split(CausalLM(rows_cfg, rngs=nnx.Rngs(params=0)), nnx.Param)
  (v0, g0) = loss(graphdef)(params)
  for other in (fused_graphdef, rows_graphdef):
    v1, g1 = loss(other)(params)
    assert abs(float(v1) - float(v0)) < 1e-6 * abs(float(v0))
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
      assert rel_err(a, b) < 1e-5


def test_fuse_activation_applies_only_where_it_can(monkeypatch):
  """moe.fuse_activation (default True) takes the activation into gmm_combine for non-gated silu /
  relu pools only: a gelu or gated pool validates and runs the plain path (gmm_combine without an
  activation), a silu pool passes it; the config dict holds booleans only (ml_collections' type)."""
  from configs import common as configs
  from umoe_jax.model import expert_mlp as experts  # the pools' forward on raw arrays
  seen = []
  real = experts.gmm_combine
  monkeypatch.setattr(experts, "gmm_combine", lambda *a, **kw: seen.append(kw.get("activation")) or real(*a, **kw))
  tokens = jnp.asarray(_tokens(3, 64))
  for overrides, want in (({}, "silu"), ({"activation": "relu"}, "relu"), ({"activation": "gelu"}, None),
                          ({"gated": True}, None)):
    m = configs.model("umoe", "tiny")
    m.vocab_size, m.n_layers = 64, 1
    for key, value in overrides.items():
      setattr(m.moe, key, value)
    cfg = model_config(m)
    assert cfg.moe.fuse_activation
    seen.clear()
    graphdef, params = nnx.split(CausalLM(cfg, rngs=nnx.Rngs(params=0)), nnx.Param)
    jax.eval_shape(lambda p: nnx.merge(graphdef, p)(tokens), params)  # traced: the calls are seen
    assert seen and set(seen) == {want}, (overrides, seen)
  # moe.fuse_weight_rows reaches every routed pool's last matmul (attention's and FFN's), gated too
  rows = []
  monkeypatch.setattr(experts, "gmm_combine",
                      lambda *a, **kw: rows.append(kw.get("fuse_weight_rows")) or real(*a, **kw))
  for gated, on in ((False, True), (True, True), (False, False)):
    m = configs.model("umoe", "tiny")
    m.vocab_size, m.n_layers, m.moe.gated, m.moe.fuse_weight_rows = 64, 1, gated, on
    rows.clear()
    graphdef, params = nnx.split(CausalLM(model_config(m), rngs=nnx.Rngs(params=0)), nnx.Param)
    jax.eval_shape(lambda p: nnx.merge(graphdef, p)(tokens), params)
    assert len(rows) >= 2 and set(rows) == {on}, (gated, on, rows)
  m = configs.model("umoe", "tiny")
  with pytest.raises(TypeError, match="fuse_activation"):
    m.moe.fuse_activation = "yes"
