"""Every picture umoe-jax draws (matplotlib, rendered with Agg; no pyplot state):

  figures.py  the figures: expert-load and attention-share heatmaps, routing fluctuation, loss curves
  runs.py     reading runs' metrics.jsonl and the command that plots them:
              python -m umoe_jax.plot runs/a runs/b [--out=plots] [--title="..."]

The trainer (TensorBoard images), the routing analysis and the command all draw through figures.py.
"""
from umoe_jax.plot.runs import main, plot_runs, read_metrics, run_label, run_labels  # noqa: F401
