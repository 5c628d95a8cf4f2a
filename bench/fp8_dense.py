"""The dense products of train.precision=fp8 (`umoe_jax.model.layers.fp8_dense`): forward + backward
TFLOP/s of x [M, K] @ w [K, N] in bf16 (jnp.dot) and in FP8 by each way the layers can run it: "xla"
(FP8 dot_generals per 128-wide chunk of the contraction) and the FP8 grouped-matmul kernels with one
group (each gmm backend with FP8 forms besides the emulation), quantisation included; the forward's
error against a float32 product beside each FP8 figure.

  python3 bench/fp8_dense.py [--shapes=base-qk,base-up,base-down,large-up,large-down] [--tokens=32768]

Rows: config fp8_dense:<shape>, metric fwd_bwd_tflops, overrides {"impl": ..., "precision": ...};
the table ends with each FP8 figure over the bf16 one. Needs a GPU
with FP8 tensor cores.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."),
                os.path.dirname(os.path.abspath(__file__))]

import results as results_lib  # noqa: E402  (bench/results.py)
from gmm_common import jax_ms, log  # noqa: E402
from gmm_fp8 import comma_list  # noqa: E402

# name -> (K, N): d_model-square products and the dense FFN's of the base and large models.
SHAPES = {"base-qk": (768, 768), "base-up": (768, 3072), "base-down": (3072, 768),
          "large-qk": (2048, 2048), "large-up": (2048, 5632), "large-down": (5632, 2048)}
MAX_REL_ERR = 0.1   # e4m3's few-percent product error; a wrong layout misses by far more


def parse_shapes(text: str) -> list[str]:
  return comma_list("--shapes", text, SHAPES)


def impls() -> list[str]:
  """bf16, the chunked dot_generals, and each gmm backend with FP8 forms that runs here (not the
  emulation: "xla" names the dot_generals here)."""
  import jax
  from umoe_jax.ops.fp8_gmm import fp8_backends
  from umoe_jax.ops.gmm_backends import BACKENDS
  platform = jax.devices()[0].platform
  kernels = [b for b in fp8_backends() if b != "xla" and platform in BACKENDS.get(b).platforms]
  return ["bf16", "xla"] + kernels


def measure(impl: str, x, w, dy) -> dict:
  """{ms, rel_err} of forward + backward (the output returned too, so the forward stays)."""
  import jax
  import jax.numpy as jnp
  from umoe_jax.model.layers import fp8_dense
  f = jnp.dot if impl == "bf16" else (lambda a, b: fp8_dense(a, b, impl))

  def fb(a, b, d):
    y, pull = jax.vjp(f, a, b)
    return y, pull(d)
  y = jax.jit(f)(x, w).astype(jnp.float32)
  ref = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
  return dict(ms=jax_ms(jax.jit(fb), x, w, dy),
              rel_err=float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref)))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--shapes", default="base-qk,base-up,base-down,large-up,large-down")
  ap.add_argument("--tokens", type=int, default=32 * 1024, help="rows M (tokens of a step)")
  results_lib.add_flag(ap)
  args = ap.parse_args(argv)
  try:
    shapes = parse_shapes(args.shapes)
  except ValueError as e:
    ap.error(str(e))
  import jax
  import jax.numpy as jnp
  rows = []
  for name in shapes:
    k, n = SHAPES[name]
    kx, kw, kd = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (args.tokens, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (k, n), jnp.float32) * 0.02).astype(jnp.bfloat16)
    dy = jax.random.normal(kd, (args.tokens, n), jnp.bfloat16)
    flops = 3 * 2 * args.tokens * k * n
    for impl in impls():
      t = measure(impl, x, w, dy)
      if impl != "bf16" and not t["rel_err"] < MAX_REL_ERR:
        log(f"{name} {impl}: forward error {t['rel_err']:.3g} >= {MAX_REL_ERR}: no row")
        continue
      tflops = flops / (t["ms"] / 1e3) / 1e12
      over = {"impl": impl, "precision": "bf16" if impl == "bf16" else "fp8"}
      bf16 = [r[3] for r in rows if r[0] == name and r[1] == "bf16"]
      anchor = (results_lib.anchor("bf16 jnp.dot, same process", bf16[0], "TFLOP/s", "bench/fp8_dense.py")
                if bf16 and impl != "bf16" else None)
      results_lib.record(args.results, f"fp8_dense:{name}", "fwd_bwd_tflops", tflops, overrides=over,
                         anchor=anchor, extra={"ms": t["ms"], "rel_err": t["rel_err"],
                                               "tokens": args.tokens})
      rows.append((name, impl, t["ms"], tflops, t["rel_err"]))
      log(f"{name:11s} {impl:10s} {t['ms']:8.3f} ms {tflops:7.1f} TFLOP/s  err {t['rel_err']:.3g}")
  bf16 = {name: ms for name, impl, ms, _, _ in rows if impl == "bf16"}
  print(f"\n{'shape':11s} {'impl':10s} {'ms':>8s} {'TFLOP/s':>8s} {'err':>8s}  vs bf16")
  for name, impl, ms, tf, err in rows:
    ratio = f"{bf16[name] / ms:.2f}x" if name in bf16 and impl != "bf16" else ""
    print(f"{name:11s} {impl:10s} {ms:8.3f} {tf:8.1f} {err:8.2g}  {ratio}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
