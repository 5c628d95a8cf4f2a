"""bench/ for FP8 training: bench/gmm.py --precision=bf16,fp8 (bench/gmm_fp8.py), bench/fp8_dense.py, bench/train_step.py
--precision / --routing=balanced / per-row flags, bench/balanced_routing.py's round-robin patch on a
tiny model, and bench.report keeping fp8 rows apart from bf16 ones. All on CPU, small."""
from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import balanced_routing  # noqa: E402  (bench/balanced_routing.py)
import fp8_dense  # noqa: E402  (bench/fp8_dense.py)
import gmm_fp8  # noqa: E402
import report  # noqa: E402
import results  # noqa: E402
import train_step  # noqa: E402
from test_results import _valid  # noqa: E402  (a bench script's measurement as a validated row)


# bench/gmm.py's FP8 part.


def _valid_all(measurements):
  return [_valid(m) for m in measurements]


def test_gmm_fp8_rows_carry_the_precision_and_count_flops_as_bf16(tmp_path):
  t = dict(fwd_ms=2.0, fwd_bwd_ms=5.0, quantize_ms=0.25, rel_err=0.03)
  rows = [_valid(m) for m in gmm_fp8.measurements("base-up", 4e12, "triton", t)]
  got = {(r["metric"], json.dumps(r["overrides"], sort_keys=True)): r for r in rows}
  fp8 = json.dumps({"backend": "triton", "precision": "fp8"}, sort_keys=True)
  assert got["fwd_tflops", fp8]["value"] == pytest.approx(2000.0)      # 4e12 / 2 ms
  assert got["fwd_bwd_tflops", fp8]["value"] == pytest.approx(2400.0)  # 3 x 4e12 / 5 ms
  quant = got["ms", json.dumps({"op": "quantize_tiles (activations)", "backend": "triton", "precision": "fp8"},
                               sort_keys=True)]
  assert quant["value"] == 0.25 and quant["config"] == "gmm:base-up"
  # the kernel alone (operands quantised beforehand): the forward, 1x the FLOPs
  kt = _valid_all(gmm_fp8.measurements("base-up", 4e12, "triton", dict(t, kernel_fwd_ms=1.0)))
  alone = {r["metric"]: r["value"] for r in kt if r["overrides"].get("operands")}
  assert alone == {"fwd_tflops": pytest.approx(4000.0)} and len(kt) == len(rows) + 1
  # Two backends: each its own quantisation row (a backend may have its own quantiser).
  path = str(tmp_path / "rows.jsonl")
  gmm_fp8.record_shape(path, "base-up", 4e12, {"triton_fp8": t, "xla_fp8": t, "mosaic_fwd": 1.0,
                                                "triton_fwd": 400.0, "triton_fwd_bwd": 380.0,
                                                "xla_fwd": float("nan")},
                       ["triton", "mosaic", "xla"])
  written = results.load_file(path)
  assert sorted((r["metric"], r["overrides"].get("backend")) for r in written) == [
      ("fwd_bwd_tflops", "triton"), ("fwd_bwd_tflops", "xla"), ("fwd_tflops", "triton"),
      ("fwd_tflops", "xla"), ("ms", "triton"), ("ms", "xla")]
  # each FP8 figure against its backend's bf16 figure of the same run, where that one ran; the
  # kernels alone only where they were timed
  anchors = {(r["metric"], r["overrides"].get("backend")): r["anchor"] for r in written}
  assert anchors["fwd_tflops", "triton"]["value"] == 400.0
  assert anchors["fwd_bwd_tflops", "triton"]["value"] == 380.0
  assert anchors["fwd_tflops", "xla"] is None and anchors["fwd_bwd_tflops", "xla"] is None


def test_the_switch_table_names_real_module_switches():
  """Each switch of bench/train_step.py's table is a module attribute of its kind (a 0/1 boolean,
  or an int >= least) and its default is the module's own setting, so a row's flag sets what the
  step reads."""
  assert train_step.SWITCHES, "a switch awaits its rows (bench/results/to_measure.md)"
  for key, sw in train_step.SWITCHES.items():
    value = getattr(sw.module, sw.attr)
    assert isinstance(value, bool) if sw.least is None else value >= sw.least, key
    assert train_step.SWITCH_DEFAULTS[key] == int(value), key
  assert train_step.SWITCHES["fp8_one_block_scales"].attr == "ONE_BLOCK_SCALES"


def test_precision_list_is_checked():
  assert gmm_fp8.parse_precisions("bf16,fp8") == ["bf16", "fp8"]
  for bad in ("fp16", "bf16,fp4", ""):
    with pytest.raises(ValueError, match="bf16, fp8"):
      gmm_fp8.parse_precisions(bad)


def test_time_fp8_times_fp8_gmm_with_its_quantisation():
  """The timed functions are fp8_gmm's forward (within FP8 error of the float32 product, and not
  the bf16 product: the operands really are quantised), its vjp and the activations' quantisation."""
  from umoe_jax.ops import fp8
  from umoe_jax.ops.fp8_gmm import fp8_gmm
  rng = np.random.default_rng(1)
  sizes = jnp.asarray([70, 0, 200, 42], jnp.int32)   # ragged, one empty, 312 of 320 rows
  x = jnp.asarray(rng.standard_normal((320, 256)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((4, 256, 128)) / 16, jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((320, 128)), jnp.bfloat16)
  calls = []

  def timer(f, *args):
    calls.append(jax.device_get(f(*args)))
    return float(len(calls))
  t = gmm_fp8.time_fp8("xla", x, w, dy, sizes, timer)
  assert (t["fwd_ms"], t["fwd_bwd_ms"], t["quantize_ms"], t["kernel_fwd_ms"]) == (1.0, 2.0, 3.0, 4.0)
  assert 1e-3 < t["rel_err"] < gmm_fp8.MAX_REL_ERR
  np.testing.assert_array_equal(calls[0], jax.device_get(fp8_gmm(x, w, sizes, backend="xla")))
  y, (dx, dw) = calls[1]
  _, pull = jax.vjp(lambda a, b: fp8_gmm(a, b, sizes, backend="xla"), x, w)
  ref_dx, ref_dw = pull(dy)
  np.testing.assert_array_equal(y, calls[0])
  np.testing.assert_array_equal(dx, jax.device_get(ref_dx))
  np.testing.assert_array_equal(dw, jax.device_get(ref_dw))
  q, s = calls[2]
  ref_q, ref_s = fp8.quantize_tiles(x, axis=1)
  assert q.dtype == ref_q.dtype and np.array_equal(np.asarray(s), np.asarray(ref_s))
  # the raw forward alone: its values are fp8_gmm's
  np.testing.assert_array_equal(calls[3], calls[0])
  assert len(calls) == 4


def test_gmm_bench_runs_both_precisions_and_tables_the_ratio(tmp_path, monkeypatch, capsys):
  """bench/gmm.py end to end on CPU at small stand-ins for two shapes, xla backend: bf16 and fp8
  rows of the same shapes, told apart by overrides, and the table's fp8 / bf16 lines."""
  import gmm
  monkeypatch.setattr(gmm, "SHAPES", [("base-up", 512, 256, 128, 4), ("base-down", 512, 128, 256, 4),
                                      ("large-up", 512, 256, 256, 4)])
  path = tmp_path / "rows.jsonl"
  monkeypatch.setattr(sys, "argv", ["bench/gmm.py", "--precision=bf16,fp8", "--shapes=base-up,base-down",
                                    "--backends=xla", "--no-torch", "--no-baselines", "--no-dispatch",
                                    f"--out={tmp_path}", f"--results={path}"])
  gmm.main()
  rows = results.load_file(str(path))
  keys = {(r["config"], r["metric"], json.dumps(r["overrides"], sort_keys=True)) for r in rows}
  for shape in ("base-up", "base-down"):
    for metric in ("fwd_tflops", "fwd_bwd_tflops"):
      assert (f"gmm:{shape}", metric, '{"backend": "xla"}') in keys
      assert (f"gmm:{shape}", metric, '{"backend": "xla", "precision": "fp8"}') in keys
  assert not any("large-up" in r["config"] for r in rows)
  out = capsys.readouterr().out
  table = out[out.index("fp8_gmm TFLOP/s"):].splitlines()
  assert [line.split()[:2] for line in table[2:4]] == [["base-up", "xla"], ["base-down", "xla"]]
  saved = json.loads((tmp_path / "gmm_results.json").read_text())["shapes"]["base-up"]
  ratio = float(table[2].split()[3])
  assert ratio == pytest.approx(saved["xla_fp8"]["fwd_tflops"] / saved["xla_fwd"], abs=0.006)


def test_fp8_tile_sweep_keeps_the_fastest_right_tile_and_records_it(tmp_path, monkeypatch):
  """`gmm_fp8.sweep` on CPU, the Triton FP8 kernel stood in for by the xla backend's raw FP8 form
  (one tile made wrong): each op's candidates are called with their own tile, a tile whose output
  differs from the tabled tile's is never picked however fast, the fastest right one is, and its
  row names the tile and anchors on the tabled tile's figure; `table_lines` writes TABLE rows."""
  from kernels.gmm import triton_fp8_gmm as k8
  from umoe_jax.ops import gmm_backends as gb
  xla = gb.BACKENDS.get("xla")
  # per op, its last candidate gives a wrong product (and would be the fastest)
  wrong = {"gmm": k8.candidates("gmm", 256, 192)[-1], "gmm_t": k8.candidates("gmm_t", 192, 256)[-1]}
  seen = []

  def stand_in(*args, config=None, **kw):
    op = "gmm_t" if kw["transpose_rhs"] else "gmm"
    seen.append((op, config))
    out = xla.fp8_gmm(*args, **kw)
    return out * 1.01 if config == wrong[op] else out
  monkeypatch.setattr(k8, "triton_fp8_gmm", stand_in)
  speed = {}
  ms = lambda c: 10.0 / (c.bn * c.num_stages + c.bm / 1000)

  def timer(f, *args):  # ms: the wrong tile fastest, then the widest tile with most stages
    op, cfg = seen[-1]
    speed[op, cfg] = 0.1 if cfg == wrong[op] else ms(cfg)
    return speed[op, cfg]
  path = tmp_path / "rows.jsonl"
  shapes = [("base-up", 384, 256, 192, 3)]
  best = gmm_fp8.sweep(shapes, timer, str(path))
  assert set(best) == {("gmm", 256, 192), ("gmm_t", 192, 256)}
  for (op, kc, no), (tflops, cfg) in best.items():
    cands = k8.candidates(op, kc, no)
    assert cfg != wrong[op] and (op, wrong[op]) not in speed   # checked, never timed
    assert {c for o, c in seen if o == op} == set(cands)
    assert cfg == min(cands[:-1], key=ms)
    assert tflops == pytest.approx(2.0 * 384 * 256 * 192 / (ms(cfg) / 1e3) / 1e12)
  rows = results.load_file(str(path))
  assert len(rows) == 2
  for r in rows:
    op = {v: k for k, v in gmm_fp8.SWEEP_METRICS.items()}[r["metric"]]
    cfg = best[next(k for k in best if k[0] == op)][1]
    assert r["overrides"]["tile"] == f"{cfg.bm}x{cfg.bn} w{cfg.num_warps} s{cfg.num_stages}"
    first = k8.candidates(op, *next(k for k in best if k[0] == op)[1:])[0]
    assert r["anchor"]["value"] == pytest.approx(2.0 * 384 * 256 * 192 / (ms(first) / 1e3) / 1e12)
  lines = gmm_fp8.table_lines(best)
  assert len(lines) == 2 and all(line.strip().startswith('("') for line in lines)
  op, kc, no = "gmm", 256, 192
  c = best[(op, kc, no)][1]
  assert any(f'("gmm", 256, 192): tuning.TileConfig({c.bm}, {c.bn}, 128, {c.num_warps}, '
             f'{c.num_stages})' in line for line in lines), lines


def test_gmm_bench_refuses_an_unknown_shape_or_precision(monkeypatch, capsys):
  import gmm
  for flag, word in (("--shapes=base-upp", "base-upp"), ("--precision=fp16", "fp16")):
    monkeypatch.setattr(sys, "argv", ["bench/gmm.py", flag, "--no-torch"])
    with pytest.raises(SystemExit):
      gmm.main()
    assert word in capsys.readouterr().err


# bench/train_step.py: precision, routing, per-row flags.


# bench/fp8_dense.py.


def test_fp8_dense_bench_rows_per_impl_with_error_and_flops(tmp_path, capsys):
  """bf16 and the chunked dot_generals on CPU (no kernel runs here): one row each, precision and impl
  in overrides, TFLOP/s = 3 x 2 M K N over the measured time, the FP8 forward's error a few percent
  (bf16's far less); the table's ratio is bf16's time over FP8's."""
  path = str(tmp_path / "rows.jsonl")
  assert fp8_dense.main(["--shapes=base-qk", "--tokens=256", f"--results={path}"]) == 0
  rows = {r["overrides"]["impl"]: results.validate(r) for r in map(json.loads, open(path))}
  assert sorted(rows) == ["bf16", "xla"]
  assert rows["bf16"]["overrides"]["precision"] == "bf16" and rows["xla"]["overrides"]["precision"] == "fp8"
  for r in rows.values():
    assert r["config"] == "fp8_dense:base-qk" and r["metric"] == "fwd_bwd_tflops"
    assert r["value"] == pytest.approx(3 * 2 * 256 * 768 * 768 / (r["extra"]["ms"] / 1e3) / 1e12)
  assert 1e-3 < rows["xla"]["extra"]["rel_err"] < 0.1 and rows["bf16"]["extra"]["rel_err"] < 1e-2
  assert rows["xla"]["anchor"]["value"] == rows["bf16"]["value"] and rows["bf16"]["anchor"] is None
  ratio = rows["bf16"]["extra"]["ms"] / rows["xla"]["extra"]["ms"]
  assert f"{ratio:.2f}x" in capsys.readouterr().out.splitlines()[-1]


def test_fp8_dense_bench_refuses_an_unknown_shape(capsys):
  with pytest.raises(SystemExit):
    fp8_dense.main(["--shapes=base-qk,huge"])
  assert "--shapes='base-qk,huge'" in capsys.readouterr().err


def test_row_flags_parse_round_trip_and_refuse_bad_values():
  r = train_step.parse_row("umoe_base:single/routing=balanced/precision=fp8/zipf=1.1")
  assert r["flags"] == {"routing": "balanced", "precision": "fp8", "zipf": 1.1}
  assert train_step.parse_row(train_step.row_spec(r)) == r
  assert train_step.parse_row("umoe_base:single")["flags"] == {}
  args = train_step.row_args(train_step.parser().parse_args(["--zipf=0.5", "--precision=fp8"]),
                             train_step.parse_row("umoe_base:single/zipf=1.1"))
  assert (args.zipf, args.precision, args.routing) == (1.1, "fp8", "router")
  for bad, word in (("umoe_base:single/precision=fp16", "fp16"), ("umoe_base:single/routing=rr", "rr"),
                    ("umoe_base:single/zipf=-1", "-1"), ("umoe_base:single/zipf=x", "'x'"),
                    ("umoe_base:single/steps=3", "steps=3")):
    with pytest.raises(ValueError, match=word):
      train_step.parse_row(bad)


def _switch_table(monkeypatch):
  """bench/train_step.py's switch table replaced by two stand-in switches on a namespace: a boolean
  (least None) and a count (least 1), with the derived tables rebuilt as the module builds them.
  Returns the namespace."""
  import types
  mod = types.ModuleType("stand_in")
  mod.ROWS, mod.SPLITS = False, 1
  switches = {"rows_switch": train_step.Switch(mod, "ROWS", None, "a boolean switch"),
              "splits_switch": train_step.Switch(mod, "SPLITS", 1, "a count")}
  monkeypatch.setattr(train_step, "SWITCHES", switches)
  monkeypatch.setattr(train_step, "SWITCH_DEFAULTS", {"rows_switch": 0, "splits_switch": 1})
  monkeypatch.setattr(train_step, "ROW_FLAGS", {**train_step.ROW_FLAGS, "rows_switch": int,
                                                "splits_switch": int})
  return mod


def test_switch_flags_set_the_modules_for_a_row_and_name_themselves(monkeypatch, capsys):
  """A switch of the table (/KEY= for a row, --KEY for the command): parsed, checked, set on its
  module before the step is traced (a switch a row does not name back at the module's own
  setting), in overrides, and in the table's mode text only where it differs from the module's own
  setting."""
  mod = _switch_table(monkeypatch)
  r = train_step.parse_row("umoe_base:single/precision=fp8/rows_switch=1/splits_switch=8")
  assert r["flags"] == {"precision": "fp8", "rows_switch": 1, "splits_switch": 8}
  assert train_step.parse_row(train_step.row_spec(r)) == r
  args = train_step.row_args(train_step.parser().parse_args([]), r)
  train_step.fp8_switches(args)
  assert mod.ROWS is True and mod.SPLITS == 8
  train_step.fp8_switches(train_step.parser().parse_args([]))   # not given: the modules' own
  assert mod.ROWS is False and mod.SPLITS == 1
  train_step.fp8_switches(train_step.parser().parse_args(["--rows_switch=1"]))
  assert mod.ROWS is True and mod.SPLITS == 1
  assert {k: train_step.switch_value(k) for k in train_step.SWITCHES} == {"rows_switch": 1,
                                                                           "splits_switch": 1}
  row = dict(precision="fp8", zipf=0.0, routing="router", **train_step.SWITCH_DEFAULTS)
  assert train_step.mode_text(row) == "fp8"
  assert train_step.mode_text({**row, "splits_switch": 8}) == "fp8 splits_switch=8"
  assert train_step.mode_text({**row, "precision": "bf16", "splits_switch": 8}) == "bf16"
  assert train_step.mode_text({**row, "rows_switch": 1}) == "fp8 rows_switch=1"
  m = dict(config="umoe_base", layout="single", devices=1, device_kind="NVIDIA H100 80GB HBM3", batch=32,
           seq_len=1024, step_ms=90.0, tokens_per_s=364e3, mfu=0.3, peak_mem_gb=20.0, loss_check=True,
           step_times_ms=[90.0], xla_flags="", precision="fp8", routing="router", zipf=0.0)
  assert _valid(train_step.measurement(m, args))["overrides"] == {
      "precision": "fp8", "rows_switch": 1, "splits_switch": 8}
  for bad, word in (("umoe_base:single/rows_switch=2", "0 or 1"),
                    ("umoe_base:single/rows_switch=-1", "0 or 1"),
                    ("umoe_base:single/splits_switch=0", ">= 1"),
                    ("umoe_base:single/splits_switch=x", "'x'")):
    with pytest.raises(ValueError, match=word):
      train_step.parse_row(bad)
  for flag, word in (("--splits_switch=0", ">= 1"), ("--rows_switch=2", "0 or 1")):
    monkeypatch.setattr(sys, "argv", ["train_step.py", flag])
    with pytest.raises(SystemExit):
      train_step.main()
    assert f"{flag}: {word}" in capsys.readouterr().err


def test_train_step_rows_carry_precision_routing_and_zipf():
  r = dict(config="umoe_base", layout="single", devices=1, device_kind="NVIDIA H200", batch=32,
           seq_len=1024, step_ms=90.0, tokens_per_s=364e3, mfu=0.3, peak_mem_gb=20.0,
           loss_check=True, step_times_ms=[89.0, 90.0, 91.0], xla_flags="", precision="fp8",
           routing="balanced", zipf=0.0)
  args = train_step.row_args(train_step.parser().parse_args(["--runs=umoe_base:single"]),
                             train_step.parse_row("umoe_base:single/precision=fp8/routing=balanced"))
  row = _valid(train_step.measurement(r, args))
  assert row["overrides"] == {"precision": "fp8", "routing": "balanced"}
  args = train_step.parser().parse_args(["--precision=fp8", "--zipf=1.1"])
  assert _valid(train_step.measurement(r, args))["overrides"] == {"precision": "fp8", "zipf": 1.1}
  assert _valid(train_step.measurement(r, train_step.parser().parse_args([])))["overrides"] == {}


def test_efficiency_and_fp8_ratio_are_per_mode():
  def row(precision, zipf, routing, step_ms):
    return dict(config="umoe_base", layout="single", devices=1, step_ms=step_ms, precision=precision,
                zipf=zipf, routing=routing, tokens_per_s=1e6 / step_ms, tokens_per_s_per_device=1e6 / step_ms)
  rows = [row("bf16", 0.0, "router", 100.0), row("fp8", 0.0, "router", 80.0),
          row("bf16", 1.1, "router", 110.0), row("fp8", 1.1, "router", 77.0),
          row("fp8", 0.0, "balanced", 60.0), dict(config="umoe_base", layout="single", error="boom")]
  train_step.add_efficiency(rows)
  assert [r.get("vs_bf16") for r in rows[:5]] == [None, pytest.approx(0.8), None, pytest.approx(0.7), None]
  assert all(r["scaling_efficiency"] == pytest.approx(1.0) for r in rows[:5])
  assert train_step.mode_text(rows[3]) == "fp8 zipf=1.1" and train_step.mode_text(rows[4]) == "fp8 balanced"


def test_profiled_fp8_rows_print_their_difference_from_the_bf16_row(capsys):
  """An fp8 row profiled beside a profiled bf16 row of the same config and tokens prints where its
  kernel time differs; a row of other tokens (no bf16 partner) and the bf16 row print none."""
  def row(precision, zipf, ms):
    prof = [dict(scope="layer_*/ffn/expert_up", **{"pass": "bwd"}, ms=ms, kernels=1, share=1.0)]
    return dict(config="umoe_base", layout="single", precision=precision, zipf=zipf, routing="router",
                profile=dict(rows=prof))
  train_step.print_profile_diffs([row("bf16", 0.0, 2.0), row("fp8", 0.0, 3.5), row("fp8", 1.1, 9.0)])
  out = capsys.readouterr().out
  assert out.count("against bf16, kernel time by scope") == 1
  assert "umoe_base single: fp8 against bf16" in out
  line = next(x for x in out.splitlines() if x.endswith("layer_*/ffn/expert_up"))
  assert line.split()[:4] == ["2.000", "3.500", "+1.500", "bwd"]


# bench/balanced_routing.py.


def test_round_robin_ids_against_a_loop():
  ids = np.asarray(balanced_routing.round_robin_ids(3, 5, 7, 2))
  for b in range(3):
    for s in range(5):
      for j in range(2):
        assert ids[b, s, j] == ((b * 5 + s) * 2 + j) % 7


@pytest.fixture
def patched_routers():
  yield balanced_routing.install()
  balanced_routing.uninstall()


def test_patched_router_gives_round_robin_ids_uniform_gates_and_equal_loads(patched_routers):
  """A tiny model's routers, called on CPU: every kind the tiny configs use gives round-robin ids,
  gates 1/K of the router's shape and dtype, every expert the same number of slots; unpatched,
  the same router's ids differ."""
  from flax import nnx
  import configs
  from umoe_jax.config import RouterConfig
  from umoe_jax.model.routers import call_router, make_router, route_context
  assert "ScoreRouter" in patched_routers
  x = jax.random.normal(jax.random.key(0), (2, 24, 16))
  tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, 100)
  model = configs.common.experiment("umoe", "tiny").model
  for kind, e, k in (("topk_softmax", 8, 2), ("topk_sigmoid", 6, 3), ("hash", 4, 1),
                     (model.router.kind, 12, 2)):
    router = make_router(RouterConfig(kind=kind), 16, e, k, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    out = call_router(router, x, route_context(tokens))
    ids = np.asarray(out.expert_ids)
    want = [[[(t * k + j) % e for j in range(k)] for t in range(b * 24, b * 24 + 24)] for b in range(2)]
    np.testing.assert_array_equal(ids, want)
    assert out.gates.shape == (2, 24, k) and np.allclose(np.asarray(out.gates), 1.0 / k)
    assert out.slot_mask is None
    assert np.bincount(ids.ravel(), minlength=e).tolist() == [2 * 24 * k // e] * e
    balanced_routing.uninstall()
    try:
      real = np.asarray(call_router(router, x, route_context(tokens)).expert_ids)
    finally:
      balanced_routing.install()
    assert not np.array_equal(real, ids), kind


def test_train_step_balanced_rows_are_balanced_end_to_end(tmp_path):
  """bench/train_step.py on CPU, the tiny UMoE, one run list with a routed row and a balanced fp8
  Zipf row: the balanced row's every router has max load / mean 1, the routed one not; the rows
  carry their flags."""
  import subprocess
  rows_path = tmp_path / "rows.jsonl"
  r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "train_step.py"),
                      "--runs=umoe_tiny:single,umoe_tiny:single/routing=balanced/precision=fp8/zipf=1.1",
                      "--batch=2", "--seq_len=32", "--steps=1", "--warmup=0", "--in_process",
                      f"--out={tmp_path}", f"--results={rows_path}"],
                     capture_output=True, text=True, timeout=600, cwd=ROOT)
  assert r.returncode == 0, r.stderr[-2000:]
  routed, balanced = json.loads((tmp_path / "train_step.json").read_text())
  assert balanced["precision"] == "fp8" and balanced["routing"] == "balanced" and balanced["zipf"] == 1.1
  per = balanced["routing_load"]["per_router"]
  assert per and all(v == pytest.approx(1.0) for v in per.values())
  assert routed["routing_load"]["max"] > 1.05
  overrides = [row["overrides"] for row in results.load_file(str(rows_path))]
  assert overrides == [{"batch": 2, "seq_len": 32},
                       {"batch": 2, "seq_len": 32, "precision": "fp8", "routing": "balanced", "zipf": 1.1}]
  assert "fp8 zipf=1.1 balanced" in r.stdout


# bench.report keeps the precisions apart.


def test_report_keeps_bf16_and_fp8_rows_on_separate_lines():
  t = dict(fwd_ms=2.0, fwd_bwd_ms=5.0, quantize_ms=0.25, rel_err=0.03)
  bf16 = dict(config="gmm:base-up", metric="fwd_tflops", value=500.0, overrides={"backend": "triton"},
              anchor=None)
  rows = [_valid(bf16)] + [_valid(m) for m in gmm_fp8.measurements("base-up", 4e12, "triton", t)]
  train = [_valid(dict(config="umoe_base", metric="tokens_per_s", value=v, overrides=o, anchor=None,
                       extra={"step_ms": 1.0}))
           for v, o in ((3e5, {}), (4e5, {"precision": "fp8"}), (5e5, {"precision": "fp8", "routing": "balanced"}))]
  best = report.best_rows(rows + train)
  assert len(best) == 7
  page = report.page(rows + train, "nothing")
  lines = [line for line in page.splitlines() if line.startswith("| base-up") or line.startswith("| `umoe_base`")]
  settings = sorted(line.split(" | ")[1] for line in lines)
  assert settings == sorted(["backend=triton", "backend=triton, precision=fp8", "backend=triton, precision=fp8",
                             "backend=triton, op=quantize_tiles (activations), precision=fp8", "defaults", "precision=fp8",
                             "precision=fp8, routing=balanced"])


def test_fp8_tile_sweep_of_the_mosaic_kernel(tmp_path, monkeypatch):
  """`gmm_fp8.sweep(..., backend="mosaic")` on CPU, the Mosaic FP8 kernel stood in for by the xla
  backend's raw FP8 form: the tiles tried are the candidates that take the shape, each called with
  its own tile; the rows name the backend and the tile."""
  from kernels.gmm import mosaic_fp8_gmm as mf
  from umoe_jax.ops import gmm_backends as gb
  xla = gb.BACKENDS.get("xla")
  seen = []

  def stand_in(*args, tile=None, **kw):
    seen.append(("gmm_t" if kw["transpose_rhs"] else "gmm", tile))
    return xla.fp8_gmm(*args, **kw)
  monkeypatch.setattr(mf, "mosaic_fp8_gmm", stand_in)
  ms = lambda t: 1.0 + t.stages / 10 - t.ctas_per_sm / 3 - t.bm / 1000 + (not t.overlap)

  def timer(f, *args):
    return ms(seen[-1][1])
  path = tmp_path / "rows.jsonl"
  best = gmm_fp8.sweep([("large-up", 200, 512, 192, 2)], timer, str(path), backend="mosaic")
  # gmm: 192 output columns (64-wide tiles only); gmm_t: 512 (every tile)
  takes = {"gmm": [t for t in mf.candidates() if mf.supported(512, 192, t)], "gmm_t": mf.candidates()}
  assert set(best) == {("gmm", 512, 192), ("gmm_t", 192, 512)}
  assert takes["gmm"] and all(t.bn == 64 for t in takes["gmm"]) and len(takes["gmm_t"]) > len(takes["gmm"])
  rows = {r["metric"]: r for r in results.load_file(str(path))}
  for op, (kc, no) in (("gmm", (512, 192)), ("gmm_t", (192, 512))):
    assert [t for o, t in seen if o == op] == takes[op]
    t = min(takes[op], key=ms)
    assert best[(op, kc, no)][1] == t
    row = rows[gmm_fp8.SWEEP_METRICS[op]]
    assert row["overrides"]["backend"] == "mosaic"
    assert row["overrides"]["tile"] == f"{t.bm}x{t.bn} s{t.stages} c{t.ctas_per_sm}" and t.overlap
  with pytest.raises(ValueError, match="no FP8 tile sweep for backend 'xla'"):
    gmm_fp8.sweep([("large-up", 200, 512, 192, 2)], timer, backend="xla")
