"""The pre-mixing attention core alone: the XLA, cuDNN and Triton cores, and the Triton tile sweep.

Shapes (one shared key head; pre-mixing's values = the hidden states): base B=32, T=1024, H=1+3, dk=192, D=768;
large B=16, T=1024, H=4, dk=512, D=2048; moa (MoA-base's shared key / value head) B=32, T=1024,
H=1+3, dk=192, D=192. For each: the Triton core is checked against the XLA core
(values and the gradients of q, k, x, relative error), then every core is timed forward and
forward+backward (CUPTI kernel time, median of 10; gradients of all three inputs under a
non-constant cotangent). TFLOP/s counts useful causal FLOPs: forward 2 * B*H * T(T+1)/2 * (dk + D),
forward+backward 3x that (no recomputation counted). cuDNN takes head sizes up to 256 only (large:
no cuDNN row).

--sweep=SHAPES times each Triton kernel alone (fwd, dx, dk, dq, the fused dxdk) over candidate tiles
(each first checked against the default tiles' result), keeps the fastest per kernel (the fused
dX + dK pass when it beats dx + dk), writes them to
$OUT/attention_tiles.json (`--attention_tiles` of bench/train_step.py and bench/layer_breakdown.py
loads it) and times the core again with them. The file is rewritten after every kernel with what the
sweep has measured so far (the starting form, its kernels' fastest tiles), so a sweep cut short by
a time limit still leaves tiles to load.

  python3 bench/attention_core.py [--shapes=base,large,moa] [--cores=xla,cudnn,triton] [--sweep=base]
      [--sweep_budget_s=150] [--sweep_kernels=dq_ds,ds,...] [--backwards=auto,recompute,stored_pairs]
      [--delta] [--out DIR]

Every core timed is also recorded as rows (`measurements`: fwd and fwd+bwd ms, against the XLA core of
the same command) to --results (bench/results.py: default $OUT/rows.jsonl when $OUT is set, else
bench/results/<device>.jsonl; none: no rows).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from gmm import jax_ms, log  # noqa: E402
from checks import rel_err  # noqa: E402
from layer_breakdown import time_fwd_bwd  # noqa: E402
import results as results_lib  # noqa: E402  (bench/results.py)

SHAPES = {"base": (32, 1024, 4, 192, 768), "large": (16, 1024, 4, 512, 2048),
          # MoA-base: 1 + 3 query heads over one shared key / value head, values as wide as the
          # keys (where `auto` takes cuDNN, which is faster there than the Triton core)
          "moa": (32, 1024, 4, 192, 192)}

# Candidate tiles per kernel, (bm, bn, bd, warps, stages); the default tiles are tried first. All
# compile for sm_90a without register spills (bench/kernel_resources.py), and each fits the H200's
# 227 KB of shared memory.
CANDIDATES = {
    # Wider D chunks and taller row tiles for UMoE-large's wide heads (dk 512, D 2048: each 256-wide
    # D chunk recomputes the 512-deep scores); D in two chunks of 384, not three of 256 (the scores
    # recomputed twice, not three times); the tabled tile in three stages (216 KB with dk 192 held
    # as 128 + 64).
    "fwd": [(64, 32, 512, 8, 2), (128, 32, 256, 8, 2), (64, 32, 384, 8, 2), (64, 64, 128, 4, 2),
            (64, 32, 256, 8, 3), (32, 32, 512, 4, 2),
            (128, 32, 384, 8, 2), (64, 64, 384, 8, 2), (128, 64, 256, 8, 3)],
    "dx": [],
    "dk": [(32, 32, 128, 4, 2), (32, 32, 256, 4, 2)],
    "dq": [(64, 64, 128, 8, 2), (64, 64, 256, 8, 2), (32, 32, 128, 4, 2), (32, 32, 256, 4, 2)],
    # The fused dX + dK pass (replacing dx and dk when it beats their sum).
    "dxdk": [(64, 64, 256, 8, 2), (32, 64, 256, 8, 2), (64, 32, 256, 4, 2)],
    # The stored-scores form (`FlashTiles.ds`): dQ as the stored dS times the keys (bd unused), dX
    # reading P (wider key tiles a program, 128-wide D chunks), dK from the stored dS (bd unused),
    # and the pass over (row tile, key tile) pairs that stores dS and P (bd = the dO X^T step:
    # deeper pipelines, 4-warp programs two or three an SM, taller row tiles).
    "dq_ds": [(64, 64, 16, 4, 2), (64, 64, 16, 8, 2), (64, 128, 16, 8, 2), (64, 32, 16, 4, 2)],
    "dx_p": [(64, 64, 256, 8, 2), (64, 64, 384, 8, 2),
             (64, 128, 256, 8, 2), (64, 128, 128, 8, 2), (32, 128, 128, 4, 2), (64, 64, 128, 4, 3)],
    "dk_ds": [(64, 64, 16, 4, 2), (64, 32, 16, 4, 2), (128, 64, 16, 8, 2)],
    "ds": [(128, 64, 64, 8, 2), (128, 128, 64, 8, 2), (64, 128, 64, 8, 2), (128, 64, 128, 8, 3),
           (128, 128, 64, 8, 3), (128, 128, 32, 8, 4), (128, 64, 64, 4, 2), (64, 64, 64, 4, 3),
           (256, 64, 32, 8, 2), (128, 64, 64, 8, 4)],
}


def flops(b, t, h, dk, d):
  return 2.0 * b * h * t * (t + 1) / 2 * (dk + d)


def inputs(shape, seed=0):
  b, t, h, dk, d = shape
  kq, kk, kv, kc = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(kq, (b, t, h, dk), jnp.float32).astype(jnp.bfloat16)
  k = jax.random.normal(kk, (b, t, 1, dk), jnp.float32).astype(jnp.bfloat16)
  v = jax.random.normal(kv, (b, t, 1, d), jnp.float32).astype(jnp.bfloat16)
  return q, k, v, jax.random.normal(kc, (b, t, h, d), jnp.float32)


def cores(positions, tiles=None):
  from kernels.attention import triton_attention as ta
  from umoe_jax.model.attention.cores import causal_attention
  return {
      "xla": lambda q, k, v: causal_attention(q, k, v, positions, positions),
      "cudnn": lambda q, k, v: causal_attention(q, k, v, positions, positions, core="cudnn"),
      "triton": lambda q, k, v: ta.premix_attention(q, k[:, :, 0], v[:, :, 0], tiles=tiles),
  }


def check(fn, ref, q, k, v, cot):
  """(value error, max gradient error) of fn against ref, relative."""
  loss = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) * cot), (0, 1, 2)))
  err = rel_err(jax.jit(fn)(q, k, v), jax.jit(ref)(q, k, v))
  g_err = max(rel_err(a, b) for a, b in zip(loss(fn)(q, k, v), loss(ref)(q, k, v)))
  return err, g_err


def time_cores(name, shape, tiles=None, which=("xla", "cudnn", "triton"), backwards=("auto",)):
  """Times each core of `which`; the Triton core once per backward form of `backwards`
  (`attention_tiles.with_backward`: row key "triton" for "auto", "triton_<form>" for the others),
  each first checked against the XLA core."""
  from kernels.attention import tiles as at
  b, t, h, dk, d = shape
  q, k, v, cot = inputs(shape)
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  start = tiles or at.default_tiles(dk, d)
  fns = cores(positions, tiles)
  fl = flops(*shape)
  row = {}
  for core in which:
    if core == "cudnn" and dk > 256:
      continue  # cuDNN has no kernel for this head size (the call would be the XLA form)
    variants = ({(f"triton_{bw}" if bw != "auto" else "triton"):
                 cores(positions, at.with_backward(start, bw, dk))["triton"] for bw in backwards}
                if core == "triton" else {core: fns[core]})
    for key, fn in variants.items():
      if key.startswith("triton"):
        row[f"{key}_err"], row[f"{key}_grad_err"] = err, g_err = check(fn, fns["xla"], q, k, v, cot)
        log(f"  {name}: {key} vs xla: values {err:.2e}, grads {g_err:.2e}")
        if not (err < 1e-2 and g_err < 1e-2):
          log(f"  {name}: {key} disagrees with XLA; not timed")
          continue
      fwd, fb = time_fwd_bwd(fn, q, k, v)
      row[key] = dict(fwd_ms=fwd, fwd_bwd_ms=fb, fwd_tflops=fl / fwd / 1e9,
                      fwd_bwd_tflops=3 * fl / fb / 1e9)
      log(f"  {name} {key:7s} fwd {fwd:7.3f} ms ({fl / fwd / 1e9:5.0f} TFLOP/s)  "
          f"fwd+bwd {fb:7.3f} ms ({3 * fl / fb / 1e9:5.0f} TFLOP/s)")
  return row


# The kernels a backward form needs beside the one named (`--sweep_kernels` runs them on their own
# tiles, so that the form's summed time is known).
NEEDS = {"ds": ("dk_ds", "dq_ds", "dx_p"), "dk_ds": ("ds", "dq_ds", "dx_p"),
         "dq_ds": ("ds", "dk_ds", "dx_p"), "dx_p": ("ds", "dk_ds", "dq_ds"), "dxdk": ()}


def sweep_kernels(names: str) -> tuple[list[str] | None, list[str]]:
  """`--sweep_kernels`: (the kernels named, whose candidates are tried; None: all) and (the other
  kernels their backward forms need (NEEDS), timed on their own tiles only)."""
  asked = [n for n in names.split(",") if n]
  if not asked:
    return None, []
  bad = [n for n in asked if n not in CANDIDATES]
  if bad:
    raise SystemExit(f"--sweep_kernels: unknown {', '.join(bad)}; kernels: {', '.join(CANDIDATES)}")
  return sorted(asked), sorted(set().union(*(NEEDS.get(n, ()) for n in asked)) - set(asked))


# The FlashTiles field each swept kernel's tiles go to when the starting tiles use that kernel.
FIELD_OF = {"fwd": "fwd", "dx": "dx", "dk": "dk", "dq": "dq", "dxdk": "dxdk",
            "dq_ds": "dq_ds", "dx_p": "dx_read", "dk_ds": "dk_ds", "ds": "ds"}


def partial_tiles(base, best: dict):
  """The starting tiles `base` with the fastest tiles found so far (`best`: {kernel: (tiles, ms)})
  for the kernels base's own backward form launches: what a sweep cut short has improved, its
  form unchanged (comparing forms needs every kernel timed)."""
  from kernels.attention import tiles as at
  # (the recomputing passes' dx / dk / dq tiles are updated whatever the form: `with_backward(..,
  # "recompute")` takes them)
  uses = {"fwd", "dx", "dk", "dq"} | ({"dxdk"} if base.dxdk is not None else set())
  if base.ds is not None:
    uses |= {"ds", "dk_ds", "dq_ds", "dx_p"}
  fields = {FIELD_OF[kn]: at.PassTiles(*tiles) for kn, (tiles, _) in best.items() if kn in uses}
  return dataclasses.replace(base, **fields)


def sweep(name, shape, budget_s, kernels=None, timer=None, progress=None, partners=()):
  """Fastest tiles per kernel; every candidate is checked against the default tiles' output.
  `kernels`: those whose candidates are tried (None: all); `partners` and fwd, dx, dk, dq run
  their own tiles only, the others not at all. `timer(kernel, fn, *args)` -> ms (default:
  CUPTI kernel time of fn). `progress(tiles)`, after each kernel: `partial_tiles` so far (a caller
  writes them out, so a sweep cut by a time limit keeps what it measured)."""
  timer = timer or (lambda kernel, fn, *args: jax_ms(fn, *args))
  from kernels.attention import tiles as at
  from kernels.attention import triton_attention as ta
  b, t, h, dk, d = shape
  q, k, v, cot = inputs(shape, seed=1)
  k, v = k[:, :, 0], v[:, :, 0]
  base = at.default_tiles(dk, d)
  out, lse = jax.jit(lambda q, k, v: ta._forward(q, k, v, base))(q, k, v)
  dout = cot.astype(q.dtype)
  delta = jax.jit(ta._delta)(out, dout)
  calls = {
      "fwd": lambda tl: jax.jit(lambda q, k, v: ta._forward(q, k, v, dataclasses.replace(base, fwd=tl))[0]),
      "dx": lambda tl: jax.jit(lambda q, k, v: ta._bwd_dx(q, k, v, dout, lse, tl)),
      "dk": lambda tl: jax.jit(lambda q, k, v: ta._bwd_dk(q, k, v, dout, lse, delta, tl)),
      "dq": lambda tl: jax.jit(lambda q, k, v: ta._bwd_dq(q, k, v, dout, lse, delta, tl)),
      "dxdk": lambda tl: jax.jit(lambda q, k, v: jnp.concatenate(
          [a.reshape(-1) for a in ta._bwd_dxdk(q, k, v, dout, lse, delta, tl)])),
      # (the stored form's largest pass, first, so a budget cut spares it; checked through what
      # the readers make of its stores: its unwritten entries are undefined)
      "ds": lambda tl: (jax.jit(lambda q, k, v: _from_stores(q, k, v, tl)),
                        jax.jit(lambda q, k, v: ta._bwd_ds(q, k, v, dout, lse, delta, tl))),
      "dq_ds": lambda tl: jax.jit(lambda q, k, v: ta._bwd_dq_ds(stored[0], q, k, tl)),
      "dx_p": lambda tl: jax.jit(lambda q, k, v: ta._bwd_dx(q, k, v, dout, lse, tl,
                                                            probs_t=stored[1])),
      "dk_ds": lambda tl: jax.jit(lambda q, k, v: ta._bwd_dk_ds(stored[0], q, k, tl)),
  }

  # The stored forms' own tiles for this head width where the base tiles name none.
  stored_default = dict(zip(("dq_ds", "ds", "dk_ds"), at.stored_tiles(dk)))

  def _from_stores(q, k, v, ds_tiles):  # (dK, dQ, dX) from the ds pass's stores
    ds_t, p_t = ta._bwd_ds(q, k, v, dout, lse, delta, ds_tiles)
    return (ta._bwd_dk_ds(ds_t, q, k, stored_default["dk_ds"]),
            ta._bwd_dq_ds(ds_t, q, k, stored_default["dq_ds"]),
            ta._bwd_dx(q, k, v, dout, lse, base.dx_tiles(reads_p=True), probs_t=p_t))
  # dS^T and P^T as the pair pass stores them, for the dq_ds / dx_p / dk_ds candidates.
  readers = {"dq_ds", "dx_p", "dk_ds"}
  stored = (jax.jit(lambda q, k, v: ta._bwd_ds(q, k, v, dout, lse, delta,
                                               base.ds or stored_default["ds"]))(q, k, v)
            if kernels is None or readers & set(kernels).union(partners) else None)
  same_as = {"dxdk": None, "dq_ds": "dq", "dx_p": "dx", "dk_ds": "dk"}  # checked against
  def own_tiles(kernel):  # the starting tiles of a kernel (None: it has none)
    own = ({"dx_p": base.dx_tiles(reads_p=True)}.get(kernel, getattr(base, kernel, None))
           or stored_default.get(kernel))
    return own if isinstance(own, at.PassTiles) else None
  t0 = time.perf_counter()
  best, results, outputs = {}, {}, {}
  for kernel, make in calls.items():
    own = own_tiles(kernel)
    tried = kernels is None or kernel in kernels
    if not tried and kernel not in ("fwd", "dx", "dk", "dq", *partners):
      continue
    cands = ([] if own is None else [dataclasses.astuple(own)]) + [
        c for c in (CANDIDATES.get(kernel, []) if tried else [])
        if own is None or c != dataclasses.astuple(own)]
    # The fused pass is checked against the separate dx and dk passes' outputs, the stored-dS / P
    # passes against the passes they replace.
    want = (jnp.concatenate([outputs["dx"].reshape(-1), outputs["dk"].reshape(-1)])
            if kernel == "dxdk" and "dx" in outputs and "dk" in outputs
            else tuple(outputs.get(n) for n in ("dk", "dq", "dx"))
            if kernel == "ds" else outputs.get(same_as.get(kernel)))
    if isinstance(want, tuple) and any(w is None for w in want):
      log(f"  {name} {kernel}: a reference pass failed; not swept")
      continue
    results[kernel] = []
    for i, cand in enumerate(cands):
      if i and time.perf_counter() - t0 > budget_s:
        log(f"  {name} sweep: budget spent, {kernel} stops after {i} candidates")
        break
      try:
        f = make(at.PassTiles(*cand))
        f_check, f_time = f if isinstance(f, tuple) else (f, f)
        got = f_check(q, k, v)
        if want is None:
          want = outputs[kernel] = got
        # (per gradient for the ds pass: one error over all three could hide a small one's)
        err = (max(rel_err(g, w) for g, w in zip(got, want)) if isinstance(got, tuple)
               else rel_err(got, want))
        ms = timer(kernel, f_time, q, k, v) if err < 1e-2 else float("nan")
      except Exception as e:  # noqa: BLE001  (out of shared memory / registers: skip the candidate)
        log(f"  {name} {kernel} {cand}: failed {type(e).__name__}: {str(e)[:160]}")
        results[kernel].append(dict(tiles=cand, error=f"{type(e).__name__}: {str(e)[:300]}"))
        continue
      results[kernel].append(dict(tiles=cand, ms=ms, err=err))
      log(f"  {name} {kernel} {cand}: {ms:.3f} ms (vs default tiles {err:.1e})")
      if ms == ms and (kernel not in best or ms < best[kernel][1]):
        best[kernel] = (cand, ms)
    if progress is not None:
      progress(partial_tiles(base, best))
  pick = lambda kn: at.PassTiles(*best[kn][0]) if kn in best else own_tiles(kn)
  # The backward with the least summed kernel time: separate passes, the fused dX + dK pass, or the
  # stored-scores pass with every reader.
  ms = lambda kn: best[kn][1] if kn in best else float("inf")
  forms = {"dk+dq+dx": ms("dk") + ms("dq") + ms("dx"), "dxdk+dq": ms("dxdk") + ms("dq"),
           "ds+dk_ds+dq_ds+dx_p": ms("ds") + ms("dk_ds") + ms("dq_ds") + ms("dx_p")}
  form = min(forms, key=forms.get)
  common = dict(fwd=pick("fwd"), dq=pick("dq"))
  # (the recomputing passes' tiles are kept beside the stored form's, so that
  # `with_backward(chosen, "recompute")` still has tiles that fit)
  if form == "ds+dk_ds+dq_ds+dx_p":
    chosen = at.FlashTiles(**common, dx=pick("dx"), dk=pick("dk"), dq_ds=pick("dq_ds"),
                           dx_p=True, ds=pick("ds"), dk_ds=pick("dk_ds"), dx_read=pick("dx_p"))
  else:
    chosen = at.FlashTiles(**common, dx=pick("dx"), dk=pick("dk"),
                           dxdk=pick("dxdk") if form == "dxdk+dq" else None)
  log(f"  {name}: backward kernels summed, ms: "
      + ", ".join(f"{k} {v:.3f}" for k, v in forms.items()) + f" -> {form}")
  return chosen, results


# The backward's row reduction delta [B, T*H] = <dO[r], out[r]> (float32; `triton_attention._delta`),
# in the forms XLA may lower differently: a dot_general with no free dimensions, or a float32
# product reduced over D.
DELTA_FORMS = {
    "einsum": lambda out, dout: jnp.einsum("bthd,bthd->bth", dout, out,
                                           preferred_element_type=jnp.float32),
    "product_sum": lambda out, dout: jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32),
                                             axis=-1),
}


def time_delta(name, shape):
  """Each DELTA_FORMS form and the library's `_delta` at the shape: ms (CUPTI), GB/s of the two
  bf16 inputs read, and the relative error against a float32 reference."""
  from kernels.attention import triton_attention as ta
  b, t, h, _, d = shape
  ko, kd = jax.random.split(jax.random.key(3))
  out = jax.random.normal(ko, (b, t, h, d), jnp.float32).astype(jnp.bfloat16)
  dout = jax.random.normal(kd, (b, t, h, d), jnp.float32).astype(jnp.bfloat16)
  want = jax.jit(lambda o, g: jnp.sum(o.astype(jnp.float32) * g.astype(jnp.float32), -1))(out, dout)
  forms = {**DELTA_FORMS, "library": lambda o, g: ta._delta(o, g).reshape(b, t, h)}
  rows = {}
  for form, fn in forms.items():
    f = jax.jit(fn)
    ms = jax_ms(f, out, dout)
    rows[form] = dict(ms=ms, gb_s=2 * out.size * 2 / ms / 1e6, err=rel_err(f(out, dout), want))
    log(f"  {name} delta {form:12s} {ms:.3f} ms ({rows[form]['gb_s']:.0f} GB/s, err "
        f"{rows[form]['err']:.1e})")
  return rows


def measurements(name: str, row: dict, tuned: bool = False) -> list[dict]:
  """The results rows of one shape's `time_cores` row: per core timed, fwd and fwd+bwd ms (TFLOP/s
  beside them), each against the XLA core of the same row where it was timed. Overrides name the core,
  a backward form other than auto, and the swept tiles (`tuned`)."""
  xla = row.get("xla")
  out = []
  for key, r in row.items():
    if not (isinstance(r, dict) and "fwd_ms" in r):
      continue
    core, _, form = key.partition("_")
    overrides = {"core": core}
    if form:
      overrides["core_backward"] = form
    if tuned:
      overrides["tiles"] = "swept"
    for metric in ("fwd_ms", "fwd_bwd_ms"):
      anchor = (results_lib.anchor("XLA core (scores materialised), same command", xla[metric], "ms",
                                   "bench/attention_core.py") if xla and core != "xla" else None)
      tflops = metric.replace("_ms", "_tflops")
      out.append(dict(config=f"attention_core:{name}", metric=metric, value=r[metric],
                      overrides=overrides, anchor=anchor, extra={tflops: r[tflops]}))
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--shapes", default="base,large")
  ap.add_argument("--sweep", default="", help="shapes to sweep the tiles of, e.g. base")
  ap.add_argument("--cores", default="xla,cudnn,triton", help="cores to time")
  ap.add_argument("--sweep_budget_s", type=float, default=150.0, help="per shape")
  ap.add_argument("--sweep_kernels", default="",
                  help="kernels whose candidates the sweep tries (default: all); the others run "
                       "their default tiles only (fwd, dx, dk, dq always run: the references)")
  ap.add_argument("--attention_tiles", default=None, help="JSON of tiles to start from")
  ap.add_argument("--backwards", default="auto",
                  help="the Triton core's backward forms to time, e.g. auto,recompute,stored_pairs")
  ap.add_argument("--delta", action="store_true",
                  help="also time the backward's delta = <dO, out> reduction in each DELTA_FORMS form")
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  results_lib.add_flag(ap)
  args = ap.parse_args()
  from kernels.attention import tiles as at
  from kernels.attention import triton_attention as ta
  if args.attention_tiles:
    at.load_table(args.attention_tiles)
  log("device:", jax.devices()[0].device_kind)
  os.makedirs(args.out, exist_ok=True)
  backwards = tuple(bw for bw in args.backwards.split(",") if bw)
  bad = [bw for bw in backwards if bw not in at.BACKWARDS]
  if bad:
    raise SystemExit(f"--backwards: unknown {', '.join(bad)}; forms: {', '.join(at.BACKWARDS)}")
  kernels, partners = sweep_kernels(args.sweep_kernels)   # (names checked before any GPU work)
  results, table = {}, {}
  names = args.shapes.split(",")
  bad = [n for n in names if n not in SHAPES]
  if bad:
    raise SystemExit(f"--shapes / --sweep: {', '.join(bad)}; shapes: {', '.join(SHAPES)}")
  for name in names:
    shape = SHAPES[name]
    log(f"{name}: B, T, H, dk, D = {shape}, tiles {at.tiles_to_json(at.default_tiles(*shape[3:]))}")
    which = tuple(c for c in args.cores.split(",") if c)
    results[name] = row = (time_cores(name, shape, which=which, backwards=backwards)
                           if which else {})
    if args.delta:
      row["delta"] = time_delta(name, shape)
    if name in args.sweep.split(","):
      def progress(tiles, key=f"{shape[3]},{shape[4]}"):   # the file as far as the sweep got
        with open(os.path.join(args.out, "attention_tiles.json"), "w") as f:
          json.dump({**table, key: at.tiles_to_json(tiles)}, f, indent=1)
      chosen, row["sweep"] = sweep(name, shape, args.sweep_budget_s,
                                   kernels, progress=progress, partners=partners)
      row["tiles"] = at.tiles_to_json(chosen)
      table[f"{shape[3]},{shape[4]}"] = row["tiles"]
      log(f"  {name}: chosen tiles {row['tiles']}")
      row["tuned"] = time_cores(name, shape, tiles=chosen, which=("triton",))
    for m in measurements(name, row) + measurements(name, row.get("tuned", {}), tuned=True):
      results_lib.record(args.results, **m)
    with open(os.path.join(args.out, "attention_core.json"), "w") as f:
      json.dump(results, f, indent=1)
    if table:
      with open(os.path.join(args.out, "attention_tiles.json"), "w") as f:
        json.dump(table, f, indent=1)
  log("\nms (TFLOP/s): fwd / fwd+bwd")
  for name, row in results.items():
    cells = []
    keys = ["xla", "cudnn"] + [k for k in row if k.startswith("triton") and isinstance(row[k], dict)]
    for core, r in [(c, row.get(c)) for c in keys] + [
        ("triton tuned", row.get("tuned", {}).get("triton"))]:
      if r:
        cells.append(f"{core} {r['fwd_ms']:.3f} ({r['fwd_tflops']:.0f}) / {r['fwd_bwd_ms']:.3f} "
                     f"({r['fwd_bwd_tflops']:.0f})")
    log(f"{name:6s} " + " | ".join(cells))


if __name__ == "__main__":
  main()
