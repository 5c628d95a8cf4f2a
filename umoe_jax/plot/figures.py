"""Pictures of routing and training (matplotlib, no pyplot state: figures render with Agg).

  load_heatmap(counts)            layers x experts, one panel per router kind; colour = picks of an
                                  expert / mean picks of its router (1 = balanced), x = no pick
  attention_share_heatmap(...)    layers x experts of a shared pool: attention's share of each
                                  expert's picks, centred on the proportional share
                                  (grey cells: no value, e.g. an expert nobody picked)
  fluctuation_figure(series)      top-1 change and top-k Jaccard against the training step
  loss_figure(runs)               LM loss and perplexity (train lines, eval markers) of several runs
  relative_figure(runs, baseline) their LM loss relative to a baseline run's, in percent
  save_png(fig, path) / png_bytes(fig)
"""
from __future__ import annotations

import io
import math
from typing import Mapping, Optional, Sequence

import numpy as np
import matplotlib
from matplotlib import colors as mcolors
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import LogFormatter, MaxNLocator

from umoe_jax import storage
from umoe_jax.analysis.probe import split_name


def save_png(fig: Figure, path: str, dpi: int = 110) -> str:
  storage.write_bytes(path, png_bytes(fig, dpi))  # atomic; a local path or a URL
  return path


def png_bytes(fig: Figure, dpi: int = 90) -> bytes:
  FigureCanvasAgg(fig)
  buf = io.BytesIO()
  fig.savefig(buf, dpi=dpi, format="png")
  return buf.getvalue()


_KIND_TITLES = {"attention": "attention", "ffn": "FFN"}


def _by_kind(counts: Mapping[str, np.ndarray]) -> dict[str, dict[int, np.ndarray]]:
  """{router kind: {layer: counts}}, kinds in first-seen order of the sorted names."""
  out: dict[str, dict[int, np.ndarray]] = {}
  for name in sorted(counts, key=split_name):
    layer, kind = split_name(name)
    out.setdefault(kind, {})[layer] = np.asarray(counts[name], np.float64)
  return out


def _matrix(rows: Mapping[int, np.ndarray]) -> tuple[np.ndarray, list[int]]:
  """[L, E] of per-layer vectors (NaN where a layer's vector is shorter), and the layers."""
  layers = sorted(rows)
  width = max(len(v) for v in rows.values())
  m = np.full((len(layers), width), np.nan)
  for i, layer in enumerate(layers):
    m[i, :len(rows[layer])] = rows[layer]
  return m, layers


# Grids up to this many cells get their values written in (larger ones would be unreadable).
ANNOTATE_CELLS = 160
# Heatmaps wider than this many experts get a fixed width (13 in) instead of one growing per expert.
WIDE_EXPERTS = 32
# Cells without a value (an expert no token picked, a layer with fewer experts): grey, since white
# is the centre of both diverging scales (balanced load, proportional attention share).
NO_VALUE_COLOR = "#b0b0b0"


def _heat_axes(ax, m: np.ndarray, layers: Sequence[int], norm, cmap: str, title: str,
               mark: Optional[np.ndarray] = None, fmt: str = "{:.2f}"):
  cmap = matplotlib.colormaps[cmap].with_extremes(bad=NO_VALUE_COLOR)
  im = ax.imshow(np.ma.masked_invalid(m), aspect="auto", cmap=cmap, norm=norm,
                 interpolation="nearest")
  ax.set_title(title)
  ax.set_xlabel("expert id")
  ax.set_ylabel("layer")
  ax.set_yticks(range(len(layers)), [str(l) for l in layers])
  n_e = m.shape[1]
  step = max(1, math.ceil(n_e / 16))
  ax.set_xticks(range(0, n_e, step))
  if m.size <= ANNOTATE_CELLS:
    for (y, x), v in np.ndenumerate(m):
      if np.isfinite(v) and not (mark is not None and mark[y, x]):
        rgba = im.cmap(norm(v))
        dark = 0.299 * rgba[0] + 0.587 * rgba[1] + 0.114 * rgba[2] < 0.5
        text = "<.01" if 0 < v < 0.005 else fmt.format(v)  # "0.00" would read as never picked
        ax.text(x, y, text, ha="center", va="center", fontsize=8,
                color="white" if dark else "black")
  if mark is not None and mark.any():
    ys, xs = np.nonzero(mark)
    ax.scatter(xs, ys, marker="x", s=30, c="black", linewidths=1.2, label="no pick (dead)")
  return im


def load_heatmap(counts: Mapping[str, np.ndarray], title: str = "") -> Figure:
  """Expert load per layer: {"layer_<i>/<router>": picks per expert [E]} -> one panel per router
  kind (attention, ffn, ...), rows = layers, colour = picks / mean picks of that router."""
  kinds = _by_kind(counts)
  if not kinds:
    raise ValueError("no router counts to plot (a model without routers?)")
  rel, dead = {}, {}
  for kind, rows in kinds.items():
    m, layers = _matrix(rows)
    mean = np.nanmean(m, axis=1, keepdims=True)
    rel[kind] = (np.where(mean > 0, m / np.where(mean > 0, mean, 1.0), np.nan), layers)
    dead[kind] = np.nan_to_num(m, nan=1.0) == 0
  vmax = max(2.0, max(float(np.nanmax(r)) for r, _ in rel.values() if np.isfinite(r).any()))
  norm = mcolors.TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=vmax)
  n = len(kinds)
  widest = max(r.shape[1] for r, _ in rel.values())
  n_layers = max(len(l) for _, l in rel.values())
  panel_h = max(2.2, 0.32 * n_layers + 1.2)
  if widest > WIDE_EXPERTS:  # many experts: panels stacked, each the figure's width
    fig = Figure(figsize=(13.0, n * panel_h + 0.8), layout="constrained")
    axes = fig.subplots(n, 1, squeeze=False)[:, 0]
  elif n > 4:  # many routers per layer (SwitchHead's per-head ones): a grid of 4 columns
    cols, rows = 4, -(-n // 4)
    panel_w = max(3.5, 0.3 * widest + 1.5)
    fig = Figure(figsize=(cols * panel_w + 1.5, rows * panel_h + 0.8), layout="constrained")
    grid = fig.subplots(rows, cols, squeeze=False)
    axes = list(grid.reshape(-1)[:n])
    for ax in grid.reshape(-1)[n:]:
      ax.set_axis_off()
  else:
    widths = [max(3.5, 0.3 * rel[k][0].shape[1] + 1.5) for k in kinds]
    fig = Figure(figsize=(sum(widths) + 1.5, panel_h + 0.8), layout="constrained")
    axes = fig.subplots(1, n, squeeze=False, width_ratios=widths)[0]
  im = None
  for ax, kind in zip(axes, kinds):
    m, layers = rel[kind]
    im = _heat_axes(ax, m, layers, norm, "RdBu_r", f"{_KIND_TITLES.get(kind, kind)} router",
                    mark=dead[kind])
  cbar = fig.colorbar(im, ax=list(axes), shrink=0.9, ticks=load_ticks(vmax), format="{x:g}")
  label = "picks / mean picks of the router\n(1 = balanced, 0 = unused)"
  if any(d.any() for d in dead.values()):
    label += "\nx = expert with no pick"
  cbar.set_label(label)
  fig.suptitle(title or "Expert load per layer")
  return fig


def load_ticks(vmax: float) -> list[float]:
  """Colour-bar ticks of the load scale: 0, 0.5 and 1 (balanced) on its lower half, a few
  integers up to `vmax` on the upper (TwoSlopeNorm gives each half the same length)."""
  upper = [float(t) for t in MaxNLocator(nbins=5, integer=True).tick_values(1.0, vmax)
           if 1.0 < t <= vmax]
  return [0.0, 0.5, 1.0] + upper


def attention_share_heatmap(shares: Mapping[int, Sequence[float]], balanced: float,
                            title: str = "") -> Figure:
  """{layer: attention share of each expert's picks [E]} of a shared pool -> heatmap layers x
  experts, white at the proportional share `balanced` = K_att / (K_att + K_ffn)."""
  m, layers = _matrix({k: np.asarray([np.nan if v is None else v for v in s], np.float64)
                       for k, s in shares.items()})
  width = 13.0 if m.shape[1] > WIDE_EXPERTS else max(6.5, 0.28 * m.shape[1] + 3.0)
  fig = Figure(figsize=(width, max(3.0, 0.42 * len(layers) + 2.0)), layout="constrained")
  ax = fig.subplots()
  center = min(max(balanced, 1e-3), 1 - 1e-3)
  norm = mcolors.TwoSlopeNorm(vmin=0.0, vcenter=center, vmax=1.0)
  im = _heat_axes(ax, m, layers, norm, "PuOr_r",
                  f"attention picks / all picks of each expert (0 = FFN only, 1 = attention only;\n"
                  f"white = {balanced:.2f}, the attention's share of the top-k slots)")
  ax.title.set_fontsize(9)
  cbar = fig.colorbar(im, ax=ax, ticks=sorted({0.0, round(center, 2), 1.0}))
  cbar.set_label("attention share" + ("\n(grey = expert not picked)" if np.isnan(m).any() else ""))
  fig.suptitle(title or "Shared expert pool: attention vs FFN use")
  return fig


def fluctuation_figure(series: Mapping[str, tuple[Sequence[float], Sequence[float], Sequence[float]]],
                       title: str = "", xlabel: str = "training step",
                       highlight: Optional[str] = None,
                       reference: str = "the previous evaluation",
                       xticklabels: Optional[Mapping[float, str]] = None) -> Figure:
  """{label: (steps, top-1 change, Jaccard)} -> two panels against the step, each point compared
  with `reference`. A label of the form layer_<i>/<router> is coloured by layer and dashed for FFN
  routers; `highlight` is drawn thick and black. `xticklabels` {x: text} names the x positions
  (e.g. checkpoint pairs without steps)."""
  fig = Figure(figsize=(11.5, 4.2), layout="constrained")
  ax_change, ax_jac = fig.subplots(1, 2)
  labels = list(series)
  layered = [l for l in labels if l != highlight and _is_router(l)]
  n_layers = 1 + max((split_name(l)[0] for l in layered), default=0)
  cmap = mcolors.LinearSegmentedColormap.from_list("layers", ["#1f77b4", "#2ca02c", "#d62728"])
  layer_color = lambda layer: cmap(layer / max(n_layers - 1, 1))
  for i, label in enumerate(labels):
    steps, change, jac = series[label]
    kw = dict(marker="o", markersize=3)
    if label == highlight:
      kw.update(color="black", linewidth=2.5, markersize=6, zorder=5)
    elif _is_router(label):
      layer, kind = split_name(label)
      kw.update(color=layer_color(layer), linewidth=1.2, alpha=0.85,
                linestyle="--" if kind.startswith("ffn") else "-")
    else:
      kw.update(color=f"C{i % 10}", linewidth=1.6)
    ax_change.plot(steps, change, label=label, **kw)
    ax_jac.plot(steps, jac, label=label, **kw)
  ax_change.set_title(f"tokens whose top-1 expert changed\nsince {reference}")
  ax_change.set_ylabel("fraction of probe tokens")
  ax_jac.set_title(f"overlap of each token's top-k set\nwith {reference}")
  ax_jac.set_ylabel(r"mean Jaccard $|A \cap B| \,/\, |A \cup B|$")
  xs = sorted({float(x) for steps, _, _ in series.values() for x in steps})
  for ax in (ax_change, ax_jac):
    ax.set_xlabel(xlabel)
    if xticklabels:
      names = list(xticklabels.values())
      slanted = len(names) > 4 or max(len(n) for n in names) > 12  # else they run into each other
      ax.set_xticks(list(xticklabels), names, rotation=30 if slanted else 0,
                    ha="right" if slanted else "center", fontsize=8 if slanted else None)
    elif len(xs) <= 12:  # a tick at every measured step (a locator's would fall between them)
      ax.set_xticks(xs, [f"{x:g}" for x in xs])
    else:
      ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if len(xs) == 1:  # one comparison: a column of points, centred
      ax.set_xlim(xs[0] - 1, xs[0] + 1)
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
  handles, names = ax_jac.get_legend_handles_labels()
  if len(labels) > 12 and layered:  # many routers: explain the encoding instead of every line
    shown = sorted({0, (n_layers - 1) // 2, n_layers - 1})
    handles = [Line2D([], [], color=layer_color(l), label=f"layer {l}") for l in shown]
    kinds = {split_name(l)[1].startswith("ffn") for l in layered}
    if False in kinds:
      handles.append(Line2D([], [], color="gray", linestyle="-", label="attention router"))
    if True in kinds:
      handles.append(Line2D([], [], color="gray", linestyle="--", label="FFN router"))
    if highlight:
      handles.insert(0, Line2D([], [], color="black", linewidth=2.5, label=highlight))
    names = [h.get_label() for h in handles]
  ax_jac.legend(handles, names, loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=8,
                frameon=False)
  fig.suptitle(title or "Routing fluctuation on the probe batch")
  return fig


def _is_router(label: str) -> bool:
  try:
    split_name(label)
    return True
  except ValueError:
    return False


def loss_figure(runs: Mapping[str, Mapping[str, tuple[Sequence[float], Sequence[float]]]],
                title: str = "") -> Figure:
  """{run: {metric key: (steps, values)}} with keys train/lm_loss, eval/loss, train/perplexity,
  eval/perplexity (any may be missing) -> LM loss and perplexity panels, one colour per run,
  training as lines and evaluation as dashed lines with markers."""
  fig = Figure(figsize=(11.5, 4.2), layout="constrained")
  ax_loss, ax_ppl = fig.subplots(1, 2)
  panels = ((ax_loss, "train/lm_loss", "eval/loss"), (ax_ppl, "train/perplexity", "eval/perplexity"))
  for i, (run, series) in enumerate(runs.items()):
    color = f"C{i % 10}"
    for ax, train_key, eval_key in panels:
      if train_key in series:  # one interval (a short or crashed run): a line of one point shows
        one = len(series[train_key][0]) == 1  # nothing, so a marker
        ax.plot(*series[train_key], color=color, linewidth=1.3, alpha=0.9,
                marker="s" if one else None, markersize=4)
      if eval_key in series:
        ax.plot(*series[eval_key], color=color, linestyle="--", marker="o", markersize=4)
  ax_loss.set_title("LM loss (cross-entropy)")
  ax_loss.set_ylabel("nats per token")
  ax_ppl.set_title("perplexity")
  ax_ppl.set_ylabel("perplexity (log scale)")
  ax_ppl.set_yscale("log")
  # Plain numbers (30, 200), not the default's 3x10^1; which minor ticks get a label is unchanged.
  ax_ppl.yaxis.set_major_formatter(LogFormatter())
  ax_ppl.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))
  steps = {x for series in runs.values() for xs, _ in series.values() for x in xs}
  for ax in (ax_loss, ax_ppl):
    ax.set_xlabel("training step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if len(steps) == 1:  # one step (the evaluation at step 0 alone): its tick, not -0.045..0.045
      (x,) = steps
      ax.set_xlim(x - 1, x + 1)
      ax.set_xticks([x], [f"{x:g}"])
    ax.grid(alpha=0.3, which="both")
  handles = [Line2D([], [], color=f"C{i % 10}", linewidth=2, label=run) for i, run in enumerate(runs)]
  handles += [Line2D([], [], color="gray", label="train (interval mean)"),
              Line2D([], [], color="gray", linestyle="--", marker="o", markersize=4,
                     label="eval (held-out)")]
  ax_ppl.legend(handles=handles, loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=9,
                frameon=False)
  fig.suptitle(title or "Training curves")
  return fig


def relative_figure(runs: Mapping[str, Mapping[str, tuple[Sequence[float], Sequence[float]]]],
                    baseline: str, title: str = "", colors: Mapping[str, str] | None = None) -> Figure:
  """{run: {"train/lm_loss" / "eval/loss": (steps, percent over the baseline's)}} -> one panel,
  training as a line and evaluation as a dashed line with markers, zero marked; a run's colour is
  colors[run] (the one it has in loss_figure; default C1, C2, ... in order)."""
  colors = colors or {run: f"C{i % 10}" for i, run in enumerate(runs, 1)}
  fig = Figure(figsize=(9.0, 4.0), layout="constrained")
  ax = fig.add_subplot()
  ax.axhline(0.0, color="black", linewidth=0.8)
  for run, series in runs.items():
    color = colors[run]
    if "train/lm_loss" in series:
      ax.plot(*series["train/lm_loss"], color=color, linewidth=1.1, alpha=0.8)
    if "eval/loss" in series:
      ax.plot(*series["eval/loss"], color=color, linestyle="--", marker="o", markersize=4)
  ax.set_xlabel("training step")
  ax.set_ylabel(f"LM loss / {baseline}'s - 1 (%)")
  ax.xaxis.set_major_locator(MaxNLocator(integer=True))
  ax.grid(alpha=0.3)
  handles = [Line2D([], [], color=colors[run], linewidth=2, label=run) for run in runs]
  handles += [Line2D([], [], color="gray", label="train (interval mean)"),
              Line2D([], [], color="gray", linestyle="--", marker="o", markersize=4,
                     label="eval (held-out)")]
  ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=9, frameon=False)
  fig.suptitle(f"{title + ': ' if title else ''}LM loss relative to {baseline}")
  return fig
