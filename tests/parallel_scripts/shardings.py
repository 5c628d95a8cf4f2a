"""Param / optimizer-state / batch shardings on an 8-device mesh (run by tests/test_parallel.py)."""
import jax
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

import configs.umoe_tiny as tiny
from umoe_jax.model import build_model
from umoe_jax.parallel import mesh as mesh_lib, sharding

assert jax.device_count() == 8, jax.devices()
cfg = tiny.get_config()
mesh = mesh_lib.make_mesh(dict(data=1, fsdp=2, tensor=2, expert=2))
model = sharding.create_sharded_model(lambda: build_model(cfg.model, 0), mesh, cfg.sharding_rules)
params = nnx.state(model, nnx.Param)
specs = {jax.tree_util.keystr(p): a.sharding.spec for p, a in jax.tree_util.tree_leaves_with_path(params)}
assert specs["['layers'][0]['experts']['w_up'].value"] == P("expert", "fsdp", "tensor"), specs
assert specs["['layers'][0]['experts']['w_down'].value"] == P("expert", "tensor", "fsdp")
assert specs["['embed'].value"] == P("tensor", "fsdp")
assert specs["['final_norm']['scale'].value"] == P(None)
logical = sharding.param_logical_axes(params)
assert logical["embed"] == P("vocab", "embed")

# Optimizer state: nnx.State-based (names carried) and pure-dict-based (matched by path and shape).
for tree, kw in ((params, {}), (nnx.to_pure_dict(params), dict(params=params))):
  opt = jax.eval_shape(optax.adamw(1e-3).init, tree)
  sh = sharding.state_shardings(opt, mesh, cfg.sharding_rules, **kw)
  flat = {jax.tree_util.keystr(p): s.spec for p, s in jax.tree_util.tree_leaves_with_path(sh)}
  mu = [v for k, v in flat.items() if "mu" in k and "experts" in k and "w_up" in k]
  assert mu and all(v == P("expert", "fsdp", "tensor") for v in mu), flat
  assert all(v == P() for k, v in flat.items() if "count" in k)

# Non-dividing axes are dropped: 16 experts on expert=... stays legal; a dim of 3 cannot split.
assert sharding.spec_for_shape(("embed",), (3,), mesh) == P(None)
assert sharding.batch_sharding(mesh).spec == P(("data", "fsdp", "expert"), None)
assert sharding.batch_shards(mesh) == 4
x = jax.numpy.ones((8, 4))
assert sharding.with_logical_constraint(x, ("batch", None)) is x   # no mesh context: no-op
with sharding.use_mesh(mesh, cfg.sharding_rules):
  y = jax.jit(lambda a: sharding.with_logical_constraint(a * 2, ("batch", None)))(x)
assert y.sharding.is_equivalent_to(sharding.batch_sharding(mesh), 2), y.sharding
print("OK")
