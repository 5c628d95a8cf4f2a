"""Training metrics: interval summaries, MFU, and the writers (TensorBoard, JSONL, console).

TensorBoard files are written with tensorboard's record framing and protos (no TensorFlow or torch
import); they and metrics.jsonl go through umoe_jax/storage (`AppendFile`), so a workdir in a bucket
works (there the files are re-uploaded whole every `storage.append.REMOTE_FLUSH_SECS` and at close).

Names (TensorBoard tags = JSONL keys):
  train/loss, train/lm_loss, train/perplexity (exp lm_loss), train/balance_loss (all routers),
  train/<name> for each other router loss summed over routers (train/z_loss, ...),
  train/learning_rate, train/grad_norm (before clipping), train/param_norm (after the interval's
  last step), train/skipped_steps (so far, the whole run), train/interval_skipped_steps (updates
  dropped in this log interval; the interval means above and below are over its finite steps only,
  so one NaN step does not blank the interval),
  perf/tokens_per_sec, perf/tokens_per_sec_per_device, perf/step_time_s, perf/mfu (if peak known),
  moe/<layer>/<router>/{balance_loss, entropy, load_max_mean, load_p50_mean, load_p90_mean,
      load_cv} per router (and its other losses, z_loss ..., and bias_spread under aux-loss-free
      balancing), e.g. moe/layer_0/attention/balance_loss; load_max_mean = max_e count_e /
      mean_e count_e, load_p50_mean and load_p90_mean the median and 90th percentile over experts
      over the mean (`umoe_jax.train.expert_load`), and load_cv = std_e / mean_e of the per-step
      expert counts, averaged over the interval;
  moe/<layer>/<router>/dead_experts, moe/dead_experts: experts that received no token over the last
      log.dead_expert_window steps (`umoe_jax.train.expert_load`);
  moe/<layer>/<router>/expert_load: histogram over expert ids weighted by routed tokens (interval);
  eval/loss, eval/perplexity;
  routing/... (routing fluctuation on a probe batch at every evaluation, images of its expert load:
      `umoe_jax.train.routing_probe`).
Every run starts with a session mark at the first step it logs (`MetricWriter.start_session`): a
`SessionLog.START` event, upon which TensorBoard drops the points of earlier runs at that step or
later, and the JSONL record {"step": <that step>, "session_start": true}, read the same way by
`umoe_jax.plot.read_metrics`. So a run resumed from an older step than the last one logged (a
damaged latest checkpoint, checkpoint.restore_step, a kill after the last save) shows the re-run
steps once, with the new values.
Every writer acts on process 0 only. Other writers (`umoe_jax.train.wandb_writer`) take the same
records from `MetricWriter` (its `sinks`).
"""
from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import socket
import struct
import time
from typing import Any, Mapping, Optional, Sequence

import numpy as np
from absl import logging

from umoe_jax import storage
from umoe_jax.analysis.routing import load_balance  # noqa: F401  (also metrics_lib.load_balance)
from umoe_jax.train.expert_load import load_percentiles
from umoe_jax.train.workdir import WorkdirError, write_failed

# bf16 dense peak FLOP/s per device, matched by substring of `jax.Device.device_kind` (first match).
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989e12),
    ("GH200", 989e12),
    ("H100", 989e12),        # SXM; the PCIe card is 756e12: set log.peak_flops
    ("H800", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L4", 121e12),
    # TPU device kinds: v5e "TPU v5 lite", v5p "TPU v5" (or "TPU v5p"), v6e "TPU v6 lite"
    # (umoe_jax.ops.pallas_tpu); "TPU v5 lite" must come before "TPU v5".
    ("TPU v6", 918e12),      # v6e
    ("TPU v5 lite", 197e12),  # v5e
    ("TPU v5e", 197e12),
    ("TPU v5", 459e12),      # v5p
    ("TPU v4", 275e12),
)


def peak_flops_per_device(device_kind: str, override: Optional[float] = None) -> Optional[float]:
  if override:
    return float(override)
  for name, flops in PEAK_FLOPS:
    if name.lower() in device_kind.lower():
      return flops
  return None


def train_flops_per_token(model_cfg: Any, seq_len: int) -> float:
  """Model FLOPs of one trained token (forward + backward), from `umoe_jax.stats`."""
  from umoe_jax import stats
  return float(stats.train_flops_per_token(model_cfg, seq_len))


def router_tag(name: str, metric: str) -> str:
  """'layer_3/attention' -> 'moe/layer_3/attention/<metric>'."""
  return f"moe/{name}/{metric}"


def summarize(steps: Sequence[Mapping[str, Any]]) -> tuple[dict[str, float], dict[str, np.ndarray]]:
  """Per-step host metrics (from `train_step`) of one interval -> (scalars, expert-count sums).

  Scalars are interval means over the steps whose loss and gradient norm are finite (over all
  steps, so NaN / inf, if none is); per-router load statistics are computed step by step and
  averaged over the same steps, expert counts summed over them.
  `train/interval_skipped_steps` counts the steps whose update was dropped (`applied` == 0).
  """
  skipped = sum(1 for s in steps if not int(s.get("applied", 1 - int(s.get("nonfinite", 0)))))
  finite = [s for s in steps if not int(s.get("nonfinite", 0))]
  steps = finite or steps  # an interval of non-finite steps only: its means are NaN / inf
  mean = lambda key: float(np.mean([float(s[key]) for s in steps]))
  lm_loss = mean("lm_loss")
  scalars = {
      "train/loss": mean("loss"),
      "train/lm_loss": lm_loss,
      "train/perplexity": math.exp(min(lm_loss, 80.0)),
      "train/balance_loss": mean("balance_loss"),
      "train/learning_rate": mean("learning_rate"),
      "train/grad_norm": mean("grad_norm"),
      "train/interval_skipped_steps": float(skipped),
  }
  for name in sorted(steps[0].get("router_losses", {})):   # z_loss, ...: each on its own
    scalars[f"train/{name}"] = float(np.mean([float(s["router_losses"][name]) for s in steps]))
  if "ep_dropped_rows" in steps[0]:   # expert parallelism with a capacity factor: rows per step
    scalars["train/ep_dropped_rows"] = mean("ep_dropped_rows")
  if "param_norm" in steps[-1]:
    scalars["train/param_norm"] = float(steps[-1]["param_norm"])
  routers, counts = router_summary(steps)
  return {**scalars, **routers}, counts


def router_summary(steps: Sequence[Mapping[str, Any]]) -> tuple[dict[str, float], dict[str, np.ndarray]]:
  """The steps' `routers` metrics ({name: {"balance_loss", "entropy", "expert_counts" [E], ...}})
  -> (interval means of every scalar and of the per-step load max/mean and CV per router, tagged
  `router_tag`; expert-count sums per router)."""
  scalars: dict[str, float] = {}
  counts: dict[str, np.ndarray] = {}
  for name in sorted(steps[0]["routers"]):
    per_step = [s["routers"][name] for s in steps]
    for key in per_step[0]:
      if np.ndim(per_step[0][key]) == 0:
        scalars[router_tag(name, key)] = float(np.mean([float(r[key]) for r in per_step]))
    if "expert_counts" in per_step[0]:
      loads = [load_balance(r["expert_counts"]) for r in per_step]
      scalars[router_tag(name, "load_max_mean")] = float(np.mean([x[0] for x in loads]))
      scalars[router_tag(name, "load_cv")] = float(np.mean([x[1] for x in loads]))
      percentiles = [load_percentiles(r["expert_counts"]) for r in per_step]
      scalars[router_tag(name, "load_p50_mean")] = float(np.mean([x[0] for x in percentiles]))
      scalars[router_tag(name, "load_p90_mean")] = float(np.mean([x[1] for x in percentiles]))
      counts[name] = np.sum([np.asarray(r["expert_counts"], np.float64) for r in per_step], axis=0)
  return scalars, counts


def perf_scalars(*, steps: int, tokens: float, seconds: float, num_devices: int,
                 flops_per_token: Optional[float], peak_flops: Optional[float]) -> dict[str, float]:
  out = {"perf/step_time_s": seconds / max(steps, 1)}
  if seconds > 0:
    tps = tokens / seconds
    out["perf/tokens_per_sec"] = tps
    out["perf/tokens_per_sec_per_device"] = tps / num_devices
    if flops_per_token and peak_flops:
      out["perf/mfu"] = flops_per_token * tps / (peak_flops * num_devices)
  return out


def duration(seconds: float) -> str:
  """3725.2 -> '1:02:05'; '-' if unknown."""
  if seconds is None or not math.isfinite(seconds) or seconds < 0:
    return "-"
  s = int(round(seconds))
  return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


# The routers' other losses (`RouterOutput.aux_losses`) the console line shows as loss terms.
ROUTER_LOSS_NAMES = ("z_loss", "entropy_loss")


def console_line(step: int, num_steps: int, s: Mapping[str, float], *,
                 elapsed_s: Optional[float] = None, eta_s: Optional[float] = None) -> str:
  """'step   120/300 | loss 3.412 (lm 3.398 bal 0.0140) | ppl 29.9 | lr 1.9e-03 | gnorm 0.61 | ...
  | 0:01:05 elapsed, ETA 0:02:10' (elapsed: since the run started; ETA: remaining steps at the
  interval's step time)."""
  # The loss's terms: LM, balance, and the routers' other losses (z_loss, ...) when configured.
  terms = "".join(f" {name.removesuffix('_loss')} {s[f'train/{name}']:.4f}"
                  for name in ROUTER_LOSS_NAMES if f"train/{name}" in s)
  parts = [f"step {step:>{len(str(num_steps))}d}/{num_steps}",
           f"loss {s['train/loss']:.4f} (lm {s['train/lm_loss']:.4f} bal "
           f"{s['train/balance_loss']:.4f}{terms})",
           f"ppl {s['train/perplexity']:.2f}",
           f"lr {s['train/learning_rate']:.2e}",
           f"gnorm {s['train/grad_norm']:.3f}"]
  if "perf/tokens_per_sec" in s:
    parts.append(f"{s['perf/tokens_per_sec']:,.0f} tok/s")
  if "perf/mfu" in s:
    parts.append(f"mfu {100 * s['perf/mfu']:.2f}%")
  parts.append(f"{s['perf/step_time_s']:.3f} s/step")
  loads = [v for k, v in s.items() if k.endswith("/load_max_mean")]
  if loads:
    parts.append(f"load max/mean {max(loads):.2f}")
  if s.get("moe/dead_experts"):   # no token over log.dead_expert_window steps
    parts.append(f"dead experts {int(s['moe/dead_experts'])}")
  if s.get("train/ep_dropped_rows"):   # expert buffers full (expert_parallel.capacity_factor)
    parts.append(f"dropped {s['train/ep_dropped_rows']:,.0f} rows/step")
  if s.get("train/skipped_steps"):
    parts.append(f"skipped {int(s['train/skipped_steps'])}")
  if elapsed_s is not None:
    parts.append(f"{duration(elapsed_s)} elapsed, ETA {duration(eta_s)}")
  return " | ".join(parts)


# The JSONL key of a run's first record (`MetricWriter.start_session`).
SESSION_START = "session_start"


class _EventWriter:
  """A TensorBoard event file (`events.out.tfevents.<time>.<host>.<pid>.<n>` in `logdir`):
  tensorboard's protos and TFRecord framing (no TensorFlow, no torch), written through an
  `AppendFile` (local or remote)."""

  _count = itertools.count()

  def __init__(self, logdir: str):
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter
    self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
    name = (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}."
            f"{next(self._count)}")
    self.path = storage.join(logdir, name)
    with _writing(self.path):
      self._file = storage.AppendFile(self.path)
      self._records = RecordWriter(self._file)
      self._write(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2",
                                  source_metadata=event_pb2.SourceMetadata(writer="umoe_jax")))
      self.flush()

  def _write(self, event) -> None:
    self._records.write(event.SerializeToString())

  def _add(self, step: int, values: list) -> None:
    summary = self._summary_pb2.Summary(value=values)
    self._write(self._event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary))

  def session_start(self, step: int) -> None:
    # TensorBoard's loader purges the points at `step` or later that it read before this event.
    log = self._event_pb2.SessionLog(status=self._event_pb2.SessionLog.START)
    self._write(self._event_pb2.Event(wall_time=time.time(), step=int(step), session_log=log))

  def scalars(self, step: int, values: Mapping[str, float]) -> None:
    self._add(step, [self._summary_pb2.Summary.Value(tag=k, simple_value=float(v))
                     for k, v in values.items()])

  def histogram(self, step: int, tag: str, *, bucket_limits: Sequence[float],
                bucket_counts: Sequence[float], min: float, max: float, num: float, sum: float,
                sum_squares: float) -> None:  # pylint: disable=redefined-builtin
    histo = self._summary_pb2.HistogramProto(
        min=min, max=max, num=num, sum=sum, sum_squares=sum_squares,
        bucket_limit=list(bucket_limits), bucket=list(bucket_counts))
    self._add(step, [self._summary_pb2.Summary.Value(tag=tag, histo=histo)])

  def image(self, step: int, tag: str, png: bytes) -> None:
    width, height = struct.unpack(">II", png[16:24])  # the PNG header's IHDR chunk
    image = self._summary_pb2.Summary.Image(height=height, width=width, colorspace=4,
                                            encoded_image_string=png)
    self._add(step, [self._summary_pb2.Summary.Value(tag=tag, image=image)])

  def flush(self) -> None:
    self._file.flush()

  def close(self) -> None:
    self._file.close()


@contextlib.contextmanager
def _writing(path: str):
  """A local write into the workdir that fails (a full disk, ...) raises WorkdirError naming the
  file, not a bare OSError (a remote one raises StorageError naming the URL already)."""
  try:
    yield
  except storage.StorageError:
    raise
  except OSError as e:
    raise write_failed(path, e) from e


class MetricWriter:
  """TensorBoard event files + a JSONL file (local paths or URLs: umoe_jax/storage). Only the
  process with `is_main` writes anything. A write that fails raises WorkdirError naming the file.
  Use as a context manager (or call `close`): on an exception it closes without raising again."""

  def __init__(self, workdir: str, *, tensorboard: bool = True, jsonl: bool = True,
               is_main: bool = True, sinks: Sequence[Any] = ()):
    """`sinks`: other writers with scalars(step, values), histogram(step, tag, counts),
    image(step, tag, png) and close() (`umoe_jax.train.wandb_writer`), given every record the
    TensorBoard file gets; closed with this writer."""
    self.is_main = is_main
    self._tb = None
    self._jsonl = None
    self._sinks = list(sinks) if is_main else []
    if not is_main:
      return
    with _writing(workdir):
      storage.makedirs(workdir)
    if tensorboard:
      self._tb = _EventWriter(storage.join(workdir, "tensorboard"))
    if jsonl:
      path = storage.join(workdir, "metrics.jsonl")
      with _writing(path):
        self._jsonl = storage.AppendFile(path, lines=True)

  def start_session(self, first_step: int) -> None:
    """Marks the start of a run that logs from `first_step` on: the points earlier runs logged at
    that step or later belong to an abandoned branch (a resume from an older step) and are dropped
    by TensorBoard and `umoe_jax.plot.read_metrics`."""
    if not self.is_main:
      return
    if self._tb is not None:
      with _writing(self._tb.path):
        self._tb.session_start(first_step)
        self._tb.flush()
    if self._jsonl is not None:
      with _writing(self._jsonl.path):
        self._jsonl.write(json.dumps({"step": int(first_step), SESSION_START: True}) + "\n")
        self._jsonl.flush()

  def scalars(self, step: int, values: Mapping[str, float]) -> None:
    if not self.is_main:
      return
    finite = {k: float(v) for k, v in values.items() if v is not None and math.isfinite(v)}
    if self._tb is not None:
      with _writing(self._tb.path):
        self._tb.scalars(step, finite)
        self._tb.flush()
    for sink in self._sinks:
      sink.scalars(step, finite)
    if self._jsonl is not None:
      record = {"step": int(step), **{k: finite.get(k) for k in values}}
      with _writing(self._jsonl.path):
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()

  def expert_histograms(self, step: int, counts: Mapping[str, np.ndarray]) -> None:
    """One histogram per router: bucket e = expert e, height = tokens routed to it."""
    if not self.is_main:
      return
    for name, c in counts.items():
      c = np.asarray(c, np.float64)
      ids = np.arange(len(c), dtype=np.float64)
      total = float(c.sum())
      if total <= 0:
        continue
      for sink in self._sinks:
        sink.histogram(step, router_tag(name, "expert_load"), c)
      if self._tb is None:
        continue
      with _writing(self._tb.path):
        self._tb.histogram(
            step, router_tag(name, "expert_load"), bucket_limits=(ids + 0.5).tolist(),
            bucket_counts=c.tolist(), min=0.0, max=float(len(c) - 1), num=total,
            sum=float((ids * c).sum()), sum_squares=float((ids * ids * c).sum()))

  def image(self, step: int, tag: str, png: bytes) -> None:
    """A PNG image (e.g. `umoe_jax.plot.figures.png_bytes(fig)`) in TensorBoard's images tab."""
    if self.is_main and self._tb is not None:
      with _writing(self._tb.path):
        self._tb.image(step, tag, png)
    for sink in self._sinks:
      sink.image(step, tag, png)

  def flush(self) -> None:
    if self._tb is not None:
      with _writing(self._tb.path):
        self._tb.flush()
    if self._jsonl is not None:
      with _writing(self._jsonl.path):
        self._jsonl.flush()

  def close(self, *, quiet: bool = False) -> None:
    """Closes both files. A write that fails here raises WorkdirError, or (quiet=True, while
    another error is being reported) is logged."""
    tb, jsonl, self._tb, self._jsonl = self._tb, self._jsonl, None, None
    sinks, self._sinks = self._sinks, []
    error = None
    for f in (tb, jsonl):
      if f is None:
        continue
      try:
        with _writing(f.path):
          f.close()
      except (WorkdirError, storage.StorageError) as e:
        error = error or e
    for sink in sinks:
      try:
        sink.close()
      except Exception as e:  # pylint: disable=broad-except  (the run's own files are closed)
        logging.warning("closing %s failed: %s: %s", type(sink).__name__, type(e).__name__, e)
    if error is not None:
      if not quiet:
        raise error
      logging.error("%s", error)

  def __enter__(self) -> "MetricWriter":
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    self.close(quiet=exc_type is not None)


def log_line(line: str) -> None:
  logging.info("%s", line)
