"""The fused attention cores on 8 virtual CPU devices (`attention.local_shards.on_local_shards`), run by
test_parallel.py with TRITON_INTERPRET=1:

  * "single", "layouts": the Triton pre-mixing core inside a model, every kernel launch through the
    Triton interpreter (`test_triton_attention._interpreter_launch`). A one-layer UMoE with
    `attention.core="triton"` gives the same loss and gradients on each layout as the XLA core on
    one device, and each launch sees one device's rows: its grid's batch axis is the local batch,
    its H the local query heads.
  * "wrapper": `on_local_shards` around the XLA form of a causal core (`fused_attention(...,
    implementation="xla")`) where the model's layouts do not reach: key heads as many as the query
    heads with the heads split, and mesh axes that divide neither batch nor heads (replicated:
    the backward must sum the gradients over them). Values and gradients against no mesh.

Usage: fused_core_layouts.py OUT.json   writes {"single": {...}, "layouts": {...}, "wrapper": {...}}
"""
import json
import os
import sys
import time

import common
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.join(common.ROOT, "tests"))
import test_triton_attention as tta  # noqa: E402  (the interpreter launch)

import configs.common  # noqa: E402
from kernels.attention import triton_attention as ta  # noqa: E402
from umoe_jax.config import model_config  # noqa: E402
from umoe_jax.parallel import mesh as mesh_lib, sharding  # noqa: E402

# Query heads: the always-on one + top_k = 3 routed = 4; tensor=2 and tensor=4 split them.
LAYOUTS = ["data=8", "expert=8", "fsdp=2,tensor=2,expert=2", "data=2,tensor=4"]
# 24: not a multiple of the kernels' 16-row tiles. Keep the arrays small: on jax 0.10's CPU client a
# callback on several virtual devices hangs once an operand passes ~64 KB a device (pure_callback
# copies it onto device 0, whose thread pool is busy with the other devices' callbacks; seen at
# 256 KB, never at 64 KB or below). These stay under 20 KB.
BATCH, SEQ = 8, 24


def cfg_for(core: str):
  m = configs.common.model("umoe", "tiny")
  m.n_layers, m.max_seq_len, m.vocab_size, m.d_model = 1, SEQ, 128, 64
  m.compute_dtype, m.gmm_backend, m.attention.core = "float32", "xla", core
  m.attention.head_dim = m.attention.v_head_dim = 16
  m.attention.top_k = 3
  return model_config(m)


LAUNCHED = []   # (kernel name, grid batch, H) of every launch, as traced


def launch(kernel, grid, args, out_shape, **meta):
  LAUNCHED.append((kernel.fn.__name__, grid[1], meta["H"]))
  return tta._interpreter_launch(kernel, grid, args, out_shape, **meta)


def main(out_path: str):
  assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
  tta.interpreter_loop_bounds()
  ta._launch, ta.available, ta.DTYPES = launch, (lambda: True), (jnp.float32,)
  ref_cfg, cfg = cfg_for("xla"), cfg_for("triton")
  params = common.init_params(ref_cfg)
  rng = np.random.default_rng(3)
  batch = jnp.asarray(rng.integers(0, 128, (BATCH, SEQ + 1)), jnp.int32)
  ref_graphdef, _ = common.model_parts(ref_cfg)
  ref_loss, ref_grads = jax.jit(common.loss_and_grads_fn(ref_graphdef))(params, batch)
  assert not LAUNCHED, "the XLA core launched a Triton kernel"

  graphdef, abstract_params = common.model_parts(cfg)
  loss, grads = jax.jit(common.loss_and_grads_fn(graphdef))(params, batch)
  names = {name for name, _, _ in LAUNCHED}
  assert "_fwd_kernel" in names and len(names) >= 4, names   # forward and the backward passes
  batches, heads = {b for _, b, _ in LAUNCHED}, {h for _, _, h in LAUNCHED}
  assert batches == {BATCH} and heads == {4}, LAUNCHED
  n_heads = heads.pop()
  report = {"single": dict(loss_diff=abs(float(loss) - float(ref_loss)),
                           grad_rel=common.rel_diff(grads, ref_grads), kernels=sorted(names),
                           heads=n_heads),
            "layouts": {}}
  print("single", report["single"], flush=True)

  pure_abs = jax.eval_shape(lambda: nnx.to_pure_dict(abstract_params))
  for layout in LAYOUTS:
    t0 = time.time()
    axes = common.parse_layout(layout)
    mesh = mesh_lib.make_mesh(axes)
    p_sh = sharding.state_shardings(pure_abs, mesh, None, params=abstract_params)
    b_sh = sharding.batch_sharding(mesh)
    fn = jax.jit(common.loss_and_grads_fn(graphdef), in_shardings=(p_sh, b_sh))
    del LAUNCHED[:]
    with sharding.use_mesh(mesh):
      loss, grads = fn(jax.device_put(params, p_sh), jax.device_put(batch, b_sh))
    tensor = axes.get("tensor", 1)
    batch_shards = mesh.size // tensor   # BATCH: data x fsdp x expert
    want_heads = n_heads // tensor if n_heads % tensor == 0 else n_heads
    seen = sorted({(b, h) for _, b, h in LAUNCHED})
    report["layouts"][layout] = dict(
        loss_diff=abs(float(loss) - float(ref_loss)), grad_rel=common.rel_diff(grads, ref_grads),
        kernels=sorted({name for name, _, _ in LAUNCHED}), local=seen,
        want_local=[[BATCH // batch_shards, want_heads]], seconds=round(time.time() - t0, 1))
    print(layout, report["layouts"][layout], flush=True)
  report["wrapper"] = wrapper_cases()
  with open(out_path, "w") as f:
    json.dump(report, f, indent=1)


# (name, mesh, B, H, Hk, the local [B, H] each device must see)
WRAPPER_CASES = [("mha_heads_split", "data=2,tensor=4", 4, 4, 4, [2, 1]),
                 ("shared_key_batch_replicated", "expert=8", 2, 4, 1, [2, 4]),
                 ("mha_batch_and_heads_replicated", "data=8,tensor=1", 3, 3, 3, [3, 3]),
                 ("shared_key_heads_split_batch_replicated", "data=4,tensor=2", 2, 4, 1, [2, 2])]


def wrapper_cases() -> dict:
  from umoe_jax.model.attention.cores import fused_attention
  from umoe_jax.model.attention.local_shards import on_local_shards
  out = {}
  for name, layout, b, h, hk, want_local in WRAPPER_CASES:
    rng = np.random.default_rng(len(name))
    t, dk, dv = 12, 8, 8 if hk == h else 24
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32)
               for s in ((b, t, h, dk), (b, t, hk, dk), (b, t, hk, dv)))
    cot = jnp.asarray(rng.standard_normal((b, t, h, dv)), jnp.float32)
    seen = []

    def attend(q, k, v):
      seen.append([q.shape[0], q.shape[2]])
      return fused_attention(q, k, v, implementation="xla")

    def pullback(q, k, v):
      y, vjp = jax.vjp(lambda *a: on_local_shards(attend, *a), q, k, v)
      return (y, *vjp(cot))

    want = pullback(q, k, v)                     # no mesh: the arrays as they are
    del seen[:]
    mesh = mesh_lib.make_mesh(common.parse_layout(layout))
    with sharding.use_mesh(mesh):
      got = jax.jit(pullback)(q, k, v)
    out[name] = dict(rel=max(common.rel_diff(g, w) for g, w in zip(got, want)),
                     local=sorted({tuple(s) for s in seen}), want_local=[want_local])
    print(name, out[name], flush=True)
  return out


if __name__ == "__main__":
  main(sys.argv[1])
