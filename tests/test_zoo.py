"""The model zoo (issue 3): MoA, SwitchHead, post-mixing, MLA-latent pre-mixing and gated experts
against naive float64 loops; the ablation switches; parameter/MAC counts of the paper's configs."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs.common
import paper_counts
import reference as R
from conftest import numpy_params, positions_for, random_module, rel_err, tiny_config
from umoe_jax import stats
from umoe_jax.config import ConfigError, model_config
from umoe_jax.model import CausalLM, abstract_model
from umoe_jax.model.attention import ATTENTIONS
from umoe_jax.model.block import make_expert_pool
from umoe_jax.model.experts import ExpertPool
from umoe_jax.model.layers import MLP

F32_BOUND = 1e-5
B, T = 2, 9


def _rope(cfg):
  return lambda v, pos: R.rope_official(v, pos, cfg.rope_theta, cfg.rope_layout)


def _attend(q, keys, values, visible):
  """softmax over the visible entries of q . keys / sqrt(d_k), times values."""
  scores = [float(q @ keys[j]) / math.sqrt(q.shape[0]) for j in visible]
  a = R.softmax(np.array(scores))
  out = np.zeros(values[0].shape[0])
  for w, j in zip(a, visible):
    out += w * values[j]
  return out


def _sigmoid_route(x, w_r, k):
  """sigmoid(x W_r), greedy top-k; gates = the chosen sigmoid scores."""
  scores = 1.0 / (1.0 + np.exp(-(R.f64(x) @ R.f64(w_r))))
  remaining, ids = list(range(scores.shape[0])), []
  for _ in range(k):
    best = max(remaining, key=lambda e: scores[e])
    ids.append(best)
    remaining.remove(best)
  return np.array(ids), scores[ids]


def _route(cfg, x, w_r, k):
  if cfg.router.kind == "topk_sigmoid":
    return _sigmoid_route(x, w_r, k)
  _, ids, gates = R.route_token(x, w_r, k, cfg.router.renormalize)
  return ids, gates


def _inputs(cfg, seed):
  return np.random.default_rng(seed).standard_normal((B, T, cfg.d_model)).astype(np.float32)


def _run(kind_cfg, seed, with_pool=False):
  att = random_module(lambda: ATTENTIONS.get(kind_cfg.attention.kind)(kind_cfg, rngs=nnx.Rngs(0)), seed)
  pool = (random_module(lambda: make_expert_pool(kind_cfg, nnx.Rngs(0)), seed + 1)
          if with_pool else None)
  x = _inputs(kind_cfg, seed + 2)
  y, routes = att(jnp.asarray(x), positions_for(B, T), experts=pool)
  return att, pool, x, np.asarray(y), routes


# ------------------------------------------------------------------------------------------------
# Naive references, one sequence x [T, D] at a time.


def moa_ref(x, p, cfg):
  att, rope = cfg.attention, _rope(cfg)
  keys = [rope(x[s] @ p["k_proj"]["kernel"], s) for s in range(T)]
  values = [x[s] @ p["v_proj"]["kernel"] for s in range(T)]
  y = np.zeros_like(x)
  for t in range(T):
    ids, gates = _route(cfg, x[t], p["router"]["kernel"], att.top_k)
    for i, g in zip(ids, gates):
      o = _attend(rope(x[t] @ p["q_experts"][i], t), keys, values, range(t + 1))
      y[t] += g * (o @ p["o_experts"][i])
    if att.n_shared_experts:
      o = _attend(rope(x[t] @ p["shared_q_proj"]["kernel"], t), keys, values, range(t + 1))
      y[t] += o @ p["shared_o_proj"]["kernel"]
  return y


def switchhead_ref(x, p, cfg):
  att, rope = cfg.attention, _rope(cfg)
  h_, dk, e_ = att.n_heads, att.head_dim, att.n_experts
  y = np.zeros_like(x)
  for h in range(h_):
    sl = slice(h * dk, (h + 1) * dk)
    keys = [rope(x[s] @ p["k_proj"]["kernel"][:, sl], s) for s in range(T)]
    values = []
    for s in range(T):          # value experts, routed by the source token
      ids, gates = _route(cfg, x[s], p["v_experts"]["router"][h]["kernel"], att.top_k)
      values.append(sum(g * (x[s] @ p["v_experts"]["w"][h * e_ + i]) for i, g in zip(ids, gates)))
    for t in range(T):          # output experts, routed by the destination token
      o = _attend(rope(x[t] @ p["q_proj"]["kernel"][:, sl], t), keys, values, range(t + 1))
      ids, gates = _route(cfg, x[t], p["o_experts"]["router"][h]["kernel"], att.top_k)
      for i, g in zip(ids, gates):
        y[t] += g * (o @ p["o_experts"]["w"][h * e_ + i])
  return y


def _mlp(v, p, cfg):
  act = R.ACT[cfg.moe.activation]
  h = R.f64(v) @ p["up"]["kernel"]
  if p.get("gate") is not None and "kernel" in p.get("gate", {}):
    h = act(R.f64(v) @ p["gate"]["kernel"]) * h
  else:
    h = act(h)
  return h @ p["down"]["kernel"]


def _expert(v, pool, i, cfg):
  act = R.ACT[cfg.moe.activation]
  h = R.f64(v) @ pool["w_up"][i]
  h = act(R.f64(v) @ pool["w_gate"][i]) * h if "w_gate" in pool else act(h)
  return h @ pool["w_down"][i]


def postmix_picks(cfg, x, w_r, k):
  """One token's K attention slots: (ids [K], gates [K], active [K] bool). Top-k: all active;
  top-P: slot j active iff the probabilities of slots 0..j-1 sum to less than P (slot 0 always);
  SMoE-Dropout at step 0: the first k_start slots. Inactive slots get gate 0."""
  r = cfg.router_for("attention")
  if r.selection != "top_p" and r.kind != "smoe_dropout":
    ids, gates = _route(cfg, x, w_r, k)
    return ids, gates, np.ones(k, bool)
  _, ids, top = R.route_token(x, w_r, k, False)
  if r.selection == "top_p":
    active = np.array([j == 0 or top[:j].sum() < r.top_p for j in range(k)])
  else:
    active = np.arange(k) < min(r.smoe_dropout_k_start, k)
  gates = np.where(active, top, 0.0)
  return ids, (gates / gates.sum() if r.renormalize else gates), active


def postmix_ref(x, p, pool, cfg, masked_in_softmax=False):
  """One softmax over the (token, slot) entries a query sees; a slot without a pick is no entry
  (`masked_in_softmax`: the old behaviour, such slots entries with value 0, for the contrast)."""
  att, rope = cfg.attention, _rope(cfg)
  keys, values, owner = [], [], []          # every (token, slot) entry
  for s in range(T):
    ids, gates, active = postmix_picks(cfg, x[s], p["router"]["kernel"], att.top_k)
    if att.n_shared_experts:
      keys.append(rope(x[s] @ p["shared_k_proj"]["kernel"], s))
      values.append(_mlp(x[s], p["shared_expert"], cfg))
      owner.append(s)
    for i, g, a in zip(ids, gates, active):
      if not (a or masked_in_softmax):
        continue
      if att.q_lora_rank is None:
        k = x[s] @ p["k_b"][i]
      else:
        code = x[s] @ p["k_a"][i]
        if att.q_lora_norm:
          code = R.rms_norm_vec(code, p["k_a_norm"]["scale"], cfg.norm_eps)
        k = x[s] @ p["k_res_proj"]["kernel"] + code @ p["k_b"][i]
      keys.append(rope(k, s))
      values.append(g * _expert(x[s], pool, i, cfg))
      owner.append(s)
  y = np.zeros_like(x)
  for t in range(T):
    q = rope(x[t] @ p["q_proj"]["kernel"], t)
    y[t] = _attend(q, keys, values, [j for j in range(len(keys)) if owner[j] <= t])
  return y


def premix_mla_ref(x, p, pool, cfg):
  att, rope = cfg.attention, _rope(cfg)
  keys = [rope(x[s] @ p["k_proj"]["kernel"], s) for s in range(T)]
  latents = [x[s] @ p["latent_proj"]["kernel"] for s in range(T)]
  up = p["latent_up"]["kernel"]
  y = np.zeros_like(x)
  for t in range(T):
    ids, gates = _route(cfg, x[t], p["router"]["kernel"], att.top_k)
    m = _attend(rope(x[t] @ p["shared_q_proj"]["kernel"], t), keys, latents, range(t + 1)) @ up
    y[t] += _mlp(m, p["shared_expert"], cfg)
    for i, g in zip(ids, gates):
      code = R.rms_norm_vec(x[t] @ p["q_a"][i], p["q_a_norm"]["scale"], cfg.norm_eps)
      q = x[t] @ p["q_res_proj"]["kernel"] + code @ p["q_b"][i]
      m = _attend(rope(q, t), keys, latents, range(t + 1)) @ up
      y[t] += g * _expert(m, pool, i, cfg)
  return y


# ------------------------------------------------------------------------------------------------
# Modules against the references (float32 vs float64).


@pytest.mark.parametrize("shared", [1, 0])
def test_moa(shared):
  cfg = tiny_config("moa", **{"attention.n_experts": 5, "attention.top_k": 2,
                              "attention.n_shared_experts": shared})
  att, _, x, y, routes = _run(cfg, seed=10 + shared)
  p = numpy_params(att)
  ref = np.stack([moa_ref(x[b], p, cfg) for b in range(B)])
  assert rel_err(y, ref) < F32_BOUND
  assert set(routes) == {"attention"}
  assert p["q_experts"].shape == (5, 24, 8) and p["o_experts"].shape == (5, 6, 24)


@pytest.mark.parametrize("variant", ["umoe_repo", "original"])
def test_switchhead(variant):
  over = {"attention.n_experts": 4, "attention.top_k": 1}
  if variant == "original":
    over = {"attention.n_experts": 4, "attention.top_k": 2, "router.kind": "topk_sigmoid",
            "router.balance_loss": "none"}
  cfg = tiny_config("switchhead", **over)
  att, _, x, y, routes = _run(cfg, seed=20)
  ref = np.stack([switchhead_ref(x[b], numpy_params(att), cfg) for b in range(B)])
  assert rel_err(y, ref) < F32_BOUND
  assert set(routes) == {f"attention_{w}{h}" for w in "vo" for h in range(cfg.attention.n_heads)}
  if variant == "original":
    assert all(float(r.balance_loss) == 0.0 for r in routes.values())
    g = np.asarray(routes["attention_v0"].gates)
    assert np.all((g > 0) & (g < 1))      # sigmoid scores, not a distribution over the picks


@pytest.mark.parametrize("variant", ["lora", "full_keys", "no_shared", "linear_experts"])
def test_postmix(variant):
  over = {"umoe": {}, "full_keys": {"attention.q_lora_rank": None},
          "no_shared": {"attention.n_shared_experts": 0},
          "linear_experts": {"moe.activation": "none"}}.get(variant, {})
  cfg = tiny_config("umoe", **{"attention.kind": "postmix", **over})
  att, pool, x, y, _ = _run(cfg, seed=30, with_pool=True)
  ref = np.stack([postmix_ref(x[b], numpy_params(att), numpy_params(pool), cfg) for b in range(B)])
  assert rel_err(y, ref) < F32_BOUND


@pytest.mark.parametrize("variant", ["top_p", "top_p_no_shared", "smoe_dropout"])
def test_postmix_slots_without_a_pick_are_no_entries(variant, monkeypatch):
  """Top-P's unused slots (a varying number per token) and SMoE-Dropout's slots beyond k(step) get
  zero attention weight and no expert rows: the float64 loop's softmax runs over the real entries
  only, and differs from one that keeps the masked slots as entries of value 0."""
  from umoe_jax.ops import dispatch
  top_p = {"router.selection": "top_p", "router.entropy_coef": 1e-4}
  over = {"top_p": top_p, "top_p_no_shared": {**top_p, "attention.n_shared_experts": 0},
          "smoe_dropout": {"router.kind": "smoe_dropout", "router.balance_loss": "none",
                           "router.smoe_dropout_k_start": 2}}[variant]
  cfg = tiny_config("umoe", **{"attention.kind": "postmix", "attention.top_k": 3, **over})
  att = random_module(lambda: ATTENTIONS.get("postmix")(cfg, rngs=nnx.Rngs(0)), 31)
  pool = random_module(lambda: make_expert_pool(cfg, nnx.Rngs(0)), 32)
  x = _inputs(cfg, 33)
  plans, make_plan = [], dispatch.make_plan
  monkeypatch.setattr(dispatch, "make_plan", lambda *a: plans.append(make_plan(*a)) or plans[-1])
  context = {"step": jnp.int32(0)} if variant == "smoe_dropout" else None
  y, routes = att(jnp.asarray(x), positions_for(B, T), experts=pool, route_context=context)
  y = np.asarray(y)
  p, pool_p = numpy_params(att), numpy_params(pool)
  mask = np.asarray(routes["attention"].slot_mask)                             # [B, T, K]
  want = [[postmix_picks(cfg, x[b, s], p["router"]["kernel"], 3)[2] for s in range(T)]
          for b in range(B)]
  np.testing.assert_array_equal(mask, want)
  picks = mask.sum(-1)
  assert picks.min() < 3 and (variant == "smoe_dropout" or picks.max() > picks.min())
  assert int(np.asarray(plans[0].group_sizes).sum()) == mask.sum()            # no rows for them
  ref = np.stack([postmix_ref(x[b], p, pool_p, cfg) for b in range(B)])
  assert rel_err(y, ref) < F32_BOUND
  diluted = np.stack([postmix_ref(x[b], p, pool_p, cfg, masked_in_softmax=True) for b in range(B)])
  assert rel_err(y, diluted) > 1e-2


@pytest.mark.parametrize("gated", [False, True])
def test_premix_mla_latent(gated):
  cfg = tiny_config("umoe", **{"attention.latent_dim": 5, "moe.gated": gated})
  att, pool, x, y, _ = _run(cfg, seed=40, with_pool=True)
  ref = np.stack([premix_mla_ref(x[b], numpy_params(att), numpy_params(pool), cfg)
                  for b in range(B)])
  assert rel_err(y, ref) < F32_BOUND
  assert numpy_params(att)["latent_proj"]["kernel"].shape == (24, 5)


def test_gated_expert_pool_and_mlp():
  rng = np.random.default_rng(50)
  pool = random_module(lambda: ExpertPool(4, 12, 7, activation="silu", std=0.02,
                                          param_dtype="float32", compute_dtype="float32",
                                          gmm_backend="xla", rngs=nnx.Rngs(0), gated=True), 51)
  sizes = np.array([3, 0, 4, 2])
  rows = rng.standard_normal((9, 12)).astype(np.float32)
  out = np.asarray(pool(jnp.asarray(rows), jnp.asarray(sizes, jnp.int32)))
  p = numpy_params(pool)
  expert = np.repeat(np.arange(4), sizes)
  ref = np.stack([R.silu(rows[m] @ p["w_gate"][e]) * (rows[m] @ p["w_up"][e]) @ p["w_down"][e]
                  for m, e in enumerate(expert)])
  assert rel_err(out, ref) < F32_BOUND
  mlp = random_module(lambda: MLP(12, 7, activation="silu", std=0.02, param_dtype="float32",
                                  compute_dtype="float32", rngs=nnx.Rngs(0), gated=True), 52)
  q = numpy_params(mlp)
  ref = np.stack([R.silu(r @ q["gate"]["kernel"]) * (r @ q["up"]["kernel"]) @ q["down"]["kernel"]
                  for r in rows])
  assert rel_err(np.asarray(mlp(jnp.asarray(rows))), ref) < F32_BOUND


# ------------------------------------------------------------------------------------------------
# Ablation switches: structure (what is shared, what exists) and that the model runs.


def _count(model) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def _lm(cfg):
  return abstract_model(cfg)


def test_ablation_switches_share_modules():
  base = tiny_config("umoe", n_layers=2)
  d, e, f, r = base.d_model, base.moe.n_experts, base.moe.d_expert, base.attention.top_k
  n_base = _count(_lm(base))
  m = _lm(tiny_config("umoe", n_layers=2, **{"moe.share_across_layers": True}))
  assert m.layers[0].experts is m.layers[1].experts
  assert _count(m) == n_base - 2 * e * d * f
  m = _lm(tiny_config("umoe", n_layers=2, **{"router.share_att_ffn": True}))
  assert m.layers[0].ffn.router.kernel is m.layers[0].attention.router.kernel
  assert m.layers[0].ffn.router.top_k == base.ffn.top_k and m.layers[0].attention.router.top_k == r
  assert _count(m) == n_base - 2 * d * e
  m = _lm(tiny_config("umoe", n_layers=2, **{"moe.share_always_on": True, "ffn.n_shared_experts": 1}))
  assert m.layers[0].ffn.shared_expert is m.layers[0].attention.shared_expert
  assert _count(m) == n_base - 2 * 2 * d * f
  m = _lm(tiny_config("umoe", n_layers=2, **{"ffn.kind": "none"}))
  assert m.layers[0].ffn is None and m.layers[0].ffn_norm is None
  m = _lm(tiny_config("umoe", n_layers=2, **{"moe.gated": True}))
  assert _count(m) == n_base + 2 * (e * d * f + 2 * d * f)  # w_gate + the two always-on gates


def _unshared(p, switch):
  """The parameters of a model with `switch` as the plain model's layout, each shared weight copied
  to every place that uses it (nnx lists a shared module once, where it first occurs)."""
  layers = p["layers"]
  for i in layers:
    if switch.get("moe.share_across_layers"):      # one pool for all layers: layer 0's
      layers[i]["experts"] = layers[0]["experts"]
    if switch.get("router.share_att_ffn"):         # the FFN routes with the attention's weights
      layers[i]["ffn"]["router"] = layers[i]["attention"]["router"]
    if switch.get("moe.share_always_on"):          # one always-on expert for both sub-layers
      layers[i]["ffn"]["shared_expert"] = layers[i]["attention"]["shared_expert"]
  return p


@pytest.mark.parametrize("switch", [{"moe.share_across_layers": True}, {"router.share_att_ffn": True},
                                    {"moe.share_always_on": True}, {"ffn.kind": "none"},
                                    {"moe.share_pool": False}])
def test_ablation_forward_matches_reference_and_stats(switch):
  """Each ablation's 2-layer LM on random tokens against the float64 loop LM (reference.causal_lm)
  given the shared weights in every place that uses them: logits, routing and balance loss."""
  cfg = tiny_config("umoe", n_layers=2, **switch)
  model = random_module(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)), 60)
  tokens = np.random.default_rng(61).integers(0, cfg.vocab_size, (2, 7)).astype(np.int32)
  logits, aux = nnx.jit(lambda m, t: m(t))(model, jnp.asarray(tokens))
  ref, routes, loss = R.causal_lm(tokens, _unshared(numpy_params(model), switch), cfg)
  assert rel_err(logits, ref) < F32_BOUND
  assert set(aux["routers"]) == set(routes)
  for name, (_, ids, _) in routes.items():
    np.testing.assert_array_equal(np.asarray(aux["routers"][name]["expert_counts"]),
                                  np.bincount(ids.reshape(-1), minlength=cfg.moe.n_experts), name)
  np.testing.assert_allclose(float(aux["balance_loss"]), loss, rtol=1e-5)
  assert stats.param_mismatches(cfg) == {}
  assert stats.total_params(cfg) == _count(model)


@pytest.mark.parametrize("key,value,needle", [
    ("router.share_att_ffn", True, "model.router.share_att_ffn=True"),
    ("moe.share_always_on", True, "model.moe.share_always_on=True"),
    ("moe.share_across_layers", True, "model.moe.share_across_layers=True"),
    ("attention.latent_dim", 0, "model.attention.latent_dim=0"),
    ("ffn.kind", "sparse", "model.ffn.kind='sparse'"),
])
def test_ablation_config_errors(key, value, needle):
  family = "dense" if key.startswith(("router", "moe")) else "umoe"
  with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace("(", r"\(")):
    tiny_config(family, **{key: value})


@pytest.mark.parametrize("kind,key,value,needle", [
    ("moa", "attention.n_experts", 0, "model.attention.n_experts=0"),
    ("moa", "attention.n_shared_experts", 2, "model.attention.n_shared_experts=2"),
    ("switchhead", "attention.top_k", 9, "model.attention.top_k=9"),
    ("postmix", "attention.latent_dim", 4, "model.attention.latent_dim=4"),
])
def test_variant_config_errors(kind, key, value, needle):
  family = {"moa": "moa", "switchhead": "switchhead", "postmix": "umoe"}[kind]
  over = {key: value}
  if kind == "postmix":
    over["attention.kind"] = "postmix"
  with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
    tiny_config(family, **over)


# ------------------------------------------------------------------------------------------------
# The paper's configs: parameters and MACs, Table 1 at both scales built abstractly with their
# statistics. Counts: by hand from the official dimensions (tests/paper_counts.py), exactly (they are
# integers); figures: the published ones (umoe.md), to within one unit of their last printed digit.


@pytest.mark.parametrize("family,scale", sorted(paper_counts.FIGURES))
def test_paper_counts(family, scale):
  cfg = configs.common.model(family, scale)
  params, macs = stats.total_params(cfg), stats.forward_macs(cfg, batch=4, seq_len=1024)
  assert params == paper_counts.hand_params(family, scale)
  assert macs == paper_counts.hand_macs(family, scale)
  (fig_params, unit), fig_macs = paper_counts.FIGURES[(family, scale)]
  assert abs(params - fig_params) <= unit, params
  if fig_macs is not None:
    assert abs(macs - fig_macs[0]) <= fig_macs[1], macs


TABLE1 = ("dense", "ffn_moe", "moa", "switchhead", "umoe_att", "umoe")


@pytest.mark.parametrize("scale", ["base", "large"])
@pytest.mark.parametrize("family", TABLE1)
def test_table1_configs_build_and_report(family, scale):
  path = f"configs/{family}_{scale}.py"
  cfg = stats.load_config_file(path)
  s = stats.model_stats(cfg, batch=4, name=path)
  assert s["params"]["check"] != "mismatch", s["params"]
  assert s["params"]["total"] > 1e8 and s["macs"]["forward"] > 4e11
  assert s["kv_cache"]["bytes_per_token"] > 0
  from umoe_jax.model.cache import cache_values_per_token
  m = model_config(cfg.model)
  assert (s["kv_cache"]["bytes_per_token_per_layer"]
          == cache_values_per_token(m) * s["kv_cache"]["bytes_per_value"])
