"""The routers' top-k on one GPU: `jax.lax.top_k` (XLA: a sort of every row) against the Triton
kernel (kernels/router/triton_topk.py) at the UMoE-base router shapes, probs [32768, 128] float32.

First the check, for k = 3 and 15 on fresh inputs (softmax of random logits; a skewed one, most
mass on a few experts; one with many exact ties, logits from {0, 1, 2}): the kernel's ids (default
launch and every sweep candidate) and lax.top_k's against a numpy stable argsort (descending, ties
toward the lower index). Then CUPTI kernel times (bench/gmm.py's `jax_ms`, median of 10):
  ids      lax.top_k(x, k)[1]  vs  the kernel's ids;
  router   `biased_top_k` (ids + gates gathered from probs), forward, router.topk_backend xla vs
           triton: what a router call runs;
  sweep    the kernel per (block_rows, num_warps) candidate, to pick TopKConfig's defaults.
A short table last; everything to $OUT (or --out) as topk.json.

  python3 bench/topk.py [--rows=32768] [--experts=128] [--ks=3,15] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from gmm import jax_ms, log  # noqa: E402  (CUPTI kernel time)
from kernels.router import triton_topk as tk  # noqa: E402
from umoe_jax.model.routers.selection import biased_top_k  # noqa: E402

SWEEP = [tk.TopKConfig(8, 2), tk.TopKConfig(16, 4), tk.TopKConfig(32, 4), tk.TopKConfig(64, 8)]


def inputs(n: int, e: int, seed: int = 0) -> dict[str, jax.Array]:
  """Router-like probabilities [n, e] float32 (fresh random)."""
  rng = np.random.default_rng(seed)
  logits = {
      "softmax": rng.standard_normal((n, e)) * 2.0,
      "skewed": rng.standard_normal((n, e)) + 6.0 * rng.dirichlet(np.ones(e) * 0.1),
      "ties": rng.integers(0, 3, (n, e)).astype(np.float64),
  }
  return {name: jax.nn.softmax(jnp.asarray(v, jnp.float32), axis=-1) for name, v in logits.items()}


def mismatched_rows(ids, want) -> int:
  return int(np.sum(np.any(np.asarray(ids) != want, axis=-1)))


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--rows", type=int, default=32 * 1024)
  ap.add_argument("--experts", type=int, default=128)
  ap.add_argument("--ks", default="3,15")
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  args = ap.parse_args()
  ks = [int(k) for k in args.ks.split(",")]
  if not tk.available():
    sys.exit("bench/topk.py needs a GPU with Triton and jax-triton (kernels.router.triton_topk.available())")
  log(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, x [{args.rows}, {args.experts}] f32")
  xs = inputs(args.rows, args.experts)
  results = {"rows": args.rows, "experts": args.experts, "check": [], "time": [], "sweep": []}

  for name, x in xs.items():  # correctness first
    order = np.argsort(-np.asarray(x, np.float64), axis=-1, kind="stable")
    for k in ks:
      want = order[:, :k]
      row = dict(input=name, k=k, xla=mismatched_rows(jax.lax.top_k(x, k)[1], want))
      for cfg in [None] + SWEEP:
        label = "default" if cfg is None else f"{cfg.block_rows}x{cfg.num_warps}"
        row[f"triton {label}"] = mismatched_rows(tk.top_k_ids(x, k, config=cfg), want)
      results["check"].append(row)
      bad = {key: v for key, v in row.items() if key not in ("input", "k") and v}
      log(f"check {name:8s} k={k:3d}: " + ("all ids match" if not bad else f"MISMATCHED ROWS {bad}"))

  for name in ("softmax", "skewed"):
    x = xs[name]
    for k in ks:
      t = dict(input=name, k=k)
      t["ids xla"] = jax_ms(jax.jit(lambda v, k=k: jax.lax.top_k(v, k)[1]), x)
      t["ids triton"] = jax_ms(jax.jit(lambda v, k=k: tk.top_k_ids(v, k)), x)
      for backend in ("xla", "triton"):
        t[f"router {backend}"] = jax_ms(
            jax.jit(lambda v, k=k, b=backend: biased_top_k(v, k, False, topk_backend=b)), x)
      results["time"].append(t)
      log(f"time {name:8s} k={k:3d}: " + ", ".join(f"{key} {v:.4f}" for key, v in t.items()
                                                   if key not in ("input", "k")))
      if name == "softmax":
        for cfg in SWEEP:
          ms = jax_ms(jax.jit(lambda v, k=k, c=cfg: tk.top_k_ids(v, k, config=c)), x)
          results["sweep"].append(dict(k=k, block_rows=cfg.block_rows, num_warps=cfg.num_warps, ms=ms))

  default_rows = tk.launch_params(args.rows, args.experts, 1)["BLOCK_ROWS"]
  log(f"\nms per call (CUPTI), x [{args.rows}, {args.experts}] float32; default TopKConfig "
      f"{default_rows} rows x {tk.TopKConfig().num_warps} warps")
  log(f"{'input':8s} {'k':>3s} {'ids xla':>9s} {'ids triton':>10s} {'x':>6s} {'router xla':>10s} "
      f"{'router triton':>13s} {'x':>6s}")
  for t in results["time"]:
    log(f"{t['input']:8s} {t['k']:3d} {t['ids xla']:9.4f} {t['ids triton']:10.4f} "
        f"{t['ids xla'] / t['ids triton']:6.1f} {t['router xla']:10.4f} {t['router triton']:13.4f} "
        f"{t['router xla'] / t['router triton']:6.1f}")
  log("sweep (softmax input): block_rows x num_warps -> ms per k")
  for cfg in SWEEP:
    cells = [f"k={s['k']} {s['ms']:.4f}" for s in results["sweep"]
             if (s["block_rows"], s["num_warps"]) == (cfg.block_rows, cfg.num_warps)]
    log(f"  {cfg.block_rows:3d} x {cfg.num_warps}: " + ", ".join(cells))
  ok = all(v == 0 for row in results["check"] for key, v in row.items() if key not in ("input", "k"))
  log("all ids match numpy's stable argsort" if ok else "SOME IDS MISMATCH (see the check lines)")
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "topk.json"), "w") as f:
    json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
