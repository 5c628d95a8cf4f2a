"""The fine-tuning loop: `run(config, workdir)`.

  check the config -> the backbone's architecture and tokenizer (`backbone`, from init_from; on
  resume from the workdir's classifier.json) -> the splits (`data.load_splits`) -> the classifier
  and its compiled step (`step.programs`) -> the start point (the workdir's latest checkpoint, else
  init_from's backbone and a fresh head; nothing is written before it restores: then the log
  files, config.json and classifier.json) -> epochs of steps; at every epoch end the dev accuracy
  and macro-F1, the best dev epoch saved to <workdir>/best, a training checkpoint
  -> the best checkpoint scored on dev and test: results.json, test_predictions.jsonl.

Step s trains on the slice (s mod S) of the permutation of epoch s // S (`data.train_batch`) and
draws its head dropout and router jitter from keys of fold_in(rng, s) (`step.step_keys`), so a run
resumed from a checkpoint at step s continues exactly as the uninterrupted run (the routers'
selection biases, moved by the step, are parameters: in the checkpoint). SIGTERM / Ctrl-C save the current step and return (as pretraining does).
One device, one process (the model is small next to pretraining; the mesh machinery is not used).
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from flax import nnx

from umoe_jax import console, storage
from umoe_jax.config import ConfigError, model_config
from umoe_jax.finetune import backbone as backbone_lib
from umoe_jax.finetune import config as config_lib
from umoe_jax.finetune import data as data_lib
from umoe_jax.finetune import predict as predict_lib
from umoe_jax.finetune.metrics import majority_accuracy
from umoe_jax.finetune.model import abstract_classifier, init_head
from umoe_jax.finetune.optimizer import check_freeze_routers
from umoe_jax.finetune.predict import device_sharding
from umoe_jax.finetune.step import programs
from umoe_jax.train import checkpoint as ckpt_lib
from umoe_jax.train import lock as lock_lib
from umoe_jax.train import metrics as metrics_lib
from umoe_jax.train.loop import NonFiniteError, StopRequest


def summarize(steps: list[dict]) -> tuple[dict[str, float], dict[str, np.ndarray]]:
  """Host metrics of a log interval's steps (`step.train_step`) -> (TensorBoard scalars: interval
  means, the accuracy over all rows, the routers' `metrics.router_summary`; expert-count sums)."""
  mean = lambda key: float(np.mean([float(s[key]) for s in steps]))
  out = {"train/loss": mean("loss"), "train/ce_loss": mean("ce_loss"),
         "train/balance_loss": mean("balance_loss"), "train/grad_norm": mean("grad_norm"),
         "train/accuracy": float(sum(float(s["correct"]) for s in steps)
                                 / max(sum(float(s["count"]) for s in steps), 1.0))}
  for key in steps[0]:
    if key.startswith("learning_rate_"):
      out[f"train/{key}"] = mean(key)
  routers, counts = metrics_lib.router_summary(steps)
  return {**out, **routers}, counts


class Run:
  """One fine-tuning run in a workdir (built by `run`)."""

  def __init__(self, config: Any, workdir: str, *, step_hook: Optional[Callable[[int], None]]):
    config_lib.validate(config)
    ckpt_lib.check_workdir(workdir)  # a file, or not writable: before any work (writes nothing)
    self.config, self.workdir, self.step_hook = config, workdir, step_hook
    self.lock = None  # the workdir's lock.WorkdirLock, set by `run`
    t, d = config.train, config.data
    # A run with checkpoints resumes with the architecture and tokenizer it started with.
    self.resume_meta = (predict_lib.read_meta(workdir) if ckpt_lib.complete_steps(
        os.path.join(workdir, ckpt_lib.CHECKPOINT_DIR)) else None)
    if self.resume_meta is not None:
      self.model_section = ml_collections.ConfigDict(self.resume_meta["model"])
      self.tokenizer_spec = self.resume_meta["tokenizer"]
      self.eos_token = self.resume_meta.get("eos_token", "")
    else:
      self.model_section, saved = backbone_lib.read_backbone(config)
      self.tokenizer_spec, self.eos_token = backbone_lib.tokenizer_spec(config, saved)
    if config.model.compute_dtype:
      self.model_section.compute_dtype = config.model.compute_dtype
    self.model_cfg = model_config(self.model_section)
    if d.max_len > self.model_cfg.max_seq_len:
      raise ConfigError(f"data.max_len={d.max_len} exceeds the backbone's model.max_seq_len="
                        f"{self.model_cfg.max_seq_len} (init_from={config.init_from!r})")
    from umoe_jax.data.tokenizer import make_tokenizer
    try:
      self.tokenizer = make_tokenizer(self.tokenizer_spec, self.eos_token)
    except storage.StorageError:
      raise  # the store failed, not the tokenizer: its line and hint (stdout_errors)
    except (ValueError, OSError) as e:
      raise ConfigError(f"tokenizer {self.tokenizer_spec!r} does not fit init_from="
                        f"{config.init_from!r}: {e}") from None
    self._check_tokenizer_fits_backbone()
    self.label_map, self.train_split, self.dev, self.test = data_lib.load_splits(config, self.tokenizer)
    if self.resume_meta is not None and self.resume_meta["labels"] != self.label_map.to_json():
      raise ConfigError(f"{os.path.join(workdir, predict_lib.CLASSIFIER_FILE)} holds the labels "
                        f"{self.resume_meta['labels']['names']}, but data.train_path="
                        f"{d.train_path!r} gives {list(self.label_map.names)}: use a new workdir "
                        f"for other data")
    if self.resume_meta is not None:
      self._check_resume_settings()
    self.steps_per_epoch = data_lib.steps_per_epoch(len(self.train_split.rows), t.batch_size)
    self.total_steps = t.epochs * self.steps_per_epoch

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
    self.writer: Optional[metrics_lib.MetricWriter] = None  # `open_logs`, once the state restored

  def open_logs(self) -> None:
    """Creates the log files (TensorBoard, metrics.jsonl) and writes config.json and
    classifier.json: after `initial_state`, so a run whose restore fails leaves the workdir's
    files as they were."""
    self.writer = metrics_lib.MetricWriter(self.workdir, tensorboard=self.config.log.tensorboard,
                                           jsonl=self.config.log.jsonl)
    ckpt_lib.write_config(self.workdir, self.config)
    predict_lib.write_json(os.path.join(self.workdir, predict_lib.CLASSIFIER_FILE), self.meta())

  def _check_tokenizer_fits_backbone(self) -> None:
    """ConfigError when the tokenizer's ids could index past the backbone's embedding table: its
    vocabulary is fixed by init_from's parameters, so the fix is data.tokenizer (the tokenizer the
    backbone was trained with), not model.vocab_size."""
    vocab_size = self.model_cfg.vocab_size
    if self.tokenizer.vocab_size > vocab_size:
      raise ConfigError(
          f"tokenizer {self.tokenizer_spec!r} does not fit init_from={self.config.init_from!r}: "
          f"it has {self.tokenizer.vocab_size} tokens but the backbone's vocab_size is "
          f"{vocab_size} (fixed by its parameters); set data.tokenizer to the tokenizer.json the "
          f"backbone was trained with (at most {vocab_size} tokens)")

  # Settings that change what the trained parameters read (the token rows, the pooled feature):
  # a run resumes only with those it was trained with.
  RESUME_KEYS = (("model", "pooling"), ("data", "max_len"), ("data", "bos_id"),
                 ("data", "append_eos"))

  def _check_resume_settings(self) -> None:
    path = os.path.join(self.workdir, predict_lib.CLASSIFIER_FILE)
    for section, key in self.RESUME_KEYS:
      saved, now = self.resume_meta.get(key), self.config[section][key]
      if key in self.resume_meta and saved != now:
        raise ConfigError(f"{path}: this run was trained with {section}.{key}={saved!r}, but the "
                          f"config sets {now!r}; resume with the same setting or use a new workdir")

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
    params = {"backbone": backbone_lib.load_backbone_params(self.config, self.abstract_params),
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

  def evaluate(self, params: Any, split: data_lib.Split) -> tuple[dict, np.ndarray]:
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
    self.writer.start_session(step + 1)  # earlier runs' points after `step`: an abandoned branch
    pending: list = []
    interval: list = []
    bar = None
    if self.config.log.progress:
      bar = console.progress(total=self.total_steps, initial=step, unit="step", desc="fine-tune")
      if bar.disable:  # stderr is no terminal (a pipe, a CI log): the log lines, not a bar
        bar = None

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
      scalars, counts = summarize(interval)
      self.writer.scalars(step, scalars)
      self.writer.expert_histograms(step, counts)
      line = (f"loss {scalars['train/loss']:.4f} (ce {scalars['train/ce_loss']:.4f} bal "
              f"{scalars['train/balance_loss']:.4f}) | acc {scalars['train/accuracy']:.3f}")
      if bar is not None:
        bar.set_postfix_str(line, refresh=False)
      else:
        metrics_lib.log_line(f"step {step}/{self.total_steps} | {line}")
      interval.clear()

    def save():
      fetch()
      if self.lock is not None:
        self.lock.check()  # another run took the workdir over: never save over its checkpoints
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
    if self.writer is not None:
      self.writer.close()


def run(config: Any, workdir: str, *, step_hook: Optional[Callable[[int], None]] = None,
        force_unlock: bool = False) -> dict:
  """Fine-tunes in `workdir` (resuming if it holds checkpoints). Returns {"step", "stopped",
  "start" (workdir | init_from), "dev", "test", "best_step", ...} (results.json, when not stopped).

  The run holds the workdir's lock (umoe_jax/train/lock.py) throughout; `force_unlock` takes it from
  whichever run holds it. `step_hook(step)` runs after each step is dispatched (tests use it to
  send signals).
  """
  with lock_lib.hold(workdir, command="finetune", force=force_unlock) as workdir_lock:
    r = Run(config, workdir, step_hook=step_hook)
    r.lock = workdir_lock
    return _run(r, config)


def _run(r: Run, config: Any) -> dict:
  try:
    state, start = r.initial_state()  # its errors before any file is written
    r.open_logs()
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
