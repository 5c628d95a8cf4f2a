"""Weights & Biases logging (`log.wandb=True`): the records TensorBoard gets, in a W&B run.

`pip install -r requirements-wandb.txt`. The run gets every scalar of `umoe_jax.train.metrics` under
the same name, the expert-load histograms and the images (the routing probe's load heatmap), at the
trainer's step, and the whole config as its config. Keys:
  log.wandb_project, log.wandb_name ("" = the workdir's directory name), log.wandb_mode:
  "online"; "offline" writes the run under WORKDIR/wandb (or $WANDB_DIR) for `wandb sync` later;
  "disabled" makes every call a no-op.
The run's id is kept in WORKDIR/wandb_run_id, so a resumed run continues the same W&B run. W&B keeps
one value per step and drops points at steps below its latest, so after a resume from an older
checkpoint the re-run steps show in TensorBoard and metrics.jsonl but not in W&B until they pass
the steps already logged. Only process 0 logs. The console is left alone (no capture of stdout).
"""
from __future__ import annotations

import io
import os
import secrets
import string
from typing import Any, Mapping, Optional

import numpy as np

from umoe_jax import storage
from umoe_jax.config import ConfigError

MODES = ("online", "offline", "disabled")
RUN_ID_FILE = "wandb_run_id"
REQUIREMENTS = "requirements-wandb.txt"


def check(log: Any) -> None:
  """ConfigError for bad log.wandb_* values, or log.wandb=True without the wandb package."""
  if not log.get("wandb"):
    return
  if log.wandb_mode not in MODES:
    raise ConfigError(f"log.wandb_mode={log.wandb_mode!r}; valid: {', '.join(MODES)}")
  if not isinstance(log.wandb_project, str) or not log.wandb_project:
    raise ConfigError(f"log.wandb_project={log.wandb_project!r} must be a non-empty project name")
  import importlib.util
  if importlib.util.find_spec("wandb") is None:
    raise ConfigError(f"log.wandb=True needs the wandb package: pip install -r {REQUIREMENTS}")


def _run_id(workdir: str) -> str:
  """The W&B run id of this workdir: read from RUN_ID_FILE, or made and written there."""
  path = storage.join(workdir, RUN_ID_FILE)
  if storage.exists(path):
    run_id = storage.read_text(path).strip()
    if run_id:
      return run_id
  # W&B run ids are lowercase letters and digits (as W&B's own, 8 of them).
  run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
  storage.write_text(path, run_id + "\n")
  return run_id


class WandbWriter:
  """A sink of `metrics.MetricWriter`: scalars, histograms and images into one W&B run."""

  def __init__(self, run: Any):
    self._run = run

  @classmethod
  def from_config(cls, config: Any, workdir: str) -> Optional["WandbWriter"]:
    """The writer of `config.log` (None when log.wandb is off); call on process 0 only."""
    log = config.log
    if not log.get("wandb"):
      return None
    import wandb
    name = log.wandb_name or os.path.basename(storage.abspath(workdir).rstrip("/"))
    local = not storage.is_url(workdir)
    run_id = _run_id(workdir)
    try:
      run = wandb.init(
          project=log.wandb_project, name=name, mode=log.wandb_mode, id=run_id,
          resume="allow", config=config.to_dict(),
          dir=workdir if local and not os.environ.get("WANDB_DIR") else None,
          settings=wandb.Settings(console="off"))
    except Exception as e:  # pylint: disable=broad-except  (no key, no network, bad project ...)
      hint = " (without network: --config.log.wandb_mode=offline)" if log.wandb_mode == "online" else ""
      raise ConfigError(f"log.wandb: wandb.init failed: {type(e).__name__}: {e}{hint}") from None
    return cls(run)

  def scalars(self, step: int, values: Mapping[str, float]) -> None:
    self._run.log(dict(values), step=int(step))

  def histogram(self, step: int, tag: str, counts: np.ndarray) -> None:
    """Bucket e = expert e (edges e - 0.5 .. e + 0.5), height = tokens routed to it."""
    import wandb
    counts = np.asarray(counts, np.float64)
    edges = np.arange(len(counts) + 1, dtype=np.float64) - 0.5
    self._run.log({tag: wandb.Histogram(np_histogram=(counts, edges))}, step=int(step))

  def image(self, step: int, tag: str, png: bytes) -> None:
    import wandb
    from matplotlib import image as mimage
    pixels = mimage.imread(io.BytesIO(png), format="png")  # float [H, W, C] in [0, 1]
    self._run.log({tag: wandb.Image((pixels * 255).round().astype(np.uint8))}, step=int(step))

  def close(self) -> None:
    self._run.finish()
