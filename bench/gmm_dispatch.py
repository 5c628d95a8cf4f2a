"""bench/gmm.py's token-dispatch part: plan + permute + unpermute + combine against the expert matmuls
they feed, the fused dispatch (umoe_jax.ops.fused_dispatch, as ExpertPool.route runs it) against the
unfused one (values and gradients checked first), and where the dispatch time goes."""
from __future__ import annotations

from gmm_common import DISPATCH_CONFIGS, T, jax_ms, log, routed_inputs


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
