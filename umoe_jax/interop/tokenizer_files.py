"""The tokenizer files an export copies beside the weights (both export formats)."""
from __future__ import annotations

import os

from umoe_jax import storage


def copy_tokenizer(spec: str, out_dir: str) -> list[str]:
  """Copies the tokenizer.json `spec` names (and the tokenizer_config.json / special_tokens_map.json
  beside it, if any) into out_dir; the names copied ([] for the byte tokenizer)."""
  if spec in ("", "byte"):
    return []
  path = storage.expand(spec)
  if storage.isdir(path):
    path = storage.join(path, "tokenizer.json")
  copied = []
  folder = storage.dirname(path)
  for name, src in (("tokenizer.json", path),
                    ("tokenizer_config.json", storage.join(folder, "tokenizer_config.json")),
                    ("special_tokens_map.json", storage.join(folder, "special_tokens_map.json"))):
    if storage.isfile(src):
      with open(os.path.join(out_dir, name), "wb") as f:
        f.write(storage.read_bytes(src))
      copied.append(name)
  return copied
