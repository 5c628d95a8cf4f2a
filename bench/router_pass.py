"""A softmax router's forward in one pass (`router.one_pass`, kernels/triton_router.py) against the
separate ops it replaces (XLA's softmax, the Triton top-k, the gates' gather, the statistics'
reductions: `router_pass.separate_ops`), on one GPU at the UMoE-base router shapes, logits
[32, 1024, 128] float32, k = 15 (FFN) and 3 (attention).

First the check on fresh inputs (random logits; a skewed set, most mass on a few experts): the
kernel's probs, gates and mean probs against the separate ops' (largest relative difference), its
ids and counts (mismatched rows / entries), and d logits of one objective through both (the custom
VJP against JAX's own). Then CUPTI kernel times (bench/gmm.py's `jax_ms`, median of 10) of the
forward and of forward + backward, each form; and the kernel per (block_rows, num_warps). A short
table last; everything to $OUT (or --out) as router_pass.json.

  python3 bench/router_pass.py [--batch=32] [--seq=1024] [--experts=128] [--ks=3,15] [--out DIR]
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
from kernels import triton_router as tr  # noqa: E402
from umoe_jax.ops import router_pass  # noqa: E402

SWEEP = [tr.RouterPassConfig(8, 2), tr.RouterPassConfig(16, 4), tr.RouterPassConfig(32, 4),
         tr.RouterPassConfig(32, 8), tr.RouterPassConfig(64, 8)]


def inputs(b: int, t: int, e: int, seed: int = 0) -> dict[str, jax.Array]:
  """Router-like logits [b, t, e] float32 (fresh random): plain, and skewed toward a few experts."""
  rng = np.random.default_rng(seed)
  return {"random": jnp.asarray(rng.standard_normal((b, t, e)) * 2.0, jnp.float32),
          "skewed": jnp.asarray(rng.standard_normal((b, t, e)) + 6.0 * rng.dirichlet(np.ones(e) * 0.1),
                                jnp.float32)}


def objective(form, k: int, cots):
  """logits -> a scalar that reaches probs, gates and prob_means (the balance loss's input)."""
  def f(logits):
    out = form(logits, k, renormalize=False)
    return (jnp.sum(out.gates * cots[0]) + jnp.sum(out.prob_means * cots[1])
            + 1e-3 * jnp.sum(out.probs * cots[2]))
  return f


def rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--seq", type=int, default=1024)
  ap.add_argument("--experts", type=int, default=128)
  ap.add_argument("--ks", default="3,15")
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  args = ap.parse_args()
  ks = [int(k) for k in args.ks.split(",")]
  if not tr.available():
    sys.exit("bench/router_pass.py needs a GPU with Triton and jax-triton "
             "(kernels.triton_router.available())")
  b, t, e = args.batch, args.seq, args.experts
  log(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, logits [{b}, {t}, {e}] f32")
  xs = inputs(b, t, e)
  one = lambda x, k, **kw: router_pass.softmax_top_k(x, k, **kw)
  sep = lambda x, k, **kw: router_pass.separate_ops(x, k, topk_backend="triton", **kw)
  results = {"shape": [b, t, e], "check": [], "time": [], "sweep": []}
  rng = np.random.default_rng(1)

  for name, x in xs.items():  # correctness first
    for k in ks:
      got, want = jax.jit(lambda v, k=k: one(v, k))(x), jax.jit(lambda v, k=k: sep(v, k))(x)
      cots = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((b, t, k), (b, e), (b, t, e))]
      d_one = jax.jit(jax.grad(objective(one, k, cots)))(x)
      d_sep = jax.jit(jax.grad(objective(sep, k, cots)))(x)
      # The kernel's ids must be the top k of its own probs, its counts those of its ids; where
      # its probs and XLA's differ by round-off, a near tie may pick differently (id_rows_differ).
      own = np.argsort(-np.asarray(got.probs, np.float64), axis=-1, kind="stable")[..., :k]
      ids = np.asarray(got.ids)
      same = np.all(ids == np.asarray(want.ids), axis=-1)                                # [B, T]
      own_counts = np.stack([np.bincount(r.ravel(), minlength=e) for r in ids]).astype(np.float32)
      row = dict(input=name, k=k, probs=rel(got.probs, want.probs), gates=rel(got.gates, want.gates),
                 prob_means=rel(got.prob_means, want.prob_means),
                 id_rows_wrong=int(np.sum(np.any(ids != own, axis=-1))),
                 count_entries_wrong=int(np.sum(np.asarray(got.counts) != own_counts)),
                 id_rows_differ=int(np.sum(~same)),
                 # (over the rows both forms pick alike: a different pick moves that row's gradient)
                 d_logits=rel(np.asarray(d_one)[same], np.asarray(d_sep)[same]))
      results["check"].append(row)
      log("check " + ", ".join(f"{key} {v:.2e}" if isinstance(v, float) else f"{key} {v}"
                               for key, v in row.items()))

  for name, x in xs.items():
    for k in ks:
      cots = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((b, t, k), (b, e), (b, t, e))]
      row = dict(input=name, k=k)
      for label, form in (("separate", sep), ("one pass", one)):
        row[f"fwd {label}"] = jax_ms(jax.jit(lambda v, f=form, k=k: f(v, k)), x)
        row[f"fwd+bwd {label}"] = jax_ms(jax.jit(jax.grad(objective(form, k, cots))), x)
      results["time"].append(row)
      log(f"time {name} k={k}: " + ", ".join(f"{key} {v:.4f}" for key, v in row.items()
                                             if key not in ("input", "k")))
      if name == "random":
        for cfg in SWEEP:
          ms = jax_ms(jax.jit(lambda v, k=k, c=cfg: tr.softmax_top_k(v, k, config=c)), x)
          results["sweep"].append(dict(k=k, block_rows=cfg.block_rows, num_warps=cfg.num_warps, ms=ms))

  default = tr.launch_params(t, e, 1)
  log(f"\nms per router call (CUPTI), logits [{b}, {t}, {e}] float32; default launch "
      f"{default['BLOCK_ROWS']} rows x {default['num_warps']} warps")
  log(f"{'input':7s} {'k':>3s} {'fwd separate':>12s} {'fwd 1-pass':>10s} {'x':>5s} "
      f"{'f+b separate':>12s} {'f+b 1-pass':>10s} {'x':>5s}")
  for r in results["time"]:
    log(f"{r['input']:7s} {r['k']:3d} {r['fwd separate']:12.4f} {r['fwd one pass']:10.4f} "
        f"{r['fwd separate'] / r['fwd one pass']:5.2f} {r['fwd+bwd separate']:12.4f} "
        f"{r['fwd+bwd one pass']:10.4f} {r['fwd+bwd separate'] / r['fwd+bwd one pass']:5.2f}")
  log("sweep (random input): block_rows x num_warps -> ms per k")
  for cfg in SWEEP:
    cells = [f"k={s['k']} {s['ms']:.4f}" for s in results["sweep"]
             if (s["block_rows"], s["num_warps"]) == (cfg.block_rows, cfg.num_warps)]
    log(f"  {cfg.block_rows:3d} x {cfg.num_warps}: " + ", ".join(cells))
  ok = all(r["id_rows_wrong"] == 0 and r["count_entries_wrong"] == 0 and max(
      r["probs"], r["gates"], r["prob_means"]) < 1e-5 and r["d_logits"] < 1e-4
           for r in results["check"])
  log("the one pass matches the separate ops" if ok else "MISMATCH (see the check lines)")
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "router_pass.json"), "w") as f:
    json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
