"""Checkpoints with Orbax: train state + data-iterator position per step, and where a run starts.

Workdir layout:
  <workdir>/config.json                     the experiment config (process 0, at every start once
                                            the start point is restored: a failed resume keeps it)
  <workdir>/checkpoints/<step>/state        `state.checkpoint_tree`: params, optimizer state, step,
                                            RNG, skipped
  <workdir>/checkpoints/<step>/data         grain iterator position, process_<i>-of-<n>.json
  <workdir>/checkpoints_damaged/<step>-<t>  checkpoints that failed to restore, moved aside
  <workdir>/checkpoints_abandoned/<step>-<t>  checkpoints newer than `checkpoint.restore_step`, moved
                                            aside when a run resumes from that older step

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
(it never silently restarts from scratch over an existing run). `checkpoint.restore_step=N` resumes
from step N instead of the latest (no fallback); the later steps are moved to checkpoints_abandoned/
once the run starts, and the saves of the new branch record `restored_from: N`, so that restarting
the same command later continues the new branch instead of going back to N again.

Workdirs in a bucket (`gs://bucket/runs/name`): Orbax writes the checkpoints there itself (etils.epath
for its metadata, TensorStore for the arrays), every process its own shards. On gs:// a step is
written in place and made complete by a `commit_success.txt` written last (Orbax's atomicity on
object stores; a step without it is never listed), and older steps are deleted after the new one is
complete. config.json, the step metadata, and the moves to checkpoints_damaged/ and
checkpoints_abandoned/ go through umoe_jax/storage (a move there copies every object, then deletes).
Orbax speaks local paths and gs:// only: other stores (s3://, ...) are refused with WorkdirError.

Nothing is written before a run has restored (or built) its start state: the manager does not create
`checkpoints/` until the first save. A save that fails (a full disk, ...) raises CheckpointSaveError
naming the step, the directory, the cause and the last complete step; its partial
`<step>.orbax-checkpoint-tmp-*` directory is removed. Each save carries `custom_metadata` (the save
guard's reference values, see guard.py); a step can be protected from keep-last-K rotation.
"""
from __future__ import annotations

import dataclasses
import json
import logging as std_logging
import os
import re
import sys
import tempfile
import time
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from umoe_jax import data as data_lib
from umoe_jax import storage
from umoe_jax.config import ConfigError

CHECKPOINT_DIR = "checkpoints"
DAMAGED_DIR = "checkpoints_damaged"
ABANDONED_DIR = "checkpoints_abandoned"
CONFIG_FILE = "config.json"
STEP_METADATA_FILE = "_CHECKPOINT_METADATA"  # Orbax's per-step metadata (holds custom_metadata)


class CheckpointError(RuntimeError):
  """No checkpoint of a run could be restored."""


class CheckpointMismatchError(CheckpointError):
  """A checkpoint's arrays do not fit the current config (the model or optimizer changed)."""


class CheckpointSaveError(CheckpointError):
  """Writing a checkpoint failed (a full disk, permissions, ...); the earlier steps are intact."""


class WorkdirError(ValueError):
  """--workdir cannot hold a run (a file, or not writable)."""


CHECKPOINT_SCHEMES = ("gs",)  # remote stores Orbax writes checkpoints to


def _check_remote_workdir(workdir: str) -> None:
  scheme = storage.scheme(workdir)
  if scheme not in CHECKPOINT_SCHEMES:
    raise WorkdirError(
        f"--workdir={workdir!r}: checkpoints (Orbax) are written to local paths and gs:// only, not "
        f"{scheme}://; use a gs:// bucket, or mount the store (e.g. mountpoint-s3) and pass the "
        "mount path")
  bucket = storage.bucket_url(workdir)
  if bucket == storage.expand(workdir):
    raise WorkdirError(f"--workdir={workdir!r} is a bucket: pass a directory in it, e.g. "
                       f"{bucket}/runs/NAME")
  try:
    storage.check_bucket(workdir)
  except FileNotFoundError as e:
    raise WorkdirError(f"--workdir={workdir!r}: {e}") from None
  if storage.isfile(workdir):
    raise WorkdirError(f"--workdir={workdir!r} is a file (an object), not a directory")


def check_workdir(workdir: str) -> None:
  """Raises WorkdirError unless `workdir` is (or can be created as) a writable directory.

  Writes nothing: writability is probed with an anonymous temporary file in the nearest existing
  ancestor (root ignores permission bits, a read-only mount does not). A URL must be on a store
  Orbax writes to, in a bucket that exists, and not name an object; its writability shows at the
  first write (a StorageError naming the object and the credentials to check).
  """
  if storage.is_url(workdir):
    _check_remote_workdir(workdir)
    return
  path = os.path.abspath(os.path.expanduser(workdir))
  if os.path.exists(path) and not os.path.isdir(path):
    raise WorkdirError(f"--workdir={workdir!r} is a file, not a directory")
  existing = path
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise WorkdirError(f"--workdir={workdir!r} cannot be created: {existing!r} is a file")
  try:
    with tempfile.TemporaryFile(dir=existing):
      pass
  except OSError as e:
    what = "is not writable" if existing == path else f"cannot be created in {existing!r}"
    raise WorkdirError(f"--workdir={workdir!r} {what} ({e.strerror or e})") from None


def step_metadata(directory: str, step: int) -> dict:
  """The `custom_metadata` saved with `step` (Orbax's <step>/_CHECKPOINT_METADATA, read as JSON
  without building item handlers); {} for checkpoints written without it."""
  try:
    text = storage.read_text(storage.join(directory, str(step), STEP_METADATA_FILE))
    return dict(json.loads(text).get("custom_metadata") or {})
  except (OSError, ValueError, AttributeError):
    return {}


def complete_steps(directory: str) -> list[int]:
  """Finalized checkpoint steps in `directory` (tmp directories of unfinished saves excluded)."""
  if not storage.isdir(directory):
    return []
  return sorted(ocp.utils.checkpoint_steps(directory))


@dataclasses.dataclass(frozen=True)
class ResumeSource:
  kind: str        # "workdir" | "init_from" | "scratch"
  path: str = ""   # the checkpoint directory (workdir) or the init_from directory
  step: Optional[int] = None  # workdir: checkpoint.restore_step (None: the latest that restores)


def init_from_checkpoints(path: str) -> tuple[str, list[int]]:
  """("params", []) for a converted checkpoint, else (checkpoint directory, its complete steps) of
  a training workdir or its `checkpoints/`; ConfigError naming `path` when it holds neither."""
  if not storage.isdir(path):
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
    init_from_checkpoints(path)
    return ResumeSource("init_from", path)
  return ResumeSource("scratch")


def write_config(workdir: str, config: Any) -> None:
  """<workdir>/config.json (process 0), atomically (storage.write_text: a temporary file renamed
  over it, or one whole upload), so a reader or a crash sees the old file or the new one, never a
  partial one."""
  if jax.process_index() != 0:
    return
  text = config.to_json_best_effort(indent=2) if hasattr(config, "to_json_best_effort") else str(config)
  storage.write_text(storage.join(workdir, CONFIG_FILE), text + "\n")


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


def _path_name(path) -> str:
  """A tree path as 'params/layers/0/embed' (dict keys, indices and attributes alike)."""
  parts = []
  for k in path:
    for attr in ("key", "idx", "name"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return "/".join(parts)


def tree_shapes(tree: Any) -> dict[str, tuple]:
  """{'params/layers/0/embed': shape} of the array leaves of `tree`."""
  return {_path_name(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def saved_shapes(directory: str) -> Optional[dict[str, tuple]]:
  """`tree_shapes` of the Orbax checkpoint in `directory` (a step's state/, or a converted params/,
  whose leaves nnx saves as '<path>/value'), from its metadata alone; None if that is unreadable."""
  try:
    saved = ocp.StandardCheckpointHandler().metadata(epath.Path(directory))
  except Exception:  # pylint: disable=broad-except  (unreadable: the restore reports the damage)
    return None
  return {re.sub(r"/value$", "", k): v for k, v in tree_shapes(saved).items()}


def shape_mismatches(on_disk: dict[str, tuple], wanted: dict[str, tuple]) -> str:
  """The first two differences between saved and wanted {path: shape} ("" if none), params first."""
  order = lambda keys: sorted(keys, key=lambda k: (not k.startswith("params/"), k))  # noqa: E731
  problems = [f"{k} is {on_disk[k]} on disk, {wanted[k]} here" for k in order(wanted)
              if k in on_disk and on_disk[k] != wanted[k]]
  problems += [f"{k} is not in the checkpoint" for k in order(set(wanted) - set(on_disk))]
  problems += [f"{k} is in the checkpoint only" for k in order(set(on_disk) - set(wanted))]
  more = f" (and {len(problems) - 2} more)" if len(problems) > 2 else ""
  return f"{'; '.join(problems[:2])}{more}" if problems else ""


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

  def __init__(self, directory: str, *, keep: int, async_save: bool = True):
    self.directory = storage.abspath(directory)  # a local path or a gs:// URL, as Orbax takes it
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
    on_disk = saved_shapes(storage.join(self.directory, str(step), "state"))
    if on_disk is None:  # unreadable: the restore reports the damage
      return
    problems = shape_mismatches(on_disk, tree_shapes(target))
    if problems:
      raise CheckpointMismatchError(
          f"checkpoint step {step} in {self.directory} does not fit this config: "
          f"{problems}. A run resumes with the model and optimizer config it "
          f"was started with ({storage.join(storage.dirname(self.directory), CONFIG_FILE)}); to "
          f"start over with the new one, move {self.directory} away")

  def _restore_step(self, step: int, target: Any, data_iter: Optional[Any]):
    self._check_fits(step, target)
    items = {"state": ocp.args.StandardRestore(target)}
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
        items["data"] = data_lib.restore_args(data_iter)
    return self.manager.restore(step, args=ocp.args.Composite(**items))["state"]

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
    damaged = []
    for step in reversed(self.steps()):
      try:
        state = self._restore_step(step, target, data_iter)
      except CheckpointMismatchError:
        raise  # a config change, not damage: the older steps were written with the same config
      except Exception as e:  # pylint: disable=broad-except  (any unreadable file)
        logging.warning("checkpoint step %d in %s cannot be restored (%s); trying the previous one",
                        step, self.directory, _one_line(e, 300))
        damaged.append((step, e))
        continue
      if damaged:
        self._move_aside([s for s, _ in damaged], DAMAGED_DIR)
        logging.warning("resumed from checkpoint step %d instead of the damaged step(s) %s (moved "
                        "to %s)", step, [s for s, _ in damaged], self._aside_dir(DAMAGED_DIR))
      return state, step
    detail = "; ".join(f"step {s}: {_one_line(e, 200)}" for s, e in damaged)
    raise CheckpointError(
        f"no checkpoint in {self.directory} can be restored ({detail}). If the model or optimizer "
        f"config changed, restore the old config; to start over, move {self.directory} away")

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


def orphaned_orbax_work(unraisable) -> bool:
  """Whether an unraisable exception is the echo of an Orbax operation abandoned after an error
  that the command reports itself (so it adds nothing but a screenful of traceback):

  * after a failed save or restore, TensorStore completes the other reads / writes of that
    operation and calls back into the asyncio loop Orbax has already closed: 'Event loop is
    closed' (hundreds on a full disk, one per array of a damaged checkpoint);
  * after a failed restore (e.g. the model changed), the reads of the other arrays are coroutines
    that were never awaited; at exit Python finalises them and prints their read errors.
  """
  error, obj = unraisable.exc_value, unraisable.object
  if isinstance(error, RuntimeError) and "Event loop is closed" in str(error):
    return True
  code = getattr(obj, "cr_code", None)
  return code is not None and "/orbax/" in code.co_filename


def orphaned_orbax_record(record: std_logging.LogRecord) -> bool:
  """Whether a log record is asyncio's 'exception was never retrieved' for a future or Task of an
  Orbax operation that failed: a full disk fails every write of a save (the first failure is
  reported by the run, the others are logged when their futures are garbage-collected, in no fixed
  order); after a damaged checkpoint's first read error, TensorStore's other reads fail inside
  Tasks nobody awaits any more (their errors carry a `tensorstore_spec`; whether they are logged
  depends on timing)."""
  if "/asyncio/" not in record.pathname or not record.exc_info:
    return False
  if "tensorstore_spec" in str(record.exc_info[1]):
    return True
  tb = record.exc_info[2]
  while tb is not None:
    if "/orbax/" in tb.tb_frame.f_code.co_filename:
      return True
    tb = tb.tb_next
  return False


class _QuietOrphanedRecords(std_logging.Filter):
  def filter(self, record: std_logging.LogRecord) -> bool:
    return not orphaned_orbax_record(record)


def quiet_orphaned_orbax_work() -> None:
  """Drops, instead of printing, the unraisable exceptions `orphaned_orbax_work` recognises and the
  asyncio log records `orphaned_orbax_record` recognises, for the rest of the process (the
  commands call it at start-up; not with UMOE_DEBUG=1, or train.py --debug). Idempotent."""
  previous = sys.unraisablehook
  if getattr(previous, "quiets_orbax", False) or os.environ.get("UMOE_DEBUG", "") not in ("", "0"):
    return

  def hook(unraisable):
    if not orphaned_orbax_work(unraisable):
      previous(unraisable)

  hook.quiets_orbax = True
  sys.unraisablehook = hook
  std_logging.getLogger("asyncio").addFilter(_QuietOrphanedRecords())


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
    restored = ocp.StandardCheckpointer().restore(storage.abspath(params_dir), target)
    return nnx.to_pure_dict(restored)
  ckpt_dir, steps = init_from_checkpoints(path)
  state_dir = storage.join(storage.abspath(ckpt_dir), str(steps[-1]), "state")
  _check_init_from_fits(path, state_dir, target_dict, "params/")
  item = {"params": target_dict}
  restored = ocp.PyTreeCheckpointer().restore(state_dir, args=ocp.args.PyTreeRestore(
      item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
      partial_restore=True))
  logging.info("init_from: params of step %d of %s", steps[-1], ckpt_dir)
  return restored["params"]


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
