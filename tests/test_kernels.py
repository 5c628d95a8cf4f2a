"""CPU tests of kernels/: backend wiring, tuning-table lookup, launch geometry and work-list schedules
against numpy, the gather-only fused dispatch against umoe_jax.ops.dispatch, and the kernels themselves
where an interpreter runs them on CPU:
  - the Pallas Mosaic GPU kernels (gmm, transposed gmm, tgmm) under the Mosaic GPU interpreter
    (InterpretGPUParams), with the two things its jax 0.10 version lacks filled in by the test;
  - the Triton kernels (all three ops) under TRITON_INTERPRET=1 where Triton is installed (CI installs
    it; the GPU tests in tests/gpu cover both on hardware).
"""
from __future__ import annotations

import dataclasses
import inspect
import itertools
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import interpreter_loop_bounds, run_in_triton_interpreter
from mgpu_interpret import mosaic_interpreter
from umoe_jax.ops import gmm_backends as GB
from umoe_jax.ops import ragged
from kernels.gmm import schedule, tuning
from kernels.gmm import triton_gmm
from umoe_jax.ops import gmm as G

BENCH_SHAPES = [(768, 192), (192, 768), (2048, 512), (512, 2048)]


def _ref_gmm(a, w, gs, transpose_rhs=False):
  a = np.asarray(a, np.float32); w = np.asarray(w, np.float32)
  out = np.zeros((a.shape[0], w.shape[1] if transpose_rhs else w.shape[2]), np.float32)
  s = 0
  for g, n in enumerate(np.asarray(gs)):
    out[s:s + n] = a[s:s + n] @ (w[g].T if transpose_rhs else w[g])
    s += n
  return out


def _ref_tgmm(a, b, gs):
  a = np.asarray(a, np.float32); b = np.asarray(b, np.float32)
  out = np.zeros((len(gs), a.shape[1], b.shape[1]), np.float32)
  s = 0
  for g, n in enumerate(np.asarray(gs)):
    out[g] = a[s:s + n].T @ b[s:s + n]
    s += n
  return out


def _random_sizes(rng, m, g, p_empty=0.3):
  used = int(rng.integers(0, m + 1))
  gs = np.floor(rng.dirichlet(np.ones(g)) * used).astype(np.int64)
  gs[-1] += used - gs.sum()
  gs[rng.random(g) < p_empty] = 0
  return gs.astype(np.int32)


# ----------------------------------------------------------------------------------------------
# Wiring.


def test_import_registers_gpu_backends_only_for_gpu():
  G.register_builtin_kernels()
  for name in ("triton", "mosaic"):
    if name in G.BACKENDS:
      be = G.BACKENDS.get(name)
      assert be.platforms == ("gpu",)
      assert be.auto_priority == GB.AUTO_PRIORITY[name] >= 0
  # On the CPU, auto never picks a GPU kernel, and asking for one by name is a clear error.
  assert G.resolve_backend("auto", "cpu") == "xla"
  if "triton" in G.BACKENDS:
    with pytest.raises(ValueError, match="does not run on platform 'cpu'"):
      G.resolve_backend("triton", "cpu")


def test_auto_on_gpu_prefers_the_fastest_available_kernel(monkeypatch):
  G.register_builtin_kernels()
  entries = G.BACKENDS._entries
  for name in ("triton", "mosaic"):
    if name in entries:
      monkeypatch.setitem(entries, name, dataclasses.replace(entries[name], available=lambda: False))
  assert G.resolve_backend("auto", "gpu") == "xla"  # nothing available: portable fallback
  fake = lambda name: G.GmmBackend(gmm=ragged.xla_gmm, tgmm=ragged.xla_tgmm, platforms=("gpu",),
                                   auto_priority=GB.AUTO_PRIORITY[name], available=lambda: True)
  monkeypatch.setitem(entries, "triton", fake("triton"))
  monkeypatch.setitem(entries, "mosaic", fake("mosaic"))
  best = max(GB.AUTO_PRIORITY, key=GB.AUTO_PRIORITY.get)
  assert G.resolve_backend("auto", "gpu") == best
  monkeypatch.setitem(entries, best, dataclasses.replace(entries[best], available=lambda: False))
  assert G.resolve_backend("auto", "gpu") != best


@pytest.mark.parametrize("hide", [(), ("triton", "jax_triton")])
def test_kernel_modules_import_without_gpu_toolchain(hide):
  # Importing must not raise whatever is missing (Triton, jax_triton, Hopper). A fresh interpreter,
  # not importlib.reload: a reload here would leave other tests' module-level functions stale.
  mods = ("kernels.gmm.triton_gmm", "kernels.gmm.mosaic_gmm", "kernels.gmm.schedule",
          "kernels.gmm.tuning", "kernels.gmm.triton_fp8_gmm", "kernels.gmm.triton_fp8_quant",
          "kernels.gmm.triton_fan_in", "kernels.gmm.megablox_gmm")
  code = ("import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in hide)
          + "".join(f"import {m}\n" for m in mods)
          + "import jax\nfrom kernels.gmm import triton_gmm\n"
          "print(triton_gmm.available(), any(d.platform == 'gpu' for d in jax.devices()))\n")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                     timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  available, gpu = r.stdout.split()
  assert available == "False" or gpu == "True"
  if hide:
    assert available == "False"


# ----------------------------------------------------------------------------------------------
# Tuning table.


@pytest.mark.parametrize("backend", ["triton", "mosaic"])
@pytest.mark.parametrize("op", ["gmm", "gmm_t", "tgmm"])
def test_tuning_table_covers_bench_shapes_and_is_valid(backend, op):
  for kc, no in BENCH_SHAPES:
    key = (backend, op, kc, no)
    cfg = tuning.lookup(backend, op, 1 << 18, kc, no, 64)
    assert key in tuning.TABLE, key
    assert cfg == tuning.TABLE[key]
    if backend == "triton":
      hi, rest = triton_gmm.split_width(cfg.bn)
      assert hi + rest == cfg.bn and hi & (hi - 1) == 0 and (rest & (rest - 1)) == 0
    else:
      from kernels.gmm import mosaic_gmm as mgpu_gmm
      if op == "tgmm":
        assert kc % cfg.bm == 0 and no % cfg.bn == 0
      else:
        assert mgpu_gmm.gmm_supported(1 << 18, kc, no, jnp.bfloat16, cfg)
      assert cfg.bm * cfg.bn <= 128 * 192  # one warpgroup's float32 accumulator


def test_tuning_default_for_unknown_shapes():
  cfg = tuning.lookup("triton", "gmm", 1000, 96, 80, 3)
  assert cfg == tuning.default_config("triton", "gmm", 1000, 96, 80, 3)
  assert ("triton", "gmm", 96, 80) not in tuning.TABLE
  # A table entry wins over the default, and a custom table can be passed in.
  custom = {("triton", "gmm", 96, 80): tuning.TileConfig(64, 64, 32, 4, 2)}
  assert tuning.lookup("triton", "gmm", 1000, 96, 80, 3, table=custom).bm == 64
  with pytest.raises(ValueError):
    tuning.lookup("triton", "gmm", 1000, 96, 80, 3,
                  table={("triton", "gmm", 96, 80): tuning.TileConfig(64, 100, 32)})
  for op in ("gmm", "gmm_t", "tgmm"):
    for kc, no in BENCH_SHAPES:
      assert tuning.candidates("triton", op, kc, no)[0] == tuning.lookup("triton", op, 0, kc, no, 0)


def test_tuning_gathered_ops_fall_back_to_plain_rows():
  """A "+gather" op uses its own row when the table has one, else the plain op's (M-specific first)."""
  plain = tuning.TileConfig(128, 128, 64, 4, 3)
  m_rows = tuning.TileConfig(256, 128, 64, 8, 3)
  gathered = tuning.TileConfig(64, 64, 32, 4, 5)
  table = {("triton", "gmm", 96, 80): plain, ("triton", "gmm", 96, 80, tuning.m_bucket(4096)): m_rows}
  assert tuning.lookup("triton", "gmm+gather", 1000, 96, 80, 3, table=table) == plain
  assert tuning.lookup("triton", "gmm+gather", 4096, 96, 80, 3, table=table) == m_rows
  table[("triton", "gmm+gather", 96, 80)] = gathered
  assert tuning.lookup("triton", "gmm+gather", 4096, 96, 80, 3, table=table) == gathered
  assert tuning.lookup("triton", "gmm", 4096, 96, 80, 3, table=table) == m_rows
  # Not in any table: the plain op's default (tgmm's differs from gmm's).
  assert (tuning.lookup("triton", "tgmm+gather", 10, 96, 80, 3, table={})
          == tuning.default_config("triton", "tgmm", 10, 96, 80, 3))
  cands = tuning.candidates("triton", "gmm+gather", 2048, 512, 1 << 18)
  assert cands[0] == tuning.lookup("triton", "gmm+gather", 1 << 18, 2048, 512, 64)
  assert any(c.num_stages > cands[0].num_stages for c in cands[1:])


def test_tgmm_runs_one_program_a_tile():
  """tgmm's grid is one program per output tile; a persistent tile is refused naming it, and the
  sweep never offers one."""
  cfg = tuning.TileConfig(64, 128, 64, 4, 5)
  assert triton_gmm.tgmm_launch(4096, 192, 768, 128, cfg)["grid"] == (128 * 3 * 6,)
  with pytest.raises(ValueError, match="one program a tile"):
    triton_gmm.tgmm_launch(4096, 192, 768, 128, dataclasses.replace(cfg, persistent=1))
  for op, kc, no in (("tgmm+gather", 192, 768), ("tgmm+gather", 768, 192), ("tgmm", 2048, 512)):
    cands = tuning.candidates("triton", op, kc, no, 1 << 19)
    assert not any(c.persistent for c in cands), op
    assert len(cands) == len(set(cands))


def test_tgmm_tile_order_largest_groups_first_where_skewed():
  """`tile_order` against numpy's stable sort by decreasing size (ties by index, empty groups
  last) where the largest group holds at least `skew` times the mean group's rows, and group order
  where it does not; fewer sizes than groups count as empty groups; a bad skew is named."""
  rng = np.random.default_rng(15)
  cases = ([3, 0, 7, 7, 0, 12], [5] * 8, [4], [9, 10, 11, 10], [0, 0, 0],
           rng.integers(0, 4, 8).tolist(), rng.integers(0, 1000, 6).tolist(),
           rng.integers(90, 110, 128).tolist(),
           (rng.dirichlet(np.ones(128)) * 4e5).astype(int).tolist())
  ranked_seen = set()
  for sizes, skew in itertools.product(cases, (1, 2, 3)):
    gs = np.asarray(sizes, np.int64)
    ranked = gs.max() * len(gs) >= skew * gs.sum()
    ranked_seen.add(bool(ranked))
    want = np.argsort(-gs, kind="stable") if ranked else np.arange(len(gs))
    got = triton_gmm.tile_order(jnp.asarray(gs, jnp.int32), len(gs), skew)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, want, err_msg=f"{sizes} skew={skew}")
  assert ranked_seen == {True, False}
  # 2 sizes for 4 groups: groups 2 and 3 are empty ([0, 6, 0, 0]: 6 * 4 >= 2 * 6, ranked)
  np.testing.assert_array_equal(triton_gmm.tile_order(jnp.asarray([0, 6]), 4, 2), [1, 0, 2, 3])
  # more sizes than groups: the first num_groups; at the gate's equality (4 * 4 == 2 * 8): ranked
  np.testing.assert_array_equal(triton_gmm.tile_order(jnp.asarray([1, 9, 30]), 2, 1), [1, 0])
  np.testing.assert_array_equal(triton_gmm.tile_order(jnp.asarray([2, 4, 0, 2]), 4, 2),
                                [1, 0, 3, 2])
  # under jit, max * G past int32 (2^23 rows in one of 256 groups, 2^31): still ranked
  big = jnp.zeros(256, jnp.int32).at[7].set(1 << 23).at[3].set(5)
  got = jax.jit(lambda s: triton_gmm.tile_order(s, 256, 2))(big)
  assert list(np.asarray(got[:3])) == [7, 3, 0]
  for bad in (0, -1, 1.5, True):
    with pytest.raises(ValueError, match=re.escape(f"skew={bad!r}")):
      triton_gmm.tile_order(jnp.asarray([1, 2]), 2, bad)


def test_spill_free_epilogue_dgrad_candidates_only_at_the_base_width():
  """The fused-epilogue tiles that compile without spills at 768 -> 192 are offered for that
  dgrad, within Hopper's shared memory, and not for other widths or ops."""
  spill_free = [tuning.TileConfig(128, 192, 64, 8, 4, prefetch_row_dot=True),
            tuning.TileConfig(128, 64, 64, 8, 3),
            tuning.TileConfig(128, 128, 64, 8, 4, prefetch_row_dot=True)]
  dgrad = tuning.candidates("triton", "gmm_t+gather", 768, 192, 1 << 19)
  assert all(c in dgrad for c in spill_free)
  assert all(tuning.triton_gmm_shared_bytes(c) <= tuning.HOPPER_SHARED_BYTES for c in spill_free)
  for op, kc, no in (("gmm_t+gather", 2048, 512), ("gmm+gather", 768, 192)):
    assert not any(c in tuning.candidates("triton", op, kc, no, 1 << 19) for c in spill_free), op


def test_tuning_candidates_fit_hopper_shared_memory(monkeypatch):
  """Past the tabled tile, no Triton gmm candidate needs more shared memory than a Hopper block
  may take (deeper pipelines of a wide tile would fail at launch); the two-programs-per-SM tiles
  are offered for the 768 -> 192 dgrad."""
  for op, kc, no in (("gmm_t+gather", 768, 192), ("gmm+gather", 768, 192), ("gmm", 192, 768),
                     ("gmm_t+gather", 2048, 512), ("gmm", 512, 2048)):
    cands = tuning.candidates("triton", op, kc, no, 1 << 19)
    assert len(cands) == len(set(cands)) >= 5, (op, kc, no)
    over = [c for c in cands[1:] if tuning.triton_gmm_shared_bytes(c) > tuning.HOPPER_SHARED_BYTES]
    assert not over, (op, kc, no, over)
  # Without its gathered row the dgrad starts from the plain op's 128x192x64 / 5 stages (200 KB):
  # its deeper pipelines (240, 280 KB) are not offered, the 64-row 4-warp tiles are.
  monkeypatch.setattr(tuning, "TABLE", {k: v for k, v in tuning.TABLE.items()
                                        if k[:2] != ("triton", "gmm_t+gather")})
  dgrad = tuning.candidates("triton", "gmm_t+gather", 768, 192, 1 << 19)
  assert dgrad[0] == tuning.TABLE[("triton", "gmm_t", 768, 192)] and dgrad[0].num_stages == 5
  for stages in (6, 7):
    deep = dataclasses.replace(dgrad[0], num_stages=stages)
    assert tuning.triton_gmm_shared_bytes(deep) > tuning.HOPPER_SHARED_BYTES
    assert deep not in dgrad and dataclasses.replace(deep, persistent=1) not in dgrad
  # gmm_combine's input gradient: the tile with its epilogue operand loaded early comes next.
  assert dgrad[1] == dataclasses.replace(dgrad[0], prefetch_row_dot=True)
  assert not any(c.prefetch_row_dot for c in tuning.candidates("triton", "gmm+gather", 768, 192))
  # ... then the epilogue left to XLA, on the tiles of the plain matmuls of these widths.
  assert dgrad[2:4] == [dataclasses.replace(tuning.lookup("triton", op, 1 << 19, 768, 192, 0),
                                            xla_epilogue=True) for op in ("gmm+gather", "gmm_t")]
  assert not any(c.xla_epilogue for c in tuning.candidates("triton", "gmm+gather", 768, 192))
  two_per_sm = [c for c in dgrad[1:6] if c.bm == 64 and c.num_warps == 4]
  assert two_per_sm and all(2 * tuning.triton_gmm_shared_bytes(c) <= tuning.HOPPER_SHARED_BYTES
                            for c in two_per_sm)


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


_NP_ACTS = {None: (lambda x: x, lambda x: np.ones_like(x)),
            "silu": (lambda x: x * _sigmoid(x),
                     lambda x: _sigmoid(x) * (1 + x * (1 - _sigmoid(x)))),
            "relu": (lambda x: np.maximum(x, 0), lambda x: (x > 0).astype(np.float64))}


def _epilogue_reference(u, scale, z, act_name, z_dtype):
  """numpy float64: (u * act'(z) * scale, <u, act(z)>, act(z) rounded to z's dtype * scale)."""
  act, dact = _NP_ACTS[act_name]
  u, z, scale = (np.asarray(a, np.float64) for a in (u, z, scale))
  rounded = np.asarray(jnp.asarray(act(z), jnp.float32).astype(z_dtype), np.float64)
  return u * dact(z) * scale[:, None], (u * act(z)).sum(-1), rounded * scale[:, None]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("act_name", [None, "silu", "relu"])
def test_row_dot_epilogue_matches_numpy(act_name, dtype):
  """`umoe_jax.ops.epilogue` (the row-dot epilogue in XLA: backends without the fused one, and
  Triton tiles with `TileConfig.xla_epilogue`) against numpy in float64 from a float32 product:
  the output times act'(z) (and the row scale, when given), the row dots with act(z), and the
  scaled rows act(z) * scale with act rounded to z's dtype first, exactly as that rounding."""
  from umoe_jax.ops import epilogue
  rng = np.random.default_rng(7 + (act_name is None) + 2 * (dtype == jnp.bfloat16))
  m, n = 37, 48
  u = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
  z = jnp.asarray(2 * rng.standard_normal((m, n)), dtype)
  scale = jnp.asarray(rng.uniform(0.1, 1.0, m), jnp.float32)
  run = jax.jit(epilogue.row_dot_epilogue, static_argnums=(3, 4))
  out, dots = run(u, scale, z, act_name, dtype)
  unscaled, unscaled_dots = run(u, None, z, act_name, dtype)
  rows = jax.jit(epilogue.gate_scaled, static_argnums=2)(z, scale, act_name)
  want_out, want_dots, want_rows = _epilogue_reference(u, scale, z, act_name, dtype)
  tol = 1e-6 if dtype == jnp.float32 else 1e-2
  assert out.dtype == unscaled.dtype == rows.dtype == dtype and dots.dtype == jnp.float32
  for name, got, want in (("out", out, want_out), ("unscaled", unscaled, want_out / np.asarray(
      scale, np.float64)[:, None]), ("dots", dots, want_dots), ("unscaled dots", unscaled_dots,
                                                                  want_dots)):
    got = np.asarray(got, np.float64)
    assert np.linalg.norm(got - want) <= tol * np.linalg.norm(want), name
  # The rows bit for bit: float32 act(z) (jax.nn's) rounded to z's dtype, then scaled, rounded.
  act32 = {None: lambda x: x, "silu": jax.nn.silu, "relu": jax.nn.relu}[act_name]
  a = np.asarray(act32(z.astype(jnp.float32)).astype(dtype), np.float32)
  want_rows = jnp.asarray(a * np.asarray(scale)[:, None]).astype(dtype)
  np.testing.assert_array_equal(np.asarray(rows, np.float32), np.asarray(want_rows, np.float32))
  assert epilogue.row_dot_epilogue(u, scale, None, None, dtype)[1] is None


def _replace_triton_call(monkeypatch, fake):
  """triton_gmm's launches go to `fake` (jax_triton.triton_call's signature) instead of jax-triton,
  which needs a GPU."""
  monkeypatch.setattr(triton_gmm, "jt", type("FakeJT", (), {"triton_call": staticmethod(fake)}),
                      raising=False)


@pytest.mark.extras("triton")
def test_triton_gmm_launches_the_silu_epilogue_with_the_fast_sigmoid(monkeypatch):
  """The dgrad call with the silu epilogue launches the kernel with FAST_SIGMOID on (tanh.approx,
  GPU only; the interpreter's launches in this file leave the kernel's default, off); the launch
  replaced by a recorder (no GPU)."""
  launches = []

  def fake_triton_call(*args, out_shape, **params):
    launches.append(params)
    return [jnp.zeros(s.shape, s.dtype) for s in out_shape]

  _replace_triton_call(monkeypatch, fake_triton_call)
  m, kc, no = 40, 32, 16
  args = (jnp.ones((m, kc), jnp.bfloat16), jnp.ones((2, no, kc), jnp.bfloat16),
          jnp.asarray([20, 20], jnp.int32))
  z = jnp.ones((m, no), jnp.bfloat16)
  cfg = tuning.TileConfig(64, 16, 32, 4, 3)
  triton_gmm.triton_gmm(*args, transpose_rhs=True, config=cfg, row_dot=z, epi_act="silu")
  assert launches[-1]["FAST_SIGMOID"] is True and launches[-1]["EPI_ACT"] == 1
  default = inspect.signature(triton_gmm._gmm_kernel.fn).parameters["FAST_SIGMOID"].default
  assert default is False     # what the interpreter's direct launches get


@pytest.mark.extras("triton")
def test_triton_gmm_with_the_xla_epilogue_runs_the_plain_kernel(monkeypatch):
  """With `TileConfig.xla_epilogue` the dgrad call (gathered rows, row scale, row dot with the silu
  epilogue, scaled rows) launches the kernel without any epilogue, on the same tile and gathered
  rows, writing a float32 product, and returns the epilogue's results from it (the launch replaced
  by a numpy product here: jax-triton needs a GPU)."""
  launches = []

  def fake_triton_call(lhs, rhs, gs, index, scale, other, *, kernel, grid, out_shape, **params):
    launches.append(dict(params, out_dtype=out_shape[0].dtype))
    rows = np.asarray(lhs, np.float32)[np.asarray(index)] if params["A_INDEX"] else lhs
    product = _ref_gmm(rows, np.asarray(rhs, np.float32), gs, transpose_rhs=True)
    return [jnp.asarray(product, out_shape[0].dtype)] + [jnp.zeros(s.shape, s.dtype)
                                                         for s in out_shape[1:]]

  _replace_triton_call(monkeypatch, fake_triton_call)
  rng = np.random.default_rng(8)
  m, kc, no, g = 50, 32, 24, 3
  gs = np.array([20, 0, 25], np.int32)                    # 5 padding rows
  src = jnp.asarray(rng.standard_normal((30, kc)), jnp.float32)
  idx = jnp.asarray(rng.integers(0, 30, m), jnp.int32)
  w = jnp.asarray(rng.standard_normal((g, no, kc)) / 4, jnp.float32)
  z = jnp.asarray(2 * rng.standard_normal((m, no)), jnp.float32)
  scale = jnp.asarray(rng.uniform(0.1, 1.0, m), jnp.float32)
  cfg = tuning.TileConfig(64, 64, 32, 4, 3, xla_epilogue=True)
  out, dots, rows = triton_gmm.triton_gmm(src, w, jnp.asarray(gs), transpose_rhs=True, config=cfg,
                                          lhs_index=idx, row_scale=scale, row_dot=z, epi_act="silu",
                                          scaled_row_dot=True)
  (params,) = launches
  assert params["A_INDEX"] and not (params["ROW_DOT"] or params["ROW_SCALE"] or params["SCALED_D"])
  assert params["EPI_ACT"] == 0 and (params["BM"], params["BK"]) == (64, 32)
  assert params["out_dtype"] == jnp.float32   # the product is handed on unrounded
  u = _ref_gmm(np.asarray(src)[np.asarray(idx)], w, gs, transpose_rhs=True)   # padding rows 0
  for name, got, want in zip(("out", "dots", "rows"), (out, dots, rows),
                             _epilogue_reference(u, scale, z, "silu", jnp.float32)):
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5, err_msg=name)


def test_tuning_rows_round_trip_through_a_file_and_bad_files_are_named(tmp_path):
  """A sweep's rows written by rows_to_json load back as the same configs and win the lookup;
  a bad key, tile or file is refused with the file and the entry named."""
  rows = {("triton", "gmm_t+gather", 96, 80, tuning.m_bucket(4096)): tuning.TileConfig(64, 192, 32, 4, 5),
          ("triton", "tgmm", 96, 80): tuning.TileConfig(128, 64, 64, 8, 3, persistent=1)}
  path = tmp_path / "gmm_tiles.json"
  path.write_text(json.dumps(tuning.rows_to_json(rows)))
  table = {}
  assert tuning.load_table(str(path), table) == rows and table == rows
  assert tuning.lookup("triton", "gmm_t+gather", 4096, 96, 80, 3, table=table).bn == 192
  assert tuning.lookup("triton", "tgmm", 10, 96, 80, 3, table=table).persistent == 1
  tile = {"bm": 64, "bn": 64, "bk": 32}
  bad = [("triton|gmm|96", tile, "key 'triton|gmm|96' is not 'backend|op|kc|no"),
         ("triton|gmm|96|x", tile, "is not 'backend|op|kc|no"),
         ("triton|gmm|96|80", {"bm": 64, "bn": 64}, "entry 'triton|gmm|96|80' must give bm, bn, bk"),
         ("triton|gmm|96|80", dict(tile, warps=4), "must give bm, bn, bk"),
         ("triton|gmm|96|80", dict(tile, bn=100), "tile width 100"),
         ("triton|gmm|96|80", dict(tile, bm="64"), "as integers")]
  for key, obj, message in bad:
    path.write_text(json.dumps({key: obj}))
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*" + re.escape(message)):
      tuning.load_table(str(path), {})
  for text in ("[1, 2]", "{not json"):
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(str(path))):
      tuning.load_table(str(path), {})
  with pytest.raises(ValueError, match="no_such.json"):
    tuning.load_table(str(tmp_path / "no_such.json"), {})


def test_split_width():
  assert triton_gmm.split_width(192) == (128, 64)
  assert triton_gmm.split_width(256) == (256, 0)
  assert triton_gmm.split_width(96) == (64, 32)
  with pytest.raises(ValueError):
    triton_gmm.split_width(112)  # 64 + 48


# ----------------------------------------------------------------------------------------------
# Schedules against numpy.


def test_row_block_items_matches_numpy_and_covers_every_row_once():
  rng = np.random.default_rng(0)
  fn = jax.jit(schedule.row_block_items, static_argnums=(1, 2))
  for trial, (g, m, bm) in enumerate([(5, 100, 8), (5, 100, 8), (5, 100, 8), (1, 7, 8), (9, 257, 64),
                                      (9, 257, 64), (9, 257, 64), (5, 64, 64), (1, 1, 8)]):
    gs = _random_sizes(rng, m, g)
    if trial == 0:
      gs[:] = 0  # every row padding
    got = [np.asarray(v) for v in fn(jnp.asarray(gs), m, bm)]
    want = schedule.row_block_items_numpy(gs, m, bm)
    for a, b in zip(got, want):
      np.testing.assert_array_equal(a, b)
    seg_of_row = np.full(m, -1)
    bounds = np.concatenate([[0], np.cumsum(gs)])
    for grp, blk, lo, hi in zip(*got):
      if grp == g + 1:
        assert lo == hi == 0
        continue
      rows = blk * bm + np.arange(lo, hi)
      assert np.all(seg_of_row[rows] == -1), "row written twice"
      seg_of_row[rows] = grp
    expect = np.searchsorted(bounds[1:], np.arange(m), side="right")  # g for padding rows
    np.testing.assert_array_equal(seg_of_row, np.minimum(expect, g))


def test_triton_row_tile_bound_holds():
  # gmm_launch sizes the grid by cdiv(M, BM) + G + 1 group-aligned tiles; check against the real count.
  rng = np.random.default_rng(1)
  for _ in range(100):
    g = int(rng.integers(1, 40)); m = int(rng.integers(1, 5000)); bm = int(rng.choice([64, 128]))
    gs = _random_sizes(rng, m, g)
    segs = list(gs) + [m - gs.sum()]
    tiles = sum(-(-int(s) // bm) for s in segs)
    launch = triton_gmm.gmm_launch(m, 64, 192, g, tuning.TileConfig(bm, 192, 64))
    assert launch["grid"][0] >= tiles * launch["N_TILES"]
    assert launch["GP"] >= g + 1 and launch["BN"] + launch["BN2"] == 192


def test_group_row_blocks():
  gs = np.array([0, 70, 1, 0, 63], np.int32)
  starts, ends, first, nblk = (np.asarray(v) for v in schedule.group_row_blocks(jnp.asarray(gs), 140, 64))
  np.testing.assert_array_equal(starts, [0, 0, 70, 71, 71])
  np.testing.assert_array_equal(ends, [0, 70, 71, 71, 134])
  np.testing.assert_array_equal(first, [0, 0, 1, 1, 1])
  np.testing.assert_array_equal(nblk, [0, 2, 1, 0, 2])


# ----------------------------------------------------------------------------------------------
# Kernels under interpreters.


# Empty groups, groups smaller than a tile, group boundaries inside row blocks, padding rows past
# sum(group_sizes); M % 8 != 0 (the row padding TMA needs). gmm / gmm^T: 64-row blocks, so the last
# block reads past the padded M = 144; tgmm: M pads to 160 = 5 blocks of 32 rows (an aligned block
# read past M would be NaN here, zeros on hardware, where tgmm's row mask relies on it).
MOSAIC_CASES = {  # op: (M, K, N, group sizes, TileConfig(bm, bn, bk))
    "gmm": (141, 32, 32, [0, 61, 2, 0, 70], tuning.TileConfig(64, 16, 16, num_stages=2)),
    "gmm_t": (141, 32, 32, [0, 61, 2, 0, 70], tuning.TileConfig(64, 16, 16, num_stages=2)),
    "tgmm": (157, 32, 32, [0, 40, 3, 0, 100, 0], tuning.TileConfig(16, 16, 32, num_stages=2)),
}


@pytest.mark.ci_required
@pytest.mark.parametrize("op", sorted(MOSAIC_CASES))
def test_mosaic_kernels_in_interpreter(monkeypatch, op):
  """Every Mosaic GPU op (gmm, gmm with a transposed rhs, tgmm) under the interpreter against numpy."""
  launched = mosaic_interpreter(monkeypatch)
  from kernels.gmm import mosaic_gmm as mgpu_gmm
  m, k, n, gs, cfg = MOSAIC_CASES[op]
  gs = np.asarray(gs, np.int32)
  keys = jax.random.split(jax.random.key(3), 3)
  a = jax.random.normal(keys[0], (m, n if op == "gmm_t" else k), jnp.float32).astype(jnp.bfloat16)
  if op == "tgmm":
    b = jax.random.normal(keys[1], (m, n), jnp.float32).astype(jnp.bfloat16)
    assert mgpu_gmm.tgmm_supported(m + (-m) % 8, k, n, jnp.bfloat16, cfg)
    out = mgpu_gmm.mgpu_tgmm(a, b, jnp.asarray(gs), out_dtype=jnp.float32, config=cfg)
    want = _ref_tgmm(a, b, gs)
  else:
    w = jax.random.normal(keys[2], (len(gs), k, n), jnp.float32).astype(jnp.bfloat16)
    tr = op == "gmm_t"
    assert mgpu_gmm.gmm_supported(m + (-m) % 8, n if tr else k, k if tr else n, jnp.bfloat16, cfg)
    out = mgpu_gmm.mgpu_gmm(a, w, jnp.asarray(gs), transpose_rhs=tr, out_dtype=jnp.float32, config=cfg)
    want = _ref_gmm(a, w, gs, transpose_rhs=tr)
  assert len(launched) == 1, "the kernel did not run (a fallback answered)"
  out = np.asarray(out)
  assert out.shape == want.shape
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)
  if op == "tgmm":
    assert np.all(out[gs == 0] == 0), "an empty group's weight gradient is zero"
  else:
    assert np.all(out[gs.sum():] == 0), "padding rows are zero"


class _NpDtype:
  def __init__(self, name): self.name = name
  def __str__(self): return "torch." + self.name


# One object per dtype, alive for the whole run: Triton caches type lookups by the dtype object,
# so short-lived per-tensor dtype objects (whose ids get reused) gave stale element types.
_NP_DTYPES = {np.dtype(np.float32): _NpDtype("float32"), np.dtype(np.int32): _NpDtype("int32"),
              np.dtype(np.float16): _NpDtype("float16")}


class _NpTensor:
  """The few torch-tensor methods the Triton interpreter calls, over a numpy array."""

  def __init__(self, arr):
    self.arr = np.ascontiguousarray(arr)
    self.dtype = _NP_DTYPES[self.arr.dtype]

  def data_ptr(self): return self.arr.ctypes.data
  def untyped_storage(self): return self
  def cpu(self): return self
  def new_empty(self, *a, **k): return _NpTensor(self.arr[:0])
  def set_(self, storage, *a): self.arr = storage.arr; return self
  def storage_offset(self): return 0
  def size(self): return self.arr.shape
  def stride(self): return tuple(s // self.arr.itemsize for s in self.arr.strides)
  def copy_(self, other): pass


TRITON_CASES = [  # m, k, n, group sizes, (bm, bn, bk)
    (50, 32, 48, [0, 7, 20, 0, 13], (16, 48, 16)),   # 48 = 32 + 16 split tile, padding rows
    (64, 48, 32, [30, 0, 2, 32], (16, 16, 16)),
    (37, 24, 40, [5, 9], (16, 32, 16)),              # K, N not tile multiples
]


def _triton_interpreter_check():
  """Runs in a fresh process with TRITON_INTERPRET=1 set before Triton is imported."""
  interpreter_loop_bounds()
  T = triton_gmm
  for m, k, n, gs, tile in TRITON_CASES:
    rng = np.random.default_rng(m)
    gs = np.asarray(gs, np.int32)
    g = len(gs)
    a = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((g, k, n)).astype(np.float32)
    dy = rng.standard_normal((m, n)).astype(np.float32)
    # Fused gathers: operand rows read through a random index into a smaller source; output rows
    # scaled per row.
    src_a = rng.standard_normal((m // 3 + 1, k)).astype(np.float32)
    src_dy = rng.standard_normal((m // 2 + 1, n)).astype(np.float32)
    ia = rng.integers(0, src_a.shape[0], m).astype(np.int32)
    idy = rng.integers(0, src_dy.shape[0], m).astype(np.int32)
    scale = rng.standard_normal(m).astype(np.float32)
    none = lambda: _NpTensor(np.zeros(1, np.int32))  # a placeholder for an unused operand
    for persistent, index, row_scale, row_dot in ((0, False, False, False), (1, False, False, True),
                                                  (0, True, True, True), (2, True, False, False),
                                                  (2, True, True, True)):
      cfg = tuning.TileConfig(*tile, persistent=persistent)
      for tr, lhs, src, idx in ((False, a, src_a, ia), (True, dy, src_dy, idy)):
        kc, no = (n, k) if tr else (k, n)
        st = (k * n, 1, n) if tr else (k * n, n, 1)
        launch = T.gmm_launch(m, kc, no, g, cfg, num_sms=2)
        grid = launch.pop("grid"); launch.pop("num_warps"); launch.pop("num_stages")
        out = _NpTensor(np.full((m, no), np.nan, np.float32))
        other = rng.standard_normal((m, no)).astype(np.float32)
        dots = _NpTensor(np.full((launch["N_TILES"], m), np.nan, np.float32))
        T._gmm_kernel[grid](_NpTensor(src if index else lhs), _NpTensor(w), _NpTensor(gs),
                            _NpTensor(idx) if index else none(),
                            _NpTensor(scale) if row_scale else none(),
                            _NpTensor(other) if row_dot else none(), out, dots, none(), M=m, KC=kc, NO=no,
                            G=g, s_bg=st[0], s_bk=st[1], s_bn=st[2], A_INDEX=index,
                            ROW_SCALE=row_scale, ROW_DOT=row_dot, **launch)
        want = _ref_gmm(src[idx] if index else lhs, w, gs, tr)
        case = f"persistent={persistent} index={index} scale={row_scale} dot={row_dot}"
        if row_dot:  # the dot is taken before the scale; every row (padding rows too) is written
          np.testing.assert_allclose(dots.arr.sum(0), (want * other).sum(-1), rtol=1e-4, atol=1e-3,
                                     err_msg=case)
        if row_scale:
          want = want * scale[:, None]
        np.testing.assert_allclose(out.arr, want, rtol=1e-4, atol=1e-4, err_msg=case)
    for a_index, b_index, a_scale, permuted in (
        (False, False, False, False), (True, False, True, True), (False, True, True, False),
        (True, True, False, True)):
      # slot s runs group order[s]'s tiles: the identity (group order) or a random permutation
      order = rng.permutation(g) if permuted else np.arange(g)
      launch = T.tgmm_launch(m, k, n, g, tuning.TileConfig(*tile))
      _check_tgmm(T, none, launch, gs, (a, src_a, ia, a_index), (dy, src_dy, idy, b_index),
                  scale if a_scale else None, f"permuted={permuted}", order=order.astype(np.int32))
    # ...and does read it: group 1 named in every slot leaves the other groups unwritten (NaN)
    launch = T.tgmm_launch(m, k, n, g, tuning.TileConfig(*tile))
    with pytest.raises(AssertionError, match="nan location mismatch"):
      _check_tgmm(T, none, launch, gs, (a, src_a, ia, False), (dy, src_dy, idy, False), None,
                  "order [1] * G", order=np.ones(g, np.int32))
    _check_fused_activations(T, m, k, n, gs, tile, rng, none)
  # The epilogue on the second piece of a split column tile (48 = 32 + 16 output columns, as
  # UMoE-base's 192 = 128 + 64), with the zero tail, both grid forms.
  _check_fused_activations(T, 40, 48, 32, np.asarray([9, 0, 20], np.int32), (16, 48, 16),
                           np.random.default_rng(40), none)
  _check_tgmm_split_rows(T, none)
  print("TRITON_INTERPRETER_OK")


def _check_tgmm_split_rows(T, none):
  """tgmm with its output tile's rows in two pieces (48 = 32 + 16, as UMoE-base's 192 = 128 + 64
  down-projection weight gradient): all of K in one tile (K = 48), K ending inside the second piece
  (40, masked), two K tiles (96) with the second's pieces masked (88) or past K (64: K a multiple of
  the first piece, not of the tile), with gathered and scaled rows and an empty group."""
  rng = np.random.default_rng(48)
  gs = np.asarray([11, 0, 17, 6], np.int32)
  m, n, g = int(gs.sum()) + 3, 32, len(gs)  # 3 rows past the groups: never read
  for k, (a_index, b_index, a_scale) in itertools.product(
      (48, 40, 96, 88, 64), ((False, False, False), (True, True, True), (False, True, True))):
    src_a = rng.standard_normal((m + 5, k)).astype(np.float32)
    src_dy = rng.standard_normal((m + 2, n)).astype(np.float32)
    ia = rng.integers(0, src_a.shape[0], m).astype(np.int32)
    idy = rng.integers(0, src_dy.shape[0], m).astype(np.int32)
    scale = rng.standard_normal(m).astype(np.float32)
    launch = T.tgmm_launch(m, k, n, g, tuning.TileConfig(48, 16, 16))
    assert (launch["BK"], launch["BK2"], launch["K_TILES"]) == (32, 16, -(-k // 48))
    _check_tgmm(T, none, launch, gs, (src_a[:m], src_a, ia, a_index),
                (src_dy[:m], src_dy, idy, b_index), scale if a_scale else None,
                f"k={k}", order=np.arange(g, dtype=np.int32))


def _check_tgmm(T, none, launch, gs, lhs, rhs, scale, what, order):
  """Runs the tgmm kernel at `launch` (tgmm_launch's dict) and compares it with numpy. lhs / rhs:
  (plain operand [M, K|N], gather source, row index [M], gathered?); scale: the lhs rows' scale [M]
  or None; order: the tile order [G] (`tile_order`). Output starts as NaN, so a tile the kernel
  never writes fails."""
  (a, src_a, ia, a_index), (dy, src_dy, idy, b_index) = lhs, rhs
  m, k, n, g = a.shape[0], a.shape[1], dy.shape[1], len(gs)
  launch = dict(launch)
  grid = launch.pop("grid"); launch.pop("num_warps"); launch.pop("num_stages")
  out = _NpTensor(np.full((g, k, n), np.nan, np.float32))
  T._tgmm_kernel[grid](_NpTensor(src_a if a_index else a), _NpTensor(src_dy if b_index else dy),
                       _NpTensor(gs), _NpTensor(ia) if a_index else none(),
                       _NpTensor(idy) if b_index else none(),
                       none() if scale is None else _NpTensor(scale),
                       _NpTensor(order), out, M=m, K=k, N=n, G=g,
                       A_INDEX=a_index, B_INDEX=b_index, A_SCALE=scale is not None, **launch)
  lhs_rows = src_a[ia] if a_index else a
  want = _ref_tgmm(lhs_rows if scale is None else lhs_rows * scale[:, None],
                   src_dy[idy] if b_index else dy, gs)
  np.testing.assert_allclose(out.arr, want, rtol=1e-4, atol=1e-4,
                             err_msg=f"{what} a_index={a_index} b_index={b_index} "
                                     f"a_scale={scale is not None}")


def _check_fused_activations(T, m, k, n, gs, tile, rng, none):
  """The epilogue activation codes of the gmm kernel (moe.fuse_activation) against numpy: gmm^T
  with ROW_DOT + EPI_ACT (+ gathered rows and a row scale: gmm_combine's backward: dots with
  act(z), output times act'(z) before the scale), without and with SCALED_D (also the rows
  act(z) * scale, moe.fuse_weight_rows), with z's tile loaded after or before the contraction
  (PREFETCH_D); code 0 is no activation."""
  g = len(gs)
  acts = {code: _NP_ACTS[name] for code, name in ((0, None), (1, "silu"), (2, "relu"))}
  z = rng.standard_normal((m, k)).astype(np.float32) * 2        # pre-activations [M, F]
  w = rng.standard_normal((g, k, n)).astype(np.float32)
  src_dy = rng.standard_normal((m // 2 + 1, n)).astype(np.float32)
  idy = rng.integers(0, src_dy.shape[0], m).astype(np.int32)
  scale = rng.standard_normal(m).astype(np.float32)
  for (code, (act, dact)), scaled_d, (persistent, prefetch) in itertools.product(
      acts.items(), (False, True), ((0, False), (2, False), (0, True), (2, True))):
    cfg = tuning.TileConfig(*tile, persistent=persistent, prefetch_row_dot=prefetch)
    launch = T.gmm_launch(m, n, k, g, cfg, num_sms=2)                  # gmm^T: [M, N] -> [M, K]
    grid = launch.pop("grid"); launch.pop("num_warps"); launch.pop("num_stages")
    out = _NpTensor(np.full((m, k), np.nan, np.float32))
    dots = _NpTensor(np.full((launch["N_TILES"], m), np.nan, np.float32))
    rows = _NpTensor(np.full((m, k), np.nan, np.float32)) if scaled_d else none()
    T._gmm_kernel[grid](_NpTensor(src_dy), _NpTensor(w), _NpTensor(gs), _NpTensor(idy),
                        _NpTensor(scale), _NpTensor(z), out, dots, rows, M=m, KC=n, NO=k, G=g,
                        s_bg=k * n, s_bk=1, s_bn=n, A_INDEX=True, ROW_SCALE=True, ROW_DOT=True,
                        EPI_ACT=code, SCALED_D=scaled_d, **launch)
    u = _ref_gmm(src_dy[idy], w, gs, True)                             # [M, K], rows past the groups 0
    case = (f"EPI_ACT={code} SCALED_D={scaled_d} persistent={persistent} prefetch={prefetch} "
            f"K={k} tile={tile}")
    assert launch["PREFETCH_D"] == prefetch
    np.testing.assert_allclose(dots.arr.sum(0), (u * act(z)).sum(-1), rtol=1e-4, atol=1e-3,
                               err_msg=f"{case} dots")
    np.testing.assert_allclose(out.arr, u * dact(z) * scale[:, None], rtol=1e-4, atol=1e-4,
                               err_msg=case)
    if scaled_d:  # every row is written (the zero tail too: its tiles run the epilogue)
      np.testing.assert_allclose(rows.arr, act(z) * scale[:, None], rtol=1e-5, atol=1e-6,
                                 err_msg=f"{case} rows")


@pytest.mark.extras("triton")
def test_triton_kernels_in_interpreter():
  run_in_triton_interpreter("test_kernels", "_triton_interpreter_check", "TRITON_INTERPRETER_OK")
