"""Checkpoints with Orbax: train state + data-iterator position per step, and where a run starts.

Workdir layout:
  <workdir>/config.json                     the experiment config (process 0, at every start once
                                            the start point is restored: a failed resume keeps it)
  <workdir>/checkpoints/<step>/state        `state.checkpoint_tree`: params, optimizer state, step,
                                            RNG, skipped
  <workdir>/checkpoints/<step>/data         grain iterator position, process_<i>-of-<n>.json
  <workdir>/checkpoints_damaged/<step>-<t>  checkpoints that failed to restore, moved aside

Atomicity: Orbax writes a step into `<step>.orbax-checkpoint-tmp-<ts>` and renames it to `<step>` only
after every file (and every process) has finished; a crash mid-save leaves a tmp directory that is
never listed as a step, and older steps are deleted (keep-last-K) only after the new one is final.

Resume order (`resume_source`, the one place that decides):
  1. the latest complete checkpoint in <workdir>/checkpoints (a run that was interrupted);
  2. `checkpoint.init_from`: parameters of a converted checkpoint (the layout written by
     `umoe_jax.interop.official.save_converted`: <dir>/params, an Orbax checkpoint of
     `nnx.state(model, nnx.Param)`), or of another training workdir (its latest state's params);
     optimizer state, step and data start fresh;
  3. scratch: parameters from `train.seed`.
A damaged latest checkpoint (missing or truncated files) is reported with a warning, moved to
checkpoints_damaged/, and the previous one is used. If no checkpoint can be read the run stops
(it never silently restarts from scratch over an existing run).
"""
from __future__ import annotations

import dataclasses
import glob
import os
import re
import shutil
import time
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp
from absl import logging

from umoe_jax import data as data_lib
from umoe_jax.config import ConfigError

CHECKPOINT_DIR = "checkpoints"
DAMAGED_DIR = "checkpoints_damaged"
CONFIG_FILE = "config.json"


class CheckpointError(RuntimeError):
  """No checkpoint of a run could be restored."""


def complete_steps(directory: str) -> list[int]:
  """Finalized checkpoint steps in `directory` (tmp directories of unfinished saves excluded)."""
  if not os.path.isdir(directory):
    return []
  return sorted(ocp.utils.checkpoint_steps(directory))


@dataclasses.dataclass(frozen=True)
class ResumeSource:
  kind: str        # "workdir" | "init_from" | "scratch"
  path: str = ""   # the checkpoint directory (workdir) or the init_from directory


def resume_source(checkpoint_dir: str, init_from: str = "") -> ResumeSource:
  """Where a run starts: its own latest checkpoint, else `init_from`, else scratch."""
  if complete_steps(checkpoint_dir):
    return ResumeSource("workdir", checkpoint_dir)
  if init_from:
    if not os.path.isdir(os.path.expanduser(init_from)):
      raise ConfigError(f"checkpoint.init_from={init_from!r}: no such directory")
    return ResumeSource("init_from", os.path.expanduser(init_from))
  return ResumeSource("scratch")


def write_config(workdir: str, config: Any) -> None:
  """<workdir>/config.json (process 0), atomically: a temporary file renamed over it, so a reader
  or a crash sees the old file or the new one, never a partial one."""
  if jax.process_index() != 0:
    return
  os.makedirs(workdir, exist_ok=True)
  text = config.to_json_best_effort(indent=2) if hasattr(config, "to_json_best_effort") else str(config)
  tmp = os.path.join(workdir, CONFIG_FILE + ".tmp")
  try:
    with open(tmp, "w", encoding="utf-8") as f:
      f.write(text + "\n")
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, os.path.join(workdir, CONFIG_FILE))
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def _barrier(name: str) -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)


def _saved_process_counts(step_dir: str) -> set[int]:
  names = glob.glob(os.path.join(step_dir, "data", "process_*-of-*.json"))
  return {int(m.group(1)) for n in names if (m := re.search(r"-of-(\d+)\.json$", n))}


class Checkpointer:
  """An Orbax CheckpointManager with items "state" (TrainState) and "data" (grain iterator)."""

  def __init__(self, directory: str, *, keep: int, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           enable_async_checkpointing=async_save)
    self.manager = ocp.CheckpointManager(self.directory, item_names=("state", "data"),
                                         options=options)

  def steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def save(self, step: int, state: Any, data_iter: Optional[Any] = None) -> None:
    """Starts saving (returns once the arrays are copied off the device when async)."""
    items = {"state": ocp.args.StandardSave(state)}
    if data_iter is not None:
      items["data"] = data_lib.save_args(data_iter)
    self.manager.save(step, args=ocp.args.Composite(**items), force=True)

  def _restore_step(self, step: int, target: Any, data_iter: Optional[Any]):
    items = {"state": ocp.args.StandardRestore(target)}
    if data_iter is not None:
      saved = _saved_process_counts(os.path.join(self.directory, str(step)))
      if saved and jax.process_count() not in saved:
        logging.warning("checkpoint %d holds the data position of %s process(es), this run has %d: "
                        "the data iterator starts from the beginning of its stream", step,
                        sorted(saved), jax.process_count())
      else:
        items["data"] = data_lib.restore_args(data_iter)
    return self.manager.restore(step, args=ocp.args.Composite(**items))["state"]

  def restore_latest(self, target: Any, data_iter: Optional[Any] = None) -> tuple[Any, int]:
    """(state, step) from the newest checkpoint that restores; damaged newer ones are moved aside.

    `target`: the abstract `state.checkpoint_tree` with shardings of the *current* mesh
    (ShapeDtypeStructs), so a checkpoint written on another mesh or device count is resharded on
    load. `data_iter` is restored in place.
    """
    damaged = []
    for step in reversed(self.steps()):
      try:
        state = self._restore_step(step, target, data_iter)
      except Exception as e:  # pylint: disable=broad-except  (any unreadable file)
        logging.warning("checkpoint step %d in %s cannot be restored (%s: %s); trying the previous "
                        "one", step, self.directory, type(e).__name__, str(e)[:500])
        damaged.append((step, e))
        continue
      if damaged:
        self._move_aside([s for s, _ in damaged])
        logging.warning("resumed from checkpoint step %d instead of the damaged step(s) %s (moved "
                        "to %s)", step, [s for s, _ in damaged], self._damaged_dir())
      return state, step
    detail = "; ".join(f"step {s}: {type(e).__name__}: {str(e)[:200]}" for s, e in damaged)
    raise CheckpointError(
        f"no checkpoint in {self.directory} can be restored ({detail}). If the model or optimizer "
        f"config changed, restore the old config; to start over, move {self.directory} away")

  def _damaged_dir(self) -> str:
    return os.path.join(os.path.dirname(self.directory), DAMAGED_DIR)

  def _move_aside(self, steps: list[int]) -> None:
    if jax.process_index() == 0:
      os.makedirs(self._damaged_dir(), exist_ok=True)
      for step in steps:
        dst = os.path.join(self._damaged_dir(), f"{step}-{int(time.time())}")
        shutil.move(os.path.join(self.directory, str(step)), dst)
    _barrier("umoe_checkpoint_move_damaged")
    self.manager.reload()

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def load_init_params(path: str, abstract_params: Any, param_shardings: Any) -> Any:
  """Parameters (pure dict, on `param_shardings`) from a converted checkpoint or another run.

  Args:
    path: `checkpoint.init_from`: a directory with `params/` (converted layout), or a training
      workdir / its `checkpoints/` directory (the latest step's `state.params`).
    abstract_params: nnx.State of nnx.Param(ShapeDtypeStruct) of the current model.
    param_shardings: pure dict of NamedSharding, the params part of the state shardings.
  """
  from flax import nnx

  target_dict = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                             nnx.to_pure_dict(abstract_params), param_shardings)
  params_dir = os.path.join(path, "params")
  if os.path.isdir(params_dir):
    target = jax.tree.map(lambda x: x, abstract_params)
    nnx.replace_by_pure_dict(target, target_dict)
    restored = ocp.StandardCheckpointer().restore(os.path.abspath(params_dir), target)
    return nnx.to_pure_dict(restored)
  ckpt_dir = os.path.join(path, CHECKPOINT_DIR)
  ckpt_dir = ckpt_dir if os.path.isdir(ckpt_dir) else path
  steps = complete_steps(ckpt_dir)
  if not steps:
    raise ConfigError(f"checkpoint.init_from={path!r} holds neither params/ (a converted checkpoint) "
                      f"nor training checkpoints")
  state_dir = os.path.join(os.path.abspath(ckpt_dir), str(steps[-1]), "state")
  item = {"params": target_dict}
  restored = ocp.PyTreeCheckpointer().restore(state_dir, args=ocp.args.PyTreeRestore(
      item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
      partial_restore=True))
  logging.info("init_from: params of step %d of %s", steps[-1], ckpt_dir)
  return restored["params"]
