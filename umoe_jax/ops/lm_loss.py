"""The language-model loss of a batch: summed negative log-likelihood of the targets and the number of
tokens, which training (`train.step`) and evaluation (`eval.perplexity`) both reduce; the chunked,
LM-head-fused form is `chunked_loss.chunked_token_nll`."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import optax


def token_nll(logits: jax.Array, targets: jax.Array,
              loss_mask: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array]:
  """(sum of -log p(target), number of tokens), both float32 scalars.

  Args:
    logits: [B, T, V] (float32 from the model).
    targets: [B, T] int.
    loss_mask: optional [B, T] weights (1 = counted, 0 = ignored).
  """
  nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
  if loss_mask is None:
    return jnp.sum(nll), jnp.asarray(nll.size, jnp.float32)
  mask = loss_mask.astype(jnp.float32)
  return jnp.sum(nll * mask), jnp.sum(mask)
