"""The LM head fused with the softmax cross-entropy, chunked over tokens (train.loss_chunk_tokens).

    nll_sum, count = chunked_token_nll(h, w, targets, loss_mask, chunk_tokens=4096)

is `token_nll(logits_dot(h, w), targets, loss_mask)` (umoe_jax.ops.lm_loss, model.layers)
without ever holding the float32 logits [N, V] of all N = B * T tokens: for UMoE-base's step
(32 x 1024 tokens, V = 32000) those are 4.2 GB, written by the head, read twice by the softmax
(max, then sum-exp), read again and a cotangent of the same size written by its backward. Here a
`lax.scan` over chunks of at most `chunk_tokens` rows computes each chunk's logits [C, V], its
log-sum-exp and target logit, and adds the chunk's weighted NLL; only the per-row log-sum-exp [N]
is kept for the backward, which recomputes each chunk's logits (one more head matmul, as Levanter /
MaxText / Liger pay), forms its logit cotangent g * weight * (softmax - onehot) rounded to the
inputs' dtype (as `logits_dot`'s backward rounds it), and contracts it at once: dh of the chunk,
and dW accumulated over chunks in float32 (the scan carry).

Chunk k holds rows k, k + K, k + 2K, ... of the flattened tokens (K chunks), not a contiguous slab,
as the step's micro-batches take rows: with the batch split over devices (and C a multiple of
their count) every chunk is split over all of them, where a contiguous chunk would lie on few.
N is padded to K * C with weight-0 rows; C = ceil(N / K) <=
chunk_tokens keeps the padding below K rows.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp


def chunked_token_nll(h: jax.Array, w: jax.Array, targets: jax.Array,
                      loss_mask: Optional[jax.Array] = None, *,
                      chunk_tokens: int, keep_logits: bool = False) -> tuple[jax.Array, jax.Array]:
  """(sum of -log p(target) over counted tokens, number of counted tokens), float32 scalars.

  Args:
    h: [B, T, D] (or any [..., D]) hidden states in the compute dtype.
    w: [D, V] the LM head, already in the compute dtype.
    targets: [B, T] int, in [0, V).
    loss_mask: optional [B, T] weights (1 = counted, 0 = ignored); no gradient flows to it.
    chunk_tokens: the most tokens whose logits exist at once (>= 1; >= N: one chunk).
    keep_logits: keep every chunk's float32 logits for the backward instead of recomputing them
      (no second head matmul; the memory of all N rows' logits, as autodiff of the plain head
      keeps). With one chunk this is the head and loss as one op whose backward forms the logit
      cotangent and rounds it in a single pass (`train.fused_loss_head`), where autodiff of
      `token_nll(logits_dot(...))` writes a float32 cotangent [N, V] and then rounds it.

  Gradients flow to h and w (in their dtypes); none to targets or loss_mask.
  """
  if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or chunk_tokens < 1:
    raise ValueError(f"chunk_tokens={chunk_tokens!r} must be an integer >= 1")
  if h.shape[:-1] != targets.shape or w.ndim != 2 or w.shape[0] != h.shape[-1]:
    raise ValueError(f"chunked_token_nll: h {h.shape}, w {w.shape}, targets {targets.shape}: "
                     "want h [..., D], w [D, V], targets [...] (h's leading shape)")
  if loss_mask is not None and loss_mask.shape != targets.shape:
    raise ValueError(f"chunked_token_nll: loss_mask {loss_mask.shape} != targets {targets.shape}")
  n, d = targets.size, h.shape[-1]
  if n == 0:
    raise ValueError(f"chunked_token_nll: no tokens (targets {targets.shape})")
  if loss_mask is None:
    weights, count = jnp.ones((n,), jnp.float32), jnp.asarray(n, jnp.float32)
  else:
    mask = jax.lax.stop_gradient(loss_mask.astype(jnp.float32))
    weights, count = mask.reshape(n), jnp.sum(mask)
  layout = (n, *_layout(n, chunk_tokens), bool(keep_logits))
  nll = _nll_sum(layout, h.reshape(n, d), w, targets.reshape(n).astype(jnp.int32), weights)
  return nll, count


def _layout(n: int, chunk_tokens: int) -> tuple[int, int]:
  """(K chunks, C rows each): K = ceil(N / chunk_tokens), C = ceil(N / K)."""
  k = -(-n // chunk_tokens)
  return k, -(-n // k)


def _to_chunks(x: jax.Array, k: int, c: int) -> jax.Array:
  """[N, ...] -> [K, C, ...], chunk j = rows j, j + K, ... (zero rows pad N to K * C)."""
  pad = k * c - x.shape[0]
  if pad:
    x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
  return x.reshape(c, k, *x.shape[1:]).swapaxes(0, 1)


def _from_chunks(x: jax.Array, n: int) -> jax.Array:
  """[K, C, ...] -> [N, ...]: `_to_chunks` undone, padding dropped."""
  return x.swapaxes(0, 1).reshape(-1, *x.shape[2:])[:n]


def _scan(body, init, xs, k: int):
  """lax.scan over the K chunks, or the body once when K == 1 (straight-line code XLA can fuse
  across: the fused head's cotangent pass)."""
  if k > 1:
    return jax.lax.scan(body, init, xs)
  carry, ys = body(init, jax.tree.map(lambda x: x[0], xs))
  return carry, jax.tree.map(lambda y: y[None], ys)


def _chunk_logits(h_c: jax.Array, w: jax.Array) -> jax.Array:
  """[C, D] @ [D, V] -> float32 [C, V]: products in the inputs' dtype, as `logits_dot`."""
  return jnp.dot(h_c, w, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _nll_sum(layout: tuple[int, int, int, bool], h: jax.Array, w: jax.Array, targets: jax.Array,
             weights: jax.Array) -> jax.Array:
  """sum_i weights[i] * -log softmax(h[i] @ w)[targets[i]]; h [N, D], targets / weights [N];
  layout = (N, K chunks, C rows each, keep the logits for the backward), static."""
  return _nll_fwd(layout, h, w, targets, weights)[0]


def _nll_fwd(layout, h, w, targets, weights):
  _, k, c, keep = layout
  chunks = (_to_chunks(h, k, c), _to_chunks(targets, k, c), _to_chunks(weights, k, c))

  def body(total, xs):
    h_c, t_c, wt_c = xs
    logits = _chunk_logits(h_c, w)                                          # [C, V] float32
    # As optax.softmax_cross_entropy_with_integer_labels: shift by the row max, then
    # log-sum-exp minus the shifted target logit.
    top = jnp.max(logits, axis=-1, keepdims=True)
    shifted = logits - top
    log_norm = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1))                  # [C]
    target = jnp.take_along_axis(shifted, t_c[:, None], axis=-1)[:, 0]      # [C]
    return total + jnp.sum((log_norm - target) * wt_c), (log_norm + top[:, 0],
                                                         logits if keep else None)

  total, (lse, logits) = _scan(body, jnp.zeros((), jnp.float32), chunks, k)  # lse [K, C]
  return total, (*chunks, lse, logits, w)


def _nll_bwd(layout, res, g):
  n, keep = layout[0], layout[3]
  h_chunks, t_chunks, wt_chunks, lse, logits, w = res
  dtype = jnp.result_type(h_chunks.dtype, w.dtype)
  vocab = jax.lax.broadcasted_iota(jnp.int32, (1, w.shape[1]), 1)          # [1, V]

  def body(dw, xs):
    h_c, t_c, wt_c, lse_c, logits_c = xs
    logits_c = logits_c if keep else _chunk_logits(h_c, w)
    probs = jnp.exp(logits_c - lse_c[:, None])                              # [C, V] softmax
    dlogits = jnp.where(vocab == t_c[:, None], probs - 1.0, probs) * (g * wt_c)[:, None]
    dlogits = dlogits.astype(dtype)   # bf16 matmuls below, float32 accumulation (logits_dot)
    dh_c = jnp.dot(dlogits, w.T, preferred_element_type=jnp.float32).astype(h_c.dtype)  # [C, D]
    dw = dw + jnp.dot(h_c.T, dlogits, preferred_element_type=jnp.float32)              # [D, V]
    return dw, dh_c

  dw, dh = _scan(body, jnp.zeros(w.shape, jnp.float32),
                 (h_chunks, t_chunks, wt_chunks, lse, logits), layout[1])
  return _from_chunks(dh, n), dw.astype(w.dtype), None, None


_nll_sum.defvjp(_nll_fwd, _nll_bwd)
