"""Grouped expert matmul benchmark at the UMoE shapes (T = 32*1024 tokens), one GPU.

  python bench/gmm.py [--sweep] [--backends triton,mosaic] [--no-torch] [--out DIR]
  python bench/gmm.py --backends=megablox --no-torch --sweep --sweep-backends=megablox   # a TPU

Prints, per shape, TFLOP/s of: a dense matmul of equal FLOPs, our kernels fwd and fwd+bwd (fwd + input
grad + weight grad = 3x the forward FLOPs), JAX's shipped Mosaic GPU ragged_dot fwd, jax.lax.ragged_dot
fwd (may run out of memory), torch._grouped_mm fwd and fwd+bwd; then the token-dispatch cost against
the expert matmuls; a short table last. Full results go to $OUT (or --out) as gmm_results.json.
--sweep times every candidate tile config of kernels/tuning.py's CANDIDATES and reports the best per
(backend, op, shape): the rows to paste into tuning.TABLE. --sweep-gathered does the same for the
calls as fused_dispatch makes them and also writes the rows to $OUT/gmm_tiles.json, which
bench/train_step.py --gmm_tiles loads (the step timed with them before they go into the table).
Group sizes: Dirichlet(alpha=4) as in shared/anchors/grouped_matmul_anchors.py. Inputs are random bf16.
JAX timings: CUPTI kernel time (jax.experimental.mosaic.gpu.profiler.measure), median of 10 runs;
torch: CUDA events, median of 20 (as the anchors).
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

import timing  # noqa: E402  (bench/timing.py)

T = 32 * 1024
SHAPES = [  # name, M, K, N, G
    ("base-up", T * 15, 768, 192, 128),
    ("base-down", T * 15, 192, 768, 128),
    ("base-att", T * 3, 768, 192, 128),
    ("large-up", T * 10, 2048, 512, 64),
    ("large-down", T * 10, 512, 2048, 64),
]
# One H200, TFLOP/s (shared/anchors): dense, torch fwd, torch fwd+bwd, jax mgpu ragged_dot fwd.
ANCHORS = {
    "base-up": dict(dense=611, torch_f=433, torch_fb=259, mgpu=389),
    "base-down": dict(dense=539, torch_f=333, torch_fb=334, mgpu=170),
    "base-att": dict(dense=580, torch_f=315, torch_fb=198, mgpu=329),
    "large-up": dict(dense=766, torch_f=679, torch_fb=448, mgpu=607),
    "large-down": dict(dense=754, torch_f=526, torch_fb=531, mgpu=382),
}


def group_sizes(M, E, seed=0):
  rng = np.random.default_rng(seed)
  p = rng.dirichlet(np.ones(E) * 4.0)
  gs = np.floor(p * M).astype(np.int32)
  gs[-1] += M - gs.sum()
  return gs


def log(*a):
  print(*a, flush=True)


def jax_ms(f, *args, iterations=10):
  """Median kernel time in ms (CUPTI); falls back to wall clock around block_until_ready."""
  try:
    from jax.experimental.mosaic.gpu import profiler
    f(*args)  # compile + warm up
    _, t = profiler.measure(f, iterations=iterations)(*args)
    if t is not None:
      return float(np.median(t))
  except Exception as e:  # noqa: BLE001
    log("  cupti timing failed, wall clock:", repr(e)[:120])
  return float(timing.wall_ms(f, *args, iters=iterations))


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


def make_inputs(M, K, N, E, seed=0):
  import jax
  import jax.numpy as jnp
  kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(kx, (M, K), jnp.bfloat16)
  w = (jax.random.normal(kw, (E, K, N), jnp.float32) / np.sqrt(K)).astype(jnp.bfloat16)
  dy = jax.random.normal(kd, (M, N), jnp.bfloat16)
  return x, w, dy, jnp.asarray(group_sizes(M, E))


def quick_check(be, x, w, dy, gs, cfgs=None):
  """Relative error of fwd/dgrad/wgrad on a slice of the real inputs vs float32 XLA ragged_dot."""
  import jax
  import jax.numpy as jnp
  from umoe_jax.ops import gmm as G
  m = 8192
  g = gs.shape[0]
  gs_s = jnp.asarray(np.diff(np.minimum(np.concatenate([[0], np.cumsum(np.asarray(gs))]), m - 100)),
                     jnp.int32)  # last 100 rows padding
  xs, dys = x[:m], dy[:m]
  f32 = lambda a: a.astype(jnp.float32)
  errs = {}
  cfgs = cfgs or {}
  out = be.gmm(xs, w, gs_s, transpose_rhs=False, out_dtype=jnp.bfloat16, **cfgs.get("gmm", {}))
  ref = G._xla_gmm(f32(xs), f32(w), gs_s, transpose_rhs=False, out_dtype=jnp.float32)
  errs["fwd"] = float(jnp.linalg.norm(f32(out) - ref) / jnp.linalg.norm(ref))
  out = be.gmm(dys, w, gs_s, transpose_rhs=True, out_dtype=jnp.bfloat16, **cfgs.get("gmm_t", {}))
  ref = G._xla_gmm(f32(dys), f32(w), gs_s, transpose_rhs=True, out_dtype=jnp.float32)
  errs["dgrad"] = float(jnp.linalg.norm(f32(out) - ref) / jnp.linalg.norm(ref))
  out = be.tgmm(xs, dys, gs_s, num_groups=g, out_dtype=jnp.float32, **cfgs.get("tgmm", {}))
  ref = G._xla_tgmm(f32(xs), f32(dys), gs_s, num_groups=g, out_dtype=jnp.float32)
  errs["wgrad"] = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
  return errs


MAX_CANDS = 12


def sweep(backend_name, shapes, results, ops=("gmm", "gmm_t", "tgmm")):
  import jax
  import jax.numpy as jnp
  from kernels import tuning
  mod = {"triton": "kernels.triton_gmm", "mosaic": "kernels.mgpu_gmm",
         "megablox": "kernels.megablox_gmm"}[backend_name]
  import importlib
  kmod = importlib.import_module(mod)
  table_backend = getattr(kmod, "tuning_key", lambda: backend_name)()  # megablox: "megablox/<gen>"
  best_rows = {}
  for name, M, K, N, E in shapes:
    x, w, dy, gs = make_inputs(M, K, N, E)
    fl = 2.0 * M * K * N
    for op, (kc, no) in (("gmm", (K, N)), ("gmm_t", (N, K)), ("tgmm", (K, N))):
      best = (0.0, None)
      if op not in ops:
        continue
      for cfg in tuning.candidates(table_backend, op, kc, no, M)[:MAX_CANDS]:
        try:
          if op == "tgmm":
            f = jax.jit(functools.partial(kmod.TGMM, out_dtype=jnp.bfloat16, num_groups=E, config=cfg))
            args = (x, dy, gs)
          else:
            f = jax.jit(functools.partial(kmod.GMM, transpose_rhs=(op == "gmm_t"), out_dtype=jnp.bfloat16,
                                          config=cfg))
            args = (x, w, gs) if op == "gmm" else (dy, w, gs)
          tf = fl / (jax_ms(f, *args) / 1e3) / 1e12
        except Exception as e:  # noqa: BLE001
          log(f"  sweep {backend_name} {name} {op} {cfg}: FAILED {repr(e)[:300]}")
          continue
        log(f"  sweep {backend_name} {name} {op} {cfg}: {tf:.0f} TFLOP/s")
        results.setdefault("sweep", []).append(dict(backend=backend_name, shape=name, op=op,
                                                    cfg=str(cfg), tflops=tf))
        if tf > best[0]:
          best = (tf, cfg)
      key = (table_backend, op, kc, no, tuning.m_bucket(M))  # M-specific: base-up != base-att
      best_rows[key] = best
      if best[1] is not None:  # the timed section below then runs the tuned config
        tuning.TABLE[key] = best[1]
      log(f"BEST {backend_name} {name} {op}: {best[1]} {best[0]:.0f}")
    del x, w, dy
  log("TABLE rows:")
  for key, (tf, cfg) in best_rows.items():
    log(f"  {key!r}: {cfg!r},  # {tf:.0f} TFLOP/s")
  return best_rows


def routed_inputs(d, h, E, K, n=None, seed=5):
  """An MoE layer's inputs at the bench scale: tokens x [n, d], Dirichlet-skewed top-K ids, gates,
  expert weights w1 [E, d, h] and w2 [E, h, d] (bf16, fresh random)."""
  import jax
  import jax.numpy as jnp
  n = n or T
  kx, ke, kg, kw1, kw2 = jax.random.split(jax.random.key(seed), 5)
  x = jax.random.normal(kx, (n, d), jnp.bfloat16)
  logits = jax.random.normal(ke, (n, E)) + jnp.log(jnp.asarray(
      np.random.default_rng(0).dirichlet(np.ones(E) * 4.0), jnp.float32))
  ids = jax.lax.top_k(logits, K)[1].astype(jnp.int32)
  gates = jax.nn.softmax(jax.random.normal(kg, (n, K)), -1).astype(jnp.bfloat16)
  w1 = (jax.random.normal(kw1, (E, d, h)) / np.sqrt(d)).astype(jnp.bfloat16)
  w2 = (jax.random.normal(kw2, (E, h, d)) / np.sqrt(h)).astype(jnp.bfloat16)
  return x, ids, gates, w1, w2


DISPATCH_CONFIGS = (("base", 768, 192, 128, 15), ("large", 2048, 512, 64, 10))
# Swept by --sweep-gathered only: UMoE-base's attention-side calls (the routed queries' and the
# attention experts' matmuls, K = 3 slots: M = 3 N ~ 2^17 rows, their own table rows).
ATTENTION_CONFIGS = (("base_att", 768, 192, 128, 3),)


# Gathered ops timed for comparison only: the table row of their op comes from the trainer's form
# ("gmm_t+gather+silu": the activation fused; "tgmm+gather (down)": the rows pre-scaled).
COMPARISON_ONLY = ("gmm_t+gather", "tgmm+gather+scale (down)")


def sweep_gathered(results, max_cands=8, configs=None, only_ops=None, out_path=None, cand_indices=None,
                   pick_xla_epilogue=False):
  """Tiles of the Triton kernels as fused_dispatch calls them (operand rows through the sort order,
  from a token array that may not fit in L2): the "+gather" rows of kernels/tuning.py, and the
  M-specific rows of the two calls whose rows are already in expert order ("gmm (down)",
  "gmm_t (up)": the plain ops at the trainer's M and routing). configs / only_ops: names of
  DISPATCH_CONFIGS + ATTENTION_CONFIGS / op names to run (None: all). Returns the best rows; with
  `out_path` they are also written there (`tuning.rows_to_json`) after every op, so a sweep cut
  short by a time limit keeps what it found. cand_indices: positions in `tuning.candidates`' list
  to time (0, the tabled tile, is always timed first, as the row to beat); None: the first
  max_cands. pick_xla_epilogue: let a tile with the epilogue in XLA be the best row."""
  import jax
  import jax.numpy as jnp
  from kernels import tuning, triton_gmm as TG
  from umoe_jax.ops import dispatch as D
  best_rows, best_by_op = {}, {}
  for name, d, h, E, K in DISPATCH_CONFIGS + ATTENTION_CONFIGS:
    if configs is not None and name not in configs:
      continue
    x, ids, gates, w1, w2 = routed_inputs(d, h, E, K)
    plan = D.make_plan(ids, E)
    token_of_row = plan.order // K
    m = plan.order.shape[0]
    dout = jax.random.normal(jax.random.key(9), x.shape, jnp.bfloat16)
    hrows = jax.random.normal(jax.random.key(8), (m, h), jnp.bfloat16)
    scale = jnp.take(gates.reshape(-1), plan.order).astype(jnp.float32)
    hscaled = (hrows.astype(jnp.float32) * scale[:, None]).astype(hrows.dtype)
    ops = {  # name -> (table op, flops, (kc, no), cfg -> jitted call, its args)
        "gmm+gather": ("gmm+gather", 2.0 * m * d * h, (d, h), lambda cfg: jax.jit(
            lambda x, w, gs, i: TG.triton_gmm(x, w, gs, lhs_index=i, config=cfg)),
            (x, w1, plan.group_sizes, token_of_row)),
        "gmm_t+gather": ("gmm_t+gather", 2.0 * m * d * h, (d, h), lambda cfg: jax.jit(
            lambda o, w, gs, i, s, hr: TG.triton_gmm(o, w, gs, transpose_rhs=True, lhs_index=i,
                                                     row_scale=s, row_dot=hr, config=cfg)),
            (dout, w2, plan.group_sizes, token_of_row, scale, hrows)),
        # ... as the trainer calls it (`moe.fuse_activation`, the default): hrows hold the
        # pre-activations, the epilogue takes silu and its derivative too.
        "gmm_t+gather+silu": ("gmm_t+gather", 2.0 * m * d * h, (d, h), lambda cfg: jax.jit(
            lambda o, w, gs, i, s, hr: TG.triton_gmm(o, w, gs, transpose_rhs=True, lhs_index=i,
                                                     row_scale=s, row_dot=hr, epi_act="silu",
                                                     config=cfg)),
            (dout, w2, plan.group_sizes, token_of_row, scale, hrows)),
        # The two short-contraction calls (F -> D, K = F) take their rows in expert order, no
        # gather: the last matmul's forward (act(z) rows, then the fan-in) and the first matmul's
        # input gradient (gather_gmm's backward, then the fan-in), at the trainer's M and routing.
        "gmm (down)": ("gmm", 2.0 * m * d * h, (h, d), lambda cfg: jax.jit(
            lambda a, w, gs: TG.triton_gmm(a, w, gs, config=cfg)),
            (hrows, w2, plan.group_sizes)),
        "gmm_t (up)": ("gmm_t", 2.0 * m * d * h, (h, d), lambda cfg: jax.jit(
            lambda o, w, gs: TG.triton_gmm(o, w, gs, transpose_rhs=True, config=cfg)),
            (hrows, w1, plan.group_sizes)),
        "tgmm+gather": ("tgmm+gather", 2.0 * m * d * h, (d, h), lambda cfg: jax.jit(
            lambda x, r, gs, i: TG.triton_tgmm(x, r, gs, num_groups=E, lhs_index=i, config=cfg)),
            (x, hrows, plan.group_sizes, token_of_row)),
        # The last matmul's weight gradient as gmm_combine's backward takes it: gate-scaled rows
        # (pre-scaled by XLA, the form it calls) against the gathered output gradient; then the same
        # with the scale inside the kernel (the form before), for the comparison only.
        "tgmm+gather (down)": ("tgmm+gather", 2.0 * m * d * h, (h, d), lambda cfg: jax.jit(
            lambda a, o, gs, i: TG.triton_tgmm(a, o, gs, num_groups=E, rhs_index=i, config=cfg)),
            (hscaled, dout, plan.group_sizes, token_of_row)),
        "tgmm+gather+scale (down)": ("tgmm+gather", 2.0 * m * d * h, (h, d), lambda cfg: jax.jit(
            lambda a, o, gs, i, s: TG.triton_tgmm(a, o, gs, num_groups=E, rhs_index=i, lhs_scale=s,
                                                  config=cfg)),
            (hrows, dout, plan.group_sizes, token_of_row, scale)),
    }
    for op, (table_op, fl, (kc, no), make, args) in ops.items():
      if only_ops is not None and op not in only_ops:
        continue
      best = (0.0, None)
      cands = tuning.candidates("triton", table_op, kc, no, m)
      if cand_indices is None:
        cands = cands[:max_cands]
      else:
        cands = [cands[i] for i in sorted({0, *cand_indices}) if i < len(cands)]
      for cfg in cands:
        try:
          tf = fl / (jax_ms(make(cfg), *args) / 1e3) / 1e12
        except Exception as e:  # noqa: BLE001
          log(f"  sweep {name} {op} {cfg}: FAILED {repr(e)[:200]}")
          continue
        log(f"  sweep {name} {op} {cfg}: {tf:.0f} TFLOP/s")
        results.setdefault("sweep_gathered", []).append(dict(shape=name, op=op, cfg=str(cfg), tflops=tf))
        # The epilogue in XLA wins here and loses in the training step (runs 48, 55: the float32
        # product's round trip competes with the step's other traffic): timed, never picked
        # unless asked for.
        if tf > best[0] and (pick_xla_epilogue or not cfg.xla_epilogue):
          best = (tf, cfg)
      best_by_op[(name, op)] = best
      if op in COMPARISON_ONLY:  # timed beside the form the trainer calls, not a tile for the table
        continue
      key = ("triton", table_op, kc, no, tuning.m_bucket(m))
      best_rows[key] = best
      if best[1] is not None:
        tuning.TABLE[key] = best[1]
      if out_path:
        with open(out_path, "w") as f:
          json.dump(tuning.rows_to_json({k: c for k, (_, c) in best_rows.items() if c is not None}),
                    f, indent=1)
  log("best tile per call (TFLOP/s):")
  for (name, op), (tf, cfg) in best_by_op.items():
    log(f"  {name:6s} {op:26s} {tf:6.0f}  {cfg}")
  log("TABLE rows (gathered):")
  for key, (tf, cfg) in best_rows.items():
    log(f"  {key!r}: {cfg!r},  # {tf:.0f} TFLOP/s")
  return {key: cfg for key, (_, cfg) in best_rows.items() if cfg is not None}


def dispatch_part(ours_backend, results):
  """Token dispatch (plan + permute + unpermute + combine) vs the expert matmuls it feeds."""
  import jax
  import jax.numpy as jnp
  from umoe_jax.ops import dispatch as D
  from umoe_jax.ops import gmm as G
  from umoe_jax.ops import fused_dispatch as FD
  out = {}
  for name, D_, H, E, K in DISPATCH_CONFIGS:
    n = T
    x, ids, gates, w1, w2 = routed_inputs(D_, H, E, K, n)
    kx = jax.random.key(5)

    def experts(rows, gs, w1, w2):
      h = G.gmm(rows, w1, gs, backend=ours_backend)
      return G.gmm(jax.nn.relu(h), w2, gs, backend=ours_backend)

    def dispatch_only(x, ids, gates, y_sorted):
      plan = D.make_plan(ids, E)
      rows = D.permute(x, plan, K)
      y = D.unpermute(y_sorted, plan).reshape(n, K, -1)
      return rows, D.combine(y, gates)

    def full(x, ids, gates, w1, w2):
      plan = D.make_plan(ids, E)
      return D.apply_experts(x, plan, gates, lambda r, gs: experts(r, gs, w1, w2))

    def fused(x, ids, gates, w1, w2):  # what ExpertPool.route runs
      plan = D.make_plan(ids, E)
      h = jax.nn.relu(FD.gather_gmm(x, w1, plan, K, backend=ours_backend))
      return FD.gmm_combine(h, w2, plan, gates, backend=ours_backend)

    plan = jax.jit(lambda i: D.make_plan(i, E))(ids)
    rows = jax.jit(lambda x, p: D.permute(x, p, K))(x, plan)
    y_sorted = jax.random.normal(kx, (n * K, D_), jnp.bfloat16)
    t_disp = jax_ms(jax.jit(dispatch_only), x, ids, gates, y_sorted)
    t_plan = jax_ms(jax.jit(lambda i: D.make_plan(i, E)), ids)
    t_exp = jax_ms(jax.jit(experts), rows, plan.group_sizes, w1, w2)
    t_full = jax_ms(jax.jit(full), x, ids, gates, w1, w2)
    loss = lambda x, g, w1, w2: jnp.sum(full(x, ids, g, w1, w2).astype(jnp.float32))
    t_full_fb = jax_ms(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))), x, gates, w1, w2)
    loss_e = lambda r, w1, w2: jnp.sum(experts(r, plan.group_sizes, w1, w2).astype(jnp.float32))
    t_exp_fb = jax_ms(jax.jit(jax.grad(loss_e, argnums=(0, 1, 2))), rows, w1, w2)
    # The fused layer must agree with the unfused one before it is timed.
    ref = jax.jit(full)(x, ids, gates, w1, w2).astype(jnp.float32)
    got = jax.jit(fused)(x, ids, gates, w1, w2).astype(jnp.float32)
    fused_err = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
    loss_f = lambda x, g, w1, w2: jnp.sum(fused(x, ids, g, w1, w2).astype(jnp.float32))
    g_ref = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, gates, w1, w2)
    g_got = jax.jit(jax.grad(loss_f, argnums=(0, 1, 2, 3)))(x, gates, w1, w2)
    fused_grad_err = max(float(jnp.linalg.norm((a - b).astype(jnp.float32)) /
                               jnp.linalg.norm(b.astype(jnp.float32))) for a, b in zip(g_got, g_ref))
    t_fused = jax_ms(jax.jit(fused), x, ids, gates, w1, w2)
    t_fused_fb = jax_ms(jax.jit(jax.grad(loss_f, argnums=(0, 1, 2, 3))), x, gates, w1, w2)
    out[name] = dict(fused_fwd_ms=t_fused, fused_fwd_bwd_ms=t_fused_fb, fused_err=fused_err,
                     fused_grad_err=fused_grad_err,
                     fused_dispatch_frac_fwd=(t_fused - t_exp) / t_exp,
                     fused_dispatch_frac_fwd_bwd=(t_fused_fb - t_exp_fb) / t_exp_fb,
                     dispatch_fwd_ms=t_disp, plan_ms=t_plan, experts_fwd_ms=t_exp, layer_fwd_ms=t_full,
                     layer_fwd_bwd_ms=t_full_fb, experts_fwd_bwd_ms=t_exp_fb,
                     dispatch_frac_fwd=(t_full - t_exp) / t_exp,
                     dispatch_frac_fwd_bwd=(t_full_fb - t_exp_fb) / t_exp_fb)
    out[name]["parts"] = dispatch_parts(ours_backend, x, ids, gates, w1, w2, plan, rows, y_sorted, K, E)
    log(f"  dispatch {name}: dispatch-only fwd {t_disp:.3f} ms (plan {t_plan:.3f}), experts fwd {t_exp:.3f} ms, "
        f"layer fwd {t_full:.3f} ms -> dispatch = {100 * out[name]['dispatch_frac_fwd']:.0f}% of experts; "
        f"fwd+bwd layer {t_full_fb:.3f} vs experts {t_exp_fb:.3f} -> "
        f"{100 * out[name]['dispatch_frac_fwd_bwd']:.0f}%")
    log(f"  dispatch {name} FUSED (fused_dispatch, as ExpertPool.route): fwd {t_fused:.3f} ms "
        f"({100 * out[name]['fused_dispatch_frac_fwd']:.0f}% over experts), fwd+bwd {t_fused_fb:.3f} ms "
        f"({100 * out[name]['fused_dispatch_frac_fwd_bwd']:.0f}%); rel err vs unfused {fused_err:.1e}, "
        f"grads {fused_grad_err:.1e}")
  results["dispatch"] = out


def dispatch_parts(backend, x, ids, gates, w1, w2, plan, rows, y_sorted, K, E):
  """Where the dispatch time goes (ms): plan variants, the combine against its bandwidth floor
  (the same reduction over expert outputs already in token order), and each fused op against the
  raw gmm it replaces, forward and forward+backward."""
  import jax
  import jax.numpy as jnp
  from umoe_jax.ops import dispatch as D
  from umoe_jax.ops import gmm as G
  from umoe_jax.ops import fused_dispatch as FD
  n, d = x.shape
  parts, flat = {}, ids.reshape(-1)
  iota = jnp.arange(flat.shape[0], dtype=jnp.int32)
  parts["sort_pair"] = jax_ms(jax.jit(lambda f: jax.lax.sort((f, iota), num_keys=1, is_stable=True)), flat)
  bits = (flat.shape[0] - 1).bit_length()  # (id, index) packed into one unique int32 key
  parts["sort_packed"] = jax_ms(jax.jit(lambda f: jax.lax.sort((f << bits) | iota)), flat)
  sorted_ids = jnp.sort(flat)
  bounds_at = jnp.arange(E + 1, dtype=jnp.int32)
  for method in ("scan", "scan_unrolled", "compare_all", "sort"):
    parts[f"bounds_{method}"] = jax_ms(jax.jit(
        lambda s, m=method: jnp.searchsorted(s, bounds_at, side="left", method=m)), sorted_ids)
  parts["bincount"] = jax_ms(jax.jit(lambda f: jnp.bincount(f, length=E)), flat)
  parts["plan"] = jax_ms(jax.jit(lambda i: D.make_plan(i, E)), ids)
  y_tok = jnp.take(y_sorted, plan.inverse, axis=0).reshape(n, K, d)
  parts["combine_gather"] = jax_ms(jax.jit(lambda y, p, g: D.combine(
      jnp.take(y, p.inverse, axis=0).reshape(n, K, d), g)), y_sorted, plan, gates)
  parts["combine_floor"] = jax_ms(jax.jit(D.combine), y_tok, gates)
  parts["copy_Md"] = jax_ms(jax.jit(lambda y: y * 2), y_sorted)
  parts["hbm_GBps_copy"] = 2 * y_sorted.size * 2 / parts["copy_Md"] / 1e6
  parts["hbm_GBps_combine"] = (y_sorted.size + n * d) * 2 / parts["combine_gather"] / 1e6
  gs = plan.group_sizes
  h = jax.nn.relu(G.gmm(rows, w1, gs, backend=backend))
  sq = lambda f: lambda *a: jnp.sum(f(*a).astype(jnp.float32))
  for label, fused, raw, args in (
      ("up", lambda x, w: FD.gather_gmm(x, w, plan, K, backend=backend),
       lambda r, w: G.gmm(r, w, gs, backend=backend), ((x, w1), (rows, w1))),
      ("down", lambda h, w, g: FD.gmm_combine(h, w, plan, g, backend=backend),
       lambda h, w, g: G.gmm(h, w, gs, backend=backend), ((h, w2, gates), (h, w2, gates)))):
    parts[f"{label}_fused_fwd"] = jax_ms(jax.jit(fused), *args[0])
    parts[f"{label}_raw_fwd"] = jax_ms(jax.jit(raw), *args[1])
    parts[f"{label}_fused_fwd_bwd"] = jax_ms(jax.jit(jax.grad(sq(fused), argnums=(0, 1))), *args[0])
    parts[f"{label}_raw_fwd_bwd"] = jax_ms(jax.jit(jax.grad(sq(raw), argnums=(0, 1))), *args[1])
  log("  parts (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in parts.items()))
  return parts


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--sweep", action="store_true")
  ap.add_argument("--sweep-backends", default="triton")
  ap.add_argument("--sweep-gathered", action="store_true", help="tiles of the fused-dispatch calls")
  ap.add_argument("--gathered-configs", default="",
                  help="with --sweep-gathered: base,large,base_att (default all)")
  ap.add_argument("--gathered-ops", default="",
                  help="with --sweep-gathered: ';'-separated call names (default all), e.g. "
                       "'tgmm+gather (down);tgmm+gather+scale (down)'")
  ap.add_argument("--sweep-ops",
                  default="triton:gmm,gmm_t,tgmm;mosaic:gmm,gmm_t,tgmm;megablox:gmm,gmm_t,tgmm")
  ap.add_argument("--backends", default="triton,mosaic")
  ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
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
  args = ap.parse_args()
  globals()["MAX_CANDS"] = args.max_cands
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
  log("backends:", backends, "device:", results["device"])

  sweep_ops = {kv.split(":")[0]: tuple(kv.split(":")[1].split(",")) for kv in args.sweep_ops.split(";")}
  if args.sweep:
    for b in args.sweep_backends.split(","):
      if b in backends:
        try:
          results.setdefault("best", {})[b] = {str(k): [v[0], str(v[1])]
                                               for k, v in sweep(b, shapes, results, sweep_ops.get(b, ())).items()}
        except Exception:  # noqa: BLE001
          log(traceback.format_exc())
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
    for b in backends:
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
    results["shapes"][name] = row
    del x, w, dy
    _save(args.out, results)

  if not args.no_dispatch and backends:
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
