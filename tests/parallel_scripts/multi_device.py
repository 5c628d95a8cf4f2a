"""All single-process, 8-device checks in one process (one JAX start-up), run by test_parallel.py.

Usage: multi_device.py OUT.json [section ...]   sections: shardings expert_map layouts restore
                                                 variants
Writes {section: {"ok": bool, "error": str, ...numbers}}; each section runs even if another failed.
"""
import dataclasses
import functools
import json
import math
import os
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
from umoe_jax.config import model_config
from umoe_jax.model import build_model
from umoe_jax.ops import dispatch
from umoe_jax.ops.gmm import gmm
from umoe_jax.parallel import expert_parallel, mesh as mesh_lib, sharding

LAYOUTS = ["data=8", "fsdp=8", "tensor=8", "expert=8", "data=2,expert=4", "fsdp=2,tensor=2,expert=2"]
# Forced exchanges (LAYOUTS run "auto": all_to_all for both pools on expert=8, all_gather for the FFN
# pool (K=4) and all_to_all for the pre-mixing queries (K=2) on data=2,expert=4, all_gather for
# both on expert=2), one step each.
EXCHANGE_LAYOUTS = [("expert=8", "all_gather"), ("data=2,expert=4", "all_gather"),
                    ("data=2,expert=4", "all_to_all")]


def parse(layout: str) -> dict:
  return {k: int(v) for k, v in (kv.split("=") for kv in layout.split(","))}


_STEPS: dict = {}


def step_for(layout: str, graphdef, abstract_params, exchange: str = "auto"):
  """(mesh, jitted sharded step, param shardings, opt shardings), compiled once per layout and
  exchange (a step is traced under the `use_mesh` of its first call: run it under that exchange)."""
  if (layout, exchange) not in _STEPS:
    mesh = mesh_lib.make_mesh(parse(layout))
    _STEPS[layout, exchange] = (mesh, *common.sharded_step(graphdef, abstract_params, mesh))
  return _STEPS[layout, exchange]


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


def _numpy_expected(x, ids, gates, w, groups, ep, cap):
  """Loop oracle with the capacity rule: the tokens split into `groups` contiguous groups that share
  buffers (all_to_all: each batch shard; all_gather: the EP batch shards of one gather); per group,
  rows in (expert, token, slot) order, each destination shard keeps its first `cap` rows."""
  n, k = ids.shape
  e_local = w.shape[0] // ep
  per = n // groups
  out = np.zeros((n, k, w.shape[-1]))
  dropped = 0
  for s in range(groups):
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


# (layout, EXPERT rule override or None, variants). A variant is (ids, x rank, gates?, capacity
# factor, exchange): both input forms, both output forms, dropless and dropping, both exchanges and
# "auto" with K=3 < EP (-> all_to_all) and K >= EP (-> all_gather), skewed routing (dropless: no drop).
_BOTH = [("spread", 2, True, None), ("spread", 3, True, None), ("spread", 2, False, None),
         ("spread", 3, False, None), ("spread", 2, True, 0.5), ("spread", 3, False, 0.5),
         ("spread", 2, True, 100.0)]
_SHORT = [("spread", 2, True, None), ("spread", 3, False, None), ("spread", 2, True, 0.5),
          ("spread", 3, False, 0.5)]
_SKEW = [("skewed", 2, True, None), ("skewed", 3, False, None)]
EXPERT_MAP_CASES = [
    ("expert=8", None, [v + ("auto",) for v in _BOTH] + [v + ("all_gather",) for v in _SHORT]),
    ("data=2,expert=4", None, [v + ("auto",) for v in _BOTH] +
     [v + ("all_gather",) for v in _SHORT + _SKEW] + [v + ("all_to_all",) for v in _SKEW]),
    ("data=4,expert=2", None, [v + ("auto",) for v in _SHORT + _SKEW] +
     [v + ("all_to_all",) for v in _SHORT[:3]]),
    # Experts over two mesh axes (EP = 8): the shard index is linearised like the collectives.
    ("data=2,expert=4", ("data", "expert"), [v + ("all_gather",) for v in _SHORT[::2]] +
     [("spread", 2, True, None, "all_to_all")]),
]


def _routing(rng, n, k, e):
  """'spread': skewed logits (overflow at cf < 1); 'skewed': 90% of the tokens put all K slots on
  experts 0..3 (one shard for EP <= 4). Distinct ids per token (top-k)."""
  logits = rng.standard_normal((n, e)) + np.linspace(0, 3, e)
  spread = np.argsort(-logits, axis=1)[:, :k].astype(np.int32)
  skewed = spread.copy()
  hot = rng.random(n) < 0.9
  skewed[hot] = np.stack([rng.permutation(4)[:k] for _ in range(int(hot.sum()))])
  return dict(spread=spread, skewed=skewed)


def _collectives(fn, *args) -> set:
  text = jax.jit(fn).lower(*args).as_text()
  return {c for c in ("all_to_all", "all_gather", "reduce_scatter") if f"stablehlo.{c}" in text}


def check_expert_map():
  """expert_map vs a loop oracle (values, exact drop counts) and vs single-device dispatch (grads),
  for both exchanges; "auto" picks all_to_all for K < EP and all_gather for K >= EP."""
  rng = np.random.default_rng(0)
  n, k, d, e, dout = 64, 3, 8, 16, 5
  id_sets = _routing(rng, n, k, e)
  gates = rng.uniform(0.1, 1.0, (n, k)).astype(np.float32)
  w = (rng.standard_normal((e, d, dout)) / np.sqrt(d)).astype(np.float32)
  xs = {2: rng.standard_normal((n, d)).astype(np.float32),
        3: rng.standard_normal((n, k, d)).astype(np.float32)}
  names = (("expert", "embed", None),)
  out = {}
  for layout, expert_rule, variants in EXPERT_MAP_CASES:
    mesh = mesh_lib.make_mesh(parse(layout))
    rules = None
    if expert_rule:
      rules = [(n_, expert_rule if n_ == "expert" else t) for n_, t in sharding.normalize_rules(None)]
    ep, shards = math.prod(mesh.shape[a] for a in expert_rule or ("expert",)), 8
    tag = layout + ("" if expert_rule is None else f"/experts_over={'x'.join(expert_rule)}")

    def emap(x_, ids_, w_, g_, cf_, exchange, mesh_=mesh, rules_=rules):
      return expert_parallel.expert_map(x_, jnp.asarray(ids_), g_, (w_,), names, _expert_fn,
                                        num_experts=e, mesh=mesh_, rules=rules_,
                                        capacity_factor=cf_, exchange=exchange)

    @jax.jit
    def all_variants(x2, x3, w_, g_, variants=tuple(variants)):
      res = []
      for ids_name, rank, use_g, cf, exchange in variants:
        y, st = emap(x2 if rank == 2 else x3, id_sets[ids_name], w_, g_ if use_g else None, cf,
                     exchange)
        res.append((y, st["dropped_rows"]))
      return res

    results = all_variants(xs[2], xs[3], w, gates)
    for (ids_name, rank, use_g, cf, exchange), (y, dropped) in zip(variants, results):
      strategy = expert_parallel.resolve_exchange(exchange, k, ep)
      cap = expert_parallel.capacity(n // shards, k, ep, e // ep, cf, strategy)
      groups = shards // ep if strategy == "all_gather" else shards
      ids = id_sets[ids_name]
      ref, ref_dropped = _numpy_expected(xs[rank], ids, gates if use_g else None, w, groups, ep,
                                         cap)
      err = float(np.max(np.abs(np.asarray(y) - ref)))
      key = (f"{tag}/{ids_name}/x{rank}/{'gates' if use_g else 'slots'}/cf={cf}/"
             f"{exchange}->{strategy}")
      assert err < 1e-5, (key, err)
      assert int(dropped) == ref_dropped, (key, int(dropped), ref_dropped)
      assert (ref_dropped > 0) == (cf == 0.5), (key, ref_dropped)   # overflow is live / absent
      out[key] = dict(err=err, dropped=int(dropped), strategy=strategy)

    # "auto" runs the collectives of the strategy it resolves to.
    auto = expert_parallel.resolve_exchange("auto", k, ep)
    expected = {"all_to_all": {"all_to_all"}, "all_gather": {"all_gather", "reduce_scatter"}}
    seen = _collectives(lambda x_, w_: emap(x_, id_sets["spread"], w_, jnp.asarray(gates), None,
                                            "auto")[0], xs[2], w)
    assert seen == expected[auto], (tag, auto, seen)
    out[f"{tag}/auto_collectives"] = sorted(seen)

    # Gradients (dropless) equal the single-device dispatch's, for both exchanges.
    def loss_ep(x2, x3, w_, exchange):
      return sum(jnp.sum(jnp.sin(emap(x, id_sets["spread"], w_, jnp.asarray(gates), None,
                                      exchange)[0])) for x in (x2, x3))

    def loss_ref(x2, x3, w_):
      plan = dispatch.make_plan(jnp.asarray(id_sets["spread"]), e)
      fn = lambda rows, gs: jnp.tanh(gmm(rows, w_, gs, backend="xla"))
      return sum(jnp.sum(jnp.sin(dispatch.apply_experts(x, plan, jnp.asarray(gates), fn)))
                 for x in (x2, x3))
    g_ref = jax.jit(jax.grad(loss_ref, argnums=(0, 1, 2)))(xs[2], xs[3], w)
    for exchange in ("all_to_all", "all_gather") if expert_rule is None else ():
      g_ep = jax.jit(jax.grad(functools.partial(loss_ep, exchange=exchange),
                              argnums=(0, 1, 2)))(xs[2], xs[3], w)
      gerr = common.max_abs_diff(g_ep, g_ref)
      assert gerr < 1e-5, (tag, exchange, gerr)
      out[f"{tag}/grad/{exchange}"] = dict(err=gerr)
  # The model sows the dropped-row count when a capacity factor is set.
  cfg = common.tiny_cfg()
  mesh = mesh_lib.make_mesh(dict(expert=8))
  model = build_model(cfg, 0)
  toks = jnp.asarray(common.tokens()[:, :-1])

  def fwd(m, t):
    m(t)
    return nnx.pop(m, nnx.Intermediate)
  for exchange in ("auto", "all_gather"):   # auto: all_to_all here (K = 4 and 2 < EP = 8)
    with sharding.use_mesh(mesh, expert_capacity_factor=0.25, expert_exchange=exchange):
      sown = nnx.jit(fwd)(model, toks)        # a jit per setting: the context is read when tracing
    counts = [int(v) for v in jax.tree.leaves(sown)]
    assert counts and sum(counts) > 0, (exchange, sown)
    out[f"model_sown_dropped_rows/{exchange}"] = counts
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
  for layout, exchange in EXCHANGE_LAYOUTS:
    t0 = time.time()
    mesh, step, p_sh, o_sh = step_for(layout, graphdef, abstract_params, exchange)
    p = jax.device_put(params, p_sh)
    o = jax.device_put(common.TX.init(params), o_sh)
    with sharding.use_mesh(mesh, expert_exchange=exchange):
      losses, grads, _ = run(step, p, o, [jax.device_put(batches[0], sharding.batch_sharding(mesh))])
    report[f"{layout}/{exchange}"] = dict(step1_loss_diff=abs(losses[0] - ref_losses[0]),
                                          grad_diff=common.max_abs_diff(grads, ref_grads),
                                          seconds=round(time.time() - t0, 1))
    print(layout, exchange, report[f"{layout}/{exchange}"], flush=True)
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


# ----------------------------------------------------------------------------------------------
# The other attention variants of the zoo (configs/<family>_tiny.py shrunk by common.tiny_cfg): loss
# and gradients of one batch vs one device. Only pre-mixing's routed queries and the pool's `route`
# have an expert-parallel path (umoe_att, umoe_mla); every other routed expert (MoA heads, SwitchHead
# V/O experts, post-mixing's pool call and low-rank keys) runs through the XLA partitioner with its
# weights split by the rules.


def _variant_cfg(family: str, **attention):
  cfg = common.tiny_cfg(family)
  return dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, **attention))


def _routing_cfg(family: str, *, attention=None, ffn=None):
  """A tiny family with its sub-layers' own router sections (`model.<sublayer>.router`)."""
  cfg = common.tiny_cfg(family)
  section = lambda sub, keys: dataclasses.replace(getattr(cfg, sub), router=dataclasses.replace(
      getattr(cfg, sub).router, **(keys or {})))
  return model_config(dataclasses.replace(cfg, attention=section("attention", attention),
                                          ffn=section("ffn", ffn)))


# The routing methods of issue 14 (routers/*), two programs' worth: AoE's pool with expert choice
# (a top-C over the whole batch) and attention mixing behind MHA; per sub-layer routers in a UMoE
# whose FFN is AoE's with top-P, its attention router X-MoE with similarity mixing, bias, z-loss.
ROUTING_VARIANTS = {
    "aoe_expert_choice": lambda: _routing_cfg("ffn_moe", ffn=dict(
        kind="aoe", aoe_dim=8, selection="expert_choice", expert_choice_capacity=2.0,
        mixing="attention", balance_loss="none", z_loss_coef=1e-3)),
    "umoe_routing": lambda: _routing_cfg("umoe", attention=dict(
        kind="xmoe", xmoe_learn_temperature=False, mixing="similarity", bias_update_rate=1e-3,
        z_loss_coef=1e-3), ffn=dict(kind="aoe", aoe_dim=8, selection="top_p", entropy_coef=1e-2)),
}


# 16 routed experts where the zoo has 15 (moa, umoe_att), so that expert=4 splits them (15 would
# stay replicated). SwitchHead: 4 heads x 4 experts = 16 groups.
VARIANTS = {
    "moa": lambda: _variant_cfg("moa", n_experts=16),
    "switchhead": lambda: _variant_cfg("switchhead"),
    "switchhead_sigmoid": lambda: _variant_cfg("switchhead_sigmoid"),
    "umoe_att": lambda: common.tiny_cfg("umoe_att", n_experts=16),
    "postmix": lambda: _variant_cfg("umoe", kind="postmix"),
    "umoe_mla": lambda: common.tiny_cfg("umoe_mla"),
    **ROUTING_VARIANTS,
}
# fsdp=8 also matches (checked by hand: VARIANT_LAYOUTS="data=2,expert=4;tensor=8;fsdp=8"); left out
# of the default run to keep the compile time down.
VARIANT_LAYOUTS = os.environ.get("VARIANT_LAYOUTS", "data=2,expert=4;tensor=8").split(";")


def check_variants():
  """Loss and gradients (no optimizer: less to compile) of every variant on each layout vs one
  device; records which weights are split over "expert". Compiling dominates, so all variants run
  as one program per layout (and one on one device); if a layout's program fails, each variant
  runs alone to name the failing ones (their error goes in the report, the others still compare)."""
  batch = common.tokens(seed=0)
  parts, params = {}, {}
  for name, make_cfg in VARIANTS.items():
    cfg = make_cfg()
    graphdef, abstract_params = common.model_parts(cfg)
    parts[name] = (cfg, graphdef, abstract_params)
    params[name] = common.init_params(cfg)
  grad_fns = {name: jax.value_and_grad(functools.partial(common.loss_fn, graphdef=graphdef))
              for name, (_, graphdef, _) in parts.items()}

  def grads_of(names):
    return lambda ps, b: {n: grad_fns[n](ps[n], b) for n in names}

  t0 = time.time()
  ref = jax.jit(grads_of(list(parts)))(params, batch)
  ref_grads = {n: dict(jax.tree_util.tree_leaves_with_path(g)) for n, (_, g) in ref.items()}
  report = {n: dict(kind=parts[n][0].attention.kind, ref_loss=float(ref[n][0]),
                    grad_scale=common.max_abs(ref[n][1])) for n in parts}
  report["seconds/one_device"] = round(time.time() - t0, 1)
  for layout in VARIANT_LAYOUTS:
    t0 = time.time()
    mesh = mesh_lib.make_mesh(parse(layout))
    p_sh = {n: common.sharded_step(graphdef, abstract, mesh)[1]
            for n, (_, graphdef, abstract) in parts.items()}
    b_sh = sharding.batch_sharding(mesh)
    rep = jax.sharding.NamedSharding(mesh, P())
    if "expert" in layout:   # the [E, ...] routed weights (E = 16) split over "expert"
      for n in parts:
        report[n]["expert_split"] = [jax.tree_util.keystr(p) for p, sh in
                                     jax.tree_util.tree_leaves_with_path(p_sh[n])
                                     if sh.spec and sh.spec[0] == "expert"]

    def run(names, mesh=mesh, p_sh=p_sh, b_sh=b_sh, rep=rep):
      step = jax.jit(grads_of(names), in_shardings=({n: p_sh[n] for n in names}, b_sh),
                     out_shardings={n: (rep, p_sh[n]) for n in names})
      with sharding.use_mesh(mesh):
        return step({n: jax.device_put(params[n], p_sh[n]) for n in names},
                    jax.device_put(batch, b_sh))
    try:
      outs = run(list(parts))
    except Exception:  # pylint: disable=broad-except
      outs = {}
      for n in parts:
        try:
          outs.update(run([n]))
        except Exception as e:  # pylint: disable=broad-except
          report[f"{n}/{layout}"] = dict(error=f"{type(e).__name__}: {e}\n"
                                               f"{traceback.format_exc()[-3000:]}")
    for n, (loss, grads) in outs.items():
      per_param = {jax.tree_util.keystr(p): common.max_abs_diff(g, ref_grads[n][p])
                   for p, g in jax.tree_util.tree_leaves_with_path(grads)}
      worst = max(per_param, key=per_param.get)
      report[f"{n}/{layout}"] = dict(step1_loss_diff=abs(float(loss) - float(ref[n][0])),
                                     grad_diff=per_param[worst], worst_grad=worst)
    report[f"seconds/{layout}"] = round(time.time() - t0, 1)
    print(layout, {k: v for k, v in report.items() if k.endswith(layout)}, flush=True)
  return report


CHECKS = dict(shardings=check_shardings, expert_map=check_expert_map, layouts=check_layouts,
              restore=check_restore, variants=check_variants)


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
