"""Checkpoints with Orbax: the Checkpointer saves and restores train state + data-iterator position.

A step is <workdir>/checkpoints/<step>/{state,data} (the layout: workdir.py). Where a run starts
(its own checkpoint, `checkpoint.init_from`, scratch) is resume.py; reading a checkpoint's steps,
metadata and shapes without restoring it, and the errors, is checkpoint_metadata.py; quieting
Orbax's echoes after a failure is orbax_noise.py. Their names are importable from here too.

Atomicity: Orbax writes a step into `<step>.orbax-checkpoint-tmp-<ts>` and renames it to `<step>` only
after every file (and every process) has finished; a crash mid-save leaves a tmp directory that is
never listed as a step, and older steps are deleted (keep-last-K) only after the new one is final.

Restore: the newest step that restores (or `checkpoint.restore_step`); a damaged one (missing or
truncated files) is reported with a warning and moved to checkpoints_damaged/, and the previous one
is used; a step that does not fit the current config (CheckpointMismatchError) stops the run.
`set_aside_newer` moves the steps after a restore_step to checkpoints_abandoned/.

Workdirs in a bucket (`gs://bucket/runs/name`): Orbax writes the checkpoints there itself (etils.epath
for its metadata, TensorStore for the arrays), every process its own shards. On gs:// a step is
written in place and made complete by a `commit_success.txt` written last (Orbax's atomicity on
object stores; a step without it is never listed), and older steps are deleted after the new one is
complete. The step metadata and the moves to checkpoints_damaged/ and checkpoints_abandoned/ go
through umoe_jax/storage (a move there copies every object, then deletes).

Nothing is written before a run has restored (or built) its start state: the manager does not create
`checkpoints/` until the first save. A save that fails (a full disk, ...) raises CheckpointSaveError
naming the step, the directory, the cause and the last complete step; its partial
`<step>.orbax-checkpoint-tmp-*` directory is removed. Each save carries `custom_metadata` (the save
guard's reference values, see guard.py); a step can be protected from keep-last-K rotation.
"""
from __future__ import annotations

import json
import os
import re
import time
from typing import Any, Callable, Optional

import jax
import orbax.checkpoint as ocp
from absl import logging

from umoe_jax import data as data_lib
from umoe_jax import storage
# The start point, workdir, metadata and Orbax-noise names, re-exported: the commands, finetune,
# load.py and the tests import them from here (some are also used below).
from umoe_jax.train.checkpoint_metadata import (  # noqa: F401
    STEP_METADATA_FILE, CheckpointError, CheckpointMismatchError, CheckpointSaveError,
    IncompleteStepError, complete_steps, saved_shapes, shape_mismatches, step_metadata,
    step_state_shapes, tree_shapes)
from umoe_jax.train.orbax_noise import (  # noqa: F401
    orphaned_orbax_record, orphaned_orbax_work, quiet_orphaned_orbax_work)
from umoe_jax.train.resume import (  # noqa: F401
    ResumeSource, init_from_checkpoints, load_init_params, resume_source)
from umoe_jax.train.workdir import (  # noqa: F401
    ABANDONED_DIR, CHECKPOINT_DIR, CHECKPOINT_SCHEMES, CONFIG_FILE, DAMAGED_DIR, WorkdirError,
    check_workdir, write_config)


def _barrier(name: str) -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)


def _saved_process_counts(step_dir: str) -> set[int]:
  names = storage.glob(storage.join(step_dir, "data", "process_*-of-*.json"))
  return {int(m.group(1)) for n in names if (m := re.search(r"-of-(\d+)\.json$", n))}


class _ProtectedSteps:
  """Orbax preservation policy: keep the steps in `steps` whatever the keep-last-K policy says."""

  def __init__(self):
    self.steps: set[int] = set()

  def should_preserve(self, checkpoints, *, context):
    del context
    return [c.step in self.steps for c in checkpoints]


def _one_line(error: BaseException, limit: int) -> str:
  """'Type: message' on one line (Orbax errors carry multi-line TensorStore specs), cut to `limit`."""
  text = " ".join(str(error).split())
  return f"{type(error).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def restore_newest(steps: list[int], restore: Callable[[int], Any], directory: str, *,
                   stop: tuple[type, ...] = (CheckpointMismatchError,)
                   ) -> tuple[Any, Optional[int], list[tuple[int, BaseException]]]:
  """(restore(step), step, failures) for the newest of `steps` that `restore` restores, trying them
  newest first: a step whose restore raises is damaged, a warning names it, the directory and the
  cause, and the previous one is tried. An error of `stop` (CheckpointMismatchError) is raised at
  once: a config change, not damage (the older steps were written with the same config).
  `failures`: [(step, error)] of the newer steps that failed; (None, None, failures) when none
  restores. Used by a resume (`Checkpointer.restore_latest`) and by `umoe_jax.load` for a
  workdir's latest step."""
  failures = []
  for step in sorted(steps, reverse=True):
    try:
      result = restore(step)
    except stop:
      raise
    except Exception as e:  # pylint: disable=broad-except  (any unreadable file)
      logging.warning("checkpoint step %d in %s cannot be restored (%s); trying the previous one",
                      step, directory, _one_line(e, 300))
      failures.append((step, e))
      continue
    return result, step, failures
  return None, None, failures


def failures_text(failures: list[tuple[int, BaseException]], limit: int = 200) -> str:
  """'step 3: Type: message; step 2: ...' of `restore_newest`'s failures (each cut to `limit`)."""
  return "; ".join(f"step {s}: {_one_line(e, limit)}" for s, e in failures)


def _save_problem(error: BaseException) -> str:
  """A short cause of a failed save: "no space left on device", or the error's first line."""
  text = " ".join(str(error).split())
  if "No space left" in text or "os_error_code='28'" in text or "ENOSPC" in text:
    return "no space left on device"
  if "Permission denied" in text or "os_error_code='13'" in text:
    return "permission denied"
  if "Read-only file system" in text or "os_error_code='30'" in text:
    return "read-only file system"
  return _one_line(error, 300)


class Checkpointer:
  """An Orbax CheckpointManager with items "state" (TrainState) and "data" (grain iterator).

  Creates no directory until the first save. `protect(step)` keeps a step out of keep-last-K
  rotation. Failed saves raise CheckpointSaveError (module docstring). Use as a context manager (or
  call `close`): on an exception it shuts down without raising again, so the first error is the
  one reported.
  """

  def __init__(self, directory: str, *, keep: int, async_save: bool = True,
               data_config: Optional[Any] = None):
    self.directory = storage.abspath(directory)  # a local path or a gs:// URL, as Orbax takes it
    self.data_config = data_config  # (names the changed data keys when a data position misfits)
    self._protected = _ProtectedSteps()
    policy = ocp.checkpoint_managers.AnyPreservationPolicy(
        [ocp.checkpoint_managers.LatestN(n=keep), self._protected])
    options = ocp.CheckpointManagerOptions(preservation_policy=policy, create=False,
                                           enable_async_checkpointing=async_save)
    self.manager = ocp.CheckpointManager(self.directory, item_names=("state", "data"),
                                         options=options)
    self._in_flight: Optional[int] = None  # step of a save that may still be writing
    self._directory_made = False  # checkpoints/ exists for every process (after the first save)
    self._failed = False

  def steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def protect(self, step: Optional[int]) -> None:
    """Keeps `step` (only it: an earlier protected step is released) out of rotation."""
    self._protected.steps = {step} if step is not None else set()

  @property
  def protected(self) -> Optional[int]:
    return next(iter(self._protected.steps), None)

  def metadata(self, step: int) -> dict:
    """The `custom_metadata` saved with `step` ({} for checkpoints written without it)."""
    return step_metadata(self.directory, step)

  def save(self, step: int, state: Any, data_iter: Optional[Any] = None,
           metadata: Optional[dict] = None) -> None:
    """Starts saving (returns once the arrays are copied off the device when async)."""
    items = {"state": ocp.args.StandardSave(state)}
    if data_iter is not None:
      items["data"] = data_lib.save_args(data_iter)
    if not self._directory_made:  # decided per process alike: every process joins the barrier
      if (jax.process_index() == 0 and not storage.is_url(self.directory)
          and not os.path.isdir(self.directory)):
        os.makedirs(self.directory, exist_ok=True)
      _barrier("umoe_checkpoint_mkdir")
      self._directory_made = True
    if jax.process_index() == 0:
      logging.info("checkpoint: saving step %d to %s", step, storage.join(self.directory, str(step)))
    previous, self._in_flight = self._in_flight, step
    try:
      self.manager.save(step, args=ocp.args.Composite(**items), force=True,
                        custom_metadata=metadata or {})
    except Exception as e:  # pylint: disable=broad-except
      # An async save reports its failure at the next save: name the step that failed.
      try:
        self.manager.wait_until_finished()
      except Exception:  # pylint: disable=broad-except  (the same failure, reported below)
        pass
      failed = previous if previous is not None and previous not in self._complete() else step
      raise self._save_failed(failed, e) from e

  def _complete(self) -> list[int]:
    return complete_steps(self.directory)

  def _save_failed(self, step: Optional[int], error: BaseException) -> CheckpointSaveError:
    self._failed = True
    self._in_flight = None
    done = self._complete()
    if jax.process_index() == 0:  # the partial step: never listed as a step, but it takes space
      self._remove_partial(step, done)
    last = (f"the last complete checkpoint is step {done[-1]} (a restart resumes from it)" if done
            else "no checkpoint is complete")
    what = "a checkpoint" if step is None else f"checkpoint step {step}"
    return CheckpointSaveError(
        f"saving {what} to {self.directory} failed ({_save_problem(error)}); {last}")

  def _remove_partial(self, step: Optional[int], done: list[int]) -> None:
    """Deletes what a failed save of `step` left: locally its `<step>.orbax-checkpoint-tmp*`
    directory; on gs:// (written in place) the step directory, unless it is complete."""
    try:
      if not storage.is_url(self.directory):
        prefix = "*" if step is None else str(step)
        for tmp in storage.glob(storage.join(self.directory, f"{prefix}.orbax-checkpoint-tmp*")):
          storage.rmtree(tmp)
      elif step is not None and step not in done:
        storage.rmtree(storage.join(self.directory, str(step)))
    except OSError as e:  # the failure being reported matters more
      logging.warning("could not remove the partial checkpoint step %s: %s", step, e)

  def _check_fits(self, step: int, target: Any) -> None:
    """CheckpointMismatchError naming the first arrays whose paths or shapes differ between step
    `step`'s saved state and `target`, read from the metadata alone: a mismatch is a config change,
    not damage, and a restore attempt would only leave Orbax reads pending."""
    # Incomplete (IncompleteStepError): Orbax's restore would say "pytree structure error".
    on_disk = step_state_shapes(self.directory, step)
    problems = shape_mismatches(on_disk, tree_shapes(target))
    if problems:
      raise CheckpointMismatchError(
          f"checkpoint step {step} in {self.directory} does not fit this config: "
          f"{problems}. A run resumes with the model and optimizer config it "
          f"was started with ({storage.join(storage.dirname(self.directory), CONFIG_FILE)}); to "
          f"start over with the new one, move {self.directory} away")

  def _restore_step(self, step: int, target: Any, data_iter: Optional[Any]):
    self._check_fits(step, target)
    state = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target)))["state"]
    if data_iter is not None:
      saved = _saved_process_counts(storage.join(self.directory, str(step)))
      if saved and jax.process_count() not in saved:
        # Each process's share of the stream is a function of the process count (sources.py), so
        # a position saved by n processes does not exist in a stream of m: start over.
        logging.warning(
            "checkpoint %d holds the data position of %s process(es), this run has %d: parameters, "
            "optimizer state and step restore exactly, but the data iterator restarts from the "
            "beginning of this run's stream (epoch 0 of train.seed; data seen before is seen again)",
            step, "/".join(str(n) for n in sorted(saved)), jax.process_count())
      else:
        self._restore_data(step, data_iter)
    return state

  def _restore_data(self, step: int, data_iter: Any) -> None:
    """Restores the iterator position of `step` into `data_iter`. A position that is readable JSON
    but that the iterator refuses (grain's KeyError) was saved by another data pipeline: a config
    change (CheckpointMismatchError naming the data keys that changed), not damage."""
    try:
      self.manager.restore(step, args=ocp.args.Composite(data=data_lib.restore_args(data_iter)))
    except Exception as e:  # pylint: disable=broad-except
      name = f"process_{jax.process_index()}-of-{jax.process_count()}.json"
      try:
        json.loads(storage.read_text(storage.join(self.directory, str(step), "data", name)))
      except (OSError, ValueError):
        raise e from None  # missing or damaged: the damage path
      config_file = storage.join(storage.dirname(self.directory), CONFIG_FILE)
      raise CheckpointMismatchError(
          f"checkpoint step {step} in {self.directory} holds the position of another data "
          f"pipeline ({_one_line(e, 80)}){self._changed_data_keys(config_file)}. A run resumes "
          f"with the data config it was started with ({config_file}); to train on other data, "
          f"start a new --workdir with --config.checkpoint.init_from="
          f"{storage.dirname(self.directory)} (its parameters)") from e

  def _changed_data_keys(self, config_file: str) -> str:
    """': data.k=<saved> when saved, <now> now, ...' from the run's config.json ('' if unknown)."""
    if self.data_config is None:
      return ""
    try:
      saved = json.loads(storage.read_text(config_file))["data"]
    except (OSError, ValueError, KeyError, TypeError):
      return ""
    now = self.data_config.to_dict() if hasattr(self.data_config, "to_dict") else self.data_config
    changed = [f"data.{k}={saved[k]!r} when saved, {v!r} now" for k, v in sorted(now.items())
               if k in saved and saved[k] != v and not isinstance(v, (tuple, list, dict))]
    return f": {'; '.join(changed)}" if changed else ""

  def restore(self, target: Any, data_iter: Optional[Any] = None,
              step: Optional[int] = None) -> tuple[Any, int]:
    """(state, step) of checkpoint `step`, or of the newest one that restores when None."""
    if step is None:
      return self.restore_latest(target, data_iter)
    try:
      return self._restore_step(step, target, data_iter), step
    except CheckpointMismatchError:
      raise
    except Exception as e:  # pylint: disable=broad-except  (any unreadable file)
      raise CheckpointError(
          f"checkpoint step {step} in {self.directory} (checkpoint.restore_step) cannot be restored "
          f"({_one_line(e, 300)})") from e

  def restore_latest(self, target: Any, data_iter: Optional[Any] = None) -> tuple[Any, int]:
    """(state, step) from the newest checkpoint that restores; damaged newer ones are moved aside.

    `target`: the abstract `state.checkpoint_tree` with shardings of the *current* mesh
    (ShapeDtypeStructs), so a checkpoint written on another mesh or device count is resharded on
    load. `data_iter` is restored in place.
    """
    state, step, damaged = restore_newest(
        self.steps(), lambda s: self._restore_step(s, target, data_iter), self.directory)
    if step is None:
      raise CheckpointError(
          f"no checkpoint in {self.directory} can be restored ({failures_text(damaged)}). If the "
          f"model or optimizer config changed, restore the old config; to start over, move "
          f"{self.directory} away")
    if damaged:
      self._move_aside([s for s, _ in damaged], DAMAGED_DIR)
      logging.warning("resumed from checkpoint step %d instead of the damaged step(s) %s (moved "
                      "to %s)", step, [s for s, _ in damaged], self._aside_dir(DAMAGED_DIR))
    return state, step

  def set_aside_newer(self, step: int) -> list[int]:
    """Moves the checkpoints after `step` to checkpoints_abandoned/ (a run resumed from `step`
    continues another branch); returns their steps."""
    newer = [s for s in self.steps() if s > step]
    if newer:
      self._move_aside(newer, ABANDONED_DIR)
      logging.warning("resuming from checkpoint step %d (checkpoint.restore_step): the newer "
                      "checkpoints %s were moved to %s", step, newer, self._aside_dir(ABANDONED_DIR))
    return newer

  def _aside_dir(self, name: str) -> str:
    return storage.join(storage.dirname(self.directory), name)

  def _move_aside(self, steps: list[int], name: str) -> None:
    if jax.process_index() == 0:
      storage.makedirs(self._aside_dir(name))
      for step in steps:
        dst = storage.join(self._aside_dir(name), f"{step}-{int(time.time())}")
        storage.move(storage.join(self.directory, str(step)), dst)
    _barrier("umoe_checkpoint_move_aside")
    self.manager.reload()

  def wait(self) -> None:
    """Blocks until the last save is written; CheckpointSaveError if it failed."""
    try:
      self.manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      raise self._save_failed(self._in_flight, e) from e
    self._in_flight = None

  def close(self, *, quiet: bool = False) -> None:
    """Waits for the last save and shuts the manager's threads down. A failed last save raises
    CheckpointSaveError, or (quiet=True, while another error is being reported) is logged."""
    try:
      if not self._failed:
        self.wait()
    except CheckpointSaveError as e:
      if not quiet:
        self._shutdown()
        raise
      logging.error("%s", e)
    self._shutdown()

  def _shutdown(self) -> None:
    try:
      self.manager.close()
    except Exception as e:  # pylint: disable=broad-except  (a failure that was already reported)
      logging.warning("closing the checkpoint manager: %s: %s", type(e).__name__, str(e)[:200])

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    self.close(quiet=exc_type is not None)
