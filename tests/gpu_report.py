"""GPU suite report: a session that ran tests/gpu ends with how many kernel backends ran, and how.

A test's backend is its `backend` parameter (tests/gpu/test_gmm_gpu.py); the name travels on the test
report (`user_properties`), so the count is right under pytest-xdist too. A plugin module registered
by tests/conftest.py, not a tests/gpu/conftest.py: two conftest modules would both be `conftest` in
sys.modules, and the CPU tests' `from conftest import ...` could get the wrong one.
"""
from __future__ import annotations

import collections

import pytest

import gpu_backends

_TALLY: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
_SEEN_GPU_SUITE = []  # non-empty once a report of a tests/gpu test arrived


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  report = (yield).get_result()
  backend = getattr(item, "callspec", None) and item.callspec.params.get("backend")
  if backend:
    report.user_properties.append(("gmm_backend", backend))


def pytest_runtest_logreport(report):
  if not report.nodeid.replace("\\", "/").startswith("tests/gpu/"):
    return  # CPU tests may have a `backend` parameter too
  _SEEN_GPU_SUITE.append(True)
  backend = dict(report.user_properties).get("gmm_backend")
  if backend and (report.when == "call" or report.outcome != "passed"):
    _TALLY[backend][report.outcome] += 1


def pytest_terminal_summary(terminalreporter):
  """One line, e.g. "GPU kernel backends run: 2 of 2 expected (mosaic: 41 passed; triton: 41
  passed)"; a backend counts as run when at least one of its tests passed. Silent when no test of
  tests/gpu ran (the CPU suite)."""
  if not _SEEN_GPU_SUITE:
    return
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
