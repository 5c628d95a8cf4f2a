"""docs/performance.md (and README.md's performance block) generated from the rows of bench/results/.

  python3 -m bench.report           # writes docs/performance.md, and README.md between its markers
  python3 -m bench.report --check   # exit 1 when either differs from what the rows give

Rows are read as today's code (`split_today`: settings the code now always has leave them, rows of
settings no longer offered are listed apart). Per device: the best row of each (config, overrides,
metric) (`best_rows`: the highest tokens/s or TFLOP/s, the lowest time), one table for the models'
training steps, one for the models' other metrics, one per kernel (configs `BENCH:SHAPE`), each
figure with its anchor and result id, then the rows of retired settings. Then the
"to measure" list, bench/results/to_measure.md as written. README.md is touched only between
`README_BEGIN` and `README_END`, and only where both markers are there.

The zoo's config files (`configs/<family>_<scale>.py`) state in their docstring the command that
trains them and the training step they give (each device's best default-settings row, with its own
command), or that none is measured yet: everything after the docstring's first line is written here.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import shlex
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE]

import results  # noqa: E402  (bench/results.py)

PAGE = os.path.join(ROOT, "docs", "performance.md")
README = os.path.join(ROOT, "README.md")
CONFIGS = os.path.join(ROOT, "configs")
TO_MEASURE = os.path.join(results.RESULTS_DIR, "to_measure.md")
README_BEGIN, README_END = "<!-- performance:begin -->", "<!-- performance:end -->"
COMMAND = "python3 -m bench.report"
TRAINING = "tokens_per_s"   # a model row of this metric is a training step (extra: step_ms, mfu)
SCALES = {"tiny": 0, "base": 1, "large": 2}


def settings(overrides: dict) -> str:
  return ", ".join(f"{k}={v}" for k, v in sorted(overrides.items())) or "defaults"


def group_key(row: dict) -> tuple:
  return row["device"], row["config"], json.dumps(row["overrides"], sort_keys=True), row["metric"]


def best_rows(rows: list[dict]) -> dict[tuple, dict]:
  """{group_key: its best row}: the highest value where the metric is higher-better, else the
  lowest; between equal values the later date, then the larger id."""
  best = {}
  for row in rows:
    key = group_key(row)
    higher = results.METRICS[row["metric"]][1]
    rank = ((row["value"] if higher else -row["value"]), row["date"], row["id"])
    if key not in best or rank > best[key][0]:
      best[key] = (rank, row)
  return {k: r for k, (_, r) in best.items()}


def split_today(rows: list[dict]) -> tuple[list[dict], list[tuple[dict, list[str]]]]:
  """(the rows as today's code reads them, [(row, notes)] of those that ran a retired setting at
  another value than the code now has: `results.as_today`)."""
  current, gone = [], []
  for row in rows:
    today, notes = results.as_today(row)
    if notes:
      gone.append((today, notes))
    else:
      current.append(today)
  return current, gone


def fmt(value: float, unit: str) -> str:
  if unit == "tokens/s":
    return f"{value / 1e3:.1f}k" if value >= 1e4 else f"{value:,.0f}"
  if unit in ("TFLOP/s", "items/s"):
    return f"{value:.0f}"
  return f"{value:.3f}" if value < 1 else f"{value:.2f}" if value < 100 else f"{value:.1f}"


def anchor_cell(row: dict) -> str:
  a = row["anchor"]
  if a is None:
    return "-"
  higher = results.METRICS[row["metric"]][1]
  ratio = row["value"] / a["value"] if higher else a["value"] / row["value"]
  return f"{a['what']}: {fmt(a['value'], a['unit'])} {a['unit']} ({ratio:.2f}x)"


def _config_order(row: dict) -> tuple:
  family, _, scale = row["config"].rpartition("_")
  return (SCALES.get(scale, 9), family, row["overrides"] != {}, settings(row["overrides"]),
          row["metric"])


def _table(header: list[str], lines: list[list[str]]) -> list[str]:
  return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
          *("| " + " | ".join(cells) + " |" for cells in lines), ""]


def training_table(rows: list[dict]) -> list[str]:
  lines = []
  for r in sorted(rows, key=_config_order):
    x = r.get("extra", {})
    lines.append([f"`{r['config']}`", settings(r["overrides"]),
                  f"{x['step_ms']:.1f}" if "step_ms" in x else "-", fmt(r["value"], r["unit"]),
                  f"{100 * x['mfu']:.1f}%" if "mfu" in x else "-",
                  f"{x['peak_mem_gb']:.1f}" if "peak_mem_gb" in x else "-",
                  anchor_cell(r), f"`{r['id']}`"])
  return _table(["config", "settings", "step ms", "tokens/s", "MFU", "peak GB", "anchor", "result"],
                lines)


def metric_table(rows: list[dict], first: str) -> list[str]:
  lines = []
  for r in sorted(rows, key=lambda r: (r["config"], r["overrides"] != {}, settings(r["overrides"]),
                                       r["metric"])):
    name = r["config"].partition(":")[2] if first == "shape" else f"`{r['config']}`"
    lines.append([name, settings(r["overrides"]), r["metric"], f"{fmt(r['value'], r['unit'])} {r['unit']}",
                  anchor_cell(r), f"`{r['id']}`"])
  return _table([first, "settings", "metric", "value", "anchor", "result"], lines)


def retired_list(gone: list[tuple[dict, list[str]]]) -> list[str]:
  """One line a retired setting at a value the code no longer runs: what became of it, and which
  rows ran it (they stay in bench/results/)."""
  configs = {}
  for row, notes in gone:
    for note in notes:
      configs.setdefault(note, []).append(row["config"])
  return [f"- {note}; {len(c)} row{'s' * (len(c) > 1)} of {', '.join(sorted(set(c)))}"
          for note, c in sorted(configs.items())] + [""]


def page(rows: list[dict], to_measure: str) -> str:
  rows, gone = split_today(rows)
  best = list(best_rows(rows).values())
  out = ["# Performance", "",
         f"Generated by `{COMMAND}` from the rows in `bench/results/*.jsonl` (schema: `bench/results.py`);",
         f"do not edit. `{COMMAND} --check` fails when this page is stale. Each figure is the best row of",
         "its config, settings and metric on its device, and is what the code of that row's commit gave;",
         "the result id finds the row, with its date, commit and exact command. Settings: what the row ran",
         "with that differs from the defaults of its commit, less `trace_step` (a traced step is one of",
         "the timed ones) and the settings now fixed at the value the row ran (`RETIRED` in",
         "`bench/results.py`). Anchor: what the figure is compared with, and the ratio (above 1: ours is",
         "ahead). Settings no longer offered, with the rows that ran them, close each device's section.",
         "The diary before results were rows: [docs/history/benchmarks-2026.md](history/benchmarks-2026.md).",
         ""]
  for device in sorted({r["device"] for r in best} | {r["device"] for r, _ in gone}):
    here = [r for r in best if r["device"] == device]
    models = [r for r in here if ":" not in r["config"]]
    out += [f"## {device}", ""]
    train = [r for r in models if r["metric"] == TRAINING]
    if train:
      out += ["### Models: training step (`bench/train_step.py`)", "", *training_table(train)]
    other = [r for r in models if r["metric"] != TRAINING]
    if other:
      out += ["### Models: inference and evaluation", "", *metric_table(other, "config")]
    for bench in sorted({r["config"].partition(":")[0] for r in here if ":" in r["config"]}):
      kernel = [r for r in here if r["config"].partition(":")[0] == bench]
      out += [f"### Kernel: {bench} (`bench/{bench}.py`)", "", *metric_table(kernel, "shape")]
    old = [(r, n) for r, n in gone if r["device"] == device]
    if old:
      out += ["### Settings no longer offered", "", *retired_list(old)]
  out += ["## To measure", "", to_measure.strip(), ""]
  return "\n".join(out)


def readme_block(rows: list[dict]) -> str:
  """The README's short table: each device's training steps at default settings."""
  best = [r for r in best_rows(split_today(rows)[0]).values()
          if ":" not in r["config"] and r["metric"] == TRAINING and not r["overrides"]]
  lines = []
  for r in sorted(best, key=lambda r: (r["device"], _config_order(r))):
    x = r.get("extra", {})
    lines.append([r["device"], f"`{r['config']}`", fmt(r["value"], r["unit"]),
                  f"{100 * x['mfu']:.1f}%" if "mfu" in x else "-", anchor_cell(r), f"`{r['id']}`"])
  return "\n".join([f"<!-- generated by `{COMMAND}` from bench/results/; do not edit -->", "",
                    *_table(["device", "config", "tokens/s", "MFU", "anchor", "result"], lines),
                    "More, with kernels and settings: [docs/performance.md](docs/performance.md)."])


# A zoo config: its docstring, then `get_config` returning `common.experiment(family, scale)`.
_ZOO_CONFIG = re.compile(r'\A"""([^\n]*?)(?:\n.*?)?"""\n(from configs import common\n\n\ndef get_config\(\):\n'
                         r'  return common\.experiment\("\w+", "\w+"\))\n?\Z', re.S)


def _row_command(row: dict) -> str:
  """The row's command as someone reruns it for this row: of a `--runs` list, the runs of its config
  whose `/name=value` pieces all match its settings, those with the most pieces (the fp8 row keeps
  `C:single/precision=fp8`, a default row every layout without pieces; all its config's runs where
  none match); the output flags (where a GPU call wrote its files) left out."""
  words = []
  for w in shlex.split(row["command"]):
    if w.startswith(("--results=", "--out=")):
      continue
    if w.startswith("--runs="):
      runs = [r for r in w[len("--runs="):].split(",") if r.split(":")[0] == row["config"]]
      pieces = {r: results.run_pieces(r)[1] for r in runs}
      fit = [r for r in runs if all(k in row["overrides"] and results._same(row["overrides"][k], v)
                                    for k, v in pieces[r])]
      most = max((len(pieces[r]) for r in fit), default=0)
      w = "--runs=" + ",".join([r for r in fit if len(pieces[r]) == most] or runs)
    words.append(w)
  return results.join_command(words)


def config_docstring(name: str, first_line: str, rows: list[dict]) -> str:
  """The docstring of `configs/<name>.py`: its first line kept, then the command and the result."""
  lines = [first_line, "", "Train (checkpoints and TensorBoard logs in the workdir):",
           f"  python3 train.py --config=configs/{name}.py --workdir=runs/{name}"]
  mine = sorted((r for r in rows if r["config"] == name and r["metric"] == TRAINING
                 and not r["overrides"]), key=lambda r: r["device"])
  if not mine and not name.endswith("_tiny"):   # tiny models are for CPUs; nobody times their steps
    lines += ["Training step: not measured yet (docs/performance.md, \"To measure\"; the command for",
              f"  a row: python3 bench/train_step.py --runs={name}:single --steps=10)."]
  for r in mine:
    x = r.get("extra", {})
    shape = f"{x['batch']} x {x['seq_len']} tokens, " if "batch" in x and "seq_len" in x else ""
    figures = [f"{x['step_ms']:.1f} ms a step" if "step_ms" in x else None,
               f"{fmt(r['value'], r['unit'])} tokens/s",
               f"{100 * x['mfu']:.1f}% MFU" if "mfu" in x else None]
    lines += [f"Training step on {r['device']} (bench/train_step.py, random tokens):",
              f"  {_row_command(r)}",
              f"  {', '.join(f for f in figures if f)} ({shape}{r['date']}), result {r['id']}"]
  if len(lines) > 4:
    lines += [f"Written by `{COMMAND}` from bench/results/ (every figure with its anchor:",
              "docs/performance.md); do not edit below the first line."]
  return "\n".join(lines)


def config_files(rows: list[dict], configs_dir: str) -> dict[str, str]:
  """{path: text with its docstring as the rows give it} for every zoo config in `configs_dir`."""
  best = [r for r in best_rows(split_today(rows)[0]).values() if ":" not in r["config"]]
  out = {}
  for f in sorted(os.listdir(configs_dir)):
    path = os.path.join(configs_dir, f)
    if not f.endswith(".py"):
      continue
    with open(path) as fh:
      text = fh.read()
    m = _ZOO_CONFIG.match(text)
    if m:
      out[path] = f'"""{config_docstring(f[:-3], m.group(1), best)}\n"""\n{m.group(2)}\n'
  return out


def with_readme_block(text: str, block: str) -> str:
  """`text` with what lies between the markers replaced by `block` (unchanged without both)."""
  begin, end = text.find(README_BEGIN), text.find(README_END)
  if begin < 0 or end < begin:
    return text
  return text[:begin + len(README_BEGIN)] + "\n" + block + "\n" + text[end:]


def outputs(directory: str = results.RESULTS_DIR, page_path: str = PAGE,
            readme_path: str = README, configs_dir: str | None = CONFIGS) -> dict[str, str]:
  """{path: the text the rows give} for the page and, where they differ from what is there,
  README.md (with the markers) and the zoo configs of `configs_dir` (None: none)."""
  rows = results.load(directory)
  with open(os.path.join(directory, "to_measure.md")) as f:
    want = {page_path: page(rows, f.read())}
  if os.path.exists(readme_path):
    with open(readme_path) as f:
      text = f.read()
    new = with_readme_block(text, readme_block(rows))
    if new != text:
      want[readme_path] = new
  if configs_dir:
    for path, new in config_files(rows, configs_dir).items():
      with open(path) as f:
        if f.read() != new:
          want[path] = new
  return want


def main(argv=None, **paths) -> int:
  """`paths`: `outputs`' directory / page_path / readme_path (tests point them elsewhere)."""
  ap = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n")[0])
  ap.add_argument("--check", action="store_true", help="exit 1 when a generated file is stale")
  args = ap.parse_args(argv)
  try:
    want = outputs(**paths)
  except (results.RowError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  stale = []
  for path, text in want.items():
    have = open(path).read() if os.path.exists(path) else ""
    if have == text:
      continue
    if args.check:
      stale.append(path)
      sys.stdout.writelines(difflib.unified_diff(have.splitlines(True), text.splitlines(True),
                                                 path, "generated", n=1))
    else:
      with open(path, "w") as f:
        f.write(text)
      print(f"wrote {os.path.relpath(path, ROOT)}")
  if stale:
    print(f"stale: {', '.join(os.path.relpath(p, ROOT) for p in stale)}; run `{COMMAND}`",
          file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
