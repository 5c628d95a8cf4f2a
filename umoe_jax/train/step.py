"""The jitted training step: `train_step(state, batch) -> (state, metrics)`, a pure function.

Loss = LM cross-entropy (token mean) + the routers' balance losses and other losses (z-loss, ...;
coefficients already applied by each router). Gradient accumulation is a `lax.scan` over micro-batches inside the step rather
than `optax.MultiSteps`:
  * one call = one optimizer update, so the step counter, the LR schedule, the data-iterator
    position saved in a checkpoint and the metrics all count the same thing;
  * clipping and the non-finite check see the gradient of the whole batch, and a skipped step
    drops the whole batch (MultiSteps would check micro-batches one by one);
  * the accumulator lives in the scan carry, not in the optimizer state, so checkpoints hold no
    half-accumulated gradient and need no extra memory between steps;
  * the host dispatches one program per step instead of `grad_accum_steps`.
Micro-batch a takes rows a, a + A, a + 2A, ... of the batch, so that with the batch split over
devices every micro-batch is split over all of them too.

Non-finite loss or gradient norm: the update is dropped (params and optimizer state unchanged,
selected with `jnp.where`), `skipped` grows, and `metrics["nonfinite"]` is 1. With
`on_nonfinite="stop"` the state is also marked `halted`, and every later step of this run is dropped
too, so the state stays at the last good step until the loop (which reads the metrics at each log
interval) stops the run naming the step. `halted` is run-local (not checkpointed): a run resumed
from a checkpoint whose `skipped` is non-zero (an earlier run under "skip") trains normally.
`metrics["applied"]` is 0 for every dropped update, whatever the reason, so none is silent.

Routers see the training step (schedules) and a PRNG key (`step_rng`: the router-input jitter),
folded with the micro-batch index. After the optimizer update, routers with aux-loss-free balancing
move their selection biases by the batch's load (`routers.bias_balance`; part of params, so a
dropped update drops that too).
"""
from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from umoe_jax.model.routers.bias_balance import update_selection_biases
from umoe_jax.ops.chunked_loss import chunked_token_nll
from umoe_jax.ops.lm_loss import token_nll
from umoe_jax.train.state import TrainState


def step_rng(state: TrainState) -> jax.Array:
  """The PRNG key of this step's forward passes: the state's key folded with its step."""
  return jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)


def _forward(params: Any, micro: dict, *, graphdef: Any, remat: bool | str, total_tokens: jax.Array,
             accum_steps: int, step: Optional[jax.Array], rng: Optional[jax.Array] = None,
             loss_chunk_tokens: int = 0, fused_loss_head: bool = False):
  """Objective whose gradient, summed over micro-batches, is the batch's gradient.

  `loss_chunk_tokens` > 0 fuses the LM head into the cross-entropy, chunked over that many tokens
  (`umoe_jax.ops.chunked_loss`: no float32 [tokens, V] logits); else `fused_loss_head` fuses them
  unchunked (the logits kept, the logit cotangent rounded as it is formed); else the model's
  logits, then `token_nll`."""
  model = nnx.merge(graphdef, params)
  # The step reaches routers with a schedule (SMoE-Dropout's growing k, StableMoE's stage switch);
  # the key, routers with jitter.
  if loss_chunk_tokens or fused_loss_head:
    h, aux = model.hidden_states(micro["inputs"], remat=remat, step=step, rng=rng)
    with jax.named_scope("lm_head_loss"):
      w = model.lm_head.value.astype(model.cfg.compute_dtype)
      nll_sum, count = chunked_token_nll(h, w, micro["targets"], micro.get("loss_mask"),
                                         chunk_tokens=loss_chunk_tokens or micro["targets"].size,
                                         keep_logits=not loss_chunk_tokens)
  else:
    logits, aux = model(micro["inputs"], remat=remat, step=step, rng=rng)
    with jax.named_scope("loss"):
      nll_sum, count = token_nll(logits, micro["targets"], micro.get("loss_mask"))
  balance = aux["balance_loss"]
  router_losses = aux.get("router_losses", {})
  extra = sum(router_losses.values(), jnp.zeros((), jnp.float32))
  objective = nll_sum / total_tokens + (balance + extra) / accum_steps
  stats = {"nll_sum": nll_sum, "tokens": count, "balance_loss": balance,
           "router_losses": router_losses, "routers": aux["routers"]}
  dropped = _dropped_rows(model)
  if dropped is not None:
    stats["ep_dropped_rows"] = dropped
  return objective, stats


def _dropped_rows(model: nnx.Module) -> Optional[jax.Array]:
  """The (token, slot) rows the forward's expert-parallel exchanges dropped for lack of buffer
  room, summed over pools and calls ([] int32), or None when none counted them (no capacity factor:
  dropless). The pools sow the counts (`model.expert_routes`); they live in the forward only."""
  counts = nnx.All(nnx.Intermediate, nnx.PathContains("ep_dropped_rows"))
  sown = jax.tree.leaves(nnx.pop(model, counts))
  if not sown:
    return None
  return sum((jnp.asarray(v, jnp.int32) for v in sown), jnp.zeros((), jnp.int32))


def _micro_batches(batch: dict, accum_steps: int) -> dict:
  """[B, ...] -> [A, B / A, ...]; micro-batch a holds rows a::A."""
  def split(x):
    b = x.shape[0]
    return x.reshape(b // accum_steps, accum_steps, *x.shape[1:]).swapaxes(0, 1)
  return jax.tree.map(split, batch)


def _reduce_micro(stats: dict, accum_steps: int) -> dict:
  """Sum over micro-batches of the per-micro-batch aux: counts add, scalar means average."""
  out = dict(stats)
  out["balance_loss"] = stats["balance_loss"] / accum_steps
  out["router_losses"] = jax.tree.map(lambda x: x / accum_steps, stats["router_losses"])
  out["routers"] = jax.tree.map(lambda x: x / accum_steps if x.ndim == 0 else x, stats["routers"])
  return out   # ep_dropped_rows (when present) is a count: summed, as the scan left it


def grads_and_stats(params: Any, batch: dict, *, graphdef: Any, accum_steps: int, remat: bool | str,
                    step: Optional[jax.Array] = None, rng: Optional[jax.Array] = None,
                    loss_chunk_tokens: int = 0, fused_loss_head: bool = False):
  """(grads, stats) of the whole batch, accumulating over `accum_steps` micro-batches; `step` []
  int32 is the training step the routers see (None: as at the end of training), `rng` their key
  (folded with the micro-batch index; None: no router noise); `loss_chunk_tokens` and
  `fused_loss_head` as in `_forward` (`train.loss_chunk_tokens`, `train.fused_loss_head`)."""
  mask = batch.get("loss_mask")
  total = (jnp.sum(mask.astype(jnp.float32)) if mask is not None
           else jnp.asarray(batch["targets"].size, jnp.float32))
  total = jnp.maximum(total, 1.0)
  grad_fn = jax.grad(_forward, has_aux=True)
  kw = dict(graphdef=graphdef, remat=remat, total_tokens=total, accum_steps=accum_steps, step=step,
            loss_chunk_tokens=loss_chunk_tokens, fused_loss_head=fused_loss_head)
  micro_rng = lambda a: None if rng is None else jax.random.fold_in(rng, a)
  if accum_steps == 1:
    grads, stats = grad_fn(params, batch, rng=micro_rng(0), **kw)
    return grads, stats
  micro = _micro_batches(batch, accum_steps)
  first = jax.tree.map(lambda x: x[0], micro)
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                       jax.eval_shape(lambda p, m: grad_fn(p, m, rng=micro_rng(0), **kw), params,
                                      first))

  def body(carry, m_a):
    m, a = m_a
    out = grad_fn(params, m, rng=micro_rng(a), **kw)
    return jax.tree.map(jnp.add, carry, out), None

  (grads, stats), _ = jax.lax.scan(body, zeros, (micro, jnp.arange(accum_steps)))
  return grads, _reduce_micro(stats, accum_steps)


def keep_if(apply: jax.Array, new: Any, old: Any) -> Any:
  """`new` where `apply` ([] bool) holds, else `old`, leaf by leaf: a dropped update (non-finite, or
  the state halted) leaves parameters and optimizer state as they were."""
  return jax.tree.map(lambda n, o: jnp.where(apply, n, o), new, old)


def train_step(state: TrainState, batch: dict, *, graphdef: Any, tx: optax.GradientTransformation,
               schedule: optax.Schedule, accum_steps: int = 1, remat: bool | str = False,
               on_nonfinite: str = "stop", loss_chunk_tokens: int = 0,
               fused_loss_head: bool = False) -> tuple[TrainState, dict]:
  """One optimizer update on `batch` ({"inputs", "targets": int32 [B, T]}, optional "loss_mask").

  Bind the keyword arguments with functools.partial and jit with `donate_argnums=0`.
  `loss_chunk_tokens` (`train.loss_chunk_tokens`) > 0: the LM head and cross-entropy in chunks of
  that many tokens; `fused_loss_head` (`train.fused_loss_head`): as one op, unchunked (`_forward`).
  Returns the new state and metrics: loss, lm_loss, balance_loss, router_losses ({name: value}, the
  routers' other losses: "z_loss", ...), grad_norm (before clipping), learning_rate, tokens,
  param_norm (global norm of the parameters after the step: what the save guard watches),
  nonfinite (this step's loss or gradient norm is NaN / inf), applied (0 if the update was dropped:
  non-finite, or the state is halted), and per router {"balance_loss", "expert_counts" [E],
  "entropy", its other losses, and "bias_spread" (max - min of its selection bias after the update)
  for routers with aux-loss-free balancing}; under expert parallelism with a capacity factor also
  ep_dropped_rows ([] int32, the batch's (token, slot) rows dropped by the exchanges' buffers).
  """
  applied_steps = state.step - state.skipped  # the counter the learning-rate schedule reads too
  grads, stats = grads_and_stats(state.params, batch, graphdef=graphdef, accum_steps=accum_steps,
                                 remat=remat, step=applied_steps, rng=step_rng(state),
                                 loss_chunk_tokens=loss_chunk_tokens,
                                 fused_loss_head=fused_loss_head)
  lm_loss = stats["nll_sum"] / jnp.maximum(stats["tokens"], 1.0)
  loss = lm_loss + stats["balance_loss"] + sum(stats["router_losses"].values(),
                                               jnp.zeros((), jnp.float32))
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  if on_nonfinite == "skip":
    apply, halted = finite, state.halted
  else:  # "stop": freeze at the last good step of this run (never on `skipped` of earlier runs)
    apply, halted = finite & ~state.halted, state.halted | ~finite

  with jax.named_scope("optimizer"):
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
  # Aux-loss-free balancing: selection biases follow this batch's loads (no gradient of their own).
  params, bias_spreads = update_selection_biases(params, graphdef, stats["routers"])
  new_params = keep_if(apply, params, state.params)
  new_state = state.replace(
      step=state.step + 1,
      params=new_params,
      opt_state=keep_if(apply, opt_state, state.opt_state),
      skipped=state.skipped + (1 - apply.astype(jnp.int32)),
      halted=halted)
  metrics = {
      "loss": loss,
      "lm_loss": lm_loss,
      "balance_loss": stats["balance_loss"],
      "grad_norm": grad_norm,
      "learning_rate": schedule(applied_steps),
      "tokens": stats["tokens"],
      "nonfinite": (~finite).astype(jnp.int32),
      "applied": apply.astype(jnp.int32),
      "param_norm": optax.tree.norm(new_params),
      "router_losses": stats["router_losses"],
      **({"ep_dropped_rows": stats["ep_dropped_rows"]} if "ep_dropped_rows" in stats else {}),
      "routers": {name: {**r, **({"bias_spread": bias_spreads[name]} if name in bias_spreads else {})}
                  for name, r in stats["routers"].items()},
  }
  return new_state, metrics
