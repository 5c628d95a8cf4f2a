"""CPU tests of the routers' top-k ids (umoe_jax/ops/topk.py, kernels/router/triton_topk.py): the backend
choice and its fallback, `router.topk_backend` in the config, the launch geometry, and the Triton
kernel under the interpreter (TRITON_INTERPRET=1, in a subprocess), every launch routed through
`jax.pure_callback` into the interpreter: against `jax.lax.top_k` and a numpy stable argsort on
fresh random inputs (E not a power of two, k from 1 to E, rows not a multiple of the block, heavy
ties, rows with -inf, signed zeros and NaN), through the JAX entry on [B, T, E], and the routers of
a tiny config with topk_backend="triton" against "xla" (ids, gates, losses and the gradients of
the router weights, bit for bit). GPU timing and the on-device check: bench/topk.py.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import run_in_triton_interpreter
from kernels.router import triton_topk as tk
from umoe_jax.kinds import TOPK_BACKENDS
from umoe_jax.ops import topk as topk_api


def _argsort_ids(x, k):
  """numpy reference: descending, ties toward the lower index (a stable sort of -x)."""
  return np.argsort(-np.asarray(x, np.float64), axis=-1, kind="stable")[..., :k].astype(np.int32)


def test_top_k_ids_off_gpu_is_lax_top_k_for_every_backend():
  """On this machine every backend answers with lax.top_k's ids (the kernel needs a GPU), on any
  leading shape; bad backends and k are named."""
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.choice([0.0, 0.5, 1.0], size=(2, 3, 20)), jnp.float32)
  assert not tk.available() and not tk.supported(x.reshape(-1, 20), 3)
  want = _argsort_ids(x, 3)
  np.testing.assert_array_equal(np.asarray(jax.lax.top_k(x, 3)[1]), want)
  for backend in TOPK_BACKENDS:
    ids = jax.jit(lambda v, b=backend: topk_api.top_k_ids(v, 3, backend=b))(x)
    assert ids.shape == (2, 3, 3) and ids.dtype == jnp.int32, backend
    np.testing.assert_array_equal(np.asarray(ids), want, err_msg=backend)
  np.testing.assert_array_equal(np.asarray(topk_api.top_k_ids(x[0, 0], 20)), _argsort_ids(x[0, 0], 20))
  with pytest.raises(ValueError, match="backend='cuda'; valid: auto, xla, triton"):
    topk_api.top_k_ids(x, 3, backend="cuda")
  for k in (0, 21):
    with pytest.raises(ValueError, match=f"k={k} must be in"):
      topk_api.top_k_ids(x, k)


def test_launch_params_cover_every_row_and_column():
  for n, e, k, br in ((37, 20, 3, 16), (32768, 128, 15, 0), (5, 100, 100, 4), (1, 8, 1, 0)):
    p = tk.launch_params(n, e, k, tk.TopKConfig(block_rows=br))
    assert p["grid"][0] * p["BLOCK_ROWS"] >= n > (p["grid"][0] - 1) * p["BLOCK_ROWS"]
    for width, pad in ((e, p["E_PAD"]), (k, p["K_PAD"])):  # powers of two, at least 2
      assert pad & (pad - 1) == 0 and pad >= max(width, 2) > pad // 2
  assert tk.launch_params(32768, 128, 15)["BLOCK_ROWS"] == tk.ROW_ELEMENTS // 128
  with pytest.raises(ValueError, match="k=21 must be in"):
    tk.launch_params(4, 20, 21)
  with pytest.raises(ValueError, match="E=2000 exceeds"):
    tk.launch_params(4, 2000, 3)
  with pytest.raises(ValueError, match="block_rows=12 must be a power of two"):
    tk.launch_params(4, 20, 3, tk.TopKConfig(block_rows=12))
  assert not tk.supported_shapes(jnp.zeros((4, 20), jnp.int32), 3)
  assert not tk.supported_shapes(jnp.zeros((0, 20), jnp.float32), 3)


def test_auto_takes_the_kernel_on_one_device_only(monkeypatch):
  """backend="auto": the best-ranked backend where it runs and the program spans one device;
  lax.top_k over several (XLA would gather the rows whole to every device for the kernel's call).
  A kernel that declines a shape hands it to lax.top_k."""
  import dataclasses
  from umoe_jax.ops import topk as T
  calls = []

  def ids(flat, k):  # stands in for kernels/router/triton_topk.py on this CPU: marks its ids
    calls.append(flat.shape)
    return None if flat.shape[-1] > 20 else jax.lax.top_k(flat, k)[1][:, ::-1]

  T.register_builtin_kernels()
  monkeypatch.setitem(T.BACKENDS._entries, "triton", T.TopKBackend(
      ids=ids, platforms=(jax.default_backend(),), auto_priority=20, single_device=True))
  x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 5, 20)), jnp.float32)
  want = np.asarray(jax.lax.top_k(x, 4)[1])
  for count, kernel in ((1, True), (2, False), (8, False)):
    monkeypatch.setattr(T.jax, "device_count", lambda count=count: count)
    calls.clear()
    got = np.asarray(T.top_k_ids(x, 4, backend="auto"))
    np.testing.assert_array_equal(got, want[..., ::-1] if kernel else want)
    assert bool(calls) == kernel and (not calls or calls[0] == (10, 20))
  np.testing.assert_array_equal(np.asarray(T.top_k_ids(x, 4, backend="xla")), want)
  monkeypatch.setattr(T.jax, "device_count", lambda: 8)  # by name it runs on several devices too
  np.testing.assert_array_equal(np.asarray(T.top_k_ids(x, 4, backend="triton")), want[..., ::-1])
  wide = jnp.concatenate([x, x[..., :1] - 9.0], axis=-1)     # E = 21: declined, lax.top_k answers
  np.testing.assert_array_equal(np.asarray(T.top_k_ids(wide, 4, backend="triton")), want)
  monkeypatch.setitem(T.BACKENDS._entries, "triton",
                      dataclasses.replace(T.BACKENDS.get("triton"), available=lambda: False))
  monkeypatch.setattr(T.jax, "device_count", lambda: 1)
  np.testing.assert_array_equal(np.asarray(T.top_k_ids(x, 4, backend="auto")), want)


def test_config_topk_backend_is_checked_and_per_sublayer():
  from configs import common as configs
  from umoe_jax.config import ConfigError, model_config
  m = configs.model("umoe", "tiny")
  assert model_config(m).router.topk_backend == "auto"
  m.router.topk_backend = "triton"
  cfg = model_config(m)
  assert cfg.router_for("ffn").topk_backend == cfg.router_for("attention").topk_backend == "triton"
  m.ffn.router.topk_backend = "xla"
  cfg = model_config(m)
  assert (cfg.router_for("attention").topk_backend, cfg.router_for("ffn").topk_backend) == ("triton", "xla")
  m.ffn.router.topk_backend = "Triton"
  with pytest.raises(ConfigError, match=r"model\.ffn\.router\.topk_backend='Triton'; valid: auto, xla, triton"):
    model_config(m)


# ----------------------------------------------------------------------------------------------
# Under the interpreter (a fresh process: TRITON_INTERPRET must be set before Triton is imported).

LAUNCHES = []

KERNEL_CASES = [  # rows, E, k, block rows, values
    (37, 20, 1, 16, "normal"), (37, 20, 3, 16, "ties"), (37, 20, 20, 8, "ties"),
    (37, 20, 20, 8, "normal"),                    # negative values ranked too (k = E)
    (50, 128, 15, 16, "normal"), (21, 128, 3, 8, "ties"), (19, 128, 128, 4, "neginf"),
    (45, 100, 15, 0, "neginf"), (13, 100, 100, 4, "ties"), (33, 8, 3, 32, "ties"),
    (10, 16, 5, 4, "zeros_nan"), (10, 16, 16, 4, "zeros_nan"), (9, 3, 2, 4, "ties"),
    (6, 1, 1, 2, "normal"),
]


def _interpreter_launch(kernel, grid, args, out_shape, num_warps=None, **meta):
  """`triton_topk._launch` through the interpreter; the output poisoned with -7 first."""
  from test_kernels import _NpTensor

  def host(*arrays):
    out = _NpTensor(np.full(out_shape.shape, -7, np.int32))
    kernel[grid](*(_NpTensor(np.asarray(a)) for a in arrays), out, **meta)
    return out.arr

  LAUNCHES.append(meta)
  return jax.pure_callback(host, out_shape, *args)


def _values(rng, n, e, kind):
  if kind == "normal":
    return rng.standard_normal((n, e)).astype(np.float32)
  x = rng.choice(np.asarray([0.0, 0.5, 1.0], np.float32), size=(n, e))
  if kind == "neginf":  # some entries -inf, one row all -inf, one row -inf but one entry
    x[rng.random((n, e)) < 0.4] = -np.inf
    x[0] = -np.inf
    x[1] = -np.inf
    x[1, e - 1] = 2.0
  if kind == "zeros_nan":  # signed zeros and NaN: IEEE total order, as lax.top_k on the CPU
    x = rng.choice(np.asarray([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf], np.float32), size=(n, e))
    x[rng.random((n, e)) < 0.1] = np.nan
    x[rng.random((n, e)) < 0.1] = -np.nan
  return x


def _router_outputs(cfg, sublayer, backend, x, bias=None):
  """(ids, gates, total loss, gradients of the router weights, probs, sequence counts) of a tiny
  config's `sublayer` router with router.topk_backend=backend, the loss reaching every
  differentiable output (gates, probs, the router's losses); `bias` [E]: its aux-loss-free
  selection bias."""
  from flax import nnx
  from umoe_jax.model.routers import make_router
  rcfg = dataclasses.replace(cfg.router_for(sublayer), topk_backend=backend)
  k = cfg.ffn.top_k if sublayer == "ffn" else cfg.attention.top_k
  router = make_router(rcfg, cfg.d_model, cfg.moe.n_experts, k, param_dtype="float32",
                       rngs=nnx.Rngs(params=0))
  if bias is not None:
    router.selection_bias.set_value(jnp.asarray(bias))
  graphdef, params, rest = nnx.split(router, nnx.Param, ...)
  cot = jnp.asarray(np.random.default_rng(3).standard_normal(x.shape[:-1] + (k,)), jnp.float32)
  cot_p = jnp.asarray(np.random.default_rng(4).standard_normal(x.shape[:-1] + (cfg.moe.n_experts,)),
                      jnp.float32)

  def loss(params):
    out = nnx.merge(graphdef, params, rest)(x)
    total = (jnp.sum(out.gates * cot) + 1e-2 * jnp.sum(out.probs * cot_p) + out.balance_loss
             + sum(out.aux_losses.values()))
    return total, out

  (total, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  return out.expert_ids, out.gates, total, jax.tree.leaves(grads), out.probs, out.sequence_counts


def _interpreter_check():
  from configs import common as configs
  from umoe_jax.config import model_config
  tk._launch = _interpreter_launch
  tk.available = lambda: True

  # The kernel, through its JAX entry (one launch each), against lax.top_k and numpy.
  for n, e, k, br, kind in KERNEL_CASES:
    rng = np.random.default_rng(n * e + k)
    x = _values(rng, n, e, kind)
    case = f"N={n} E={e} k={k} block_rows={br} {kind}"
    got = np.asarray(jax.jit(lambda v: tk.top_k_ids(v, k, config=tk.TopKConfig(br)))(x))
    want = np.asarray(jax.lax.top_k(jnp.asarray(x), k)[1])
    np.testing.assert_array_equal(got, want, err_msg=case)
    if kind != "zeros_nan":  # numpy's sort has no total order of signed zeros / NaN
      np.testing.assert_array_equal(got, _argsort_ids(x, k), err_msg=case)
    assert all(len(set(r)) == k for r in got.tolist()), case  # distinct, also among -inf
  x16 = np.random.default_rng(7).standard_normal((29, 100)).astype(np.float16)
  np.testing.assert_array_equal(np.asarray(tk.top_k_ids(jnp.asarray(x16), 15)), _argsort_ids(x16, 15))

  # The API with backend="triton": any leading shape, the kernel runs (not the fallback).
  x = jnp.asarray(np.random.default_rng(8).dirichlet(np.ones(100) * 0.3, size=(3, 11)), jnp.float32)
  n0 = len(LAUNCHES)
  ids = jax.jit(lambda v: topk_api.top_k_ids(v, 15, backend="triton"))(x)
  assert len(LAUNCHES) == n0 + 1 and ids.shape == (3, 11, 15)
  np.testing.assert_array_equal(np.asarray(ids), np.asarray(jax.lax.top_k(x, 15)[1]))

  # The routers of a tiny config (E = 20 experts: padded inside the kernel), switch on vs off.
  m = configs.model("umoe", "tiny")
  m.moe.n_experts = 20
  x = jnp.asarray(np.random.default_rng(9).standard_normal((2, 13, m.d_model)), jnp.float32)
  bias = np.random.default_rng(10).standard_normal(20).astype(np.float32) * 0.05
  variants = [("ffn", {}, None), ("attention", {}, None),
              ("ffn", dict(bias_update_rate=1e-3), bias),                      # aux-loss-free bias
              ("ffn", dict(selection="top_p", entropy_coef=1e-4, renormalize=True), None),
              ("attention", dict(kind="topk_sigmoid", renormalize=True), None)]
  for sublayer, keys, b in variants:
    for key, value in keys.items():
      setattr(m.router, key, value)
    cfg = model_config(m)
    n0 = len(LAUNCHES)
    on = _router_outputs(cfg, sublayer, "triton", x, b)
    assert len(LAUNCHES) == n0 + 1, (sublayer, keys)
    off = _router_outputs(cfg, sublayer, "xla", x, b)
    assert len(LAUNCHES) == n0 + 1, (sublayer, keys)
    for name, a, w in zip(("ids", "gates", "loss"), on[:3], off[:3]):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(w), err_msg=f"{sublayer} {keys} {name}")
    assert len(on[3]) == len(off[3]) and any(np.any(np.asarray(w)) for w in off[3]), (sublayer, keys)
    for a, w in zip(on[3], off[3]):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(w), err_msg=f"{sublayer} {keys} grad")
    k = on[0].shape[-1]  # the picks themselves: the top-k of probs + bias (numpy)
    scores = np.asarray(on[4]) + (0 if b is None else b)
    np.testing.assert_array_equal(np.asarray(on[0]), _argsort_ids(scores, k), err_msg=f"{sublayer} {keys}")
    if b is not None:  # the bias moves picks
      assert np.any(np.asarray(on[0]) != _argsort_ids(on[4], k))
    m = configs.model("umoe", "tiny")
    m.moe.n_experts = 20

  # ... and the gradient into probs as before the switch existed (gates = lax.top_k's values).
  from umoe_jax.model.routers.selection import biased_top_k
  probs = jax.nn.softmax(jnp.asarray(np.random.default_rng(11).standard_normal((5, 7, 20)), jnp.float32))
  cot = jnp.asarray(np.random.default_rng(12).standard_normal((5, 7, 4)), jnp.float32)
  new = jax.grad(lambda p: jnp.sum(biased_top_k(p, 4, True, topk_backend="triton")[1] * cot))(probs)
  old = jax.grad(lambda p: jnp.sum(_renormalized(jax.lax.top_k(p, 4)[0]) * cot))(probs)
  np.testing.assert_array_equal(np.asarray(new), np.asarray(old))
  print("TRITON_TOPK_INTERPRETER_OK")


def _renormalized(gates):
  return gates / jnp.sum(gates, axis=-1, keepdims=True)


@pytest.mark.extras("triton")
def test_kernel_in_interpreter_matches_lax_top_k():
  run_in_triton_interpreter("test_triton_topk", "_interpreter_check", "TRITON_TOPK_INTERPRETER_OK")
