"""Where a run starts: its own latest checkpoint, `checkpoint.init_from`, or scratch.

Resume order (`resume_source`, the one place that decides):
  1. the latest complete checkpoint in <workdir>/checkpoints (a run that was interrupted);
  2. `checkpoint.init_from`: parameters of a converted checkpoint (the layout written by
     `umoe_jax.interop.official.save_converted`: <dir>/params, an Orbax checkpoint of
     `nnx.state(model, nnx.Param)`), or of another training workdir (its latest state's params);
     optimizer state, step and data start fresh (`load_init_params`);
  3. scratch: parameters from `train.seed`.
A damaged latest checkpoint (missing or truncated files) is reported with a warning, moved to
checkpoints_damaged/, and the previous one is used (checkpoint.py). If no checkpoint can be read the
run stops (it never silently restarts from scratch over an existing run). `checkpoint.restore_step=N`
resumes from step N instead of the latest (no fallback); the later steps are moved to
checkpoints_abandoned/ once the run starts, and the saves of the new branch record
`restored_from: N`, so that restarting the same command later continues the new branch instead of
going back to N again.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp
from absl import logging

from umoe_jax import storage
from umoe_jax.config import ConfigError
from umoe_jax.train.checkpoint_metadata import (CheckpointError, CheckpointMismatchError,
                                                complete_steps, saved_shapes, shape_mismatches,
                                                step_metadata, tree_shapes)
from umoe_jax.train.workdir import CHECKPOINT_DIR, finetune_message, finetune_workdir


@dataclasses.dataclass(frozen=True)
class ResumeSource:
  """Where a run starts, as `resume_source` decides it."""
  kind: str        # "workdir" | "init_from" | "scratch"
  path: str = ""   # the checkpoint directory (workdir) or the init_from directory
  step: Optional[int] = None  # workdir: checkpoint.restore_step (None: the latest that restores)


def init_from_checkpoints(path: str) -> tuple[str, list[int]]:
  """("params", []) for a converted checkpoint, else (checkpoint directory, its complete steps) of
  a training workdir or its `checkpoints/`; ConfigError naming `path` when it holds neither."""
  if not storage.isdir(path):
    if storage.isfile(path):
      raise ConfigError(f"checkpoint.init_from={path!r} is a file, not a checkpoint directory (a "
                        "training workdir or its checkpoints/, or a converted checkpoint's "
                        "directory)")
    raise ConfigError(f"checkpoint.init_from={path!r}: no such directory")
  if storage.isdir(storage.join(path, "params")):
    return "params", []
  ckpt_dir = storage.join(path, CHECKPOINT_DIR)
  ckpt_dir = ckpt_dir if storage.isdir(ckpt_dir) else path
  steps = complete_steps(ckpt_dir)
  if not steps:
    raise ConfigError(f"checkpoint.init_from={path!r} holds neither params/ (a converted checkpoint) "
                      f"nor complete training checkpoints (in {ckpt_dir!r})")
  return ckpt_dir, steps


def resume_source(checkpoint_dir: str, init_from: str = "",
                  restore_step: Optional[int] = None) -> ResumeSource:
  """Where a run starts: its own checkpoint (the latest, or `restore_step`), else `init_from`, else
  scratch. Checks everything it can without reading a checkpoint (ConfigError)."""
  steps = complete_steps(checkpoint_dir)
  if restore_step is not None and steps and steps[-1] > restore_step and step_metadata(
      checkpoint_dir, steps[-1]).get("restored_from") == restore_step:
    # An earlier run already branched from restore_step and saved since: continue that branch
    # (restarting the same command must not go back to restore_step again).
    logging.warning("checkpoint.restore_step=%d was applied by an earlier run, whose checkpoints "
                    "continue from it: resuming from the latest, step %d (unset "
                    "checkpoint.restore_step to silence this)", restore_step, steps[-1])
    return ResumeSource("workdir", checkpoint_dir)
  if restore_step is not None:
    if restore_step not in steps:
      have = f"its complete steps are {steps}" if steps else "it holds no complete checkpoint"
      raise ConfigError(f"checkpoint.restore_step={restore_step}: no such checkpoint in "
                        f"{checkpoint_dir} ({have})")
    return ResumeSource("workdir", checkpoint_dir, restore_step)
  if steps:
    return ResumeSource("workdir", checkpoint_dir)
  if init_from:
    path = storage.expand(init_from)
    workdir = finetune_workdir(path) if storage.isdir(path) else None
    if workdir:  # else "does not fit this model: parameter embed is not in the checkpoint ..."
      raise ConfigError(f"checkpoint.init_from={finetune_message(path, workdir)}")
    init_from_checkpoints(path)
    return ResumeSource("init_from", path)
  return ResumeSource("scratch")



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
  params_dir = storage.join(path, "params")
  if storage.isdir(params_dir):
    _check_init_from_fits(path, params_dir, target_dict, "")
    target = jax.tree.map(lambda x: x, abstract_params)
    nnx.replace_by_pure_dict(target, target_dict)
    try:
      restored = ocp.StandardCheckpointer().restore(storage.abspath(params_dir), target)
    except Exception as e:  # pylint: disable=broad-except  (a damaged file: TensorStore's error)
      raise CheckpointError(f"checkpoint.init_from={path!r}: {params_dir} cannot be restored "
                            f"({_one_line(e)})") from e
    return nnx.to_pure_dict(restored)
  ckpt_dir, steps = init_from_checkpoints(path)
  # As a resume does: a damaged latest step (a run killed mid-write, a truncated copy) is reported
  # and the previous one used; the other run's directory is left as it is.
  damaged = []
  for step in reversed(steps):
    state_dir = storage.join(storage.abspath(ckpt_dir), str(step), "state")
    _check_init_from_fits(path, state_dir, target_dict, "params/")
    item = {"params": target_dict}
    try:
      restored = ocp.PyTreeCheckpointer().restore(state_dir, args=ocp.args.PyTreeRestore(
          item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
          partial_restore=True))
    except Exception as e:  # pylint: disable=broad-except  (any unreadable file)
      logging.warning("checkpoint.init_from: step %d of %s cannot be restored (%s); trying the "
                      "previous one", step, ckpt_dir, _one_line(e))
      damaged.append(f"step {step}: {_one_line(e, 200)}")
      continue
    logging.info("init_from: params of step %d of %s", step, ckpt_dir)
    return restored["params"]
  raise CheckpointError(f"checkpoint.init_from={path!r}: no checkpoint in {ckpt_dir} can be "
                        f"restored ({'; '.join(damaged)})")


def _one_line(error: BaseException, limit: int = 300) -> str:
  """'Type: message' on one line (TensorStore errors span many), cut to `limit`."""
  text = " ".join(str(error).split())
  return f"{type(error).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def _check_init_from_fits(path: str, directory: str, target_dict: Any, prefix: str) -> None:
  """CheckpointMismatchError naming the first parameters of `checkpoint.init_from` (saved in
  `directory`, their paths under `prefix`) whose shapes differ from the model's, from the metadata
  (a restore would fail deep in Orbax, naming no parameter)."""
  on_disk = saved_shapes(directory)
  if on_disk is None:  # unreadable: the restore reports it
    return
  on_disk = {k[len(prefix):]: v for k, v in on_disk.items() if k.startswith(prefix)}
  problems = shape_mismatches(on_disk, tree_shapes(target_dict))
  if problems:
    error = CheckpointMismatchError(
        f"checkpoint.init_from={path!r} does not fit this model: parameter {problems}")
    error.hint = ("checkpoint.init_from takes parameters of the same shapes: pass the model config "
                  "they were trained with (their config.json), or another checkpoint.init_from")
    raise error
