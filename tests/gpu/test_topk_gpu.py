"""GPU check of the routers' Triton top-k (kernels/router/triton_topk.py, `router.topk_backend="triton"`)
against `jax.lax.top_k` and a numpy stable argsort. Skipped without a GPU (or without jax-triton).

Fresh random inputs: E not a power of two, k from 1 to E, rows not a multiple of the block, heavy
ties, rows with -inf, bf16; then the routers of a tiny config with the switch on and off: the same
ids, gates and gradients of the router weights, bit for bit. Timing: bench/topk.py.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gpu_tiers

from kernels.router import triton_topk as tk
from umoe_jax.ops.topk import top_k_ids

QUICK = pytest.mark.gpu_quick   # the quick tier: `pytest -m gpu_quick tests/gpu`

pytestmark = pytest.mark.skipif(not tk.available(), reason="needs a GPU with Triton and jax-triton")


def _values(rng, n, e, kind):
  if kind == "normal":
    return rng.standard_normal((n, e)).astype(np.float32)
  x = rng.choice(np.asarray([0.0, 0.5, 1.0], np.float32), size=(n, e))
  if kind == "neginf":
    x[rng.random((n, e)) < 0.4] = -np.inf
    x[0] = -np.inf
  return x


@pytest.mark.parametrize("e,kind", gpu_tiers.product((128, "ties"), [8, 20, 100, 128, 256],
                                                     ["normal", "ties", "neginf"]))
def test_kernel_matches_lax_top_k(e, kind):
  rng = np.random.default_rng(e)
  x = jnp.asarray(_values(rng, 1000 + e, e, kind))
  want = np.argsort(-np.asarray(x, np.float64), axis=-1, kind="stable")
  for k in sorted({1, 3, min(15, e), e}):
    for cfg in (None,) if k == e else (None, tk.TopKConfig(8, 2), tk.TopKConfig(64, 8)):
      got = np.asarray(jax.jit(lambda v, k=k, c=cfg: tk.top_k_ids(v, k, config=c))(x))
      np.testing.assert_array_equal(got, want[:, :k], err_msg=f"E={e} k={k} {kind} {cfg}")
    np.testing.assert_array_equal(np.asarray(jax.lax.top_k(x, k)[1]), want[:, :k])
  xb = x.astype(jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(top_k_ids(xb.reshape(2, -1, e), 3, backend="triton")),
                                np.asarray(jax.lax.top_k(xb.reshape(2, -1, e), 3)[1]))


@QUICK
def test_router_switch_on_and_off_agree():
  from flax import nnx
  from configs import common as configs
  from umoe_jax.config import model_config
  from umoe_jax.model.routers import make_router
  m = configs.model("umoe", "tiny")
  m.moe.n_experts = 20
  cfg = model_config(m)
  x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 64, cfg.d_model)), jnp.float32)
  outs = {}
  for backend in ("xla", "triton"):
    router = make_router(dataclasses.replace(cfg.router_for("ffn"), topk_backend=backend),
                         cfg.d_model, cfg.moe.n_experts, cfg.ffn.top_k, param_dtype="float32",
                         rngs=nnx.Rngs(params=0))
    graphdef, params, rest = nnx.split(router, nnx.Param, ...)
    cot = jnp.cos(jnp.arange(x.shape[0] * x.shape[1] * cfg.ffn.top_k)).reshape(*x.shape[:2], -1)

    def loss(params):
      out = nnx.merge(graphdef, params, rest)(x)
      return jnp.sum(out.gates * cot) + out.balance_loss, out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    outs[backend] = (out.expert_ids, out.gates, *jax.tree.leaves(grads))
  for a, b in zip(outs["triton"], outs["xla"]):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
