"""`umoe_jax.ops.chunked_loss.chunked_token_nll` (`train.loss_chunk_tokens`): the LM head fused with
the cross-entropy, chunked over tokens. Its value and gradients (h, w) equal those of
`token_nll(logits_dot(h, w), ...)` and of a float64 numpy reference (float32 and bf16 inputs, with
and without a loss mask, chunks that divide the tokens or not, one chunk), and its gradient program
holds no [tokens, V] array (jaxpr avals and the compiled temporaries)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import jaxpr_avals, rel_err
from umoe_jax.model.layers import logits_dot
from umoe_jax.ops.chunked_loss import chunked_token_nll
from umoe_jax.ops.lm_loss import token_nll

B, T, D, V = 3, 5, 16, 37   # N = 15 tokens
G = 2.5                     # the cotangent of the nll sum (the step's is 1 / tokens)


def _inputs(seed: int, dtype):
  k = jax.random.split(jax.random.key(seed), 5)
  h = jax.random.normal(k[0], (B, T, D)).astype(dtype)
  w = (jax.random.normal(k[1], (D, V)) / 2).astype(dtype)      # logits of a few units
  targets = jax.random.randint(k[2], (B, T), 0, V)
  # weights 0 / 0.5 / 1: dropped, half-counted and counted tokens
  mask = jax.random.choice(k[3], jnp.asarray([0.0, 0.5, 1.0]), (B, T))
  return h, w, targets, mask


def _numpy_reference(h, w, targets, mask):
  """(nll sum, count, dh, dw of G * nll sum) in float64 from the (rounded) inputs."""
  h = np.asarray(h, np.float64).reshape(-1, D)
  w = np.asarray(w, np.float64)
  t = np.asarray(targets).reshape(-1)
  m = np.ones(len(t)) if mask is None else np.asarray(mask, np.float64).reshape(-1)
  logits = h @ w
  top = logits.max(-1, keepdims=True)
  lse = top[:, 0] + np.log(np.exp(logits - top).sum(-1))
  nll = np.sum(m * (lse - logits[np.arange(len(t)), t]))
  dlogits = np.exp(logits - lse[:, None])
  dlogits[np.arange(len(t)), t] -= 1.0
  dlogits *= G * m[:, None]
  return nll, m.sum(), (dlogits @ w.T).reshape(B, T, D), h.T @ dlogits


def _value_and_grads(nll_and_count, h, w):
  """(nll sum, count, dh, dw of G * nll sum)."""
  loss = lambda h, w: (lambda nll, count: (G * nll, (nll, count)))(*nll_and_count(h, w))
  (_, (nll, count)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(h, w)
  return nll, count, *grads


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("masked", [False, True])
def test_values_and_gradients_match_token_nll_and_float64(dtype, masked):
  h, w, targets, mask = _inputs(0 if dtype == "float32" else 1, jnp.dtype(dtype))
  mask = mask if masked else None
  ref = _numpy_reference(h, w, targets, mask)
  plain = _value_and_grads(lambda h, w: token_nll(logits_dot(h, w), targets, mask), h, w)
  # bf16 inputs: the logits are exact float32 sums of bf16 products either way, but the logit
  # cotangent is rounded to bf16 before the backward's matmuls (as logits_dot's backward) and the
  # gradients are returned in bf16.
  grad_tol, plain_tol = (1e-6, 1e-6) if dtype == "float32" else (5e-3, 1e-3)
  assert ref[0] > 1.0 and np.abs(ref[3]).max() > 1e-2  # not a degenerate case
  # 15 tokens: 2 and 4 leave a weight-0 padding row (8 x 2, 4 x 4), 5 divides, 15 and 64 are one
  # chunk; each with the logits recomputed in the backward and kept (keep_logits)
  for chunk, keep in [(c, k) for c in (2, 4, 5, 15, 64) for k in (False, True)]:
    out = _value_and_grads(
        lambda h, w: chunked_token_nll(h, w, targets, mask, chunk_tokens=chunk, keep_logits=keep),
        h, w)
    what = f"{dtype} masked={masked} chunk={chunk} keep_logits={keep}"
    assert out[2].dtype == h.dtype and out[3].dtype == w.dtype, what
    assert out[0].dtype == jnp.float32 and out[1].dtype == jnp.float32, what
    np.testing.assert_allclose(out[0], ref[0], rtol=1e-6, err_msg=what)
    np.testing.assert_allclose(out[0], plain[0], rtol=1e-6, err_msg=what)
    assert float(out[1]) == ref[1] == float(plain[1]), what
    for i, name in ((2, "dh"), (3, "dw")):
      assert rel_err(out[i], ref[i]) < grad_tol, (what, name, rel_err(out[i], ref[i]))
      assert rel_err(out[i], plain[i]) < plain_tol, (what, name, rel_err(out[i], plain[i]))


def test_no_gradient_to_the_mask_and_bad_arguments():
  h, w, targets, mask = _inputs(2, jnp.float32)
  g = jax.grad(lambda m: chunked_token_nll(h, w, targets, m, chunk_tokens=4)[0])(mask)
  assert not np.any(np.asarray(g))
  with pytest.raises(ValueError, match="chunk_tokens=0 must be an integer >= 1"):
    chunked_token_nll(h, w, targets, chunk_tokens=0)
  with pytest.raises(ValueError, match=r"w \(37, 16\)"):
    chunked_token_nll(h, w.T, targets, chunk_tokens=4)
  with pytest.raises(ValueError, match=r"loss_mask \(3, 4\)"):
    chunked_token_nll(h, w, targets, mask[:, :4], chunk_tokens=4)


def test_the_fused_head_keeps_the_logits_and_no_float32_cotangent():
  """keep_logits with one chunk (`train.fused_loss_head`): no second head matmul in the backward,
  and the compiled gradient's temporaries hold the float32 logits once, where autodiff of the
  plain head holds them and a float32 cotangent of the same size (bf16 inputs, as training)."""
  n, vocab = 512, 1000
  k = jax.random.split(jax.random.key(4), 3)
  h = jax.random.normal(k[0], (n // 8, 8, D)).astype(jnp.bfloat16)
  w = jax.random.normal(k[1], (D, vocab)).astype(jnp.bfloat16)
  targets = jax.random.randint(k[2], (n // 8, 8), 0, vocab)
  fused = jax.grad(lambda h, w: chunked_token_nll(h, w, targets, chunk_tokens=n,
                                                  keep_logits=True)[0], (0, 1))
  recomputed = jax.grad(lambda h, w: chunked_token_nll(h, w, targets, chunk_tokens=n)[0], (0, 1))
  plain = jax.grad(lambda h, w: token_nll(logits_dot(h, w), targets)[0], (0, 1))
  # products [N, D] x [D, V] -> [N, V]: the head's forward, and its recomputation in the backward
  def head_dots(f):
    def walk(jaxpr):
      for e in jaxpr.eqns:
        yield from (v.aval.shape for v in e.outvars if e.primitive.name == "dot_general")
        for p in e.params.values():
          for sub in (p if isinstance(p, (tuple, list)) else (p,)):
            inner = getattr(sub, "jaxpr", sub)
            if hasattr(inner, "eqns"):
              yield from walk(inner)
    return sum(1 for shape in walk(jax.make_jaxpr(f)(h, w).jaxpr) if shape[-2:] == (n, vocab))
  assert head_dots(fused) == 1 and head_dots(recomputed) == 2, (head_dots(fused),
                                                                head_dots(recomputed))
  temp = lambda f: jax.jit(f).lower(h, w).compile().memory_analysis().temp_size_in_bytes
  logits_bytes = n * vocab * 4
  assert logits_bytes <= temp(fused) < 1.5 * logits_bytes < temp(plain), (temp(fused), temp(plain))


def test_the_gradient_holds_no_tokens_by_vocab_array():
  n, chunk, vocab = 512, 64, 1000
  k = jax.random.split(jax.random.key(3), 3)
  h = jax.random.normal(k[0], (n // 8, 8, D))
  w = jax.random.normal(k[1], (D, vocab))
  targets = jax.random.randint(k[2], (n // 8, 8), 0, vocab)
  chunked = jax.grad(lambda h, w: chunked_token_nll(h, w, targets, chunk_tokens=chunk)[0], (0, 1))
  plain = jax.grad(lambda h, w: token_nll(logits_dot(h, w), targets)[0], (0, 1))
  sizes = lambda f: {int(np.prod(a.shape)) for a in jaxpr_avals(jax.make_jaxpr(f)(h, w).jaxpr)
                     if hasattr(a, "shape")}
  assert n * vocab in sizes(plain)                   # the walk sees the full logits where they are
  assert chunk * vocab in sizes(chunked)             # ... and into the scans
  assert max(sizes(chunked)) < n * vocab, max(sizes(chunked))
  # The compiled programs' temporaries: under one [N, V] float32 array chunked, over it plain.
  temp = lambda f: jax.jit(f).lower(h, w).compile().memory_analysis().temp_size_in_bytes
  logits_bytes = n * vocab * 4
  assert temp(chunked) < logits_bytes / 2 < logits_bytes < temp(plain), (temp(chunked),
                                                                         temp(plain))
