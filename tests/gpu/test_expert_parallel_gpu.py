"""GPU checks of the expert-parallel exchanges on 2+ GPUs: the native `jax.lax.ragged_all_to_all`
(which XLA:CPU lacks, so the CPU tests run its dense emulation) against the emulation, the dense
all_to_all and a float64 loop; values and gradients, spread and skewed routing, chunked.

Skipped with fewer than 2 GPUs. Fresh random float32 inputs; relative errors < 1e-5 (float32 only
reorders sums here; the expert matmuls run through the XLA gmm backend in float32).
"""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from umoe_jax.ops.gmm import gmm
from umoe_jax.ops.varying import match_varying
from umoe_jax.parallel import exchange, expert_parallel, mesh as mesh_lib

GPUS = [d for d in jax.devices() if d.platform == "gpu"]
pytestmark = pytest.mark.skipif(len(GPUS) < 2, reason="needs 2 or more GPUs")

N, K, D, E, D_OUT = 512, 3, 64, 32, 48


def _expert_fn(rows, group_sizes, w, *, tensor_axes):
  del tensor_axes
  rows, w = match_varying(rows, w)
  return jnp.tanh(gmm(rows, w, group_sizes, backend="xla"))


def _inputs(seed, skewed):
  rng = np.random.default_rng(seed)
  ids = np.stack([rng.permutation(E)[:K] for _ in range(N)]).astype(np.int32)
  if skewed:   # 90% of the tokens on experts 0..3 (the first shard)
    hot = rng.random(N) < 0.9
    ids[hot] = np.stack([rng.permutation(4)[:K] for _ in range(int(hot.sum()))])
  x = rng.standard_normal((N, D)).astype(np.float32)
  gates = rng.uniform(0.1, 1.0, (N, K)).astype(np.float32)
  w = (rng.standard_normal((E, D, D_OUT)) / np.sqrt(D)).astype(np.float32)
  return x, ids, gates, w


def _loop(x, ids, gates, w):
  x, w = np.float64(x), np.float64(w)
  out = np.zeros((N, D_OUT))
  for t in range(N):
    for j in range(K):
      out[t] += gates[t, j] * np.tanh(x[t] @ w[ids[t, j]])
  return out


def _run(mesh, x, ids, gates, w, exch, chunks):
  def f(x_, w_):
    y, st = expert_parallel.expert_map(x_, jnp.asarray(ids), jnp.asarray(gates), (w_,),
                                       (("expert", "embed", None),), _expert_fn, num_experts=E,
                                       mesh=mesh, exchange=exch, chunks=chunks)
    return y, st["sent_rows"]
  y, sent = jax.jit(f)(x, w)
  grads = jax.jit(jax.grad(lambda x_, w_: jnp.sum(jnp.sin(f(x_, w_)[0])), argnums=(0, 1)))(x, w)
  return np.asarray(y), np.asarray(sent), [np.asarray(g) for g in grads]


@pytest.mark.parametrize("slices", ["peer", "expert"])
@pytest.mark.parametrize("skewed", [False, True])
@pytest.mark.parametrize("chunks", [1, 2])
def test_native_ragged_matches_emulation_and_loop(monkeypatch, slices, skewed, chunks):
  mesh = mesh_lib.make_mesh(dict(expert=len(GPUS)), devices=GPUS)
  x, ids, gates, w = _inputs(7 + chunks, skewed)
  ref = _loop(x, ids, gates, w)
  monkeypatch.setenv(exchange.SLICES_ENV, slices)
  assert exchange.ragged_impl("gpu") == "native"
  native = _run(mesh, x, ids, gates, w, "ragged", chunks)
  monkeypatch.setenv(exchange.IMPL_ENV, "dense")
  dense = _run(mesh, x, ids, gates, w, "ragged", chunks)
  a2a = _run(mesh, x, ids, gates, w, "all_to_all", chunks)
  rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))
  assert rel(native[0], ref) < 1e-5, rel(native[0], ref)
  assert rel(native[0], dense[0]) < 1e-6
  assert np.array_equal(native[1], dense[1])               # the same exact send sizes
  assert int(native[1].sum()) == N * K                     # every routed row once, nothing dropped
  for g_native, g_dense, g_a2a in zip(native[2], dense[2], a2a[2]):
    assert rel(g_native, g_dense) < 1e-5 and rel(g_native, g_a2a) < 1e-5
