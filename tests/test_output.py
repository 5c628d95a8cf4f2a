"""What the commands print and write (`umoe_jax.output`): tables against hand-built strings, and result
files that are strict JSON and never half-written."""
from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from umoe_jax import output


def test_tables_by_hand():
  rows = [("name", "n", "value"), ("arc_easy", "2,376", "0.25"), ("piqa", "7", "")]
  assert output.text_table(rows) == ["name          n  value",
                                     "arc_easy  2,376   0.25",
                                     "piqa          7"]
  assert output.text_table(rows, rule=True)[1] == "--------  -----  -----"
  assert output.markdown_table(rows).splitlines() == ["| name     | n     | value |",
                                                      "|----------|-------|-------|",
                                                      "| arc_easy | 2,376 | 0.25  |",
                                                      "| piqa     | 7     |       |"]
  assert [output.fmt(x) for x in (1234567, 0.123456, 2.5e7, None, True, float("inf"))] == [
      "1,234,567", "0.1235", "2.5000e+07", "", "True", "inf"]


def test_write_json_is_strict_and_atomic(tmp_path):
  path = tmp_path / "sub" / "results.json"
  output.write_json(str(path), {"acc": np.float32(0.5), "n": np.int64(3), "ppl": float("nan"),
                                "steps": (1, 2), 7: [float("-inf")]})
  assert json.loads(path.read_text()) == {"acc": 0.5, "n": 3, "ppl": None, "steps": [1, 2],
                                          "7": [None]}
  assert os.stat(path).st_mode & 0o777 == 0o644
  # A write that fails half-way (an object json cannot encode, after some output) leaves the
  # previous file whole and no temporary file behind.
  with pytest.raises(TypeError, match="not JSON serializable"):
    output.write_json(str(path), {"a": list(range(1000)), "b": object()})
  assert json.loads(path.read_text())["acc"] == 0.5
  assert os.listdir(path.parent) == ["results.json"]


def test_output_paths_are_checked_before_the_work(tmp_path):
  """`check_output_path`: what a command checks before it scores or analyses, so that the results
  are not lost at the end to an unwritable --json / --plots (the analysis raised a traceback
  then)."""
  output.check_output_path(str(tmp_path / "new" / "r.json"), "--json")  # its directory is made
  assert (tmp_path / "new").is_dir() and not (tmp_path / "new" / "r.json").exists()
  output.check_output_path(str(tmp_path / "plots"), "--plots", directory=True)
  assert (tmp_path / "plots").is_dir()
  with pytest.raises(ValueError, match=f"--json='{tmp_path}' is not a writable file path"):
    output.check_output_path(str(tmp_path), "--json")
  (tmp_path / "a_file").write_text("x")
  # A file where a directory must be (or be made): named as such, not makedirs' bare errno text.
  for path, directory in (("a_file/p", True), ("a_file", True), ("a_file/sub/r.json", False)):
    with pytest.raises(ValueError, match=re.escape(f"--out='{tmp_path}/{path}': '{tmp_path}/a_file'"
                                                   " is a file, not a directory")):
      output.check_output_path(str(tmp_path / path), "--out", directory=directory)
  with pytest.raises(ValueError, match=r"--json='/proc/umoe-test/r\.json': cannot create "
                                       r"'/proc/umoe-test' \(No such file or directory\)"):
    output.check_output_path("/proc/umoe-test/r.json", "--json")  # /proc refuses even root


def test_tilde_paths_are_written_where_they_were_checked(tmp_path, monkeypatch):
  """`--json=~/r.json` / `--out=~/plots` (no shell expansion after "="): check_output_path made
  $HOME/... but the results went to a directory named "~" below the working directory."""
  from umoe_jax.plot import runs as plot
  home, cwd = tmp_path / "home", tmp_path / "cwd"
  home.mkdir()
  cwd.mkdir()
  monkeypatch.setenv("HOME", str(home))
  monkeypatch.chdir(cwd)
  output.check_output_path("~/res/r.json", "--json")
  output.write_json("~/res/r.json", {"acc": 0.5})
  assert json.loads((home / "res" / "r.json").read_text()) == {"acc": 0.5}
  run = tmp_path / "run"
  run.mkdir()
  (run / "metrics.jsonl").write_text('{"step": 1, "train/lm_loss": 2.0}\n')
  assert plot.plot_runs([str(run)], "~/plots") == ["~/plots/curves.png"]
  assert (home / "plots" / "curves.png").stat().st_size > 0
  assert os.listdir(cwd) == []
