"""A trained model from a checkpoint directory: which checkpoint, its config, its parameters, its
tokenizer. The one reader for everything that loads a model to use it (generation, evaluation, the
routing analysis; training restores its own state in `umoe_jax.train.checkpoint`).

    model, tokenizer, info = load_model_and_tokenizer("runs/umoe_tiny")     # latest step
    model, tokenizer, info = load_model_and_tokenizer("runs/umoe_tiny/checkpoints/200")
    model, tokenizer, info = load_model_and_tokenizer(config=cfg)           # random parameters
    ref = resolve_checkpoint(path); ref, params = load_checkpoint_params(ref, abstract_params)

A checkpoint directory is
  * a training step, `<workdir>/checkpoints/<step>` (its model in `<workdir>/config.json`);
  * a training workdir, or its `checkpoints/` directory: the latest step that restores, as a resume
    finds it (a newer one a crash left empty or without its parameters is skipped with a warning;
    one whose array files are damaged is tried, named in a warning with the cause, and the
    previous one is loaded);
  * a converted checkpoint (`python -m umoe_jax.interop.official`): `<dir>/params` + `<dir>/config.json`.
The architecture is the checkpoint's config.json, else `config` (an experiment ConfigDict, e.g.
`--config=configs/umoe_base.py`); without a checkpoint the parameters are random (`seed`). The
tokenizer is `tokenizer` ("byte" or a tokenizer.json), else the checkpoint's (or config's)
`data.tokenizer`, else "byte"; its ids must fit the model. Bad input raises `LoadError` (a
ValueError) naming the directory or file.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional

from umoe_jax import json_errors, storage
# The workdir's file names and the fine-tuning workdir check live with the workdir layout, which
# the trainer's resume reads too (the trainer never imports this module).
from umoe_jax.train.workdir import (CLASSIFIER_FILE, CONFIG_FILE,  # noqa: F401  (re-exported)
                                    finetune_message, finetune_workdir)


class LoadError(ValueError):
  """A checkpoint, config or tokenizer cannot be loaded; the message names it and why."""


class ParamsMismatchError(LoadError):
  """A checkpoint's saved parameters are not the model of its config (a config change, not damage:
  no older step of the run is tried)."""


@dataclasses.dataclass(frozen=True)
class CheckpointRef:
  path: str                 # the directory as resolved (a step directory or a converted checkpoint)
  kind: str                 # "step" | "converted"
  step: Optional[int]       # training step (None for a converted checkpoint)
  run: str                  # the workdir (or the converted directory)
  config: Optional[dict]    # the run's config.json (experiment config, or {"model": ...}); None: none
  # The run's older steps, tried newest first when this one does not restore: set when the step was
  # resolved as a workdir's latest (not for a step or a converted checkpoint named explicitly).
  fallback: tuple[int, ...] = dataclasses.field(default=(), compare=False)

  @property
  def config_path(self) -> str:
    return storage.join(self.run, CONFIG_FILE)


def _read_json(path: str) -> Optional[dict]:
  """The JSON file `path`, or None when there is none; LoadError when it is not JSON."""
  if not storage.isfile(path):
    return None
  try:
    return json.loads(storage.read_text(path))
  except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
    raise LoadError(f"{path} is not valid JSON ({json_errors.message(e)}); a training workdir or a "
                    "converted checkpoint writes it") from None


def _read_config(directory: str) -> Optional[dict]:
  """<directory>/config.json, or None when there is none; LoadError when it is not a config."""
  config = _read_json(storage.join(directory, CONFIG_FILE))
  if config is not None and (not isinstance(config, dict)
                             or not isinstance(config.get("model"), dict)):
    raise LoadError(f"{storage.join(directory, CONFIG_FILE)} has no 'model' section")
  return config


def read_checkpoint_config(checkpoint: str) -> Optional[dict]:
  """The config.json of a checkpoint directory or of its parent (a workdir's `checkpoints/`) as
  it is, or None when neither has one; LoadError when it is not JSON."""
  for d in (checkpoint, storage.dirname(storage.normpath(checkpoint))):
    config = _read_json(storage.join(d, CONFIG_FILE))
    if config is not None:
      return config
  return None


def resolve_checkpoint(path: str) -> CheckpointRef:
  """The checkpoint a directory names (module docstring); LoadError when it names none. A
  workdir's incomplete newer steps are skipped with a warning naming them (as a resume does); a
  step named explicitly that is incomplete is an error."""
  from umoe_jax.train.checkpoint import CHECKPOINT_DIR, complete_steps

  path = storage.abspath(path)
  if storage.isfile(path):
    raise LoadError(f"checkpoint {path!r} is a file; pass the directory (a training workdir, one of "
                    "its checkpoints/<step>, or a converted checkpoint)")
  if not storage.isdir(path):
    raise LoadError(f"checkpoint {path!r}: no such directory")
  workdir = finetune_workdir(path)
  if workdir is not None:  # else "unknown key model.head_dropout" of its fine-tuning config
    raise LoadError(f"checkpoint {finetune_message(path, workdir)}")
  if storage.isdir(storage.join(path, "params")):
    return CheckpointRef(path, "converted", None, path, _read_config(path))
  name = storage.basename(path)
  parent = storage.dirname(path)
  if name.isdigit() and (storage.isdir(storage.join(path, "state"))
                         or storage.basename(parent) == CHECKPOINT_DIR):
    _check_named_step_complete(parent, int(name))
    workdir = storage.dirname(parent)
    return CheckpointRef(path, "step", int(name), workdir, _read_config(workdir))
  ckpt_dir = path if name == CHECKPOINT_DIR else storage.join(path, CHECKPOINT_DIR)
  steps = complete_steps(ckpt_dir)
  if not steps:
    raise LoadError(f"checkpoint {path!r} holds no parameters: expected params/ (a converted "
                    "checkpoint), checkpoints/<step>/ with a complete step (a training workdir), or "
                    "a <workdir>/checkpoints/<step> directory")
  latest = _latest_complete_step(ckpt_dir, steps)
  return dataclasses.replace(resolve_checkpoint(storage.join(ckpt_dir, str(latest))),
                             fallback=tuple(s for s in reversed(steps) if s < latest))


def _check_named_step_complete(ckpt_dir: str, step: int) -> None:
  """LoadError naming step `step` of `ckpt_dir`, asked for by its directory, when it is incomplete:
  the step asked for, or none (no fallback to another step)."""
  from umoe_jax.train.checkpoint import IncompleteStepError, step_state_shapes
  try:
    step_state_shapes(ckpt_dir, step)
  except IncompleteStepError as e:
    raise LoadError(f"checkpoint step {step} cannot be loaded: {e}; pass the workdir "
                    f"{storage.dirname(ckpt_dir)} for its latest complete step") from None


def _latest_complete_step(ckpt_dir: str, steps: list[int]) -> int:
  """The newest of `steps` (numbered directories of `ckpt_dir`) whose files are complete
  (`step_state_shapes`, the test a resume applies); a warning names each newer one skipped and
  why. LoadError naming `ckpt_dir` when none is complete."""
  from absl import logging

  from umoe_jax.train.checkpoint import IncompleteStepError, step_state_shapes
  skipped = []
  for step in reversed(steps):
    try:
      step_state_shapes(ckpt_dir, step)
    except IncompleteStepError as e:
      logging.warning("skipping checkpoint step %d: %s; trying the previous step", step, e)
      skipped.append(f"step {step}: {e}")
      continue
    return step
  raise LoadError(f"no complete checkpoint step in {ckpt_dir} ({'; '.join(skipped)})")


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  """{"a.b.c": leaf} of a nested dict."""
  if isinstance(tree, dict):
    out = {}
    for k, v in tree.items():
      out.update(flatten(v, f"{prefix}{k}."))
    return out
  return {prefix[:-1]: tree}


def _saved_param_shapes(state_dir: str) -> Optional[dict[str, tuple]]:
  """{parameter path: shape} from a step's Orbax metadata, or None if it cannot be read so."""
  import orbax.checkpoint as ocp
  from etils import epath
  try:  # the handler's metadata: the Checkpointer's also looks for step metadata (and warns)
    meta = ocp.PyTreeCheckpointHandler().metadata(epath.Path(state_dir))
    tree = getattr(meta, "tree", meta)
    return {k: tuple(v.shape) for k, v in flatten(dict(tree["params"])).items()}
  except Exception:  # pylint: disable=broad-except  (another Orbax layout: the restore decides)
    return None


def _check_saved_shapes(ref: CheckpointRef, target: Any) -> None:
  """Compares a step's saved parameter shapes with the model's before reading any array: a
  config.json that does not describe its checkpoint gets an error naming the parameter."""
  saved = _saved_param_shapes(storage.join(ref.path, "state"))
  if saved is None:
    return
  want = {k: tuple(v.shape) for k, v in flatten(target).items()}
  for k in sorted(set(want) | set(saved)):
    if saved.get(k) != want.get(k):
      raise ParamsMismatchError(
          f"cannot read the parameters of checkpoint {ref.path} as the model of its config: "
          f"parameter {k} is {saved.get(k) or 'missing'} in the checkpoint, "
          f"{want.get(k) or 'absent'} in the model")


def load_checkpoint_params(ref: CheckpointRef, abstract_params: Any) -> tuple[CheckpointRef, Any]:
  """(the step loaded, its parameters): `load_params` of `ref`, or, when it cannot be read and
  `ref` is a workdir's latest step (`ref.fallback`), of the newest older step that can, as a resume
  does (`checkpoint.restore_newest`: a warning names each step that fails and why). LoadError when
  none can, listing each step's failure; a step named explicitly has no fallback (its own error).
  ParamsMismatchError (a config that is not the checkpoint's model) stops at once."""
  if not ref.fallback:
    return ref, load_params(ref, abstract_params)
  from absl import logging

  from umoe_jax.train.checkpoint import failures_text, restore_newest

  ckpt_dir = storage.dirname(ref.path)
  refs = {ref.step: ref}

  def restore(step: int) -> Any:
    if step not in refs:  # an older step: complete (its metadata) before it is read
      refs[step] = resolve_checkpoint(storage.join(ckpt_dir, str(step)))
    return load_params(refs[step], abstract_params)

  params, step, failures = restore_newest([ref.step, *ref.fallback], restore, ckpt_dir,
                                          stop=(ParamsMismatchError,))
  if step is None:
    raise LoadError(f"no checkpoint step in {ckpt_dir} can be loaded "
                    f"({failures_text(failures, 400)})")
  if failures:
    logging.warning("loaded checkpoint step %d instead of the newer step(s) %s, which cannot be "
                    "read", step, [s for s, _ in failures])
  return refs[step], params


def load_params(ref: CheckpointRef, abstract_params: Any) -> Any:
  """The parameters of `ref` (pure dict on the first device) for the model whose abstract
  parameters (nnx.State of ShapeDtypeStructs, `state.model_parts(cfg).abstract_params`) are given:
  that checkpoint or a LoadError naming it (`load_checkpoint_params` falls back to older steps)."""
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
        storage.join(ref.path, "state"), args=ocp.args.PyTreeRestore(
            item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
            partial_restore=True))
    return restored["params"]
  except LoadError:
    raise
  except Exception as e:  # pylint: disable=broad-except  (any unreadable or mismatched file)
    cause = _innermost_cause(e)
    text = " ".join(str(cause).split())  # Orbax / TensorStore messages span lines
    raise LoadError(f"cannot read the parameters of checkpoint {ref.path} (damaged files, or not "
                    f"the model of its config): {type(cause).__name__}: {text[:300]}") from e


def _innermost_cause(error: BaseException) -> BaseException:
  """The first exception of the `raise ... from` chain. Orbax wraps TensorStore's error, which
  names the array and file ('OUT_OF_RANGE: Error reading "params.embed/0" in OCDBT database at
  local file ...'), in one that says only "See full TensorStore details" and dumps its spec."""
  seen = {id(error)}
  while error.__cause__ is not None and id(error.__cause__) not in seen:
    error = error.__cause__
    seen.add(id(error))
  return error


def check_seed(seed: int) -> None:
  """LoadError naming a --seed outside int64: nnx.Rngs and jax.random.key take an int64, and raise
  an OverflowError traceback otherwise."""
  if not -2**63 <= seed < 2**63:
    raise LoadError(f"--seed={seed} is outside the int64 range [-2**63, 2**63)")


def load_model(checkpoint: Optional[str] = None, config: Any = None, *, seed: int = 0,
               compute_dtype: Optional[str] = None):
  """(CausalLM, model ConfigDict, CheckpointRef or None) (module docstring).

  `config`: an experiment ConfigDict (with `.model`) or a model section; used when the checkpoint
  has no config.json, or without a checkpoint. `compute_dtype` overrides the config's.
  """
  import ml_collections
  from flax import nnx

  from umoe_jax.config import ConfigError, model_config
  from umoe_jax.model.lm import CausalLM
  from umoe_jax.train import state as state_lib

  if checkpoint is None and config is None:
    raise LoadError("give --checkpoint=DIR, or --config=configs/<model>.py for random parameters")
  ref = resolve_checkpoint(checkpoint) if checkpoint is not None else None
  if ref is not None and ref.config is not None:
    section = ref.config["model"]
  elif config is not None:
    section = config.model.to_dict() if hasattr(config, "model") else dict(config)
  else:
    raise LoadError(f"checkpoint {ref.path!r} has no config.json (expected {ref.config_path}): "
                    "pass --config=configs/<model>.py with its architecture")
  section = ml_collections.ConfigDict(section)
  if compute_dtype:
    section.compute_dtype = compute_dtype
  try:
    cfg = model_config(section)
  except ConfigError as e:
    raise LoadError(f"the model config of {ref.config_path if ref else 'the config'} is invalid: "
                    f"{e}") from None
  if ref is None:
    check_seed(seed)
    return CausalLM(cfg, rngs=nnx.Rngs(params=seed)), section, None
  parts = state_lib.model_parts(cfg)
  ref, params = load_checkpoint_params(ref, parts.abstract_params)
  state = parts.abstract_params  # a fresh State: filled in place with the arrays
  nnx.replace_by_pure_dict(state, params)
  return nnx.merge(parts.graphdef, state), section, ref


def tokenizer_spec(flag: Optional[str], saved: Optional[dict], config: Any = None
                   ) -> tuple[str, str]:
  """(tokenizer spec, eos token): the flag, else the data.tokenizer of the checkpoint's config.json
  (`saved`) or of the experiment ConfigDict `config`, else "byte"."""
  if flag:
    return flag, ""
  for source in (saved, config.to_dict() if hasattr(config, "to_dict") else None):
    data = (source or {}).get("data") or {}
    if data.get("tokenizer"):
      return data["tokenizer"], data.get("eos_token", "") or ""
  return "byte", ""


def check_tokenizer_fits_checkpoint(tok: Any, spec: str, vocab_size: int,
                                    ref: CheckpointRef) -> None:
  """LoadError when the tokenizer's ids could index past the embedding table of the checkpoint's
  model. Its vocabulary is fixed by the checkpoint, so the fix is the tokenizer it was trained
  with (--tokenizer), not a larger model.vocab_size."""
  if tok.vocab_size <= vocab_size:
    return
  raise LoadError(f"tokenizer {spec!r} has {tok.vocab_size} tokens, but the model of checkpoint "
                  f"{ref.path} has vocab_size {vocab_size} (fixed by its parameters): pass "
                  f"--tokenizer=<the tokenizer.json of that model> (at most {vocab_size} tokens)")


def load_model_and_tokenizer(checkpoint: Optional[str] = None, config: Any = None, *,
                             tokenizer: Optional[str] = None, seed: int = 0,
                             compute_dtype: Optional[str] = "float32"):
  """(CausalLM, tokenizer, info {"checkpoint", "step", "tokenizer", "model"}) (module docstring)."""
  from umoe_jax.data.tokenizer import check_vocab, make_tokenizer

  model, section, ref = load_model(checkpoint, config, seed=seed,
                                   compute_dtype=compute_dtype or None)
  spec, eos_token = tokenizer_spec(tokenizer, ref.config if ref else None, config)
  try:
    tok = make_tokenizer(spec, eos_token)
  except storage.StorageError:
    raise  # the store failed, not the tokenizer: its line and hint (stdout_errors)
  except (ValueError, OSError) as e:
    raise LoadError(str(e)) from None
  if ref is not None:
    check_tokenizer_fits_checkpoint(tok, spec, section.vocab_size, ref)
  try:
    check_vocab(tok, section.vocab_size)  # random parameters: the config's vocab_size can change
  except ValueError as e:
    raise LoadError(str(e)) from None
  info = {"checkpoint": checkpoint, "step": ref.step if ref else None, "tokenizer": spec,
          "model": {k: section.get(k) for k in ("vocab_size", "d_model", "n_layers", "max_seq_len",
                                                "compute_dtype")}}
  return model, tok, info
