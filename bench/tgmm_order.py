"""The Triton weight gradient's tile order (`kernels.gmm.triton_gmm.tile_order`) under balanced and
skewed routing: largest groups first in every call (TGMM_BIG_FIRST_SKEW 1), and largest first only
where the largest group holds at least twice the mean group's rows (2, the default; other calls
run in group order).

UMoE-base's four gathered weight-gradient calls (FFN pool K = 15 slots, attention pool K = 3; the
up projection dW1 = x[token].T @ dh, the down projection dW2 = hg.T @ dout[token]) on 32 x 1024
tokens, routed top-K over 128 experts by random logits plus a log-Dirichlet bias (none: balanced).
Checks first: every order gives bitwise the same output, within 1e-2 of a float32 reference; then
CUPTI kernel times. Full rows go to --out as JSON; the table prints last. Each (call, routing) at the
default order is also a row of --results (bench/results.py: default $OUT/rows.jsonl when $OUT is set,
else bench/results/<device>.jsonl; none: no rows).

  python bench/tgmm_order.py --out=$OUT/tgmm_order.json
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from gmm_common import T, jax_ms, log
import results  # noqa: E402  (bench/results.py; gmm_common put bench/ on the path)
from kernels.gmm import triton_gmm
from umoe_jax.ops import dispatch

EXPERTS = 128
CALLS = (  # name, slots K, lhs width, rhs width, which operand is gathered by token
    ("ffn-up", 15, 768, 192, "lhs"),
    ("ffn-down", 15, 192, 768, "rhs"),
    ("att-up", 3, 768, 192, "lhs"),
    ("att-down", 3, 192, 768, "rhs"),
)
ROUTINGS = (("balanced", None), ("dirichlet-4", 4.0), ("dirichlet-1", 1.0))
SKEWS = (1, 2)


def route(slots, alpha, seed=0):
  """Top-`slots` routing of T tokens, sorted by the model's dispatch plan: (group sizes [E], the
  token of each expert-sorted row [T * slots])."""
  rng = np.random.default_rng(seed)
  logits = rng.standard_normal((T, EXPERTS)).astype(np.float32)
  if alpha is not None:
    logits += np.log(rng.dirichlet(np.full(EXPERTS, alpha))).astype(np.float32)
  ids = np.argpartition(-logits, slots - 1, axis=1)[:, :slots]
  plan = dispatch.make_plan(jnp.asarray(ids, jnp.int32), EXPERTS)
  return np.asarray(plan.group_sizes), np.asarray(plan.order) // slots


def reference(lhs, rhs, gs):
  """float32 out[g] = lhs[rows of g].T @ rhs[rows of g], group by group (lhs, rhs already
  gathered)."""
  lhs, rhs = np.asarray(lhs, np.float32), np.asarray(rhs, np.float32)
  ends = np.cumsum(gs)
  return np.stack([lhs[e - n:e].T @ rhs[e - n:e] for n, e in zip(gs, ends)])


def measurements(row: dict) -> list[dict]:
  """The results row of one (call, routing) row: ms at the module's default order, against
largest groups first in every call (skew 1) in the same command."""
  skew = str(triton_gmm.TGMM_BIG_FIRST_SKEW)
  return [dict(config=f"tgmm_order:{row['call']}", metric="ms", value=row["ms"][skew],
               overrides={"routing": row["routing"]},
               anchor=results.anchor("largest groups first (TGMM_BIG_FIRST_SKEW=1), same command",
                                     row["ms"]["1"], "ms", "bench/tgmm_order.py"),
               extra=dict(tflops=row["tflops"][skew], max_over_mean=row["max_over_mean"],
                          skew=int(skew)))]


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", default="", help="JSON file for the full rows")
  results.add_flag(ap)
  ap.add_argument("--iterations", type=int, default=20)
  args = ap.parse_args()
  rows = []
  for name, slots, kw, nw, gathered in CALLS:
    for routing, alpha in ROUTINGS:
      gs_np, token_np = route(slots, alpha)
      m = len(token_np)
      keys = jax.random.split(jax.random.key(len(rows) + 1), 2)
      if gathered == "lhs":
        lhs = jax.random.normal(keys[0], (T, kw), jnp.bfloat16)        # x [T, 768]
        rhs = jax.random.normal(keys[1], (m, nw), jnp.bfloat16)        # dh [M, 192]
      else:
        lhs = jax.random.normal(keys[0], (m, kw), jnp.bfloat16)        # hg [M, 192]
        rhs = jax.random.normal(keys[1], (T, nw), jnp.bfloat16)        # dout [T, 768]
      gs, token = jnp.asarray(gs_np), jnp.asarray(token_np)
      index_arg = "lhs_index" if gathered == "lhs" else "rhs_index"
      outs, times = {}, {}
      default_skew = triton_gmm.TGMM_BIG_FIRST_SKEW
      try:
        for skew in SKEWS:
          triton_gmm.TGMM_BIG_FIRST_SKEW = skew  # read when the launch is traced: a fresh jit each
          f = jax.jit(lambda a, b, g, i: triton_gmm.triton_tgmm(
              a, b, g, num_groups=EXPERTS, **{index_arg: i}))
          outs[skew] = np.asarray(f(lhs, rhs, gs, token).astype(jnp.float32))
          times[skew] = jax_ms(f, lhs, rhs, gs, token, iterations=args.iterations)
      finally:
        triton_gmm.TGMM_BIG_FIRST_SKEW = default_skew
      a = np.asarray(jnp.take(lhs, token, axis=0)) if gathered == "lhs" else np.asarray(lhs)
      b = np.asarray(jnp.take(rhs, token, axis=0)) if gathered == "rhs" else np.asarray(rhs)
      want = reference(a, b, gs_np)
      rel = float(np.abs(outs[SKEWS[0]] - want).max() / np.abs(want).max())
      same = all(np.array_equal(outs[SKEWS[0]], outs[s]) for s in SKEWS)
      flops = 2.0 * m * kw * nw
      row = dict(call=name, routing=routing, rows=m,
                 max_over_mean=float(gs_np.max() / gs_np.mean()),
                 rel_err=rel, orders_bitwise_equal=same,
                 ms={str(s): times[s] for s in SKEWS},
                 tflops={str(s): flops / times[s] / 1e9 for s in SKEWS})
      rows.append(row)
      log(json.dumps(row))
      if not same or rel > 1e-2:
        raise SystemExit(f"FAILED: {name} {routing}: orders equal {same}, rel err {rel:.2e}")
      for m in measurements(row):
        results.record(args.results, **m)
  if args.out:
    with open(args.out, "w") as fh:
      json.dump(rows, fh, indent=1)
  log(f"\n{'call':9} {'routing':12} {'max/mean':>8} {'rel err':>8}  "
      + "  ".join(f"skew={s} ms (TF/s)" for s in SKEWS))
  for r in rows:
    log(f"{r['call']:9} {r['routing']:12} {r['max_over_mean']:8.2f} {r['rel_err']:8.1e}  "
        + "  ".join(f"{r['ms'][str(s)]:7.3f} ({r['tflops'][str(s)]:3.0f})   " for s in SKEWS))


if __name__ == "__main__":
  main()
