"""bench/optimizer_update.py times the step's update (norms, clip, AdamW, keep-or-skip) in each form
of the global norm after checking it against the first: on a tiny model's shapes the forms agree on
the new parameters and both norms, the JSON holds a row per form, and an unknown form is refused
before anything compiles."""
from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import optimizer_update  # noqa: E402


def test_every_form_checked_and_timed(tmp_path):
  rc = optimizer_update.main(["--config=dense_tiny", "--iters=1", f"--out={tmp_path}"])
  out = json.loads((tmp_path / "optimizer_update.json").read_text())
  rows = out["rows"]
  assert rc == 0 and [r["form"] for r in rows] == list(optimizer_update.FORMS)
  for r in rows:
    assert r["ms"] > 0 and r["kernels"] > 0, r
    assert r["rel_err_params"] < 1e-6 and r["rel_err_grad_norm"] < 1e-5, r
    # the gradient was drawn at global norm 2: the clip at 1.0 was active
    assert abs(r["grad_norm"] - 2.0) < 0.05 and r["param_norm"] > 0, r


def test_an_unknown_form_is_refused():
  with pytest.raises(ValueError, match="unknown form 'fast'"):
    optimizer_update.main(["--forms=rows,fast"])
