"""What the commands print and write: aligned text tables, Markdown tables, result files as JSON.

    print(text_table([["router", "entropy"], ["layer_0/ffn", "1.234"]]))
    print(markdown_table([("metric", "value"), ("token_ppl", fmt(12.3456))]))
    write_json("results/eval.json", {"acc": 0.25, "ppl": float("nan")})    # NaN -> null
    write_jsonl("results/samples.jsonl", [{"doc_id": 0}, {"doc_id": 1}])    # one object a line
    check_output_path(path, "--json")     # before the work: ValueError if it cannot be written

`write_json` (as `write_jsonl` and `write_text`) writes a temporary file beside the target and
renames it over the target (a URL: one whole upload, umoe_jax/storage), so an error (or Ctrl-C)
never leaves a half-written file: a reader sees the old file or the complete new one.
Non-finite floats become null (strict JSON, readable by every parser), numpy scalars plain numbers.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from typing import Any, Sequence

from umoe_jax import storage


def text_table(rows: Sequence[Sequence[Any]], rule: bool = False) -> list[str]:
  """Lines of a plain table: first column left-aligned, the others right-aligned, two spaces
  between columns, trailing spaces stripped; `rule` puts a dashed line under rows[0] (the header)."""
  rows = [[str(c) for c in r] for r in rows]
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  lines = ["  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])])
           .rstrip() for r in rows]
  if rule:
    lines.insert(1, "  ".join("-" * w for w in widths))
  return lines


def markdown_table(rows: Sequence[Sequence[str]]) -> str:
  """A Markdown table (rows[0] is the header; every cell a string), columns padded to align."""
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
  lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
  return "\n".join(lines)


def fmt(x: Any) -> str:
  """A metric for a table: ints with thousands separators, floats to 4 decimals (4 significant
  digits in scientific notation from 1e6 on), None as an empty cell."""
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


def jsonable(x: Any) -> Any:
  """`x` with string keys, lists for tuples, plain numbers for numpy scalars, None for NaN / inf."""
  if isinstance(x, dict):
    return {str(k): jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [jsonable(v) for v in x]
  if hasattr(x, "item") and callable(x.item):   # numpy scalars
    x = x.item()
  if isinstance(x, float) and not math.isfinite(x):
    return None
  return x


def write_json(path: str, obj: Any, indent: int = 2) -> None:
  """json.dump(jsonable(obj)) to `path` atomically (module docstring); creates the directory."""
  write_text(path, json.dumps(jsonable(obj), indent=indent, allow_nan=False) + "\n")


def write_jsonl(path: str, records: Sequence[Any]) -> None:
  """One JSON object per line (`jsonable`, characters as they are) to `path`, as `write_json`."""
  write_text(path, "".join(json.dumps(jsonable(r), allow_nan=False, ensure_ascii=False) + "\n"
                           for r in records))


def write_text(path: str, text: str) -> None:
  """`text` to `path` (UTF-8) atomically (module docstring); creates the directory."""
  if storage.is_url(path):
    storage.write_text(path, text)
    return
  path = os.path.abspath(os.path.expanduser(path))  # the path check_output_path checked
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                             dir=os.path.dirname(path))
  try:
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      f.write(text)
    os.chmod(tmp, 0o644)  # mkstemp's 0600 would make the result unreadable to others
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def check_output_path(path: str, flag: str, *, directory: bool = False) -> None:
  """ValueError naming `flag` when a command could not write its results to `path` (a file, or
  with `directory` a directory of files) at the end: called before the work starts. A local path's
  directory is made (as the write would make it) and must be writable; a URL's bucket must exist."""
  if storage.is_url(path):
    try:
      storage.check_bucket(path)
    except storage.StorageError:
      raise  # the store failed (no client library, credentials): its line and hint (stdout_errors)
    except OSError as e:
      raise ValueError(f"{flag}={path!r}: {e}") from None
    return
  path = os.path.abspath(storage.expand_user(path, flag))  # ValueError for ~user of no user
  folder = path if directory else os.path.dirname(path)
  existing = folder
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):  # else makedirs' bare "File exists" / "Not a directory"
    raise ValueError(f"{flag}={path!r}: {existing!r} is a file, not a directory")
  try:
    os.makedirs(folder, exist_ok=True)
  except OSError as e:
    raise ValueError(f"{flag}={path!r}: cannot create {folder!r} ({e.strerror or e})") from None
  if (not directory and os.path.isdir(path)) or not os.access(folder, os.W_OK):
    what = "a writable directory" if directory else "a writable file path"
    raise ValueError(f"{flag}={path!r} is not {what}")
