"""End-to-end training throughput: the trainer's own jitted step (forward, backward, clip, AdamW).

For each model config and mesh layout: builds the state and step exactly as `train.py` does
(`umoe_jax.train.loop.config_programs`), checks the first loss is near ln(V) and finite, then times
`--steps` steps on random tokens (never zeros) and reports median step time, tokens/s, MFU and peak
memory. Usage (GPU):

  python bench/train_step.py --configs=dense_base,umoe_base --batch=32 --seq_len=1024 \
      [--layouts=single,data,expert] [--gmm_backend=auto] [--remat[=block|dots|dots_no_batch]] [--out=$OUT] \
      [--capacity_factor=1.25] [--exchange=auto|all_to_all|all_gather]

Layouts: "single" = one device; "data" = data parallel over every device; "expert" = expert parallel
over every device (mesh data=1, expert=N) with data parallel batch sharding.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import numpy as np  # noqa: E402

# The official PyTorch UMoE code on one H200 (bf16, 32x1024 tokens a step), tokens/s.
ANCHORS = {"dense_base": 213.6e3, "ffn_moe_base": 71.2e3, "umoe_base": 58.2e3}


def log(*a):
  print(*a, flush=True)


def layout_mesh(layout: str, n: int) -> dict:
  if layout == "single":
    return dict(data=1, fsdp=1, tensor=1, expert=1)
  if layout == "data":
    return dict(data=n, fsdp=1, tensor=1, expert=1)
  if layout == "expert":
    return dict(data=1, fsdp=1, tensor=1, expert=n)
  raise ValueError(f"unknown layout {layout!r}")


def bench_one(name: str, layout: str, args) -> dict:
  from umoe_jax import stats
  from umoe_jax.parallel import sharding as sharding_lib
  from umoe_jax.parallel import mesh as mesh_lib
  from umoe_jax.train import loop
  from umoe_jax.train import config as train_config
  from umoe_jax.train import metrics as metrics_lib

  config = stats.load_config_file(os.path.join(ROOT, "configs", f"{name}.py"))
  if args.attention_tiles:
    from kernels import attention_tiles
    attention_tiles.load_table(args.attention_tiles)
  n_dev = 1 if layout == "single" else jax.device_count()
  with config.unlocked():
    config.model.gmm_backend = args.gmm_backend
    if args.attention_core is not None:
      config.model.attention.core = args.attention_core
    config.train.global_batch_size = args.batch * n_dev
    config.train.seq_len = args.seq_len
    config.train.remat = args.remat
    config.train.grad_accum_steps = 1
    config.train.eval_every = 0
    config.mesh = layout_mesh(layout, n_dev)
  model_cfg = train_config.validate(config)
  mesh = mesh_lib.make_mesh(config.mesh, devices=jax.devices()[:n_dev])
  rules = sharding_lib.normalize_rules(config.get("sharding_rules"))
  with config.unlocked():
    if args.capacity_factor is not None:
      config.expert_parallel.capacity_factor = args.capacity_factor
    if args.exchange is not None:
      config.expert_parallel.exchange = args.exchange
  train_config.check_expert_parallel(config.get("expert_parallel"))
  cf, exchange = loop.expert_parallel_settings(config)
  progs = loop.config_programs(config, model_cfg, mesh, rules)

  b, t, v = config.train.global_batch_size, args.seq_len, model_cfg.vocab_size
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, v, size=(b, t + 1), dtype=np.int32)
  batch_sharding = sharding_lib.batch_sharding(mesh, rules)
  batch = {"inputs": jax.device_put(tokens[:, :-1], batch_sharding),
           "targets": jax.device_put(tokens[:, 1:], batch_sharding)}

  with sharding_lib.use_mesh(mesh, rules, expert_capacity_factor=cf, expert_exchange=exchange):
    t0 = time.perf_counter()
    state = progs.init_fn(config.train.seed)
    state, m = progs.train_fn(state, batch)
    first_loss = float(m["loss"])
    compile_s = time.perf_counter() - t0
    # Correctness: a fresh model on uniform random tokens has loss ~ ln(V) (+ small balance loss).
    ok = math.isfinite(first_loss) and abs(first_loss - math.log(v)) < 0.15 * math.log(v)
    for _ in range(args.warmup):
      state, m = progs.train_fn(state, batch)
    jax.block_until_ready(state)
    times = []
    for _ in range(args.steps):
      s0 = time.perf_counter()
      state, m = progs.train_fn(state, batch)
      jax.block_until_ready(m["loss"])
      times.append(time.perf_counter() - s0)
    last_loss = float(m["loss"])
  step_s = statistics.median(times)
  tok_s = b * t / step_s
  flops_tok = stats.train_flops_per_token(model_cfg, t)
  peak = metrics_lib.peak_flops_per_device(jax.devices()[0].device_kind) or float("nan")
  mem = jax.devices()[0].memory_stats() or {}
  row = dict(config=name, layout=layout, devices=n_dev, batch=b, seq_len=t, step_ms=1e3 * step_s,
             tokens_per_s=tok_s, tokens_per_s_per_device=tok_s / n_dev,
             mfu=flops_tok * tok_s / (peak * n_dev), compile_s=compile_s, first_loss=first_loss,
             last_loss=last_loss, loss_check=ok, peak_mem_gb=mem.get("peak_bytes_in_use", 0) / 2**30,
             gmm_backend=args.gmm_backend, remat=args.remat, capacity_factor=cf, exchange=exchange,
             attention_core=model_cfg.attention.core,
             step_times_ms=[1e3 * x for x in times],
             anchor_tokens_per_s=ANCHORS.get(name))
  del state, m, batch
  gc.collect()
  jax.clear_caches()
  return row


def _bench_subprocess(name: str, layout: str) -> dict:
  """One row in a fresh process: its peak memory and compile time are its own."""
  import subprocess
  import tempfile
  own = ("--runs", "--configs", "--layouts", "--out")  # set per row below
  argv, words = [], iter(sys.argv[1:])
  for a in words:
    if a in own:
      next(words, None)  # "--out DIR": drop the value too
    elif not a.startswith(own):
      argv.append(a)
  with tempfile.TemporaryDirectory() as tmp:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), f"--runs={name}:{layout}",
                           f"--out={tmp}", *argv], check=False)
    path = os.path.join(tmp, "train_step.json")
    if not os.path.exists(path):
      raise RuntimeError(f"row {name}:{layout} exited with {proc.returncode} and wrote no result")
    with open(path) as f:
      row = json.load(f)[0]
  if "error" in row:
    raise RuntimeError(row["error"])
  return row


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--configs", default="dense_base,ffn_moe_base,umoe_base")
  ap.add_argument("--layouts", default="single")
  ap.add_argument("--runs", default="", help="explicit config:layout list, e.g. umoe_base:single,umoe_base:data")
  ap.add_argument("--batch", type=int, default=32, help="sequences per device")
  ap.add_argument("--seq_len", type=int, default=1024)
  ap.add_argument("--steps", type=int, default=10)
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--gmm_backend", default="auto")
  ap.add_argument("--remat", nargs="?", const="block", default="none",
                  help="train.remat policy (none|block|dots|dots_no_batch; a bare --remat = block)")
  ap.add_argument("--attention_core", default=None, choices=["xla", "cudnn", "triton"],
                  help="model.attention.core (default: the config's)")
  ap.add_argument("--attention_tiles", default=None,
                  help="JSON of Triton attention tiles (bench/attention_core.py --sweep)")
  ap.add_argument("--capacity_factor", type=float, default=None,
                  help="expert-parallel buffer capacity factor (default: the config's; None = dropless)")
  ap.add_argument("--exchange", default=None, choices=["auto", "all_to_all", "all_gather"],
                  help="expert-parallel token exchange (default: the config's, normally auto = "
                       "all_gather when top-k >= expert-axis size)")
  ap.add_argument("--in_process", action="store_true",
                  help="run every row in this process (default: one subprocess per row, so that peak "
                       "memory and compile caches are per row)")
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  args = ap.parse_args()
  rows = []
  runs = [tuple(r.split(":")) for r in args.runs.split(",")] if args.runs else [
      (name, layout) for layout in args.layouts.split(",") for name in args.configs.split(",")]
  if args.in_process or len(runs) == 1:
    log("devices:", jax.devices())  # (not in a parent of subprocesses: it would take the GPUs' memory)
  for name, layout in runs:
    try:
      rows.append(bench_one(name, layout, args) if args.in_process or len(runs) == 1
                  else _bench_subprocess(name, layout))
      r = rows[-1]
      log(f"{name:14s} {layout:7s} step {r['step_ms']:8.1f} ms  {r['tokens_per_s'] / 1e3:8.1f}k tok/s  "
          f"MFU {100 * r['mfu']:5.1f}%  loss {r['first_loss']:.3f}->{r['last_loss']:.3f} "
          f"(check {'ok' if r['loss_check'] else 'FAILED'})  compile {r['compile_s']:.0f}s  "
          f"mem {r['peak_mem_gb']:.1f} GB")
    except Exception as e:  # noqa: BLE001  (report and go on with the next row)
      log(f"{name} {layout}: FAILED {type(e).__name__}: {str(e)[:400]}")
      rows.append(dict(config=name, layout=layout, error=f"{type(e).__name__}: {e}"[:2000]))
    os.makedirs(args.out, exist_ok=True)  # after every row: a run cut short keeps what it measured
    with open(os.path.join(args.out, "train_step.json"), "w") as f:
      json.dump(rows, f, indent=1)
  log("\nconfig          layout  dev  step ms   tok/s (k)  per dev  MFU   anchor (k, official torch)")
  for r in rows:
    if "error" in r:
      log(f"{r['config']:15s} {r['layout']:7s} FAILED")
      continue
    anchor = r["anchor_tokens_per_s"]
    log(f"{r['config']:15s} {r['layout']:7s} {r['devices']:3d} {r['step_ms']:8.1f} "
        f"{r['tokens_per_s'] / 1e3:10.1f} {r['tokens_per_s_per_device'] / 1e3:8.1f} "
        f"{100 * r['mfu']:5.1f}%  {anchor / 1e3 if anchor else float('nan'):6.1f}")


if __name__ == "__main__":
  main()
