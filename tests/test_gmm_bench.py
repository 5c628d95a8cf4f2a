"""bench/gmm.py's gathered-call sweep (bench/gmm_sweep.py) on CPU: the kernels replaced by shape-only stand-ins and the
timer by fixed per-(op, candidate) times, so that its bookkeeping (which op's best becomes which
table row, the comparison-only ops kept out, tiles with the epilogue in XLA timed but not picked
unless asked, the rows file bench/train_step.py --gmm_tiles loads, written after every op) is checked before it costs GPU time."""
from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "bench"))
import gmm_common  # noqa: E402
import gmm_sweep as bench_gmm  # noqa: E402  (bench/gmm_sweep.py: the sweeps of bench/gmm.py)
from kernels.gmm import triton_gmm, tuning  # noqa: E402


def _fake_gmm(lhs, rhs, group_sizes, *, transpose_rhs=False, lhs_index=None, row_dot=None,
              config=None, **_):
  m = lhs.shape[0] if lhs_index is None else lhs_index.shape[0]
  out = jnp.zeros((m, rhs.shape[1] if transpose_rhs else rhs.shape[2]), lhs.dtype)
  return out if row_dot is None else (out, jnp.zeros((m,), jnp.float32))


def _fake_tgmm(lhs, rhs, group_sizes, *, num_groups=None, **_):
  return jnp.zeros((num_groups, lhs.shape[1], rhs.shape[1]), lhs.dtype)


def test_gathered_sweep_writes_the_trainers_forms_rows(monkeypatch, tmp_path):
  monkeypatch.setattr(gmm_common, "T", 256)       # routed_inputs' token count
  monkeypatch.setattr(bench_gmm, "DISPATCH_CONFIGS", (("base", 64, 48, 8, 3),))
  monkeypatch.setattr(bench_gmm, "ATTENTION_CONFIGS", ())
  monkeypatch.setattr(triton_gmm, "triton_gmm", _fake_gmm)
  monkeypatch.setattr(triton_gmm, "triton_tgmm", _fake_tgmm)
  monkeypatch.setattr(tuning, "TABLE", {})
  # Per op, the candidate (in the sweep's order) the fake timer makes fastest: the plain dgrad
  # (comparison only) prefers another tile than the silu form the trainer calls.
  fastest = {"gmm+gather": 1, "gmm_t+gather": 2, "gmm_t+gather+silu": 3, "tgmm+gather": 0,
             "tgmm+gather (down)": 2, "tgmm+gather+scale (down)": 1, "gmm (down)": 4,
             "gmm_t (up)": 3}
  calls = []

  def timer(fn, *args, iterations=10):
    jax.block_until_ready(fn(*args))
    op = current["op"]
    calls.append(op)
    i = sum(1 for c in calls if c == op) - 1
    return 1.0 if i == fastest[op] else 2.0

  current = {}
  monkeypatch.setattr(bench_gmm, "jax_ms", timer)
  monkeypatch.setattr(bench_gmm, "log", lambda *a: None)
  # One op at a time (only_ops), so the timer knows which op it times.
  path = tmp_path / "gmm_tiles.json"
  m = 256 * 3   # rows: T tokens x top-3
  for op in fastest:
    table_op, kc, no = {"gmm+gather": ("gmm+gather", 64, 48), "gmm_t+gather": (None, 64, 48),
                        "gmm_t+gather+silu": ("gmm_t+gather", 64, 48),
                        "tgmm+gather": ("tgmm+gather", 64, 48),
                        "tgmm+gather (down)": ("tgmm+gather", 48, 64),
                        "tgmm+gather+scale (down)": (None, 48, 64),
                        "gmm (down)": ("gmm", 48, 64), "gmm_t (up)": ("gmm_t", 48, 64)}[op]
    # (the candidates as the sweep sees them: its first is the table's row before it)
    cands = tuning.candidates("triton", table_op, kc, no, m)[:5] if table_op else None
    current["op"] = op
    before = path.read_text() if path.exists() else None
    rows = bench_gmm.sweep_gathered({}, max_cands=5, only_ops=[op], out_path=str(path))
    if table_op is None:
      assert rows == {}, (op, rows)   # timed, but no row: not what the trainer calls
      assert (path.read_text() if path.exists() else None) == before, op
      continue
    key = ("triton", table_op, kc, no, tuning.m_bucket(m))
    assert len(cands) > fastest[op], (op, cands)
    want = cands[fastest[op]]
    if want.xla_epilogue:  # timed, not picked by default: the first of the others (all tie) wins
      want = cands[0]
      tiles = dict(tuning.TABLE)
      current["op"] = op
      calls[:] = [c for c in calls if c != op]
      picked = bench_gmm.sweep_gathered({}, max_cands=5, only_ops=[op], pick_xla_epilogue=True)
      assert picked == {key: cands[fastest[op]]}, (op, picked)
      tuning.TABLE.clear()
      tuning.TABLE.update(tiles)
    assert rows == {key: want}, (op, rows)
    assert tuning.TABLE[key] == want
    assert tuning.load_table(str(path), {}) == {key: want}   # the file as the step loads it
  assert set(calls) == set(fastest)
  # The silu dgrad's fastest candidate here is one with the epilogue in XLA (so both branches ran).
  silu = tuning.candidates("triton", "gmm_t+gather", 64, 48, m)
  assert silu[fastest["gmm_t+gather+silu"]].xla_epilogue
