"""Output of the evaluation commands: Markdown tables and JSON written atomically.

`write_json(path, obj)` writes a temporary file beside `path` and renames it over `path`, so an
error (or Ctrl-C) never leaves a half-written result: either the old file or the complete new one.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from typing import Any, Sequence


def markdown_table(rows: Sequence[Sequence[str]]) -> str:
  """rows[0] is the header; every cell a string."""
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
  lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
  return "\n".join(lines)


def fmt(x: Any) -> str:
  """A metric for a table: ints as they are, floats to 4 decimals (or 4 significant digits)."""
  if x is None:
    return ""
  if isinstance(x, bool):
    return str(x)
  if isinstance(x, int):
    return f"{x:,}"
  if isinstance(x, float):
    if not math.isfinite(x):
      return str(x)
    return f"{x:.4f}" if abs(x) < 1e6 else f"{x:.4e}"
  return str(x)


def _jsonable(x: Any) -> Any:
  if isinstance(x, dict):
    return {str(k): _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if hasattr(x, "item") and callable(x.item):   # numpy scalars
    return x.item()
  if isinstance(x, float) and not math.isfinite(x):
    return str(x)
  return x


def write_json(path: str, obj: Any) -> None:
  """json.dump(obj) to `path` atomically (module docstring); creates the parent directory."""
  path = os.path.abspath(path)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                             dir=os.path.dirname(path))
  try:
    with os.fdopen(fd, "w") as f:
      json.dump(_jsonable(obj), f, indent=2)
      f.write("\n")
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise
