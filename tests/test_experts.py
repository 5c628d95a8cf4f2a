"""Expert pool, MoE FFN (routed pool + separate always-on expert) and dense FFN against float64 loops."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import reference as R
from conftest import bf16_round, numpy_params, random_module, rel_err, tiny_config
from umoe_jax.model.block import DecoderBlock, make_expert_pool
from umoe_jax.model.experts import ExpertPool
from umoe_jax.model.ffn import DenseFFN, MoEFFN

F32_BOUND = 1e-5     # float32 against float64: observed ~1e-7
BF16_BOUND = 2e-2    # bfloat16 compute against float64: observed ~5e-3


@nnx.jit
def _pool_call(pool, rows, gs):
  return pool(rows, gs)


@nnx.jit
def _pool_route(pool, x, ids, gates):
  return pool.route(x, ids, gates)


@nnx.jit
def _ffn_call(ffn, pool, x):
  return ffn(x, experts=pool)


def _pool(cfg, seed):
  return random_module(lambda: make_expert_pool(cfg, nnx.Rngs(params=0)), seed)


@pytest.mark.parametrize("backend", ["xla", "masked"])
@pytest.mark.parametrize("activation", ["silu", "gelu", "relu", "none"])
def test_pool_on_sorted_rows(backend, activation):
  cfg = tiny_config("umoe", gmm_backend=backend, **{"moe.activation": activation})
  pool = _pool(cfg, 1)
  p = numpy_params(pool)
  gs = np.array([3, 0, 4, 1, 0, 2])          # empty experts, 10 rows
  rows = np.random.default_rng(2).standard_normal((10, cfg.d_model)).astype(np.float32)
  out = _pool_call(pool, jnp.asarray(rows), jnp.asarray(gs, jnp.int32))
  ref = np.zeros((10, cfg.d_model))
  row = 0
  for e, n in enumerate(gs):
    for _ in range(n):
      ref[row] = R.mlp_vec(rows[row], p["w_up"][e], p["w_down"][e], activation)
      row += 1
  assert rel_err(out, ref) < F32_BOUND


@pytest.mark.parametrize("per_slot", [False, True])
def test_pool_route_per_token_loop(per_slot):
  cfg = tiny_config("umoe")
  pool = _pool(cfg, 3)
  p = numpy_params(pool)
  n, k, e = 12, 3, cfg.moe.n_experts
  rng = np.random.default_rng(4)
  ids = np.stack([rng.choice(e, k, replace=False) for _ in range(n)]).astype(np.int32)
  gates = rng.random((n, k)).astype(np.float32)
  x = rng.standard_normal((n, k, cfg.d_model) if per_slot else (n, cfg.d_model)).astype(np.float32)
  out = _pool_route(pool, jnp.asarray(x), jnp.asarray(ids), jnp.asarray(gates))
  ref = np.zeros((n, cfg.d_model))
  for t in range(n):
    for j in range(k):
      v = x[t, j] if per_slot else x[t]
      ref[t] += gates[t, j] * R.mlp_vec(v, p["w_up"][ids[t, j]], p["w_down"][ids[t, j]], "silu")
  assert rel_err(out, ref) < F32_BOUND


@pytest.mark.parametrize("per_slot", [False, True])
def test_pool_route_gives_masked_slots_no_rows(per_slot):
  """Slots outside slot_mask (gate 0: top-P's unused ones) get no grouped-matmul rows: the plan's
  groups hold the active slots only, and the values and gradients are the float64 loop over the
  active slots, and those of the route that runs every slot."""
  import jax
  from umoe_jax.model.experts import routed_mlp
  from umoe_jax.ops import dispatch
  cfg = tiny_config("umoe")
  pool = _pool(cfg, 5)
  p = numpy_params(pool)
  n, k, e = 12, 3, cfg.moe.n_experts
  rng = np.random.default_rng(6)
  ids = np.stack([rng.choice(e, k, replace=False) for _ in range(n)]).astype(np.int32)
  mask = rng.random((n, k)) < 0.5
  mask[:, 0] = True
  gates = np.where(mask, rng.random((n, k)), 0.0).astype(np.float32)
  x = rng.standard_normal((n, k, cfg.d_model) if per_slot else (n, cfg.d_model)).astype(np.float32)
  out = nnx.jit(lambda pl, *a: pl.route(*a[:3], slot_mask=a[3]))(
      pool, jnp.asarray(x), jnp.asarray(ids), jnp.asarray(gates), jnp.asarray(mask))
  ref = np.zeros((n, cfg.d_model))
  for t in range(n):
    for j in np.flatnonzero(mask[t]):
      v = x[t, j] if per_slot else x[t]
      ref[t] += gates[t, j] * R.mlp_vec(v, p["w_up"][ids[t, j]], p["w_down"][ids[t, j]], "silu")
  assert rel_err(out, ref) < F32_BOUND
  plan = dispatch.make_plan(jnp.asarray(ids), e, jnp.asarray(mask))
  assert int(np.sum(plan.group_sizes)) == mask.sum() < n * k

  def loss(xx, w_up, w_down, slot_mask):
    plan = dispatch.make_plan(jnp.asarray(ids), e, slot_mask)
    y = routed_mlp(xx, plan, jnp.asarray(gates), w_up, w_down, activation="silu", backend="xla")
    return jnp.sum(jnp.sin(y))
  args = (jnp.asarray(x), pool.w_up.value, pool.w_down.value)
  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  for a, b in zip(grad(*args, jnp.asarray(mask)), grad(*args, jnp.ones((n, k), bool))):
    assert rel_err(a, b) < 1e-6


def _moe_ffn_case(cfg, seed, b=2, t=9):
  ffn = random_module(lambda: MoEFFN(cfg, rngs=nnx.Rngs(params=0)), seed)
  pool = _pool(cfg, seed + 1)
  x = np.random.default_rng(seed + 2).standard_normal((b, t, cfg.d_model)).astype(np.float32)
  return ffn, pool, x


@pytest.mark.parametrize("overrides", [
    {},
    {"router.renormalize": True},
    {"ffn.n_shared_experts": 0},
    {"ffn.n_shared_experts": 2, "ffn.top_k": 6},    # k = E: every expert
    {"gmm_backend": "masked", "router.balance_loss": "switch"},
], ids=["official", "renormalize", "no_shared", "shared2_k_eq_E", "masked_switch"])
def test_moe_ffn_float32(overrides):
  cfg = tiny_config("ffn_moe", **overrides)
  ffn, pool, x = _moe_ffn_case(cfg, 10)
  y, routes = _ffn_call(ffn, pool, jnp.asarray(x))
  route = routes["ffn"]
  p, pp = numpy_params(ffn), numpy_params(pool)
  refs = [R.moe_ffn(x[b], p, pp, cfg) for b in range(x.shape[0])]
  ref_y = np.stack([r[0] for r in refs])
  probs, ids, gates = (np.stack([r[1][j] for r in refs]) for j in range(3))
  np.testing.assert_array_equal(np.asarray(route.expert_ids), ids)
  assert rel_err(route.gates, gates) < 1e-6
  assert rel_err(route.probs, probs) < 1e-6
  assert rel_err(y, ref_y) < F32_BOUND
  loss = cfg.router.balance_coef * R.BALANCE[cfg.router.balance_loss](probs, ids)
  np.testing.assert_allclose(float(route.balance_loss), loss, rtol=1e-5)


def test_moe_ffn_bfloat16():
  cfg = tiny_config("ffn_moe", compute_dtype="bfloat16")
  ffn, pool, x = _moe_ffn_case(cfg, 20)
  y, routes = _ffn_call(ffn, pool, jnp.asarray(x))
  assert y.dtype == jnp.bfloat16
  ids = np.asarray(routes["ffn"].expert_ids)
  p, pp = numpy_params(ffn), numpy_params(pool)
  xb = bf16_round(x)
  refs = [R.moe_ffn(xb[b], p, pp, cfg) for b in range(x.shape[0])]
  agree = np.mean(np.stack([r[1][1] for r in refs]) == ids)
  assert agree > 0.9, f"bf16 routing differs from float64 in {1 - agree:.0%} of the choices"
  # the output itself against the oracle run on the experts the bf16 router chose
  forced = [R.moe_ffn(xb[b], p, pp, cfg, forced_ids=ids[b])[0] for b in range(x.shape[0])]
  assert rel_err(np.asarray(y, np.float32), np.stack(forced)) < BF16_BOUND


@pytest.mark.parametrize("dtype,bound", [("float32", F32_BOUND), ("bfloat16", BF16_BOUND)])
def test_dense_ffn(dtype, bound):
  cfg = tiny_config("dense", compute_dtype=dtype)
  ffn = random_module(lambda: DenseFFN(cfg, rngs=nnx.Rngs(params=0)), 30)
  x = np.random.default_rng(31).standard_normal((2, 7, cfg.d_model)).astype(np.float32)
  y, aux = _ffn_call(ffn, None, jnp.asarray(x, cfg.compute_dtype))
  assert aux == {}
  p = numpy_params(ffn)
  xin = x if dtype == "float32" else bf16_round(x)
  ref = np.stack([R.dense_ffn(xin[b], p, cfg) for b in range(2)])
  assert rel_err(np.asarray(y, np.float32), ref) < bound


def test_moe_ffn_needs_a_pool():
  cfg = tiny_config("ffn_moe")
  ffn = random_module(lambda: MoEFFN(cfg, rngs=nnx.Rngs(params=0)), 0)
  with pytest.raises(ValueError, match="expert pool"):
    ffn(jnp.zeros((1, 2, cfg.d_model)))


def test_pool_wiring_in_blocks():
  """UMoE: attention and FFN of a layer route into one pool; share_pool=False gives the FFN its own;
  the FFN-MoE baseline has one pool (FFN only); dense has none."""
  def build(cfg):
    return nnx.eval_shape(lambda: DecoderBlock(cfg, rngs=nnx.Rngs(params=0)))

  umoe = build(tiny_config("umoe"))
  assert isinstance(umoe.experts, ExpertPool) and umoe.ffn_experts is None
  split = build(tiny_config("umoe", **{"moe.share_pool": False}))
  assert isinstance(split.experts, ExpertPool) and isinstance(split.ffn_experts, ExpertPool)
  ffn_moe = build(tiny_config("ffn_moe"))
  assert isinstance(ffn_moe.experts, ExpertPool) and ffn_moe.ffn_experts is None
  dense = build(tiny_config("dense"))
  assert dense.experts is None and dense.ffn_experts is None
  cfg = tiny_config("umoe")
  e, d, f = cfg.moe.n_experts, cfg.d_model, cfg.moe.d_expert
  assert umoe.experts.w_up.shape == (e, d, f) and umoe.experts.w_down.shape == (e, f, d)
  # FFN always-on expert is separate from the attention's (official seperate_share_expert_for_ffn)
  assert umoe.ffn.shared_expert is not umoe.attention.shared_expert
  assert umoe.ffn.shared_expert.up.kernel.shape == (d, f * cfg.ffn.n_shared_experts)


@pytest.mark.parametrize("fuse", [True, False])
def test_pool_under_a_mesh_keeps_fuse_activation(monkeypatch, fuse):
  """The expert-parallel route (`expert_routes.route_pool`, any mesh) hands the pool's
  moe.fuse_activation and moe.fuse_weight_rows to its per-device fused function: a silu pool's
  last matmul gets the activation exactly when the switch is on, as on one device, and the
  weight-rows switch as set."""
  import jax
  from umoe_jax.model import expert_mlp, expert_routes
  from umoe_jax.ops import dispatch
  seen, captured = [], {}
  real = expert_mlp.gmm_combine
  monkeypatch.setattr(expert_mlp, "gmm_combine", lambda *a, **kw: seen.append(
      (kw.get("activation"), kw.get("fuse_weight_rows"))) or real(*a, **kw))

  def fake_expert_map(x, ids, gates, values, names, local, *, num_experts, fused_local, slot_mask=None):
    captured.update(fused=fused_local, values=values)
    return x, {}

  monkeypatch.setattr(expert_routes, "expert_map", fake_expert_map)
  pool = ExpertPool(6, 8, 12, activation="silu", std=0.1, param_dtype=jnp.float32,
                    compute_dtype=jnp.float32, gmm_backend="xla", rngs=nnx.Rngs(params=0),
                    fuse_activation=fuse, fuse_weight_rows=not fuse)
  x = jax.random.normal(jax.random.key(1), (10, 8))
  ids = jnp.asarray(np.random.default_rng(2).integers(0, 6, (10, 2)), jnp.int32)
  gates = jnp.full((10, 2), 0.5)
  expert_routes.route_pool(pool, x, ids, gates)
  w_up, w_down = captured["values"]
  captured["fused"](x, dispatch.make_plan(ids, 6), gates, w_up, w_down)
  assert seen == [("silu" if fuse else None, not fuse)]


def _gated_mlp_vec(v, w_gate, w_up, w_down, act):
  """SwiGLU-style expert of one vector: (act(v W_gate) * (v W_up)) W_down."""
  return (R.ACT[act](v @ w_gate) * (v @ w_up)) @ w_down


def test_gated_moe_ffn_and_dense_ffn_float32():
  """moe.gated=True: every routed expert, the always-on expert and the dense MLP compute
  (act(x W_gate) * (x W_up)) W_down, the activation on the gate branch only (a swap of gate and up
  would still run, and the non-gated oracles above never build a w_gate)."""
  cfg = tiny_config("ffn_moe", **{"moe.gated": True})
  ffn, pool, x = _moe_ffn_case(cfg, 40)
  y, routes = _ffn_call(ffn, pool, jnp.asarray(x))
  p, pp = numpy_params(ffn), numpy_params(pool)
  act, sh = cfg.moe.activation, p["shared_expert"]
  ids, gates = np.asarray(routes["ffn"].expert_ids), np.asarray(routes["ffn"].gates, np.float64)
  ref = np.zeros(x.shape)
  for b in range(x.shape[0]):
    for t in range(x.shape[1]):
      v = x[b, t].astype(np.float64)
      for j, e in enumerate(ids[b, t]):
        ref[b, t] += gates[b, t, j] * _gated_mlp_vec(v, pp["w_gate"][e], pp["w_up"][e],
                                                     pp["w_down"][e], act)
      ref[b, t] += _gated_mlp_vec(v, sh["gate"]["kernel"], sh["up"]["kernel"], sh["down"]["kernel"],
                                  act)
  assert rel_err(y, ref) < F32_BOUND

  dense_cfg = tiny_config("dense", **{"moe.gated": True})
  dense = random_module(lambda: DenseFFN(dense_cfg, rngs=nnx.Rngs(params=0)), 41)
  yd, _ = _ffn_call(dense, None, jnp.asarray(x))
  m = numpy_params(dense)["mlp"]
  refd = _gated_mlp_vec(x.astype(np.float64), m["gate"]["kernel"], m["up"]["kernel"],
                        m["down"]["kernel"], act)
  assert rel_err(yd, refd) < F32_BOUND
