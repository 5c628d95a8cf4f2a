"""The tile sweeps of bench/gmm.py: `sweep` times kernels/gmm/tuning.py's candidates for the plain
grouped matmuls at the bench shapes, `sweep_gathered` for the calls as umoe_jax.ops.fused_dispatch
makes them (rows through the sort order, epilogues as the trainer runs them) and writes the best rows
as the file bench/train_step.py --gmm_tiles loads."""
from __future__ import annotations

import functools
import json

from gmm_common import (ATTENTION_CONFIGS, DISPATCH_CONFIGS, jax_ms, log, make_inputs,
                        routed_inputs)

MAX_CANDS = 12


def sweep(backend_name, shapes, results, ops=("gmm", "gmm_t", "tgmm"), max_cands=MAX_CANDS):
  import jax
  import jax.numpy as jnp
  from kernels.gmm import tuning
  mod = {"triton": "kernels.gmm.triton_gmm", "mosaic": "kernels.gmm.mosaic_gmm",
         "megablox": "kernels.gmm.megablox_gmm"}[backend_name]
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
      for cfg in tuning.candidates(table_backend, op, kc, no, M)[:max_cands]:
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


# Gathered ops timed for comparison only: the table row of their op comes from the trainer's form
# ("gmm_t+gather+silu": the activation fused; "tgmm+gather (down)": the rows pre-scaled).
COMPARISON_ONLY = ("gmm_t+gather", "tgmm+gather+scale (down)")


def sweep_gathered(results, max_cands=8, configs=None, only_ops=None, out_path=None, cand_indices=None,
                   pick_xla_epilogue=False):
  """Tiles of the Triton kernels as fused_dispatch calls them (operand rows through the sort order,
  from a token array that may not fit in L2): the "+gather" rows of kernels/gmm/tuning.py, and the
  M-specific rows of the two calls whose rows are already in expert order ("gmm (down)",
  "gmm_t (up)": the plain ops at the trainer's M and routing). configs / only_ops: names of
  DISPATCH_CONFIGS + ATTENTION_CONFIGS / op names to run (None: all). Returns the best rows; with
  `out_path` they are also written there (`tuning.rows_to_json`) after every op, so a sweep cut
  short by a time limit keeps what it found. cand_indices: positions in `tuning.candidates`' list
  to time (0, the tabled tile, is always timed first, as the row to beat); None: the first
  max_cands. pick_xla_epilogue: let a tile with the epilogue in XLA be the best row."""
  import jax
  import jax.numpy as jnp
  from kernels.gmm import tuning, triton_gmm as TG
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
        # The epilogue in XLA wins here and loses in the training step (the float32 product's
        # round trip competes with the step's other traffic): timed, never picked unless asked for.
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
