"""bench/tgmm_order.py on CPU: its routing (group sizes and expert-sorted token rows), its float32
reference, and its checks and table with the Triton weight gradient replaced by an XLA stand-in and
the timer by fixed times, so that a GPU run spends its time on the kernels."""
from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "bench"))
import results  # noqa: E402  (bench/results.py)
import tgmm_order  # noqa: E402  (bench/tgmm_order.py)
from kernels.gmm import triton_gmm  # noqa: E402


@pytest.mark.parametrize("slots", [1, 3])
def test_route_sorts_each_tokens_slots_into_its_experts_groups(slots, monkeypatch):
  monkeypatch.setattr(tgmm_order, "T", 200)
  monkeypatch.setattr(tgmm_order, "EXPERTS", 16)
  ratios = []
  for alpha in (None, 1.0):
    gs, token = tgmm_order.route(slots, alpha, seed=3)
    assert gs.shape == (16,) and gs.sum() == 200 * slots == len(token)
    assert np.array_equal(np.bincount(token, minlength=200), np.full(200, slots))
    ends = np.cumsum(gs)
    for e in range(16):  # a group's tokens: distinct, ascending (a stable sort of the flat ids)
      rows = token[ends[e] - gs[e]:ends[e]]
      assert np.all(np.diff(rows) > 0), (alpha, e)
    ratios.append(gs.max() / gs.mean())
  assert ratios[1] > ratios[0]  # the Dirichlet bias skews the sizes


def test_reference_is_each_groups_product():
  rng = np.random.default_rng(0)
  a, b = rng.standard_normal((9, 4)), rng.standard_normal((9, 3))
  gs = np.asarray([2, 0, 7])
  out = tgmm_order.reference(a, b, gs)
  want = np.stack([a[:2].T @ b[:2], np.zeros((4, 3)), a[2:].T @ b[2:]])
  np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)


def _stand_in(perturb_skew=None):
  """The weight gradient in XLA (float32 one-hot contraction), reading the gathers as the kernel
  does; with perturb_skew, that order's output is off by one (not bitwise equal)."""
  def tgmm(lhs, rhs, gs, *, num_groups, lhs_index=None, rhs_index=None, **_):
    a = lhs if lhs_index is None else jnp.take(lhs, lhs_index, axis=0)
    b = rhs if rhs_index is None else jnp.take(rhs, rhs_index, axis=0)
    group = jnp.repeat(jnp.arange(num_groups), gs, total_repeat_length=a.shape[0])
    onehot = jax.nn.one_hot(group, num_groups, dtype=jnp.float32)
    out = jnp.einsum("mg,mk,mn->gkn", onehot, a.astype(jnp.float32), b.astype(jnp.float32))
    if perturb_skew is not None and triton_gmm.TGMM_BIG_FIRST_SKEW == perturb_skew:
      out = out + 1.0
    return out.astype(lhs.dtype)
  return tgmm


def _small(monkeypatch):
  monkeypatch.setattr(tgmm_order, "T", 96)
  monkeypatch.setattr(tgmm_order, "EXPERTS", 8)
  monkeypatch.setattr(tgmm_order, "CALLS", (("ffn-up", 3, 32, 16, "lhs"),
                                            ("ffn-down", 3, 16, 32, "rhs")))
  monkeypatch.setattr(tgmm_order, "jax_ms", lambda f, *a, iterations: 1.0
                      + 0.1 * triton_gmm.TGMM_BIG_FIRST_SKEW)
  monkeypatch.setattr(triton_gmm, "TGMM_BIG_FIRST_SKEW", triton_gmm.TGMM_BIG_FIRST_SKEW)


def test_main_checks_then_writes_rows_and_table(monkeypatch, tmp_path, capsys):
  _small(monkeypatch)
  monkeypatch.setattr(triton_gmm, "triton_tgmm", _stand_in())
  out = tmp_path / "rows.json"
  monkeypatch.setattr(sys, "argv", ["tgmm_order.py", f"--out={out}", "--iterations=2",
                                    f"--results={tmp_path / 'results.jsonl'}"])
  tgmm_order.main()
  rows = json.loads(out.read_text())
  recorded = results.load_file(str(tmp_path / "results.jsonl"))   # a results row per (call, routing)
  assert [(r["config"], r["overrides"]["routing"], r["value"], r["anchor"]["value"]) for r in recorded] == [
      (f"tgmm_order:{c}", r, 1.2, 1.1) for c in ("ffn-up", "ffn-down") for r, _ in tgmm_order.ROUTINGS]
  assert [(r["call"], r["routing"]) for r in rows] == [
      (c, r) for c in ("ffn-up", "ffn-down") for r, _ in tgmm_order.ROUTINGS]
  for r in rows:
    assert r["orders_bitwise_equal"] and r["rel_err"] < 1e-2, r   # bf16 output vs float32
    assert r["ms"] == {"1": 1.1, "2": 1.2}
    assert r["tflops"]["1"] == pytest.approx(2.0 * r["rows"] * 32 * 16 / 1.1 / 1e9)  # ms = 1.1
  table = capsys.readouterr().out.splitlines()
  assert table[-1].startswith("ffn-down  dirichlet-1") and "1.200" in table[-1]


def test_main_fails_when_an_order_changes_the_output(monkeypatch):
  _small(monkeypatch)
  monkeypatch.setattr(triton_gmm, "triton_tgmm", _stand_in(perturb_skew=2))
  monkeypatch.setattr(sys, "argv", ["tgmm_order.py", "--iterations=2", "--results=none"])
  with pytest.raises(SystemExit, match="FAILED: ffn-up balanced: orders equal False"):
    tgmm_order.main()
