"""The fine-tuning step and its compiled program (`programs`).

  loss = CE(logits, labels), mean over the batch's real rows (weights 1; the rows filling the last
         batch have weight 0)
       + train.balance_loss_weight x the routers' balance losses (each router's coefficient already
         applied, as in pretraining), so routing stays balanced while the decoder adapts.

Frozen parameters (`optimizer.param_labels`) get zero gradients before clipping and zero updates,
so they stay bit-identical and XLA drops their part of the backward pass. A non-finite loss or
gradient drops that update (the loop raises on it).

Keys (`step_keys`): the head's dropout and the routers' input jitter (`router.jitter_eps`) draw from
two keys split from fold_in(rng, step), so a run resumed at step s draws what the uninterrupted run
drew. Routers see no step (they route as at the end of pretraining: SMoE-Dropout with all k
experts, StableMoE's frozen stage 2).

Aux-loss-free balancing (`router.bias_update_rate` > 0), as in pretraining: after each update every
router's selection bias moves by the step's load (`routers.bias_balance`), unless the routers are
frozen (train.freeze_routers / freeze_body: the biases stay as pretrained). The load is counted over
the real tokens only, tokens[i, :lengths[i]] of the rows with weight > 0: the padding (a run of one
pad id, and the filler rows of the last batch) would pull the biases towards wherever the pad token
routes. The balance losses and the logged expert counts still include the padding (the backbone's
aux, `model`).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from umoe_jax.finetune import optimizer as optimizer_lib
from umoe_jax.finetune.predict import device_sharding
from umoe_jax.model.remat import policy_name
from umoe_jax.model.routers import pick_counts
from umoe_jax.model.routers.bias_balance import update_selection_biases


def step_keys(state: dict) -> tuple[jax.Array, jax.Array]:
  """(head-dropout key, router key) of the state's step: split(fold_in(rng, step)), a pure function
  of the state's "rng" and "step"."""
  key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])
  dropout_key, router_key = jax.random.split(key)
  return dropout_key, router_key


def real_tokens(batch: dict) -> jax.Array:
  """[B, L] bool: the batch's real tokens (tokens[i, :lengths[i]] of the rows with weight > 0)."""
  length = batch["tokens"].shape[1]
  inside = jnp.arange(length)[None, :] < batch["lengths"][:, None]
  return inside & (batch["weights"][:, None] > 0)


def train_step(state: dict, batch: dict, *, graphdef: Any, tx: Any, labels: Any, schedules: dict,
               balance_weight: float, remat: bool | str,
               move_biases: bool = False) -> tuple[dict, dict]:
  """One update. state: {"step" [] int32, "params", "opt_state", "rng" [2] uint32, "best_score" []
  float32, "best_step" [] int32}; batch: `data.collate`'s {"tokens" [B, L], "lengths" [B],
  "labels" [B], "weights" [B]}. `move_biases`: update the routers' selection biases from the real
  tokens' load (`optimizer.moves_selection_biases`). Returns (new state, metrics of the step, on
  device); metrics["routers"][name] has "bias_spread" (max - min of the bias after the update) for
  every router whose bias moved."""
  dropout_key, router_key = step_keys(state)

  def loss_fn(params):
    logits, aux = nnx.merge(graphdef, params)(batch["tokens"], batch["lengths"],
                                              dropout_rng=dropout_key, router_rng=router_key,
                                              remat=remat, return_routes=move_biases)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, batch["labels"][:, None], axis=-1)[:, 0]       # [B]
    w = batch["weights"]
    ce = jnp.sum(w * nll) / jnp.maximum(jnp.sum(w), 1.0)
    correct = jnp.sum(w * (jnp.argmax(logits, axis=-1) == batch["labels"]))
    loss = ce + balance_weight * aux["balance_loss"]
    stats = {"ce_loss": ce, "balance_loss": aux["balance_loss"], "routers": aux["routers"],
             "correct": correct, "count": jnp.sum(w)}
    if move_biases:   # the real tokens' picks per router, the load the biases follow
      mask = real_tokens(batch)
      stats["bias_loads"] = {name: {"expert_counts": pick_counts(r, r.probs.shape[-1], mask)}
                             for name, r in aux["routes"].items()}
    return loss, stats

  grads, stats = jax.grad(loss_fn, has_aux=True)(state["params"])
  grads = jax.tree.map(lambda g, lab: jnp.zeros_like(g) if lab == optimizer_lib.FROZEN else g,
                       grads, labels)
  grad_norm = optax.tree.norm(grads)
  loss = stats["ce_loss"] + balance_weight * stats["balance_loss"]
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
  params = optax.apply_updates(state["params"], updates)
  routers = stats["routers"]
  if move_biases:
    # Aux-loss-free balancing: the selection biases follow the real tokens' load (no gradient).
    params, spreads = update_selection_biases(params, graphdef, stats.pop("bias_loads"))
    params = jax.tree.map(lambda n, o, lab: o if lab == optimizer_lib.FROZEN else n,
                          params, state["params"], labels)   # frozen stays bit-identical
    routers = {name: {**r, **({"bias_spread": spreads[name]} if name in spreads else {})}
               for name, r in routers.items()}
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
  new_state = dict(state, step=state["step"] + 1, params=keep(params, state["params"]),
                   opt_state=keep(opt_state, state["opt_state"]))
  metrics = dict(stats, routers=routers, loss=loss, grad_norm=grad_norm, finite=finite,
                 **{f"learning_rate_{g}": s(state["step"]) for g, s in schedules.items()})
  return new_state, metrics


@dataclasses.dataclass(frozen=True)
class Programs:
  labels: Any              # pure dict of HEAD | BODY | FROZEN, like the params
  tx: Any
  schedules: dict          # group -> optax schedule
  abstract_state: dict     # ShapeDtypeStructs of the train state
  train_fn: Callable       # jitted (state, batch) -> (state, metrics); state donated


# Keys of config.train that shape the compiled step (the others steer the loop only).
OPTIMIZER_KEYS = ("head_learning_rate", "body_learning_rate", "warmup_ratio", "min_lr_ratio", "b1",
                  "b2", "eps", "weight_decay", "grad_clip", "freeze_body", "freeze_routers")

# Built programs by (graphdef, groups, optimizer settings, steps, ...): a second run in one process
# (resume, the tests) reuses the compiled step instead of tracing a new one.
_PROGRAMS: dict = {}


def programs(config: Any, graphdef: Any, abstract_params: Any, total_steps: int) -> Programs:
  """The optimizer and jitted step of this classifier and config. `abstract_params`: the nnx.State
  of the abstract classifier's parameters (its logical axes pick the weight-decay mask)."""
  t = config.train
  remat = policy_name(config.model.remat)
  pure = nnx.to_pure_dict(abstract_params)
  labels = optimizer_lib.param_labels(pure, freeze_body=t.freeze_body,
                                      freeze_routers=t.freeze_routers)
  key = (graphdef, optimizer_lib.flat_labels(labels), tuple((k, t[k]) for k in OPTIMIZER_KEYS),
         total_steps, float(t.balance_loss_weight), remat)
  if key not in _PROGRAMS:
    tx, schedules = optimizer_lib.make_optimizer(t, labels, optimizer_lib.decay_mask(abstract_params),
                                                 total_steps)
    abstract_state = {
        "step": jax.ShapeDtypeStruct((), jnp.int32), "params": pure,
        "opt_state": jax.eval_shape(tx.init, pure),
        "rng": jax.ShapeDtypeStruct((2,), jnp.uint32),
        "best_score": jax.ShapeDtypeStruct((), jnp.float32),
        "best_step": jax.ShapeDtypeStruct((), jnp.int32)}
    step = functools.partial(train_step, graphdef=graphdef, tx=tx, labels=labels,
                             schedules=schedules, balance_weight=float(t.balance_loss_weight),
                             remat=remat,
                             move_biases=optimizer_lib.moves_selection_biases(labels))
    while len(_PROGRAMS) >= 4:
      _PROGRAMS.pop(next(iter(_PROGRAMS)))
    # Explicit placement: state and batch are committed to the device, so every step (fresh,
    # restored or updated state alike) hits one compiled program.
    device = device_sharding()
    _PROGRAMS[key] = Programs(labels=labels, tx=tx, schedules=schedules,
                              abstract_state=abstract_state,
                              train_fn=jax.jit(step, in_shardings=device, out_shardings=device,
                                               donate_argnums=0))
  return _PROGRAMS[key]
