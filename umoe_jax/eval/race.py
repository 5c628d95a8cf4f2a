"""RACE reading comprehension (Lai et al. 2017): the public release, scored as lm-eval does.

Data: RACE.tar.gz (https://www.cs.cmu.edu/~glai1/data/race/): `RACE/{train,dev,test}/{high,middle}/
<n>.txt`, each file one JSON object {"article", "questions": [q, ...], "options": [[4 str], ...],
"answers": ["A"-"D", ...], "id"}. lm-eval's `race` task is RACE-high test (`RACE/test/high`, 1,045
articles). A path is one such file, a directory of them (read in natural file-name order), or a
JSON-lines file with one article object a line.

One item per article (lm-eval's scheme): its last question is scored, the earlier ones are answered
in the context:

    Article: <article>\\n\\n
    Question: <q_i>\\nAnswer: <answer text of q_i>\\n           (each earlier question; a cloze
                                                             question ending "  _  ." is written
                                                             with its blank filled instead)
    <last question>

with the last question's four options as choices (" " + option; acc and acc_norm).
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Optional

from umoe_jax import json_errors, storage
from umoe_jax.eval.jsonl import read_records
from umoe_jax.eval.tasks import MultipleChoice, TaskFormatError

LETTERS = ("A", "B", "C", "D")
_BLANK_END = "  _  ."


def _natural_key(path: str):
  return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", os.path.basename(path))]


def _check_article(rec: Any, where: str) -> dict:
  if not isinstance(rec, dict):
    raise TaskFormatError(f"{where}: expected a JSON object, got {type(rec).__name__}")
  for key in ("article", "questions", "options", "answers"):
    if key not in rec:
      raise TaskFormatError(f"{where}: missing key {key!r} (has {sorted(rec)})")
  if not isinstance(rec["article"], str):
    raise TaskFormatError(f"{where}: 'article' must be a string")
  qs, opts, ans = rec["questions"], rec["options"], rec["answers"]
  if not (isinstance(qs, list) and isinstance(opts, list) and isinstance(ans, list)) or not qs:
    raise TaskFormatError(f"{where}: 'questions', 'options', 'answers' must be non-empty lists")
  if not len(qs) == len(opts) == len(ans):
    raise TaskFormatError(f"{where}: {len(qs)} questions, {len(opts)} option lists and "
                          f"{len(ans)} answers (must be equal)")
  for i, (q, o, a) in enumerate(zip(qs, opts, ans)):
    if not isinstance(q, str):
      raise TaskFormatError(f"{where}: question {i} must be a string")
    if not (isinstance(o, list) and len(o) == 4 and all(isinstance(x, str) for x in o)):
      raise TaskFormatError(f"{where}: question {i} needs 4 string options, got {o!r:.120}")
    if a not in LETTERS:
      raise TaskFormatError(f"{where}: answer {i} must be one of A, B, C, D, got {a!r}")
  return rec


def to_item(rec: dict) -> MultipleChoice:
  """An article record -> its lm-eval item (see the module docstring)."""
  answer_text = lambda i: rec["options"][i][LETTERS.index(rec["answers"][i])]  # noqa: E731
  text = "Article: " + rec["article"] + "\n\n"
  for i, q in enumerate(rec["questions"][:-1]):
    if q.endswith(_BLANK_END):
      text += q[:-len(_BLANK_END) + 1] + answer_text(i) + "\n"
    else:
      text += "Question: " + q + "\n" + "Answer: " + answer_text(i) + "\n"
  text += rec["questions"][-1]
  return MultipleChoice(text, tuple(rec["options"][-1]), LETTERS.index(rec["answers"][-1]))


def _read_json_file(path: str) -> Any:
  try:
    with storage.open(path, encoding="utf-8") as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    line, column = json_errors.position(e)  # (json's of a file cut short: the line after its last)
    raise TaskFormatError(f"{path}:{line}: invalid JSON ({e.msg} at column {column})") from None
  except UnicodeDecodeError as e:
    raise TaskFormatError(f"{path}: not UTF-8 text ({e.reason})") from None


def read_articles(path: str, limit: Optional[int] = None) -> list[dict]:
  """The article records under `path` (file, directory or .jsonl), validated."""
  if storage.isdir(path):
    files = sorted(storage.find_files(path, (".txt", ".json")), key=_natural_key)
    if not files:
      raise TaskFormatError(f"{path}: no RACE .txt / .json files")
    files = files[:limit] if limit is not None else files
    return [_check_article(_read_json_file(f), f) for f in files]
  if not storage.isfile(path):
    raise FileNotFoundError(f"RACE data not found: {path!r}")
  if not path.endswith(".jsonl"):
    return [_check_article(_read_json_file(path), path)]
  out = [_check_article(rec, where)
         for where, rec in read_records(path, limit, TaskFormatError)]
  if not out:
    raise TaskFormatError(f"{path}: no records")
  return out


def load_race(path: str, limit: Optional[int] = None) -> list[MultipleChoice]:
  """One lm-eval item per article under `path`, the first `limit` articles."""
  return [to_item(r) for r in read_articles(path, limit)]
