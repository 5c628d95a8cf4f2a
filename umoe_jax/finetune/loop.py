"""The fine-tuning loop: `run(config, workdir)`.

  check the config -> the backbone's config and tokenizer (init_from) -> read, label, carve, tokenize
  -> classifier, optimizer (optax.multi_transform: head / body / frozen) -> start point (own
  checkpoint > init_from backbone + fresh head) -> epochs of steps; at every epoch end: dev accuracy
  and macro-F1, the best dev epoch saved to <workdir>/best, a training checkpoint
  -> the best checkpoint scored on dev and test: results.json, test_predictions.jsonl.

Loss = cross-entropy of the labels (mean over the batch's real rows) + train.balance_loss_weight x the
routers' balance losses (each router's coefficient already applied, as in pretraining), so routing
stays balanced while the routers adapt. Frozen parameters (`param_labels`: the backbone's unused LM
head always; the whole backbone with train.freeze_body; every router with train.freeze_routers) get
zero gradients before clipping and zero updates, so they stay bit-identical and their backward pass
is dead code XLA removes. Head and body have their own AdamW with its own warmup + cosine schedule
(`umoe_jax.train.optimizer`); the gradient is clipped over the trained parameters jointly.

Step s trains on the slice (s mod S) of the permutation of epoch s // S (`data.train_batch`) and
draws its dropout from fold_in(rng, s), so a run resumed from a checkpoint at step s continues exactly
as the uninterrupted run. SIGTERM / Ctrl-C save the current step and return (as pretraining does).
One device, one process (the model is small next to pretraining; the mesh machinery is not used).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import sys
import types
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from flax import nnx

from umoe_jax.config import ConfigError, model_config
from umoe_jax.finetune import config as config_lib
from umoe_jax.finetune import data as data_lib
from umoe_jax.finetune import predict as predict_lib
from umoe_jax.finetune.metrics import majority_accuracy
from umoe_jax.finetune.model import init_head
from umoe_jax.model.remat import policy_name
from umoe_jax.train import checkpoint as ckpt_lib
from umoe_jax.train import metrics as metrics_lib
from umoe_jax.train import optimizer as optimizer_lib
from umoe_jax.train.loop import StopRequest

HEAD, BODY, FROZEN = "head", "body", "frozen"


class NonFiniteError(FloatingPointError):
  """The fine-tuning loss or gradient became NaN / inf."""


# ----------------------------------------------------------------------------------------------
# Data.


@dataclasses.dataclass
class Split:
  name: str                 # train | dev | test
  path: str                 # the file (dev carved from train: the train file)
  rows: list                # int32 token rows
  labels: np.ndarray        # int32 [N] class ids


def _tokenizer_spec(config: Any, saved: dict) -> tuple[str, str]:
  """(tokenizer, eos_token): data.tokenizer, else the pretraining run's data.tokenizer."""
  d = config.data
  if d.tokenizer:
    spec, eos = d.tokenizer, d.eos_token
  else:
    pretrain = saved.get("data") or {}
    if not pretrain.get("tokenizer"):
      raise ConfigError(f"init_from={config.init_from!r} does not name its tokenizer (a converted "
                        f"checkpoint): set data.tokenizer (and data.bos_id=1 for Llama-2)")
    spec, eos = pretrain["tokenizer"], d.eos_token or pretrain.get("eos_token", "")
  if spec != "byte" and os.path.exists(os.path.expanduser(spec)):
    spec = os.path.abspath(os.path.expanduser(spec))
  return spec, eos


def load_data(config: Any, tokenizer) -> tuple[data_lib.LabelMap, Split, Split, Optional[Split]]:
  """(label map, train, dev, test or None): read, labelled against the training file, tokenized."""
  d, seed = config.data, config.train.seed
  kw = dict(text_field=d.text_field, label_field=d.label_field, fmt=d.format)
  train = data_lib.read_examples(d.train_path, key="data.train_path", **kw)
  label_map = data_lib.build_label_map(train, path=d.train_path, label_names=list(d.label_names))
  if d.dev_path:
    dev, dev_path = data_lib.read_examples(d.dev_path, key="data.dev_path", **kw), d.dev_path
  else:
    train, dev = data_lib.carve_dev(train, d.dev_fraction, seed)
    dev_path = f"{d.train_path} (dev carve-out)"
    if not dev:
      raise data_lib.DataError(f"data.train_path={d.train_path!r}: too few examples per class to carve "
                               f"a dev split of data.dev_fraction={d.dev_fraction}; give data.dev_path")
  test = data_lib.read_examples(d.test_path, key="data.test_path", **kw) if d.test_path else None

  def split(name, path, examples):
    ids = label_map.ids(examples, path=path, train_path=d.train_path)
    rows = data_lib.encode([e.text for e in examples], tokenizer, max_len=d.max_len,
                           bos_id=d.bos_id, append_eos=d.append_eos)
    return Split(name, path, rows, ids)

  return (label_map, split("train", d.train_path, train), split("dev", dev_path, dev),
          split("test", d.test_path, test) if test is not None else None)


# ----------------------------------------------------------------------------------------------
# Parameters: groups, optimizer.


def _key_name(k) -> str:
  return str(getattr(k, "key", getattr(k, "idx", k)))


def param_labels(params: Any, *, freeze_body: bool, freeze_routers: bool) -> Any:
  """Pure dict like `params` of "head" | "body" | "frozen" (see the module docstring)."""

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


def check_freeze_routers(abstract_params: Any, t: Any, router_kind: str) -> None:
  """train.freeze_routers on a backbone without router parameters (dense, hash, AoE) is a mistake."""
  if not t.freeze_routers or t.freeze_body:
    return
  labels = param_labels(nnx.to_pure_dict(abstract_params), freeze_body=False, freeze_routers=True)
  if not any(v == FROZEN and "['router']" in k for k, v in flat_labels(labels)):
    raise ConfigError(f"train.freeze_routers=True, but the backbone (router.kind={router_kind!r}) "
                      f"has no router parameters to freeze")


def _schedule_args(t: Any, lr: float, total_steps: int) -> types.SimpleNamespace:
  """The `train` fields `umoe_jax.train.optimizer` reads, for one parameter group."""
  return types.SimpleNamespace(learning_rate=lr, num_steps=total_steps, warmup_steps=None,
                               warmup_ratio=t.warmup_ratio, min_lr_ratio=t.min_lr_ratio, b1=t.b1,
                               b2=t.b2, eps=t.eps, weight_decay=t.weight_decay, grad_clip=0.0)


def make_optimizer(t: Any, labels: Any, decay: Any, total_steps: int):
  """(tx, {group: schedule}): clip over all trained gradients, then AdamW per group; frozen: zero."""
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


# ----------------------------------------------------------------------------------------------
# The step.


def train_step(state: dict, batch: dict, *, graphdef: Any, tx: Any, labels: Any, schedules: dict,
               balance_weight: float, remat: bool | str) -> tuple[dict, dict]:
  """One update. state: {"step", "params", "opt_state", "rng", "best_score", "best_step"};
  batch: `data.collate` arrays. A non-finite loss or gradient drops the update (metrics say so)."""
  key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])

  def loss_fn(params):
    logits, aux = nnx.merge(graphdef, params)(batch["tokens"], batch["lengths"], dropout_rng=key,
                                              remat=remat)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, batch["labels"][:, None], axis=-1)[:, 0]
    w = batch["weights"]
    count = jnp.maximum(jnp.sum(w), 1.0)
    ce = jnp.sum(w * nll) / count
    correct = jnp.sum(w * (jnp.argmax(logits, axis=-1) == batch["labels"]))
    loss = ce + balance_weight * aux["balance_loss"]
    return loss, {"ce_loss": ce, "balance_loss": aux["balance_loss"], "routers": aux["routers"],
                  "correct": correct, "count": jnp.sum(w)}

  grads, stats = jax.grad(loss_fn, has_aux=True)(state["params"])
  grads = jax.tree.map(lambda g, lab: jnp.zeros_like(g) if lab == FROZEN else g, grads, labels)
  grad_norm = optax.tree.norm(grads)
  loss = stats["ce_loss"] + balance_weight * stats["balance_loss"]
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
  params = optax.apply_updates(state["params"], updates)
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
  new_state = dict(state, step=state["step"] + 1, params=keep(params, state["params"]),
                   opt_state=keep(opt_state, state["opt_state"]))
  metrics = dict(stats, loss=loss, grad_norm=grad_norm, finite=finite,
                 **{f"learning_rate_{g}": s(state["step"]) for g, s in schedules.items()})
  return new_state, metrics


@dataclasses.dataclass(frozen=True)
class Programs:
  labels: Any              # pure dict of HEAD | BODY | FROZEN, like the params
  tx: Any
  schedules: dict          # group -> optax schedule
  abstract_state: dict     # ShapeDtypeStructs of the train state
  train_fn: Callable       # jitted (state, batch) -> (state, metrics); state donated


def device_sharding() -> jax.sharding.Sharding:
  """Where fine-tuning runs: the first device."""
  return jax.sharding.SingleDeviceSharding(jax.devices()[0])


# Keys of config.train that shape the compiled step (the others steer the loop only).
OPTIMIZER_KEYS = ("head_learning_rate", "body_learning_rate", "warmup_ratio", "min_lr_ratio", "b1",
                  "b2", "eps", "weight_decay", "grad_clip", "freeze_body", "freeze_routers")

# Built programs by (graphdef, groups, optimizer settings, steps, ...): a second run in one process
# (resume, the tests) reuses the compiled step instead of tracing a new one.
_PROGRAMS: dict = {}


def flat_labels(labels: Any) -> tuple:
  """((path string, group), ...) of a labels tree."""
  return tuple((jax.tree_util.keystr(p), v) for p, v in jax.tree_util.tree_leaves_with_path(labels))


def programs(config: Any, graphdef: Any, abstract_params: Any, total_steps: int) -> Programs:
  """The optimizer and jitted step of this classifier and config. `abstract_params`: the nnx.State
  of the abstract classifier's parameters (its logical axes pick the weight-decay mask)."""
  t = config.train
  pure = nnx.to_pure_dict(abstract_params)
  labels = param_labels(pure, freeze_body=t.freeze_body, freeze_routers=t.freeze_routers)
  key = (graphdef, flat_labels(labels), tuple((k, t[k]) for k in OPTIMIZER_KEYS), total_steps,
         float(t.balance_loss_weight), policy_name(config.model.remat))
  if key not in _PROGRAMS:
    decay = optimizer_lib.decay_mask(abstract_params)
    decay["head"]["bias"] = False
    tx, schedules = make_optimizer(t, labels, decay, total_steps)
    abstract_state = {
        "step": jax.ShapeDtypeStruct((), jnp.int32), "params": pure,
        "opt_state": jax.eval_shape(tx.init, pure),
        "rng": jax.ShapeDtypeStruct((2,), jnp.uint32),
        "best_score": jax.ShapeDtypeStruct((), jnp.float32),
        "best_step": jax.ShapeDtypeStruct((), jnp.int32)}
    step = functools.partial(train_step, graphdef=graphdef, tx=tx, labels=labels,
                             schedules=schedules, balance_weight=float(t.balance_loss_weight),
                             remat=policy_name(config.model.remat))
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


# ----------------------------------------------------------------------------------------------
# Metrics of a log interval.


def summarize(steps: list[dict]) -> dict[str, float]:
  """Host metrics of the interval's steps -> TensorBoard scalars (means; accuracy over all rows)."""
  mean = lambda key: float(np.mean([float(s[key]) for s in steps]))
  out = {"train/loss": mean("loss"), "train/ce_loss": mean("ce_loss"),
         "train/balance_loss": mean("balance_loss"), "train/grad_norm": mean("grad_norm"),
         "train/accuracy": float(sum(float(s["correct"]) for s in steps)
                                 / max(sum(float(s["count"]) for s in steps), 1.0))}
  for key in steps[0]:
    if key.startswith("learning_rate_"):
      out[f"train/{key}"] = mean(key)
  for name in sorted(steps[0]["routers"]):
    per_step = [s["routers"][name] for s in steps]
    for key in ("balance_loss", "entropy"):
      if key in per_step[0]:
        out[metrics_lib.router_tag(name, key)] = float(np.mean([float(r[key]) for r in per_step]))
    if "expert_counts" in per_step[0]:
      loads = [metrics_lib.load_balance(r["expert_counts"]) for r in per_step]
      out[metrics_lib.router_tag(name, "load_max_mean")] = float(np.mean([x[0] for x in loads]))
  return out


def expert_counts(steps: list[dict]) -> dict[str, np.ndarray]:
  return {name: np.sum([np.asarray(s["routers"][name]["expert_counts"], np.float64) for s in steps],
                       axis=0)
          for name in sorted(steps[0]["routers"]) if "expert_counts" in steps[0]["routers"][name]}


# ----------------------------------------------------------------------------------------------
# The run.


def _read_backbone(config: Any) -> tuple[Any, dict]:
  """(model ConfigDict, the init_from config.json) of the pretrained checkpoint."""
  from umoe_jax.model.decode import read_checkpoint_config
  path = os.path.expanduser(config.init_from)
  if not os.path.isdir(path):
    raise ConfigError(f"init_from={config.init_from!r}: no such directory")
  saved = read_checkpoint_config(path)
  if saved is None or not isinstance(saved, dict) or "model" not in saved:
    raise ConfigError(f"init_from={config.init_from!r} has no config.json with a 'model' section: "
                      f"not a training workdir or a converted checkpoint, so the architecture is "
                      f"unknown")
  return ml_collections.ConfigDict(saved["model"]), saved


def _load_backbone_params(config: Any, abstract_params: Any) -> dict:
  """The backbone's parameters (pure dict) from init_from; errors name the checkpoint."""
  backbone = abstract_params["backbone"]
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  shardings = jax.tree.map(lambda _: device, nnx.to_pure_dict(backbone))
  try:
    return ckpt_lib.load_init_params(os.path.abspath(os.path.expanduser(config.init_from)),
                                     backbone, shardings)
  except ConfigError:
    raise
  except Exception as e:  # pylint: disable=broad-except  (Orbax: missing / mismatched arrays)
    raise ConfigError(f"init_from={config.init_from!r}: its parameters do not restore into the "
                      f"architecture of its config.json ({type(e).__name__}: {str(e)[:300]})") from None


class Run:
  """One fine-tuning run in a workdir (built by `run`)."""

  def __init__(self, config: Any, workdir: str, *, step_hook: Optional[Callable[[int], None]]):
    config_lib.validate(config)
    self.config, self.workdir, self.step_hook = config, workdir, step_hook
    t, d = config.train, config.data
    # A run with checkpoints resumes with the architecture and tokenizer it started with.
    self.resume_meta = (predict_lib.read_meta(workdir) if ckpt_lib.complete_steps(
        os.path.join(workdir, ckpt_lib.CHECKPOINT_DIR)) else None)
    if self.resume_meta is not None:
      self.model_section = ml_collections.ConfigDict(self.resume_meta["model"])
      self.tokenizer_spec = self.resume_meta["tokenizer"]
      self.eos_token = self.resume_meta.get("eos_token", "")
    else:
      self.model_section, saved = _read_backbone(config)
      self.tokenizer_spec, self.eos_token = _tokenizer_spec(config, saved)
    if config.model.compute_dtype:
      self.model_section.compute_dtype = config.model.compute_dtype
    self.model_cfg = model_config(self.model_section)
    if d.max_len > self.model_cfg.max_seq_len:
      raise ConfigError(f"data.max_len={d.max_len} exceeds the backbone's model.max_seq_len="
                        f"{self.model_cfg.max_seq_len} (init_from={config.init_from!r})")
    from umoe_jax.data.tokenizer import check_vocab, make_tokenizer
    try:
      self.tokenizer = make_tokenizer(self.tokenizer_spec, self.eos_token)
      check_vocab(self.tokenizer, self.model_cfg.vocab_size)
    except (ValueError, OSError) as e:
      raise ConfigError(f"tokenizer {self.tokenizer_spec!r} does not fit init_from="
                        f"{config.init_from!r}: {e}") from None
    self.label_map, self.train_split, self.dev, self.test = load_data(config, self.tokenizer)
    if self.resume_meta is not None and self.resume_meta["labels"] != self.label_map.to_json():
      raise ConfigError(f"{os.path.join(workdir, predict_lib.CLASSIFIER_FILE)} holds the labels "
                        f"{self.resume_meta['labels']['names']}, but data.train_path="
                        f"{d.train_path!r} gives {list(self.label_map.names)}: use a new workdir "
                        f"for other data")
    self.steps_per_epoch = data_lib.steps_per_epoch(len(self.train_split.rows), t.batch_size)
    self.total_steps = t.epochs * self.steps_per_epoch

    from umoe_jax.finetune.model import abstract_classifier
    model = abstract_classifier(self.model_section, self.label_map.num_classes,
                                pooling=config.model.pooling, dropout=config.model.head_dropout)
    self.graphdef, self.abstract_params = nnx.split(model, nnx.Param)
    check_freeze_routers(self.abstract_params, config.train, self.model_cfg.router.kind)
    self.programs = programs(config, self.graphdef, self.abstract_params, self.total_steps)

    self.checkpointer = ckpt_lib.Checkpointer(os.path.join(workdir, ckpt_lib.CHECKPOINT_DIR),
                                              keep=config.checkpoint.keep,
                                              async_save=config.checkpoint.async_save)
    self.best = ckpt_lib.Checkpointer(os.path.join(workdir, predict_lib.BEST_DIR), keep=1,
                                      async_save=False)
    self.writer = metrics_lib.MetricWriter(workdir, tensorboard=config.log.tensorboard,
                                           jsonl=config.log.jsonl)

  # -- start point -------------------------------------------------------------------------------

  def meta(self) -> dict:
    d, m = self.config.data, self.config.model
    return {"model": self.model_section.to_dict(), "init_from": self.config.init_from,
            "labels": self.label_map.to_json(), "pooling": m.pooling,
            "head_dropout": m.head_dropout, "tokenizer": self.tokenizer_spec,
            "eos_token": self.eos_token, "bos_id": d.bos_id, "append_eos": d.append_eos,
            "max_len": d.max_len, "text_field": d.text_field, "label_field": d.label_field,
            "train_path": d.train_path}

  def initial_state(self) -> tuple[dict, str]:
    p = self.programs
    if self.checkpointer.steps():
      target = predict_lib.single_device_target(p.abstract_state)
      state, step = self.checkpointer.restore_latest(target)
      logging.info("resumed from %s step %d", self.checkpointer.directory, step)
      return state, "workdir"
    params = {"backbone": _load_backbone_params(self.config, self.abstract_params),
              "head": init_head(self.model_section, self.label_map.num_classes,
                                seed=self.config.train.seed)}
    rng = jax.random.key_data(jax.random.key(self.config.train.seed)).astype(jnp.uint32)
    state = {"step": jnp.zeros((), jnp.int32), "params": params,
             "opt_state": p.tx.init(params), "rng": rng,
             "best_score": jnp.full((), -jnp.inf, jnp.float32),
             "best_step": jnp.full((), -1, jnp.int32)}
    state = jax.device_put(state, device_sharding())
    logging.info("backbone from %s, fresh head of %d classes", self.config.init_from,
                 self.label_map.num_classes)
    return state, "init_from"

  # -- evaluation -------------------------------------------------------------------------------

  def evaluate(self, params: Any, split: Split) -> tuple[dict, np.ndarray]:
    probs = predict_lib.probabilities((self.graphdef, params), split.rows,
                                      batch_size=self.config.train.eval_batch_size,
                                      max_len=self.config.data.max_len)
    out = predict_lib.score(probs, split.labels, self.label_map.num_classes)
    out["majority_accuracy"] = majority_accuracy(self.train_split.labels, split.labels,
                                                 self.label_map.num_classes)
    return out, probs

  def _write_eval(self, step: int, name: str, result: dict) -> None:
    self.writer.scalars(step, {f"{name}/{k}": result[k]
                               for k in ("accuracy", "macro_f1", "loss", "majority_accuracy")})

  # -- loop -------------------------------------------------------------------------------------

  def train(self, state: dict, stop: StopRequest) -> tuple[dict, bool]:
    t, ck, p = self.config.train, self.config.checkpoint, self.programs
    step = int(jax.device_get(state["step"]))
    pending: list = []
    interval: list = []
    bar = None
    if self.config.log.progress:
      from tqdm import tqdm
      bar = tqdm(total=self.total_steps, initial=step, unit="step", dynamic_ncols=True,
                 desc="fine-tune", mininterval=1.0)

    def fetch():
      host = jax.device_get([m for _, m in pending])
      for (s, _), m in zip(pending, host):
        if not bool(m["finite"]):
          raise NonFiniteError(f"non-finite loss or gradient at step {s} (loss={float(m['loss'])}, "
                               f"grad_norm={float(m['grad_norm'])}); that update was not applied. "
                               f"Lower train.head_learning_rate / train.body_learning_rate")
        interval.append(m)
      pending.clear()

    def log():
      fetch()
      if not interval:
        return
      scalars = summarize(interval)
      self.writer.scalars(step, scalars)
      self.writer.expert_histograms(step, expert_counts(interval))
      line = (f"loss {scalars['train/loss']:.4f} (ce {scalars['train/ce_loss']:.4f} bal "
              f"{scalars['train/balance_loss']:.4f}) | acc {scalars['train/accuracy']:.3f}")
      if bar is not None:
        bar.set_postfix_str(line, refresh=False)
      else:
        metrics_lib.log_line(f"step {step}/{self.total_steps} | {line}")
      interval.clear()

    def save():
      fetch()
      self.checkpointer.save(step, state)

    try:
      while step < self.total_steps:
        if stop.requested(step):
          log()
          if step not in self.checkpointer.steps():
            save()
          logging.warning("stopped at step %d on request; checkpoint saved", step)
          return state, True
        batch = data_lib.train_batch(self.train_split.rows, self.train_split.labels, seed=t.seed, step=step,
                                     batch_size=t.batch_size, max_len=self.config.data.max_len)
        state, m = p.train_fn(state, jax.device_put(batch, device_sharding()))
        step += 1
        pending.append((step, m))
        if bar is not None:
          bar.update(1)
        if self.step_hook is not None:
          self.step_hook(step)
        if step % t.log_every == 0:
          log()
        if step % self.steps_per_epoch == 0 or step == self.total_steps:
          log()
          state = self.end_of_epoch(state, step, bar)
          save()
        elif ck.every and step % ck.every == 0:
          save()
      return state, False
    finally:
      if bar is not None:
        bar.close()

  def end_of_epoch(self, state: dict, step: int, bar) -> dict:
    """Dev metrics; a better dev score replaces the best checkpoint. Returns the state with the
    (possibly) new best score, saved with it in the training checkpoint."""
    t = self.config.train
    epoch = -(-step // self.steps_per_epoch)
    result, _ = self.evaluate(state["params"], self.dev)
    self._write_eval(step, "dev", result)
    score = result[t.select_metric]
    best = float(jax.device_get(state["best_score"]))
    improved = score > best
    if improved:
      if step not in self.best.steps():
        self.best.save(step, {"params": state["params"]})
        self.best.wait()
      state = dict(state, **jax.device_put({"best_score": np.float32(score),
                                            "best_step": np.int32(step)}, device_sharding()))
    line = (f"epoch {epoch}/{t.epochs} (step {step}): dev accuracy {result['accuracy']:.4f} | "
            f"macro-F1 {result['macro_f1']:.4f} | loss {result['loss']:.4f} | majority "
            f"{result['majority_accuracy']:.4f}{' | best so far' if improved else ''}")
    if bar is not None:
      bar.write(line, file=sys.stderr)     # above the progress line; stdout keeps the summary
    else:
      metrics_lib.log_line(line)
    return state

  def finish(self, state: dict) -> dict:
    """Scores the best checkpoint on dev and test; writes results.json and test predictions."""
    best_step = int(jax.device_get(state["best_step"]))
    target = {"params": predict_lib.single_device_target(self.programs.abstract_state["params"])}
    params = self.best.restore_latest(target)[0]["params"]
    out = {"best_step": best_step, "best_epoch": -(-best_step // self.steps_per_epoch),
           "select_metric": self.config.train.select_metric,
           "labels": list(self.label_map.names),
           "examples": {"train": len(self.train_split.rows), "dev": len(self.dev.rows),
                        "test": len(self.test.rows) if self.test else 0}}
    out["dev"], _ = self.evaluate(params, self.dev)
    if self.test is not None:
      out["test"], probs = self.evaluate(params, self.test)
      self._write_eval(self.total_steps, "test", out["test"])
      gold = [self.label_map.value(i) for i in self.test.labels]
      predict_lib.write_predictions(os.path.join(self.workdir, "test_predictions.jsonl"), probs,
                                    self.label_map, gold)
      line = (f"test (best dev epoch {out['best_epoch']}): accuracy {out['test']['accuracy']:.4f} | "
              f"macro-F1 {out['test']['macro_f1']:.4f} | majority "
              f"{out['test']['majority_accuracy']:.4f}")
      metrics_lib.log_line(line)
    predict_lib.write_json(os.path.join(self.workdir, predict_lib.RESULTS_FILE), out)
    return out

  def close(self) -> None:
    self.checkpointer.close()
    self.best.close()
    self.writer.close()


def run(config: Any, workdir: str, *, step_hook: Optional[Callable[[int], None]] = None) -> dict:
  """Fine-tunes in `workdir` (resuming if it holds checkpoints). Returns {"step", "stopped",
  "start" (workdir | init_from), "dev", "test", "best_step", ...} (results.json, when not stopped).

  `step_hook(step)` runs after each step is dispatched (tests use it to send signals).
  """
  r = Run(config, workdir, step_hook=step_hook)
  try:
    state, start = r.initial_state()
    ckpt_lib.write_config(workdir, config)
    predict_lib.write_json(os.path.join(workdir, predict_lib.CLASSIFIER_FILE), r.meta())
    logging.info("fine-tuning %d classes: %d train / %d dev / %d test examples, %d steps of %d "
                 "(%d epochs) from step %d (%s)", r.label_map.num_classes, len(r.train_split.rows),
                 len(r.dev.rows), len(r.test.rows) if r.test else 0, r.total_steps,
                 config.train.batch_size, config.train.epochs,
                 int(jax.device_get(state["step"])), start)
    with StopRequest() as stop:
      state, stopped = r.train(state, stop)
    step = int(jax.device_get(state["step"]))
    if stopped:
      return {"step": step, "stopped": True, "start": start}
    r.checkpointer.wait()
    return {"step": step, "stopped": False, "start": start, **r.finish(state)}
  finally:
    r.close()
