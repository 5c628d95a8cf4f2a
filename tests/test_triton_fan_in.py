"""CPU tests of the fan-in kernel (kernels/gmm/triton_fan_in.py) and of the fused dispatch's use of a
backend's `gather_sum` (umoe_jax/ops/fused_dispatch.py): the launch geometry, and under the Triton
interpreter (TRITON_INTERPRET=1, in a subprocess; launches through `jax.pure_callback`): the kernel
against a float64 numpy loop on fresh random rows (tokens and widths not multiples of the block,
K = 1 to 15, repeated indices, weights in float16 and float32, float16 and float32 rows, the
output poisoned with NaN first), and gather_gmm / gmm_combine with the kernel as the backend's
fan-in against the same ops without it (values and gradients, masked slots)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import run_in_triton_interpreter
from kernels.gmm import triton_fan_in as fi


def test_launch_params_cover_every_token_and_column():
  for n, k, d, cfg in ((37, 15, 768, fi.FanInConfig()), (5, 1, 300, fi.FanInConfig(4, 128)),
                       (32768, 15, 768, fi.FanInConfig()), (3, 2, 8, fi.FanInConfig(16, 256))):
    p = fi.launch_params(n, k, d, cfg)
    (gn, gd), bn, bd = p["grid"], p["BLOCK_N"], p["BLOCK_D"]
    assert gn * bn >= n > (gn - 1) * bn and gd * bd >= d > (gd - 1) * bd, (n, d, p)
    assert bd & (bd - 1) == 0 and bd <= cfg.block_d
  assert fi.launch_params(3, 2, 8)["BLOCK_D"] == 16  # no wider than the rows (at least 16)
  with pytest.raises(ValueError, match="block_n=12 must be a power of two"):
    fi.launch_params(4, 2, 64, fi.FanInConfig(block_n=12))
  with pytest.raises(ValueError, match=r"weights \(4, 3\) must match index \(4, 2\)"):
    fi.gather_sum(jnp.zeros((8, 4)), jnp.zeros((4, 2), jnp.int32), jnp.zeros((4, 3)))


# ----------------------------------------------------------------------------------------------
# Under the interpreter (a fresh process: TRITON_INTERPRET must be set before Triton is imported).

LAUNCHES = []

KERNEL_CASES = [  # tokens N, slots K, width D, block_n, block_d, rows dtype, weights dtype or None
    (37, 15, 300, 16, 128, "float16", None),
    (37, 15, 300, 16, 128, "float16", "float16"),
    (20, 3, 64, 8, 256, "float32", "float32"),
    (9, 1, 40, 4, 32, "float32", None),
    (1, 4, 17, 16, 16, "float16", "float32"),
]


def _interpreter_launch(kernel, grid, args, out_shape, num_warps=None, **meta):
  """`triton_fan_in._launch` through the interpreter; the output poisoned with NaN first."""
  from test_kernels import _NpTensor

  def host(*arrays):
    out = _NpTensor(np.full(out_shape.shape, np.nan, out_shape.dtype))
    kernel[grid](*(_NpTensor(np.asarray(a)) for a in arrays), out, **meta)
    return out.arr

  LAUNCHES.append(meta)
  return jax.pure_callback(host, out_shape, *args)


def _fused_ops_with_and_without(backend_name):
  """gather_gmm and gmm_combine (values and gradients) of fresh float32 inputs with masked slots,
  through `backend_name`."""
  from umoe_jax.ops import dispatch, fused_dispatch as fd
  rng = np.random.default_rng(5)
  n, k, e, d, f = 23, 4, 6, 24, 20
  ids = rng.integers(0, e, (n, k)).astype(np.int32)
  mask = rng.random((n, k)) > 0.2
  plan = dispatch.make_plan(jnp.asarray(ids), e, jnp.asarray(mask))
  x = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
  w1 = jnp.asarray(rng.standard_normal((e, d, f)) / np.sqrt(d), jnp.float32)
  w2 = jnp.asarray(rng.standard_normal((e, f, d)) / np.sqrt(f), jnp.float32)
  gates = jnp.asarray(rng.random((n, k)) * mask, jnp.float32)
  cot = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)

  def loss(x, w1, w2, gates):
    h = jax.nn.silu(fd.gather_gmm(x, w1, plan, k, backend=backend_name))
    return jnp.sum(fd.gmm_combine(h, w2, plan, gates, backend=backend_name) * cot)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x, w1, w2, gates)


def _combine_16bit(backend_name):
  """gmm_combine's output of float16 rows and weights with float32 gates (fresh random)."""
  from umoe_jax.ops import dispatch, fused_dispatch as fd
  rng = np.random.default_rng(11)
  n, k, e, f, d = 40, 5, 6, 16, 32
  plan = dispatch.make_plan(jnp.asarray(rng.integers(0, e, (n, k)), jnp.int32), e)
  h = jnp.asarray(rng.standard_normal((n * k, f)), jnp.float16)
  w = jnp.asarray(rng.standard_normal((e, f, d)) / 4, jnp.float16)
  gates = jnp.asarray(rng.random((n, k)), jnp.float32)
  return np.asarray(jax.jit(lambda h, w, g: fd.gmm_combine(h, w, plan, g, backend=backend_name))(h, w, gates))


def _interpreter_check():
  from umoe_jax.ops import gmm as gmm_api
  fi._launch = _interpreter_launch
  fi.available = lambda: True

  for n, k, d, bn, bd, rows_dtype, w_dtype in KERNEL_CASES:
    rng = np.random.default_rng(n * k + d)
    m = n * k + 5
    rows = rng.standard_normal((m, d)).astype(np.float32)
    index = rng.integers(0, m, (n, k)).astype(np.int32)
    index[0, :] = index[0, 0]  # a row read by every slot of a token
    weights = None if w_dtype is None else rng.uniform(-1, 1, (n, k)).astype(np.float32)
    rows = rows.astype(rows_dtype)  # (the interpreter's arrays are numpy's: float16 for 16 bits)
    if w_dtype is not None:
      weights = weights.astype(w_dtype)
    case = f"N={n} K={k} D={d} block={bn}x{bd} {rows_dtype} weights={w_dtype}"
    got = jax.jit(lambda r, i, w: fi.gather_sum(r, i, w, config=fi.FanInConfig(bn, bd)))(
        jnp.asarray(rows), jnp.asarray(index), None if weights is None else jnp.asarray(weights))
    assert got.dtype == rows.dtype and got.shape == (n, d), case
    w64 = np.ones((n, k)) if weights is None else weights.astype(np.float64)
    exact = np.zeros((n, d))
    for t in range(n):  # the naive loop
      for s in range(k):
        exact[t] += w64[t, s] * rows[index[t, s]].astype(np.float64)
    got64 = np.asarray(got, np.float64)
    assert np.all(np.isfinite(got64)), case  # every output written
    step = 2.0 ** -10 if rows_dtype == "float16" else 1e-6  # one rounding of the float32 sum
    scale = np.abs(w64)[:, :, None] * np.abs(rows[index].astype(np.float64))
    np.testing.assert_array_less(np.abs(got64 - exact), step * scale.sum(1) + 1e-30, err_msg=case)
  assert len(LAUNCHES) == len(KERNEL_CASES)

  # The fused dispatch with the kernel as its backend's fan-in: same values and gradients as
  # without (float32: only the summation order differs), and the kernel ran.
  xla = gmm_api.BACKENDS.get("xla")
  gmm_api.BACKENDS.register("xla+fan_in")(dataclasses.replace(xla, gather_sum=fi.gather_sum))
  n0 = len(LAUNCHES)
  (want_loss, want_grads) = _fused_ops_with_and_without("xla")
  (got_loss, got_grads) = _fused_ops_with_and_without("xla+fan_in")
  assert len(LAUNCHES) - n0 == 2, LAUNCHES[n0:]  # the combine forward, the input gradient's fan-in
  assert [meta["WEIGHTED"] for meta in LAUNCHES[n0:]] == [True, False]
  np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
  for name, g, w in zip(("x", "w1", "w2", "gates"), got_grads, want_grads):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5, err_msg=name)
  # 16-bit rows with float32 gates: the kernel gets the gates rounded to the rows' dtype, as
  # `dispatch.combine` takes them, so the two combines agree to the output's last bit (but for a
  # float32 summation-order flip now and then); unrounded gates would move ~half the outputs.
  outs = [_combine_16bit(name) for name in ("xla", "xla+fan_in")]
  assert np.mean(outs[0] == outs[1]) > 0.98, np.mean(outs[0] == outs[1])
  print("TRITON_FAN_IN_INTERPRETER_OK")


@pytest.mark.extras("triton")
def test_kernel_in_interpreter_matches_float64_loop():
  run_in_triton_interpreter("test_triton_fan_in", "_interpreter_check", "TRITON_FAN_IN_INTERPRETER_OK")
