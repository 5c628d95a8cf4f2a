"""All single-process, 8-device checks in one process (one JAX start-up), run by test_parallel.py.

Usage: multi_device.py OUT.json [section ...]   sections: shardings expert_map layouts restore
Writes {section: {"ok": bool, "error": str, ...numbers}}; each section runs even if another failed.
"""
import json
import sys
import tempfile
import time
import traceback

import common
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

import configs.umoe_tiny as tiny
from umoe_jax.model import build_model
from umoe_jax.ops import dispatch
from umoe_jax.ops.gmm import gmm
from umoe_jax.parallel import expert_parallel, mesh as mesh_lib, sharding

LAYOUTS = ["data=8", "fsdp=8", "tensor=8", "expert=8", "data=2,expert=4", "fsdp=2,tensor=2,expert=2"]


def parse(layout: str) -> dict:
  return {k: int(v) for k, v in (kv.split("=") for kv in layout.split(","))}


_STEPS: dict = {}


def step_for(layout: str, graphdef, abstract_params):
  """(mesh, jitted sharded step, param shardings, opt shardings), compiled once per layout."""
  if layout not in _STEPS:
    mesh = mesh_lib.make_mesh(parse(layout))
    _STEPS[layout] = (mesh, *common.sharded_step(graphdef, abstract_params, mesh))
  return _STEPS[layout]


# ----------------------------------------------------------------------------------------------


def check_shardings():
  cfg = tiny.get_config()
  mesh = mesh_lib.make_mesh(dict(data=1, fsdp=2, tensor=2, expert=2))
  model = sharding.create_sharded_model(lambda: build_model(cfg.model, 0), mesh, cfg.sharding_rules)
  params = nnx.state(model, nnx.Param)
  specs = {jax.tree_util.keystr(p): a.sharding.spec
           for p, a in jax.tree_util.tree_leaves_with_path(params)}
  assert specs["['layers'][0]['experts']['w_up'].value"] == P("expert", "fsdp", "tensor"), specs
  assert specs["['layers'][0]['experts']['w_down'].value"] == P("expert", "tensor", "fsdp")
  assert specs["['layers'][0]['attention']['q_a'].value"] == P("expert", "fsdp", None)
  assert specs["['embed'].value"] == P("tensor", "fsdp")
  assert specs["['final_norm']['scale'].value"] == P(None)
  assert sharding.param_logical_axes(params)["embed"] == P("vocab", "embed")
  # Optimizer state of an nnx.State (names carried) and of a pure dict (matched by path + shape).
  for tree, kw in ((params, {}), (nnx.to_pure_dict(params), dict(params=params))):
    opt = jax.eval_shape(optax.adamw(1e-3).init, tree)
    sh = sharding.state_shardings(opt, mesh, cfg.sharding_rules, **kw)
    flat = {jax.tree_util.keystr(p): s.spec for p, s in jax.tree_util.tree_leaves_with_path(sh)}
    mu = [v for k, v in flat.items() if "mu" in k and "experts" in k and "w_up" in k]
    assert mu and all(v == P("expert", "fsdp", "tensor") for v in mu), flat
    assert all(v == P() for k, v in flat.items() if "count" in k), flat
  # shard_params on a model built on one device.
  placed = sharding.shard_params(build_model(cfg.model, 0), mesh, cfg.sharding_rules)
  assert placed.layers[0].experts.w_up.get_value().sharding.spec == P("expert", "fsdp", "tensor")
  # Non-dividing mesh axes are dropped; batch over data x fsdp x expert.
  assert sharding.spec_for_shape(("embed",), (3,), mesh) == P(None)
  assert sharding.batch_sharding(mesh).spec == P(("data", "fsdp", "expert"), None)
  assert sharding.batch_shards(mesh) == 4
  x = jnp.ones((8, 4))
  assert sharding.with_logical_constraint(x, ("batch", None)) is x   # no mesh context: no-op
  with sharding.use_mesh(mesh, cfg.sharding_rules):
    y = jax.jit(lambda a: sharding.with_logical_constraint(a * 2, ("batch", None)))(x)
  assert y.sharding.is_equivalent_to(sharding.batch_sharding(mesh), 2), y.sharding
  return {}


# ----------------------------------------------------------------------------------------------


def _expert_fn(rows, group_sizes, w, *, tensor_axes):
  del tensor_axes
  rows, w = expert_parallel.match_varying(rows, w)
  return jnp.tanh(gmm(rows, w, group_sizes, backend="xla"))


def _numpy_expected(x, ids, gates, w, n_shards, ep, cap):
  """Loop oracle with the capacity rule: per batch shard, rows in (expert, token, slot) order, each
  destination shard keeps its first `cap` rows."""
  n, k = ids.shape
  e_local = w.shape[0] // ep
  per = n // n_shards
  out = np.zeros((n, k, w.shape[-1]))
  dropped = 0
  for s in range(n_shards):
    pairs = sorted(((ids[t, j], t, j) for t in range(s * per, (s + 1) * per) for j in range(k)))
    used = np.zeros(ep, int)
    for e, t, j in pairs:
      d = e // e_local
      if used[d] >= cap:
        dropped += 1
        continue
      used[d] += 1
      row = x[t] if x.ndim == 2 else x[t, j]
      out[t, j] = np.tanh(row @ w[e])
  comb = None if gates is None else np.einsum("nkd,nk->nd", out, gates)
  return (out if gates is None else comb), dropped


def check_expert_map():
  """expert_map vs a loop oracle (values, exact drop counts) and vs single-device dispatch (grads)."""
  rng = np.random.default_rng(0)
  n, k, d, e, dout = 64, 3, 8, 16, 5
  logits = rng.standard_normal((n, e)) + np.linspace(0, 3, e)    # skewed load -> overflow at cf<1
  ids = np.argsort(-logits, axis=1)[:, :k].astype(np.int32)       # distinct ids per token
  gates = rng.uniform(0.1, 1.0, (n, k)).astype(np.float32)
  w = (rng.standard_normal((e, d, dout)) / np.sqrt(d)).astype(np.float32)
  xs = {2: rng.standard_normal((n, d)).astype(np.float32),
        3: rng.standard_normal((n, k, d)).astype(np.float32)}
  names = (("expert", "embed", None),)
  # (x rank, gates?, capacity factor): both input forms, both output forms, dropless and dropping.
  variants = [(2, True, None), (3, True, None), (2, False, None), (3, False, None),
              (2, True, 0.5), (3, False, 0.5), (2, True, 100.0)]
  out = {}
  for layout in ("expert=8", "data=2,expert=4"):
    mesh = mesh_lib.make_mesh(parse(layout))
    ep, shards = mesh.shape["expert"], 8

    def emap(x_, w_, g_, cf_, mesh_=mesh):
      return expert_parallel.expert_map(x_, jnp.asarray(ids), g_, (w_,), names, _expert_fn,
                                        num_experts=e, mesh=mesh_, capacity_factor=cf_)

    @jax.jit
    def all_variants(x2, x3, w_, g_):
      res = []
      for rank, use_g, cf in variants:
        y, st = emap(x2 if rank == 2 else x3, w_, g_ if use_g else None, cf)
        res.append((y, st["dropped_rows"]))
      return res

    results = all_variants(xs[2], xs[3], w, gates)
    for (rank, use_g, cf), (y, dropped) in zip(variants, results):
      cap = expert_parallel.capacity(n // shards, k, ep, e // ep, cf)
      ref, ref_dropped = _numpy_expected(xs[rank], ids, gates if use_g else None, w, shards, ep, cap)
      err = float(np.max(np.abs(np.asarray(y) - ref)))
      key = f"{layout}/x{rank}/{'gates' if use_g else 'slots'}/cf={cf}"
      assert err < 1e-5, (key, err)
      assert int(dropped) == ref_dropped, (key, int(dropped), ref_dropped)
      assert (ref_dropped > 0) == (cf == 0.5), (key, ref_dropped)   # overflow is live / absent
      out[key] = dict(err=err, dropped=int(dropped))

    # Gradients (dropless) equal the single-device dispatch's.
    def loss_ep(x2, x3, w_):
      return sum(jnp.sum(jnp.sin(emap(x, w_, jnp.asarray(gates), None)[0])) for x in (x2, x3))

    def loss_ref(x2, x3, w_):
      plan = dispatch.make_plan(jnp.asarray(ids), e)
      fn = lambda rows, gs: jnp.tanh(gmm(rows, w_, gs, backend="xla"))
      return sum(jnp.sum(jnp.sin(dispatch.apply_experts(x, plan, jnp.asarray(gates), fn)))
                 for x in (x2, x3))
    g_ep = jax.jit(jax.grad(loss_ep, argnums=(0, 1, 2)))(xs[2], xs[3], w)
    g_ref = jax.jit(jax.grad(loss_ref, argnums=(0, 1, 2)))(xs[2], xs[3], w)
    gerr = common.max_abs_diff(g_ep, g_ref)
    assert gerr < 1e-5, (layout, gerr)
    out[f"{layout}/grad"] = dict(err=gerr)
  # The model sows the dropped-row count when a capacity factor is set.
  cfg = common.tiny_cfg()
  mesh = mesh_lib.make_mesh(dict(expert=8))
  model = build_model(cfg, 0)
  toks = jnp.asarray(common.tokens()[:, :-1])

  @nnx.jit
  def fwd(m, t):
    m(t)
    return nnx.pop(m, nnx.Intermediate)
  with sharding.use_mesh(mesh, expert_capacity_factor=0.25):
    sown = fwd(model, toks)
  counts = [int(v) for v in jax.tree.leaves(sown)]
  assert counts and sum(counts) > 0, sown
  out["model_sown_dropped_rows"] = counts
  return out


# ----------------------------------------------------------------------------------------------


def check_layouts():
  cfg = common.tiny_cfg()
  graphdef, abstract_params = common.model_parts(cfg)
  params = common.init_params(cfg)
  batches = [common.tokens(seed=s) for s in range(3)]

  def run(step, p, o, bs):
    losses, first = [], None
    for b in bs:
      p, o, loss, grads = step(p, o, b)
      losses.append(float(loss))
      first = grads if first is None else first
    return losses, first, p

  ref_losses, ref_grads, ref_params = run(jax.jit(common.make_step(graphdef)), params,
                                          common.TX.init(params), batches)
  report = {"ref_losses": ref_losses, "grad_scale": common.max_abs(ref_grads)}
  for layout in LAYOUTS:
    t0 = time.time()
    mesh, step, p_sh, o_sh = step_for(layout, graphdef, abstract_params)
    p = jax.device_put(params, p_sh)
    o = jax.device_put(common.TX.init(params), o_sh)
    bs = [jax.device_put(b, sharding.batch_sharding(mesh)) for b in batches]
    with sharding.use_mesh(mesh):
      losses, grads, final = run(step, p, o, bs)
    report[layout] = dict(
        step1_loss_diff=abs(losses[0] - ref_losses[0]),
        loss_diff=max(abs(a - b) for a, b in zip(losses, ref_losses)),
        grad_diff=common.max_abs_diff(grads, ref_grads),
        param_diff=common.max_abs_diff(final, ref_params),
        seconds=round(time.time() - t0, 1))
    print(layout, report[layout], flush=True)
  return report


# ----------------------------------------------------------------------------------------------


def check_restore():
  """Save (params, opt_state) trained on data=8; restore onto fsdp=2 x tensor=2 x expert=2;
  continue (the compiled steps of the layouts section are reused)."""
  import orbax.checkpoint as ocp
  cfg = common.tiny_cfg()
  graphdef, abstract_params = common.model_parts(cfg)
  params = common.init_params(cfg)
  b0, b1 = common.tokens(seed=0), common.tokens(seed=1)
  mesh_a, step_a, pa_sh, oa_sh = step_for("data=8", graphdef, abstract_params)
  with sharding.use_mesh(mesh_a):
    p, o, _, _ = step_a(jax.device_put(params, pa_sh), jax.device_put(common.TX.init(params), oa_sh),
                        jax.device_put(b0, sharding.batch_sharding(mesh_a)))
    _, _, loss_a, _ = step_a(p, o, jax.device_put(b1, sharding.batch_sharding(mesh_a)))
  state = {"params": p, "opt_state": o}
  path = tempfile.mkdtemp() + "/ckpt"
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(path, state)
  ckptr.wait_until_finished()

  mesh_b, step_b, pb_sh, ob_sh = step_for("fsdp=2,tensor=2,expert=2", graphdef, abstract_params)
  abstract = jax.eval_shape(lambda: state)
  target = sharding.abstract_with_shardings(abstract, {"params": pb_sh, "opt_state": ob_sh})
  restored = ckptr.restore(path, target)
  w_up = restored["params"]["layers"][0]["experts"]["w_up"]
  assert w_up.sharding.is_equivalent_to(jax.NamedSharding(mesh_b, P("expert", "fsdp", "tensor")),
                                        3), w_up.sharding
  mu = restored["opt_state"][0].mu["layers"][0]["experts"]["w_up"]
  assert mu.sharding.is_equivalent_to(w_up.sharding, 3), mu.sharding
  value_diff = common.max_abs_diff(restored, state)
  assert value_diff == 0.0, value_diff
  with sharding.use_mesh(mesh_b):
    _, _, loss_b, _ = step_b(restored["params"], restored["opt_state"],
                             jax.device_put(b1, sharding.batch_sharding(mesh_b)))
  diff = abs(float(loss_a) - float(loss_b))
  assert diff < 1e-5, (float(loss_a), float(loss_b))
  return dict(value_diff=value_diff, next_loss_diff=diff)


CHECKS = dict(shardings=check_shardings, expert_map=check_expert_map, layouts=check_layouts,
              restore=check_restore)


def main(out_path, sections):
  assert jax.device_count() == 8, jax.devices()
  report = {}
  for name in sections or list(CHECKS):
    t0 = time.time()
    try:
      report[name] = dict(ok=True, **CHECKS[name]())
    except Exception as e:  # pylint: disable=broad-except
      report[name] = dict(ok=False, error=f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    report[name]["seconds"] = round(time.time() - t0, 1)
    print(name, "ok" if report[name]["ok"] else report[name]["error"], flush=True)
    with open(out_path, "w") as f:
      json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2:])
