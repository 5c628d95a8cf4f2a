"""The routing report: per-checkpoint and between-checkpoint figures as one JSON-able dict, and
its text tables.

  report = {
    "probe": {"tokens", "seq_len", "seed", "data", "tokenizer"},
    "routers": {router: {"layer", "router", "n_experts", "top_k"}},
    "checkpoints": [{"label", "path", "step",
                     "routers": {router: routing.router_summary(...)},
                     "shared_pool": {"layer_<i>": shared_pool_summary(...)}}],
    "fluctuation": [{"from", "to", "routers": {router: {"top1_change", "jaccard"}}}],
  }
Written with `umoe_jax.output.write_json` (atomically; NaN, e.g. no repeated token id, as null).
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from umoe_jax.analysis import routing
from umoe_jax.analysis.probe import Routes, split_name
from umoe_jax.output import text_table


def shared_pool_summary(att: Routes, ffn: Routes) -> dict:
  """Attention vs FFN use of one layer's shared pool (routing.pick_overlap, attention_share)."""
  e = att.n_experts
  att_counts = routing.expert_counts(att.expert_ids, e)
  ffn_counts = routing.expert_counts(ffn.expert_ids, e)
  return {**routing.pick_overlap(att.expert_ids, ffn.expert_ids, e),
          "attention_share": routing.attention_share(att_counts, ffn_counts).tolist(),
          "attention_share_balanced": att.top_k / (att.top_k + ffn.top_k),
          "attention_picks": att_counts.tolist(), "ffn_picks": ffn_counts.tolist()}


def checkpoint_entry(label: str, ref: Any, routes: Mapping[str, Routes], token_ids: np.ndarray,
                     pairs: Sequence[tuple[int, str, str]]) -> dict:
  """One checkpoint's figures: every router's summary and every shared pool's split."""
  return {"label": label, "path": ref.path, "step": ref.step,
          "routers": {name: routing.router_summary(r.expert_ids, r.probs, token_ids, r.n_experts)
                      for name, r in routes.items()},
          "shared_pool": {f"layer_{i}": shared_pool_summary(routes[a], routes[f])
                          for i, a, f in pairs}}


def router_info(routes: Mapping[str, Routes]) -> dict:
  info = {}
  for name, r in routes.items():
    layer, kind = split_name(name)
    info[name] = {"layer": layer, "router": kind, "n_experts": r.n_experts, "top_k": r.top_k}
  return info


def fluctuation_entry(label_a: str, label_b: str, ids_a: Mapping[str, np.ndarray],
                      ids_b: Mapping[str, np.ndarray]) -> dict:
  return {"from": label_a, "to": label_b, "routers": routing.fluctuation(ids_a, ids_b)}


# ------------------------------------------------------------------------------------------------
# Text


def _fmt(x: Any, spec: str = ".3f") -> str:
  if x is None or (isinstance(x, float) and math.isnan(x)):
    return "-"
  return format(x, spec)


def mean_over_routers(fluctuation: Mapping[str, Any]) -> dict[str, float]:
  """{"top1_change", "jaccard"} of one checkpoint pair's fluctuation entry, averaged over its
  routers (the report's "mean over routers" row, the plots' black line)."""
  values = list(fluctuation["routers"].values())
  return {k: float(np.mean([v[k] for v in values])) for k in ("top1_change", "jaccard")}


def table(header: Sequence[str], rows: Sequence[Sequence[str]], group: int = 1) -> str:
  """An aligned table; a blank line wherever column `group` (the checkpoint) changes."""
  lines = text_table([header, *rows], rule=True)
  out = lines[:2]
  for i, (row, line) in enumerate(zip(rows, lines[2:])):
    if i and row[group] != rows[i - 1][group]:
      out.append("")
    out.append(line)
  return "\n".join(out)


def format_report(report: Mapping[str, Any]) -> str:
  """The report as text: a header and up to three tables."""
  p, info = report["probe"], report["routers"]
  out = [f"Routing on {p['tokens']:,} probe tokens of {p['data']} (windows of {p['seq_len']}, "
         f"seed {p['seed']}, tokenizer {p['tokenizer']}); {len(report['checkpoints'])} checkpoint(s)",
         ""]
  rows = []
  for ck in report["checkpoints"]:
    for name, s in ck["routers"].items():
      e = info[name]["n_experts"]
      rows.append([name, ck["label"], f"{e}/{info[name]['top_k']}", _fmt(s["entropy"]),
                   _fmt(math.log(e)), _fmt(s["load_max_mean"], ".2f"), _fmt(s["load_cv"], ".2f"),
                   str(s["dead_experts"]), _fmt(s["token_consistency"])])
  out += ["Per router and checkpoint (entropy in nats, ln E = uniform; load = picks per expert; "
          "token-id consistency over ids seen twice or more)",
          table(["router", "ckpt", "E/K", "entropy", "ln E", "load max/mean", "load CV", "dead",
                 "token-id consist."], rows)]
  if report["fluctuation"]:
    # One row per router and pair of checkpoints (a column pair per comparison would make the table
    # as wide as the run is long), and per pair the mean over routers (the plots' black line).
    rows = []
    for f in report["fluctuation"]:
      pair = f"{f['from']}->{f['to']}"
      for name, v in [*f["routers"].items(), ("mean over routers", mean_over_routers(f))]:
        rows.append([name, pair, _fmt(v["top1_change"]), _fmt(v["jaccard"])])
    out += ["", "Routing fluctuation between consecutive checkpoints (fraction of probe tokens whose "
            "top-1 expert changed; mean Jaccard overlap of their top-k sets)",
            table(["router", "ckpts", "top-1 changed", "top-k Jaccard"], rows)]
  shared = [(ck["label"], layer, s) for ck in report["checkpoints"]
            for layer, s in ck["shared_pool"].items()]
  if shared:
    rows = []
    for label, layer, s in shared:
      share = np.asarray([np.nan if v is None else v for v in s["attention_share"]], np.float64)
      lo, hi = (np.nanmin(share), np.nanmax(share)) if np.isfinite(share).any() else (None, None)
      rows.append([layer, label, f"{_fmt(s['top1_same'])} ({_fmt(s['top1_same_chance'])} / "
                                 f"{_fmt(s['top1_same_chance_uniform'])})",
                   f"{_fmt(s['overlap'])} ({_fmt(s['overlap_chance'])} / "
                   f"{_fmt(s['overlap_chance_uniform'])})",
                   f"{_fmt(lo, '.2f')}..{_fmt(hi, '.2f')} ({_fmt(s['attention_share_balanced'], '.2f')})"])
    out += ["", "Shared expert pool: attention vs FFN picks of each token (in brackets: chance, "
            "the value if attention and FFN picked independently, at the measured expert loads / "
            "at equal loads) and "
            "each expert's attention share of its picks (min..max over experts; proportional in "
            "brackets)", table(["layer", "ckpt", "same top-1", "top-k overlap", "attention share"],
                               rows)]
  return "\n".join(out)

