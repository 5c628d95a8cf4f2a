"""Which tasks to score: known names, any file by path and kind, or a small task spec file.

`--tasks` is a comma-separated list whose entries are

  arc_easy                     a known task (`tasks.TASKS`) in --data_dir
  data/my_mc.jsonl:mc          any JSONL file and its kind (multiple_choice|mc, schema, lm|cloze, race)
  mine=data/my_mc.jsonl:mc     the same, named "mine" in the results
  suite.yaml                   a task spec file (YAML or JSON)

A spec file holds one task (a mapping), a list of them, or {"tasks": [...]}. Keys:

  name             result name (default: the file stem)
  path             data: a JSONL file (multiple_choice / schema / lm), RACE data (race), MMLU's data/
                   directory (mmlu); relative paths are relative to the spec file
  kind             multiple_choice | schema | lm | race | mmlu  ("mc", "cloze" accepted)
  num_fewshot      examples in each prompt (default: --num_fewshot, else 0; mmlu: 5)
  fewshot_path     a separate split to draw examples from (default: the scored file, excluding the
                   scored item; mmlu: its dev split)
  fewshot_seed     seed of the draw (default: --fewshot_seed, 1234 as lm-eval)
  fewshot_sampler  random | first_n (mmlu: first_n)
  description      text put before the examples
  limit            score only the first N items (default: --limit)
  split            mmlu only: test | val (default test)
  subjects         mmlu only: a list of subjects (default: every subject found)

Example (suite.yaml):

    tasks:
      - {name: arc_e_3shot, path: /data/eval/arc_easy.jsonl, kind: mc, num_fewshot: 3}
      - {name: race_high, path: /data/RACE/test/high, kind: race}
      - {name: mmlu, path: /data/mmlu/data, kind: mmlu}
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional, Sequence

from umoe_jax import json_errors, storage
from umoe_jax.eval import tasks as tasks_lib
from umoe_jax.eval.errors import EvalError
from umoe_jax.eval.fewshot import SAMPLERS

FILE_KINDS = tasks_lib.KINDS + ("race", "mmlu")
SPEC_SUFFIXES = (".yaml", ".yml", ".json")


@dataclasses.dataclass(frozen=True)
class TaskSpec:
  name: str
  kind: str                           # one of FILE_KINDS
  path: str
  num_fewshot: Optional[int] = None   # None: the command's --num_fewshot (mmlu: 5)
  fewshot_path: Optional[str] = None
  fewshot_seed: Optional[int] = None     # None: the command's --fewshot_seed (1234)
  fewshot_sampler: Optional[str] = None   # None: random (mmlu: first_n)
  description: str = ""
  limit: Optional[int] = None
  split: str = "test"
  subjects: Optional[tuple[str, ...]] = None


def resolve_file_kind(kind: Any, where: str) -> str:
  if not isinstance(kind, str):
    raise EvalError(f"{where}: 'kind' must be a string, got {kind!r}")
  if kind.strip() in ("race", "mmlu"):
    return kind.strip()
  try:
    return tasks_lib.resolve_kind(kind)
  except EvalError:
    raise EvalError(f"{where}: unknown task kind {kind!r}; valid: {', '.join(FILE_KINDS)} "
                    "(or mc, cloze)") from None


def _stem(path: str) -> str:
  base = os.path.basename(os.path.normpath(path))
  return base.split(".")[0] or base


def _spec_from_mapping(rec: Any, where: str, base_dir: str) -> TaskSpec:
  if not isinstance(rec, dict):
    raise EvalError(f"{where}: a task must be a mapping, got {type(rec).__name__}")
  fields = {f.name for f in dataclasses.fields(TaskSpec)}
  unknown = sorted(set(rec) - fields)
  if unknown:
    raise EvalError(f"{where}: unknown key(s) {unknown}; valid: {', '.join(sorted(fields))}")
  for key in ("path", "kind"):
    if key not in rec:
      raise EvalError(f"{where}: missing key {key!r}")
  rec = dict(rec)
  rec["kind"] = resolve_file_kind(rec["kind"], where)
  for key in ("path", "fewshot_path"):
    if rec.get(key) is not None:
      if not isinstance(rec[key], str):
        raise EvalError(f"{where}: {key!r} must be a string, got {rec[key]!r}")
      try:
        rec[key] = (rec[key] if storage.is_url(rec[key]) else
                    storage.join(base_dir, storage.expand(rec[key])))
      except storage.UnknownUserError as e:
        raise EvalError(f"{where}: {key!r}: {e}") from None
  # Else a number here fails only once scored (description) or in the table after every task
  # (name), the results lost.
  for key in ("name", "description", "split"):
    if key in rec and not isinstance(rec[key], str):
      raise EvalError(f"{where}: {key!r} must be a string, got {rec[key]!r}")
  for key in ("num_fewshot", "limit", "fewshot_seed"):
    if rec.get(key) is not None and (isinstance(rec[key], bool) or not isinstance(rec[key], int)
                                     or rec[key] < 0):
      raise EvalError(f"{where}: {key!r} must be an integer >= 0, got {rec[key]!r}")
  if rec.get("fewshot_sampler") is not None and rec["fewshot_sampler"] not in SAMPLERS:
    raise EvalError(f"{where}: fewshot_sampler must be one of {', '.join(SAMPLERS)}, "
                    f"got {rec['fewshot_sampler']!r}")
  if rec.get("subjects") is not None:
    if not isinstance(rec["subjects"], list) or not all(isinstance(s, str) for s in rec["subjects"]):
      raise EvalError(f"{where}: 'subjects' must be a list of strings")
    rec["subjects"] = tuple(rec["subjects"])
  rec.setdefault("name", _stem(rec["path"]))
  return TaskSpec(**rec)


def load_spec_file(path: str) -> list[TaskSpec]:
  """The tasks of a YAML / JSON spec file (see the module docstring); errors name the file."""
  if storage.isdir(path):  # (not "not found": it is there)
    raise EvalError(f"task spec file {path!r} is a directory, not a YAML / JSON file")
  if not storage.isfile(path):
    raise FileNotFoundError(f"task spec file not found: {path!r}")
  with storage.open(path, encoding="utf-8") as f:
    text = f.read()
  try:
    if path.endswith(".json"):
      data = json.loads(text)
    else:
      import yaml
      data = yaml.safe_load(text)
  except Exception as e:   # yaml.YAMLError / json.JSONDecodeError: both say where
    raise EvalError(f"{path}: cannot parse task spec ({json_errors.message(e)})"
                    .replace("\n", " ")) from None
  if isinstance(data, dict) and "tasks" in data:
    data = data["tasks"]
  entries = data if isinstance(data, list) else [data]
  if not entries:
    raise EvalError(f"{path}: no tasks")
  base = storage.dirname(storage.abspath(path))
  return [_spec_from_mapping(e, f"{path}: task {i}", base) for i, e in enumerate(entries)]


def parse_task_list(entries: str | Sequence[str | TaskSpec],
                    data_dir: str = tasks_lib.DEFAULT_DATA_DIR) -> list[TaskSpec]:
  """--tasks (a comma-separated string, or a list of entries and TaskSpecs) -> TaskSpecs, in order."""
  if isinstance(entries, str):
    entries = entries.split(",")
  specs = []
  for entry in entries:
    if isinstance(entry, TaskSpec):
      specs.append(entry)
      continue
    entry = entry.strip()
    if not entry:
      continue
    if entry.endswith(SPEC_SUFFIXES):
      specs += load_spec_file(entry)
    elif ":" in entry and "/" not in entry.rsplit(":", 1)[1]:  # (not a URL's "s3://")
      named, kind = entry.rsplit(":", 1)
      name, path = named.split("=", 1) if "=" in named else (_stem(named), named)
      specs.append(TaskSpec(name=name, kind=resolve_file_kind(kind, f"--tasks entry {entry!r}"),
                            path=path))
    else:
      path = entry.split("=", 1)[-1]
      if storage.exists(path) and _stem(path) not in tasks_lib.TASKS:  # a file without its kind
        if storage.isdir(path):  # only race and mmlu read a directory
          raise EvalError(f"--tasks entry {entry!r} is a directory: give its kind, {entry}:KIND, "
                          "with KIND race or mmlu (the kinds that read a directory)")
        raise EvalError(f"--tasks entry {entry!r} is a file: give its kind, {entry}:KIND, with "
                        f"KIND one of {', '.join(FILE_KINDS)} (or mc, cloze)")
      name = tasks_lib.resolve_task(entry)
      filename, kind = tasks_lib.TASKS[name]
      specs.append(TaskSpec(name=name, kind=kind, path=os.path.join(data_dir, filename)))
  if not specs:
    raise EvalError("no tasks given")
  names = [s.name for s in specs]
  dup = sorted({n for n in names if names.count(n) > 1})
  if dup:
    raise EvalError(f"task name(s) {dup} given twice; name them apart (NAME=PATH:KIND, or 'name:')")
  return specs
