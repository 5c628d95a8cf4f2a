"""Grouped matmul (`xla` and `masked` backends) against per-group loops, incl. empty groups, padding
rows past sum(group_sizes), transpose_rhs, tgmm, and gradients against a dense per-group reference."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import rel_err
from umoe_jax.ops import gmm as G

BACKENDS = ["xla", "masked"]
M, K, N, NG = 13, 6, 5, 5
# (group sizes, number of padding rows = M - sum): empty groups in the middle, at both ends, all rows
# in one group, every row padding.
GROUP_CASES = [
    [3, 0, 5, 0, 2],
    [0, 4, 4, 5, 0],
    [13, 0, 0, 0, 0],
    [0, 0, 0, 0, 13],
    [2, 2, 2, 2, 2],
    [0, 0, 0, 0, 0],
]


@functools.partial(jax.jit, static_argnames=("backend", "transpose_rhs"))
def _gmm(lhs, rhs, gs, backend, transpose_rhs=False):
  return G.gmm(lhs, rhs, gs, backend=backend, transpose_rhs=transpose_rhs)


@functools.partial(jax.jit, static_argnames=("backend",))
def _tgmm(lhs, rhs, gs, backend):
  return G.tgmm(lhs, rhs, gs, backend=backend)


def _loop_gmm(x, w, gs, transpose_rhs=False):
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
  out_dim = w.shape[1] if transpose_rhs else w.shape[2]
  out = np.zeros((x.shape[0], out_dim))
  row = 0
  for g, n in enumerate(gs):
    wg = w[g].T if transpose_rhs else w[g]
    for _ in range(n):
      out[row] = x[row] @ wg
      row += 1
  return out


def _loop_tgmm(a, b, gs):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  out = np.zeros((len(gs), a.shape[1], b.shape[1]))
  row = 0
  for g, n in enumerate(gs):
    for _ in range(n):
      out[g] += np.outer(a[row], b[row])
      row += 1
  return out


def _inputs(seed, transpose_rhs=False):
  rng = np.random.default_rng(seed)
  lhs = rng.standard_normal((M, N if transpose_rhs else K)).astype(np.float32)  # padding rows too
  rhs = rng.standard_normal((NG, K, N)).astype(np.float32)
  return lhs, rhs


def _close(out, ref, bound):
  if np.linalg.norm(ref) == 0:
    assert np.all(np.asarray(out) == 0)
  else:
    assert rel_err(out, ref) < bound


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gmm_against_loop(backend, transpose_rhs):
  for i, gs in enumerate(GROUP_CASES):
    lhs, rhs = _inputs(i, transpose_rhs)
    out = np.asarray(_gmm(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(gs, jnp.int32), backend,
                          transpose_rhs))
    assert out.shape == (M, K if transpose_rhs else N)
    _close(out, _loop_gmm(lhs, rhs, gs, transpose_rhs), 1e-6)
    used = sum(gs)
    assert np.all(out[used:] == 0), f"padding rows must be zero (group sizes {gs})"


@pytest.mark.parametrize("backend", BACKENDS)
def test_tgmm_against_loop(backend):
  for i, gs in enumerate(GROUP_CASES):
    rng = np.random.default_rng(100 + i)
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((M, N)).astype(np.float32)
    used = sum(gs)
    a[used:] = 1e3  # garbage in the padding rows must not leak into any group
    out = np.asarray(_tgmm(jnp.asarray(a), jnp.asarray(b), jnp.asarray(gs, jnp.int32), backend))
    assert out.shape == (NG, K, N)
    ref = _loop_tgmm(a, b, gs)
    _close(out, ref, 1e-6)
    for g, n in enumerate(gs):
      if n == 0:
        assert np.all(out[g] == 0), f"empty group {g} must be zero"


@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_agree_and_bfloat16(backend):
  gs = [3, 0, 5, 0, 2]
  lhs, rhs = _inputs(7)
  out = G.gmm(jnp.asarray(lhs, jnp.bfloat16), jnp.asarray(rhs, jnp.bfloat16),
              jnp.asarray(gs, jnp.int32), backend=backend)
  assert out.dtype == jnp.bfloat16
  assert rel_err(np.asarray(out, np.float32), _loop_gmm(lhs, rhs, gs)) < 1e-2
  out32 = G.gmm(jnp.asarray(lhs, jnp.bfloat16), jnp.asarray(rhs, jnp.bfloat16),
                jnp.asarray(gs, jnp.int32), backend=backend, preferred_element_type=jnp.float32)
  assert out32.dtype == jnp.float32
  # bf16-rounded inputs, float32 accumulation: matches a float64 loop on the rounded inputs closely
  lr = np.asarray(jnp.asarray(lhs, jnp.bfloat16).astype(jnp.float32))
  rr = np.asarray(jnp.asarray(rhs, jnp.bfloat16).astype(jnp.float32))
  assert rel_err(out32, _loop_gmm(lr, rr, gs)) < 1e-6


def _dense_reference(lhs, rhs, gs, transpose_rhs):
  """Per-group jnp matmuls with static slices (differentiable by plain jax.grad)."""
  out_dim = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  parts, row = [], 0
  for g, n in enumerate(gs):
    w = rhs[g].T if transpose_rhs else rhs[g]
    parts.append(lhs[row:row + n] @ w)
    row += n
  parts.append(jnp.zeros((lhs.shape[0] - row, out_dim), lhs.dtype))
  return jnp.concatenate(parts, axis=0)


@functools.partial(jax.jit, static_argnums=(3, 4))
def _dense_grads(lhs, rhs, cot, gs, transpose_rhs):
  return jax.grad(lambda a, b: jnp.sum(_dense_reference(a, b, gs, transpose_rhs) * cot),
                  argnums=(0, 1))(lhs, rhs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gmm_gradients(backend, transpose_rhs):
  @jax.jit
  def grads_gmm(lhs, rhs, gs, cot):
    return jax.grad(lambda a, b: jnp.sum(G.gmm(a, b, gs, backend=backend,
                                               transpose_rhs=transpose_rhs) * cot),
                    argnums=(0, 1))(lhs, rhs)

  for i, gs in enumerate(GROUP_CASES[:5]):
    lhs, rhs = _inputs(20 + i, transpose_rhs)
    cot = np.random.default_rng(40 + i).standard_normal((M, K if transpose_rhs else N))
    cot = jnp.asarray(cot, jnp.float32)
    got = grads_gmm(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(gs, jnp.int32), cot)
    want = _dense_grads(jnp.asarray(lhs), jnp.asarray(rhs), cot, tuple(gs), transpose_rhs)
    for g_got, g_want, name in zip(got, want, ("lhs", "rhs")):
      assert g_got.shape == g_want.shape
      _close(g_got, g_want, 1e-6)
    assert np.all(np.asarray(got[0])[sum(gs):] == 0), "no gradient into padding rows"
    for g, n in enumerate(gs):
      if n == 0:
        assert np.all(np.asarray(got[1])[g] == 0), "no gradient into an unused expert"


def test_shape_errors():
  lhs = jnp.zeros((4, 3))
  with pytest.raises(ValueError, match="contraction"):
    G.gmm(lhs, jnp.zeros((2, 5, 6)), jnp.array([2, 2]), backend="xla")
  with pytest.raises(ValueError, match="groups"):
    G.gmm(lhs, jnp.zeros((3, 3, 6)), jnp.array([2, 2]), backend="xla")
  with pytest.raises(ValueError, match="integer"):
    G.gmm(lhs, jnp.zeros((2, 3, 6)), jnp.array([2.0, 2.0]), backend="xla")
  with pytest.raises(ValueError, match="tgmm"):
    G.tgmm(lhs, jnp.zeros((5, 2)), jnp.array([2, 2]), backend="xla")


def test_backend_resolution():
  platform = jax.devices()[0].platform
  name = G.resolve_backend("auto")
  assert name in G.BACKENDS and platform in G.BACKENDS.get(name).platforms
  assert G.BACKENDS.get(name).auto_priority >= 0
  assert G.resolve_backend("masked") == "masked"
  with pytest.raises(ValueError, match="'no_such_kernel'"):
    G.resolve_backend("no_such_kernel")


# ----------------------------------------------------------------------------------------------
# shard_map's varying-axes types (kernels behind custom calls lose them; gmm restores them).


def _run_in_subprocess(code: str) -> str:
  import subprocess
  import sys
  import textwrap
  env = dict(__import__("os").environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
  out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       env=env, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout


def test_varying_axes_are_read_and_restored_inside_shard_map():
  """On this jax the helper must see the data axis, and `vary_like` must add it to an invariant value.

  Also: a backend whose outputs come back typed invariant (as Triton/Mosaic custom calls do) still
  differentiates under `shard_map(check_vma=True)` and gives the same values and gradients.
  """
  out = _run_in_subprocess("""
      import functools, jax, jax.numpy as jnp, numpy as np
      from jax.sharding import PartitionSpec as P
      from umoe_jax.ops import gmm as G
      from umoe_jax.ops.varying import varying_axes, vary_like

      mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
      smap = getattr(jax, "shard_map", None)
      kw = dict(mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"))
      seen = {}

      def probe(x, w):
        seen["x"], seen["w"] = varying_axes(x), varying_axes(w)
        seen["w_cast"] = varying_axes(vary_like(w, frozenset({"data"})))
        return x
      smap(probe, **kw, check_vma=True)(jnp.ones((4, 3)), jnp.ones((3,)))
      print("x", sorted(seen["x"]), "w", sorted(seen["w"]), "w_cast", sorted(seen["w_cast"]))

      # A backend that hides the varying type of its results, like a custom call does. Its inputs
      # are replicated values typed as varying, so every device holds the same result, and the mean
      # over the axis (a psum: typed invariant) is exactly this device's own value.
      xla = G.BACKENDS.get("xla")
      def hide(y):
        return jax.lax.psum(y, "data") / 2
      def gmm_raw(lhs, rhs, gs, **k):
        return jax.lax.stop_gradient(hide(xla.gmm(lhs, rhs, gs, **k)))
      def tgmm_raw(lhs, rhs, gs, **k):
        return jax.lax.stop_gradient(hide(xla.tgmm(lhs, rhs, gs, **k)))
      G.BACKENDS.register("hidden_vma")(G.GmmBackend(gmm=gmm_raw, tgmm=tgmm_raw,
                                                     platforms=("cpu",), auto_priority=-1))
      rng = np.random.default_rng(0)
      x = jnp.asarray(rng.normal(size=(12, 8)), jnp.float32)
      w = jnp.asarray(rng.normal(size=(3, 8, 5)), jnp.float32)
      gs = jnp.array([4, 0, 8], jnp.int32)

      def loss(backend):
        def per_device(x, w):
          x, w = vary_like(x, frozenset({"data"})), vary_like(w, frozenset({"data"}))
          return jnp.sum(jnp.sin(G.gmm(x, w, gs, backend=backend)))[None]
        f = smap(per_device, mesh=mesh, in_specs=(P(), P()), out_specs=P("data"), check_vma=True)
        return lambda x, w: jnp.sum(f(x, w))
      ref = jax.value_and_grad(loss("xla"), (0, 1))(x, w)
      got = jax.value_and_grad(loss("hidden_vma"), (0, 1))(x, w)
      err = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)))
      print("max_err", err)
  """)
  assert "x ['data'] w [] w_cast ['data']" in out, out
  err = float(out.split("max_err")[1])
  assert err < 1e-5, out
