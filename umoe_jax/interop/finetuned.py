"""The language model inside a fine-tuning workdir (`python -m umoe_jax.finetune`), for export.

A fine-tuned classifier is `SequenceClassifier`: a complete `CausalLM` backbone (its LM head kept,
frozen by the fine-tuning optimizer) plus a classification head. Export writes the backbone: the
fine-tuned decoder with the pretrained LM head, the language model the classifier reads its hidden
states from. The classification head has no place in a causal LM's files and is left out (named in
the summary line).

Which parameters: those the run scores with, `best/<step>` (its best dev epoch), by default; with
--step=N, step N of `best/` or else of `checkpoints/` (training state: only its parameters are read).
A step directory of either as --checkpoint is that step.
"""
from __future__ import annotations

import os
from typing import Optional

from umoe_jax import storage

BACKBONE, HEAD = "backbone", "head"


def _steps(directory: str) -> list[int]:
  from umoe_jax.train.checkpoint_metadata import complete_steps
  return complete_steps(directory)


def _pick_step(workdir: str, path: str, step: Optional[int]) -> tuple[str, int]:
  """(checkpoint directory, step) of the parameters to export; LoadError naming what is missing."""
  from umoe_jax.finetune.predict import BEST_DIR
  from umoe_jax.load import LoadError
  from umoe_jax.train.checkpoint import CHECKPOINT_DIR

  best, ckpts = os.path.join(workdir, BEST_DIR), os.path.join(workdir, CHECKPOINT_DIR)
  name, parent = os.path.basename(path), os.path.dirname(path)
  if name.isdigit() and parent in (best, ckpts):   # a step directory named as --checkpoint
    if step is not None and step != int(name):
      raise LoadError(f"--step={step} but --checkpoint names step {name} ({path})")
    return parent, int(name)
  if step is None:
    have = _steps(best)
    if not have:
      raise LoadError(f"fine-tuning workdir {workdir} has no complete best checkpoint in {best} "
                      "(the run ended before its first epoch); pass --step=N for a step of "
                      f"{ckpts} (steps there: {_steps(ckpts) or 'none'})")
    return best, have[-1]
  for d in (best, ckpts):
    if os.path.isdir(os.path.join(d, str(step))):
      return d, step
  raise LoadError(f"--step={step}: fine-tuning workdir {workdir} has no such step (best: "
                  f"{_steps(best) or 'none'}, checkpoints: {_steps(ckpts) or 'none'})")


def load_backbone(path: str, workdir: str, step: Optional[int] = None):
  """(CausalLM in float32, model ConfigDict, CheckpointRef, tokenizer spec, eos token, what was
  left out) of the fine-tuning workdir `workdir` (`path`: it, or a directory in it)."""
  import jax
  import ml_collections
  import orbax.checkpoint as ocp
  from flax import nnx

  from umoe_jax.config import ConfigError, model_config
  from umoe_jax.finetune.predict import read_meta
  from umoe_jax.load import CheckpointRef, LoadError, _innermost_cause
  from umoe_jax.train import state as state_lib
  from umoe_jax.train.checkpoint_metadata import IncompleteStepError, step_state_shapes

  try:
    meta = read_meta(workdir)
  except ConfigError as e:
    raise LoadError(str(e)) from None
  section = ml_collections.ConfigDict(meta["model"])
  section.compute_dtype = "float32"
  try:
    cfg = model_config(section)
  except ConfigError as e:
    raise LoadError(f"the backbone's model config in {workdir}/classifier.json is invalid: {e}"
                    ) from None
  directory, step = _pick_step(workdir, os.path.abspath(path), step)
  step_dir = os.path.join(directory, str(step))
  try:
    shapes = step_state_shapes(directory, step)
  except IncompleteStepError as e:
    raise LoadError(f"checkpoint step {step} cannot be loaded: {e}") from None
  prefix = f"params/{HEAD}/"
  head = {k[len(prefix):]: v for k, v in shapes.items() if k.startswith(prefix)}
  if not any(k.startswith(f"params/{BACKBONE}/lm_head") for k in shapes):
    raise LoadError(f"{step_dir} has no {BACKBONE}/lm_head: the fine-tuned model has no language-"
                    "model head to export")

  parts = state_lib.model_parts(cfg)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device),
                        nnx.to_pure_dict(parts.abstract_params))
  item = {"params": {BACKBONE: target}}
  try:   # the backbone alone: the head and a training step's optimizer state stay on disk
    restored = ocp.PyTreeCheckpointer().restore(
        storage.join(step_dir, "state"), args=ocp.args.PyTreeRestore(
            item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
            partial_restore=True))
  except Exception as e:  # pylint: disable=broad-except  (any unreadable or mismatched file)
    cause = _innermost_cause(e)
    text = " ".join(str(cause).split())
    raise LoadError(f"cannot read the backbone of fine-tuned checkpoint {step_dir} (damaged files, "
                    f"or not the model of classifier.json): {type(cause).__name__}: {text[:300]}"
                    ) from e
  state = parts.abstract_params
  nnx.replace_by_pure_dict(state, restored["params"][BACKBONE])
  model = nnx.merge(parts.graphdef, state)
  ref = CheckpointRef(step_dir, "step", step, workdir, {"model": meta["model"]})
  dims = ", ".join(f"{k} {list(v)}" for k, v in sorted(head.items()))
  left_out = (f"the fine-tuned backbone with its pretrained LM head (frozen while fine-tuning); "
              f"left out: the classification head ({dims})")
  return model, section, ref, meta["tokenizer"], meta.get("eos_token", ""), left_out
