"""Reading the tensors of a Hugging Face-style checkpoint, as the official UMoE code saves them.

  load_official_state_dict(path) -> {name: np.ndarray}
      `path` is a checkpoint directory, a .safetensors / .bin file or a shard index .json; bfloat16
      tensors come back as ml_dtypes.bfloat16 arrays
  read_safetensors(path) / read_torch_bin(path) -> {name: np.ndarray}   one file

Formats: `model.safetensors`, shards `model-0000i-of-0000n.safetensors` listed by
`model.safetensors.index.json`, or `pytorch_model.bin` (torch.save of a state dict, which needs
PyTorch; safetensors files are read with numpy alone, memory-mapped). A malformed safetensors file,
an unknown file type or an index listing tensors its shards lack raises `StateDictError` naming the file.
"""
from __future__ import annotations

import glob
import json
import os
import struct
from typing import Mapping

import numpy as np

from umoe_jax import json_errors


class StateDictError(ValueError):
  """An official state dict cannot be read or does not fit the config: an unreadable file, or
  missing, unexpected or mis-shaped tensors."""


_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64,
              "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def _st_dtype(name: str, path: str, tensor: str):
  if name == "BF16":
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)
  if name not in _ST_DTYPES:
    raise StateDictError(f"{path}: tensor {tensor} has unsupported dtype {name}")
  return np.dtype(_ST_DTYPES[name])


def read_safetensors(path: str) -> dict[str, np.ndarray]:
  """Tensors of one .safetensors file as (memory-mapped, read-only) numpy arrays; no torch needed."""
  with open(path, "rb") as f:
    head = f.read(8)
    n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
    try:
      if not 0 < n <= os.path.getsize(path) - 8:
        raise ValueError(f"header length {n}")
      header = json.loads(f.read(n))
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, a bad length
      raise StateDictError(f"{path} is not a safetensors file, or is truncated ({e})") from None
  mm = np.memmap(path, dtype=np.uint8, mode="r")
  out = {}
  for name, info in header.items():
    if name == "__metadata__":
      continue
    dtype = _st_dtype(info["dtype"], path, name)
    start, end = info["data_offsets"]
    buf = mm[8 + n + start: 8 + n + end]
    out[name] = buf.view(dtype).reshape(info["shape"])
  return out


def torch_to_numpy(t) -> np.ndarray:
  """A torch tensor (any shape) as a numpy array of its shape on the CPU; bfloat16 reinterpreted
  bit for bit as ml_dtypes.bfloat16 (torch's .numpy() refuses bfloat16)."""
  import torch
  t = t.detach().cpu()
  if t.dtype == torch.bfloat16:
    import ml_dtypes
    return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
  return t.numpy()


def read_torch_bin(path: str) -> dict[str, np.ndarray]:
  """A `pytorch_model.bin` (torch.save of a state dict); needs torch."""
  try:
    import torch
  except ImportError as e:
    raise ImportError(f"reading {path} needs PyTorch (pip install torch); .safetensors checkpoints "
                      "do not") from e
  obj = torch.load(path, map_location="cpu", weights_only=True)
  for wrapper in ("module", "state_dict", "model"):
    if isinstance(obj, Mapping) and wrapper in obj and isinstance(obj[wrapper], Mapping):
      obj = obj[wrapper]
  if not isinstance(obj, Mapping):
    raise StateDictError(f"{path}: expected a state dict, got {type(obj).__name__}")
  return {k: torch_to_numpy(v) for k, v in obj.items() if hasattr(v, "detach")}


def _read_index(path: str) -> dict[str, np.ndarray]:
  """The tensors of the shards a Hugging Face index ({"weight_map": {tensor: shard file}}) names."""
  try:
    with open(path) as f:
      index = json.load(f)
  except json.JSONDecodeError as e:
    raise StateDictError(f"{path}: not a JSON shard index (line {json_errors.position(e)[0]}: "
                         f"{e.msg})") from None
  weight_map = index.get("weight_map") if isinstance(index, dict) else None
  if not isinstance(weight_map, dict):
    raise StateDictError(f"{path}: not a shard index (no \"weight_map\" of tensor -> shard file; "
                         "pass the checkpoint directory, or its model.safetensors / index .json)")
  folder = os.path.dirname(path)
  out = {}
  for shard in sorted(set(weight_map.values())):
    out.update(_read_file(os.path.join(folder, shard)))
  missing = sorted(set(weight_map) - set(out))
  if missing:
    raise StateDictError(f"{path}: tensors listed in the index are absent from their shards: {missing[:5]}")
  return out


def _read_file(path: str) -> dict[str, np.ndarray]:
  if path.endswith(".safetensors"):
    return read_safetensors(path)
  if path.endswith(".json"):
    return _read_index(path)
  if path.endswith((".bin", ".pt", ".pth")):
    return read_torch_bin(path)
  raise StateDictError(f"{path}: unknown checkpoint file type (want .safetensors, .bin or an index .json)")


_DIR_CANDIDATES = ("model.safetensors.index.json", "model.safetensors",
                   "pytorch_model.bin.index.json", "pytorch_model.bin")


def load_official_state_dict(path: str) -> dict[str, np.ndarray]:
  """The official state dict {name: array} from a checkpoint directory or one file.

  A directory is searched for, in order: model.safetensors.index.json (+ shards), model.safetensors,
  pytorch_model.bin.index.json (+ shards), pytorch_model.bin; failing those, a single *.safetensors.
  `.bin` files need PyTorch (an ImportError says so). DeepSpeed's `module.` name prefix is stripped.
  """
  path = os.fspath(path)
  if os.path.isdir(path):
    for name in _DIR_CANDIDATES:
      if os.path.isfile(os.path.join(path, name)):
        sd = _read_file(os.path.join(path, name))
        break
    else:
      singles = sorted(glob.glob(os.path.join(path, "*.safetensors")))
      if len(singles) != 1:
        raise FileNotFoundError(f"{path}: no official checkpoint found (looked for "
                                f"{', '.join(_DIR_CANDIDATES)} or a single *.safetensors)")
      sd = read_safetensors(singles[0])
  elif os.path.isfile(path):
    sd = _read_file(path)
  else:
    raise FileNotFoundError(f"{path}: no such checkpoint file or directory")
  if sd and all(k.startswith("module.") for k in sd):
    sd = {k[len("module."):]: v for k, v in sd.items()}
  return sd

