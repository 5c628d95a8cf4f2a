r"""Routing analysis of checkpoints on a fixed probe set.

  python -m umoe_jax.analysis routing --checkpoints=runs/a/checkpoints/100,runs/a/checkpoints/200 \
      [--data=PATH|builtin] [--tokens=16384] [--seed=0] [--routers=attention,ffn] \
      [--json=routing.json] [--plots=DIR]
  python -m umoe_jax.analysis routing --checkpoints='runs/a/checkpoints/*'      # every step of a run

Prints, per layer and router (UMoE's attention and FFN routers separately): routing entropy, expert
load (max/mean, coefficient of variation, experts with no pick) and token-id consistency for each
checkpoint; the top-1 change and top-k Jaccard between consecutive checkpoints; and, for a pool
shared by attention and FFN, how often they pick the same experts and each expert's attention share.
Definitions: `umoe_jax/analysis/routing.py`; the JSON layout: `umoe_jax/analysis/report.py`.

--checkpoints: see `umoe_jax/analysis/checkpoints.py` and `umoe_jax/load.py` (step directories,
workdirs = their latest step, converted checkpoints, globs). --data: the probe corpus, a file / directory / glob read as
--source (default: from the name: .parquet, .jsonl, an ArrayRecord directory, else text files), or
"builtin"; default: the held-out data of the first checkpoint's run. The tokenizer is --tokenizer,
else the run's data.tokenizer, else the byte tokenizer. --plots writes load heatmaps per checkpoint,
the fluctuation against the step (one position per compared pair when the checkpoints are not
increasing steps of one run) and the shared pool's attention share (PNG).
"""
from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any, Callable, Optional, Sequence

from umoe_jax import console, storage

COMMANDS = ("routing",)


def infer_source(path: str) -> str:
  """The data source of a probe path: builtin, parquet, jsonl, arrayrecord (a prepared directory)
  or text."""
  if path == "builtin":
    return "builtin"
  low = path.lower()
  if low.endswith(".parquet") or (storage.isdir(path) and any(
      f.endswith(".parquet") for f in storage.listdir(path))):
    return "parquet"
  if low.endswith((".jsonl", ".json")):
    return "jsonl"
  if storage.isfile(storage.join(path, "metadata.json")):
    return "arrayrecord"
  return "text"


def probe_data_config(data: str, *, source: str, tokenizer: str, text_field: str,
                      run_config: dict) -> tuple[Any, str]:
  """(data ConfigDict whose eval split is the probe corpus, its description)."""
  from umoe_jax import data as data_lib
  from umoe_jax.load import tokenizer_spec
  from umoe_jax.train.config import _path_exists  # one definition of "exists" (globs too)

  cfg = data_lib.default_data_config()
  run_data = run_config.get("data") or {}
  if not data:
    if not run_data:
      raise ValueError("give --data=PATH (or --data=builtin): the first checkpoint has no run config "
                       "with a data section (a converted checkpoint)")
    for key in ("source", "eval_path", "text_field"):
      if key in run_data:
        cfg[key] = run_data[key]
    describe = cfg.eval_path or f"{cfg.source} held-out split"
  else:
    cfg.source = source or infer_source(data)
    if cfg.source not in data_lib.SOURCES:
      raise ValueError(f"--source={cfg.source!r}; valid: {', '.join(data_lib.SOURCES)}")
    if cfg.source != "builtin" and not _path_exists(data):
      raise ValueError(f"--data={data!r}: no such file, directory or glob match")
    cfg.eval_path = "" if cfg.source == "builtin" else data
    cfg.text_field = text_field
    describe = data if cfg.source != "builtin" else "the builtin held-out split"
  cfg.tokenizer, cfg.eos_token = tokenizer_spec(tokenizer, run_config)
  cfg.read_threads = 1
  return cfg, describe


def analyze(checkpoints: str | Sequence[str], *, data: str = "", source: str = "",
            tokenizer: str = "", text_field: str = "text", tokens: int = 16384,
            seq_len: Optional[int] = None, seed: int = 0, batch_size: int = 8,
            routers: Sequence[str] = (), compute_dtype: str = "float32",
            log: Callable[[str], None] = lambda s: None, plots_dir: str = "") -> dict:
  """The routing report (`umoe_jax.analysis.report`) of `checkpoints` on the probe. Bad input
  (checkpoints of different shapes, a probe corpus shorter than `tokens`, an unknown router name)
  raises ValueError naming the value."""
  import jax

  from umoe_jax import data as data_lib
  from umoe_jax.analysis import checkpoints as ckpt
  from umoe_jax.analysis import probe, report
  from umoe_jax.load import check_tokenizer_fits_checkpoint, load_params
  from umoe_jax.train import state as state_lib

  if batch_size < 1:  # else range(0, rows, 0) fails with a message that names no flag
    raise ValueError(f"--batch_size={batch_size} must be >= 1")
  refs = ckpt.resolve(checkpoints)
  cfgs = ckpt.model_configs(refs)
  for note in ckpt.check_same_shapes(refs, cfgs):
    log(note)
  labels = ckpt.labels(refs)
  if compute_dtype:
    cfgs = [dataclasses.replace(c, compute_dtype=compute_dtype) for c in cfgs]

  data_cfg, describe = probe_data_config(data, source=source, tokenizer=tokenizer,
                                         text_field=text_field, run_config=refs[0].config)
  try:
    tok = data_lib.load_tokenizer(data_cfg)
  except storage.StorageError:
    raise  # the store failed, not the tokenizer: its line and hint (stdout_errors)
  except (ValueError, OSError) as e:  # (their messages mostly name the tokenizer already)
    named = data_cfg.tokenizer in str(e)
    raise ValueError(str(e) if named else f"tokenizer {data_cfg.tokenizer!r}: {e}") from None
  # The checkpoint fixes the vocabulary: the advice is another --tokenizer (a LoadError, a ValueError).
  check_tokenizer_fits_checkpoint(tok, data_cfg.tokenizer, cfgs[0].vocab_size, refs[0])
  if seq_len is None:
    seq_len = min(int((refs[0].config.get("train") or {}).get("seq_len") or cfgs[0].max_seq_len),
                  cfgs[0].max_seq_len)
  if seq_len > cfgs[0].max_seq_len:
    raise ValueError(f"--seq_len={seq_len} exceeds the model's max_seq_len={cfgs[0].max_seq_len}")
  rows = probe.probe_tokens(data_cfg, tokens=tokens, seq_len=seq_len, seed=seed, describe=describe)
  token_ids = rows.reshape(-1)[:tokens]
  log(f"probe: {tokens:,} tokens of {describe} in {len(rows)} windows of {seq_len} (seed {seed})")

  result = {"probe": {"tokens": tokens, "seq_len": seq_len, "seed": seed, "data": describe,
                      "tokenizer": data_cfg.tokenizer},
            "routers": {}, "checkpoints": [], "fluctuation": []}
  fns: dict[Any, tuple] = {}
  previous = None
  selected = None
  # One bar over every checkpoint's probe windows (a terminal's stderr only: `console.progress`).
  bar = console.progress(total=len(refs) * len(rows), desc="routing", unit="window")
  with bar:
    for ref, cfg, label in zip(refs, cfgs, labels):
      if cfg not in fns:  # one compile per distinct model config
        parts = state_lib.model_parts(cfg)
        fns[cfg] = (parts, jax.jit(functools.partial(probe.route_outputs, graphdef=parts.graphdef)))
      parts, fn = fns[cfg]
      params = load_params(ref, parts.abstract_params)
      if selected is None:
        names = list(jax.eval_shape(fn, params, rows[:1]))
        if not names:
          raise ValueError(f"checkpoint {ref.path}: the model has no routers to analyse")
        selected = probe.select_routers(names, routers)
        pairs = probe.shared_pool_pairs(cfg, selected)
      routes = probe.collect(fn, params, rows, n_tokens=tokens, batch_size=batch_size,
                             routers=selected, progress=bar.update)
      del params
      if not result["routers"]:
        result["routers"] = report.router_info(routes)
      entry = report.checkpoint_entry(label, ref, routes, token_ids, pairs)
      result["checkpoints"].append(entry)
      ids = {name: r.expert_ids for name, r in routes.items()}
      if previous is not None:
        result["fluctuation"].append(report.fluctuation_entry(previous[0], label, previous[1], ids))
      previous = (label, ids)
      log(f"checkpoint {label}: {ref.path}")
      if plots_dir:
        _plot_checkpoint(plots_dir, entry, tokens)
  if plots_dir and result["fluctuation"]:
    _plot_fluctuation(plots_dir, result)
  return result


def _save_plot(plots_dir: str, fig: Any, name: str) -> None:
  """plots.save_png into --plots; a write that fails (checked before the analysis, but a disk can
  fill up since) raises ValueError naming the file: one error line, not a traceback."""
  from umoe_jax.plot import figures as plots
  path = storage.join(plots_dir, name)
  try:
    storage.makedirs(plots_dir)
    plots.save_png(fig, path)
  except OSError as e:
    raise ValueError(f"cannot write --plots={plots_dir!r}: {path!r} ({e.strerror or e})") from None


def _plot_checkpoint(plots_dir: str, entry: dict, tokens: int) -> None:
  import numpy as np

  from umoe_jax.plot import figures as plots
  label = entry["label"]
  safe = label.replace("/", "_").replace("@", "_")
  counts = {name: np.asarray(s["expert_counts"]) for name, s in entry["routers"].items()}
  _save_plot(plots_dir, plots.load_heatmap(counts, f"Expert load per layer, checkpoint {label} "
                                                  f"({tokens:,} probe tokens)"),
             f"load_heatmap_{safe}.png")
  if entry["shared_pool"]:
    shares = {int(k.split("_")[1]): v["attention_share"] for k, v in entry["shared_pool"].items()}
    balanced = next(iter(entry["shared_pool"].values()))["attention_share_balanced"]
    _save_plot(plots_dir, plots.attention_share_heatmap(
        shares, balanced, f"Shared expert pool, checkpoint {label}: attention vs FFN picks"),
        f"attention_share_{safe}.png")


def _plot_fluctuation(plots_dir: str, result: dict) -> None:
  _save_plot(plots_dir, fluctuation_plot(result), "fluctuation.png")


def fluctuation_plot(result: dict):
  """The report's fluctuation between consecutive checkpoints as a figure: against the training
  step when the checkpoints are increasing steps of one run (their labels are the steps), else one
  position per compared pair, named "A -> B" (checkpoints of different runs, converted ones)."""
  from umoe_jax.plot import figures as plots
  from umoe_jax.analysis.report import mean_over_routers
  flucts, cks = result["fluctuation"], result["checkpoints"]
  steps = [ck["step"] for ck in cks]
  by_step = (all(ck["step"] is not None and ck["label"] == str(ck["step"]) for ck in cks)
             and all(a < b for a, b in zip(steps, steps[1:])))
  x = steps[1:] if by_step else list(range(1, len(flucts) + 1))
  names = list(flucts[0]["routers"])
  series = {name: (x, [f["routers"][name]["top1_change"] for f in flucts],
                   [f["routers"][name]["jaccard"] for f in flucts]) for name in names}
  means = [mean_over_routers(f) for f in flucts]
  series["mean over routers"] = (x, [m["top1_change"] for m in means], [m["jaccard"] for m in means])
  gaps = {b - a for a, b in zip(steps, steps[1:])} if by_step else set()
  reference = (f"the checkpoint {gaps.pop():,} steps before" if len(gaps) == 1 else
               "the previous checkpoint")
  return plots.fluctuation_figure(
      series, f"Routing change between consecutive checkpoints ({result['probe']['tokens']:,} "
              f"probe tokens)",
      xlabel="training step of the later checkpoint" if by_step else "checkpoints compared",
      highlight="mean over routers", reference=reference,
      xticklabels=None if by_step else {i: f"{f['from']} -> {f['to']}"
                                        for i, f in zip(x, flucts)})


def define_flags():
  from absl import flags
  flags.DEFINE_string("checkpoints", None, "Comma-separated checkpoints (step directories, workdirs, "
                      "converted checkpoints; globs), compared in this order.")
  flags.DEFINE_string("data", "", 'Probe corpus: file, directory, glob, or "builtin" (default: the '
                      "first checkpoint's held-out data).")
  flags.DEFINE_string("source", "", "Data source of --data (default: inferred from the name).")
  flags.DEFINE_string("text_field", "text", "Text column (parquet) / key (jsonl) of --data.")
  flags.DEFINE_string("tokenizer", "", '"byte" or a tokenizer.json (default: the run\'s).')
  flags.DEFINE_integer("tokens", 16384, "Probe tokens N.")
  flags.DEFINE_integer("seq_len", None, "Tokens per probe window (default: the run's train.seq_len).")
  flags.DEFINE_integer("seed", 0, "Seed of the probe's document order.")
  flags.DEFINE_integer("batch_size", 8, "Probe windows per forward pass (at most the power of "
                       "two that holds every window).")
  flags.DEFINE_list("routers", [], "Routers to report: kinds (attention, ffn, ...) or full names "
                    "(layer_0/ffn); default all.")
  flags.DEFINE_string("compute_dtype", "float32", 'Compute dtype ("" = the config\'s).')
  flags.DEFINE_string("json", "", "Write the report to this JSON file.")
  flags.DEFINE_string("plots", "", "Write PNG plots into this directory.")
  # `--help` lists the key flags of the program's file (sys.argv[0]), not of this module.
  for flag in flags.FLAGS.get_key_flags_for_module(__name__):
    flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)
  return flags.FLAGS


def main(argv) -> int:
  from absl import flags, logging

  from umoe_jax.analysis import report
  from umoe_jax.output import check_output_path, write_json

  if len(argv) < 2 or argv[1] not in COMMANDS:
    raise SystemExit(f"usage: python -m umoe_jax.analysis {{{'|'.join(COMMANDS)}}} --checkpoints=... "
                     f"(got {' '.join(argv[1:]) or 'no command'})")
  if len(argv) > 2:
    raise SystemExit(f"unexpected arguments: {argv[2:]}")
  f = flags.FLAGS
  if not f["verbosity"].present:  # Orbax's INFO lines (a dozen per checkpoint read) hide the report
    logging.set_verbosity(logging.WARNING)
  if not f.checkpoints:
    raise SystemExit("--checkpoints=A,B,... is required")
  log = console.note  # (stderr, above the progress bar on a terminal)
  from umoe_jax.train.checkpoint import quiet_orphaned_orbax_work
  quiet_orphaned_orbax_work()  # a damaged checkpoint: its error line, not TensorStore's echoes
  try:
    for flag, path, directory in (("--json", f.json, False), ("--plots", f.plots, True)):
      if path:  # before the analysis: the results could not be written at its end
        check_output_path(path, flag, directory=directory)
    result = analyze(f.checkpoints, data=f.data, source=f.source, tokenizer=f.tokenizer,
                     text_field=f.text_field, tokens=f.tokens, seq_len=f.seq_len, seed=f.seed,
                     batch_size=f.batch_size, routers=f.routers, compute_dtype=f.compute_dtype,
                     log=log, plots_dir=f.plots)
  except ValueError as e:
    raise SystemExit(f"error: {e}") from None
  print(report.format_report(result))
  if f.json:
    try:
      write_json(f.json, result, indent=1)
    except OSError as e:  # checked before the analysis, but a disk can fill up since
      raise SystemExit(f"error: cannot write --json={f.json!r} ({e.strerror or e}); the results "
                       "are the report above") from None
    log(f"wrote {f.json}")
  if f.plots:
    log(f"wrote plots to {f.plots}")
  return 0

