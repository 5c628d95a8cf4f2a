"""bench/compile_time.py lowers the trainer's gradient of a config at a given depth, looped and
scanned (`model.scan_layers`): the scanned program holds one block whatever the depth. Lowering only
here (the timing is the script's, on any machine)."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import compile_time  # noqa: E402


def test_the_scanned_program_stays_one_block_deep():
  rows = {(n, scan): compile_time.measure("umoe_tiny", n, scan, batch=2, seq_len=16, remat="block",
                                          compile=False)
          for n in (1, 5) for scan in (False, True)}
  for (n, scan), row in rows.items():
    assert row["n_layers"] == n and row["scan_layers"] == scan and row["compile_s"] is None
    assert row["lower_s"] > 0 and row["program_chars"] > 0
  chars = {key: row["program_chars"] for key, row in rows.items()}
  assert chars[5, False] > 2.5 * chars[1, False], chars   # the loop's program grows a block a layer
  # the scan's by the stacking of one layer's parameters and the slicing of its routes only
  assert chars[5, True] - chars[1, True] < 0.1 * (chars[5, False] - chars[1, False]), chars
  assert chars[5, True] < 0.5 * chars[5, False], chars
