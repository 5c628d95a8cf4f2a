"""fp8_gmm.MIN_CONTRACTION: under train.precision=fp8, a product whose contraction is shorter than it
takes bf16 operands by the backend's bf16 gmm, in `fp8_gmm` (forward, input gradient) and in the
fused dispatch's two matmuls (the first one's forward, the last one's forward and its u product);
the rest stay FP8. Checked by which of a recording backend's products run, at which contraction,
and by values: a product the threshold moves equals the bf16 path's, one it leaves equals the
switch-off FP8 path's."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from umoe_jax.ops import dispatch, fp8_gmm as F, gmm_backends, ragged
from umoe_jax.ops.fused_dispatch import gather_gmm, gmm_combine
from umoe_jax.ops.gmm import gmm
from umoe_jax.model.expert_mlp import routed_mlp


@pytest.fixture
def recorded(monkeypatch):
  jax.clear_caches()
  """A backend "rec" over the xla backend's forms that records each product: ("fp8", K) for an FP8
  gmm contracting over K, ("bf16", K) for a bf16 one; [] to read and clear."""
  calls = []
  xla = gmm_backends.BACKENDS.get("xla")

  def fp8_form(lhs_q, lhs_s, rhs_q, rhs_s, gs, *, transpose_rhs, **kw):
    calls.append(("fp8", lhs_q.shape[1]))
    return xla.fp8_gmm(lhs_q, lhs_s, rhs_q, rhs_s, gs, transpose_rhs=transpose_rhs, **kw)

  def bf16_form(lhs, rhs, gs, *, transpose_rhs, **kw):
    calls.append(("bf16", lhs.shape[1]))
    return xla.gmm(lhs, rhs, gs, transpose_rhs=transpose_rhs, **kw)

  rec = dataclasses.replace(xla, gmm=bf16_form, fp8_gmm=fp8_form, tgmm=ragged.xla_tgmm)
  monkeypatch.setitem(gmm_backends.BACKENDS._entries, "rec", rec)
  monkeypatch.setattr(F, "AUTO_FP8", F.AUTO_FP8 | {"rec"})
  return calls


def _threshold(monkeypatch, value):
  """Sets the switch and drops jax's traces: it is read when a product is traced."""
  monkeypatch.setattr(F, "MIN_CONTRACTION", value)
  jax.clear_caches()


def _data(seed, m, k, n, g=3):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(g, k, n)) / np.sqrt(k), jnp.float32)
  dy = jnp.asarray(rng.normal(size=(m, n)), jnp.float32)
  sizes = rng.multinomial(m - 5, np.ones(g) / g)        # ragged, 5 rows past the groups
  return x, w, dy, jnp.asarray(sizes, jnp.int32)


def _step(x, w, dy, gs, backend="rec"):
  y, pull = jax.vjp(lambda a, b: F.fp8_gmm(a, b, gs, backend=backend), x, w)
  return (y, *pull(dy))


def _equal(a, b):
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("k,n", [(384, 192), (192, 384)])
def test_fp8_gmm_takes_bf16_where_the_contraction_is_short(monkeypatch, recorded, k, n):
  x, w, dy, gs = _data(1, 96, k, n)
  y_fp8, dx_fp8, dw_fp8 = _step(x, w, dy, gs)
  assert sorted(recorded) == sorted([("fp8", k), ("fp8", n)])   # off: both products in FP8
  recorded.clear()
  y_bf, pull = jax.vjp(lambda a, b: gmm(a, b, gs, backend="xla"), x, w)
  dx_bf, dw_bf = pull(dy)
  _threshold(monkeypatch, 256)
  y, dx, dw = _step(x, w, dy, gs)
  assert sorted(recorded) == sorted([("fp8" if k >= 256 else "bf16", k),
                                     ("fp8" if n >= 256 else "bf16", n)])
  _equal(y, y_fp8 if k >= 256 else y_bf)        # the forward contracts over k
  _equal(dx, dx_fp8 if n >= 256 else dx_bf)     # the input gradient over n
  _equal(dw, dw_fp8)                            # the weight gradient is bf16 either way
  assert float(jnp.max(jnp.abs(y_fp8 - y_bf))) > 0 and float(jnp.max(jnp.abs(dx_fp8 - dx_bf))) > 0
  recorded.clear()
  _threshold(monkeypatch, min(k, n))     # the bound itself is FP8
  _step(x, w, dy, gs)
  assert sorted(recorded) == sorted([("fp8", k), ("fp8", n)])


def _pool(x, w_up, w_down, plan, gates, dy, backend="rec", fp8_on=True):
  def f(x, w_up, w_down):
    return routed_mlp(x, plan, gates, w_up, w_down, activation="silu", backend=backend,
                      fuse_activation=True, fp8=fp8_on)
  y, pull = jax.vjp(f, x, w_up, w_down)
  return (y, *pull(dy))


def _pool_data(seed, n_tok=40, d=384, f=192, e=4, k=2):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(n_tok, d)), jnp.float32)
  w_up = jnp.asarray(rng.normal(size=(e, d, f)) / np.sqrt(d), jnp.float32)
  w_down = jnp.asarray(rng.normal(size=(e, f, d)) / np.sqrt(f), jnp.float32)
  plan = dispatch.make_plan(jnp.asarray(rng.integers(0, e, (n_tok, k)), jnp.int32), e)
  gates = jnp.asarray(rng.dirichlet(np.ones(k), n_tok), jnp.float32)
  dy = jnp.asarray(rng.normal(size=(n_tok, d)), jnp.float32)
  return x, w_up, w_down, plan, gates, dy


def test_the_expert_pool_takes_bf16_for_its_short_contractions(monkeypatch, recorded):
  """UMoE-base's shape in small (D = 384, F = 192, threshold 256): the first matmul's forward and
  the last one's u product (over D) stay FP8; the last one's forward and the first one's input
  gradient (over F) take bf16, and the first matmul then hands the last one no FP8 tiles."""
  x, w_up, w_down, plan, gates, dy = _pool_data(2)
  _pool(x, w_up, w_down, plan, gates, dy)
  assert sorted(recorded) == [("fp8", 192), ("fp8", 192), ("fp8", 384), ("fp8", 384)]
  recorded.clear()
  _threshold(monkeypatch, 256)
  got = _pool(x, w_up, w_down, plan, gates, dy)
  assert sorted(recorded) == [("bf16", 192), ("bf16", 192), ("fp8", 384), ("fp8", 384)]
  # Against a float64 pool with the FP8 products' operands on the FP8 grid and the rest exact.
  want = _pool(x, w_up, w_down, plan, gates, dy, backend="xla", fp8_on=False)
  for a, b in zip(got, want):
    err = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
    assert 1e-4 < err < 0.05, err          # FP8 in two products, not in none, not broken


def test_every_product_in_bf16_is_the_bf16_pool(monkeypatch, recorded):
  """A threshold above every contraction leaves no FP8 product: the pool's values and gradients
  are the bf16 form's (to float32 rounding: the FP8 form's algebra sums its u product in float32)."""
  x, w_up, w_down, plan, gates, dy = _pool_data(3)
  _threshold(monkeypatch, 10**6)
  got = _pool(x, w_up, w_down, plan, gates, dy)
  assert {kind for kind, _ in recorded} == {"bf16"}
  want = _pool(x, w_up, w_down, plan, gates, dy, backend="xla", fp8_on=False)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
  recorded.clear()   # the single matmuls too
  h = gather_gmm(x, w_up, plan, 2, backend="rec", fp8=True)
  _equal(h, gather_gmm(x, w_up, plan, 2, backend="xla"))
  _equal(gmm_combine(h, w_down, plan, gates, backend="rec", fp8=True),
         gmm_combine(h, w_down, plan, gates, backend="xla"))
