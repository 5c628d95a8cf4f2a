"""What a Triton launch costs between XLA's fusions, through jax-triton's custom call and through the
typed-FFI route (kernels/triton_launch.py: ffi): a route whose launches XLA records into its CUDA
graphs runs the chain faster (host launches gone), one that it launches from the host does not.

A chain of `--layers` small steps, each an XLA fusion and a fan-in kernel (kernels/gmm/triton_fan_in.py,
`--tokens` x K=`--k` rows of width `--d`), is jitted once per route (custom_call, ffi). For each: the median wall time
of `--iters` calls (after checking that both routes give bit-identical results on fresh random
inputs) and the optimized HLO's Triton custom calls, those inside command-buffer computations and
the calls of such computations (jax 0.11.2's optimized HLO shows none for either route: there
only the time tells). The step's own difference:
bench/train_step.py --triton_launch=ROUTE.

  python bench/triton_launch.py [--layers=48] [--tokens=2048] [--k=4] [--d=256] [--iters=30] [--out=$OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."),
                os.path.dirname(os.path.abspath(__file__))]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import timing  # noqa: E402  (bench/timing.py)
from kernels.gmm import triton_fan_in as fi  # noqa: E402
from kernels import triton_launch  # noqa: E402

TRITON_TARGETS = ("triton_kernel_call", triton_launch.FFI_TARGET)


def hlo_launch_stats(text: str) -> dict:
  """Counts in an optimized HLO module's text: Triton custom calls in all, those inside computations
  named command_buffer*, and the calls of such computations."""
  per_computation, name = {}, None
  for line in text.splitlines():
    m = re.match(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
    if m and "=" not in line.split("{")[0]:
      name = m.group(1)
      continue
    for target in TRITON_TARGETS:
      if f'custom_call_target="{target}"' in line:
        per_computation[name] = per_computation.get(name, 0) + 1
  total = sum(per_computation.values())
  in_graphs = sum(v for k, v in per_computation.items() if k and k.startswith("command_buffer"))
  graph_calls = len(re.findall(r"to_apply=%?command_buffer", text)) + len(
      re.findall(r"calls=%?command_buffer", text))
  return dict(triton_calls=total, triton_calls_in_command_buffers=in_graphs,
              command_buffer_calls=graph_calls)


def chain(rows, index, weights, layers: int):
  """layers x (an XLA fusion, then a fan-in launch that reads its output)."""
  n, k = index.shape
  x = rows
  acc = jnp.zeros((n, rows.shape[1]), jnp.float32)
  for i in range(layers):
    x = (x * (1.0 + 1e-3 * i)).astype(rows.dtype)
    y = fi.gather_sum(x, index, weights)
    acc = acc + y.astype(jnp.float32)
  return acc


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--layers", type=int, default=48)
  ap.add_argument("--tokens", type=int, default=2048)
  ap.add_argument("--k", type=int, default=4)
  ap.add_argument("--d", type=int, default=256)
  ap.add_argument("--iters", type=int, default=30)
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  args = ap.parse_args()
  rng = np.random.default_rng(7)
  n, k, d = args.tokens, args.k, args.d
  rows = jnp.asarray(rng.standard_normal((n * k, d)), jnp.bfloat16)
  index = jnp.asarray(rng.permutation(n * k).reshape(n, k), jnp.int32)
  weights = jnp.asarray(rng.uniform(0.1, 1.0, (n, k)), jnp.bfloat16)
  results, outs = {}, {}
  for route in triton_launch.ROUTES:
    triton_launch.set_route(route)
    try:
      fn = jax.jit(lambda r, i, w: chain(r, i, w, args.layers))
      text = fn.lower(rows, index, weights).compile().as_text()
      outs[route] = np.asarray(fn(rows, index, weights))
      results[route] = dict(hlo_launch_stats(text), ms=timing.wall_ms(fn, rows, index, weights,
                                                                        iters=args.iters))
    finally:
      triton_launch.set_route(None)
  same = all(np.array_equal(outs["custom_call"], o) for o in outs.values())
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "triton_launch.json"), "w") as f:
    json.dump(dict(args=vars(args), results=results, bit_identical=same), f, indent=1)
  print(f"chain of {args.layers} x (XLA fusion + fan-in {n}x{k}x{d}); routes bit-identical: {same}")
  print("route        ms/call  us/layer  triton calls  in command buffers  command-buffer calls")
  for route, r in results.items():
    print(f"{route:11s} {r['ms']:8.3f} {1e3 * r['ms'] / args.layers:9.1f} {r['triton_calls']:13d} "
          f"{r['triton_calls_in_command_buffers']:19d} {r['command_buffer_calls']:21d}")
  if not same:
    sys.exit("the two routes disagree")


if __name__ == "__main__":
  main()
