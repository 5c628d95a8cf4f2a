"""bench/train_step.py refuses a --trace_step outside the timed steps before it builds anything (a
GPU run would otherwise compile for minutes and trace nothing)."""
from __future__ import annotations

import os
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench",
                     "train_step.py")


def test_a_trace_step_outside_the_timed_steps_is_refused(tmp_path):
  out = subprocess.run([sys.executable, BENCH, "--steps=3", "--trace_step=5", f"--out={tmp_path}"],
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 2, out
  assert "--trace_step=5: a timed step, 1 to --steps=3" in out.stderr
  assert not os.listdir(tmp_path)
