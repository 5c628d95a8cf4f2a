"""AdamW with linear warmup + cosine decay, global-norm clipping, and no weight decay on norm scales.

  update = -lr(t) * (adam(clip(g)) + wd * p * mask)      mask = False for norm scales
  lr(t)  = peak * t / warmup                                         t < warmup
           peak * (r + (1 - r) * (1 + cos(pi * (t - warmup) / (N - warmup))) / 2)   t >= warmup

with r = `train.min_lr_ratio`, N = `train.num_steps`. `t` is the optimizer's own update count, so
a skipped (non-finite) step does not advance the schedule.
"""
from __future__ import annotations

import types
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import optax

from umoe_jax.parallel import rules as ax


def warmup_steps(train: Any) -> int:
  if train.warmup_steps is not None:
    return int(train.warmup_steps)
  return int(round(train.warmup_ratio * train.num_steps))


def learning_rate_schedule(train: Any) -> optax.Schedule:
  """Linear warmup from 0 to `learning_rate`, then cosine down to `min_lr_ratio * learning_rate`."""
  peak, total = float(train.learning_rate), int(train.num_steps)
  warm = min(warmup_steps(train), total)
  cosine = optax.cosine_decay_schedule(peak, decay_steps=max(total - warm, 1),
                                       alpha=float(train.min_lr_ratio))
  if warm == 0:
    return cosine
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warm), cosine], [warm])


# The train keys that shape the learning-rate schedule.
SCHEDULE_KEYS = ("num_steps", "learning_rate", "warmup_steps", "warmup_ratio", "min_lr_ratio")


def schedule_change(saved: Mapping[str, Any], train: Any, step: int, count: int) -> Optional[str]:
  """What resuming at `step` (`count` updates applied) with `train` instead of the run's saved train
  config (`saved`, from its config.json) does to the schedule: 'train.num_steps 40 -> 60: the
  learning rate at step 25, where this run resumes, becomes 3.12e-04 (was 1.42e-04)', or None when
  no schedule key changed. Keys missing from `saved` count as unchanged."""
  old = types.SimpleNamespace(**{k: saved.get(k, getattr(train, k)) for k in SCHEDULE_KEYS})
  changed = [k for k in SCHEDULE_KEYS if getattr(old, k) != getattr(train, k)]
  if train.warmup_steps is not None and old.warmup_steps is not None and "warmup_ratio" in changed:
    changed.remove("warmup_ratio")  # unused next to warmup_steps
  if not changed:
    return None
  lr = lambda t: float(learning_rate_schedule(t)(count))
  keys = ", ".join(f"train.{k} {getattr(old, k)!r} -> {getattr(train, k)!r}" for k in changed)
  return (f"{keys}: the learning rate at step {step}, where this run resumes, becomes "
          f"{lr(train):.2e} (was {lr(old):.2e})")


def _logical_axes(var: Any) -> tuple:
  meta = var.get_metadata() if hasattr(var, "get_metadata") else {}
  for key in ("out_sharding", "sharding_names", "sharding"):
    if meta.get(key) is not None:
      return tuple(meta[key])
  return ()


def _is_norm(path: tuple, var: Any) -> bool:
  """A norm scale: tagged with the logical axis `norm`, or (untagged) a path entry naming a norm."""
  axes = _logical_axes(var)
  if axes:
    return ax.NORM in axes
  return any("norm" in str(getattr(k, "key", getattr(k, "name", k))).lower() for k in path)


def decay_mask(abstract_params: Any) -> Any:
  """Pure-dict tree of bools (True = apply weight decay) from an nnx.State of the parameters.

  Norm scales (logical axis `norm`) are never decayed, as in the official HF Trainer recipe (no
  decay on LayerNorm weights and biases; the models have no biases).
  """
  from flax import nnx

  def one(path, var):
    return not _is_norm(path, var)

  flags = jax.tree_util.tree_map_with_path(one, abstract_params,
                                           is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.to_pure_dict(flags) if isinstance(flags, nnx.State) else flags


def adamw(train: Any, mask: Any) -> optax.GradientTransformation:
  """AdamW(schedule, b1, b2, eps, weight_decay, mask), the first moment kept in `train.mu_dtype`
  (float32: the parameters' dtype)."""
  mu_dtype = None if train.mu_dtype == "float32" else jnp.dtype(train.mu_dtype)
  return optax.adamw(learning_rate_schedule(train), b1=float(train.b1), b2=float(train.b2),
                     eps=float(train.eps), weight_decay=float(train.weight_decay), mask=mask,
                     mu_dtype=mu_dtype)


def make_optimizer(train: Any, mask: Any) -> optax.GradientTransformation:
  """clip_by_global_norm(grad_clip) -> `adamw` (no clipping when grad_clip is 0)."""
  if train.grad_clip > 0:
    return optax.chain(optax.clip_by_global_norm(float(train.grad_clip)), adamw(train, mask))
  return adamw(train, mask)
