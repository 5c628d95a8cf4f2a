"""Which checkpoints a routing analysis reads, their model configs, and their parameters.

A checkpoint spec is a comma-separated list; each item (glob patterns expanded, sorted by step) is
  * a training step directory, `<workdir>/checkpoints/<step>` (its run's `<workdir>/config.json`);
  * a training workdir, or its `checkpoints/` directory: the latest complete step;
  * a converted checkpoint (`python -m umoe_jax.interop.official`): `<dir>/params` + `<dir>/config.json`.
Items are compared in the order given ("consecutive" = neighbours in that list).

All checkpoints must have parameters of the same shapes (`check_same_shapes` names the config keys
that differ); other differences (e.g. the router kind) are reported and the analysis goes on.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Any, Optional, Sequence

# Model keys that change numerics or kernels, not what is computed: ignored when comparing models.
NUMERICS_KEYS = ("compute_dtype", "param_dtype", "gmm_backend", "attention.core")


@dataclasses.dataclass(frozen=True)
class CheckpointRef:
  path: str                 # the directory as resolved (a step directory or a converted checkpoint)
  kind: str                 # "step" | "converted"
  step: Optional[int]       # training step (None for a converted checkpoint)
  run: str                  # the workdir (or the converted directory)
  config: dict              # the run's config.json (experiment config, or {"model": ...})


def labels(refs: Sequence[CheckpointRef]) -> list[str]:
  """Short names: the step when all checkpoints are steps of one run, else "<run>@<step>"
  (a converted checkpoint: its directory name)."""
  one_run = len({r.run for r in refs}) == 1 and all(r.step is not None for r in refs)
  out = []
  for r in refs:
    run = os.path.basename(r.run.rstrip("/"))
    out.append(str(r.step) if one_run else run if r.step is None else f"{run}@{r.step}")
  return out


def _read_config(directory: str, what: str) -> dict:
  path = os.path.join(directory, "config.json")
  if not os.path.isfile(path):
    raise ValueError(f"{what} has no config.json (expected {path}): cannot tell its model")
  try:
    with open(path, encoding="utf-8") as f:
      config = json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: not valid JSON ({e})") from None
  if "model" not in config:
    raise ValueError(f"{path} has no 'model' section")
  return config


def _step_dirs(checkpoints_dir: str) -> list[int]:
  from umoe_jax.train.checkpoint import complete_steps
  return complete_steps(checkpoints_dir)


def _resolve_one(path: str) -> CheckpointRef:
  from umoe_jax.train.checkpoint import CHECKPOINT_DIR

  path = os.path.abspath(os.path.expanduser(path))
  if not os.path.isdir(path):
    raise ValueError(f"checkpoint {path!r}: no such directory")
  if os.path.isdir(os.path.join(path, "params")):
    return CheckpointRef(path, "converted", None, path, _read_config(path, f"checkpoint {path!r}"))
  name = os.path.basename(path)
  parent = os.path.dirname(path)
  if name.isdigit() and os.path.isdir(os.path.join(path, "state")):
    workdir = os.path.dirname(parent)
    return CheckpointRef(path, "step", int(name), workdir,
                         _read_config(workdir, f"checkpoint {path!r} (run {workdir})"))
  ckpt_dir = path if name == CHECKPOINT_DIR else os.path.join(path, CHECKPOINT_DIR)
  steps = _step_dirs(ckpt_dir)
  if not steps:
    raise ValueError(f"checkpoint {path!r} is neither a training workdir with checkpoints, a "
                     f"<workdir>/checkpoints/<step> directory, nor a converted checkpoint (params/)")
  return _resolve_one(os.path.join(ckpt_dir, str(steps[-1])))


def resolve(spec: str | Sequence[str]) -> list[CheckpointRef]:
  """The checkpoints of a comma-separated spec (or a list of items), in order; see the docstring."""
  items = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
  if not items:
    raise ValueError("no checkpoint given (--checkpoints=A,B,...)")
  refs = []
  for item in items:
    if glob.has_magic(item):
      matches = glob.glob(os.path.expanduser(item))
      if not matches:
        raise ValueError(f"checkpoint pattern {item!r} matches nothing")
      found = [_resolve_one(m) for m in matches if os.path.isdir(m)]
      refs += sorted(found, key=lambda r: (r.run, r.step if r.step is not None else -1))
    else:
      refs.append(_resolve_one(item))
  return refs


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  if isinstance(tree, dict):
    out = {}
    for k, v in tree.items():
      out.update(_flatten(v, f"{prefix}{k}."))
    return out
  return {prefix[:-1]: tree}


def model_configs(refs: Sequence[CheckpointRef]) -> list[Any]:
  """The resolved ModelConfig of each checkpoint (errors name the checkpoint)."""
  import ml_collections

  from umoe_jax.config import ConfigError, model_config
  out = []
  for r in refs:
    try:
      out.append(model_config(ml_collections.ConfigDict(r.config["model"])))
    except ConfigError as e:
      raise ValueError(f"checkpoint {r.path}: its config.json model section is invalid: {e}") from None
  return out


def config_differences(a: Any, b: Any) -> list[tuple[str, Any, Any]]:
  """(key, value in a, value in b) of two ModelConfigs, numerics-only keys left out."""
  from umoe_jax.config import to_dict
  fa, fb = _flatten(to_dict(a)), _flatten(to_dict(b))
  return [(k, fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb))
          if fa.get(k) != fb.get(k) and k not in NUMERICS_KEYS]


def param_shapes(cfg: Any) -> dict[str, tuple]:
  """{parameter path: shape} of the model `cfg` (abstract: no memory)."""
  from flax import nnx

  from umoe_jax.model.lm import abstract_model
  state = nnx.to_pure_dict(nnx.state(abstract_model(cfg), nnx.Param))
  return {k: tuple(v.shape) for k, v in _flatten(state).items()}


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


def load_params(ref: CheckpointRef, abstract_params: Any) -> Any:
  """The parameters of `ref` (pure dict on the first device) for the model whose abstract
  parameters (nnx.State of ShapeDtypeStructs, `state.model_parts(cfg).abstract_params`) are given."""
  import jax
  import orbax.checkpoint as ocp
  from flax import nnx

  from umoe_jax.train import checkpoint as ckpt_lib

  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device),
                        nnx.to_pure_dict(abstract_params))
  try:
    if ref.kind == "converted":
      shardings = jax.tree.map(lambda _: device, target)
      return ckpt_lib.load_init_params(ref.path, abstract_params, shardings)
    _check_saved_shapes(ref, target)
    item = {"params": target}
    restored = ocp.PyTreeCheckpointer().restore(
        os.path.join(ref.path, "state"), args=ocp.args.PyTreeRestore(
            item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
            partial_restore=True))
    return restored["params"]
  except ValueError:
    raise
  except Exception as e:  # pylint: disable=broad-except  (any unreadable or mismatched file)
    raise ValueError(f"cannot read the parameters of checkpoint {ref.path} as the model of its "
                     f"config.json ({type(e).__name__}: {str(e)[:300]})") from e


def _saved_param_shapes(state_dir: str) -> Optional[dict[str, tuple]]:
  """{parameter path: shape} from a step's Orbax metadata, or None if it cannot be read so."""
  import orbax.checkpoint as ocp
  try:
    meta = ocp.PyTreeCheckpointer().metadata(state_dir)
    tree = getattr(getattr(meta, "item_metadata", meta), "tree", None)
    params = tree["params"]
    return {k: tuple(v.shape) for k, v in _flatten(dict(params)).items()}
  except Exception:  # pylint: disable=broad-except  (another Orbax layout: the restore decides)
    return None


def _check_saved_shapes(ref: CheckpointRef, target: Any) -> None:
  """Compares a step's saved parameter shapes with the model's before reading any array: a
  config.json that does not describe its checkpoint gets an error naming the parameter."""
  saved = _saved_param_shapes(os.path.join(ref.path, "state"))
  if saved is None:
    return
  want = {k: tuple(v.shape) for k, v in _flatten(target).items()}
  for k in sorted(set(want) | set(saved)):
    if saved.get(k) != want.get(k):
      raise ValueError(f"cannot read the parameters of checkpoint {ref.path} as the model of its "
                       f"config.json: parameter {k} is {saved.get(k) or 'missing'} in the "
                       f"checkpoint, {want.get(k) or 'absent'} in the model")
