"""The Pallas TPU kernels inside a model on 8 virtual CPU devices, run by test_tpu_kernels.py with
UMOE_PALLAS_TPU_INTERPRET=1: a one-layer UMoE (pre-mixing attention -> splash MQA with D-wide
values; MoE FFN -> the megablox gmm backend) gives the same loss and gradients on each layout as
the XLA backends on one device.

Usage: tpu_layouts.py OUT.json   writes {"kernels": {"pallas_calls": n}, "layouts": {layout: {...}}}
"""
import json
import sys
import time

import common
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import configs.common
from umoe_jax.config import model_config
from umoe_jax.ops import pallas_tpu
from umoe_jax.parallel import mesh as mesh_lib, sharding

LAYOUTS = ["expert=8", "fsdp=2,tensor=2,expert=2"]
SEQ = 128   # splash needs a multiple of its 128-blocks


def cfg_for(gmm_backend: str, core: str):
  m = configs.common.model("umoe", "tiny")
  m.n_layers, m.max_seq_len, m.vocab_size, m.d_model = 1, SEQ, 128, 64
  m.compute_dtype, m.gmm_backend, m.attention.core = "float32", gmm_backend, core
  m.attention.head_dim = m.attention.v_head_dim = 16
  return model_config(m)


def main(out_path: str):
  assert pallas_tpu.interpret(), "run with UMOE_PALLAS_TPU_INTERPRET=1"
  ref_cfg, tpu_cfg = cfg_for("xla", "xla"), cfg_for("megablox", "splash")
  params = common.init_params(ref_cfg)
  rng = np.random.default_rng(3)
  batch = jnp.asarray(rng.integers(0, 128, (8, SEQ + 1)), jnp.int32)
  ref_graphdef, _ = common.model_parts(ref_cfg)
  ref_loss, ref_grads = jax.jit(common.loss_and_grads_fn(ref_graphdef))(params, batch)

  graphdef, abstract_params = common.model_parts(tpu_cfg)
  report = {"layouts": {}}
  for layout in LAYOUTS:
    t0 = time.time()
    mesh = mesh_lib.make_mesh(common.parse_layout(layout))
    pure_abs = jax.eval_shape(lambda: nnx.to_pure_dict(abstract_params))
    p_sh = sharding.state_shardings(pure_abs, mesh, None, params=abstract_params)
    b_sh = sharding.batch_sharding(mesh)
    fn = jax.jit(common.loss_and_grads_fn(graphdef), in_shardings=(p_sh, b_sh))
    with sharding.use_mesh(mesh):
      if "pallas_calls" not in report.get("kernels", {}):
        text = str(jax.make_jaxpr(common.loss_and_grads_fn(graphdef))(params, batch))
        report["kernels"] = {"pallas_calls": text.count("pallas_call")}
      loss, grads = fn(jax.device_put(params, p_sh), jax.device_put(batch, b_sh))
    report["layouts"][layout] = dict(loss=float(loss), loss_diff=abs(float(loss) - float(ref_loss)),
                                     grad_rel=common.rel_diff(grads, ref_grads),
                                     seconds=round(time.time() - t0, 1))
    print(layout, report["layouts"][layout], flush=True)
  with open(out_path, "w") as f:
    json.dump(report, f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1])
