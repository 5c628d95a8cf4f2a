"""The GPU suite's tiers (tests/gpu_tiers.py): `--gpu_shard=i/n` parts cover the suite exactly once
and are balanced by the measured seconds; `-m gpu_quick` runs every GPU test module, and every kernel
backend, at least once. Collected here on the CPU (the GPU tests collect everywhere and skip)."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import gpu_tiers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _collect(*args) -> list[str]:
  r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                      "tests/gpu", *args], capture_output=True, text=True, cwd=ROOT, timeout=300)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  return [l for l in r.stdout.splitlines() if "::" in l]


@pytest.mark.parametrize("spec,want", [("1/1", (1, 1)), ("3/4", (3, 4))])
def test_parse_shard_accepts_i_of_n(spec, want):
  assert gpu_tiers.parse_shard(spec) == want


@pytest.mark.parametrize("spec", ["0/3", "4/3", "2", "a/b", "1/0", ""])
def test_parse_shard_names_a_bad_value(spec):
  with pytest.raises(pytest.UsageError, match=f"--gpu_shard='{spec}': expected I/N"):
    gpu_tiers.parse_shard(spec)


def test_partition_covers_each_test_once_in_order_and_balances_the_seconds():
  rng = np.random.default_rng(0)
  ids = [f"t{i}" for i in range(157)]
  secs = {nid: float(s) for nid, s in zip(ids, rng.lognormal(1.0, 1.0, len(ids)))}
  del secs["t5"], secs["t77"]        # unmeasured tests count as the median
  for n in (1, 2, 3, 5):
    parts = gpu_tiers.partition(ids, n, secs)
    assert sorted(sum(parts, [])) == sorted(ids)               # each test in exactly one part
    assert all(p == sorted(p, key=ids.index) for p in parts)   # collection order kept
    cost = lambda p: sum(secs.get(t, float(np.median(list(secs.values())))) for t in p)
    total, longest = sum(map(cost, parts)), max(secs.values())
    assert max(map(cost, parts)) <= total / n + longest + 1e-9
  # Equal seconds: the parts differ by at most one test.
  sizes = [len(p) for p in gpu_tiers.partition(ids, 4, {})]
  assert max(sizes) - min(sizes) <= 1


def test_product_marks_exactly_the_quick_case():
  cases = gpu_tiers.product((2, "b"), [1, 2], ["a", "b"])
  assert [c.values for c in cases] == [(1, "a"), (1, "b"), (2, "a"), (2, "b")]
  quick = [c.values for c in cases if any(m.name == "gpu_quick" for m in c.marks)]
  assert quick == [(2, "b")]
  with pytest.raises(ValueError, match="not among"):
    gpu_tiers.product((3, "b"), [1, 2], ["a", "b"])


def test_shards_of_the_gpu_suite_cover_it_exactly_once():
  full = _collect()
  parts = [_collect(f"--gpu_shard={i}/3") for i in (1, 2, 3)]
  assert sorted(sum(parts, [])) == sorted(full) and all(parts)


def test_the_quick_tier_runs_every_gpu_module_and_backend():
  quick = _collect("-m", "gpu_quick")
  modules = {f for f in os.listdir(os.path.join(ROOT, "tests", "gpu")) if f.startswith("test_")}
  multi_gpu = {"test_expert_parallel_gpu.py"}       # needs several GPUs: nothing to run on one
  assert {q.split("::")[0].split("/")[-1] for q in quick} == modules - multi_gpu
  for backend in ("triton", "mosaic"):
    assert any(f"-{backend}]" in q and "test_raw_ops" in q for q in quick), backend
    assert any(f"-{backend}]" in q and "fused_dispatch" in q for q in quick), backend
  for form in ("auto", "recompute"):
    assert any(f"split_key_width_matches_xla[base-{form}]" in q for q in quick), form
  assert len(quick) < len(_collect()) / 4


def test_durations_out_writes_each_tests_seconds(tmp_path):
  out = tmp_path / "d.json"
  r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                      "tests/test_gpu_tiers.py", "-k", "parse_shard_accepts", f"--gpu_durations_out={out}"],
                     capture_output=True, text=True, cwd=ROOT, timeout=300)
  assert r.returncode == 0, r.stdout[-2000:]
  table = gpu_tiers.load_durations(str(out))
  assert sorted(table) == [f"tests/test_gpu_tiers.py::test_parse_shard_accepts_i_of_n[{s}-want{i}]"
                           for i, s in enumerate(("1/1", "3/4"))]
  assert all(v >= 0 for v in table.values())
