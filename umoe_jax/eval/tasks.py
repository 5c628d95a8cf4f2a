"""Eval sets: JSONL readers and the (context, continuation) requests each item asks for.

The files are those in `../shared/data/eval/` (MosaicML eval-gauntlet layout, one JSON object a line):

  kind             tasks                                         record
  multiple_choice  arc_easy, arc_challenge, piqa, hellaswag      {"query", "choices": [str, ...], "gold": i}
  schema           winogrande                                    {"context_options": [str, ...], "continuation", "gold": i}
  lm               lambada_openai                                {"context", "continuation"}

Any file in one of these layouts can be read by kind (`read_jsonl(path, kind)`; kinds also go by
"mc" and "cloze"). Requests (scored by the log-likelihood of the continuation's tokens given the
context's), after an optional few-shot `prefix` (see `umoe_jax.eval.fewshot`):
  multiple_choice: (prefix + query, " " + choice) for every choice;
  schema:          (prefix + option, " " + continuation) for every context option (shared continuation);
  lm:              (prefix + context, " " + continuation) (the last word).
`example()` is the item solved, as a few-shot example: query + " " + gold choice, gold option + " " +
continuation, context + " " + continuation.

    docs = load_task("arc_easy", data_dir, limit=100)        # list[MultipleChoice]
    pairs = docs[0].requests()                               # [(context, continuation), ...]

A malformed record raises `TaskFormatError` naming the file and line.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional, Union

from umoe_jax import storage
from umoe_jax.eval.errors import EvalError
from umoe_jax.eval.jsonl import read_records

# Joins a context and its continuation (lm-evaluation-harness's target_delimiter).
DELIMITER = " "

# The repository's default eval directory: <repo>/../shared/data/eval.
DEFAULT_DATA_DIR = os.path.normpath(os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "shared", "data", "eval"))


class TaskFormatError(EvalError):
  """A record of an eval file is not what its task expects (the message names file:line)."""


@dataclasses.dataclass(frozen=True)
class MultipleChoice:
  query: str
  choices: tuple[str, ...]
  gold: int

  def requests(self, prefix: str = "") -> list[tuple[str, str]]:
    return [(prefix + self.query, DELIMITER + c) for c in self.choices]

  def example(self) -> str:
    return self.query + DELIMITER + self.choices[self.gold]


@dataclasses.dataclass(frozen=True)
class Schema:
  context_options: tuple[str, ...]
  continuation: str
  gold: int

  def requests(self, prefix: str = "") -> list[tuple[str, str]]:
    return [(prefix + o, DELIMITER + self.continuation) for o in self.context_options]

  def example(self) -> str:
    return self.context_options[self.gold] + DELIMITER + self.continuation


@dataclasses.dataclass(frozen=True)
class LanguageModeling:
  context: str
  continuation: str

  def requests(self, prefix: str = "") -> list[tuple[str, str]]:
    return [(prefix + self.context, DELIMITER + self.continuation)]

  def example(self) -> str:
    return self.context + DELIMITER + self.continuation


Doc = Union[MultipleChoice, Schema, LanguageModeling]

KINDS = ("multiple_choice", "schema", "lm")
_KIND_ALIASES = {"mc": "multiple_choice", "cloze": "lm", "lambada": "lm"}


def resolve_kind(kind: str) -> str:
  """Canonical record kind ("mc" and "cloze" are accepted); EvalError if unknown."""
  kind = _KIND_ALIASES.get(kind.strip(), kind.strip())
  if kind not in KINDS:
    raise EvalError(f"unknown task kind {kind!r}; valid: {', '.join(KINDS)} (or mc, cloze)")
  return kind

# task name -> (file name in the data directory, kind).
TASKS: dict[str, tuple[str, str]] = {
    "arc_easy": ("arc_easy.jsonl", "multiple_choice"),
    "arc_challenge": ("arc_challenge.jsonl", "multiple_choice"),
    "piqa": ("piqa.jsonl", "multiple_choice"),
    "hellaswag": ("hellaswag_val.jsonl", "multiple_choice"),
    "winogrande": ("winogrande.jsonl", "schema"),
    "lambada_openai": ("lambada_openai.jsonl", "lm"),
}
_ALIASES = {"hellaswag_val": "hellaswag", "lambada": "lambada_openai", "arc_e": "arc_easy",
            "arc_c": "arc_challenge"}


def task_names() -> list[str]:
  return list(TASKS)


def resolve_task(name: str) -> str:
  """Canonical task name (accepts the file stem and a few aliases); ValueError if unknown."""
  name = _ALIASES.get(name.strip(), name.strip())
  if name not in TASKS:
    raise EvalError(f"unknown task {name!r}; valid: {', '.join(TASKS)}, or a file as PATH:KIND "
                    "or a task spec file (.yaml / .json)")
  return name


def task_kind(name: str) -> str:
  return TASKS[resolve_task(name)][1]


# ------------------------------------------------------------------------------------------------
# Record parsing


def _str(rec: dict, key: str, where: str) -> str:
  if key not in rec:
    raise TaskFormatError(f"{where}: missing key {key!r} (has {sorted(rec)})")
  if not isinstance(rec[key], str):
    raise TaskFormatError(f"{where}: {key!r} must be a string, got {type(rec[key]).__name__}")
  return rec[key]


def _str_list(rec: dict, key: str, where: str) -> tuple[str, ...]:
  if key not in rec:
    raise TaskFormatError(f"{where}: missing key {key!r} (has {sorted(rec)})")
  value = rec[key]
  if not isinstance(value, list) or len(value) < 2 or not all(isinstance(v, str) for v in value):
    raise TaskFormatError(f"{where}: {key!r} must be a list of at least 2 strings, got {value!r:.200}")
  return tuple(value)


def _gold(rec: dict, n: int, where: str) -> int:
  if "gold" not in rec:
    raise TaskFormatError(f"{where}: missing key 'gold' (has {sorted(rec)})")
  g = rec["gold"]
  if isinstance(g, bool) or not isinstance(g, int) or not 0 <= g < n:
    raise TaskFormatError(f"{where}: 'gold' must be an integer in [0, {n}), got {g!r}")
  return g


def parse_record(kind: str, rec: Any, where: str) -> Doc:
  """One decoded JSON record -> its Doc; `where` ("file:line") prefixes any error."""
  if not isinstance(rec, dict):
    raise TaskFormatError(f"{where}: expected a JSON object, got {type(rec).__name__}")
  if kind == "multiple_choice":
    choices = _str_list(rec, "choices", where)
    return MultipleChoice(_str(rec, "query", where), choices, _gold(rec, len(choices), where))
  if kind == "schema":
    options = _str_list(rec, "context_options", where)
    return Schema(options, _str(rec, "continuation", where), _gold(rec, len(options), where))
  if kind == "lm":
    cont = _str(rec, "continuation", where)
    if not cont.strip():
      raise TaskFormatError(f"{where}: 'continuation' is empty")
    return LanguageModeling(_str(rec, "context", where), cont)
  raise EvalError(f"unknown task kind {kind!r}; valid: {', '.join(KINDS)}")


def read_jsonl(path: str, kind: str, limit: Optional[int] = None) -> list[Doc]:
  """The first `limit` (None: all) records of a JSONL file of `kind`; blank lines are skipped."""
  kind = resolve_kind(kind)
  if storage.isdir(path):  # (not "not found": it is there)
    raise EvalError(f"eval file {path!r} is a directory: a {kind} task reads one JSON-lines file "
                    "(the kinds race and mmlu read directories)")
  if not storage.isfile(path):
    raise FileNotFoundError(f"eval file not found: {path!r}")
  docs = [parse_record(kind, rec, where)
          for where, rec in read_records(path, limit, TaskFormatError)]
  if not docs:
    raise TaskFormatError(f"{path}: no records")
  return docs


def load_task(name: str, data_dir: str = DEFAULT_DATA_DIR, limit: Optional[int] = None) -> list[Doc]:
  """The documents of task `name` (see TASKS) from `data_dir`, the first `limit` of them."""
  name = resolve_task(name)
  filename, kind = TASKS[name]
  return read_jsonl(storage.join(data_dir, filename), kind, limit)
