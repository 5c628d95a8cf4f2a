"""A run's work directory: its layout, the check that it can hold a run, and its config.json.

Layout:
  <workdir>/config.json                     the experiment config (process 0, at every start once
                                            the start point is restored: a failed resume keeps it)
  <workdir>/checkpoints/<step>/state        `state.checkpoint_tree`: params, optimizer state, step,
                                            RNG, skipped
  <workdir>/checkpoints/<step>/data         grain iterator position, process_<i>-of-<n>.json
  <workdir>/checkpoints_damaged/<step>-<t>  checkpoints that failed to restore, moved aside
  <workdir>/checkpoints_abandoned/<step>-<t>  checkpoints newer than `checkpoint.restore_step`, moved
                                            aside when a run resumes from that older step

A workdir is a local path or a gs:// URL (Orbax writes checkpoints to those only: other stores,
s3:// ..., are refused with WorkdirError). config.json goes through umoe_jax/storage.
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Optional

import jax

from umoe_jax import storage

CHECKPOINT_DIR = "checkpoints"
DAMAGED_DIR = "checkpoints_damaged"
ABANDONED_DIR = "checkpoints_abandoned"
CONFIG_FILE = "config.json"
# What marks a fine-tuning workdir (`umoe_jax.finetune.predict`): a text classifier, not an LM.
CLASSIFIER_FILE = "classifier.json"


class WorkdirError(ValueError):
  """--workdir cannot hold a run (a file, or not writable), or a write into it failed."""


def write_failed(path: str, error: OSError) -> WorkdirError:
  """WorkdirError naming the file of the workdir a local write failed on and why (a full disk,
  ...), with a hint: the run's checkpoints are intact, so the same command resumes."""
  e = WorkdirError(f"writing {path} failed ({error.strerror or error})")
  e.hint = ("free space (or fix the directory) and run the same command again: it resumes from "
            "the last complete checkpoint")
  return e



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
  try:
    path = os.path.abspath(storage.expand_user(workdir, "--workdir"))
  except ValueError as e:  # ~user of no user
    raise WorkdirError(str(e)) from None
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



def write_config(workdir: str, config: Any) -> None:
  """<workdir>/config.json (process 0), atomically (storage.write_text: a temporary file renamed
  over it, or one whole upload), so a reader or a crash sees the old file or the new one, never a
  partial one."""
  if jax.process_index() != 0:
    return
  text = config.to_json_best_effort(indent=2) if hasattr(config, "to_json_best_effort") else str(config)
  path = storage.join(workdir, CONFIG_FILE)
  try:
    storage.write_text(path, text + "\n")
  except storage.StorageError:
    raise  # (remote: names the URL already)
  except OSError as e:
    raise write_failed(path, e) from e


def finetune_workdir(path: str) -> Optional[str]:
  """The fine-tuning workdir that `path` is (or whose checkpoints/, best/ or a step of them it is),
  or None."""
  path = storage.normpath(storage.abspath(path))
  parent = storage.dirname(path)
  name = storage.basename(path)
  candidates = [path] + ([parent] if name in ("checkpoints", "best") else []) + (
      [storage.dirname(parent)] if name.isdigit() else [])
  return next((d for d in candidates if storage.isfile(storage.join(d, CLASSIFIER_FILE))), None)


def finetune_message(path: str, workdir: str) -> str:
  """Why a fine-tuning workdir is not a language-model checkpoint, and what to do instead."""
  path_config = storage.join(workdir, CONFIG_FILE)
  try:
    config = json.loads(storage.read_text(path_config)) if storage.isfile(path_config) else {}
  except ValueError:  # not JSON: the advice stands without the backbone's name
    config = {}
  backbone = config.get("init_from") if isinstance(config, dict) else None
  where = ("is a fine-tuning workdir" if storage.normpath(storage.abspath(path)) == workdir
           else f"is in the fine-tuning workdir {workdir}")
  return (f"{path!r} {where} ({CLASSIFIER_FILE}): a text "
          f"classifier, not a language model; score texts with `python -m umoe_jax.finetune "
          f"predict --checkpoint={workdir} --input=FILE --output=FILE`"
          + (f", or use its backbone, {backbone}" if backbone else ""))
