"""A saved checkpoint read from its files alone, without restoring it, and the errors of checkpoints.

What is on disk: the complete steps of a checkpoint directory (`complete_steps`), the
`custom_metadata` saved with a step (`step_metadata`), and the {path: shape} of its arrays
(`saved_shapes`), compared with the current config's (`tree_shapes`, `shape_mismatches`) so that a
checkpoint that does not fit is named before Orbax starts reading it.

The errors live here, below both of their raisers: the Checkpointer (checkpoint.py) and the start
from `checkpoint.init_from` (resume.py).
"""
from __future__ import annotations

import json
import re
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp
from etils import epath

from umoe_jax import storage

STEP_METADATA_FILE = "_CHECKPOINT_METADATA"  # Orbax's per-step metadata (holds custom_metadata)


class CheckpointError(RuntimeError):
  """No checkpoint of a run could be restored."""


class CheckpointMismatchError(CheckpointError):
  """A checkpoint's arrays do not fit the current config (the model or optimizer changed)."""


class CheckpointSaveError(CheckpointError):
  """Writing a checkpoint failed (a full disk, permissions, ...); the earlier steps are intact."""


class IncompleteStepError(CheckpointError):
  """A numbered step directory whose files say it cannot be restored: empty, without state/, or
  without a readable state/_METADATA (a crash mid-save on gs://, a copy cut short)."""



def step_metadata(directory: str, step: int) -> dict:
  """The `custom_metadata` saved with `step` (Orbax's <step>/_CHECKPOINT_METADATA, read as JSON
  without building item handlers); {} for checkpoints written without it."""
  try:
    text = storage.read_text(storage.join(directory, str(step), STEP_METADATA_FILE))
    return dict(json.loads(text).get("custom_metadata") or {})
  except (OSError, ValueError, AttributeError):
    return {}


def step_state_shapes(directory: str, step: int) -> dict[str, tuple]:
  """`saved_shapes` of step `step`'s state/ in the checkpoint directory `directory`, from its
  metadata alone; IncompleteStepError naming the step's directory and what it lacks when its files
  cannot be restored. The one test of a step's completeness: a resume (checkpoint.py) and `load`
  skip the steps it refuses."""
  step_dir = storage.join(directory, str(step))
  state_dir = storage.join(step_dir, "state")
  if not storage.isdir(state_dir):
    lacks = "is empty" if not storage.listdir(step_dir) else "has no state/ (the parameters)"
    raise IncompleteStepError(f"{step_dir} {lacks}: the step is incomplete")
  on_disk = saved_shapes(state_dir)
  if on_disk is None:
    raise IncompleteStepError(f"{state_dir}: no readable _METADATA (Orbax's index of the saved "
                              "arrays: the step is incomplete or damaged)")
  return on_disk


def complete_steps(directory: str) -> list[int]:
  """Finalized checkpoint steps in `directory` (tmp directories of unfinished saves excluded)."""
  if not storage.isdir(directory):
    return []
  return sorted(ocp.utils.checkpoint_steps(directory))



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
