"""Fine-tuning's parameter groups and optimizer.

Every parameter is in one group (`param_labels`):
  head     the classification head: AdamW at train.head_learning_rate;
  body     the pretrained decoder: AdamW at train.body_learning_rate;
  frozen   zero updates (`optax.set_to_zero`, so no weight decay either): the backbone's unused LM
           head always, the whole backbone with train.freeze_body, and with train.freeze_routers
           every parameter under a `router` module (the attention's and FFN's routers, SwitchHead's
           per-projection routers, StableMoE's distilled router, ...).
Each trained group has its own linear warmup + cosine schedule over the run's steps
(`umoe_jax.train.optimizer`); weight decay skips norm scales and the head bias; the gradient is
clipped over all trained parameters jointly, before the per-group AdamW.
"""
from __future__ import annotations

import types
from typing import Any

import jax
import optax
from flax import nnx

from umoe_jax.config import ConfigError
from umoe_jax.train import optimizer as optimizer_lib

HEAD, BODY, FROZEN = "head", "body", "frozen"


def _key_name(k) -> str:
  return str(getattr(k, "key", getattr(k, "idx", k)))


def param_labels(params: Any, *, freeze_body: bool, freeze_routers: bool) -> Any:
  """Pure dict like `params` (the classifier's) of HEAD | BODY | FROZEN."""

  def label(path, _):
    names = [_key_name(k) for k in path]
    if names[0] == "head":
      return HEAD
    if names[:2] == ["backbone", "lm_head"] or freeze_body:
      return FROZEN
    if freeze_routers and "router" in names:
      return FROZEN
    return BODY

  return jax.tree_util.tree_map_with_path(label, params)


def flat_labels(labels: Any) -> tuple:
  """((path string, group), ...) of a labels tree (hashable: part of the compiled step's key)."""
  return tuple((jax.tree_util.keystr(p), v) for p, v in jax.tree_util.tree_leaves_with_path(labels))


def moves_selection_biases(labels: Any) -> bool:
  """True when some router has an aux-loss-free selection bias (`router.bias_update_rate` > 0)
  that is not frozen: the step then moves it after each update, as pretraining does."""
  return any(v != FROZEN and k.endswith("['selection_bias']") for k, v in flat_labels(labels))


def check_freeze_routers(abstract_params: Any, t: Any, router_kind: str) -> None:
  """train.freeze_routers on a backbone without router parameters (dense, hash, AoE) is a mistake.
  `abstract_params`: the classifier's nnx.State of parameters; `t`: config.train."""
  if not t.freeze_routers or t.freeze_body:
    return
  labels = param_labels(nnx.to_pure_dict(abstract_params), freeze_body=False, freeze_routers=True)
  if not any(v == FROZEN and "['router']" in k for k, v in flat_labels(labels)):
    raise ConfigError(f"train.freeze_routers=True, but the backbone (router.kind={router_kind!r}) "
                      f"has no router parameters to freeze")


def decay_mask(abstract_params: Any) -> Any:
  """Pure dict of bools (True = weight decay): `umoe_jax.train.optimizer.decay_mask` (not on norm
  scales), and not on the head bias."""
  decay = optimizer_lib.decay_mask(abstract_params)
  decay["head"]["bias"] = False
  return decay


def _schedule_args(t: Any, lr: float, total_steps: int) -> types.SimpleNamespace:
  """The `train` fields `umoe_jax.train.optimizer` reads, for one parameter group (no clipping:
  that is done once over all groups)."""
  return types.SimpleNamespace(learning_rate=lr, num_steps=total_steps, warmup_steps=None,
                               warmup_ratio=t.warmup_ratio, min_lr_ratio=t.min_lr_ratio, b1=t.b1,
                               b2=t.b2, eps=t.eps, weight_decay=t.weight_decay, grad_clip=0.0,
                               mu_dtype="float32")


def make_optimizer(t: Any, labels: Any, decay: Any, total_steps: int):
  """(tx, {group: schedule}) for config.train `t`: global-norm clipping over every gradient (the
  frozen ones are zero), then AdamW per trained group; frozen: zero updates."""
  present = set(jax.tree.leaves(labels))
  transforms, schedules = {FROZEN: optax.set_to_zero()}, {}
  for group, lr in ((HEAD, t.head_learning_rate), (BODY, t.body_learning_rate)):
    if group in present:
      args = _schedule_args(t, lr, total_steps)
      transforms[group] = optimizer_lib.make_optimizer(args, decay)
      schedules[group] = optimizer_lib.learning_rate_schedule(args)
  tx = optax.multi_transform(transforms, labels)
  if t.grad_clip > 0:
    tx = optax.chain(optax.clip_by_global_norm(float(t.grad_clip)), tx)
  return tx, schedules
