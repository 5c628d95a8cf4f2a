"""One worker of a multi-process CPU run (launched twice by test_parallel.py, 4 devices each).

Usage: multi_process.py WORKDIR PHASE LAYOUT
  env: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID (read by
       `umoe_jax.parallel.distributed.initialize_from_env`).
  PHASE train:  AdamW steps 1..4 of the tiny UMoE on LAYOUT; an Orbax checkpoint of the sharded
                (params, opt_state) after step 2; process 0 also runs the single-device reference.
  PHASE resume: fresh processes restore step 2 onto LAYOUT (possibly another mesh) and run 3..4.
Each process writes WORKDIR/<phase>_<process>.json with its losses.
"""
import json
import os
import sys

import common  # noqa: F401  (repo root on sys.path)
from umoe_jax.parallel import distributed

assert distributed.initialize_from_env(), "expected JAX_COORDINATOR_ADDRESS etc. in the environment"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

from umoe_jax.parallel import mesh as mesh_lib, sharding  # noqa: E402

STEPS, SAVE_AT = 4, 2


def parse(layout: str) -> dict:
  return {k: int(v) for k, v in (kv.split("=") for kv in layout.split(","))}


def local_rows(batch: np.ndarray) -> np.ndarray:
  """This process's rows of the global batch (what a per-process data loader would yield)."""
  per = batch.shape[0] // jax.process_count()
  return batch[jax.process_index() * per:(jax.process_index() + 1) * per]


def main(workdir: str, phase: str, layout: str):
  info = distributed.process_info()
  assert info["process_count"] == 2 and info["global_devices"] == 8, info
  cfg = common.tiny_cfg()
  graphdef, abstract_params = common.model_parts(cfg)
  mesh = mesh_lib.make_mesh(parse(layout))
  step, p_sh, o_sh = common.sharded_step(graphdef, abstract_params, mesh)
  batches = [common.tokens(seed=s) for s in range(STEPS)]
  ckpt_dir = os.path.join(workdir, "ckpt")
  out = dict(info=info, mesh=mesh_lib.describe(mesh))
  ckptr = ocp.StandardCheckpointer()

  if phase == "train":
    params = common.init_params(cfg)
    if jax.process_index() == 0:   # single-device reference on this process's first device
      ref = jax.jit(common.make_step(graphdef))
      p, o, ref_losses = params, common.TX.init(params), []
      for b in batches:
        p, o, loss, _ = ref(p, o, b)
        ref_losses.append(float(loss))
      out["ref_losses"] = ref_losses
    p = sharding.shard_params(params, mesh)     # host values identical on every process
    p = jax.tree.map(lambda a, s: a if a.sharding == s else jax.device_put(a, s), p, p_sh)
    o = jax.jit(common.TX.init, out_shardings=o_sh)(p)
    first = 0
  else:
    abstract = jax.eval_shape(lambda: {"params": common.init_params(cfg),
                                       "opt_state": common.TX.init(common.init_params(cfg))})
    target = sharding.abstract_with_shardings(abstract, {"params": p_sh, "opt_state": o_sh})
    state = ckptr.restore(ckpt_dir, target)
    p, o = state["params"], state["opt_state"]
    assert p["layers"][0]["experts"]["w_up"].sharding.is_equivalent_to(
        p_sh["layers"][0]["experts"]["w_up"], 3)
    first = SAVE_AT

  losses = []
  with sharding.use_mesh(mesh):
    for i in range(first, STEPS):
      gb = sharding.global_batch(local_rows(batches[i]), mesh)
      p, o, loss, _ = step(p, o, gb)
      losses.append(float(loss))
      if phase == "train" and i + 1 == SAVE_AT:
        ckptr.save(ckpt_dir, {"params": p, "opt_state": o})
        ckptr.wait_until_finished()
  out["losses"] = losses
  with open(os.path.join(workdir, f"{phase}_{jax.process_index()}.json"), "w") as f:
    json.dump(out, f)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(*sys.argv[1:4])
