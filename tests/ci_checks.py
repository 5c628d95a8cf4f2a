"""Optional packages in the tests, and CI mode.

`@pytest.mark.extras("triton", ...)` marks a test that needs modules no file of requirements.txt /
requirements-dev.txt installs: without one it skips naming the module and the file that installs it,
so the README's test command passes on a fresh venv made from requirements-dev.txt alone. CI then
installs requirements-extras.txt and runs `-m "extras or ci_required"` under UMOE_CI=1, where a skip
of such a test is a failure: a package that installs but does not import, or a jax that lost an API
(`ci_required`: the Mosaic GPU interpreter ships inside jax), turns CI red instead of passing as a skip.
Imported by tests/conftest.py, which makes the hooks below hooks of the test session.
"""
from __future__ import annotations

import importlib
import os

import pytest

# The file that installs each optional module (import name -> requirements file).
INSTALLED_BY = {
    "triton": "requirements-extras.txt",
    "torch": "requirements-extras.txt",
    "lm_eval": "requirements-eval.txt",
    "wandb": "requirements-wandb.txt",
    "transformers": "requirements-extras.txt",
}


def missing(modules) -> str | None:
  """None when every module imports, else a reason naming the first that does not."""
  for name in modules:
    try:
      importlib.import_module(name)
    except Exception as e:  # noqa: BLE001  (a broken install raises more than ImportError)
      where = INSTALLED_BY.get(name.split(".")[0], "requirements-extras.txt")
      return f"needs {name} (pip install -r {where}): {type(e).__name__}: {e}"
  return None


def pytest_runtest_setup(item):
  marker = item.get_closest_marker("extras")
  if marker is not None:
    if not marker.args:
      raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.extras needs the module names")
    reason = missing(marker.args)
    if reason:
      pytest.skip(reason)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  report = (yield).get_result()
  if (report.skipped and os.environ.get("UMOE_CI") == "1"
      and (item.get_closest_marker("ci_required") or item.get_closest_marker("extras"))):
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
    report.outcome = "failed"
    report.longrepr = f"UMOE_CI=1: {item.nodeid} is required in CI but skipped: {reason}"
