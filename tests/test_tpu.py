"""The TPU path on CPU (issue 17; no TPU is reachable from these machines): the Pallas TPU kernels run
in the Pallas interpreter (UMOE_PALLAS_TPU_INTERPRET=1, `interpret=True`).

  * the "megablox" gmm backend (JAX's megablox gmm / tgmm) through `umoe_jax.ops.gmm.gmm`: values
    against a float64 loop and every gradient against autodiff of `jax.lax.ragged_dot`, with empty
    groups, group boundaries inside row tiles, M not a multiple of the tile, rows past the groups,
    skewed routing, lane widths over one tile, bfloat16, all groups empty;
  * the "splash" attention core (splash MHA and MQA, values wider than keys) against the XLA core,
    values and gradients;
  * both inside a whole model under 8-virtual-device layouts (subprocess) against one device.
Plus the TPU tables (generation from device_kind, tiles keyed by generation, peak FLOPs for MFU),
the multi-slice mesh (data across slices) and the workdir check (a URL of a store Orbax cannot write
checkpoints to is refused clearly; gs:// workdirs run: tests/test_storage_run.py).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.gmm import megablox_gmm, tuning
from test_kernels import _ref_gmm, _ref_tgmm
from conftest import ROOT
from test_parallel import run_script
from umoe_jax.model.attention.cores import causal_attention
from umoe_jax.ops import gmm as G
from umoe_jax.ops import pallas_tpu
from umoe_jax.parallel import mesh as mesh_lib
from umoe_jax.train import metrics


@pytest.fixture
def interpreter(monkeypatch):
  """The megablox backend registered for CPU and every Pallas TPU kernel interpreted, as
  UMOE_PALLAS_TPU_INTERPRET=1 makes them at import time."""
  monkeypatch.setenv(pallas_tpu.INTERPRET_ENV, "1")
  G.register_builtin_kernels()
  entry = G.BACKENDS.get("megablox")
  monkeypatch.setitem(G.BACKENDS._entries, "megablox", dataclasses.replace(entry, platforms=("tpu", "cpu")))


def _pallas_calls(fn, *args) -> int:
  return str(jax.make_jaxpr(fn)(*args)).count("pallas_call")


# ----------------------------------------------------------------------------------------------
# TPU tables.


@pytest.mark.parametrize("kind,gen,peak", [
    ("TPU v4", "v4", 275e12), ("TPU v5 lite", "v5e", 197e12), ("TPU v5e", "v5e", 197e12),
    ("TPU v5", "v5p", 459e12), ("TPU v5p", "v5p", 459e12), ("TPU v6 lite", "v6e", 918e12),
])
def test_tpu_generation_tiles_and_peak_flops(kind, gen, peak):
  assert pallas_tpu.generation(kind) == gen
  assert metrics.peak_flops_per_device(kind) == peak
  key = megablox_gmm.tuning_key(kind)
  assert key == f"megablox/{gen}"
  mm, tg = tuning.MEGABLOX_DEFAULTS[gen]
  got = tuning.lookup(key, "gmm", 1 << 18, 768, 192, 128)
  assert (got.bm, got.bk, got.bn) == mm
  got = tuning.lookup(key, "tgmm", 1 << 18, 768, 192, 128)
  assert (got.bm, got.bn, got.bk) == tg
  # a measured row for this generation wins over the default, and only for it
  row = tuning.TileConfig(bm=256, bk=512, bn=256)
  table = {(key, "gmm", 768, 192): row}
  assert tuning.lookup(key, "gmm", 4096, 768, 192, 8, table=table) == row
  other = "megablox/v4" if gen != "v4" else "megablox/v6e"
  assert tuning.lookup(other, "gmm", 4096, 768, 192, 8, table=table) != row
  for c in tuning.candidates(key, "gmm", 768, 192):  # lane tiles: 128-multiples (Mosaic blocks)
    assert c.bk % 128 == 0 and c.bn % 128 == 0 and c.bm % 16 == 0
  assert pallas_tpu.generation("cpu") is None and pallas_tpu.generation("NVIDIA H200") is None


def test_megablox_registered_for_tpu_and_auto_picks_it_there(monkeypatch):
  G.register_builtin_kernels()
  entry = G.BACKENDS.get("megablox")
  assert "tpu" in entry.platforms and "gpu" not in entry.platforms and not entry.row_index
  assert entry.available() == pallas_tpu.runs_here()
  on_tpu = dataclasses.replace(entry, available=lambda: True)  # as on a TPU host
  monkeypatch.setitem(G.BACKENDS._entries, "megablox", on_tpu)
  assert G.resolve_backend("auto", "tpu") == "megablox"
  monkeypatch.setitem(G.BACKENDS._entries, "megablox", dataclasses.replace(entry, available=lambda: False))
  assert G.resolve_backend("auto", "tpu") == "xla"
  monkeypatch.setitem(G.BACKENDS._entries, "megablox", entry)
  if not pallas_tpu.interpret():
    assert entry.platforms == ("tpu",) and G.resolve_backend("auto", "cpu") == "xla"
    with pytest.raises(ValueError, match="does not run on platform 'cpu'"):
      G.resolve_backend("megablox", "cpu")


# ----------------------------------------------------------------------------------------------
# megablox gmm / tgmm in the interpreter.

# name: (M, K, N, group sizes, dtype, tiles (bm, bk, bn) put in the table for this shape or None).
GMM_CASES = {
    # 16-row tiles: boundaries inside tiles, an empty group, 8 rows past the groups, M = 45 padded
    "boundaries": (45, 24, 40, [10, 0, 20, 7], jnp.float32, (16, 128, 128)),
    # 90% of the rows on one expert, two empty ones; K, N over one 128-lane tile (partial blocks)
    "skewed_wide": (200, 160, 136, [3, 0, 180, 0, 7, 10], jnp.float32, (64, 128, 128)),
    # the default tiles of the generation (one row tile), bfloat16 operands
    "bf16_default_tiles": (64, 32, 48, [30, 2, 0, 32], jnp.bfloat16, None),
    "all_empty": (32, 16, 24, [0, 0, 0], jnp.float32, (16, 128, 128)),
}


@pytest.mark.parametrize("name", sorted(GMM_CASES))
def test_megablox_values_and_gradients(name, interpreter, monkeypatch):
  """Both forms through the shared custom VJP, one jitted vjp each (all three kernels in it):
  out = gmm(a, w) and its cotangent pullback (da = gmm_t, dw = tgmm), and the transposed form
  out = gmm_t(a, w) (da = gmm, dw = tgmm of the cotangent and a), against float64 loops."""
  m, k, n, sizes, dtype, tiles = GMM_CASES[name]
  g = len(sizes)
  if tiles is not None:
    bm, bk, bn = tiles
    for op, kc, no in (("gmm", k, n), ("gmm_t", n, k)):
      monkeypatch.setitem(tuning.TABLE, (megablox_gmm.tuning_key(), op, kc, no),
                          tuning.TileConfig(bm=bm, bk=bk, bn=bn))
    for kc, no in ((k, n), (n, k)):
      monkeypatch.setitem(tuning.TABLE, (megablox_gmm.tuning_key(), "tgmm", kc, no),
                          tuning.TileConfig(bm=bk, bn=bn, bk=bm))
  rng = np.random.default_rng(len(name))
  gs = jnp.asarray(sizes, jnp.int32)
  w = jnp.asarray(rng.standard_normal((g, k, n)) / np.sqrt(k), dtype)
  bound = 2e-2 if dtype == jnp.bfloat16 else 1e-5
  used = sum(sizes)
  f64 = lambda a: np.asarray(a, np.float64)

  def check(got, want):
    got = f64(got)
    if not np.abs(want).max() > 0:
      assert not got.any()
    else:
      assert np.linalg.norm(got - want) / np.linalg.norm(want) < bound

  for transpose in (False, True):
    a = jnp.asarray(rng.standard_normal((m, n if transpose else k)), dtype)
    cot = jnp.asarray(rng.standard_normal((m, k if transpose else n)), jnp.float32)

    def pullback(a, w, cot, transpose=transpose):
      out, vjp = jax.vjp(lambda a, w: G.gmm(a, w, gs, backend="megablox", transpose_rhs=transpose,
                                            preferred_element_type=jnp.float32), a, w)
      return (out, *vjp(cot))

    assert _pallas_calls(pullback, a, w, cot) == 3
    out, da, dw = jax.jit(pullback)(a, w, cot)
    if transpose:   # out = a @ w[g].T: da = cot @ w[g], dw[g] = cot[g].T @ a[g]
      want = (_ref_gmm(f64(a), f64(w), sizes, True), _ref_gmm(f64(cot), f64(w), sizes),
              _ref_tgmm(f64(cot), f64(a), sizes))
    else:           # out = a @ w[g]: da = cot @ w[g].T, dw[g] = a[g].T @ cot[g]
      want = (_ref_gmm(f64(a), f64(w), sizes), _ref_gmm(f64(cot), f64(w), sizes, True),
              _ref_tgmm(f64(a), f64(cot), sizes))
    for got, ref in zip((out, da, dw), want):
      check(got, ref)
    assert not f64(out)[used:].any() and not f64(da)[used:].any()   # rows past the groups: zeros
    for e, size in enumerate(sizes):  # empty groups: zero weight gradients
      assert size or not f64(dw)[e].any()


# ----------------------------------------------------------------------------------------------
# splash attention in the interpreter.


@pytest.mark.parametrize("kv_heads,v_dim,t", [(3, 8, 384), (1, 24, 256)],
                         ids=["mha_3_blocks", "one_key_head_wide_v"])
def test_splash_core_matches_xla_values_and_gradients(kv_heads, v_dim, t, interpreter):
  """t = 384: three 128-blocks (the causal mask skips the blocks above the diagonal); t = 256: one
  256-block. Pre-mixing's shape: one key head, values wider than the key."""
  b, h, dk = 2, 3, 8
  rng = np.random.default_rng(kv_heads)
  q = jnp.asarray(rng.standard_normal((b, t, h, dk)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((b, t, kv_heads, dk)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((b, t, kv_heads, v_dim)), jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  att = lambda core: (lambda q, k, v: causal_attention(q, k, v, pos, pos, core=core))
  assert _pallas_calls(att("splash"), q, k, v) == 1 and _pallas_calls(att("xla"), q, k, v) == 0
  cot = jnp.asarray(rng.standard_normal((b, t, h, v_dim)), jnp.float32)

  def pullback(q, k, v, core):
    out, vjp = jax.vjp(att(core), q, k, v)
    return (out, *vjp(cot))

  got = jax.jit(functools.partial(pullback, core="splash"))(q, k, v)
  want = pullback(q, k, v, "xla")
  assert got[0].shape == (b, t, h, v_dim)
  for a, b_ in zip(got, want):  # output, dq, dk, dv
    assert float(jnp.linalg.norm(a - b_) / jnp.linalg.norm(b_)) < 1e-5
  # a cache (keys not the queries' own) or a length no 128-block divides: the XLA form
  pos2 = pos + 0
  assert _pallas_calls(lambda q, k, v: causal_attention(q, k, v, pos, pos2, core="splash"), q, k, v) == 0
  short = (q[:, :100], k[:, :100], v[:, :100])
  p100 = pos[:, :100]
  assert _pallas_calls(lambda q, k, v: causal_attention(q, k, v, p100, p100, core="splash"), *short) == 0


# ----------------------------------------------------------------------------------------------
# The backend and the core inside a model, on 8 virtual devices.


def test_tpu_kernels_under_8_device_layouts(tmp_path, monkeypatch):
  monkeypatch.setenv(pallas_tpu.INTERPRET_ENV, "1")
  out = tmp_path / "tpu_layouts.json"
  run_script("tpu_layouts.py", str(out))
  report = json.loads(out.read_text())
  assert report["kernels"]["pallas_calls"] >= 3, report   # splash fwd + the experts' gmm calls
  for layout, r in report["layouts"].items():
    assert r["loss_diff"] < 1e-5 and r["grad_rel"] < 1e-4, (layout, r)


# ----------------------------------------------------------------------------------------------
# Multi-slice mesh and workdirs.


@dataclasses.dataclass(frozen=True)
class _FakeTpu:
  id: int
  process_index: int
  slice_index: int


def test_multislice_mesh_puts_data_across_slices():
  # 2 slices x 2 hosts x 2 chips, listed out of order
  devices = [_FakeTpu(id=i, process_index=i // 2, slice_index=i // 4) for i in range(8)][::-1]
  assert mesh_lib.num_slices(devices) == 2 and mesh_lib.num_slices(jax.devices()) == 1
  grid = mesh_lib.device_grid((4, 2, 1, 1), devices)            # data=4, fsdp=2
  slices = np.vectorize(lambda d: d.slice_index)(grid)
  assert (slices[:2] == 0).all() and (slices[2:] == 1).all()   # data's outer factor = the slice
  hosts = np.vectorize(lambda d: d.process_index)(grid)
  assert (hosts[:, 0] == hosts[:, 1]).all()                     # fsdp pairs stay on one host
  assert sorted(d.id for d in grid.flat) == list(range(8))
  with pytest.raises(ValueError, match=r"span 2 TPU slices, so mesh data=1 must be a multiple of 2"):
    mesh_lib.device_grid((1, 8, 1, 1), devices)


def test_multislice_environment_starts_jax_distributed():
  from umoe_jax.parallel import distributed
  # two one-host slices: each slice lists one worker, the multi-slice runtime sets MEGASCALE_*
  env = {"TPU_WORKER_HOSTNAMES": "t1v-n-0", "MEGASCALE_NUM_SLICES": "2",
         "MEGASCALE_COORDINATOR_ADDRESS": "10.0.0.2:8080"}
  assert distributed.distributed_args(env) == {}
  assert distributed.distributed_args({"TPU_WORKER_HOSTNAMES": "t1v-n-0", "MEGASCALE_NUM_SLICES": "1"}) is None


def test_train_refuses_a_url_workdir_orbax_cannot_write_clearly(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  res = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"),
                        f"--config={os.path.join(ROOT, 'configs', 'umoe_tiny.py')}",
                        "--workdir=s3://bucket/runs/x"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
  assert res.returncode == 1
  assert ("workdir error: --workdir='s3://bucket/runs/x': checkpoints (Orbax) are written to local "
          "paths and gs:// only" in res.stderr), res.stderr[-2000:]
  assert not os.listdir(tmp_path)   # nothing written (no local "s3:" directory)
