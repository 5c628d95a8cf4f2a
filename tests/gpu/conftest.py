"""GPU suite report: the session ends with how many kernel backends ran, and how their tests went.

A test's backend is its `backend` parameter (tests/gpu/test_gmm_gpu.py); the name travels on the test
report (`user_properties`), so the count is right under pytest-xdist too.
"""
from __future__ import annotations

import collections

import pytest

import gpu_backends

_TALLY: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  report = (yield).get_result()
  backend = getattr(item, "callspec", None) and item.callspec.params.get("backend")
  if backend:
    report.user_properties.append(("gmm_backend", backend))


def pytest_runtest_logreport(report):
  backend = dict(report.user_properties).get("gmm_backend")
  if backend and (report.when == "call" or report.outcome != "passed"):
    _TALLY[backend][report.outcome] += 1


def pytest_terminal_summary(terminalreporter):
  """One line, e.g. "GPU kernel backends run: 2 of 2 expected (mosaic: 41 passed; triton: 41
  passed)"; a backend counts as run when at least one of its tests passed."""
  ran = [b for b, c in _TALLY.items() if c["passed"]]
  detail = "; ".join(f"{b}: " + ", ".join(f"{n} {o}" for o, n in sorted(_TALLY[b].items()))
                     for b in sorted(_TALLY))
  if gpu_backends.on_gpu():
    expected = gpu_backends.expected_backends()
    names = ", ".join(expected) or "UMOE_GPU_BACKENDS is empty"
    where = f"{len(ran)} of {len(expected)} expected ({names})"
  else:
    where = f"{len(ran)} (no GPU)"
  terminalreporter.write_line(f"GPU kernel backends run: {where}{'; ' + detail if detail else ''}")
