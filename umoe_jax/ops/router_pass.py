"""A softmax router's forward in one pass over its logits (`router.one_pass`): `softmax_top_k`.

    softmax_top_k(logits [B, T, E], k) -> RouterPass(probs [B, T, E], ids [B, T, K] int32,
                                                     gates [B, T, K], prob_means [B, E], counts [B, E])

probs = softmax(logits) over the experts; ids = the top k of probs (+ `bias` [E], the aux-loss-free
selection bias, for the choice only; ties toward the lower expert); gates = probs at the ids
(renormalised over them with `renormalize`); prob_means[b] = the mean over the T positions of
sequence b of probs; counts[b, e] = how many of sequence b's picks went to expert e. These are what
the balance losses read (`routers.losses`), so the router needs no other pass over [B, T, E].

Where the Triton kernel runs (kernels/triton_router.py: a GPU with Triton and jax-triton, one
device, float32 logits, E <= 1024) it is one kernel and a sum over its per-block statistics; the
backward is XLA's (`_one_pass_bwd`: the softmax gradient of everything that reached probs). Elsewhere
(CPU, several devices: XLA does not partition the kernel's custom call) the same values come from the
separate ops (`separate_ops`), whose gradients are JAX's own.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from umoe_jax.ops.topk import biased_top_k


class RouterPass(NamedTuple):
  probs: jax.Array        # [B, T, E] float32
  ids: jax.Array          # [B, T, K] int32
  gates: jax.Array        # [B, T, K] float32
  prob_means: jax.Array   # [B, E] float32, mean over T of probs
  counts: jax.Array       # [B, E] float32, picks per sequence and expert (no gradient)


def _kernel():
  """kernels.triton_router, or None where the kernels package cannot load (a library-only install)."""
  try:
    from kernels import triton_router
  except Exception:  # noqa: BLE001  (no kernels package / toolchain: XLA answers)
    return None
  return triton_router


def separate_ops(logits: jax.Array, k: int, *, bias: Optional[jax.Array] = None,
                 renormalize: bool = False, topk_backend: str = "auto") -> RouterPass:
  """The RouterPass from XLA's softmax, the routers' `biased_top_k` (ids by `topk_backend`, gates
  gathered) and two reductions: the fallback, and the reference the kernel is tested against."""
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  ids, gates = biased_top_k(probs, k, renormalize, bias, topk_backend=topk_backend)
  counts = jax.nn.one_hot(ids, logits.shape[-1], dtype=jnp.float32).sum(axis=(1, 2))
  return RouterPass(probs, ids, gates, jnp.mean(probs, axis=1), counts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _one_pass(logits, bias, k, renormalize):
  return _one_pass_fwd(logits, bias, k, renormalize)[0]


def _one_pass_fwd(logits, bias, k, renormalize):
  probs, ids, gates, sums, counts = _kernel().softmax_top_k(
      logits, k, bias=bias, renormalize=renormalize)
  out = RouterPass(probs, ids, gates, sums.sum(axis=1) / logits.shape[1], counts.sum(axis=1))
  return out, (probs, ids, gates, bias)


def _one_pass_bwd(k, renormalize, res, cot):
  """d logits from the cotangents of probs, gates and prob_means (ids and counts carry none):
  everything that reaches probs, then the softmax's Jacobian, P * (dP - sum_e P dP)."""
  del k
  probs, ids, gates, bias = res
  d_gates = cot.gates
  if renormalize:  # gates = g / sum(g) for g = probs at the ids
    top = jnp.take_along_axis(probs, ids, axis=-1)
    d_gates = (d_gates - jnp.sum(d_gates * gates, axis=-1, keepdims=True)) / jnp.sum(
        top, axis=-1, keepdims=True)
  # The gates' cotangent scattered back to their experts as JAX's own gradient of the gather does
  # (a one-hot [B, T, K, E] product took 0.73x the separate ops' forward + backward time, run 81).
  _, scatter_gates = jax.vjp(lambda p: jnp.take_along_axis(p, ids, axis=-1), probs)
  d_probs = cot.probs + cot.prob_means[:, None, :] / probs.shape[1] + scatter_gates(d_gates)[0]
  d_logits = probs * (d_probs - jnp.sum(probs * d_probs, axis=-1, keepdims=True))
  return d_logits, None if bias is None else jnp.zeros_like(bias)


_one_pass.defvjp(_one_pass_fwd, _one_pass_bwd)


def softmax_top_k(logits: jax.Array, k: int, *, bias: Optional[jax.Array] = None,
                  renormalize: bool = False, topk_backend: str = "auto") -> RouterPass:
  """logits [B, T, E] (float32) -> RouterPass (module docstring): the Triton kernel where it runs
  on one device, else `separate_ops` (whose ids come from `topk_backend`). Gradients reach logits
  through probs, gates and prob_means either way; bias gets none."""
  if logits.ndim != 3 or not 1 <= k <= logits.shape[-1]:
    raise ValueError(f"softmax_top_k: logits [B, T, E] and 1 <= k <= E; got {logits.shape}, k={k}")
  kernel = _kernel()
  logits = logits.astype(jnp.float32)
  if kernel is None or jax.device_count() != 1 or not kernel.supported(logits, k):
    return separate_ops(logits, k, bias=bias, renormalize=renormalize, topk_backend=topk_backend)
  if bias is not None:
    bias = jax.lax.stop_gradient(bias).astype(jnp.float32)
  return _one_pass(logits, bias, k, bool(renormalize))
