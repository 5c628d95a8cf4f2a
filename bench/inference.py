"""Inference speed and memory: prefill latency, cached decoding tokens/s, KV-cache bytes, peak memory.

For each config (default: the six base models of the UMoE rebuttal's table) and batch size, on a
randomly initialised model (parameters and compute in --dtype, default bfloat16), with the programs
`generate()` runs (`umoe_jax.model.decode.decoding_programs`):
  prefill   one forward pass of B prompts of --prompt_len random tokens (never zeros) that fills a
            KV cache of prompt_len + new_tokens slots and returns the last position's logits (the LM
            head on that position only); latency in ms and prompt tokens/s;
  decode    the on-device decoding loop after that prefill: --new_tokens greedy tokens with no EOS,
            i.e. new_tokens - 1 cached forward steps of B tokens each (the first token comes from
            the prefill's logits); ms per step and generated tokens/s = B / step time;
  KV cache  bytes of the cache arrays the prefill returned (sum of their nbytes, per token and in
            total) against `umoe_jax.stats.kv_cache_bytes_per_token` (the model zoo's column);
  memory    `peak_bytes_in_use` of the device (where the backend reports it) and the bytes in use
            once the parameters are placed. Each row runs in its own process (default) so its peak
            and compile caches are its own.
Timing: one compile call, --warmup untimed runs, then the median of --repeats runs, each ended by
`block_until_ready` (wall clock: what a user of generate() waits, dispatch included). Before timing,
the cached prefill's last logits are checked against the full forward pass without a cache.
The model's max_seq_len is raised to prompt_len + new_tokens when it is shorter (RoPE has no table).

  python bench/inference.py --out=$OUT                     # GPU: 6 base configs x batch 1, 32
  python bench/inference.py --configs=umoe_tiny,dense_tiny --prompt_len=64 --new_tokens=8   # CPU
Results: $OUT/inference.json (one row per config x batch); a table is printed last.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from checks import rel_err  # noqa: E402  (bench/checks.py)

BASE_CONFIGS = "dense_base,ffn_moe_base,moa_base,switchhead_base,umoe_att_base,umoe_base"
RESULT = "inference.json"


def log(*a):
  print(*a, flush=True)


def median_s(fn, setup, warmup: int, repeats: int) -> tuple[float, list[float]]:
  """Median wall seconds of fn(*setup()) (setup untimed: fresh donated inputs every run)."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*setup()))
  times = []
  for _ in range(repeats):
    args = jax.block_until_ready(setup())
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times), times


def memory_stats() -> dict:
  return jax.devices()[0].memory_stats() or {}


def bench_one(name: str, batch: int, args) -> dict:
  from flax import nnx

  from umoe_jax import stats
  from umoe_jax.config import model_config
  from umoe_jax.model.cache import cache_bytes, init_cache
  from umoe_jax.model.decode import decoding_programs, left_pad
  from umoe_jax.model.lm import build_model

  config = stats.load_config_file(os.path.join(ROOT, "configs", f"{name}.py"))
  p, n = args.prompt_len, args.new_tokens
  with config.model.unlocked():
    config.model.param_dtype = config.model.compute_dtype = args.dtype
    config.model.gmm_backend = args.gmm_backend
    if args.attention_core:
      config.model.attention.core = args.attention_core
    config.model.max_seq_len = max(config.model.max_seq_len, p + n)
  cfg = model_config(config.model)
  model = build_model(cfg, seed=0)
  graphdef, state = nnx.split(model)
  jax.block_until_ready(state)
  weights_in_use = memory_stats().get("bytes_in_use")
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
  prefill, decode = decoding_programs(graphdef)

  rng = np.random.default_rng(1)
  prompts = rng.integers(1, cfg.vocab_size, size=(batch, p)).tolist()
  tokens, positions = (jnp.asarray(a) for a in left_pad(prompts))
  slots = p + n
  fresh_cache = lambda: init_cache(cfg, batch, slots)
  zero, one, no_eos = jnp.float32(0), jnp.float32(1), jnp.int32(-1)
  next_pos, key = positions[:, -1] + 1, jax.random.key(0)

  # Compile both programs; check the cached prefill against the full forward pass (row 0).
  t0 = time.perf_counter()
  logits, cache = jax.block_until_ready(prefill(state, tokens, positions, fresh_cache()))
  compile_prefill_s = time.perf_counter() - t0
  full = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t)[0][:, -1])(state, tokens[:1])
  ref = np.asarray(full, np.float32)
  got = np.asarray(logits[:1], np.float32)
  logits_rel_err = rel_err(got, ref)
  check = bool(np.isfinite(got).all() and logits_rel_err < args.check_bound)
  measured_cache = cache_bytes(cache)
  t0 = time.perf_counter()
  out, _, _ = jax.block_until_ready(decode(state, logits, cache, next_pos, key, zero, one, no_eos,
                                           max_new_tokens=n))
  compile_decode_s = time.perf_counter() - t0
  out = np.asarray(out)
  check = check and bool(((out >= 0) & (out < cfg.vocab_size)).all())
  del logits, cache, full

  prefill_s, prefill_times = median_s(
      prefill, lambda: (state, tokens, positions, fresh_cache()), args.warmup, args.repeats)

  def prefilled():
    logits, cache = prefill(state, tokens, positions, fresh_cache())
    return state, logits, cache, next_pos, key, zero, one, no_eos

  decode_s, decode_times = median_s(lambda *a: decode(*a, max_new_tokens=n), prefilled,
                                    args.warmup, args.repeats)
  step_s = decode_s / max(n - 1, 1)
  stats_per_token = stats.kv_cache_bytes_per_token(cfg, dtype=args.dtype)["total"]
  mem = memory_stats()
  gib = lambda b: None if b is None else b / 2**30
  row = dict(
      config=name, batch=batch, prompt_len=p, new_tokens=n, dtype=args.dtype,
      gmm_backend=args.gmm_backend, attention_core=cfg.attention.core,
      device=jax.devices()[0].device_kind,
      prefill_ms=1e3 * prefill_s, prefill_tokens_per_s=batch * p / prefill_s,
      decode_ms_per_step=1e3 * step_s, decode_tokens_per_s=batch / step_s,
      decode_total_ms=1e3 * decode_s,
      kv_bytes_per_token_measured=measured_cache / (batch * slots),
      kv_bytes_per_token_stats=stats_per_token,
      kv_match=measured_cache == stats_per_token * batch * slots,
      kv_cache_mib=measured_cache / 2**20, param_mib=param_bytes / 2**20,
      peak_gib=gib(mem.get("peak_bytes_in_use")), weights_in_use_gib=gib(weights_in_use),
      check=check, logits_rel_err=logits_rel_err,
      compile_prefill_s=compile_prefill_s, compile_decode_s=compile_decode_s,
      prefill_times_ms=[1e3 * t for t in prefill_times],
      decode_times_ms=[1e3 * t for t in decode_times])
  return row


def _bench_subprocess(name: str, batch: int, args) -> dict:
  """One row in a fresh process: its peak memory and compile caches are its own."""
  flags = [f"--{k}={v}" for k, v in vars(args).items()
           if k not in ("configs", "batches", "out", "in_process", "child") and v is not None]
  with tempfile.TemporaryDirectory() as tmp:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), f"--configs={name}",
                           f"--batches={batch}", f"--out={tmp}", "--child", *flags], check=False)
    path = os.path.join(tmp, RESULT)
    if not os.path.exists(path):
      raise RuntimeError(f"row {name} batch {batch} exited with {proc.returncode}, no result")
    with open(path) as f:
      row = json.load(f)[0]
  if "error" in row:
    raise RuntimeError(row["error"])
  return row


def _fmt(x, spec):
  return "-" if x is None else format(x, spec)


def table(rows) -> str:
  head = (f"{'config':16s} {'B':>3s} {'prefill ms':>10s} {'prefill tok/s':>13s} "
          f"{'decode ms/step':>14s} {'decode tok/s':>12s} {'KV B/token (stats)':>20s} "
          f"{'KV MiB':>8s} {'peak GiB':>8s}  check")
  lines = [head]
  for r in rows:
    if "error" in r:
      lines.append(f"{r['config']:16s} {r['batch']:3d} FAILED: {r['error'][:200]}")
      continue
    kv = f"{r['kv_bytes_per_token_measured']:,.0f} ({r['kv_bytes_per_token_stats']:,})"
    lines.append(
        f"{r['config']:16s} {r['batch']:3d} {r['prefill_ms']:10.2f} {r['prefill_tokens_per_s']:13,.0f} "
        f"{r['decode_ms_per_step']:14.3f} {r['decode_tokens_per_s']:12,.1f} {kv:>20s} "
        f"{r['kv_cache_mib']:8.1f} {_fmt(r['peak_gib'], '8.2f'):>8s}  "
        f"{'ok' if r['check'] and r['kv_match'] else 'FAILED'}")
  return "\n".join(lines)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--configs", default=BASE_CONFIGS, help="names of configs/*.py, comma-separated")
  ap.add_argument("--batches", default="1,32", help="batch sizes, comma-separated")
  ap.add_argument("--prompt_len", type=int, default=1024)
  ap.add_argument("--new_tokens", type=int, default=128)
  ap.add_argument("--dtype", default="bfloat16", help="parameter, compute and cache dtype")
  ap.add_argument("--gmm_backend", default="auto")
  ap.add_argument("--attention_core", default=None, help="model.attention.core (default: the config's)")
  ap.add_argument("--warmup", type=int, default=1)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--check_bound", type=float, default=0.05,
                  help="relative error bound of the cached prefill's logits vs the full forward")
  ap.add_argument("--in_process", action="store_true",
                  help="every row in this process (default: one subprocess per row)")
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # a row for the parent
  args = ap.parse_args()
  if args.new_tokens < 2 or args.prompt_len < 1:
    ap.error("--new_tokens must be >= 2 (one cached step at least) and --prompt_len >= 1")
  runs = [(c, int(b)) for c in args.configs.split(",") for b in args.batches.split(",")]
  for c, _ in runs:
    if not os.path.isfile(os.path.join(ROOT, "configs", f"{c}.py")):
      ap.error(f"unknown config {c!r}: no configs/{c}.py")
  single = args.in_process or len(runs) == 1
  if single:
    log("devices:", jax.devices())  # not in a parent of subprocesses: it would take GPU memory
  rows = []
  for name, batch in runs:
    try:
      if single:
        rows.append(r := bench_one(name, batch, args))
        log(f"{name} B={batch}: prefill {r['prefill_ms']:.2f} ms, decode "
            f"{r['decode_ms_per_step']:.3f} ms/step = {r['decode_tokens_per_s']:,.1f} tok/s, KV "
            f"{r['kv_cache_mib']:.1f} MiB, peak {_fmt(r['peak_gib'], '.2f')} GiB, logits rel err "
            f"{r['logits_rel_err']:.2e} (compile {r['compile_prefill_s']:.1f} + "
            f"{r['compile_decode_s']:.1f} s)")
      else:  # the child prints the row's line
        rows.append(_bench_subprocess(name, batch, args))
    except Exception as e:  # noqa: BLE001  (report and go on with the next row)
      log(f"{name} B={batch}: FAILED {type(e).__name__}: {str(e)[:400]}")
      rows.append(dict(config=name, batch=batch, error=f"{type(e).__name__}: {e}"[:2000]))
    os.makedirs(args.out, exist_ok=True)  # after every row: a run cut short keeps what it measured
    with open(os.path.join(args.out, RESULT), "w") as f:
      json.dump(rows, f, indent=1)
  if args.child:
    return
  log(f"\nprompt {args.prompt_len} tokens, {args.new_tokens} new tokens, {args.dtype}, "
      f"median of {args.repeats}; decode tok/s = batch / (ms per cached step)")
  log(table(rows))
  if any("error" in r or not (r["check"] and r["kv_match"]) for r in rows):
    sys.exit(1)


if __name__ == "__main__":
  main()
