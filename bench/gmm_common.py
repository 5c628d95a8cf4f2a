"""What bench/gmm.py and its sweeps share: the UMoE matmul shapes and anchors, random inputs (fresh
bf16, Dirichlet-skewed group sizes and routing as in shared/anchors/grouped_matmul_anchors.py) and
the timer (CUPTI kernel time, wall clock where CUPTI is not there)."""
from __future__ import annotations

import os
import sys

import numpy as np

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."),
                os.path.dirname(os.path.abspath(__file__))]

import timing  # noqa: E402  (bench/timing.py)

T = 32 * 1024
SHAPES = [  # name, M, K, N, G
    ("base-up", T * 15, 768, 192, 128),
    ("base-down", T * 15, 192, 768, 128),
    ("base-att", T * 3, 768, 192, 128),
    ("large-up", T * 10, 2048, 512, 64),
    ("large-down", T * 10, 512, 2048, 64),
]
# One H200, TFLOP/s (shared/anchors): dense, torch fwd, torch fwd+bwd, jax mgpu ragged_dot fwd.
ANCHORS = {
    "base-up": dict(dense=611, torch_f=433, torch_fb=259, mgpu=389),
    "base-down": dict(dense=539, torch_f=333, torch_fb=334, mgpu=170),
    "base-att": dict(dense=580, torch_f=315, torch_fb=198, mgpu=329),
    "large-up": dict(dense=766, torch_f=679, torch_fb=448, mgpu=607),
    "large-down": dict(dense=754, torch_f=526, torch_fb=531, mgpu=382),
}


def group_sizes(M, E, seed=0):
  rng = np.random.default_rng(seed)
  p = rng.dirichlet(np.ones(E) * 4.0)
  gs = np.floor(p * M).astype(np.int32)
  gs[-1] += M - gs.sum()
  return gs


def log(*a):
  print(*a, flush=True)


def jax_ms(f, *args, iterations=10):
  """Median kernel time in ms (CUPTI); falls back to wall clock around block_until_ready."""
  try:
    from jax.experimental.mosaic.gpu import profiler
    f(*args)  # compile + warm up
    _, t = profiler.measure(f, iterations=iterations)(*args)
    if t is not None:
      return float(np.median(t))
  except Exception as e:  # noqa: BLE001
    log("  cupti timing failed, wall clock:", repr(e)[:120])
  return float(timing.wall_ms(f, *args, iters=iterations))


def make_inputs(M, K, N, E, seed=0):
  import jax
  import jax.numpy as jnp
  kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(kx, (M, K), jnp.bfloat16)
  w = (jax.random.normal(kw, (E, K, N), jnp.float32) / np.sqrt(K)).astype(jnp.bfloat16)
  dy = jax.random.normal(kd, (M, N), jnp.bfloat16)
  return x, w, dy, jnp.asarray(group_sizes(M, E))


def routed_inputs(d, h, E, K, n=None, seed=5):
  """An MoE layer's inputs at the bench scale: tokens x [n, d], Dirichlet-skewed top-K ids, gates,
  expert weights w1 [E, d, h] and w2 [E, h, d] (bf16, fresh random)."""
  import jax
  import jax.numpy as jnp
  n = n or T
  kx, ke, kg, kw1, kw2 = jax.random.split(jax.random.key(seed), 5)
  x = jax.random.normal(kx, (n, d), jnp.bfloat16)
  logits = jax.random.normal(ke, (n, E)) + jnp.log(jnp.asarray(
      np.random.default_rng(0).dirichlet(np.ones(E) * 4.0), jnp.float32))
  ids = jax.lax.top_k(logits, K)[1].astype(jnp.int32)
  gates = jax.nn.softmax(jax.random.normal(kg, (n, K)), -1).astype(jnp.bfloat16)
  w1 = (jax.random.normal(kw1, (E, d, h)) / np.sqrt(d)).astype(jnp.bfloat16)
  w2 = (jax.random.normal(kw2, (E, h, d)) / np.sqrt(h)).astype(jnp.bfloat16)
  return x, ids, gates, w1, w2


DISPATCH_CONFIGS = (("base", 768, 192, 128, 15), ("large", 2048, 512, 64, 10))
# Swept by --sweep-gathered only: UMoE-base's attention-side calls (the routed queries' and the
# attention experts' matmuls, K = 3 slots: M = 3 N ~ 2^17 rows, their own table rows).
ATTENTION_CONFIGS = (("base_att", 768, 192, 128, 3),)
