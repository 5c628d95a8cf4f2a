"""bench/train_step.py on CPU: flags it refuses before it builds anything (a GPU run would otherwise
compile for minutes and measure nothing), its token draws (uniform, text-like Zipf), the routing
load it reports, and one tiny row end to end."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench",
                     "train_step.py")
sys.path.insert(0, os.path.dirname(BENCH))
import results  # noqa: E402  (bench/results.py)
import train_step as bench  # noqa: E402  (bench/train_step.py)


def test_a_trace_step_outside_the_timed_steps_is_refused(tmp_path):
  out = subprocess.run([sys.executable, BENCH, "--steps=3", "--trace_step=5", f"--out={tmp_path}"],
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 2, out
  assert "--trace_step=5: a timed step, 1 to --steps=3" in out.stderr
  assert not os.listdir(tmp_path)


def test_program_rows_compile_each_program_once():
  """A Zipf row's program is the same row's on uniform tokens: --precompile compiles it once."""
  runs = [bench.parse_row(x) for x in ("umoe_tiny:single/zipf=1.1", "umoe_tiny:single",
                                       "umoe_tiny:single/precision=fp8/zipf=2", "umoe_tiny:data@2:ragged")]
  assert [bench.row_spec(r) for r in bench.program_rows(runs)] == [
      "umoe_tiny:single", "umoe_tiny:single/precision=fp8", "umoe_tiny:data@2:ragged"]


def test_zipf_tokens_follow_their_exponent_and_uniform_stays_as_before():
  import numpy as np
  uniform = bench.bench_tokens(np.random.default_rng(0), 1000, (4, 33), 0.0)
  np.testing.assert_array_equal(  # the default: the draw the bench always made
      uniform, np.random.default_rng(0).integers(0, 1000, size=(4, 33), dtype=np.int32))
  vocab, s = 500, 1.1
  tokens = bench.bench_tokens(np.random.default_rng(1), vocab, (400, 500), s)
  assert tokens.dtype == np.int32 and tokens.shape == (400, 500)
  assert tokens.min() >= 0 and tokens.max() < vocab
  freq = np.sort(np.bincount(tokens.ravel(), minlength=vocab))[::-1] / tokens.size
  want = np.arange(1, vocab + 1, dtype=np.float64) ** -s
  want /= want.sum()
  np.testing.assert_allclose(freq[:5], want[:5], rtol=0.05)     # the frequent ranks, 200k draws
  top = np.argsort(np.bincount(tokens.ravel(), minlength=vocab))[::-1][:5]
  assert sorted(top) != list(range(5)), top                     # ranks land on shuffled ids
  with pytest.raises(ValueError, match="--zipf=-0.5"):
    bench.bench_tokens(np.random.default_rng(0), vocab, (2, 2), -0.5)
  with pytest.raises(ValueError, match="--zipf=nan"):
    bench.bench_tokens(np.random.default_rng(0), vocab, (2, 2), float("nan"))


def test_routing_load_is_each_routers_largest_load_over_the_mean():
  import numpy as np
  load = bench.routing_load({"layer_0/ffn": {"expert_counts": np.array([2.0, 2.0, 2.0, 2.0])},
                             "layer_0/attention": {"expert_counts": np.array([6.0, 1.0, 1.0, 0.0])},
                             "layer_1/ffn": {"expert_counts": np.array([3.0, 1.0, 2.0, 2.0]),
                                             "entropy": np.float32(1.0)}})
  assert load["per_router"] == {"layer_0/attention": 3.0, "layer_0/ffn": 1.0, "layer_1/ffn": 1.5}
  assert load["median"] == 1.5 and load["max"] == 3.0
  assert bench.routing_load({}) == {}


@pytest.mark.parametrize("flag,message", [("--zipf=-1", "--zipf=-1.0: an exponent >= 0"),
                                          ("--zipf=nan", "--zipf=nan: an exponent >= 0"),
                                          ("--tgmm_big_first_skew=0", "--tgmm_big_first_skew=0: >= 1"),
                                          ("--compile_only", "--compile_only keeps its executables in "
                                                             "--compilation_cache_dir"),
                                          ("--precompile=2", "--precompile keeps its executables in"),
                                          # removed options: no flag
                                          ("--router_one_pass=1", "unrecognized arguments"),
                                          ("--split_key_width=0", "unrecognized arguments")])
def test_bad_token_and_tile_order_flags_are_refused(tmp_path, flag, message):
  out = subprocess.run([sys.executable, BENCH, flag, f"--out={tmp_path}"],
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 2, out
  assert message in out.stderr, out.stderr
  assert not os.listdir(tmp_path)


@pytest.mark.slow
def test_a_tiny_row_reports_its_routing_load_and_zipf_tokens_skew_it(tmp_path):
  """One CPU row of umoe_tiny per token distribution: the row records its loads, and text-like
  tokens load a fresh router's busiest experts more than uniform ones."""
  import json
  loads = {}
  for zipf in ("0", "1.2"):
    out_dir = tmp_path / zipf
    out = subprocess.run([sys.executable, BENCH, "--runs=umoe_tiny:single", "--batch=4",
                          "--seq_len=64", "--steps=1", "--warmup=0", f"--zipf={zipf}",
                          f"--out={out_dir}", f"--results={out_dir}/rows.jsonl"],
                         capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    row = json.loads((out_dir / "train_step.json").read_text())[0]
    assert "error" not in row, row["error"]
    assert row["zipf"] == float(zipf) and row["loss_check"], row
    [result] = results.load_file(str(out_dir / "rows.jsonl"))   # its results row, validated
    assert (result["config"], result["metric"], result["value"]) == (
        "umoe_tiny", "tokens_per_s", row["tokens_per_s"])
    assert result["overrides"] == {"batch": 4, "seq_len": 64, **({"zipf": 1.2} if zipf != "0" else {})}
    assert "--runs=umoe_tiny:single" in result["command"]
    load = row["routing_load"]
    assert len(load["per_router"]) == 8, load                   # 4 layers x (attention, FFN)
    assert all(v >= 1.0 for v in load["per_router"].values()), load
    loads[zipf] = load["median"]
  assert loads["1.2"] > loads["0"], loads


@pytest.mark.slow
def test_a_row_records_the_kernel_switches_it_ran_with(tmp_path):
  """`--core_backward=recompute` reaches the model config and `--tgmm_big_first_skew=1` the
  weight gradient's tile order; the row records both, loss check passed."""
  import json
  out = subprocess.run([sys.executable, BENCH, "--runs=umoe_tiny:single", "--batch=2", "--seq_len=32",
                        "--steps=1", "--warmup=0", "--core_backward=recompute",
                        "--tgmm_big_first_skew=1", f"--out={tmp_path}", "--results=none"],
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  row = json.loads((tmp_path / "train_step.json").read_text())[0]
  assert "error" not in row, row["error"]
  assert row["core_backward"] == "recompute" and row["tgmm_big_first_skew"] == 1, row
  assert row["loss_check"], row


@pytest.mark.slow
def test_compile_only_rows_fill_the_cache_that_a_timed_row_then_loads(tmp_path):
  """`--compile_only` writes each row's step program into the cache and no results row; a later
  command with `--precompile` compiles only the programs not cached yet, in parallel processes, and
  its timed rows load them (a program found in the cache is loaded, not compiled and written)."""
  import json
  cache, env = tmp_path / "cache", dict(os.environ, JAX_PLATFORMS="cpu")
  common = ["--batch=2", "--seq_len=32", f"--compilation_cache_dir={cache}"]
  out = subprocess.run([sys.executable, BENCH, "--runs=umoe_tiny:single,umoe_tiny:single/precision=fp8",
                        "--compile_only", f"--out={tmp_path}/a", f"--results={tmp_path}/a/rows.jsonl",
                        *common], capture_output=True, text=True, timeout=600, env=env)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  rows = json.loads((tmp_path / "a" / "train_step.json").read_text())
  assert [(r["compile_only"], "step_ms" in r) for r in rows] == [(True, False)] * 2, rows
  assert not (tmp_path / "a" / "rows.jsonl").exists()
  steps = lambda: sorted(p.name for p in cache.iterdir() if p.name.startswith("jit_train_step"))
  compiled = steps()
  assert len(compiled) == 2, compiled                  # bf16 and fp8: two programs
  # the programs a row list needs, each once: the Zipf row's is the uniform row's, cached already;
  # the balanced row's is new
  out = subprocess.run([sys.executable, BENCH, "--runs=umoe_tiny:single/zipf=1.1,umoe_tiny:single/routing=balanced",
                        "--precompile=2", "--steps=1", "--warmup=0", f"--out={tmp_path}/c", "--results=none",
                        *common], capture_output=True, text=True, timeout=600, env=env)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert (out.stdout + out.stderr).count("precompiled") == 1            # not again in a row's process
  assert "precompiled 2 step programs, 2 at a time" in out.stdout + out.stderr
  assert sorted(os.listdir(tmp_path / "c" / "precompile")) == ["0", "0.log", "1", "1.log"]
  assert len(steps()) == 3 and set(compiled) < set(steps())
  rows = json.loads((tmp_path / "c" / "train_step.json").read_text())
  assert [(r["zipf"], r["routing"], r["loss_check"]) for r in rows] == [(1.1, "router", True),
                                                                        (0.0, "balanced", True)]


@pytest.mark.slow
def test_traced_rows_keep_a_trace_each_that_the_kernel_table_reads(tmp_path):
  """--trace_step over rows run in their own processes: each row's trace lands under --out in a
  directory named by its mode (bf16 and fp8 apart), the row points at it, and
  `profile_table.py` tables each trace by kernel and one against the other."""
  import json
  import profile_table
  out = subprocess.run([sys.executable, BENCH, "--runs=umoe_tiny:single,umoe_tiny:single/precision=fp8",
                        "--batch=2", "--seq_len=32", "--steps=2", "--warmup=0", "--trace_step=2",
                        f"--out={tmp_path}", "--results=none"],
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  rows = json.loads((tmp_path / "train_step.json").read_text())
  dirs = [r["trace_dir"] for r in rows]
  assert [os.path.basename(d) for d in dirs] == ["trace_umoe_tiny_single_bf16_step2",
                                                 "trace_umoe_tiny_single_fp8_step2"]
  tables = [profile_table.kernel_name_rows(d) for d in dirs]
  for table in tables:
    assert table and all(r["ms"] > 0 and r["count"] >= 1 for r in table)
    assert abs(sum(r["share"] for r in table) - 1.0) < 1e-9
  assert {r["kernel"] for r in tables[0]} != {r["kernel"] for r in tables[1]}  # fp8's own ops
  cli = subprocess.run([sys.executable, os.path.join(os.path.dirname(BENCH), "profile_table.py"),
                        dirs[1], f"--against={dirs[0]}"], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert cli.returncode == 0, cli.stderr[-2000:]
  last = cli.stdout.strip().splitlines()[-1].split()
  assert last[-1] == "all" and float(last[0]) == pytest.approx(sum(r["ms"] for r in tables[0]), abs=2e-3)
  bad = subprocess.run([sys.executable, os.path.join(os.path.dirname(BENCH), "profile_table.py"),
                        str(tmp_path / "nothing")], capture_output=True, text=True, timeout=300)
  assert bad.returncode == 2 and "no *.xplane.pb under" in bad.stderr
