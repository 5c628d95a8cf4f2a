"""JSON-lines files (task items, RACE articles, corpora) read one record at a time, with errors
that name the file and line.

    for where, record in read_records("data/q.jsonl", limit=100):    # where = "data/q.jsonl:7"
"""
from __future__ import annotations

import json
from typing import Any, Iterator, Optional

from umoe_jax import storage
from umoe_jax.eval.errors import EvalError


def read_records(path: str, limit: Optional[int] = None,
                 error: type[EvalError] = EvalError) -> Iterator[tuple[str, Any]]:
  """("file:line", decoded record) of each non-blank line, the first `limit` of them (None: all).
  A line that is not UTF-8 or not JSON raises `error` naming file:line and what is wrong."""
  n = 0
  with storage.open(path, "rb") as f:
    for lineno, raw in enumerate(f, 1):
      if limit is not None and n >= limit:
        return
      if not raw.strip():
        continue
      where = f"{path}:{lineno}"
      try:
        # without the line end: an unterminated record is reported at its last column, not at
        # "column 1" (of the line end)
        record = json.loads(raw.rstrip(b"\r\n").decode("utf-8"))
      except UnicodeDecodeError as e:
        raise error(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
      except json.JSONDecodeError as e:
        raise error(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
      n += 1
      yield where, record
