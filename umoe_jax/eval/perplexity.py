"""Validation loss and perplexity: token-weighted mean negative log-likelihood over held-out batches.

  loss       = sum over tokens of -log p(target) / number of tokens   (loss_mask weights tokens)
  perplexity = exp(loss)

Batches are `{"inputs": int32 [B, T], "targets": int32 [B, T]}` (+ optional float "loss_mask" [B, T]).
Only the LM loss is evaluated (no router balance losses).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Optional

import jax
import jax.numpy as jnp

from umoe_jax.ops.lm_loss import token_nll


def eval_step(params: Any, batch: dict, *, graphdef: Any) -> tuple[jax.Array, jax.Array]:
  """(nll sum, token count) of one batch; jit it with `graphdef` bound (functools.partial)."""
  from flax import nnx
  model = nnx.merge(graphdef, params)
  logits, _ = model(batch["inputs"])
  return token_nll(logits, batch["targets"], batch.get("loss_mask"))


def evaluate(step_fn: Callable[[Any, dict], tuple[jax.Array, jax.Array]], params: Any,
             batches: Iterable[dict]) -> dict[str, float]:
  """{"loss", "perplexity", "tokens"} over `batches` (already on device, or host arrays)."""
  nll, count = jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)
  for batch in batches:
    s, c = step_fn(params, batch)
    nll, count = nll + s, count + c
  nll, count = float(nll), float(count)
  if count == 0:
    raise ValueError("evaluation saw no tokens (empty eval data?)")
  loss = nll / count
  return {"loss": loss, "perplexity": math.exp(min(loss, 80.0)), "tokens": count}
