"""Divergence guards: no checkpoint of a wrecked state, no endless run of skipped steps.

A run can go bad without a NaN: a learning rate that explodes leaves a finite state whose weights
are already huge, and checkpointing it would push the last sane checkpoint out of rotation. So the
loop asks `SaveGuard.check()` before each save, from the host metrics of every step (loss,
param_norm after the update, applied). A save is refused when

  * the parameter norm is not finite, or is more than `checkpoint.max_param_norm_ratio` x the norm
    at the last checkpoint that passed. The reference is the checkpoint a run resumed from (or the
    first step of a run that resumed or started from `init_from`: trained weights); a run from
    scratch has none until its first save passes, because freshly initialised weights (std 0.02)
    can legitimately grow several-fold in the first hundreds of steps;
  * the mean of the last TAIL finite losses since the previous check is above
    `checkpoint.max_loss_ratio` x the median of the WINDOW finite losses before them (with at least
    MIN_HISTORY of them; a resumed run uses the median saved with its checkpoint until then).

Steps whose update was dropped (non-finite, `train.on_nonfinite="skip"`) leave the state as it
was, so they are not held against it: their losses are simply not counted. A ratio of 0 disables
its check. The reference values travel with each checkpoint (`metadata()`, passed back as
`reference`), so a resumed run is judged against the same norm.

`SkipLimit`: more than `train.max_consecutive_skips` dropped updates in a row (0: no limit) raise
DivergenceError, and so does a run that applied none of its steps.
"""
from __future__ import annotations

import collections
import math
from typing import Any, Mapping, Optional

import numpy as np


class DivergenceError(RuntimeError):
  """The run diverged: too many skipped steps, or a state that fails the pre-save check."""


class SaveGuard:
  """Judges the state at a save point from the metrics of the steps that led to it."""

  WINDOW = 200       # finite losses the median is taken over
  TAIL = 10          # latest losses compared with that median
  MIN_HISTORY = 8    # losses needed before the loss check applies

  def __init__(self, *, max_loss_ratio: float, max_param_norm_ratio: float,
               reference: Optional[Mapping[str, Any]] = None, trained_start: bool = False):
    """`reference`: the metadata() saved with the checkpoint the run resumed from; `trained_start`:
    the run starts from trained weights (a checkpoint or init_from), so its first step is a norm
    reference when `reference` has none."""
    self.max_loss_ratio = max_loss_ratio
    self.max_param_norm_ratio = max_param_norm_ratio
    reference = reference or {}
    self.ref_norm: Optional[float] = reference.get("param_norm")
    self.ref_what = (f"at step {reference['step']}, the checkpoint this run resumed from"
                     if "step" in reference else "at the checkpoint this run resumed from")
    self.saved_median: Optional[float] = reference.get("loss_median")
    self.trained_start = trained_start
    self.losses: collections.deque = collections.deque(maxlen=self.WINDOW + self.TAIL)
    self.new = 0                             # finite losses since the last check
    self.param_norm: Optional[float] = None  # after the latest step
    self.step: Optional[int] = None          # the latest step observed

  def observe(self, step: int, m: Mapping[str, Any]) -> None:
    """One step's host metrics: "loss", "applied" and "param_norm" (after the step)."""
    self.step = step
    if int(m.get("applied", 1)):
      loss = float(m["loss"])
      if math.isfinite(loss):
        self.losses.append(loss)
        self.new += 1
    if "param_norm" in m:
      self.param_norm = float(m["param_norm"])
      if self.ref_norm is None and self.trained_start and math.isfinite(self.param_norm):
        self.ref_norm = self.param_norm
        self.ref_what = f"after step {step}, the first of this run"

  def _median(self, losses: list) -> Optional[float]:
    if len(losses) >= self.MIN_HISTORY:
      return float(np.median(losses[-self.WINDOW:]))
    return self.saved_median

  def check(self) -> Optional[str]:
    """None if the current state may be saved, else the reason it may not."""
    norm = self.param_norm
    if norm is not None and not math.isfinite(norm):
      return f"the parameter norm is {norm}"
    if (self.max_param_norm_ratio and norm is not None and self.ref_norm
        and norm > self.max_param_norm_ratio * self.ref_norm):
      return (f"the parameter norm grew to {norm:.4g}, {norm / self.ref_norm:.3g}x its "
              f"{self.ref_norm:.4g} {self.ref_what} (checkpoint.max_param_norm_ratio="
              f"{self.max_param_norm_ratio:g})")
    if self.max_loss_ratio and self.new:
      losses = list(self.losses)
      k = min(self.TAIL, self.new)
      tail, before = losses[-k:], losses[:-k]
      median = self._median(before)
      loss = float(np.mean(tail))
      if median and loss > self.max_loss_ratio * median:
        last = f"last {k} steps" if k > 1 else "last step"
        return (f"the mean loss of the {last} is {loss:.4g}, {loss / median:.3g}x the "
                f"median {median:.4g} of the steps before (checkpoint.max_loss_ratio="
                f"{self.max_loss_ratio:g})")
    return None

  def commit(self, passed: bool) -> None:
    """Closes the interval after a check; a pass moves the norm reference to the state saved."""
    self.new = 0
    if passed and self.param_norm is not None:
      self.ref_norm = self.param_norm
      self.ref_what = f"at step {self.step}, the last checkpoint that passed"

  def metadata(self) -> dict:
    """The reference values to save with a checkpoint that passed (JSON)."""
    out = {}
    if self.ref_norm is not None:
      out["param_norm"], out["step"] = self.ref_norm, self.step
    median = self._median(list(self.losses))
    if median is not None:
      out["loss_median"] = median
    return out


class SkipLimit:
  """Counts dropped updates; raises DivergenceError past `limit` in a row (0: no limit)."""

  def __init__(self, limit: int):
    self.limit = limit
    self.in_a_row = 0
    self.first: Optional[int] = None  # first step of the current run of skips
    self.applied = 0                  # updates applied in this run
    self.seen = 0                     # steps of this run

  def observe(self, step: int, applied: bool) -> None:
    self.seen += 1
    if applied:
      self.applied += 1
      self.in_a_row, self.first = 0, None
      return
    self.in_a_row += 1
    self.first = step if self.first is None else self.first
    if self.limit and self.in_a_row > self.limit:
      raise DivergenceError(
          f"{self.in_a_row} consecutive steps ({self.first} to {step}) had a non-finite loss or "
          f"gradient and were skipped (train.max_consecutive_skips={self.limit}): the run is "
          "diverging")

  def check_some_applied(self, first_step: int, last_step: int) -> None:
    if self.seen and not self.applied:
      raise DivergenceError(
          f"none of the {self.seen} steps of this run ({first_step} to {last_step}) was applied: "
          "every loss or gradient was non-finite (train.on_nonfinite='skip')")
