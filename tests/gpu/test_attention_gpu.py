"""GPU check of the fused attention cores (`model.attention.core="cudnn"|"triton"`) against the XLA form.

Skipped without a GPU. Fresh random bf16 inputs; values and the gradients of q, k, v within 2e-2
relative of `causal_attention`'s materialised-score form, at the base models' shapes (pre-mixing:
1 + 3 query heads over one key head and D = 768 wide values; MHA: 12 heads of 64). The fused
kernel runs when the queries attend to their own keys (the same positions array); with separate
key positions (a cache: offset queries, a padding key) the XLA form must run instead, and give
exactly its values. The Triton core (one shared key head, D-wide values) is checked at the base and
large pre-mixing shapes and at odd ones (T not a multiple of any tile, 3 heads, D = 320 = a partial
D-chunk; a head of 8, padded to the 16-wide key tl.dot needs), within 1e-2 relative on values and on the gradients of q, k and x; so is the optional fused
dX + dK backward pass.
"""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from umoe_jax.model.attention.cores import causal_attention

QUICK = pytest.mark.gpu_quick   # the quick tier: `pytest -m gpu_quick tests/gpu`

pytestmark = pytest.mark.skipif(
    not any(d.platform == "gpu" for d in jax.devices()), reason="needs a GPU")


def _rel(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("h,hk,dk,dv", [(4, 1, 64, 768), (12, 12, 64, 64)], ids=["premix", "mha"])
@pytest.mark.parametrize("offset", [pytest.param(0, marks=QUICK), 64])
def test_cudnn_core_matches_xla(h, hk, dk, dv, offset):
  b, t = 2, 256
  s = t + offset
  kq, kk, kv, kc = jax.random.split(jax.random.key(h * 1000 + offset), 4)
  q = jax.random.normal(kq, (b, t, h, dk), jnp.float32).astype(jnp.bfloat16)
  k = jax.random.normal(kk, (b, s, hk, dk), jnp.float32).astype(jnp.bfloat16)
  v = jax.random.normal(kv, (b, s, hk, dv), jnp.float32).astype(jnp.bfloat16)
  cot = jax.random.normal(kc, (b, t, h, dv), jnp.float32)
  q_pos = jnp.broadcast_to(offset + jnp.arange(t, dtype=jnp.int32), (b, t))
  if offset:  # a cache: separate key positions, one of them padding
    k_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)).at[1, 3].set(-1)
  else:
    k_pos = None

  def run(core):
    def f(q, k, v, q_pos):
      return causal_attention(q, k, v, q_pos, q_pos if k_pos is None else k_pos, core=core)
    loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32) * cot)
    return jax.jit(f)(q, k, v, q_pos), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, q_pos)

  (out, grads), (want, want_grads) = run("cudnn"), run("xla")
  assert out.dtype == want.dtype and out.shape == want.shape
  if offset:
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
  assert _rel(out, want) < 2e-2
  for name, a, b_ in zip("qkv", grads, want_grads):
    assert _rel(a, b_) < 2e-2, name


def _core_inputs(b, t, h, dk, d, seed, key_heads=1):
  """Random bf16 q [B,T,H,dk], k [B,T,Hk,dk], v [B,T,Hk,D] (Hk = key_heads), a float32 cotangent
  [B,T,H,D] and the positions [B,T] (never zeros)."""
  kq, kk, kv, kc = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(kq, (b, t, h, dk), jnp.float32).astype(jnp.bfloat16)
  k = jax.random.normal(kk, (b, t, key_heads, dk), jnp.float32).astype(jnp.bfloat16)
  v = jax.random.normal(kv, (b, t, key_heads, d), jnp.float32).astype(jnp.bfloat16)
  cot = jax.random.normal(kc, (b, t, h, d), jnp.float32)
  return q, k, v, cot, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


def _assert_triton_grads_match_xla(tiles, q, k, v, cot, pos):
  """The Triton core with `tiles` against the XLA core: finite gradients of q, k and x, each
  within 1e-2 (relative) on its own."""
  from kernels.attention import triton_attention as ta
  triton = lambda q, k, v: ta.premix_attention(q, k[:, :, 0], v[:, :, 0], tiles=tiles)
  xla = lambda q, k, v: causal_attention(q, k, v, pos, pos)
  grads = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) * cot),
                                     argnums=(0, 1, 2)))(q, k, v)
  for name, a, b_ in zip("qkx", grads(triton), grads(xla)):
    assert np.isfinite(np.asarray(a, np.float32)).all(), name
    assert _rel(a, b_) < 1e-2, (name, _rel(a, b_))


@pytest.mark.parametrize("b,t,h,dk,d", [pytest.param(2, 256, 4, 192, 768, marks=QUICK), (1, 300, 4, 512, 2048),
                                        (2, 203, 3, 64, 320), (3, 77, 1, 128, 256),
                                        (2, 77, 2, 8, 64)],
                         ids=["base", "large", "odd", "one-head", "small-head"])
def test_triton_core_matches_xla(b, t, h, dk, d):
  from kernels.attention import triton_attention as ta
  q, k, v, cot, pos = _core_inputs(b, t, h, dk, d, seed=t * 7 + dk)
  assert ta.supported(q, k, v)  # the kernel runs, not a fallback

  def run(core):
    f = lambda q, k, v: causal_attention(q, k, v, pos, pos, core=core)
    loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32) * cot)
    return jax.jit(f)(q, k, v), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

  (out, grads), (want, want_grads) = run("triton"), run("xla")
  assert out.dtype == want.dtype and out.shape == want.shape
  assert np.isfinite(np.asarray(out, np.float32)).all()
  assert _rel(out, want) < 1e-2
  for name, a, b_ in zip("qkx", grads, want_grads):
    assert np.isfinite(np.asarray(a, np.float32)).all(), name
    assert _rel(a, b_) < 1e-2, (name, _rel(a, b_))


@pytest.mark.parametrize("backward", ["auto", "recompute"])
@pytest.mark.parametrize("b,t,h,dk,d", [pytest.param(2, 256, 4, 192, 768, marks=QUICK), (2, 203, 3, 96, 320),
                                        (1, 300, 4, 320, 1024)], ids=["base", "odd", "wide"])
def test_triton_core_with_split_key_width_matches_xla(b, t, h, dk, d, backward):
  """Keys of two exact pieces (192 = 128 + 64, 96 = 64 + 32, 320 = 256 + 64; `key_pieces`) in
  every pass of each backward form, the values and the gradients of q, k and x against the XLA
  core within 1e-2."""
  from kernels.attention import tiles as at
  from kernels.attention import triton_attention as ta
  assert at.key_pieces(dk)["DK2"] > 0
  q, k, v, cot, pos = _core_inputs(b, t, h, dk, d, seed=5 * t + dk)
  tiles = at.with_backward(at.default_tiles(dk, d), backward, dk)
  out = jax.jit(lambda q, k, v: ta.premix_attention(q, k[:, :, 0], v[:, :, 0], tiles=tiles))(q, k, v)
  want = jax.jit(lambda q, k, v: causal_attention(q, k, v, pos, pos))(q, k, v)
  assert _rel(out, want) < 1e-2, _rel(out, want)
  _assert_triton_grads_match_xla(tiles, q, k, v, cot, pos)


@pytest.mark.parametrize("b,t,h,dk,d", [pytest.param(2, 256, 4, 192, 768, marks=QUICK), (2, 203, 3, 64, 320)],
                         ids=["base", "odd"])
def test_triton_fused_dx_dk_pass_matches_xla(b, t, h, dk, d):
  """The optional fused dX + dK pass (`FlashTiles.dxdk`, off by default) against the XLA core,
  dK on its own (a concatenation with dX would hide a dK error). It replaces the recomputing
  backward's dX and dK passes, so it goes on the tiles without the stored form (the default)."""
  import dataclasses
  from kernels.attention import tiles as at
  tiles = dataclasses.replace(at.with_backward(at.default_tiles(dk, d), "recompute", dk),
                              dxdk=at.PassTiles(64, 32, 256, 4, 2))
  _assert_triton_grads_match_xla(tiles, *_core_inputs(b, t, h, dk, d, seed=t + dk))


@pytest.mark.parametrize("b,t,h,dk,d,dq_ds,ds", [
    pytest.param(2, 256, 4, 192, 768, (64, 128, 16, 8, 2), (128, 64, 64, 8, 2), marks=QUICK),
    (2, 256, 4, 192, 768, (64, 64, 16, 4, 2), (128, 128, 64, 8, 3)),   # the narrow defaults
    (2, 193, 3, 64, 320, (32, 64, 16, 4, 2), (64, 64, 128, 4, 2)),
    (1, 300, 4, 512, 2048, (32, 64, 16, 8, 2), (64, 128, 64, 8, 2))],
    ids=["base-ds-pass", "base-ds-pass-tabled", "odd-ds-pass", "large-ds-pass"])
def test_triton_stored_scores_match_xla(b, t, h, dk, d, dq_ds, ds):
  """The pass over tile pairs storing dS / P for the dK, dQ and dX passes (`FlashTiles.ds`,
  `dk_ds`, `dq_ds`, `dx_p`) against the XLA core: gradients of q, k and x."""
  import dataclasses
  from kernels.attention import tiles as at
  from kernels.attention import triton_attention as ta
  q, k, v, cot, pos = _core_inputs(b, t, h, dk, d, seed=3 * t + dk)
  tiles = dataclasses.replace(at.default_tiles(dk, d), dx_p=True, dq_ds=at.PassTiles(*dq_ds),
                              ds=at.PassTiles(*ds), dk_ds=at.stored_tiles(dk)[2])
  assert ta.stores_scores(tiles, q.shape, 2)
  _assert_triton_grads_match_xla(tiles, q, k, v, cot, pos)


GPUS = [d for d in jax.devices() if d.platform == "gpu"]


@pytest.mark.skipif(len(GPUS) < 2, reason="needs 2 or more GPUs")
@pytest.mark.parametrize("core,h,hk,dk,dv", [("triton", 4, 1, 192, 768), ("cudnn", 4, 1, 64, 768),
                                             ("cudnn", 12, 12, 64, 64)],
                         ids=["triton_premix", "cudnn_premix", "cudnn_mha"])
def test_fused_cores_on_each_devices_rows(core, h, hk, dk, dv):
  """Under a mesh of every GPU (batch over "data"; with 4 or more, an even count, heads over
  "tensor=2" as well), the fused cores run inside shard_map (`attention.local_shards.on_local_shards`):
  values and gradients within 1e-2 of the same core on one device and within 2e-2 of the XLA form;
  the compiled step holds the core's kernel and no all-gather. (The Triton case is the one XLA
  could not partition before; jax partitions cuDNN's call by batch and heads itself, so the cuDNN
  cases check that the shard_map layout gives the same results.)"""
  from umoe_jax.parallel import mesh as mesh_lib, sharding
  n = len(GPUS)
  axes = dict(data=n // 2, tensor=2) if n >= 4 and n % 2 == 0 else dict(data=n)
  b, t = 2 * axes["data"], 256
  q, k, v, cot, pos = _core_inputs(b, t, h, dk, dv, seed=n * 7 + h, key_heads=hk)

  def step(core):
    f = lambda q, k, v: causal_attention(q, k, v, pos, pos, core=core)
    loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32) * cot)
    return jax.jit(lambda *a: (f(*a), jax.grad(loss, argnums=(0, 1, 2))(*a)))

  with jax.default_device(GPUS[0]):
    single = step(core)(q, k, v)
    xla = step("xla")(q, k, v)
  mesh = mesh_lib.make_mesh(axes, devices=GPUS)
  with sharding.use_mesh(mesh):
    spec = sharding.batch_sharding(mesh, ndim=4)
    args = [jax.device_put(a, spec) for a in (q, k, v)]
    fn = step(core)
    text = fn.lower(*args).compile().as_text()
    got = fn(*args)
  kernel = "triton_kernel_call" if core == "triton" else "__cudnn$fmha"
  assert kernel in text, f"no {kernel} custom call in the compiled step: the core fell back"
  assert "all-gather" not in text, "the batch was gathered around the kernel"
  for name, a, want1, want_x in zip(("out", "dq", "dk", "dv"), (got[0], *got[1]),
                                    (single[0], *single[1]), (xla[0], *xla[1])):
    assert _rel(a, want1) < 1e-2, (name, _rel(a, want1))
    assert _rel(a, want_x) < 2e-2, (name, _rel(a, want_x))
