"""How long the trainer's gradient takes to trace, lower and compile, with the decoder blocks looped
and scanned (`model.scan_layers`), at a given depth: what a researcher waits before the first step.

The program is the trainer's own (`umoe_jax.train.step.grads_and_stats`: forward, loss, backward, the
routers' statistics) on a config's model with `n_layers` overridden; nothing runs, so any machine
measures its own compiler (XLA:CPU here, XLA:GPU with its autotuning on a GPU).

  python3 bench/compile_time.py [--config=umoe_tiny] [--layers=12,24] [--batch=4] [--seq_len=128]
                                [--remat=block] [--out DIR]
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402


def measure(config_name: str, n_layers: int, scan: bool, batch: int, seq_len: int,
            remat: str, compile: bool = True) -> dict:
  """{config, n_layers, scan_layers, lower_s, compile_s (None without `compile`), program_chars}."""
  from umoe_jax.config import model_config
  from umoe_jax.train import state as state_lib
  from umoe_jax.train import step as step_lib
  try:
    model = importlib.import_module(f"configs.{config_name}").get_config().model
  except ModuleNotFoundError:
    raise SystemExit(f"--config={config_name!r}: no configs/{config_name}.py") from None
  model.n_layers, model.scan_layers = n_layers, scan
  model.max_seq_len = max(model.max_seq_len, seq_len)
  cfg = model_config(model)
  parts = state_lib.model_parts(cfg)
  params = jax.eval_shape(lambda: nnx.to_pure_dict(parts.abstract_params))   # shapes only
  tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
  fn = jax.jit(lambda p, b: step_lib.grads_and_stats(p, b, graphdef=parts.graphdef, accum_steps=1,
                                                     remat=remat))
  t0 = time.perf_counter()
  lowered = fn.lower(params, {"inputs": tokens, "targets": tokens})
  t1 = time.perf_counter()
  if compile:
    lowered.compile()
  t2 = time.perf_counter()
  return dict(config=config_name, n_layers=n_layers, scan_layers=scan, lower_s=t1 - t0,
              compile_s=t2 - t1 if compile else None, program_chars=len(lowered.as_text()))


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--config", default="umoe_tiny", help="a module of configs/")
  ap.add_argument("--layers", default="12,24", help="comma-separated depths")
  ap.add_argument("--batch", type=int, default=4)
  ap.add_argument("--seq_len", type=int, default=128)
  ap.add_argument("--remat", default="block")
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  args = ap.parse_args()
  rows = []
  print(f"device: {jax.devices()[0].device_kind}")
  print(f"{'config':14s} {'layers':>6s} {'blocks':>7s} {'lower s':>8s} {'compile s':>10s} {'program':>10s}")
  for n in (int(x) for x in args.layers.split(",")):
    for scan in (False, True):
      r = measure(args.config, n, scan, args.batch, args.seq_len, args.remat)
      rows.append(r)
      print(f"{r['config']:14s} {n:6d} {'scanned' if scan else 'looped':>7s} {r['lower_s']:8.1f} "
            f"{r['compile_s']:10.1f} {r['program_chars'] / 1e3:9.0f}k", flush=True)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "compile_time.json"), "w") as f:
    json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
