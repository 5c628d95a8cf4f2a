"""The GPU suite in tiers: `-m gpu_quick` runs each kernel and backend once, `--gpu_shard=i/n` runs
the i-th of n parts of whatever was collected, so that every part fits one device call.

Parts are balanced by the per-test seconds measured on one H100 (tests/gpu/durations.json; a test not
listed there counts as the median of those listed) with longest-first greedy packing, the classic
makespan heuristic: no part exceeds the ideal share by more than the longest single test. Each part
keeps the collection order, so the cases of one test function still run back to back and reuse the
kernels they share. The choice depends only on the collected node ids, so every pytest-xdist worker
picks the same part. `--gpu_durations_out=FILE` writes the seconds this session measured, in the
same format, to refresh the table.

A plugin module registered by tests/conftest.py, as gpu_report is.
"""
from __future__ import annotations

import heapq
import json
import os
import statistics

import pytest

DURATIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu", "durations.json")

_MEASURED: dict[str, float] = {}


def add_options(parser):
  """Called from tests/conftest.py's pytest_addoption: a plugin registered later misses parsing."""
  group = parser.getgroup("umoe GPU suite")
  group.addoption("--gpu_shard", default=None, metavar="I/N",
                  help="run part I of N (1-based) of the collected tests, balanced by "
                       "tests/gpu/durations.json")
  group.addoption("--gpu_durations_out", default=None, metavar="FILE",
                  help="write each test's measured seconds (setup + call + teardown) as JSON")


def parse_shard(spec: str) -> tuple[int, int]:
  """"i/n" -> (i, n) with 1 <= i <= n; a UsageError naming the value otherwise."""
  try:
    i, n = (int(p) for p in spec.split("/"))
  except ValueError:
    i, n = 0, 0
  if not 1 <= i <= n:
    raise pytest.UsageError(f"--gpu_shard={spec!r}: expected I/N with 1 <= I <= N, e.g. 2/3")
  return i, n


def load_durations(path: str = DURATIONS) -> dict[str, float]:
  if not os.path.exists(path):
    return {}
  try:
    with open(path) as f:
      table = json.load(f)
  except (OSError, ValueError) as e:
    raise pytest.UsageError(f"{path}: not a JSON table of test seconds ({e})") from None
  if not isinstance(table, dict) or not all(isinstance(v, (int, float)) for v in table.values()):
    raise pytest.UsageError(f"{path}: expected a JSON object mapping test ids to seconds")
  return {k: float(v) for k, v in table.items()}


def partition(node_ids: list[str], n: int, durations: dict[str, float]) -> list[list[str]]:
  """The node ids in n parts of near-equal total seconds, each in the given order."""
  default = statistics.median(durations.values()) if durations else 1.0
  cost = {nid: durations.get(nid, default) for nid in node_ids}
  loads = [(0.0, part) for part in range(n)]   # (seconds so far, part): a min-heap
  owner = {}
  for nid in sorted(node_ids, key=lambda x: (-cost[x], x)):
    load, part = heapq.heappop(loads)
    owner[nid] = part
    heapq.heappush(loads, (load + cost[nid], part))
  parts = [[] for _ in range(n)]
  for nid in node_ids:
    parts[owner[nid]].append(nid)
  return parts


def pytest_collection_modifyitems(config, items):
  spec = config.getoption("gpu_shard")
  if not spec:
    return
  i, n = parse_shard(spec)
  keep = set(partition([it.nodeid for it in items], n, load_durations())[i - 1])
  config.hook.pytest_deselected(items=[it for it in items if it.nodeid not in keep])
  items[:] = [it for it in items if it.nodeid in keep]


def pytest_runtest_logreport(report):
  _MEASURED[report.nodeid] = _MEASURED.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session):
  path = session.config.getoption("gpu_durations_out")
  if path and not hasattr(session.config, "workerinput"):   # the xdist controller, or no xdist
    with open(path, "w") as f:
      json.dump({k: round(v, 2) for k, v in sorted(_MEASURED.items())}, f, indent=0)
      f.write("\n")


def product(quick: tuple, *axes) -> list:
  """The cases of several parameters (their cartesian product, in order), the one equal to `quick`
  marked `gpu_quick`: stacked parametrize decorators would mark every case sharing any marked value."""
  import itertools
  cases = list(itertools.product(*axes))
  if tuple(quick) not in cases:
    raise ValueError(f"quick case {quick} is not among the cases")
  name = lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v)
  return [pytest.param(*c, id="-".join(map(name, c)),
                       marks=[pytest.mark.gpu_quick] if c == tuple(quick) else []) for c in cases]
