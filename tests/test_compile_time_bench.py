"""bench/compile_time.py lowers the trainer's gradient of a config at a given depth, looped and
scanned (`model.scan_layers`); lowering only here (the timing is the script's, on any machine)."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import compile_time  # noqa: E402


def test_the_scanned_program_stays_one_block_deep():
  rows = {(n, scan): compile_time.measure("umoe_tiny", n, scan, batch=2, seq_len=16, remat="block",
                                          compile=False)
          for n in (1, 3) for scan in (False, True)}
  for (n, scan), row in rows.items():
    assert row["n_layers"] == n and row["scan_layers"] == scan and row["compile_s"] is None
    assert row["lower_s"] > 0 and row["program_chars"] > 0
  loop_growth = rows[3, False]["program_chars"] - rows[1, False]["program_chars"]
  scan_growth = rows[3, True]["program_chars"] - rows[1, True]["program_chars"]
  assert loop_growth > 0 and scan_growth < 0.1 * loop_growth, (loop_growth, scan_growth)
