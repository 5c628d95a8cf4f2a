"""GPU check of the Triton launches' FFI route (kernels/triton_launch.py): the same kernels launched
through jaxlib's typed-FFI handler give bit-identical results to jax-triton's custom call, and the
compiled program holds the FFI call (and no legacy one). Inputs are fresh random bf16 (never zeros):
the fan-in kernel, a grouped matmul with its gathered rows and row-dot epilogue, a weight gradient,
and the pre-mixing attention core forward + backward. Timing: bench/triton_launch.py and
bench/train_step.py --triton_launch=ROUTE.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.gmm import triton_fan_in as fi
from kernels.gmm import triton_gmm as tg
from kernels import triton_launch
from umoe_jax.ops import dispatch

# Every test here is in the quick tier: each checks one launch route once.
pytestmark = [pytest.mark.skipif(not fi.available(), reason="needs a GPU with Triton and jax-triton"),
              pytest.mark.gpu_quick]


def _both_routes(fn, *args):
  """fn(*args) compiled with each route (a fresh jit each: the route is read at trace time) ->
  [(outputs, compiled HLO text)] for custom_call, ffi."""
  out = []
  for route in triton_launch.ROUTES:
    triton_launch.set_route(route)
    try:
      jitted = jax.jit(lambda *a: fn(*a))
      text = jitted.lower(*args).compile().as_text()
      out.append((jax.tree.map(np.asarray, jitted(*args)), text))
    finally:
      triton_launch.set_route(None)
  return out


def _assert_same(legacy, ffi):
  (got_legacy, text_legacy) = legacy
  assert 'custom_call_target="triton_kernel_call"' in text_legacy
  for (got, text), target in ((ffi, triton_launch.FFI_TARGET),):
    assert f'custom_call_target="{target}"' in text
    assert 'custom_call_target="triton_kernel_call"' not in text
    for a, b in zip(jax.tree.leaves(got_legacy), jax.tree.leaves(got)):
      assert a.dtype == b.dtype and a.shape == b.shape
      np.testing.assert_array_equal(a, b)        # the same kernel on the same inputs: bit-identical


def _plan(rng, n, k, e):
  ids = jnp.asarray(rng.integers(0, e, (n, k)), jnp.int32)
  return dispatch.make_plan(ids, e)


def test_route_is_installed_on_this_gpu():
  assert triton_launch.install(), "jaxlib registers no triton_kernel_call_ffi handler here"


def test_fan_in_both_routes():
  rng = np.random.default_rng(1)
  n, k, d = 2051, 15, 768
  plan = _plan(rng, n, k, 64)
  rows = jnp.asarray(rng.standard_normal((n * k, d)), jnp.bfloat16)
  weights = jnp.asarray(rng.uniform(0.1, 1, (n, k)), jnp.bfloat16)
  index = plan.inverse.reshape(n, k)
  _assert_same(*_both_routes(lambda r, w: fi.gather_sum(r, index, w), rows, weights))


def test_gmm_with_epilogue_and_tgmm_both_routes():
  rng = np.random.default_rng(2)
  n, k, e, d, f = 1500, 4, 16, 256, 192
  plan = _plan(rng, n, k, e)
  x = jnp.asarray(rng.standard_normal((n, d)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((e, f, d)) / 16, jnp.bfloat16)
  z = jnp.asarray(rng.standard_normal((n * k, f)), jnp.bfloat16)
  scale = jnp.asarray(rng.uniform(0.1, 1, (n * k,)), jnp.float32)
  src = plan.order // k

  def step(x, w, z, scale):
    dz, dots = tg.triton_gmm(x, w, plan.group_sizes, transpose_rhs=True, out_dtype=jnp.bfloat16,
                             lhs_index=src, row_scale=scale, row_dot=z, epi_act="silu")
    dw = tg.triton_tgmm(z, x, plan.group_sizes, num_groups=e, out_dtype=jnp.float32, rhs_index=src)
    return dz, dots, dw

  _assert_same(*_both_routes(step, x, w, z, scale))


def test_attention_core_forward_backward_both_routes():
  from kernels.attention import triton_attention as ta
  rng = np.random.default_rng(3)
  b, t, h, dk, d = 2, 320, 4, 64, 192
  q = jnp.asarray(rng.standard_normal((b, t, h, dk)), jnp.bfloat16)
  kk = jnp.asarray(rng.standard_normal((b, t, dk)), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((b, t, d)), jnp.bfloat16)
  dout = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.bfloat16)

  def fwd_bwd(q, kk, v, dout):
    out, vjp = jax.vjp(ta.premix_attention, q, kk, v)
    return out, vjp(dout)

  _assert_same(*_both_routes(fwd_bwd, q, kk, v, dout))
