"""The FP8 part of bench/gmm.py (--precision=...,fp8): per shape and gmm backend with FP8 forms,
`umoe_jax.ops.fp8_gmm.fp8_gmm` forward and forward + backward as training runs them (the
operands' quantisation included), the activations' quantisation alone, and the forward's error
against a float32 product; the results rows (overrides {"backend", "precision": "fp8"}) and the
fp8 / bf16 ratios of the short table."""
from __future__ import annotations

import functools

import results as results_lib  # noqa: E402  (bench/results.py)

PRECISIONS = ("bf16", "fp8")
FP8 = {"precision": "fp8"}
BEFOREHAND = {"operands": "quantised beforehand"}
# metric -> the key of the same backend's bf16 figure in bench/gmm.py's row (row[f"{backend}_{key}"])
BF16_KEYS = {"fwd_tflops": "fwd", "fwd_bwd_tflops": "fwd_bwd"}
# e4m3 keeps 3 mantissa bits: a product's normwise error is a few percent; a wrong layout or scale
# misses by far more.
MAX_REL_ERR = 0.1


def comma_list(flag: str, text: str, valid) -> list[str]:
  """'a,b' -> ['a', 'b'], each one of `valid`; ValueError naming the flag's value otherwise."""
  out = [p for p in text.split(",") if p]
  if not out or any(p not in valid for p in out):
    raise ValueError(f"{flag}={text!r}: a comma list of {', '.join(valid)}")
  return out


def parse_precisions(text: str) -> list[str]:
  """'bf16,fp8' -> ['bf16', 'fp8']; ValueError naming a value that is not one."""
  return comma_list("--precision", text, PRECISIONS)


def fp8_forward_error(backend: str, x, w, gs) -> float:
  """Normwise relative error of fp8_gmm's forward against the platform's best bf16 gmm of the same
  operands (its bf16 rounding, ~1e-3 normwise, is far below FP8's few percent). Not a float32
  output: the bf16 Triton kernel's tuned large tiles with a float32 epilogue ask more shared memory
  than an H100 has, and XLA's float32 ragged_dot on a GPU expands to a dense product (160 GiB)."""
  import jax.numpy as jnp
  from umoe_jax.ops.fp8_gmm import fp8_gmm
  from umoe_jax.ops.gmm import gmm
  out = fp8_gmm(x, w, gs, backend=backend).astype(jnp.float32)
  ref = gmm(x, w, gs).astype(jnp.float32)
  return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))


def time_fp8(backend: str, x, w, dy, gs, timer) -> dict:
  """{fwd_ms, fwd_bwd_ms, quantize_ms, kernel_fwd_ms, rel_err} of one shape; `timer(f, *args)` ->
  ms. kernel_fwd_ms times the backend's raw FP8 forward alone on operands quantised beforehand."""
  import jax
  from umoe_jax.ops import fp8
  from umoe_jax.ops.fp8_gmm import fp8_gmm, quantize
  from umoe_jax.ops.gmm_backends import BACKENDS
  fwd = jax.jit(lambda a, b, g: fp8_gmm(a, b, g, backend=backend))

  def fb(a, b, g, d):  # returns y too, or XLA drops the forward
    y, pull = jax.vjp(lambda a_, b_: fp8_gmm(a_, b_, g, backend=backend), a, b)
    return y, pull(d)
  raw = BACKENDS.get(backend)
  kernel_fwd = jax.jit(lambda q, s, wq_, ws, g: raw.fp8_gmm(q, s, wq_, ws, g, transpose_rhs=False,
                                                             out_dtype=x.dtype))
  return dict(rel_err=fp8_forward_error(backend, x, w, gs),
              fwd_ms=timer(fwd, x, w, gs), fwd_bwd_ms=timer(jax.jit(fb), x, w, gs, dy),
              quantize_ms=timer(jax.jit(lambda a: quantize(backend, a)), x),
              kernel_fwd_ms=timer(kernel_fwd, *fp8.quantize_tiles(x, axis=1), *fp8.quantize_blocks(w),
                                  gs))


def measurements(name: str, flops: float, backend: str, t: dict) -> list[dict]:
  """The results rows of one shape's FP8 timings `t` (time_fp8's) for `backend`; forward FLOPs
  `flops` (2 M K N), fwd + bwd 3x, TFLOP/s counted as for bf16 so the rows compare."""
  over = {"backend": backend, **FP8}
  tflops = lambda ms, mult=1: mult * flops / (ms / 1e3) / 1e12
  rows = [
      dict(config=f"gmm:{name}", metric="fwd_tflops", value=tflops(t["fwd_ms"]), overrides=over,
           anchor=None, extra={"rel_err": t["rel_err"], "ms": t["fwd_ms"],
                               "quantize_ms": t["quantize_ms"]}),
      dict(config=f"gmm:{name}", metric="fwd_bwd_tflops", value=tflops(t["fwd_bwd_ms"], 3),
           overrides=over, anchor=None, extra={"ms": t["fwd_bwd_ms"], "quantize_ms": t["quantize_ms"]}),
      dict(config=f"gmm:{name}", metric="ms", value=t["quantize_ms"],
           overrides={"op": "quantize_tiles (activations)", "backend": backend, **FP8}, anchor=None,
           extra={}),
  ]
  if t.get("kernel_fwd_ms"):  # the kernel alone, on operands quantised beforehand
    rows.append(dict(config=f"gmm:{name}", metric="fwd_tflops", value=tflops(t["kernel_fwd_ms"]),
                     overrides={**over, **BEFOREHAND}, anchor=None, extra={"ms": t["kernel_fwd_ms"]}))
  return rows


def record_shape(results_path, name: str, flops: float, row: dict, backends) -> None:
  """Rows of every backend in `backends` that has FP8 timings in `row` (row[f"{b}_fp8"]), each
  TFLOP/s figure anchored on the same backend's bf16 one of this run (row[f"{b}_fwd"], ...)."""
  for b in backends:
    t = row.get(f"{b}_fp8")
    if not t:
      continue
    for m in measurements(name, flops, b, t):
      key = BF16_KEYS.get(m["metric"])
      bf16 = row.get(f"{b}_{key}") if key else None
      if bf16 == bf16 and bf16:  # (nan: its bf16 run failed)
        m["anchor"] = results_lib.anchor(f"bf16 gmm ({b}), same process", bf16, "TFLOP/s",
                                         "bench/gmm.py")
      results_lib.record(results_path, **m)


def ratio_lines(shapes, results: dict, backends) -> list[str]:
  """The short table's FP8 lines: per shape and backend, fp8 TFLOP/s and fp8 / bf16 (fwd, fwd+bwd)."""
  lines = [f"{'shape':11s} {'backend':8s} {'fp8 f':>7s} {'x bf16':>7s} {'fp8 fb':>7s} {'x bf16':>7s} "
           f"{'quant ms':>8s} {'err':>7s}"]
  nan = float("nan")
  for name, *_ in shapes:
    r = results["shapes"].get(name, {})
    for b in backends:
      t = r.get(f"{b}_fp8")
      if not t:
        continue
      f, fb = t.get("fwd_tflops", nan), t.get("fwd_bwd_tflops", nan)
      ratio = lambda v, k: v / r[k] if r.get(k) else nan
      lines.append(f"{name:11s} {b:8s} {f:7.0f} {ratio(f, b + '_fwd'):7.2f} {fb:7.0f} "
                   f"{ratio(fb, b + '_fwd_bwd'):7.2f} {t['quantize_ms']:8.3f} {t['rel_err']:7.4f}")
  return lines


SWEEP_METRICS = {"gmm": "fwd_tflops", "gmm_t": "dgrad_tflops"}
SWEEP_BACKENDS = ("triton", "mosaic")   # the gmm backends with FP8 kernels of several tiles


def _fp8_kernel(backend: str):
  """(candidates(op, kc, no) -> tiles, the tabled one first; call(*operands, transpose, tile);
  tile_text(tile)) of a backend's FP8 kernel."""
  import jax.numpy as jnp
  if backend == "triton":
    from kernels.gmm import triton_fp8_gmm as k8
    return (lambda op, kc, no: k8.candidates(op, kc, no),
            lambda *a, transpose, tile: k8.triton_fp8_gmm(*a, transpose_rhs=transpose,
                                                          out_dtype=jnp.bfloat16, config=tile),
            _tile_text)
  if backend == "mosaic":
    from kernels.gmm import mosaic_fp8_gmm as mf
    return (lambda op, kc, no: [t for t in mf.candidates() if mf.supported(kc, no, t)],
            lambda *a, transpose, tile: mf.mosaic_fp8_gmm(*a, transpose_rhs=transpose,
                                                          out_dtype=jnp.bfloat16, tile=tile),
            lambda t: f"{t.bm}x{t.bn} s{t.stages} c{t.ctas_per_sm}{'' if t.overlap else ' serial'}")
  raise ValueError(f"--sweep-fp8: no FP8 tile sweep for backend {backend!r} (one of {SWEEP_BACKENDS})")


def sweep(shapes, timer, results_path=None, max_cands: int = 0, backend: str = "triton") -> dict:
  """Times a backend's FP8 kernel at its candidate tiles (`_fp8_kernel`: triton_fp8_gmm.candidates,
  mosaic_fp8_gmm.candidates) at each shape on operands quantised beforehand: the forward (gmm) and
  the input gradient (gmm_t: dout @ w[g].T). Each tile's output is checked against the tabled
  tile's (the same chunks in the same order: equal up to the tensor cores' rounding inside a chunk).
  Returns {(op, kc, no): (TFLOP/s, tile)} of the fastest tiles and records each one's row (TFLOP/s,
  the tabled tile's figure as its anchor)."""
  import jax
  import jax.numpy as jnp
  from gmm_common import log, make_inputs
  from umoe_jax.ops import fp8
  candidates, call, text = _fp8_kernel(backend)
  best = {}
  for name, M, K, N, E in shapes:
    x, w, dy, gs = make_inputs(M, K, N, E)
    flops = 2.0 * M * K * N
    xq, dq, wq = fp8.quantize_tiles(x, axis=1), fp8.quantize_tiles(dy, axis=1), fp8.quantize_blocks(w)
    calls = {  # op -> (kc, no, transposed, its operands)
        "gmm": (K, N, False, (*xq, *wq, gs)),
        "gmm_t": (N, K, True, (*dq, *wq, gs)),
    }
    for op, (kc, no, transpose, operands) in calls.items():
      cands = candidates(op, kc, no)[:max_cands or None]
      ref, timed = None, []
      for i, tile in enumerate(cands):
        try:
          f = jax.jit(functools.partial(call, transpose=transpose, tile=tile))
          out = f(*operands).astype(jnp.float32)
          if ref is None:
            ref = out
          err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
          if not err < 1e-3:
            log(f"  {backend} fp8 sweep {name} {op} {text(tile)}: WRONG (differs from the tabled "
                f"tile by {err:.3g})")
            continue
          timed.append((flops / (timer(f, *operands) / 1e3) / 1e12, tile))
          log(f"  {backend} fp8 sweep {name} {op} [{i}] {text(tile)}: {timed[-1][0]:.0f} TFLOP/s")
        except Exception as e:  # noqa: BLE001  (a tile that does not compile: the next)
          log(f"  {backend} fp8 sweep {name} {op} {text(tile)}: FAILED {type(e).__name__}: {str(e)[:200]}")
      if not timed:
        continue
      top = max(timed, key=lambda t: t[0])
      tabled = timed[0][0] if timed[0][1] == cands[0] else None
      best[(op, kc, no)] = top
      if results_path is not None:
        results_lib.record(
            results_path, config=f"gmm:{name}", metric=SWEEP_METRICS[op], value=top[0],
            overrides={"backend": backend, **FP8, "operands": "quantised beforehand",
                       "tile": text(top[1])},
            anchor=results_lib.anchor(f"the default FP8 tile {text(cands[0])}, same process",
                                      tabled, "TFLOP/s", "bench/gmm.py --sweep-fp8") if tabled else None,
            extra={"candidates": len(cands)})
  return best


def _tile_text(cfg) -> str:
  return f"{cfg.bm}x{cfg.bn} w{cfg.num_warps} s{cfg.num_stages}"


def table_lines(best: dict) -> list[str]:
  """The TABLE rows of kernels/gmm/triton_fp8_gmm.py for `sweep`'s fastest tiles."""
  return [f'    ("{op}", {kc}, {no}): tuning.TileConfig({c.bm}, {c.bn}, {c.bk}, {c.num_warps}, '
          f'{c.num_stages}),  # {tf:.0f} TFLOP/s' for (op, kc, no), (tf, c) in sorted(best.items())]
