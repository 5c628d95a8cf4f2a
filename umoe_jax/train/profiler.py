"""`log.profile_steps`: jax.profiler traces of chosen training steps, for TensorBoard's profile tab.

Step s is the update that takes the state from step s - 1 to s (the step numbers of the logs).
Each run of consecutive chosen steps is one trace: it starts before the first of them is dispatched
and stops once the last one has finished on the device, and is written to
`<workdir>/tensorboard/plugins/profile/<timestamp>/` (`*.xplane.pb`), where
`tensorboard --logdir <workdir>` shows it with the profile plugin (`pip install
tensorboard-plugin-profile`). Every step inside a trace is marked with a StepTraceAnnotation.
"""
from __future__ import annotations

import os
from typing import Any, Optional, Sequence

from absl import logging


class StepProfiler:
  """before(step) / after(step, outputs) around each training step; close() ends an open trace."""

  def __init__(self, steps: Sequence[int] = (), logdir: str = ""):
    self.steps = frozenset(int(s) for s in steps)
    self.logdir = logdir
    self.tracing = False
    self._annotation: Optional[Any] = None

  @classmethod
  def from_config(cls, config: Any, workdir: str) -> "StepProfiler":
    steps = config.log.get("profile_steps") or ()
    return cls(steps, os.path.join(workdir, "tensorboard"))

  def before(self, step: int) -> None:
    """Called before step `step` is dispatched."""
    if step not in self.steps:
      return
    import jax
    if not self.tracing:
      os.makedirs(self.logdir, exist_ok=True)
      jax.profiler.start_trace(self.logdir)
      self.tracing = True
      logging.info("profiling from step %d into %s", step, self.logdir)
    self._annotation = jax.profiler.StepTraceAnnotation("train", step_num=step)
    self._annotation.__enter__()

  def after(self, step: int, outputs: Any) -> None:
    """Called once step `step` is dispatched, with its outputs (to wait for the device)."""
    if self._annotation is not None:
      self._annotation.__exit__(None, None, None)
      self._annotation = None
    if self.tracing and step + 1 not in self.steps:
      import jax
      jax.block_until_ready(outputs)
      self.close()
      logging.info("profile of the steps up to %d written to %s", step,
                   os.path.join(self.logdir, "plugins", "profile"))

  def close(self) -> None:
    if self._annotation is not None:
      self._annotation.__exit__(None, None, None)
      self._annotation = None
    if self.tracing:
      import jax
      jax.profiler.stop_trace()
      self.tracing = False

  def __enter__(self) -> "StepProfiler":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
