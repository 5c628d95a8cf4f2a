"""A training run's setup: everything `loop.run` builds before its first step.

  `setup`: validate the whole config, the workdir and the start point -> mesh -> compiled programs
  (programs.py) -> training iterator and eval batches -> checkpoint manager;
  `initial_state`: the start state (the run's own checkpoint > checkpoint.init_from > scratch).

Both write nothing to the workdir, so a run that fails a check or fails to resume leaves it as it
was; `loop.run` writes config.json and opens the writers only once the start state exists.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Optional

import jax
import numpy as np
from absl import logging

from umoe_jax import data as data_lib
from umoe_jax import storage
from umoe_jax.config import ConfigError
from umoe_jax.data import pipeline as pipeline_lib
from umoe_jax.data.sources import DataError
from umoe_jax.parallel import mesh as mesh_lib
from umoe_jax.parallel import sharding as sharding_lib
from umoe_jax.train import checkpoint as ckpt_lib
from umoe_jax.train import config as config_lib
from umoe_jax.train import metrics as metrics_lib
from umoe_jax.train import programs as programs_lib
from umoe_jax.train import state as state_lib


@dataclasses.dataclass
class Setup:
  """Everything `run` builds before the first step."""
  config: Any
  model_cfg: Any
  workdir: str
  mesh: Any
  rules: Any
  capacity_factor: Optional[float]
  exchange: str
  programs: programs_lib.Programs
  train_iter: Any
  eval_batches: list
  checkpointer: ckpt_lib.Checkpointer
  source: ckpt_lib.ResumeSource
  writer: Optional[metrics_lib.MetricWriter] = None  # made by `run` once the start state exists
  resume_metadata: dict = dataclasses.field(default_factory=dict)  # of the restored checkpoint
  chunks: int = 1                      # expert_parallel.chunks
  restored_from: Optional[int] = None  # checkpoint.restore_step this run's branch started from
  lock: Any = None                     # the workdir's lock.WorkdirLock (process 0), set by `run`


def _check_batch_layout(config: Any, mesh: Any, rules: Any) -> None:
  t = config.train
  shards = sharding_lib.batch_shards(mesh, rules)
  micro = t.global_batch_size // t.grad_accum_steps
  procs = jax.process_count()
  if micro % shards or t.global_batch_size % procs:
    raise config_lib.ConfigError(
        f"train.global_batch_size={t.global_batch_size} / train.grad_accum_steps="
        f"{t.grad_accum_steps} = {micro} sequences per micro-batch must divide into the batch's "
        f"{shards} shards (mesh {mesh_lib.describe(mesh)}) and {procs} process(es)")
  eval_bs = t.eval_batch_size or micro
  if t.eval_every and (eval_bs % shards or eval_bs % procs):
    raise config_lib.ConfigError(
        f"eval batch size {eval_bs} (train.eval_batch_size) must be a multiple of the batch's "
        f"{shards} shards and of {procs} process(es)")


def _close_iterator(it: Any) -> None:
  close = getattr(it, "close", None)
  if close is not None:
    close()


def _all_processes_agree(ok: bool) -> None:
  """With several processes: DataError on every one if any found its share of the data unusable
  (that one raises its own message), instead of the others waiting for it in the first step."""
  if jax.process_count() == 1:
    return
  from jax.experimental import multihost_utils
  flags = np.asarray(multihost_utils.process_allgather(np.asarray(ok)))
  if ok and not flags.all():
    bad = [int(i) for i in np.flatnonzero(~flags)]
    raise DataError(f"process(es) {bad} found too little or bad training data (their logs say "
                    "which file); every process stops")


def use_compilation_cache(path: str) -> None:
  """Points JAX's persistent compilation cache at `path` (`train.compilation_cache_dir`; a local
  directory, created if missing, or a gs:// path) for this process, before anything compiles:
  programs compiled again (a resumed run, the same config elsewhere) load their executable. JAX
  keeps the first directory a process compiles with, so a later, different one is refused."""
  if "://" not in path:
    try:
      path = os.path.abspath(storage.expand_user(path, "train.compilation_cache_dir"))
    except ValueError as e:  # ~user of no user
      raise ConfigError(str(e)) from None
    try:
      os.makedirs(path, exist_ok=True)
    except OSError as e:
      raise ConfigError(f"train.compilation_cache_dir={path!r}: cannot create it "
                        f"({e.strerror or type(e).__name__})") from e
    if not os.access(path, os.W_OK | os.X_OK):
      raise ConfigError(f"train.compilation_cache_dir={path!r} is not writable")
  current = jax.config.jax_compilation_cache_dir
  if current and current != path:
    raise ConfigError(f"train.compilation_cache_dir={path!r}: this process already caches "
                      f"compilations in {current!r} (JAX takes one directory per process)")
  jax.config.update("jax_compilation_cache_dir", path)


def setup(config: Any, workdir: str, stack: Optional[contextlib.ExitStack] = None) -> Setup:
  """Checks and builds everything before the start state; writes nothing (but creates
  train.compilation_cache_dir when it is set and missing). With `stack`, the data
  iterator and the checkpoint manager are closed when it exits (else the caller closes them)."""
  # Config, workdir and start point: everything is checked before any file is read or device
  # touched.
  model_cfg = config_lib.validate(config)
  t = config.train
  ckpt_lib.check_workdir(workdir)
  source = ckpt_lib.resume_source(storage.join(workdir, ckpt_lib.CHECKPOINT_DIR),
                                  config.checkpoint.init_from, config.checkpoint.restore_step)

  # Mesh.
  try:
    mesh = mesh_lib.make_mesh(config.get("mesh"))
    rules = sharding_lib.normalize_rules(config.get("sharding_rules"))
  except ValueError as e:
    raise ConfigError(f"config.mesh / config.sharding_rules: {e}") from e
  _check_batch_layout(config, mesh, rules)
  logging.info("mesh: %s", mesh_lib.describe(mesh))
  capacity_factor, exchange = programs_lib.expert_parallel_settings(config)

  # Model, optimizer, state layout, jitted functions.
  if t.compilation_cache_dir:
    use_compilation_cache(t.compilation_cache_dir)
  progs = programs_lib.config_programs(config, model_cfg, mesh, rules)

  # Data.
  proc = dict(process_index=jax.process_index(), process_count=jax.process_count())
  try:
    train_iter = data_lib.make_train_iterator(config.data, seq_len=t.seq_len,
                                              global_batch_size=t.global_batch_size, seed=t.seed,
                                              **proc)
  except DataError:
    _all_processes_agree(False)
    raise
  _all_processes_agree(True)
  if stack is not None:
    stack.callback(_close_iterator, train_iter)
  eval_batches = []
  if t.eval_every:
    eval_bs = t.eval_batch_size or t.global_batch_size // t.grad_accum_steps
    eval_batches = data_lib.make_eval_batches(
        config.data, seq_len=t.seq_len, num_batches=t.eval_batches, global_batch_size=eval_bs,
        **proc)
    if not eval_batches:  # raises, naming what the held-out data holds
      pipeline_lib.check_one_batch(config.data, split="eval", seq_len=t.seq_len,
                                   batch_size=eval_bs // jax.process_count(), **proc)

  # Creates no directory: config.json, checkpoints/ and the writers come once the start state is
  # restored, so a resume that fails (e.g. the model config changed) leaves the workdir as it was.
  checkpointer = ckpt_lib.Checkpointer(storage.join(workdir, ckpt_lib.CHECKPOINT_DIR),
                                       keep=config.checkpoint.keep,
                                       async_save=config.checkpoint.async_save,
                                       data_config=config.data)
  if stack is not None:
    stack.push(checkpointer.__exit__)
  return Setup(config=config, model_cfg=model_cfg, workdir=workdir, mesh=mesh, rules=rules,
               capacity_factor=capacity_factor, exchange=exchange, programs=progs,
               train_iter=train_iter, eval_batches=eval_batches, checkpointer=checkpointer,
               source=source, chunks=programs_lib.expert_chunks(config))


def initial_state(s: Setup) -> tuple[state_lib.TrainState, int, str]:
  """(state, step, source): the run's own checkpoint > checkpoint.init_from > scratch.

  Sets `s.resume_metadata` (the restored checkpoint's) and `s.restored_from`."""
  cfg, p = s.config, s.programs
  source = s.source
  if source.kind == "workdir":
    target = state_lib.checkpoint_tree(state_lib.with_shardings(p.abstract, p.shardings))
    tree, step = s.checkpointer.restore(target, s.train_iter, source.step)
    logging.info("resumed from %s step %d", s.checkpointer.directory, step)
    s.resume_metadata = s.checkpointer.metadata(step)
    s.restored_from = (source.step if source.step is not None
                       else s.resume_metadata.get("restored_from"))
    return state_lib.from_checkpoint_tree(tree, p.not_halted_fn()), step, "workdir"
  if source.kind == "init_from":
    params = ckpt_lib.load_init_params(source.path, p.parts.abstract_params, p.shardings.params)
    logging.info("initialised parameters from %s", source.path)
    return p.from_params_fn(params, cfg.train.seed), 0, "init_from"
  return p.init_fn(cfg.train.seed), 0, "scratch"
