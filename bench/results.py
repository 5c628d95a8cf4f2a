"""Benchmark results as data: one JSON object a line in `bench/results/<device>.jsonl`.

A row is one measurement of one metric (`ROW_FIELDS`: id, date, commit, device, config, overrides,
metric, value, unit, command, anchor), plus optional `extra` (other figures of the same measurement:
a training row's step time and MFU beside its tokens/s) and `source` (where a converted figure was
first written down). `docs/performance.md` is generated from the rows (`python3 -m bench.report`).

- `config`: a zoo config name (`umoe_base`) for a model measurement, `BENCH:SHAPE` for a kernel's
  (`gmm:base-up`, `attention_core:base`).
- `overrides`: the settings the measurement ran with that differ from the defaults ({} for none);
  measurements of one config are compared only between rows of equal overrides.
  A setting the scripts no longer take goes in `RETIRED` with the value the code now always has,
  so the page reads old rows as today's code where they ran that value (`as_today`).
- `anchor`: what the figure is compared with, or null: {"what", "value", "unit", "source"}.

Files: one per device kind, `bench/results/<device slug>.jsonl` (`device_slug`: "NVIDIA H200" ->
`h200`, two of them -> `h200-x2`). A bench script appends to `--results` (default: `$OUT/rows.jsonl`
when $OUT is set, as on the device machines, whose $OUT is what comes back; else the device's file
here); `python3 -m bench.results add FILE...` then files rows into the per-device files (rows already
there, by id, are skipped), `python3 -m bench.results check` validates every file.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import re
import shlex
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS_DIR = os.path.join(HERE, "results")

# name -> the JSON types a row's value of it may have
ROW_FIELDS = {
    "id": (str,), "date": (str,), "commit": (str,), "device": (str,), "config": (str,),
    "overrides": (dict,), "metric": (str,), "value": (int, float), "unit": (str,),
    "command": (str,), "anchor": (dict, type(None)),
}
OPTIONAL_FIELDS = {"extra": (dict,), "source": (str,)}
ANCHOR_FIELDS = {"what": (str,), "value": (int, float), "unit": (str,), "source": (str,)}

# metric -> (unit, True where higher is better)
METRICS = {
    "tokens_per_s": ("tokens/s", True),        # a training step's throughput
    "step_ms": ("ms", False),
    "fwd_tflops": ("TFLOP/s", True),           # a kernel's forward
    "fwd_bwd_tflops": ("TFLOP/s", True),       # forward + both backward products, 3x the FLOPs
    "wgrad_tflops": ("TFLOP/s", True),         # a kernel's weight-gradient product alone
    "dgrad_tflops": ("TFLOP/s", True),         # a kernel's input-gradient product alone
    "fwd_ms": ("ms", False),
    "fwd_bwd_ms": ("ms", False),
    "ms": ("ms", False),                       # one call of the op a config names
    "prefill_ms": ("ms", False),               # a prompt's forward with cache writes
    "decode_tokens_per_s": ("tokens/s", True),  # cached decoding, batch / ms a step
    "items_per_s": ("items/s", True),          # evaluation
    "compile_s": ("s", False),
}
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")

# Settings rows carry that no bench script takes any more: {name: (the value the code now always
# has, the commit that made it so, what became of the setting, its scope: the settings (and config)
# a row must have for it to matter, a tuple naming values any of which does)}. A row that ran the
# setting at that value measured what today's code does there; a row at another value measured
# code that is gone; a row outside its scope (a bf16 row, for an FP8 setting) did not depend on it.
_FP8 = {"precision": "fp8"}
RETIRED = {
    "fp8_rowwise": (0, "3ad6050", "removed: the row-wise FP8 recipe lost to the fine-grained one", _FP8),
    "fp8_wgrad": (0, "3ad6050", "the FP8 weight gradients are always bf16 (FP8 ones were slower)", _FP8),
    "fp8_fused_combine": (1, "3ad6050", "the fused FP8 combine is the only one", _FP8),
    "fp8_rows_through_index": (1, "49b7111", "the FP8 token rows are always read through the index",
                               _FP8),
    "fp8_keep_weight_blocks": (0, "4424681", "removed: XLA already quantises each weight once", _FP8),
    "fp8_quantize_in_epilogue": (1, "4424681", "always, where the backend has the form", _FP8),
    "fp8_narrow_tail": (1, "7a8f87e", "the FP8 gmm's last partial chunk is always one narrow dot", _FP8),
    "narrow_tail": (1, "7a8f87e", "the FP8 gmm's last partial chunk is always one narrow dot", _FP8),
    "split_key_width": (1, "bed83e8", "the Triton attention core always splits 192 as 128 + 64", {}),
    "fp8_min_contraction": (256, "82e4bdd", "FP8 products contracting over fewer than 256 take bf16",
                            # the measured configs with such products (192-wide experts)
                            dict(_FP8, config=("umoe_base", "ffn_moe_base"))),
}
# Settings that say how a row was taken, not what ran: the traced step is one of the timed steps,
# whose median is the figure.
HOW_TAKEN = ("trace_step",)


class RowError(ValueError):
  """A row that does not follow the schema; the message names the file, line and field."""


def _type_names(types) -> str:
  return " or ".join("null" if t is type(None) else t.__name__ for t in types)


def _check_fields(obj: dict, required: dict, optional: dict, where: str) -> None:
  for name, types in required.items():
    if name not in obj:
      raise RowError(f"{where}: missing field {name!r}")
  for name, value in obj.items():
    types = required.get(name) or optional.get(name)
    if types is None:
      raise RowError(f"{where}: unknown field {name!r} (fields: {', '.join([*required, *optional])})")
    if isinstance(value, bool) or not isinstance(value, types):
      raise RowError(f"{where}: field {name!r} is {type(value).__name__}, not {_type_names(types)}")


def validate(row, where: str = "row") -> dict:
  """`row` if it follows the schema, else RowError naming `where` and the field."""
  if not isinstance(row, dict):
    raise RowError(f"{where}: a row is a JSON object, not {type(row).__name__}")
  _check_fields(row, ROW_FIELDS, OPTIONAL_FIELDS, where)
  if not DATE.match(row["date"]):
    raise RowError(f"{where}: field 'date' is {row['date']!r}, not YYYY-MM-DD")
  if row["metric"] not in METRICS:
    raise RowError(f"{where}: field 'metric' is {row['metric']!r}; known: {', '.join(METRICS)}")
  unit = METRICS[row["metric"]][0]
  if row["unit"] != unit:
    raise RowError(f"{where}: field 'unit' is {row['unit']!r}; metric {row['metric']!r} is in {unit!r}")
  if not math.isfinite(row["value"]):
    raise RowError(f"{where}: field 'value' is {row['value']!r}, not a finite number")
  if row["anchor"] is not None:
    _check_fields(row["anchor"], ANCHOR_FIELDS, {}, f"{where}: anchor")
  for field in ("commit", "device", "config", "command"):
    if not row[field]:
      raise RowError(f"{where}: field {field!r} is empty")
  return row


def device_slug(device: str) -> str:
  """'NVIDIA H200' -> 'h200'; 'NVIDIA H200 x2' -> 'h200-x2'; 'TPU v5 lite' -> 'tpu-v5-lite'."""
  slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
  return re.sub(r"^nvidia-", "", slug) or "unknown"


def device_name(device_kind: str, count: int = 1) -> str:
  """A row's device: the jax device kind, with ' xN' for a measurement over N devices."""
  return device_kind if count == 1 else f"{device_kind} x{count}"


def row_id(row: dict) -> str:
  """`<date>-<device slug>-<metric>-<8 hex>`: the hash covers what the row measured, so the same
  row gets the same id wherever it is written."""
  key = {k: row.get(k) for k in ("date", "commit", "device", "config", "overrides", "metric",
                                 "value", "command")}
  digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:8]
  return f"{row['date']}-{device_slug(row['device'])}-{row['metric']}-{digest}"


def anchor(what: str, value: float, unit: str, source: str) -> dict:
  return dict(what=what, value=value, unit=unit, source=source)


def make_row(*, date: str, commit: str, device: str, config: str, metric: str, value: float,
             command: str, overrides: dict | None = None, anchor: dict | None = None,
             extra: dict | None = None, source: str | None = None) -> dict:
  """A validated row, its unit from METRICS and its id from its contents."""
  row = dict(date=date, commit=commit, device=device, config=config, overrides=dict(overrides or {}),
             metric=metric, value=value, unit=METRICS[metric][0] if metric in METRICS else "",
             command=command, anchor=anchor)
  if extra:
    row["extra"] = {k: v for k, v in extra.items() if v is not None}
  if source:
    row["source"] = source
  row = {"id": row_id(row), **row}
  return validate(row, f"row {row['id']}")


def _same(a, b) -> bool:
  """Two settings' values alike, as numbers where both are (1 == "1" == 1.0 == True)."""
  try:
    return float(a) == float(b)
  except (TypeError, ValueError):
    return str(a) == str(b)


def _today(name: str, value, overrides: dict) -> bool:
  """The setting `name=value` of a row with `overrides` is what today's code always does, or says
  nothing about what ran (how the row was taken; a retired setting outside its scope)."""
  if name in HOW_TAKEN:
    return True
  if name not in RETIRED:
    return False
  today, _, _, scope = RETIRED[name]
  in_scope = all(any(_same(overrides.get(k), one) for one in (v if isinstance(v, tuple) else (v,)))
                 for k, v in scope.items())
  return not in_scope or _same(value, today)


def join_command(words: list[str]) -> str:
  """`shlex.join`, but a leading NAME=value word (an environment setting) keeps NAME unquoted, so
  the shell still reads it as an assignment."""
  out, leading = [], True
  for w in words:
    name, eq, value = w.partition("=")
    leading = leading and bool(eq) and name.isidentifier()
    out.append(f"{name}={shlex.quote(value)}" if leading else shlex.quote(w))
  return " ".join(out)


def run_pieces(run: str) -> tuple[str, list[tuple[str, str]]]:
  """A `--runs` item 'CONFIG:LAYOUT/name=value/...' -> ('CONFIG:LAYOUT', [(name, value), ...])."""
  head, *pieces = run.split("/")
  return head, [tuple(p.partition("=")[::2]) for p in pieces]


def _runnable(command: str) -> str:
  """`command` as it runs today: without the flags of retired and how-taken settings (`--name=v`,
  `--name v`; a row whose overrides do not name one did not depend on it), its runs' `/name=v`
  pieces at today's value dropped, runs with a retired piece at another value left out, and runs
  that thereby repeat kept once."""
  gone = lambda name: name in RETIRED or name in HOW_TAKEN
  words, skip = [], False
  for w in shlex.split(command):
    if skip:
      skip = False
      continue
    if w.startswith("--") and gone(w[2:].partition("=")[0]):
      skip = "=" not in w
      continue
    if w.startswith("--runs="):
      runs = []
      for run in w[len("--runs="):].split(","):
        head, kv = run_pieces(run)
        ran = dict(kv)
        if any(k in RETIRED and not _today(k, v, ran) for k, v in kv):
          continue
        run = "/".join([head, *(f"{k}={v}" for k, v in kv if not _today(k, v, ran))])
        if run not in runs:
          runs.append(run)
      w = "--runs=" + ",".join(runs)
    words.append(w)
  return join_command(words)


def as_today(row: dict) -> tuple[dict, list[str]]:
  """(`row` as today's code names its settings, the notes of the retired settings it ran otherwise).

  Its overrides lose the settings at today's value or outside their scope (`_today`); a retired
  setting at another value stays, and its note says what became of it (the row measured code that
  is gone); so does a switch recorded in its `extra["switches"]` (bench/train_step.py writes every
  switch's value).
  Its command is `_runnable`. Older rows name only the settings that differed from the defaults
  of their day: a figure is what the code of the row's commit gave."""
  ran = {**row.get("extra", {}).get("switches", {}), **row["overrides"]}
  where = dict(ran, config=row["config"])
  notes = [f"`{k}={v}`: {RETIRED[k][2]} (since {RETIRED[k][1]})"
           for k, v in sorted(ran.items()) if k in RETIRED and not _today(k, v, where)]
  overrides = {k: v for k, v in row["overrides"].items() if not _today(k, v, where)}
  command = _runnable(row["command"])
  if overrides == row["overrides"] and command == row["command"]:
    return row, notes
  return dict(row, overrides=overrides, command=command), notes


def git_commit() -> str:
  """The checkout's short HEAD, '+' appended when tracked files differ from it ('unknown' outside
  a git checkout, as on a device machine given the tree without .git)."""
  try:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, timeout=10)
    if head.returncode:
      return "unknown"
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT, timeout=30).returncode
    return head.stdout.strip() + ("+" if dirty else "")
  except (OSError, subprocess.SubprocessError):
    return "unknown"


def command_line(argv: list[str] | None = None) -> str:
  """The exact command: the interpreter's name and argv, each word quoted where the shell needs it."""
  argv = sys.argv if argv is None else argv
  return join_command(["python3", *argv])


def default_path(device: str | None = None) -> str:
  """Where a bench script's rows go: $OUT/rows.jsonl when $OUT is set (the device machines bring
  $OUT back), else bench/results/<device slug>.jsonl."""
  if os.environ.get("OUT"):
    return os.path.join(os.environ["OUT"], "rows.jsonl")
  return os.path.join(RESULTS_DIR, f"{device_slug(device or 'unknown')}.jsonl")


def add_flag(parser) -> None:
  """`--results=PATH` on a bench script's parser ('' or 'none': record nothing)."""
  parser.add_argument("--results", default=None,
                      help="append one JSON row a measurement here (default: $OUT/rows.jsonl when "
                           "$OUT is set, else bench/results/<device>.jsonl; '' or none: no rows)")


def record(path: str | None, config: str, metric: str, value: float, *, overrides=None, anchor=None,
           extra=None, device: str | None = None, devices: int = 1) -> dict | None:
  """Appends the row of one measurement made now by this process's command (date, commit, device
  and command filled in) to `path` (None: `default_path`; '' / 'none': nothing) and returns it."""
  if path is not None and path.lower() in ("", "none"):
    return None
  if device is None:
    import jax
    device = jax.devices()[0].device_kind
  device = device_name(device, devices)
  row = make_row(date=datetime.date.today().isoformat(), commit=git_commit(), device=device,
                 config=config, metric=metric, value=float(value), command=command_line(),
                 overrides=overrides, anchor=anchor, extra=extra)
  append(path or default_path(device), row)
  return row


def append(path: str, row: dict) -> bool:
  """Appends `row` (validated) as one line of `path`, in one write to a file opened for appending
  (a reader never sees half a row). False, and nothing written, when a row of its id is there."""
  validate(row, f"row {row.get('id')!r}")
  if os.path.exists(path) and row["id"] in {r["id"] for r in load_file(path)}:
    return False
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  line = json.dumps(row, sort_keys=False) + "\n"
  fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
  try:
    os.write(fd, line.encode())
  finally:
    os.close(fd)
  return True


def load_file(path: str) -> list[dict]:
  rows, seen = [], {}
  with open(path) as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f"{path}:{n}"
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise RowError(f"{where}: not JSON ({e.msg})") from None
      validate(row, where)
      if row["id"] in seen:
        raise RowError(f"{where}: id {row['id']!r} repeats line {seen[row['id']]}")
      seen[row["id"]] = n
      rows.append(row)
  return rows


def load(directory: str = RESULTS_DIR) -> list[dict]:
  """Every row of `directory`'s *.jsonl files, validated (RowError names the file, line and field)."""
  rows = []
  for name in sorted(os.listdir(directory)):
    if name.endswith(".jsonl"):
      rows.extend(load_file(os.path.join(directory, name)))
  return rows


def add(paths: list[str], directory: str = RESULTS_DIR) -> int:
  """Files the rows of `paths` (e.g. a device run's $OUT/rows.jsonl) into `directory`'s per-device
  files; returns how many were new."""
  rows = [r for p in paths for r in load_file(p)]
  return sum(append(os.path.join(directory, f"{device_slug(r['device'])}.jsonl"), r) for r in rows)


def main(argv=None) -> int:
  import argparse
  ap = argparse.ArgumentParser(prog="python3 -m bench.results", description=__doc__.split("\n")[0])
  sub = ap.add_subparsers(dest="cmd", required=True)
  p_add = sub.add_parser("add", help="file rows (e.g. $OUT/rows.jsonl) into bench/results/<device>.jsonl")
  p_add.add_argument("files", nargs="+")
  sub.add_parser("check", help="validate every bench/results/*.jsonl")
  args = ap.parse_args(argv)
  try:
    if args.cmd == "add":
      print(f"{add(args.files)} new rows")
    else:
      print(f"{len(load())} rows ok")
  except (RowError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
