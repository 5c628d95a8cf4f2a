"""CI mode (UMOE_CI=1, set by .ci/run): a test marked `ci_required` that skips fails instead.

CI installs what these tests need (torch, Triton, lm-eval; jax brings the Mosaic GPU interpreter), so
a skip there means an install or an API went missing: it must turn CI red, not pass as a skip.
Imported by tests/conftest.py, which makes the hook below a hook of the test session.
"""
from __future__ import annotations

import os

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  report = (yield).get_result()
  if (report.skipped and os.environ.get("UMOE_CI") == "1"
      and item.get_closest_marker("ci_required") is not None):
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
    report.outcome = "failed"
    report.longrepr = f"UMOE_CI=1: {item.nodeid} is required in CI but skipped: {reason}"
