"""Dropless dispatch: plans, permute/unpermute, gate-weighted combine, `apply_experts` vs a loop."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference as R
from conftest import rel_err
from umoe_jax.ops import dispatch
from umoe_jax.ops.gmm import gmm

N, KS, E, D, F = 10, 3, 6, 5, 7


def _random_ids(seed, n=N, k=KS, e=E):
  """Top-k style ids: k distinct experts per token."""
  rng = np.random.default_rng(seed)
  return np.stack([rng.choice(e, size=k, replace=False) for _ in range(n)]).astype(np.int32)


ID_CASES = {
    "random": _random_ids(0),
    # extreme imbalance: every token picks experts 0..K-1, the others get nothing
    "all_same": np.tile(np.arange(KS, dtype=np.int32), (N, 1)),
    # the last experts only (empty groups at the start)
    "tail": np.tile(np.arange(E - KS, E, dtype=np.int32)[::-1], (N, 1)),
}


@pytest.mark.parametrize("case", list(ID_CASES))
def test_plan(case):
  ids = ID_CASES[case]
  plan = jax.jit(dispatch.make_plan, static_argnums=1)(jnp.asarray(ids), E)
  order, gs = np.asarray(plan.order), np.asarray(plan.group_sizes)
  flat = ids.reshape(-1)
  # every (token, slot) pair appears exactly once: nothing dropped, nothing duplicated
  np.testing.assert_array_equal(np.sort(order), np.arange(N * KS))
  np.testing.assert_array_equal(np.asarray(plan.inverse)[order], np.arange(N * KS))
  assert gs.sum() == N * KS
  np.testing.assert_array_equal(gs, [np.sum(flat == e) for e in range(E)])
  sorted_ids = flat[order]
  assert np.all(np.diff(sorted_ids) >= 0), "rows are sorted by expert"
  for e in range(E):
    rows = order[sorted_ids == e]
    assert np.all(np.diff(rows) > 0), "stable: tokens keep their order inside an expert"
  start = 0
  for e in range(E):
    assert np.all(sorted_ids[start:start + gs[e]] == e), "group_sizes delimit the groups"
    start += gs[e]


@pytest.mark.parametrize("case", list(ID_CASES))
def test_permute_unpermute_identity(case):
  ids = ID_CASES[case]
  plan = dispatch.make_plan(jnp.asarray(ids), E)
  x3 = np.random.default_rng(1).standard_normal((N, KS, D)).astype(np.float32)
  rows = dispatch.permute(jnp.asarray(x3), plan, KS)
  assert rows.shape == (N * KS, D)
  back = np.asarray(dispatch.unpermute(rows, plan)).reshape(N, KS, D)
  np.testing.assert_array_equal(back, x3)
  # rows really are in expert order: row i is slot order[i]
  order = np.asarray(plan.order)
  np.testing.assert_array_equal(np.asarray(rows), x3.reshape(-1, D)[order])

  # one row per token, shared by its K slots
  x2 = np.random.default_rng(2).standard_normal((N, D)).astype(np.float32)
  rows2 = np.asarray(dispatch.permute(jnp.asarray(x2), plan, KS))
  for i, slot in enumerate(order):
    np.testing.assert_array_equal(rows2[i], x2[slot // KS])
  back2 = np.asarray(dispatch.unpermute(jnp.asarray(rows2), plan)).reshape(N, KS, D)
  np.testing.assert_array_equal(back2, np.repeat(x2[:, None], KS, axis=1))


def test_plan_puts_masked_slots_in_no_group():
  """Slots outside slot_mask: after every expert's rows (in slot order) and in no group, so
  group_sizes counts the active slots only; the active rows are sorted exactly as in a plan of
  those slots alone."""
  ids = ID_CASES["random"]
  rng = np.random.default_rng(3)
  mask = rng.random(ids.shape) < 0.5
  mask[:, 0] = True
  plan = dispatch.make_plan(jnp.asarray(ids), E, jnp.asarray(mask))
  order, gs = np.asarray(plan.order), np.asarray(plan.group_sizes)
  flat, active = ids.reshape(-1), mask.reshape(-1)
  np.testing.assert_array_equal(gs, [np.sum(flat[active] == e) for e in range(E)])
  a = int(active.sum())
  assert gs.sum() == a < N * KS
  # the active rows: by expert, stable (token order inside an expert); then the masked ones
  expected = sorted(np.flatnonzero(active), key=lambda i: (flat[i], i))
  np.testing.assert_array_equal(order[:a], expected)
  np.testing.assert_array_equal(order[a:], np.flatnonzero(~active))
  np.testing.assert_array_equal(np.asarray(plan.inverse)[order], np.arange(N * KS))


def test_permute_rejects_bad_shapes():
  plan = dispatch.make_plan(jnp.asarray(ID_CASES["random"]), E)
  with pytest.raises(ValueError):
    dispatch.permute(jnp.zeros((N, KS + 1, D)), plan, KS)


def test_combine():
  rng = np.random.default_rng(3)
  y = rng.standard_normal((N, KS, D)).astype(np.float32)
  g = rng.random((N, KS)).astype(np.float32)
  out = np.asarray(dispatch.combine(jnp.asarray(y), jnp.asarray(g)))
  ref = np.zeros((N, D))
  for n in range(N):
    for k in range(KS):
      ref[n] += g[n, k] * y[n, k].astype(np.float64)
  assert rel_err(out, ref) < 1e-6


@pytest.mark.parametrize("path", ["combine", "apply_experts", "gmm_combine"])
def test_combine_accumulates_in_float32(path):
  """The K-slot sum of bf16 expert outputs is accumulated in float32 and rounded to bf16 once: the
  result is the correctly rounded bf16 of the exact sum. Each token adds one large slot (32..64,
  where bf16's spacing is 0.25..0.5) to K-1 small ones (0.5..1) with gates in (0.5, 1): a bf16
  accumulator rounds at every add (sequentially ~64% of the outputs off, pairwise ~40%).
  Through `combine`, the unfused `apply_experts` (identity experts) and the fused `gmm_combine`
  (identity expert matrices), which every pool, SwitchHead and expert-parallel combine goes through."""
  import ml_dtypes
  from umoe_jax.ops import fused_dispatch
  n, k, e, d = 64, 16, 16, 64
  rng = np.random.default_rng(21)
  to_bf16 = lambda a: np.asarray(a, np.float32).astype(ml_dtypes.bfloat16)
  y = to_bf16(np.concatenate([rng.uniform(32, 64, (n, 1, d)), rng.uniform(0.5, 1, (n, k - 1, d))],
                             axis=1))
  g = to_bf16(rng.uniform(0.5, 1, (n, k)))
  exact = np.einsum("nkd,nk->nd", y.astype(np.float64), g.astype(np.float64))
  ids = jnp.asarray(np.stack([rng.permutation(e)[:k] for _ in range(n)]), jnp.int32)
  yj, gj = jnp.asarray(y), jnp.asarray(g)
  if path == "combine":
    out = jax.jit(dispatch.combine)(yj, gj)
    # XLA on CPU runs a bf16 reduction in float32 anyway, so the values alone cannot catch a bf16
    # jnp.sum; the program must ask for float32 (other backends may take bf16 at its word).
    for eqn in jax.make_jaxpr(dispatch.combine)(yj, gj).eqns:
      if eqn.primitive.name in ("reduce_sum", "dot_general"):
        assert eqn.outvars[0].aval.dtype == jnp.float32, eqn
  elif path == "apply_experts":  # identity experts on per-slot rows: the expert outputs are y
    out = jax.jit(lambda y, g: dispatch.apply_experts(
        y, dispatch.make_plan(ids, e), g, lambda rows, gs: rows))(yj, gj)
  else:  # rows in expert order times identity matrices (exact in bf16), then un-sort and combine
    eye = jnp.broadcast_to(jnp.eye(d, dtype=jnp.bfloat16), (e, d, d))
    plan = dispatch.make_plan(ids, e)
    h = dispatch.permute(yj, plan, k)
    out = jax.jit(lambda h, g: fused_dispatch.gmm_combine(h, eye, plan, g, backend="xla"))(h, gj)
  assert out.dtype == jnp.bfloat16
  out = np.asarray(out, np.float64)
  want = to_bf16(exact).astype(np.float64)
  # float32 rounding can flip a sum that lies within ~1e-6 of a bf16 rounding midpoint: allow 1%.
  assert np.mean(out != want) <= 0.01, f"{np.mean(out != want):.1%} not correctly rounded"
  assert np.all(np.abs(out - exact) <= np.abs(exact) * 2.0 ** -8)  # within one bf16 step


def _eqns(jaxpr):
  """Every equation of a jaxpr, those of the jaxprs inside it (jit, custom_vjp, ...) included."""
  from jax.extend import core as jcore
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for sub in (value if isinstance(value, (list, tuple)) else (value,)):
        if isinstance(sub, (jcore.Jaxpr, jcore.ClosedJaxpr)):
          yield from _eqns(sub)


@pytest.mark.parametrize("gate_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("path", ["combine", "apply_experts", "gmm_combine"])
def test_combine_multiplies_and_sums_in_float32(path, gate_dtype):
  """For bf16 expert outputs (gates bf16 or float32), every gate product and every slot sum of the
  combine is float32 in the program (jaxpr), through `combine`, the unfused `apply_experts` and the
  fused `gmm_combine`, and the bf16 output lies within one bf16 rounding of the float64 sum. XLA on
  CPU keeps excess precision through a bf16 multiply or sum, so the values alone do not tell; the
  program is what other backends run as written."""
  from umoe_jax.ops import fused_dispatch
  n, k, e, d = 8, 4, 8, 16
  rng = np.random.default_rng(31)
  y = jnp.asarray(rng.standard_normal((n, k, d)), jnp.bfloat16)
  g = jnp.asarray(rng.random((n, k)), gate_dtype)
  ids = jnp.asarray(np.stack([rng.permutation(e)[:k] for _ in range(n)]), jnp.int32)
  if path == "combine":
    fn, args = dispatch.combine, (y, g)
  elif path == "apply_experts":  # identity experts on per-slot rows
    fn = lambda y, g: dispatch.apply_experts(y, dispatch.make_plan(ids, e), g, lambda r, gs: r)
    args = (y, g)
  else:  # rows in expert order through identity expert matrices, un-sorted and combined
    eye = jnp.broadcast_to(jnp.eye(d, dtype=jnp.bfloat16), (e, d, d))
    plan = dispatch.make_plan(ids, e)
    fn = lambda h, g: fused_dispatch.gmm_combine(h, eye, plan, g, backend="xla")
    args = (dispatch.permute(y, plan, k), g)
  jaxpr = jax.make_jaxpr(fn)(*args)
  arith = [eqn for eqn in _eqns(jaxpr) if eqn.primitive.name in ("mul", "add", "add_any",
                                                                 "reduce_sum", "dot_general")
           and jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.floating)]
  names = {eqn.primitive.name for eqn in arith}
  assert {"mul", "reduce_sum"} <= names or "dot_general" in names, names  # the combine is there
  for eqn in arith:
    assert eqn.outvars[0].aval.dtype == jnp.float32, eqn
  assert jaxpr.out_avals[0].dtype == jnp.bfloat16
  exact = np.einsum("nkd,nk->nd", np.asarray(y, np.float64),
                    np.asarray(g.astype(jnp.bfloat16), np.float64))
  out = np.asarray(jax.jit(fn)(*args), np.float64)
  assert np.all(np.abs(out - exact) <= np.abs(exact) * 2.0 ** -8)


def _expert_weights(seed):
  rng = np.random.default_rng(seed)
  return (rng.standard_normal((E, D, F)).astype(np.float32) / np.sqrt(D),
          rng.standard_normal((E, F, D)).astype(np.float32) / np.sqrt(F))


@functools.partial(jax.jit, static_argnames=("backend",))
def _apply(x, ids, gates, w1, w2, backend):
  plan = dispatch.make_plan(ids, E)

  def expert_fn(rows, gs):
    return gmm(jax.nn.silu(gmm(rows, w1, gs, backend=backend)), w2, gs, backend=backend)

  return dispatch.apply_experts(x, plan, gates, expert_fn)


@pytest.mark.parametrize("backend", ["xla", "masked"])
@pytest.mark.parametrize("per_slot", [False, True])
def test_apply_experts_equals_per_token_loop(backend, per_slot):
  w1, w2 = _expert_weights(4)
  rng = np.random.default_rng(5)
  for case, ids in ID_CASES.items():
    x = rng.standard_normal((N, KS, D) if per_slot else (N, D)).astype(np.float32)
    gates = rng.random((N, KS)).astype(np.float32)
    out = np.asarray(_apply(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(gates), jnp.asarray(w1),
                            jnp.asarray(w2), backend))
    ref = np.zeros((N, D))
    for n in range(N):
      for k in range(KS):
        e = ids[n, k]
        inp = x[n, k] if per_slot else x[n]
        ref[n] += gates[n, k] * R.mlp_vec(inp, w1[e], w2[e], "silu")
    assert rel_err(out, ref) < 1e-5, case


def test_apply_experts_gradient():
  """Gradients flow to the inputs, the gates and the expert weights, matching a dense loop."""
  w1, w2 = _expert_weights(6)
  ids = ID_CASES["random"]
  rng = np.random.default_rng(7)
  x = jnp.asarray(rng.standard_normal((N, D)), jnp.float32)
  gates = jnp.asarray(rng.random((N, KS)), jnp.float32)
  cot = jnp.asarray(rng.standard_normal((N, D)), jnp.float32)

  def via_dispatch(x, gates, w1, w2):
    return jnp.sum(_apply(x, jnp.asarray(ids), gates, w1, w2, "xla") * cot)

  def via_loop(x, gates, w1, w2):
    out = jnp.zeros((N, D))
    for k in range(KS):
      e = ids[:, k]
      h = jax.nn.silu(jnp.einsum("nd,ndf->nf", x, w1[e]))
      out = out + gates[:, k:k + 1] * jnp.einsum("nf,nfd->nd", h, w2[e])
    return jnp.sum(out * cot)

  args = (x, gates, jnp.asarray(w1), jnp.asarray(w2))
  got = jax.jit(jax.grad(via_dispatch, argnums=(0, 1, 2, 3)))(*args)
  want = jax.jit(jax.grad(via_loop, argnums=(0, 1, 2, 3)))(*args)
  for a, b in zip(got, want):
    assert rel_err(a, b) < 1e-5


# ----------------------------------------------------------------------------------------------
# Dispatch fused into the first / last grouped matmul (umoe_jax.ops.fused_dispatch).


def _row_index_backend(monkeypatch, calls=None):
  """A CPU backend that takes the `row_index` arguments itself (as the Triton kernels do), so the
  fused ops' index / scale plumbing is exercised without a GPU, `scaled_row_dot` included (each
  call appended to `calls` if given). Registered for the calling test only (a backend left in the
  registry would reach tests that list every registered backend)."""
  from umoe_jax.ops import gmm as G
  name = "test_row_index"
  xla = G.BACKENDS.get("xla")

  acts = {"silu": jax.nn.silu, "relu": jax.nn.relu}
  # the derivative by autodiff of the scalar function: independent of fused_dispatch's formulas
  grad_of = lambda name: jnp.vectorize(jax.grad(acts[name]))

  def gmm_ri(lhs, rhs, gs, *, transpose_rhs, out_dtype, lhs_index=None, row_scale=None,
             row_dot=None, epi_act=None, scaled_row_dot=False):
    if scaled_row_dot:
      if calls is not None:
        calls.append(epi_act)
      z = row_dot if epi_act is None else acts[epi_act](row_dot).astype(row_dot.dtype)
      out, dots = gmm_ri(lhs, rhs, gs, transpose_rhs=transpose_rhs, out_dtype=out_dtype,
                         lhs_index=lhs_index, row_scale=row_scale, row_dot=row_dot, epi_act=epi_act)
      return out, dots, (z * row_scale[:, None]).astype(row_dot.dtype)
    if lhs_index is not None:
      lhs = jnp.take(lhs, lhs_index, axis=0)
    out = xla.gmm(lhs, rhs, gs, transpose_rhs=transpose_rhs, out_dtype=jnp.float32)
    dots = None
    if row_dot is not None:
      dots = jnp.einsum("md,md->m", out, row_dot if epi_act is None else acts[epi_act](row_dot))
      if epi_act is not None:
        out = out * grad_of(epi_act)(row_dot)
    if row_scale is not None:
      out = out * row_scale[:, None]
    return out.astype(out_dtype) if row_dot is None else (out.astype(out_dtype), dots)

  def tgmm_ri(lhs, rhs, gs, *, num_groups, out_dtype, lhs_index=None, rhs_index=None,
              lhs_scale=None):
    lhs = lhs if lhs_index is None else jnp.take(lhs, lhs_index, axis=0)
    rhs = rhs if rhs_index is None else jnp.take(rhs, rhs_index, axis=0)
    if lhs_scale is not None:
      lhs = lhs * lhs_scale[:, None]
    return xla.tgmm(lhs, rhs, gs, num_groups=num_groups, out_dtype=out_dtype)

  monkeypatch.setitem(G.BACKENDS._entries, name, G.GmmBackend(
      gmm=gmm_ri, tgmm=tgmm_ri, platforms=("cpu",), auto_priority=-1, row_index=True,
      fused_activations=tuple(acts), scaled_row_dot=True))
  return name


def _combine_inputs(seed):
  """Random routing with masked slots (ids, mask [N, K]), pre-activations z [N*K, F], w_down
  [E, F, D], gates [N, K] (0 at masked slots) and a cotangent [N, D], float32."""
  rng = np.random.default_rng(seed)
  ids = jnp.asarray(ID_CASES["random"])
  mask = jnp.asarray(rng.random(ids.shape) > 0.2)
  z = jnp.asarray(rng.standard_normal((N * KS, F)), jnp.float32)
  w2 = jnp.asarray(rng.standard_normal((E, F, D)) / 3, jnp.float32)
  gates = jnp.asarray(rng.random((N, KS)), jnp.float32) * mask
  cot = jnp.asarray(rng.standard_normal((N, D)), jnp.float32)
  return ids, mask, z, w2, gates, cot


@pytest.mark.parametrize("backend", ["xla", "row_index"])
@pytest.mark.parametrize("activation", ["silu", "relu"])
def test_gmm_combine_with_the_activation_inside(backend, activation, monkeypatch):
  """gmm_combine(z, activation=act) (`moe.fuse_activation`) equals gmm_combine(act(z)): values and
  the gradients of z, the gates and the weight, float32, random routing with a masked slot; on a
  backend that takes the activation into its kernels (row_index) and on one where XLA does it."""
  from umoe_jax.ops import fused_dispatch
  backend = _row_index_backend(monkeypatch) if backend == "row_index" else backend
  ids, mask, z, w2, gates, cot = _combine_inputs(21)
  act = {"silu": jax.nn.silu, "relu": jax.nn.relu}[activation]

  def fused(z, gates, w2):
    plan = dispatch.make_plan(ids, E, mask)
    return fused_dispatch.gmm_combine(z, w2, plan, gates, backend=backend, activation=activation)

  def plain(z, gates, w2):
    plan = dispatch.make_plan(ids, E, mask)
    return fused_dispatch.gmm_combine(act(z), w2, plan, gates, backend=backend)

  args = (z, gates, w2)
  assert rel_err(jax.jit(fused)(*args), jax.jit(plain)(*args)) < 1e-6
  loss = lambda f: lambda *a: jnp.sum(f(*a) * cot)
  got = jax.jit(jax.grad(loss(fused), argnums=(0, 1, 2)))(*args)
  want = jax.jit(jax.grad(loss(plain), argnums=(0, 1, 2)))(*args)
  for name, a, b in zip(("z", "gates", "w_down"), got, want):
    assert rel_err(a, b) < 1e-6, name
  with pytest.raises(ValueError, match="activation='gelu'"):
    fused_dispatch.gmm_combine(z, w2, dispatch.make_plan(ids, E), gates, activation="gelu")


@pytest.mark.parametrize("backend", ["xla", "row_index"])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_gmm_combine_weight_rows_from_the_epilogue(backend, activation, monkeypatch):
  """gmm_combine(fuse_weight_rows=True) (`moe.fuse_weight_rows`: the weight gradient's gate-scaled
  rows from the input-gradient matmul's epilogue) gives the values and gradients of the XLA-pass
  form exactly (float32, random routing with masked slots; with and without the activation
  inside), and on a backend with `scaled_row_dot` the epilogue is asked for them."""
  from umoe_jax.ops import fused_dispatch
  calls = []
  backend = _row_index_backend(monkeypatch, calls) if backend == "row_index" else backend
  ids, mask, z, w2, gates, cot = _combine_inputs(23)

  def combine(fuse):
    def f(z, gates, w2):
      plan = dispatch.make_plan(ids, E, mask)
      return fused_dispatch.gmm_combine(z, w2, plan, gates, backend=backend, activation=activation,
                                        fuse_weight_rows=fuse)
    return f

  args = (z, gates, w2)
  assert rel_err(jax.jit(combine(True))(*args), jax.jit(combine(False))(*args)) == 0
  loss = lambda f: lambda *a: jnp.sum(f(*a) * cot)
  got = jax.jit(jax.grad(loss(combine(True)), argnums=(0, 1, 2)))(*args)
  want = jax.jit(jax.grad(loss(combine(False)), argnums=(0, 1, 2)))(*args)
  for name, a, b in zip(("z", "gates", "w_down"), got, want):
    assert np.abs(np.asarray(b)).max() > 0, name
    assert rel_err(a, b) < 1e-6, name
  assert calls == ([activation] if isinstance(backend, str) and backend.startswith("test_") else [])


@pytest.mark.parametrize("backend", ["xla", "row_index"])
@pytest.mark.parametrize("per_slot", [False, True, "in_place"])
@pytest.mark.parametrize("case", list(ID_CASES))
def test_fused_dispatch_matches_apply_experts(backend, per_slot, case, monkeypatch):
  """gather_gmm + gmm_combine: values and every gradient (x, gates, both weights) equal the
  unfused permute -> gmm -> gmm -> unpermute -> combine, float32, on fresh random inputs.
  "in_place": the slot rows sit at 1..K of x [N, K + 2, D] (`first_slot=1`, as pre-mixing reads
  its routed mixed vectors): x's gradient is zero at the other rows."""
  from umoe_jax.ops import fused_dispatch
  backend = _row_index_backend(monkeypatch) if backend == "row_index" else backend
  ids = jnp.asarray(ID_CASES[case])
  rng = np.random.default_rng(11)
  w1, w2 = (jnp.asarray(w) for w in _expert_weights(12))
  shape = {False: (N, D), True: (N, KS, D), "in_place": (N, KS + 2, D)}[per_slot]
  x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
  first = 1 if per_slot == "in_place" else 0
  gates = jnp.asarray(rng.random((N, KS)), jnp.float32)
  cot = jnp.asarray(rng.standard_normal((N, D)), jnp.float32)

  def fused(x, gates, w1, w2):
    plan = dispatch.make_plan(ids, E)
    h = jax.nn.silu(fused_dispatch.gather_gmm(x, w1, plan, KS, backend=backend, first_slot=first))
    return fused_dispatch.gmm_combine(h, w2, plan, gates, backend=backend)

  def unfused(x, gates, w1, w2):
    plan = dispatch.make_plan(ids, E)
    fn = lambda rows, gs: gmm(jax.nn.silu(gmm(rows, w1, gs, backend="xla")), w2, gs, backend="xla")
    rows = x[:, first:first + KS] if per_slot == "in_place" else x
    return dispatch.apply_experts(rows, plan, gates, fn)

  args = (x, gates, w1, w2)
  assert rel_err(jax.jit(fused)(*args), jax.jit(unfused)(*args)) < 1e-6
  loss = lambda f: lambda *a: jnp.sum(f(*a) * cot)
  got = jax.jit(jax.grad(loss(fused), argnums=(0, 1, 2, 3)))(*args)
  want = jax.jit(jax.grad(loss(unfused), argnums=(0, 1, 2, 3)))(*args)
  for name, a, b in zip(("x", "gates", "w_up", "w_down"), got, want):
    assert rel_err(a, b) < 1e-6, name


def test_fused_dispatch_rejects_bad_shapes():
  from umoe_jax.ops import fused_dispatch
  plan = dispatch.make_plan(jnp.asarray(ID_CASES["random"]), E)
  w1, w2 = (jnp.asarray(w) for w in _expert_weights(1))
  with pytest.raises(ValueError, match=r"\[N, 3, D\]"):
    fused_dispatch.gather_gmm(jnp.zeros((N, 2, D)), w1, plan, KS)
  with pytest.raises(ValueError, match=r"\[N, 4, D\]"):  # slots 1..3 need 4 rows per token
    fused_dispatch.gather_gmm(jnp.zeros((N, 3, D)), w1, plan, KS, first_slot=1)
  with pytest.raises(ValueError, match="does not fit"):
    fused_dispatch.gather_gmm(jnp.zeros((N, D + 1)), w1, plan, KS)
  with pytest.raises(ValueError, match=r"h \[30, F\]"):
    fused_dispatch.gmm_combine(jnp.zeros((N, F)), w2, plan, jnp.zeros((N, KS)))
