"""CPU tests of the softmax routers' one-pass forward (`router.one_pass`; umoe_jax/ops/router_pass.py,
kernels/triton_router.py): the separate-ops form against a float64 numpy loop, the launch geometry,
the config switch and its errors, and the Triton kernel under the interpreter (TRITON_INTERPRET=1, in
a subprocess; every launch through `jax.pure_callback`): values against float64 numpy on fresh
random logits (E not a power of two, T not a multiple of the block, k from 1 to E, with and without
the selection bias and renormalisation), gradients of its custom VJP against the separate ops', and
the routers of a tiny config with the switch on against off (ids, gates, losses, gradients of the
router weights). GPU check and timing: tests/gpu/test_topk_gpu.py, bench/topk.py --router_pass.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import run_in_triton_interpreter
from kernels import triton_router as tr
from umoe_jax.ops import router_pass


def _reference(logits, k, bias=None, renormalize=False):
  """float64 numpy loop: (probs, ids, gates, prob_means, counts) of logits [B, T, E]."""
  x = np.asarray(logits, np.float64)
  b, t, e = x.shape
  probs = np.exp(x - x.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  ids = np.zeros((b, t, k), np.int32)
  gates = np.zeros((b, t, k))
  counts = np.zeros((b, e))
  for i in range(b):
    for j in range(t):
      scores = probs[i, j] + (0.0 if bias is None else np.asarray(bias, np.float64))
      order = sorted(range(e), key=lambda c: (-scores[c], c))[:k]
      ids[i, j] = order
      gates[i, j] = probs[i, j, order]
      if renormalize:
        gates[i, j] /= gates[i, j].sum()
      counts[i, order] += 1
  return probs, ids, gates, probs.mean(axis=1), counts


def _check_against_reference(out, logits, k, bias=None, renormalize=False, case=""):
  """out (a RouterPass, or the kernel's tuple reduced to one) against `_reference`: probs, gates and
  means to 2e-6 relative; the ids exactly on the rows whose first k + 1 scores are apart by more
  than float32 round-off (elsewhere a valid top k of the float64 scores, in order within it); the
  counts those of the ids."""
  probs, ids, gates, means, _ = _reference(logits, k, bias, renormalize)
  np.testing.assert_allclose(np.asarray(out[0]), probs, rtol=2e-6, atol=1e-9, err_msg=case)
  np.testing.assert_allclose(np.asarray(out[2]), gates, rtol=2e-6, atol=1e-9, err_msg=case)
  np.testing.assert_allclose(np.asarray(out[3]), means, rtol=2e-6, atol=1e-9, err_msg=case)
  got = np.asarray(out[1])
  scores = probs + (0.0 if bias is None else np.asarray(bias, np.float64))
  # float32 probs are within a few 1e-7 of float64, relative: closer scores may swap places.
  tol = lambda v: 1e-6 * np.abs(v) + 1e-12
  ordered = -np.sort(-scores, axis=-1)[..., :k + 1]
  clear = np.all(-np.diff(ordered, axis=-1) > tol(ordered[..., 1:]), axis=-1)      # [B, T]
  assert clear.mean() > 0.5, case  # (random logits: most rows unambiguous)
  np.testing.assert_array_equal(got[clear], ids[clear], err_msg=case)
  picked = np.take_along_axis(scores, got, axis=-1)
  assert np.all(-np.diff(picked, axis=-1) > -tol(picked[..., 1:])), case    # descending
  assert all(len(set(r)) == k for r in got.reshape(-1, k).tolist()), case  # distinct
  if k < scores.shape[-1]:
    rest = np.where(np.any(np.arange(scores.shape[-1]) == got[..., None], axis=-2), -np.inf, scores)
    assert np.all(picked[..., -1] >= rest.max(-1) - tol(rest.max(-1))), case  # none better left out
  e = scores.shape[-1]
  own_counts = np.stack([np.bincount(r.ravel(), minlength=e) for r in got])
  np.testing.assert_array_equal(np.asarray(out[4]), own_counts, err_msg=case)


def _logits(seed, b, t, e):
  # Continuous random logits: ties among the probs (which would make the picks ambiguous between
  # float32 and float64) have probability ~0.
  return np.random.default_rng(seed).standard_normal((b, t, e)).astype(np.float32) * 2


def test_separate_ops_match_a_float64_loop():
  for b, t, e, k, with_bias, renorm in [(2, 7, 10, 3, False, False), (3, 5, 16, 16, True, True),
                                        (1, 9, 5, 1, True, False)]:
    x = _logits(b * t + e, b, t, e)
    bias = np.random.default_rng(e).standard_normal(e).astype(np.float32) * 0.05 if with_bias else None
    out = router_pass.separate_ops(jnp.asarray(x), k, bias=None if bias is None else jnp.asarray(bias),
                                   renormalize=renorm, topk_backend="xla")
    _check_against_reference(out, x, k, bias, renorm, case=f"{b}x{t}x{e} k={k}")


def test_softmax_top_k_off_gpu_is_the_separate_ops():
  """Without a GPU (and with the kernel unavailable) the entry answers with `separate_ops`."""
  x = jnp.asarray(_logits(0, 2, 6, 12))
  got = router_pass.softmax_top_k(x, 4, renormalize=True)
  want = router_pass.separate_ops(x, 4, renormalize=True)
  for a, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(w))
  with pytest.raises(ValueError, match=r"1 <= k <= E; got \(2, 6, 12\), k=13"):
    router_pass.softmax_top_k(x, 13)


def test_launch_params():
  p = tr.launch_params(1024, 128, 15)    # the default: 1024 logits, 2 warps a program
  assert (p["N_BLOCKS"], p["BLOCK_ROWS"], p["E_PAD"], p["K_PAD"], p["num_warps"]) == (128, 8, 128, 16, 2)
  p = tr.launch_params(1024, 1000, 15)
  assert (p["N_BLOCKS"], p["BLOCK_ROWS"], p["E_PAD"]) == (1024, 1, 1024)
  p = tr.launch_params(1000, 100, 3, tr.RouterPassConfig(block_rows=8, num_warps=2))
  assert (p["N_BLOCKS"], p["BLOCK_ROWS"], p["E_PAD"], p["K_PAD"], p["num_warps"]) == (125, 8, 128, 4, 2)
  with pytest.raises(ValueError, match="k=5 must be in"):
    tr.launch_params(10, 4, 5)
  with pytest.raises(ValueError, match="E=2048 exceeds MAX_E=1024"):
    tr.launch_params(10, 2048, 2)
  with pytest.raises(ValueError, match="block_rows=6 must be a power of two"):
    tr.launch_params(10, 8, 2, tr.RouterPassConfig(block_rows=6))
  assert not tr.supported(jnp.zeros((2, 3, 8), jnp.float32), 2)        # no GPU here
  assert not tr.supported_shapes(jnp.zeros((2, 3, 8), jnp.bfloat16), 2)
  assert tr.supported_shapes(jnp.zeros((2, 3, 8), jnp.float32), 8)


def test_config_switch_and_its_errors():
  from configs import common as configs
  from umoe_jax.config import ConfigError, model_config
  m = configs.model("umoe", "tiny")
  m.router.one_pass = True
  cfg = model_config(m)
  assert cfg.router_for("ffn").one_pass and cfg.router_for("attention").one_pass
  for keys, message in [
      (dict(selection="top_p", entropy_coef=1e-4),
       r"model\.router\.one_pass=True needs model\.router\.selection='top_k' \(got 'top_p'\)"),
      (dict(kind="topk_sigmoid"), r"model\.router\.one_pass=True needs a router that routes by a "
       r"softmax of its logits; model\.router\.kind='topk_sigmoid' does not \(valid: topk_softmax, aoe\)"),
      (dict(kind="xmoe"), r"model\.router\.kind='xmoe' does not"),
      (dict(mixing="similarity"), r"model\.router\.one_pass=True needs model\.router\.mixing='none'")]:
    m = configs.model("umoe", "tiny")
    m.router.one_pass = True
    for key, value in keys.items():
      setattr(m.router, key, value)
    with pytest.raises(ConfigError, match=message):
      model_config(m)


def test_router_with_the_switch_on_takes_the_same_values_off_gpu():
  """On CPU the switch changes the path (one `softmax_top_k` call) but not the values: the tiny
  config's routers on against off, outputs and gradients of the router weights bit for bit."""
  x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 9, 32)), jnp.float32)
  bias = np.random.default_rng(2).standard_normal(20).astype(np.float32) * 0.05
  outs = [_router_outputs("ffn", dict(one_pass=one_pass, bias_update_rate=1e-3), x, bias=bias)
          for one_pass in (False, True)]
  for a, w in zip(jax.tree.leaves(outs[1]), jax.tree.leaves(outs[0])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(w))


def _router_outputs(sublayer, keys, x, bias=None, topk_backend="xla"):
  """`test_triton_topk._router_outputs` (ids, gates, total loss, gradients of the router weights,
  probs, sequence counts) of the tiny config's `sublayer` router (20 experts, d_model = x's last
  axis) with `keys` set on model.router; bias [E]: its selection bias (needs bias_update_rate)."""
  from configs import common as configs
  from test_triton_topk import _router_outputs as router_outputs
  from umoe_jax.config import model_config
  m = configs.model("umoe", "tiny")
  m.moe.n_experts = 20
  m.d_model = x.shape[-1]
  for key, value in keys.items():
    setattr(m.router, key, value)
  return router_outputs(model_config(m), sublayer, topk_backend, x, bias)


def assert_routers_agree(on, off, case):
  """Two `_router_outputs`: the same picks and counts, values to float32 round-off, gradients of
  the router weights within 1e-4 (some of them non-zero)."""
  for name, a, w in zip(("ids", "gates", "loss", "probs", "counts"), on[:3] + on[4:], off[:3] + off[4:]):
    if name in ("ids", "counts"):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(w), err_msg=f"{case} {name}")
    else:
      np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=1e-5, atol=1e-7,
                                 err_msg=f"{case} {name}")
  assert len(on[3]) == len(off[3]) and any(np.any(np.asarray(w)) for w in off[3]), case
  for a, w in zip(on[3], off[3]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=1e-4, atol=1e-6, err_msg=f"{case} grad")


# ----------------------------------------------------------------------------------------------
# Under the interpreter (a fresh process: TRITON_INTERPRET must be set before Triton is imported).

LAUNCHES = []

KERNEL_CASES = [  # B, T, E, k, block rows, bias, renormalize
    (2, 37, 20, 3, 16, False, False), (1, 13, 20, 20, 4, True, True),
    (3, 33, 128, 15, 16, True, False), (2, 9, 100, 8, 0, False, True),
    (1, 5, 3, 1, 2, True, True), (2, 1, 1, 1, 4, False, False),
]


def _interpreter_launch(kernel, grid, args, out_shape, num_warps=None, **meta):
  """`triton_router._launch` through the interpreter; every output poisoned with -7 first."""
  from test_kernels import _NpTensor

  def host(*arrays):
    outs = [_NpTensor(np.full(s.shape, -7, s.dtype)) for s in out_shape]
    kernel[grid](*(_NpTensor(np.asarray(a)) for a in arrays), *outs, **meta)
    return tuple(o.arr for o in outs)

  LAUNCHES.append(meta)
  return jax.pure_callback(host, tuple(out_shape), *args)


def _interpreter_check():
  tr._launch = _interpreter_launch
  tr.available = lambda: True

  # The kernel against float64 numpy (its per-block statistics summed as the entry sums them).
  for b, t, e, k, br, with_bias, renorm in KERNEL_CASES:
    x = _logits(b * t * e + k, b, t, e)
    bias = (np.random.default_rng(e).standard_normal(e).astype(np.float32) * 0.05 if with_bias
            else None)
    case = f"B={b} T={t} E={e} k={k} block_rows={br} bias={with_bias} renormalize={renorm}"
    probs, ids, gates, sums, counts = jax.jit(lambda v, c: tr.softmax_top_k(
        v, k, bias=c, renormalize=renorm, config=tr.RouterPassConfig(br)))(
            x, None if bias is None else jnp.asarray(bias))
    _check_against_reference((probs, ids, gates, np.asarray(sums).sum(1) / t,
                              np.asarray(counts).sum(1)), x, k, bias, renorm, case)
    assert np.all(np.asarray(counts) >= 0) and np.asarray(counts).sum() == b * t * k, case

  # The JAX entry takes the kernel (one launch), and its custom VJP's gradient matches JAX's own
  # gradient of the separate ops for cotangents on probs, gates and prob_means at once.
  x = jnp.asarray(_logits(5, 3, 11, 24))
  bias = jnp.asarray(np.random.default_rng(6).standard_normal(24).astype(np.float32) * 0.05)
  rng = np.random.default_rng(7)
  cots = [jnp.asarray(rng.standard_normal(s).astype(np.float32))
          for s in ((3, 11, 24), (3, 11, 5), (3, 24))]
  for renorm in (False, True):
    def objective(fn, v):
      out = fn(v, 5, bias=bias, renormalize=renorm)
      return (jnp.sum(out.probs * cots[0]) + jnp.sum(out.gates * cots[1])
              + jnp.sum(out.prob_means * cots[2]) + 0 * jnp.sum(out.counts))
    n0 = len(LAUNCHES)
    got = jax.jit(jax.grad(lambda v: objective(router_pass.softmax_top_k, v)))(x)
    assert len(LAUNCHES) == n0 + 1, "the entry did not take the kernel"
    want = jax.grad(lambda v: objective(router_pass.separate_ops, v))(x)
    assert float(jnp.max(jnp.abs(want))) > 1e-3
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6,
                               err_msg=f"custom VJP, renormalize={renorm}")

  # The routers of a tiny config, switch on (the kernel) against off: the picks and counts equal,
  # values and gradients of the router weights to float32 round-off.
  x = jnp.asarray(np.random.default_rng(9).standard_normal((2, 13, 32)), jnp.float32)
  bias = np.random.default_rng(10).standard_normal(20).astype(np.float32) * 0.05
  for sublayer, keys, b in [("ffn", {}, None), ("attention", dict(renormalize=True), None),
                            ("ffn", dict(bias_update_rate=1e-3, balance_loss="switch"), bias),
                            ("ffn", dict(z_loss_coef=1e-3, entropy_coef=1e-4), None)]:
    n0 = len(LAUNCHES)
    on = _router_outputs(sublayer, dict(keys, one_pass=True), x, b)
    assert len(LAUNCHES) == n0 + 1, (sublayer, keys)
    assert_routers_agree(on, _router_outputs(sublayer, keys, x, b), f"{sublayer} {keys}")
  print("TRITON_ROUTER_INTERPRETER_OK")


@pytest.mark.extras("triton")
def test_kernel_in_interpreter_matches_float64_and_the_separate_ops():
  run_in_triton_interpreter("test_router_pass", "_interpreter_check", "TRITON_ROUTER_INTERPRETER_OK")
