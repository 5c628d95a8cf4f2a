"""The LM head fused with the softmax cross-entropy, chunked over tokens (train.loss_chunk_tokens).

    nll_sum, count = chunked_token_nll(h, w, targets, loss_mask, chunk_tokens=4096)

is `token_nll(logits_dot(h, w), targets, loss_mask)` (umoe_jax.eval.perplexity, model.layers)
without ever holding the float32 logits [N, V] of all N = B * T tokens: for UMoE-base's step
(32 x 1024 tokens, V = 32000) those are 4.2 GB, written by the head, read twice by the softmax
(max, then sum-exp), read again and a cotangent of the same size written by its backward. Here a
`lax.scan` over chunks of at most `chunk_tokens` rows computes each chunk's logits [C, V], its
log-sum-exp and target logit, and adds the chunk's weighted NLL; only the per-row log-sum-exp [N]
is kept for the backward, which recomputes each chunk's logits (one more head matmul, as Levanter /
MaxText / Liger pay), forms its logit cotangent g * weight * (softmax - onehot) rounded to the
inputs' dtype (as `logits_dot`'s backward rounds it), and contracts it at once: dh of the chunk,
and dW accumulated over chunks in float32 (the scan carry).

The log-sum-exp is two passes over each chunk's logits by default (the row max, then the sum of the
shifted exponentials, as optax); `online_lse=True` makes it one (`online_logsumexp`: a running max
and a sum rescaled to it, the online softmax of flash attention, as variadic XLA reductions),
reading the float32 logits once less.

Chunk k holds rows k, k + K, k + 2K, ... of the flattened tokens (K chunks), not a contiguous slab,
as the step's micro-batches take rows: with the batch split over devices (and C a multiple of
their count) every chunk is split over all of them, where a contiguous chunk would lie on few
(not yet run on several devices). N is padded to K * C with weight-0 rows; C = ceil(N / K) <=
chunk_tokens keeps the padding below K rows.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp


def chunked_token_nll(h: jax.Array, w: jax.Array, targets: jax.Array,
                      loss_mask: Optional[jax.Array] = None, *,
                      chunk_tokens: int, keep_logits: bool = False,
                      online_lse: bool = False) -> tuple[jax.Array, jax.Array]:
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
    online_lse: each row's log-sum-exp in one pass over the logits (`online_logsumexp`) instead of
      a max pass and a sum-exp pass; the same values up to float32 rounding.

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
  layout = (n, *_layout(n, chunk_tokens), bool(keep_logits), bool(online_lse))
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


def _lse_combine(a, b):
  """Two partial (max, sum of exp(x - max)) pairs -> theirs together. One exponential: the pair
  with the larger max keeps its sum and adds the other's rescaled by exp(-|m1 - m2|) (exp(0) when
  the maxima are equal, which also keeps two empty (-inf, 0) pairs from making a NaN)."""
  (m1, s1), (m2, s2) = a, b
  first = m1 >= m2
  gap = jax.lax.select(m1 == m2, jnp.zeros_like(m1), -jnp.abs(m1 - m2))
  return (jnp.maximum(m1, m2),
          jax.lax.select(first, s1, s2) + jax.lax.select(first, s2, s1) * jnp.exp(gap))


# Columns a first-level block of `online_logsumexp` reduces: its partial sums run over 128 terms, so
# a one-level reduction's float32 rounding, which grows with the row (sequential on CPU: 70x the
# two-pass form's error at V = 32000), stays at the two-pass form's.
LSE_BLOCK = 128


def _lse_reduce(x: jax.Array, m: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
  """(max, sum of exp(x - max)) over `axis` of (x, m) pairs (m: each entry's partial sum)."""
  return jax.lax.reduce((x, m), (jnp.float32(-jnp.inf), jnp.float32(0.0)), _lse_combine, (axis,))


def online_logsumexp(x: jax.Array) -> jax.Array:
  """log sum_j exp(x[..., j]) of float32 x [..., V] -> [...], reading x once: variadic reductions
  of (x, 1) pairs under `_lse_combine`, over blocks of LSE_BLOCK columns and then over the blocks'
  (max, sum) pairs (and a last partial block's)."""
  x = x.astype(jnp.float32)
  *lead, v = x.shape
  full = v - v % LSE_BLOCK
  parts = []
  if full:
    blocks = x[..., :full].reshape(*lead, full // LSE_BLOCK, LSE_BLOCK)
    parts.append(_lse_reduce(*_lse_reduce(blocks, jnp.ones_like(blocks), len(lead) + 1),
                             len(lead)))
  if full < v:
    tail = x[..., full:]
    parts.append(_lse_reduce(tail, jnp.ones_like(tail), len(lead)))
  top, total = parts[0] if len(parts) == 1 else _lse_combine(*parts)
  return top + jnp.log(total)


def _chunk_logits(h_c: jax.Array, w: jax.Array) -> jax.Array:
  """[C, D] @ [D, V] -> float32 [C, V]: products in the inputs' dtype, as `logits_dot`."""
  return jnp.dot(h_c, w, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _nll_sum(layout: tuple[int, int, int, bool], h: jax.Array, w: jax.Array, targets: jax.Array,
             weights: jax.Array) -> jax.Array:
  """sum_i weights[i] * -log softmax(h[i] @ w)[targets[i]]; h [N, D], targets / weights [N];
  layout = (N, K chunks, C rows each, keep the logits for the backward, one-pass log-sum-exp),
  static."""
  return _nll_fwd(layout, h, w, targets, weights)[0]


def _nll_fwd(layout, h, w, targets, weights):
  _, k, c, keep, online = layout
  chunks = (_to_chunks(h, k, c), _to_chunks(targets, k, c), _to_chunks(weights, k, c))

  def body(total, xs):
    h_c, t_c, wt_c = xs
    logits = _chunk_logits(h_c, w)                                          # [C, V] float32
    if online:
      lse = online_logsumexp(logits)                                        # [C]
      target = jnp.take_along_axis(logits, t_c[:, None], axis=-1)[:, 0]     # [C]
      return total + jnp.sum((lse - target) * wt_c), (lse, logits if keep else None)
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
