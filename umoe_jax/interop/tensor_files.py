"""Writing safetensors files with numpy alone (the reader is `checkpoint_files.read_safetensors`).

  write_safetensors(path, {name: array}, metadata=None)

float32 / float16 / int arrays are stored as they are; ml_dtypes.bfloat16 arrays as BF16. The file is
written to `path + ".tmp"` and renamed, so a crash never leaves a truncated file under `path`.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Mapping, Optional

import numpy as np

_DTYPE_NAMES = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
                np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.int16): "I16",
                np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8", np.dtype(np.bool_): "BOOL"}


def _dtype_name(a: np.ndarray, name: str) -> str:
  if a.dtype.name == "bfloat16":
    return "BF16"
  if a.dtype not in _DTYPE_NAMES:
    raise ValueError(f"tensor {name}: dtype {a.dtype} has no safetensors name")
  return _DTYPE_NAMES[a.dtype]


def write_safetensors(path: str, tensors: Mapping[str, np.ndarray],
                      metadata: Optional[Mapping[str, str]] = None) -> None:
  """Writes `tensors` (little-endian, C order, sorted by name) as one safetensors file."""
  header: dict = {"__metadata__": dict(metadata)} if metadata else {}
  arrays, offset = [], 0
  for name in sorted(tensors):
    a = np.ascontiguousarray(tensors[name])
    if a.dtype.byteorder == ">":
      a = a.astype(a.dtype.newbyteorder("<"))
    header[name] = {"dtype": _dtype_name(a, name), "shape": list(a.shape),
                    "data_offsets": [offset, offset + a.nbytes]}
    arrays.append(a)
    offset += a.nbytes
  raw = json.dumps(header, separators=(",", ":")).encode()
  raw += b" " * (-len(raw) % 8)        # the data starts 8-byte aligned
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for a in arrays:
      f.write(a.tobytes())
  os.replace(tmp, path)
