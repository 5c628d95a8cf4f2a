"""`log.profile_steps`: jax.profiler traces of chosen training steps, for TensorBoard's profile tab.

Step s is the update that takes the state from step s - 1 to s (the step numbers of the logs).
Each run of consecutive chosen steps is one trace holding exactly those steps: the host runs ahead of
the device (it dispatches steps before earlier ones have finished), so the trace starts only once
the state before its first step is ready on the device (no earlier step still queued or running),
and stops only once the outputs of its last step are ready. It is written to
`<workdir>/tensorboard/plugins/profile/<timestamp>/` (`*.xplane.pb`), where
`tensorboard --logdir <workdir>` shows it with the profile plugin (`pip install
tensorboard-plugin-profile`). Every step inside a trace is marked with a StepTraceAnnotation.
With a workdir in a bucket the trace is written to a local temporary directory and uploaded there
(umoe_jax/storage) when it stops.
"""
from __future__ import annotations

import os
import shutil
from typing import Any, Optional, Sequence

from absl import logging

from umoe_jax import storage


class StepProfiler:
  """before(step, state) / after(step, outputs) around each training step; close() ends an open
  trace."""

  def __init__(self, steps: Sequence[int] = (), logdir: str = ""):
    self.steps = frozenset(int(s) for s in steps)
    self.logdir = logdir
    self.tracing = False
    self._annotation: Optional[Any] = None
    self._trace_dir = ""  # where jax writes the trace: logdir, or a local stage of a remote one

  @classmethod
  def from_config(cls, config: Any, workdir: str) -> "StepProfiler":
    steps = config.log.get("profile_steps") or ()
    return cls(steps, storage.join(workdir, "tensorboard"))

  def before(self, step: int, state: Any = None) -> None:
    """Called before step `step` is dispatched, with its input state (to wait for the device)."""
    if step not in self.steps:
      return
    import jax
    if not self.tracing:
      # Steps dispatched earlier may still be queued or running: they stay out of the trace.
      jax.block_until_ready(state)
      if storage.is_url(self.logdir):
        self._trace_dir = storage.local_temp_dir("umoe-profile-")
      else:
        self._trace_dir = self.logdir
        os.makedirs(self.logdir, exist_ok=True)
      jax.profiler.start_trace(self._trace_dir)
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
                   storage.join(self.logdir, "plugins", "profile"))

  def close(self) -> None:
    if self._annotation is not None:
      self._annotation.__exit__(None, None, None)
      self._annotation = None
    if self.tracing:
      import jax
      jax.profiler.stop_trace()
      self.tracing = False
      if self._trace_dir != self.logdir:  # a remote logdir: upload the local trace
        try:
          storage.upload_tree(self._trace_dir, self.logdir)
        finally:
          shutil.rmtree(self._trace_dir, ignore_errors=True)

  def __enter__(self) -> "StepProfiler":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
