"""Expert-load figures of training steps: percentiles over experts, and dead experts over a window.

Per router (`layer_<i>/<router>`) and step, from the step's tokens routed to each expert c [E]:
  load_p50_mean, load_p90_mean   the median and the 90th percentile over experts of c, over mean(c)
                                 (numpy's linear interpolation between order statistics; 1 = balanced,
                                 beside load_max_mean = max(c) / mean(c) of `umoe_jax.train.metrics`)
Over the last `window` steps (`log.dead_expert_window`), summed per router:
  dead_experts                   experts that received no token in any of those steps
  moe/dead_experts               their sum over routers
Dead experts are reported once `window` steps have been seen by this run (a resumed run starts a
new window), so a count always covers the whole window.
"""
from __future__ import annotations

import collections
from typing import Any, Mapping, Sequence

import numpy as np


def load_percentiles(counts: Any) -> tuple[float, float]:
  """(p50 / mean, p90 / mean) over experts of one step's counts [E]; NaN if nothing was routed."""
  c = np.asarray(counts, np.float64)
  mean = c.mean()
  if mean <= 0:
    return float("nan"), float("nan")
  p50, p90 = np.percentile(c, [50, 90])
  return float(p50 / mean), float(p90 / mean)


class DeadExpertWindow:
  """Tokens per expert of each router over the last `window` steps; 0 disables it."""

  def __init__(self, window: int):
    self.window = int(window)
    self._steps: collections.deque = collections.deque()   # per step: {router: counts [E]}
    self._sums: dict[str, np.ndarray] = {}

  def observe(self, steps: Sequence[Mapping[str, Any]]) -> None:
    """Adds steps' host metrics (each with {"routers": {name: {"expert_counts": [E], ...}}})."""
    if self.window <= 0:
      return
    for step in steps:
      counts = {name: np.asarray(r["expert_counts"], np.float64)
                for name, r in step.get("routers", {}).items() if "expert_counts" in r}
      self._steps.append(counts)
      for name, c in counts.items():
        self._sums[name] = self._sums.get(name, 0.0) + c
      if len(self._steps) > self.window:
        for name, c in self._steps.popleft().items():
          self._sums[name] = self._sums[name] - c

  def dead(self) -> dict[str, int]:
    """{router: experts with no token over the window}; empty until the window is full."""
    if self.window <= 0 or len(self._steps) < self.window:
      return {}
    return {name: int(np.sum(s <= 0)) for name, s in sorted(self._sums.items())}

  def scalars(self) -> dict[str, float]:
    """moe/<router>/dead_experts and their sum moe/dead_experts (empty until the window is full)."""
    dead = self.dead()
    if not dead:
      return {}
    out = {f"moe/{name}/dead_experts": float(n) for name, n in dead.items()}
    out["moe/dead_experts"] = float(sum(dead.values()))
    return out
