"""bench/attention_core.py's tile sweep, run on CPU: every kernel through the Triton interpreter
(tests/test_triton_attention.py's launcher), the timer replaced by fixed per-kernel times, so that
its plumbing (the stored form's inputs, the per-gradient check of the tile-pair pass, the choice of
the backward form and the tiles it writes, `--sweep_kernels`, the core on keys of two exact pieces)
is exercised before it costs GPU time."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from conftest import interpreter_loop_bounds, run_in_triton_interpreter

HERE = os.path.dirname(os.path.abspath(__file__))

# ms per kernel the fake timer reports: the tile-pair form (ds + dk_ds + dq_ds + dx_p = 1.0) beats
# the fused dX + dK with dQ (2.2) and the separate passes (2.4).
FAKE_MS = {"fwd": 0.5, "dx": 0.6, "dk": 1.2, "dq": 0.6, "dxdk": 1.6, "dq_ds": 0.2,
           "dx_p": 0.3, "dk_ds": 0.2, "ds": 0.3}


def _sweep_check():
  sys.path[:0] = [os.path.join(os.path.dirname(HERE), "bench")]
  import jax
  import attention_core as ac
  import test_triton_attention as tta
  from kernels.attention import tiles as at
  from kernels.attention import triton_attention as ta
  interpreter_loop_bounds()
  ta._launch = tta._interpreter_launch

  def inputs(shape, seed=0):  # float32: the interpreter has no bf16
    b, t, h, dk, d = shape
    ks = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(ks[0], (b, t, h, dk)), jax.random.normal(ks[1], (b, t, 1, dk)),
            jax.random.normal(ks[2], (b, t, 1, d)), jax.random.normal(ks[3], (b, t, h, d)))

  timed = []

  def timer(kernel, fn, *args):
    jax.block_until_ready(fn(*args))
    timed.append(kernel)
    return FAKE_MS[kernel]

  ac.inputs = inputs
  # One candidate each beside the defaults (the interpreter is slow), tiles for the tiny shape.
  ac.CANDIDATES = {k: [] for k in ac.CANDIDATES}
  ac.CANDIDATES.update(dq_ds=[(16, 16, 16, 4, 2)], dk_ds=[(16, 32, 16, 4, 2)],
                       ds=[(32, 16, 16, 4, 2)], dx_p=[(16, 32, 48, 4, 2)], dxdk=[(16, 16, 48, 4, 2)])
  # The stored forms' own default tiles (the sweep's first candidates) sized for the tiny shape too.
  at.stored_tiles = lambda dk: (at.PassTiles(16, 16, 16, 4, 2), at.PassTiles(32, 16, 16, 4, 2),
                                at.PassTiles(16, 32, 16, 4, 2))
  shape = (1, 37, 3, 16, 48)
  at.TABLE[(16, 48)] = at.FlashTiles(fwd=at.PassTiles(16, 16, 48), dx=at.PassTiles(16, 16, 48),
                                     dk=at.PassTiles(16, 16, 16), dq=at.PassTiles(16, 16, 16))
  progress = []
  chosen, results = ac.sweep("tiny", shape, budget_s=1e9, timer=timer, progress=progress.append)
  print("CHOSEN", at.tiles_to_json(chosen))
  # After every kernel the tiles so far, in the starting (recomputing) form: a cut sweep's file.
  assert len(progress) == len(results) and all(p.ds is None and p.dq_ds is None for p in progress)
  assert set(timed) == set(FAKE_MS), sorted(set(timed))
  for kernel, rows in results.items():
    assert rows, kernel
    for row in rows:
      assert "error" not in row, (kernel, row)
      assert row["err"] < 1e-5, (kernel, row)   # float32: every form agrees with the separate passes
  assert chosen.ds == at.PassTiles(32, 16, 16, 4, 2) and chosen.dk_ds == at.PassTiles(16, 32, 16, 4, 2)
  assert chosen.dq_ds == at.PassTiles(16, 16, 16, 4, 2) and chosen.dx_p and chosen.dxdk is None
  assert at.tiles_from_json(at.tiles_to_json(chosen)) == chosen
  # the recomputing dX pass's tiles kept beside the reader's (`with_backward(.., "recompute")`)
  assert chosen.dx == at.PassTiles(16, 16, 48) and chosen.dx_tiles(reads_p=True) == chosen.dx_read
  # The fused dX + dK pass with dQ wins once the pair pass is slow.
  FAKE_MS["ds"] = 5.0
  chosen, _ = ac.sweep("tiny", shape, budget_s=1e9, timer=timer)
  assert chosen.ds is None and chosen.dq_ds is None and chosen.dxdk is not None, chosen
  # Restricted to dQ from the stored dS: its candidates are tried, the passes its form needs (the
  # pair pass, dK from dS, dX reading P) run on their own tiles only, the references run, nothing
  # else.
  timed.clear()
  kernels, partners = ac.sweep_kernels("dq_ds")
  assert (kernels, partners) == (["dq_ds"], ["dk_ds", "ds", "dx_p"])
  _, results = ac.sweep("tiny", shape, budget_s=1e9, kernels=kernels, partners=partners, timer=timer)
  assert set(results) == {"fwd", "dx", "dk", "dq", "ds", "dk_ds", "dq_ds", "dx_p"}, sorted(results)
  assert len(results["dx_p"]) == len(results["ds"]) == len(results["dk_ds"]) == 1
  assert timed.count("dq_ds") == len(results["dq_ds"])   # the kernel whose candidates are tried
  print("ATTENTION_SWEEP_OK")


@pytest.mark.extras("triton")
def test_the_sweep_runs_every_form_and_picks_the_fastest():
  run_in_triton_interpreter("test_attention_core_bench", "_sweep_check", "ATTENTION_SWEEP_OK",
                            timeout=600)


def _time_cores_in_interpreter():
  """bench/attention_core.py and tests/test_triton_attention.py (its launcher) with the Triton
  kernels in the interpreter, float32 inputs (the interpreter has no bf16) and a fixed timer
  (fwd 1.0, fwd+bwd 3.0 ms): what `time_cores` runs on CPU. Returns (attention_core, the test
  module, whose LAUNCHES / LAUNCH_META record every launch)."""
  sys.path[:0] = [os.path.join(os.path.dirname(HERE), "bench")]
  import jax
  import attention_core as ac
  import test_triton_attention as tta
  from kernels.attention import triton_attention as ta
  interpreter_loop_bounds()
  ta._launch, ta.available, ta.DTYPES = tta._interpreter_launch, (lambda: True), (jax.numpy.float32,)
  real_inputs = ac.inputs
  ac.inputs = lambda shape, seed=0: tuple(
      x.astype(jax.numpy.float32) for x in real_inputs(shape, seed))
  ac.time_fwd_bwd = lambda fn, *args: (jax.block_until_ready(fn(*args)), 1.0, 3.0)[1:]
  return ac, tta


def _split_check():
  """time_cores at a head of two exact pieces (dk 48 = 32 + 16): the Triton core checked against
  XLA and timed, every launch on the two pieces."""
  ac, tta = _time_cores_in_interpreter()
  shape = (1, 21, 2, 48, 32)
  ac.SHAPES["split_tiny"] = shape
  n_launch = len(tta.LAUNCHES)
  row = ac.time_cores("split_tiny", shape, which=("xla", "triton"), backwards=("auto", "recompute"))
  assert {"xla", "triton", "triton_recompute"} <= set(row), row
  for key in ("triton", "triton_recompute"):
    assert row[f"{key}_err"] < 1e-5 and row[f"{key}_grad_err"] < 1e-5, row
  pieces = {(m["DK1"], m["DK2"]) for m in tta.LAUNCH_META[n_launch:] if "DK1" in m}
  assert pieces == {(32, 16)}, pieces
  print("ATTENTION_SPLIT_OK")


@pytest.mark.extras("triton")
def test_the_core_is_checked_and_timed_on_keys_of_two_exact_pieces():
  run_in_triton_interpreter("test_attention_core_bench", "_split_check", "ATTENTION_SPLIT_OK",
                            timeout=600)


def test_a_cut_sweep_keeps_its_starting_form_with_what_it_measured():
  """partial_tiles: the kernels timed so far replace the starting tiles' own, in the fields that
  form launches (the dX pass reading P goes to dx_read), and kernels of other forms change
  nothing."""
  sys.path[:0] = [os.path.join(os.path.dirname(HERE), "bench")]
  import attention_core as ac
  from kernels.attention import tiles as at
  new = (16, 16, 16, 4, 2)
  best = {kn: (new, 1.0) for kn in ac.FIELD_OF}
  pairs = at.default_tiles(192, 768)
  got = ac.partial_tiles(pairs, {"fwd": best["fwd"], "ds": best["ds"], "dx_p": best["dx_p"],
                                 "dxdk": best["dxdk"]})
  assert (got.fwd, got.ds, got.dx_read) == (at.PassTiles(*new),) * 3
  assert (got.dk, got.dxdk, got.dq_ds, got.dk_ds) == (pairs.dk, None, pairs.dq_ds, pairs.dk_ds)
  recompute = at.with_backward(pairs, "recompute", 192)
  got = ac.partial_tiles(recompute, best)
  assert got == at.FlashTiles(*(at.PassTiles(*new),) * 4)      # fwd, dx, dk, dq only
  assert ac.partial_tiles(pairs, {}) == pairs


def test_the_delta_forms_agree_with_a_float64_row_dot():
  """`--delta`: every form of delta = <dO[r], out[r]> the bench times, and the library's, against
  numpy in float64 on fresh bf16 rows; each gets a time."""
  sys.path[:0] = [os.path.join(os.path.dirname(HERE), "bench")]
  import jax
  import jax.numpy as jnp
  import attention_core as ac
  shape = (2, 8, 3, 16, 40)
  rows = ac.time_delta("tiny", shape)
  assert set(rows) == set(ac.DELTA_FORMS) | {"library"}
  b, t, h, _, d = shape
  ko, kd = jax.random.split(jax.random.key(3))   # the bench's own inputs, re-made here in float64
  out = np.asarray(jax.random.normal(ko, (b, t, h, d), jnp.float32).astype(jnp.bfloat16), np.float64)
  dout = np.asarray(jax.random.normal(kd, (b, t, h, d), jnp.float32).astype(jnp.bfloat16), np.float64)
  want = (out * dout).sum(-1)
  from kernels.attention import triton_attention as ta
  for form, fn in {**ac.DELTA_FORMS, "library": lambda o, g: ta._delta(o, g).reshape(b, t, h)}.items():
    got = np.asarray(fn(jnp.asarray(out, jnp.bfloat16), jnp.asarray(dout, jnp.bfloat16)), np.float64)
    assert got.shape == want.shape and np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), form
    assert rows[form]["ms"] > 0 and rows[form]["err"] < 1e-6, form
