"""Which checkpoints a routing analysis compares, and whether their models have the same shapes.

A checkpoint spec is a comma-separated list; each item (glob patterns expanded, sorted by step,
saves still in progress left out) is
a checkpoint directory as `umoe_jax.load.resolve_checkpoint` reads it: a training step
(`<workdir>/checkpoints/<step>`), a training workdir or its `checkpoints/` directory (the latest
complete step), or a converted checkpoint. Items are compared in the order given ("consecutive" =
neighbours in that list); their parameters are read with `umoe_jax.load.load_params`.

All checkpoints must have parameters of the same shapes (`check_same_shapes` names the config keys
that differ); other differences (e.g. the router kind) are reported and the analysis goes on.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import orbax.checkpoint as ocp

from umoe_jax import storage
from umoe_jax.load import CheckpointRef, LoadError, flatten, resolve_checkpoint

# Model keys that change numerics or kernels, not what is computed: ignored when comparing models.
NUMERICS_KEYS = ("compute_dtype", "param_dtype", "gmm_backend", "attention.core",
                 "router.topk_backend", "attention.router.topk_backend", "ffn.router.topk_backend",
                 "moe.fuse_activation", "moe.fuse_weight_rows", "attention.core_backward")


def labels(refs: Sequence[CheckpointRef]) -> list[str]:
  """Short names: the step when all checkpoints are steps of one run, else "<run>@<step>"
  (a converted checkpoint: its directory name)."""
  one_run = len({r.run for r in refs}) == 1 and all(r.step is not None for r in refs)
  out = []
  for r in refs:
    run = os.path.basename(r.run.rstrip("/"))
    out.append(str(r.step) if one_run else run if r.step is None else f"{run}@{r.step}")
  return out


def resolve(spec: str | Sequence[str]) -> list[CheckpointRef]:
  """The checkpoints of a comma-separated spec (or a list of items), in order; see the docstring."""
  items = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
  if not items:
    raise ValueError("no checkpoint given (--checkpoints=A,B,...)")
  refs = []
  for item in items:
    if storage.has_magic(item):
      matches = storage.glob(item)
      if not matches:
        raise ValueError(f"checkpoint pattern {item!r} matches nothing")
      # a save in progress (<step>.orbax-checkpoint-tmp-<t>, while the run trains) is no step yet
      found = [resolve_checkpoint(m) for m in matches
               if storage.isdir(m) and not ocp.step.is_tmp_checkpoint(m)]
      if not found:  # else an IndexError on the empty list further on
        raise ValueError(f"checkpoint pattern {item!r} matches no checkpoint directory (only "
                         f"files or saves in progress: {', '.join(sorted(matches)[:3])}"
                         f"{', ...' if len(matches) > 3 else ''})")
      refs += sorted(found, key=lambda r: (r.run, r.step if r.step is not None else -1))
    else:
      refs.append(resolve_checkpoint(item))
  return refs


def model_configs(refs: Sequence[CheckpointRef]) -> list[Any]:
  """The resolved ModelConfig of each checkpoint (errors name the checkpoint)."""
  import ml_collections

  from umoe_jax.config import ConfigError, model_config
  out = []
  for r in refs:
    if r.config is None:
      raise LoadError(f"checkpoint {r.path!r} has no config.json (expected {r.config_path}): "
                      "cannot tell its model")
    try:
      out.append(model_config(ml_collections.ConfigDict(r.config["model"])))
    except ConfigError as e:
      raise ValueError(f"checkpoint {r.path}: its config.json model section is invalid: {e}") from None
  return out


def config_differences(a: Any, b: Any) -> list[tuple[str, Any, Any]]:
  """(key, value in a, value in b) of two ModelConfigs, numerics-only keys left out."""
  from umoe_jax.config import to_dict
  fa, fb = flatten(to_dict(a)), flatten(to_dict(b))
  return [(k, fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb))
          if fa.get(k) != fb.get(k) and k not in NUMERICS_KEYS]


def param_shapes(cfg: Any) -> dict[str, tuple]:
  """{parameter path: shape} of the model `cfg` (abstract: no memory)."""
  from flax import nnx

  from umoe_jax.model.lm import abstract_model
  state = nnx.to_pure_dict(nnx.state(abstract_model(cfg), nnx.Param))
  return {k: tuple(v.shape) for k, v in flatten(state).items()}


def check_same_shapes(refs: Sequence[CheckpointRef], cfgs: Sequence[Any]) -> list[str]:
  """Raises ValueError if two checkpoints' models have parameters of different shapes, naming
  the config keys (and values) that differ; returns notes on other config differences."""
  notes = []
  shapes0 = param_shapes(cfgs[0])
  for ref, cfg in zip(refs[1:], cfgs[1:]):
    diffs = config_differences(cfgs[0], cfg)
    if not diffs:
      continue
    shapes = param_shapes(cfg)
    keys = "; ".join(f"model.{k}={vb!r} vs {va!r}" for k, va, vb in diffs)
    if shapes != shapes0:
      bad = sorted(set(shapes) ^ set(shapes0)) or sorted(k for k in shapes if shapes[k] != shapes0[k])
      detail = (f"parameter {bad[0]}: {shapes.get(bad[0])} vs {shapes0.get(bad[0])}")
      raise ValueError(f"checkpoints of different model shapes: {ref.path} has {keys} (in "
                       f"{refs[0].path}); {detail}. Compare checkpoints of one model")
    notes.append(f"note: {ref.path} differs from {refs[0].path} in {keys} (same shapes)")
  return notes
