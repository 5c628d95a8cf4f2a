"""`--format=hf`: a Hugging Face transformers directory of a model of this project.

  write_hf(model, model_section, tokenizer_spec, tokenizer, out_dir, *, dtype) -> summary
  hf_config_dict(model_section) -> the `umoe` entry of the exported config.json

The directory holds config.json (`auto_map` to the modeling code beside it), model.safetensors,
generation_config.json, the tokenizer (tokenizer.json + tokenizer_config.json; the byte tokenizer
as an equivalent byte-level tokenizer.json) and the files of `umoe_jax/interop/hf/`, this project's
PyTorch inference code. The PyTorch model names its parameters as the JAX model does, so each tensor
is found by walking the JAX model along its name (a module shared between layers or sub-layers,
e.g. `moe.share_across_layers`, is written under every name that reaches it). Needs torch and
transformers (requirements-export.txt). Expert choice is refused: it picks among later tokens.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np

from umoe_jax.config import ConfigError, model_config
from umoe_jax.interop.tokenizer_files import copy_tokenizer

HF_DIR = os.path.join(os.path.dirname(__file__), "hf")
MODELING_FILES = ("configuration_umoe.py", "modeling_umoe.py", "umoe_decoder.py", "umoe_attention.py",
                  "umoe_routers.py", "umoe_layers.py")


def hf_config_dict(section) -> dict:
  """The model section as plain JSON, with the routed sub-layers' resolved routers added as
  "attention_router" / "ffn_router"; ConfigError for what the PyTorch code cannot run."""
  cfg = model_config(section)
  out = dataclasses.asdict(cfg)
  out.pop("matmul_precision")  # training's (train.precision): the export runs without FP8
  for s in cfg.routed_sublayers:
    r = cfg.router_for(s)
    if r.selection == "expert_choice":
      raise ConfigError(f"cannot export to hf: {cfg.router_key(s, 'selection')}='expert_choice' "
                        "picks each expert's tokens among the whole batch, later tokens included, "
                        "so it cannot generate causally")
    out[f"{s}_router"] = dataclasses.asdict(r)
  return out


def _resolve(model, name: str) -> np.ndarray:
  """The JAX parameter a PyTorch parameter name reaches ("layers.0.ffn.mlp.up.kernel")."""
  node = model
  for part in name.split("."):
    node = node[int(part)] if part.isdigit() else getattr(node, part)
  return np.asarray(node.get_value())


def byte_tokenizer_json(path: str) -> None:
  """A tokenizer.json giving the ids of `umoe_jax.data.tokenizer.ByteTokenizer`: byte b -> id b and
  EOS "<|endoftext|>" = 256 (a byte-level BPE without merges; the literal text "<|endoftext|>" is
  its EOS here, bytes there)."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers

  # ByteLevel's byte -> character map (GPT-2's): printable Latin-1 bytes are themselves, the others
  # take the characters from U+0100 on, in byte order.
  printable = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
  others = iter(range(256, 512))
  vocab = {(chr(b) if b in printable else chr(next(others))): b for b in range(256)}
  tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens(["<|endoftext|>"])
  tok.save(path)


def _write_tokenizer(spec: str, tok, out_dir: str) -> list[str]:
  copied = copy_tokenizer(spec, out_dir)
  if not copied:
    byte_tokenizer_json(os.path.join(out_dir, "tokenizer.json"))
    copied = ["tokenizer.json (bytes)"]
  if "tokenizer_config.json" not in copied:
    eos = None
    with open(os.path.join(out_dir, "tokenizer.json")) as f:
      for added in json.load(f).get("added_tokens", []):
        if added["id"] == tok.eos_id:
          eos = added["content"]
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
      json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos,
                 "model_max_length": None, "add_bos_token": False, "add_eos_token": False}, f, indent=2)
  return copied


def write_hf(model, section, spec: str, tok, out_dir: str, *, dtype: str) -> str:
  """Writes the directory (module docstring) into out_dir; returns a summary. Needs torch (the
  PyTorch decoder gives the parameter names and shapes), not transformers."""
  import ml_dtypes
  import torch

  from umoe_jax.interop.hf.umoe_decoder import Decoder
  from umoe_jax.interop.tensor_files import write_safetensors

  umoe = hf_config_dict(section)
  with torch.device("meta"):
    shapes = {k: tuple(v.shape) for k, v in Decoder(umoe).state_dict().items()}
  want = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float32)
  tensors = {}
  for name, shape in shapes.items():
    value = _resolve(model, name)
    if tuple(value.shape) != shape:
      raise ValueError(f"hf export: {name} is {value.shape} in the JAX model, {shape} in the "
                       "PyTorch code")
    tensors[f"model.{name}"] = value.astype(want)
  write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors, metadata={"format": "pt"})
  eos = int(tok.eos_id)
  config = {"architectures": ["UMoEForCausalLM"], "model_type": "umoe_jax",
            "auto_map": {"AutoConfig": "configuration_umoe.UMoEConfig",
                         "AutoModelForCausalLM": "modeling_umoe.UMoEForCausalLM"},
            "umoe": umoe, "vocab_size": umoe["vocab_size"], "hidden_size": umoe["d_model"],
            "num_hidden_layers": umoe["n_layers"], "max_position_embeddings": umoe["max_seq_len"],
            "bos_token_id": None, "eos_token_id": eos, "pad_token_id": eos,
            "tie_word_embeddings": False, "torch_dtype": dtype, "dtype": dtype}
  generation = {"eos_token_id": eos, "pad_token_id": eos, "do_sample": False}
  for name, data in (("config.json", config), ("generation_config.json", generation)):
    with open(os.path.join(out_dir, name), "w") as f:
      json.dump(data, f, indent=2, sort_keys=True)
  for name in MODELING_FILES:
    shutil.copy(os.path.join(HF_DIR, name), os.path.join(out_dir, name))
  copied = _write_tokenizer(spec, tok, out_dir)
  return f"{len(tensors)} tensors, {', '.join(copied)}"
