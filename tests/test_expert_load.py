"""Expert-load percentiles and dead experts over a window (`umoe_jax.train.expert_load`), against
hand-computed values and plain loops over hand-built routing counts."""
from __future__ import annotations

import math

import numpy as np
import pytest

from umoe_jax.train import expert_load
from umoe_jax.train import metrics as metrics_lib


def percentile_loop(values, q):
  """Linear interpolation between order statistics: position q/100 * (n - 1) of the sorted values."""
  v = sorted(float(x) for x in values)
  pos = q / 100 * (len(v) - 1)
  lo = math.floor(pos)
  hi = min(lo + 1, len(v) - 1)
  return v[lo] + (pos - lo) * (v[hi] - v[lo])


def test_load_percentiles_by_hand_and_against_a_loop():
  # sorted [0, 2, 4, 10], mean 4: p50 at position 1.5 -> 3; p90 at 2.7 -> 4 + 0.7 * 6 = 8.2.
  p50, p90 = expert_load.load_percentiles([10, 0, 4, 2])
  assert p50 == pytest.approx(3 / 4, rel=1e-12) and p90 == pytest.approx(8.2 / 4, rel=1e-12)
  assert expert_load.load_percentiles([5, 5, 5]) == (1.0, 1.0)  # balanced
  assert all(math.isnan(x) for x in expert_load.load_percentiles([0, 0, 0]))
  rng = np.random.default_rng(5)
  for e in (2, 7, 64):
    counts = rng.integers(0, 50, e)
    counts[0] += 1
    mean = sum(counts) / e
    got = expert_load.load_percentiles(counts)
    assert got[0] == pytest.approx(percentile_loop(counts, 50) / mean, rel=1e-12)
    assert got[1] == pytest.approx(percentile_loop(counts, 90) / mean, rel=1e-12)


def test_interval_summary_averages_the_percentiles_over_steps():
  step = lambda counts: {"loss": 1.0, "lm_loss": 1.0, "balance_loss": 0.0, "learning_rate": 1e-3,
                         "grad_norm": 1.0, "routers": {"layer_0/ffn": {"expert_counts": counts}}}
  scalars, counts = metrics_lib.summarize([step([10, 0, 4, 2]), step([3, 3, 3, 3])])
  assert scalars["moe/layer_0/ffn/load_p50_mean"] == pytest.approx((0.75 + 1) / 2, rel=1e-12)
  assert scalars["moe/layer_0/ffn/load_p90_mean"] == pytest.approx((2.05 + 1) / 2, rel=1e-12)
  assert scalars["moe/layer_0/ffn/load_max_mean"] == pytest.approx((2.5 + 1) / 2, rel=1e-12)
  assert counts["layer_0/ffn"].tolist() == [13, 3, 7, 5]


def _steps(per_step_counts):
  return [{"routers": {name: {"expert_counts": c, "entropy": 0.0} for name, c in step.items()}}
          for step in per_step_counts]


def test_dead_experts_over_the_window_by_hand():
  w = expert_load.DeadExpertWindow(3)
  w.observe(_steps([{"a": [1, 0, 0, 0]}, {"a": [0, 0, 2, 0]}]))
  assert w.dead() == {} and w.scalars() == {}  # two steps of three: no count yet
  w.observe(_steps([{"a": [0, 0, 0, 0]}]))
  assert w.dead() == {"a": 2}  # experts 1 and 3 got nothing in steps 1..3
  w.observe(_steps([{"a": [0, 0, 0, 0]}]))
  assert w.dead() == {"a": 3}  # steps 2..4: expert 0's token of step 1 left the window
  w.observe(_steps([{"a": [0, 0, 0, 0]}, {"a": [0, 0, 0, 0]}]))
  assert w.scalars() == {"moe/a/dead_experts": 4.0, "moe/dead_experts": 4.0}
  off = expert_load.DeadExpertWindow(0)
  off.observe(_steps([{"a": [0, 0]}] * 5))
  assert off.scalars() == {}


def test_dead_experts_against_a_loop_over_random_log_intervals():
  rng = np.random.default_rng(0)
  n_steps, window = 60, 7
  counts = {name: rng.integers(0, 3, (n_steps, 8)) * (rng.random((n_steps, 8)) < 0.15)
            for name in ("layer_0/attention", "layer_0/ffn", "layer_1/ffn")}
  w = expert_load.DeadExpertWindow(window)
  seen = 0
  while seen < n_steps:
    chunk = int(rng.integers(1, 6))  # logs every 1..5 steps
    stop = min(seen + chunk, n_steps)
    w.observe(_steps([{name: c[i].tolist() for name, c in counts.items()}
                      for i in range(seen, stop)]))
    seen = stop
    expected = {}
    if seen >= window:
      for name, c in counts.items():
        expected[name] = sum(1 for e in range(8)
                             if all(c[i][e] == 0 for i in range(seen - window, seen)))
    assert w.dead() == dict(sorted(expected.items())), seen
  assert any(w.dead().values())  # the draw leaves some expert idle for a whole window


def test_console_line_names_dead_experts():
  s = {"train/loss": 2.0, "train/lm_loss": 2.0, "train/balance_loss": 0.01, "train/perplexity": 7.4,
       "train/learning_rate": 1e-3, "train/grad_norm": 0.5, "perf/step_time_s": 0.1,
       "moe/dead_experts": 3.0}
  assert "dead experts 3" in metrics_lib.console_line(10, 100, s)
  assert "dead experts" not in metrics_lib.console_line(10, 100, dict(s, **{"moe/dead_experts": 0}))
