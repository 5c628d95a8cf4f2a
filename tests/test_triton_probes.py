"""bench/triton_probes.py's kernels in Triton's interpreter (CPU) against float32 references: the
grouped forward with TMA and pointer loads on both grids, the weight gradient with TMA (per-group
descriptors zero the rows past a group) and masked pointer loads, its output rows in one and two
pieces; empty groups and a group shorter than a tile included. The GPU timings are the script's."""
import os
import sys

import pytest

from conftest import interpreter_loop_bounds, run_in_triton_interpreter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))


def _probe_kernels_check():
  """Runs in a fresh process with TRITON_INTERPRET=1 set before Triton is imported."""
  import torch
  import triton
  import triton_probes as tp
  interpreter_loop_bounds()
  triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8))
  torch.manual_seed(0)
  sizes = [7, 0, 21, 3, 0, 17]   # 48 rows; tiles of 16 rows: 1, 2, 1 and 2 tiles
  m, g = sum(sizes), len(sizes)
  a = torch.randn(m, 32)
  w = torch.randn(g, 32, 48) / 32 ** 0.5
  want = tp.reference_gmm(a, w, sizes)
  for tma in (0, 1):
    for persistent in (0, 1):
      got = tp.gmm_call(a, w, sizes, bm=16, bn=16, bk=16, warps=4, stages=2, tma=tma,
                        persistent=persistent, num_sms=3)()
      assert tp.rel_err(got, want) < 1e-5, (tma, persistent, tp.rel_err(got, want))
  b = torch.randn(m, 32)
  want = tp.reference_tgmm(a, b, sizes)
  for tma in (0, 1):
    for bk, bk2 in ((16, 0), (16, 16), (32, 0)):   # 32 rows of the output as 16 + 16 or 32
      got = tp.tgmm_call(a, b, sizes, bm=16, bk=bk, bk2=bk2, bn=16, warps=4, stages=2, tma=tma)()
      assert tp.rel_err(got, want) < 1e-5, (tma, bk, bk2, tp.rel_err(got, want))
      assert float(got[1].abs().max()) == 0.0 and float(got[4].abs().max()) == 0.0
  print("PROBES_INTERPRETER_OK")


@pytest.mark.extras("triton", "torch")
def test_probe_kernels_in_interpreter():
  run_in_triton_interpreter("test_triton_probes", "_probe_kernels_check", "PROBES_INTERPRETER_OK")


def test_cli_refuses_unknown_probes(capsys):
  import triton_probes
  with pytest.raises(SystemExit) as e:
    triton_probes.main(["--probes=gmm,nope"])
  assert e.value.code == 2 and "unknown nope; valid: gmm, tgmm, cublas" in capsys.readouterr().err
