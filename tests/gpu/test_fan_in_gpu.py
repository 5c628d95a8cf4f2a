"""GPU check of the fan-in kernel (kernels/gmm/triton_fan_in.py) against a float64 numpy sum: bf16 rows
at the UMoE-base fan-in's width (768) and a width not a multiple of the block, tokens not a
multiple of the block, K = 15 and 3, plain and gate-weighted, the inverse permutation of a real
dispatch plan as the index. The fused dispatch with the kernel is checked by
tests/gpu/test_gmm_gpu.py::test_fused_dispatch_matches_float32_reference. Timing: bench/gmm.py.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gpu_tiers

from kernels.gmm import triton_fan_in as fi
from umoe_jax.ops import dispatch

QUICK = pytest.mark.gpu_quick   # the quick tier: `pytest -m gpu_quick tests/gpu`

pytestmark = pytest.mark.skipif(not fi.available(), reason="needs a GPU with Triton and jax-triton")


@pytest.mark.parametrize("shape,weighted", gpu_tiers.product(((4099, 15, 768), True),
                                                           [(4099, 15, 768), (1000, 3, 300)], [False, True]))
def test_kernel_matches_float64_sum(shape, weighted):
  n, k, d = shape
  rng = np.random.default_rng(n + k + d + weighted)
  ids = jnp.asarray(rng.integers(0, 64, (n, k)), jnp.int32)
  index = dispatch.make_plan(ids, 64).inverse.reshape(n, k)            # a permutation of n*k rows
  rows = jnp.asarray(rng.standard_normal((n * k, d)), jnp.bfloat16)
  weights = jnp.asarray(rng.uniform(0, 1, (n, k)), jnp.bfloat16) if weighted else None
  got = np.asarray(jax.jit(fi.gather_sum)(rows, index, weights), np.float64)
  r64 = np.asarray(rows, np.float64)[np.asarray(index)]                # [n, k, d]
  w64 = np.ones((n, k)) if weights is None else np.asarray(weights, np.float64)
  exact = np.einsum("nkd,nk->nd", r64, w64)
  bound = 2.0 ** -8 * np.einsum("nkd,nk->nd", np.abs(r64), np.abs(w64))  # one bf16 rounding
  assert np.all(np.abs(got - exact) <= bound + 1e-30)
  # The kernel's float32 sum in slot order, rounded once: numpy's float32 loop in the same order,
  # equal but for fused multiply-adds of the weighted sum flipping a rounding now and then.
  acc = np.zeros((n, d), np.float32)
  for s in range(k):
    acc += r64[:, s].astype(np.float32) * w64[:, s, None].astype(np.float32)
  want = np.asarray(jnp.asarray(acc, jnp.bfloat16), np.float64)
  assert np.mean(got == want) > (0.99 if weighted else 0.9999)
