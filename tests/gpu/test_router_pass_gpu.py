"""GPU check of the softmax routers' one-pass forward (kernels/triton_router.py, `router.one_pass`)
against a float64 numpy loop and the separate ops, on fresh random logits (E not a power of two, T not
a multiple of the block, k from 1 to E, the selection bias, renormalisation), then the routers of a
tiny config with the switch on and off: the same picks and counts, values and gradients of the router
weights to float32 round-off. Skipped without a GPU (or without jax-triton). Timing: bench/router_pass.py.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gpu_tiers

from kernels import triton_router as tr
from test_router_pass import _check_against_reference, _logits, _router_outputs, assert_routers_agree
from umoe_jax.ops import router_pass

QUICK = pytest.mark.gpu_quick   # the quick tier: `pytest -m gpu_quick tests/gpu`

pytestmark = pytest.mark.skipif(not tr.available(), reason="needs a GPU with Triton and jax-triton")


@pytest.mark.parametrize("shape,options", gpu_tiers.product(
    ((2, 37, 20, 3), (True, True)), [(2, 37, 20, 3), (1, 130, 128, 15), (3, 64, 100, 100),
                                     (2, 1000, 128, 3), (1, 5, 3, 1)], [(False, False), (True, True)]))
def test_kernel_matches_float64(shape, options):
  (b, t, e, k), (with_bias, renormalize) = shape, options
  x = _logits(b * t + e + k, b, t, e)
  bias = np.random.default_rng(e).standard_normal(e).astype(np.float32) * 0.05 if with_bias else None
  for cfg in (None, tr.RouterPassConfig(8, 2), tr.RouterPassConfig(64, 8)):
    probs, ids, gates, sums, counts = jax.jit(lambda v, c, cfg=cfg: tr.softmax_top_k(
        v, k, bias=c, renormalize=renormalize, config=cfg))(x, None if bias is None else jnp.asarray(bias))
    _check_against_reference((probs, ids, gates, np.asarray(sums).sum(1) / t, np.asarray(counts).sum(1)),
                             x, k, bias, renormalize, case=f"{b}x{t}x{e} k={k} {cfg}")


@QUICK
def test_custom_vjp_matches_the_separate_ops_gradient():
  x = jnp.asarray(_logits(5, 4, 300, 128))
  rng = np.random.default_rng(7)
  cots = [jnp.asarray(rng.standard_normal(s).astype(np.float32))
          for s in ((4, 300, 128), (4, 300, 15), (4, 128))]
  for renormalize in (False, True):
    def objective(fn):
      def f(v):
        out = fn(v, 15, renormalize=renormalize)
        return (jnp.sum(out.probs * cots[0]) + jnp.sum(out.gates * cots[1])
                + jnp.sum(out.prob_means * cots[2]))
      return f
    got = jax.jit(jax.grad(objective(router_pass.softmax_top_k)))(x)
    separate = lambda v, k, **kw: router_pass.separate_ops(v, k, topk_backend="xla", **kw)
    want = jax.jit(jax.grad(objective(separate)))(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)


@QUICK
def test_router_switch_on_and_off_agree():
  x = jnp.asarray(np.random.default_rng(9).standard_normal((4, 64, 32)), jnp.float32)
  bias = np.random.default_rng(10).standard_normal(20).astype(np.float32) * 0.05
  for sublayer, keys, b in [("ffn", {}, None), ("attention", dict(renormalize=True), None),
                            ("ffn", dict(bias_update_rate=1e-3, balance_loss="switch"), bias)]:
    on = _router_outputs(sublayer, dict(keys, one_pass=True), x, b, topk_backend="triton")
    off = _router_outputs(sublayer, keys, x, b, topk_backend="triton")
    assert_routers_agree(on, off, f"{sublayer} {keys}")
