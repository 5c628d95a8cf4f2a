r"""Plots of training runs from their metrics.jsonl.

  python -m umoe_jax.plot runs/a runs/b [--out=plots] [--title="..."] [--baseline=runs/a]

Writes into --out (created):
  curves.png                 LM loss and perplexity of every run against the step (training
                             interval means as lines, held-out evaluations as dashed markers);
  routing_fluctuation.png    if a run logged the routing probe (routing/... keys, every evaluation):
                             the top-1 change and top-k Jaccard against the step: one run = one line
                             per router and their mean, several runs = the mean of each run;
                             the titles say the probe's size and the steps each point is compared
                             with (routing/probe_tokens, routing/previous_step);
  relative.png               with --baseline (one of the runs): every other run's LM loss over the
                             baseline's at the steps both logged, minus 1, in percent (training
                             interval means as lines, held-out evaluations as dashed markers): the
                             differences of runs from one seed (bf16 and fp8, say) that the curves'
                             scale hides.
Each argument is a run's workdir (or its metrics.jsonl), named in the legends by its directory name
(with parent directories where two names are the same). A step logged twice (a resumed run) keeps
its last record, and the steps after a run's resume point that an earlier run logged and the resumed
run did not are dropped, as TensorBoard shows them. Needs no JAX.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Sequence

from umoe_jax import storage

CURVE_KEYS = ("train/lm_loss", "eval/loss", "train/perplexity", "eval/perplexity")
# A run's first record, {"step": S, "session_start": true}: the points earlier runs logged at step S
# or later belong to an abandoned branch (umoe_jax.train.metrics.SESSION_START).
SESSION_START = "session_start"


def read_metrics(run: str) -> dict[str, tuple[list, list]]:
  """{key: (steps, values)} of a run's metrics.jsonl, steps ascending, the last record of a step
  winning; a session start at step S drops what earlier runs logged at S or later (as TensorBoard
  drops their points). Raises ValueError naming the file (and line) when it is missing or not JSON
  lines; a last line cut short (no newline: the run was killed while writing it) is skipped with a
  note."""
  path = run if run.endswith(".jsonl") else storage.join(run, "metrics.jsonl")
  if not storage.isfile(path):
    raise ValueError(f"{run!r}: no metrics.jsonl (expected {path}); give training workdirs")
  by_key: dict[str, dict[int, float]] = {}
  with storage.open(path, "rb") as f:  # bytes: a line that is not UTF-8 is named like any other
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        # without the line end: json would place an unterminated record at "line 2 column 1"
        rec = json.loads(line.rstrip(b"\r\n").decode("utf-8"))
        step = int(rec["step"])
      except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as e:
        if not line.endswith(b"\n") and isinstance(e, (json.JSONDecodeError, UnicodeDecodeError)):
          why = e.msg if isinstance(e, json.JSONDecodeError) else f"not UTF-8: {e.reason}"
          print(f"note: {path}:{lineno}: skipped the last line, cut short ({why})",
                file=sys.stderr)
          break
        why = (f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError)  # one line
               else str(e))
        raise ValueError(f"{path}:{lineno}: not a metrics record ({type(e).__name__}: {why})") from None
      if rec.get(SESSION_START) is True:
        for points in by_key.values():
          for old in [s for s in points if s >= step]:
            del points[old]
        continue
      for key, value in rec.items():
        if key != "step" and isinstance(value, (int, float)):
          by_key.setdefault(key, {})[step] = float(value)
  out = {}
  for key, points in by_key.items():
    if not points:  # logged by an abandoned branch only
      continue
    steps = sorted(points)
    out[key] = (steps, [points[s] for s in steps])
  return out


def run_label(run: str, depth: int = 1) -> str:
  """The last `depth` components of a run's directory (runs/a/seed0 -> seed0, or a/seed0)."""
  run = run[:-len("metrics.jsonl")] if run.endswith("metrics.jsonl") else run
  parts = [p for p in os.path.normpath(run).split(os.sep) if p]
  return "/".join(parts[-depth:]) or run


def run_labels(runs: Sequence[str]) -> list[str]:
  """Legend names of several runs: their directory names, with as many parent directories as it
  takes to tell them apart (runs/a/seed0, runs/b/seed0 -> a/seed0, b/seed0); a run given twice
  gets primes."""
  depth = 1
  while True:
    labels = [run_label(r, depth) for r in runs]
    if len(set(labels)) == len(labels) or depth > max(r.count(os.sep) for r in runs) + 1:
      break
    depth += 1
  out: list[str] = []
  for label in labels:
    while label in out:
      label += "'"
    out.append(label)
  return out


RELATIVE_KEYS = ("train/lm_loss", "eval/loss")


def relative_series(metrics: dict[str, tuple[list, list]], baseline: dict[str, tuple[list, list]]
                    ) -> dict[str, tuple[list, list]]:
  """{key: (steps, 100 * (value / baseline's value - 1))} for the RELATIVE_KEYS, at the steps both
  runs logged (a key either run lacks, or one with no common step, is left out)."""
  out = {}
  for key in RELATIVE_KEYS:
    if key not in metrics or key not in baseline:
      continue
    base = dict(zip(*baseline[key]))
    points = [(s, 100.0 * (v / base[s] - 1.0)) for s, v in zip(*metrics[key]) if s in base and base[s]]
    if points:
      out[key] = ([s for s, _ in points], [r for _, r in points])
  return out


def fluctuation_series(metrics: dict[str, tuple[list, list]]) -> dict[str, tuple]:
  """{router (or "mean over routers"): (steps, top-1 change, Jaccard)} of one run's routing keys."""
  out = {}
  for key, (steps, change) in metrics.items():
    if not (key.startswith("routing/") and key.endswith("/top1_change")):
      continue
    name = key[len("routing/"):-len("/top1_change")] or "mean over routers"
    jac_steps, jac = metrics.get(f"routing/{name}/jaccard" if name != "mean over routers"
                                 else "routing/jaccard", ([], []))
    if jac_steps == steps:
      out[name] = (steps, change, jac)
  return out


def probe_context(metrics: dict[str, tuple[list, list]]) -> tuple[list[int], list[int]]:
  """(the probe sizes in tokens, the step distances between compared evaluations) a run logged,
  each sorted without repeats; empty where the run did not log them."""
  tokens = sorted({int(v) for v in metrics.get("routing/probe_tokens", ([], []))[1]})
  steps, previous = metrics.get("routing/previous_step", ([], []))
  return tokens, sorted({int(s - p) for s, p in zip(steps, previous)})


def _probe_words(tokens: Sequence[int]) -> str:
  return (f"{tokens[0]:,} tokens" if len(tokens) == 1 else
          f"{tokens[0]:,}-{tokens[-1]:,} tokens" if tokens else "")


def _reference(gaps: Sequence[int]) -> str:
  """'the evaluation 500 steps before' (one distance), else 'the previous evaluation (...)'."""
  if len(gaps) == 1:
    return f"the evaluation {gaps[0]:,} step{'s' if gaps[0] != 1 else ''} before"
  if gaps:
    return f"the previous evaluation ({gaps[0]:,}-{gaps[-1]:,} steps before)"
  return "the previous evaluation"


def plot_runs(runs: Sequence[str], out_dir: str, title: str = "", baseline: str | None = None) -> list[str]:
  """Writes the figures of the module docstring; returns their paths."""
  from umoe_jax.plot import figures as plots
  from umoe_jax.output import check_output_path

  if not runs:
    raise ValueError("give at least one run directory")
  labels = run_labels(runs)
  if baseline is not None and baseline not in runs and baseline not in labels:
    raise ValueError(f"--baseline={baseline!r} is not one of the runs ({', '.join(runs)})")
  if baseline is not None and len(runs) < 2:
    raise ValueError("--baseline needs another run to compare with it")
  metrics = {label: read_metrics(run) for run, label in zip(runs, labels)}
  curves = {label: {k: m[k] for k in CURVE_KEYS if k in m} for label, m in metrics.items()}
  if not any(curves.values()):
    raise ValueError(f"no loss records ({', '.join(CURVE_KEYS)}) in {', '.join(runs)}")
  rel = {}
  if baseline is not None:
    base = labels[list(runs).index(baseline)] if baseline in runs else baseline
    rel = {label: relative_series(m, metrics[base]) for label, m in metrics.items() if label != base}
    rel = {label: series for label, series in rel.items() if series}
    if not rel:
      raise ValueError(f"no step at which the baseline {base!r} and another run both logged "
                       f"{' or '.join(RELATIVE_KEYS)}")
  check_output_path(out_dir, "--out", directory=True)  # makes it; ValueError if it cannot be
  written = [plots.save_png(plots.loss_figure(curves, title),
                            storage.join(out_dir, "curves.png"))]
  if rel:  # each run in its curves.png colour
    colors = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    fig = plots.relative_figure(rel, base, title, colors)
    written.append(plots.save_png(fig, storage.join(out_dir, "relative.png")))
  fluct = {label: fluctuation_series(m) for label, m in metrics.items()}
  fluct = {label: f for label, f in fluct.items() if f}
  if fluct:
    context = {label: probe_context(metrics[label]) for label in fluct}
    gaps = sorted({g for _, run_gaps in context.values() for g in run_gaps})
    if len(fluct) == 1:
      (label, series), = fluct.items()
      size = _probe_words(context[label][0])
      fig = plots.fluctuation_figure(
          series, f"Routing fluctuation on the routing probe{f' ({size})' if size else ''}: {label}",
          highlight="mean over routers", reference=_reference(gaps))
    else:
      sizes = {label: _probe_words(c[0]) for label, c in context.items()}
      same = len(set(sizes.values())) == 1
      name = lambda label: label if same or not sizes[label] else f"{label} ({sizes[label]})"
      series = {name(label): f["mean over routers"] for label, f in fluct.items()
                if "mean over routers" in f}
      size = next(iter(sizes.values())) if same else ""
      fig = plots.fluctuation_figure(
          series, f"Routing fluctuation on the routing probe{f' ({size})' if size else ''}, mean "
                  "over routers", reference=_reference(gaps))
    written.append(plots.save_png(fig, storage.join(out_dir, "routing_fluctuation.png")))
  return written


def main(argv: Sequence[str] | None = None) -> int:
  import argparse
  parser = argparse.ArgumentParser(prog="python -m umoe_jax.plot", description=__doc__.split("\n\n")[0])
  parser.add_argument("runs", nargs="+", help="training workdirs (or their metrics.jsonl)")
  parser.add_argument("--out", default="plots", help="output directory (default: plots)")
  parser.add_argument("--title", default="", help="title of the curves figure")
  parser.add_argument("--baseline", default=None,
                      help="one of the runs: also plot the others' loss relative to it (relative.png)")
  args = parser.parse_args(argv)
  try:
    written = plot_runs(args.runs, args.out, args.title, args.baseline)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  for path in written:
    print(path)
  return 0
