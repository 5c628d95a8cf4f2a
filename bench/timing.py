"""Wall-clock timing shared by the bench scripts, for what CUPTI's kernel times would not show
(host launches, gaps between kernels) or where CUPTI is not available."""
from __future__ import annotations

import statistics
import time

import jax


def wall_ms(fn, *args, iters: int = 10, warmup: int = 1) -> float:
  """Median wall time in ms of `iters` calls of fn(*args), each waited for, after `warmup` calls
  (the first of them compiles)."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(times)
