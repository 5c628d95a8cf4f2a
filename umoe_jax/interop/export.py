"""Export a model of this project to another implementation's checkpoint directory.

  python -m umoe_jax.interop export --checkpoint=DIR [--step=N] --out=DIR --format=official|hf
      [--dtype=float32|bfloat16] [--overwrite]

--checkpoint is what `umoe_jax.load` reads: a training workdir (its latest complete step, or
--step=N), one of its checkpoints/<step> directories, or a converted checkpoint; or a fine-tuning
workdir, whose language-model backbone is exported (`finetuned`: the classification head is left
out). Sharded and expert-parallel checkpoints are gathered on the host (they restore onto one device).

  official   config.json + model.safetensors in the layout of the official UMoE code
             (`official_export`; importing it gives back the same parameters bit for bit)
  hf         a Hugging Face transformers directory with this project's own PyTorch modeling code
             (`hf_export`): AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)

The tokenizer file the checkpoint was trained with (its config's data.tokenizer) is copied beside;
the byte tokenizer has no file (the hf format writes an equivalent tokenizer.json). The export is
written to a temporary directory beside --out and moved into place at the end, so an interrupted
export leaves --out as it was. Bad input is one `error:` line naming it.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from typing import Optional

from umoe_jax import storage
from umoe_jax.interop.tokenizer_files import copy_tokenizer

FORMATS = ("official", "hf")
WEIGHT_DTYPES = ("float32", "bfloat16")


class ExportError(ValueError):
  """Bad export input or an output it cannot write; the message names it."""


def _step_dir(checkpoint: str, step: Optional[int]) -> str:
  if step is None:
    return checkpoint
  from umoe_jax.train.checkpoint import CHECKPOINT_DIR
  base = checkpoint.rstrip("/")
  ckpt_dir = base if os.path.basename(base) == CHECKPOINT_DIR else os.path.join(base, CHECKPOINT_DIR)
  path = os.path.join(ckpt_dir, str(step))
  if not os.path.isdir(path):
    have = sorted(int(n) for n in os.listdir(ckpt_dir) if n.isdigit()) if os.path.isdir(ckpt_dir) else []
    raise ExportError(f"--step={step}: no step directory {path} (steps there: {have or 'none'})")
  return path


def load_source(checkpoint: str, step: Optional[int] = None):
  """(CausalLM in float32, model ConfigDict, CheckpointRef, tokenizer spec, tokenizer, note) of a
  checkpoint (note: what a fine-tuning workdir's export leaves out, else ""); `umoe_jax.load.LoadError`
  (a ValueError) naming what is wrong: no config.json, an incomplete step, a tokenizer whose ids do
  not fit the model's vocabulary."""
  from umoe_jax import load
  from umoe_jax.data.tokenizer import make_tokenizer

  workdir = None if storage.is_url(checkpoint) else load.finetune_workdir(checkpoint)
  if workdir is not None:   # a classifier: its backbone (`finetuned`)
    from umoe_jax.interop.finetuned import load_backbone
    model, section, ref, spec, eos, note = load_backbone(checkpoint, workdir, step)
  else:
    try:
      model, section, ref = load.load_model(_step_dir(checkpoint, step), compute_dtype="float32")
    except load.LoadError as e:   # its advice, --config, is not a flag of export
      text, hint = str(e), ": pass --config="
      if "has no config.json" not in text or hint not in text:
        raise
      raise load.LoadError(text.split(hint)[0] + ": the export's architecture comes from it"
                           ) from None
    spec, eos = load.tokenizer_spec(None, ref.config)
    note = ""
  try:
    tok = make_tokenizer(spec, eos)
  except storage.StorageError:
    raise  # the store failed, not the tokenizer: its line and hint (stdout_errors)
  except (ValueError, OSError) as e:
    raise load.LoadError(f"the tokenizer of checkpoint {ref.path} ({spec!r}): {e}") from None
  load.check_tokenizer_fits_checkpoint(tok, spec, section.vocab_size, ref)
  return model, section, ref, spec, tok, note


def flat_params(model, dtype: str = "float32") -> dict[tuple, "np.ndarray"]:
  """{path tuple: numpy array} of the model's parameters, cast to `dtype`."""
  import ml_dtypes
  import numpy as np
  from flax import nnx

  want = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float32)
  return {tuple(p): np.asarray(v.get_value()).astype(want)
          for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def write_official(model, section, spec: str, out_dir: str, *, dtype: str) -> str:
  """config.json + model.safetensors (+ tokenizer files) of the official format; a summary line."""
  import json

  from umoe_jax.interop.official_export import official_config_json, official_state_dict
  from umoe_jax.interop.tensor_files import write_safetensors

  cj = official_config_json(section)
  cj["torch_dtype"] = dtype
  tensors = official_state_dict(flat_params(model, dtype), section)
  write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors, metadata={"format": "pt"})
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(cj, f, indent=2, sort_keys=True)
  copied = copy_tokenizer(spec, out_dir)
  return f"{len(tensors)} tensors" + (f", {', '.join(copied)}" if copied else ", byte tokenizer (no file)")


def _check_out(out: str, overwrite: bool) -> str:
  if storage.is_url(out):
    raise ExportError(f"--out={out!r}: export writes a local directory")
  out = os.path.abspath(storage.expand_user(out, "--out"))
  if os.path.exists(out) and not os.path.isdir(out):
    raise ExportError(f"--out={out!r} is a file, not a directory")
  if os.path.isdir(out) and os.listdir(out) and not overwrite:
    raise ExportError(f"--out={out!r} exists and is not empty; pass --overwrite to replace it")
  parent = os.path.dirname(out)
  try:
    os.makedirs(parent, exist_ok=True)
  except OSError as e:
    raise ExportError(f"--out={out!r}: cannot create {parent!r} ({e.strerror or e})") from None
  if not os.access(parent, os.W_OK):
    raise ExportError(f"--out={out!r}: {parent!r} is not writable")
  return out


def _move_into_place(tmp: str, out: str) -> None:
  """Replaces `out` (absent, empty, or --overwrite) by the finished `tmp` directory."""
  old = None
  if os.path.exists(out):
    old = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.old-", dir=os.path.dirname(out))
    os.rmdir(old)
    os.rename(out, old)
  os.rename(tmp, out)
  if old is not None:
    shutil.rmtree(old, ignore_errors=True)


def export(checkpoint: str, out: str, fmt: str, *, step: Optional[int] = None,
           dtype: str = "float32", overwrite: bool = False) -> str:
  """Exports a checkpoint (module docstring); returns the summary line the CLI prints."""
  if fmt not in FORMATS:
    raise ExportError(f"--format={fmt!r}; valid: {', '.join(FORMATS)}")
  if dtype not in WEIGHT_DTYPES:
    raise ExportError(f"--dtype={dtype!r}; valid: {', '.join(WEIGHT_DTYPES)}")
  out = _check_out(out, overwrite)
  model, section, ref, spec, tok, note = load_source(checkpoint, step)
  if fmt == "official":   # refuse before any file is written
    from umoe_jax.interop.official_export import official_config_json
    official_config_json(section)
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=os.path.dirname(out))
  try:
    if fmt == "official":
      what = write_official(model, section, spec, tmp, dtype=dtype)
    else:
      from umoe_jax.interop.hf_export import write_hf
      what = write_hf(model, section, spec, tok, tmp, dtype=dtype)
    _move_into_place(tmp, out)
  finally:
    if os.path.exists(tmp):
      shutil.rmtree(tmp, ignore_errors=True)
  where = f"step {ref.step}" if ref.step is not None else "converted checkpoint"
  where += f"; {note}" if note else ""
  return f"exported {ref.path} ({where}) as {fmt} ({dtype}; {what}) -> {out}"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m umoe_jax.interop export",
      description="Export a checkpoint of this project as the official UMoE format or as a Hugging "
                  "Face transformers directory.")
  parser.add_argument("--checkpoint", required=True, help="training workdir, checkpoints/<step> "
                      "directory, converted checkpoint, or fine-tuning workdir (its backbone)")
  parser.add_argument("--step", type=int, default=None, help="the workdir's step to export "
                      "(default: its latest complete step; a fine-tuning workdir's best)")
  parser.add_argument("--out", required=True, help="output directory (absent or empty, or --overwrite)")
  parser.add_argument("--format", required=True, choices=FORMATS, help="official | hf")
  parser.add_argument("--dtype", default="float32", choices=WEIGHT_DTYPES, help="weight dtype")
  parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
  args = parser.parse_args(argv)
  from umoe_jax.config import ConfigError
  from umoe_jax.load import LoadError
  try:
    line = export(args.checkpoint, args.out, args.format, step=args.step, dtype=args.dtype,
                  overwrite=args.overwrite)
  except storage.StorageError:
    raise  # its line and hint: stdout_errors, every command's handler of a failing store
  except (ExportError, LoadError, ConfigError, FileNotFoundError, ImportError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(line)
  return 0
