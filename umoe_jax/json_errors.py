"""Where a JSON document is malformed, for error messages that name the line.

    except json.JSONDecodeError as e:
      line, column = json_errors.position(e)
      raise ValueError(f"{path}:{line}: invalid JSON ({e.msg} at column {column})")
    except ValueError as e:        # JSONDecodeError or UnicodeDecodeError
      raise ValueError(f"{path} is not valid JSON ({json_errors.message(e)})")

json's own line / column of a document cut short (a file truncated by a full disk or a killed
writer, a record missing its end) point past its final newline: "line N+1 column 1" of an N-line
file, a line that does not exist. These point just after its last non-blank character instead.
"""
from __future__ import annotations

import json


def position(e: json.JSONDecodeError) -> tuple[int, int]:
  """(line, column), 1-based, of a JSON error: json's own, except at the end of the document
  (nothing but whitespace after the error), where it is just after the last non-blank character."""
  doc, pos = e.doc, _offset(e)
  return doc.count("\n", 0, pos) + 1, pos - doc.rfind("\n", 0, pos)


def message(e: Exception) -> str:
  """str(e), for a JSONDecodeError with the position of `position` (json's format: "msg: line L
  column C (char P)")."""
  if not isinstance(e, json.JSONDecodeError):
    return str(e)
  line, column = position(e)
  return f"{e.msg}: line {line} column {column} (char {_offset(e)})"


def _offset(e: json.JSONDecodeError) -> int:
  return len(e.doc.rstrip()) if not e.doc[e.pos:].strip() else e.pos
