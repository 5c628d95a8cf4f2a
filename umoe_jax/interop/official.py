"""Import checkpoints of the official PyTorch UMoE implementation (github.com/ysngki/UMoE).

The official code is a fork of Hugging Face DeepSeek-V2 (`model_type: "PremixMoe_v2"`,
`DeepseekV2ForCausalLM`, `model_libs/src_code/modeling_deepseek.py`). Its checkpoints are Hugging Face
directories: `config.json` plus `model.safetensors` (or shards `model-0000i-of-0000n.safetensors` with
`model.safetensors.index.json`, or `pytorch_model.bin`). This module turns one into a `CausalLM` of this
project whose logits equal the official model's (float32; tested to a relative error < 1e-4 on golden
fixtures made by `tools/make_official_fixtures.py`). The pieces (their public names are re-exported here):
  official_config    config.json -> our `model` ConfigDict (which official options are refused, and why)
  checkpoint_files   reading the tensors: safetensors, sharded index, pytorch_model.bin
  official_weights   official tensor names and shapes -> our parameters (the mapping table)

API
  config_from_official(config_json, *, compute_dtype="float32", gmm_backend="auto") -> ConfigDict
      the `model` section of our config; an official option this project cannot express raises
      `OfficialConfigError` naming the field and its value
  expert_weight_layout(config_json) -> "unsloth" | "megatron"  (official_weights: "Grouped weights")
  load_official_config(path) -> dict
  load_official_state_dict(path) -> {name: np.ndarray}   (a directory, a .safetensors / .bin file or an
      index .json; bfloat16 tensors come back as ml_dtypes.bfloat16)
  convert_state_dict(state_dict, model_cfg, *, expert_layout="unsloth") -> nnx.State of parameters
      (a missing, unexpected or mis-shaped tensor raises `StateDictError` naming it and the shapes)
  import_official(path, **config_kw) -> (CausalLM, ConfigDict)
  save_converted(model, model_cfg, output_dir, *, source=None) / load_converted(output_dir)
      -> (CausalLM, ConfigDict)

CLI
  python -m umoe_jax.interop.official --checkpoint=DIR --output=DIR [--compute_dtype=float32]

Saved layout (what `--output` / `save_converted` writes; `load_converted` reads it back)
  OUTPUT/config.json   {"model": <the `model` ConfigDict as JSON>,
                        "source": {"checkpoint": ..., "expert_layout": ..., "official_config": {...}}}
  OUTPUT/params/       an Orbax `StandardCheckpointer` checkpoint of `nnx.state(model, nnx.Param)`
                       (float32); restore it with `StandardCheckpointer().restore(path, abstract)` where
                       `abstract = nnx.state(abstract_model(model_config(cfg["model"])), nnx.Param)`.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import sys
from typing import Any, Iterator, Mapping, Optional

import numpy as np

from umoe_jax import storage
from umoe_jax.output import check_output_path
from umoe_jax.config import ConfigError, model_config
from umoe_jax.interop.checkpoint_files import (
    StateDictError, load_official_state_dict, read_safetensors, read_torch_bin)
from umoe_jax.interop.official_config import (
    EXPERT_LAYOUTS, OFFICIAL_MODEL_TYPE, OfficialConfigError, config_from_official, expert_weight_layout,
    load_official_config)
from umoe_jax.interop.official_weights import convert_state_dict, convert_to_model, model_from_state

__all__ = [
    "EXPERT_LAYOUTS", "OFFICIAL_MODEL_TYPE", "OfficialConfigError", "StateDictError", "config_from_official",
    "convert_state_dict", "expert_weight_layout", "import_official", "load_converted",
    "load_official_config", "load_official_state_dict", "main", "model_from_state", "read_safetensors",
    "read_torch_bin", "save_converted",
]


def import_official(path: str, **config_kw):
  """(CausalLM, model ConfigDict) from an official checkpoint directory (config.json + weights).

  `config_kw` go to `config_from_official` (compute_dtype, param_dtype, gmm_backend).
  """
  config_json = load_official_config(path)
  cfg = config_from_official(config_json, **config_kw)
  model = convert_to_model(load_official_state_dict(path), cfg, expert_weight_layout(config_json))
  return model, cfg


# ----------------------------------------------------------------------------------------------
# Saving / restoring the converted model


def save_converted(model, model_cfg, output_dir: str, *, source: Optional[Mapping[str, Any]] = None) -> str:
  """Writes OUTPUT/config.json and OUTPUT/params (Orbax) as described in the module docstring."""
  import orbax.checkpoint as ocp
  from flax import nnx

  output_dir = storage.abspath(os.fspath(output_dir))  # a local path or a gs:// URL (Orbax)
  storage.makedirs(output_dir)
  params_dir = storage.join(output_dir, "params")
  if storage.exists(params_dir):
    raise FileExistsError(f"{params_dir} exists; choose an empty --output")
  cfg_dict = model_cfg.to_dict() if hasattr(model_cfg, "to_dict") else dataclasses.asdict(model_cfg)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(params_dir, nnx.state(model, nnx.Param))
  checkpointer.wait_until_finished()
  storage.write_text(storage.join(output_dir, "config.json"), json.dumps(
      {"model": cfg_dict, "source": dict(source or {})}, indent=2, sort_keys=True))
  return output_dir


def load_converted(output_dir: str, **model_overrides):
  """(CausalLM, model ConfigDict) from a directory written by `save_converted` / the CLI.

  `model_overrides` replace top-level model keys (e.g. compute_dtype="bfloat16") before building.
  """
  import ml_collections
  import orbax.checkpoint as ocp
  from flax import nnx

  from umoe_jax.model import abstract_model

  output_dir = storage.abspath(os.fspath(output_dir))
  cfg = ml_collections.ConfigDict(json.loads(storage.read_text(
      storage.join(output_dir, "config.json")))["model"])
  for key, value in model_overrides.items():
    cfg[key] = value
  graphdef, abstract = nnx.split(abstract_model(model_config(cfg)))
  restored = ocp.StandardCheckpointer().restore(storage.join(output_dir, "params"), abstract)
  return nnx.merge(graphdef, restored), cfg


# ----------------------------------------------------------------------------------------------
# CLI


class OutputError(ValueError):
  """--output cannot hold the converted checkpoint (a file, or not writable)."""


def _check_output(output: str) -> None:
  """OutputError before the conversion when `output` is a file or cannot be made or written."""
  try:
    check_output_path(output, "--output", directory=True)
  except ValueError as e:
    raise OutputError(str(e)) from None


@contextlib.contextmanager
def _local_copy(path: str) -> Iterator[str]:
  """`path` when local; a URL's checkpoint directory (or config .json) downloaded through
  umoe_jax/storage into a temporary directory (safetensors and torch read local files), removed
  afterwards."""
  if not storage.is_url(path):
    yield path
    return
  tmp = storage.local_temp_dir("umoe-official-")
  try:
    base = storage.expand(path)
    files = [base] if storage.isfile(base) else storage.find_files(base)
    if not files:
      raise FileNotFoundError(f"{path}: no such checkpoint directory or config .json file")
    for url in files:
      rel = storage.basename(url) if url == base else url[len(base) + 1:]
      local = os.path.join(tmp, *rel.split("/"))
      os.makedirs(os.path.dirname(local), exist_ok=True)
      with storage.open(url, "rb") as src, open(local, "wb") as dst:
        shutil.copyfileobj(src, dst, 8 << 20)
    yield os.path.join(tmp, storage.basename(base)) if files == [base] else tmp
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m umoe_jax.interop.official",
      description="Convert an official UMoE (PyTorch, Hugging Face style) checkpoint into this project's "
                  "parameters: OUTPUT/config.json + OUTPUT/params (Orbax).")
  parser.add_argument("--checkpoint", required=True, help="official checkpoint directory (config.json + "
                      "model.safetensors / shards / pytorch_model.bin; a URL is downloaded first)")
  parser.add_argument("--output", required=True, help="output directory (created; params/ must not exist)")
  parser.add_argument("--compute_dtype", default="float32", help="model.compute_dtype of the saved config")
  parser.add_argument("--gmm_backend", default="auto", help="model.gmm_backend of the saved config")
  args = parser.parse_args(argv)
  try:
    with _local_copy(args.checkpoint) as checkpoint:
      config_json = load_official_config(checkpoint)
      layout = expert_weight_layout(config_json)
      if storage.exists(storage.join(args.output, "params")):
        raise FileExistsError(f"{storage.join(args.output, 'params')} exists; choose an empty "
                              "--output")
      _check_output(args.output)
      model, cfg = import_official(checkpoint, compute_dtype=args.compute_dtype,
                                   gmm_backend=args.gmm_backend)
    out = save_converted(model, cfg, args.output, source=dict(
        checkpoint=storage.abspath(args.checkpoint), expert_layout=layout,
        official_config=config_json))
  except (ConfigError, StateDictError, FileNotFoundError, FileExistsError, ImportError,
          OutputError) as e:  # (a StorageError: stdout_errors, every command's handler of it)
    print(f"error: {e}", file=sys.stderr)
    return 2
  import jax
  from flax import nnx
  n = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))
  print(f"converted {args.checkpoint} ({n:,} parameters, {cfg.attention.kind} attention, "
        f"{cfg.ffn.kind} FFN, expert layout {layout}) -> {out}")
  return 0


if __name__ == "__main__":
  from umoe_jax import stdout_errors
  stdout_errors.run_and_exit(main)
