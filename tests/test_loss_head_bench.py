"""bench/loss_head.py times the LM head + cross-entropy in each form after checking it against the
first: at a small shape every form's loss and gradients agree, the JSON holds a row per form, and
an unknown form is refused before anything compiles."""
from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import loss_head  # noqa: E402
import results  # noqa: E402  (bench/results.py)


def test_every_form_checked_and_timed(tmp_path):
  rc = loss_head.main(["--tokens=96", "--d_model=32", "--vocab=300", "--chunk_tokens=40",
                       "--iters=1", "--warmup=0", f"--out={tmp_path}",
                       f"--results={tmp_path / 'results.jsonl'}"])
  rows = json.loads((tmp_path / "loss_head.json").read_text())
  recorded = results.load_file(str(tmp_path / "results.jsonl"))   # a results row per form
  assert [(r["config"], r["overrides"], r["value"]) for r in recorded] == [
      ("loss_head:96x32x300", {"form": r["form"]}, r["ms"]) for r in rows]
  assert recorded[0]["anchor"] is None and recorded[1]["anchor"]["value"] == rows[0]["ms"]
  assert rc == 0 and [r["form"] for r in rows] == list(loss_head.FORMS)
  for r in rows:
    assert r["check"] and r["ms"] > 0 and r["errors_vs_first"]["loss"] < 1e-5, r
  assert rows[0]["errors_vs_first"] == {"loss": 0.0, "dh": 0.0, "dw": 0.0}


def test_an_unknown_form_is_refused():
  with pytest.raises(ValueError, match="unknown form 'fast'"):
    loss_head.main(["--forms=fused,fast"])
