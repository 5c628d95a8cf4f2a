"""Grouped expert matmul benchmark at the UMoE shapes (T = 32*1024 tokens), one GPU.

  python bench/gmm.py [--sweep] [--backends triton,mosaic] [--no-torch] [--out DIR]
  python bench/gmm.py --backends=megablox --no-torch --sweep --sweep-backends=megablox   # a TPU
  python bench/gmm.py --precision=bf16,fp8 --shapes=base-up,base-down --no-torch --no-dispatch

Prints, per shape, TFLOP/s of: a dense matmul of equal FLOPs, our kernels fwd and fwd+bwd (fwd + input
grad + weight grad = 3x the forward FLOPs), JAX's shipped Mosaic GPU ragged_dot fwd, jax.lax.ragged_dot
fwd (may run out of memory), torch._grouped_mm fwd and fwd+bwd; then the token-dispatch cost against
the expert matmuls; a short table last.
--precision=bf16,fp8 (default bf16) adds, per shape and backend with FP8 forms, umoe_jax.ops.fp8_gmm
forward and forward + backward with the operands' quantisation inside (as training runs them), the
activations' quantisation alone and the forward's error (bench/gmm_fp8.py); their rows carry
"precision": "fp8" in overrides, and the table ends with each fp8 figure over the bf16 one.
--shapes picks shapes by name (default all five). Full results go to $OUT (or --out) as gmm_results.json; each
backend's fwd and fwd+bwd TFLOP/s per shape also go as rows to --results (bench/results.py: default
$OUT/rows.jsonl when $OUT is set, else bench/results/<device>.jsonl; none: no rows).
--sweep times every candidate tile config of kernels/gmm/tuning.py's CANDIDATES and reports the best per
(backend, op, shape): the rows to paste into tuning.TABLE. --sweep-gathered does the same for the
calls as fused_dispatch makes them and also writes the rows to $OUT/gmm_tiles.json, which
bench/train_step.py --gmm_tiles loads (the step timed with them before they go into the table).
--sweep-fp8 times the FP8 kernels' candidate tiles of the triton and mosaic backends among --backends
(forward and input gradient, on operands quantised beforehand; bench/gmm_fp8.py) and prints the
rows for triton_fp8_gmm.TABLE and the fastest mosaic_fp8_gmm tiles.
Group sizes: Dirichlet(alpha=4) as in shared/anchors/grouped_matmul_anchors.py. Inputs are random bf16.
JAX timings: CUPTI kernel time (jax.experimental.mosaic.gpu.profiler.measure), median of 10 runs;
torch: CUDA events, median of 20 (as the anchors). The sweeps are bench/gmm_sweep.py, the dispatch
part bench/gmm_dispatch.py, what they share (shapes, inputs, the timer) bench/gmm_common.py.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import traceback

import numpy as np

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."),
                os.path.dirname(os.path.abspath(__file__))]

from gmm_common import ANCHORS, SHAPES, group_sizes, jax_ms, log, make_inputs  # noqa: E402
from gmm_dispatch import dispatch_part  # noqa: E402
import gmm_fp8  # noqa: E402  (bench/gmm_fp8.py)
from gmm_sweep import MAX_CANDS, sweep, sweep_gathered  # noqa: E402
import results as results_lib  # noqa: E402  (bench/results.py)

def torch_part(shapes):
  import torch
  rows = {}
  for name, M, K, N, E in shapes:
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(E, K, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    offs = torch.cumsum(torch.tensor(group_sizes(M, E), device="cuda"), 0).to(torch.int32)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)

    def timeit(f, n=20):
      f(); f(); torch.cuda.synchronize()
      st = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
      en = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
      for i in range(n):
        st[i].record(); f(); en[i].record()
      torch.cuda.synchronize()
      return float(np.median([s.elapsed_time(e) for s, e in zip(st, en)])) / 1e3

    fl = 2.0 * M * K * N
    with torch.no_grad():
      t_f = timeit(lambda: torch._grouped_mm(x, w, offs=offs))
    try:
      def fb():
        y = torch._grouped_mm(x, w, offs=offs)
        torch.autograd.backward(y, dy)
      fb_tf = 3 * fl / timeit(fb) / 1e12
    except Exception as e:  # noqa: BLE001
      fb_tf = float("nan")
      log("torch bwd failed:", repr(e)[:200])
    rows[name] = dict(torch_f=fl / t_f / 1e12, torch_fb=fb_tf)
    log(f"  torch {name}: fwd {rows[name]['torch_f']:.0f}  fwd+bwd {fb_tf:.0f}")
    del x, w, dy
    torch.cuda.empty_cache()
  return rows


def quick_check(be, x, w, dy, gs, cfgs=None):
  """Relative error of fwd/dgrad/wgrad on a slice of the real inputs vs float32 XLA ragged_dot."""
  import jax.numpy as jnp
  from umoe_jax.ops import ragged
  m = 8192
  g = gs.shape[0]
  gs_s = jnp.asarray(np.diff(np.minimum(np.concatenate([[0], np.cumsum(np.asarray(gs))]), m - 100)),
                     jnp.int32)  # last 100 rows padding
  xs, dys = x[:m], dy[:m]
  f32 = lambda a: a.astype(jnp.float32)
  errs = {}
  cfgs = cfgs or {}
  out = be.gmm(xs, w, gs_s, transpose_rhs=False, out_dtype=jnp.bfloat16, **cfgs.get("gmm", {}))
  ref = ragged.xla_gmm(f32(xs), f32(w), gs_s, transpose_rhs=False, out_dtype=jnp.float32)
  errs["fwd"] = float(jnp.linalg.norm(f32(out) - ref) / jnp.linalg.norm(ref))
  out = be.gmm(dys, w, gs_s, transpose_rhs=True, out_dtype=jnp.bfloat16, **cfgs.get("gmm_t", {}))
  ref = ragged.xla_gmm(f32(dys), f32(w), gs_s, transpose_rhs=True, out_dtype=jnp.float32)
  errs["dgrad"] = float(jnp.linalg.norm(f32(out) - ref) / jnp.linalg.norm(ref))
  out = be.tgmm(xs, dys, gs_s, num_groups=g, out_dtype=jnp.float32, **cfgs.get("tgmm", {}))
  ref = ragged.xla_tgmm(f32(xs), f32(dys), gs_s, num_groups=g, out_dtype=jnp.float32)
  errs["wgrad"] = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
  return errs


def measurements(name: str, row: dict, backends, device: str = "NVIDIA H200") -> list[dict]:
  """The results rows of one shape's timings `row`: per backend timed, fwd and fwd+bwd TFLOP/s
  (dgrad and wgrad beside the latter), each against torch._grouped_mm measured in this process, or
  shared/anchors' figure (an H200's) where torch did not run and `device` is an H200."""
  a = ANCHORS.get(name, {}) if "H200" in device else {}
  def torch_anchor(key, shared, what):
    if row.get(key) == row.get(key) and row.get(key):  # (nan: torch's backward failed)
      return results_lib.anchor(f"torch._grouped_mm {what}, same process", row[key], "TFLOP/s",
                                "bench/gmm.py torch_part")
    if shared in a:
      return results_lib.anchor(f"torch._grouped_mm {what}, one H200", a[shared], "TFLOP/s",
                                "shared/anchors/grouped_matmul_anchors.py")
    return None
  out = []
  for b in backends:
    fwd, fb = row.get(f"{b}_fwd"), row.get(f"{b}_fwd_bwd")
    if fwd is None or fwd != fwd:
      continue
    err = row.get(f"{b}_err")
    out.append(dict(config=f"gmm:{name}", metric="fwd_tflops", value=fwd, overrides={"backend": b},
                    anchor=torch_anchor("torch_f", "torch_f", "fwd"), extra={"rel_err": err}))
    out.append(dict(config=f"gmm:{name}", metric="fwd_bwd_tflops", value=fb, overrides={"backend": b},
                    anchor=torch_anchor("torch_fb", "torch_fb", "fwd+bwd"),
                    extra={"dgrad_tflops": row.get(f"{b}_dgrad"), "wgrad_tflops": row.get(f"{b}_wgrad"),
                           "rel_err": err}))
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--sweep", action="store_true")
  ap.add_argument("--sweep-backends", default="triton")
  ap.add_argument("--sweep-fp8", action="store_true",
                  help="time the FP8 kernels' candidate tiles (triton: kernels/gmm/triton_fp8_gmm.py "
                       "candidates, printing the TABLE rows of the fastest; mosaic: "
                       "kernels/gmm/mosaic_fp8_gmm.py candidates) of --backends at --shapes")
  ap.add_argument("--sweep-gathered", action="store_true", help="tiles of the fused-dispatch calls")
  ap.add_argument("--gathered-configs", default="",
                  help="with --sweep-gathered: base,large,base_att (default all)")
  ap.add_argument("--gathered-ops", default="",
                  help="with --sweep-gathered: ';'-separated call names (default all), e.g. "
                       "'tgmm+gather (down);tgmm+gather+scale (down)'")
  ap.add_argument("--sweep-ops",
                  default="triton:gmm,gmm_t,tgmm;mosaic:gmm,gmm_t,tgmm;megablox:gmm,gmm_t,tgmm")
  ap.add_argument("--backends", default="triton,mosaic")
  ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES),
                  help="comma list of " + ", ".join(s[0] for s in SHAPES))
  ap.add_argument("--precision", default="bf16",
                  help="comma list of bf16, fp8: the backends' bf16 kernels and / or fp8_gmm")
  ap.add_argument("--no-torch", action="store_true")
  ap.add_argument("--no-baselines", action="store_true")
  ap.add_argument("--no-dispatch", action="store_true")
  ap.add_argument("--max-cands", type=int, default=MAX_CANDS, help="candidates per (op, shape)")
  ap.add_argument("--pick-xla-epilogue", action="store_true",
                  help="--sweep-gathered: a tile with the epilogue in XLA may be written as the best row "
                       "(by default it is timed, not picked: it loses in the training step)")
  ap.add_argument("--cands", default="",
                  help="--sweep-gathered: comma list of candidate positions to time instead of the "
                       "first --max-cands (the tabled tile, position 0, always comes first)")
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  results_lib.add_flag(ap)
  args = ap.parse_args()
  unknown = [n for n in args.shapes.split(",") if n not in {s[0] for s in SHAPES}]
  if unknown:
    ap.error(f"--shapes: unknown {', '.join(unknown)}; valid: {', '.join(s[0] for s in SHAPES)}")
  try:
    precisions = gmm_fp8.parse_precisions(args.precision)
  except ValueError as e:
    ap.error(str(e))
  shapes = [s for s in SHAPES if s[0] in args.shapes.split(",")]
  results = {"shapes": {}, "argv": sys.argv}

  torch_rows = {}
  if not args.no_torch:
    try:
      torch_rows = torch_part(shapes)
    except Exception as e:  # noqa: BLE001
      log("torch part skipped:", repr(e)[:200])
    import gc
    gc.collect()
    try:
      import torch
      torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
      pass

  import jax
  import jax.numpy as jnp
  from umoe_jax.ops import gmm as G
  G.register_builtin_kernels()
  results["device"] = str(jax.devices()[0].device_kind)
  results["jax"] = jax.__version__
  backends = [b for b in args.backends.split(",") if b in G.BACKENDS and G.BACKENDS.get(b).available()]
  fp8_backends = [b for b in backends if G.BACKENDS.get(b).fp8_gmm is not None] if "fp8" in precisions else []
  log("backends:", backends, "device:", results["device"], "precisions:", precisions,
      "fp8 backends:", fp8_backends)
  if "fp8" in precisions and not fp8_backends:
    from umoe_jax.ops.fp8_gmm import fp8_backends as with_fp8
    log(f"  fp8: none of {backends} has FP8 forms; the ones with: {', '.join(with_fp8())}")

  sweep_ops = {kv.split(":")[0]: tuple(kv.split(":")[1].split(",")) for kv in args.sweep_ops.split(";")}
  if args.sweep:
    for b in args.sweep_backends.split(","):
      if b in backends:
        try:
          results.setdefault("best", {})[b] = {str(k): [v[0], str(v[1])]
                                               for k, v in sweep(b, shapes, results, sweep_ops.get(b, ()),
                                                                   args.max_cands).items()}
        except Exception:  # noqa: BLE001
          log(traceback.format_exc())
    _save(args.out, results)
  if args.sweep_fp8:
    swept = [b for b in gmm_fp8.SWEEP_BACKENDS
             if b in backends and G.BACKENDS.get(b).fp8_gmm is not None]
    if not swept:
      log(f"  --sweep-fp8: none of {', '.join(gmm_fp8.SWEEP_BACKENDS)} has its FP8 kernel here")
    for b in swept:
      best = gmm_fp8.sweep(shapes, jax_ms, args.results, args.max_cands, backend=b)
      results.setdefault("fp8_best", {})[b] = {str(k): [v[0], str(v[1])] for k, v in best.items()}
      if b == "triton":
        log("\nFP8 tiles, fastest per (op, kc, no) (kernels/gmm/triton_fp8_gmm.py TABLE):")
        for line in gmm_fp8.table_lines(best):
          log(line)
      else:
        log(f"\n{b} FP8 tiles, fastest per (op, kc, no):")
        for key, (tflops, tile) in sorted(best.items()):
          log(f"  {key}: {tile}  # {tflops:.0f} TFLOP/s")
    _save(args.out, results)
  if args.sweep_gathered and "triton" in backends:
    os.makedirs(args.out, exist_ok=True)
    sweep_gathered(results, args.max_cands,
                   args.gathered_configs.split(",") if args.gathered_configs else None,
                   args.gathered_ops.split(";") if args.gathered_ops else None,
                   out_path=os.path.join(args.out, "gmm_tiles.json"),  # train_step.py --gmm_tiles
                   cand_indices=[int(i) for i in args.cands.split(",")] if args.cands else None,
                   pick_xla_epilogue=args.pick_xla_epilogue)
    _save(args.out, results)

  for name, M, K, N, E in shapes:
    fl = 2.0 * M * K * N
    tf = lambda ms: fl / (ms / 1e3) / 1e12
    row = dict(torch_rows.get(name, {}))
    x, w, dy, gs = make_inputs(M, K, N, E)
    if not args.no_baselines:
      row["dense"] = tf(jax_ms(jax.jit(lambda a, b: a @ b), x, w[0]))
      try:
        row["lax_ragged_dot"] = tf(jax_ms(jax.jit(lambda a, b, g: jax.lax.ragged_dot(a, b, g)), x, w, gs))
      except Exception as e:  # noqa: BLE001
        row["lax_ragged_dot"] = float("nan")
        log(f"  lax.ragged_dot {name}: {type(e).__name__} {str(e)[:100]}")
      try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
        best = 0.0
        for bn in (128, 192, 256):
          if N % bn:
            continue
          f = jax.jit(functools.partial(ragged_dot_mgpu.ragged_dot, block_m=128, block_n=bn, block_k=64,
                                        max_concurrent_steps=4, grid_block_n=1))
          try:
            best = max(best, tf(jax_ms(lambda a, b, g: f(a, b, group_sizes=g), x, w, gs)))
          except Exception as e:  # noqa: BLE001
            log(f"  mgpu ragged_dot bn={bn}: {repr(e)[:120]}")
        row["jax_mgpu_fwd"] = best
      except Exception as e:  # noqa: BLE001
        log("  mgpu ragged_dot failed:", repr(e)[:200])
    for b in backends if "bf16" in precisions else []:
      be = G.BACKENDS.get(b)
      try:
        errs = quick_check(be, x, w, dy, gs)
        row[f"{b}_err"] = errs
        bad = [k for k, v in errs.items() if not v < 1e-2]
        if bad:
          log(f"  {b} {name}: WRONG {errs}")
          row[f"{b}_fwd"] = row[f"{b}_fwd_bwd"] = float("nan")
          continue
        f = jax.jit(lambda a, bb, g, b=b: G.gmm(a, bb, g, backend=b))
        row[f"{b}_fwd"] = tf(jax_ms(f, x, w, gs))
        def fb(a, bb, g, d, b=b):  # returns y too, or XLA drops the forward
          y, pull = jax.vjp(lambda a_, b_: G.gmm(a_, b_, g, backend=b), a, bb)
          return y, pull(d)
        fb = jax.jit(fb)
        row[f"{b}_fwd_bwd"] = 3 * tf(jax_ms(fb, x, w, gs, dy))
        # Parts of the backward, for the notes.
        fd = jax.jit(lambda d, bb, g, b=b: be.gmm(d, bb, g, transpose_rhs=True, out_dtype=jnp.bfloat16))
        row[f"{b}_dgrad"] = tf(jax_ms(fd, dy, w, gs))
        fw = jax.jit(lambda a, d, g, b=b: be.tgmm(a, d, g, num_groups=E, out_dtype=jnp.bfloat16))
        row[f"{b}_wgrad"] = tf(jax_ms(fw, x, dy, gs))
        log(f"  {b} {name}: fwd {row[f'{b}_fwd']:.0f} fwd+bwd {row[f'{b}_fwd_bwd']:.0f} "
            f"(dgrad {row[f'{b}_dgrad']:.0f}, wgrad {row[f'{b}_wgrad']:.0f}) err {errs}")
      except Exception:  # noqa: BLE001
        log(f"  {b} {name} FAILED:\n{traceback.format_exc()[-1500:]}")
    for b in fp8_backends:
      try:
        t = gmm_fp8.time_fp8(b, x, w, dy, gs, jax_ms)
        t.update(fwd_tflops=tf(t["fwd_ms"]), fwd_bwd_tflops=3 * tf(t["fwd_bwd_ms"]))
        if not t["rel_err"] < gmm_fp8.MAX_REL_ERR:
          log(f"  {b} fp8 {name}: WRONG, forward error {t['rel_err']:.3g} (FP8: < {gmm_fp8.MAX_REL_ERR})")
          continue
        row[f"{b}_fp8"] = t
        log(f"  {b} fp8 {name}: fwd {t['fwd_tflops']:.0f} fwd+bwd {t['fwd_bwd_tflops']:.0f} "
            f"(quantise x {t['quantize_ms']:.3f} ms) err {t['rel_err']:.4f}")
      except Exception:  # noqa: BLE001
        log(f"  {b} fp8 {name} FAILED:\n{traceback.format_exc()[-1500:]}")
    results["shapes"][name] = row
    for m in measurements(name, row, backends, results["device"]):
      results_lib.record(args.results, **m)
    gmm_fp8.record_shape(args.results, name, fl, row, fp8_backends)
    del x, w, dy
    _save(args.out, results)

  if not args.no_dispatch and backends and "bf16" in precisions:
    try:
      dispatch_part(backends[0], results)
    except Exception:  # noqa: BLE001
      log("dispatch part failed:", traceback.format_exc()[-1500:])
    _save(args.out, results)

  # Short table last.
  log("\nTFLOP/s (anchor in brackets); fb = fwd+bwd (3x fwd FLOPs)")
  hdr = f"{'shape':11s} {'dense':>9s} {'torch f':>9s} {'torch fb':>9s} {'mgpu f':>9s} {'lax.rd':>6s}"
  for b in backends:
    hdr += f" {b[:6] + ' f':>8s} {b[:6] + ' fb':>9s}"
  log(hdr)
  for name, *_ in shapes:
    r, a = results["shapes"].get(name, {}), ANCHORS[name]
    g = lambda k: r.get(k, float("nan"))
    line = (f"{name:11s} {g('dense'):4.0f}[{a['dense']}] {g('torch_f'):4.0f}[{a['torch_f']}] "
            f"{g('torch_fb'):4.0f}[{a['torch_fb']}] {g('jax_mgpu_fwd'):4.0f}[{a['mgpu']}] "
            f"{g('lax_ragged_dot'):6.0f}")
    for b in backends:
      line += f" {g(b + '_fwd'):8.0f} {g(b + '_fwd_bwd'):9.0f}"
    log(line)
  if fp8_backends:
    log("\nfp8_gmm TFLOP/s (same FLOPs as bf16; quantisation inside) and fp8 / bf16; "
        "quant ms = the activations' quantisation alone")
    for line in gmm_fp8.ratio_lines(shapes, results, fp8_backends):
      log(line)
  for k, v in results.get("dispatch", {}).items():
    log(f"dispatch {k}: fwd {100 * v['dispatch_frac_fwd']:.0f}% / fwd+bwd {100 * v['dispatch_frac_fwd_bwd']:.0f}% "
        f"of the expert matmuls; fused: {100 * v['fused_dispatch_frac_fwd']:.0f}% / "
        f"{100 * v['fused_dispatch_frac_fwd_bwd']:.0f}%")


def _save(out_dir, results):
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "gmm_results.json"), "w") as f:
    json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
  main()
