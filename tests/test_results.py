"""Benchmark results as rows (bench/results.py) and the page generated from them (bench/report.py):
the schema refuses a row without a field, rows round-trip through their files, the best-of choice
matches a plain reference, docs/performance.md is what the rows give, and the main bench scripts'
row writers make valid rows from a measured value (no GPU: the timings are given)."""
from __future__ import annotations

import json
import os
import random
import re
import shlex
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import report  # noqa: E402  (bench/report.py)
import results  # noqa: E402  (bench/results.py)


def _row(**kw):
  fields = dict(date="2026-12-05", commit="abc1234", device="NVIDIA H200", config="umoe_base",
                metric="tokens_per_s", value=293.8e3, command="python3 bench/train_step.py")
  fields.update(kw)
  return results.make_row(**fields)


@pytest.mark.parametrize("field", list(results.ROW_FIELDS))
def test_a_row_lacking_a_field_fails_naming_it(field):
  row = _row()
  del row[field]
  with pytest.raises(results.RowError, match=f"missing field '{field}'"):
    results.validate(row, "x.jsonl:3")


@pytest.mark.parametrize("change,message", [
    (dict(value="fast"), "field 'value' is str, not int or float"),
    (dict(value=True), "field 'value' is bool"),
    (dict(overrides=None), "field 'overrides' is NoneType, not dict"),
    (dict(unit="ms"), "field 'unit' is 'ms'; metric 'tokens_per_s' is in 'tokens/s'"),
    (dict(metric="speed"), "field 'metric' is 'speed'"),
    (dict(date="5 Dec 2026"), "field 'date' is '5 Dec 2026', not YYYY-MM-DD"),
    (dict(colour="red"), "unknown field 'colour'"),
    (dict(anchor={"what": "x", "value": 1.0, "unit": "tokens/s"}), "anchor: missing field 'source'"),
    (dict(value=float("nan")), "not a finite number"),
])
def test_a_malformed_row_fails_naming_the_field(change, message):
  row = {**_row(), **change}
  with pytest.raises(results.RowError, match=re.escape(message)):
    results.validate(row, "x.jsonl:3")


def test_append_then_load_round_trips_and_skips_a_repeated_id(tmp_path):
  a = _row(anchor=results.anchor("official PyTorch code", 58.2e3, "tokens/s", "here"),
           extra={"step_ms": 111.5, "mfu": 0.269})
  b = _row(config="gmm:base-up", metric="fwd_tflops", value=461.0, overrides={"backend": "triton"})
  path = tmp_path / "h200.jsonl"
  assert results.append(str(path), a) and results.append(str(path), b)
  assert not results.append(str(path), dict(a))   # the same measurement: the same id, kept once
  assert results.load(str(tmp_path)) == [a, b]
  assert a["id"].startswith("2026-12-05-h200-tokens_per_s-") and a["id"] != b["id"]
  assert _row()["id"] == _row()["id"] != _row(value=293.7e3)["id"]   # stable, and by contents


def test_load_names_the_file_line_and_field_of_a_bad_row(tmp_path):
  good, bad = _row(), _row(value=1.0)
  del bad["command"]
  path = tmp_path / "h200.jsonl"
  path.write_text(json.dumps(good) + "\n\n" + json.dumps(bad) + "\n")
  with pytest.raises(results.RowError, match=re.escape(f"{path}:3: missing field 'command'")):
    results.load(str(tmp_path))
  path.write_text(json.dumps(good) + "\n{not json\n")
  with pytest.raises(results.RowError, match=re.escape(f"{path}:2: not JSON")):
    results.load(str(tmp_path))


def test_add_files_rows_by_device(tmp_path):
  one, two = _row(), _row(device="NVIDIA H200 x2", value=380.9e3)
  src = tmp_path / "rows.jsonl"
  for r in (one, two):
    results.append(str(src), r)
  out = tmp_path / "results"
  assert results.add([str(src)], str(out)) == 2 and results.add([str(src)], str(out)) == 0
  assert sorted(os.listdir(out)) == ["h200-x2.jsonl", "h200.jsonl"]


def test_record_fills_in_date_commit_device_and_command(tmp_path, monkeypatch):
  monkeypatch.setenv("OUT", str(tmp_path))
  monkeypatch.setattr(sys, "argv", ["bench/train_step.py", "--runs=umoe_base:single", "--x=a b"])
  row = results.record(None, "umoe_base", "tokens_per_s", 1e5, device="NVIDIA H100 80GB HBM3")
  assert results.load_file(str(tmp_path / "rows.jsonl")) == [row]
  assert row["command"] == "python3 bench/train_step.py --runs=umoe_base:single '--x=a b'"
  assert re.fullmatch(r"[0-9a-f]{7,}\+?|unknown", row["commit"]) and row["device"] == "NVIDIA H100 80GB HBM3"
  assert results.record("none", "umoe_base", "tokens_per_s", 1e5, device="x") is None
  monkeypatch.delenv("OUT")
  assert results.default_path("NVIDIA H100 80GB HBM3").endswith("bench/results/h100-80gb-hbm3.jsonl")


def _reference_best(rows):
  """Per (device, config, overrides, metric), the row a reader would pick by hand."""
  best = {}
  for r in rows:
    key = (r["device"], r["config"], json.dumps(r["overrides"], sort_keys=True), r["metric"])
    higher = results.METRICS[r["metric"]][1]
    cands = [x for x in rows if (x["device"], x["config"], json.dumps(x["overrides"], sort_keys=True),
                                 x["metric"]) == key]
    top = (max if higher else min)(x["value"] for x in cands)
    best[key] = max((x for x in cands if x["value"] == top), key=lambda x: (x["date"], x["id"]))
  return best


def test_best_of_picks_the_right_row():
  rng = random.Random(0)
  rows = []
  for i in range(300):
    metric = rng.choice(["tokens_per_s", "fwd_ms", "fwd_tflops"])
    rows.append(_row(date=f"2026-12-{rng.randint(1, 9):02d}", device=rng.choice(["NVIDIA H200", "NVIDIA H100"]),
                     config=rng.choice(["umoe_base", "dense_base", "gmm:base-up"]), metric=metric,
                     overrides=rng.choice([{}, {"zipf": 1.1}]), value=float(rng.randint(1, 6)),
                     command=f"python3 bench/x.py --i={i}"))
  assert report.best_rows(rows) == _reference_best(rows)
  faster, slower = _row(metric="fwd_ms", value=0.4), _row(metric="fwd_ms", value=0.5)
  assert list(report.best_rows([slower, faster]).values()) == [faster]   # lower is better for time
  other = _row(overrides={"zipf": 1.1}, value=1.0)
  assert len(report.best_rows([_row(), other])) == 2                    # settings never mix


def test_performance_page_is_what_the_rows_give():
  with open(report.PAGE) as f:
    have = f.read()
  assert report.outputs()[report.PAGE] == have, (
      "docs/performance.md is stale: regenerate it with `python3 -m bench.report`")
  # README.md's block between the markers, where it has them, is current too
  stale = sorted(os.path.relpath(p, ROOT) for p in report.outputs() if p != report.PAGE)
  assert not stale, f"stale (README's performance block, zoo config docstrings): {stale}; `python3 -m bench.report`"


def test_check_fails_when_the_page_is_stale(tmp_path, monkeypatch, capsys):
  rows_dir = tmp_path / "results"
  rows_dir.mkdir()
  (rows_dir / "to_measure.md").write_text("- FP8 rows\n")
  results.append(str(rows_dir / "h200.jsonl"), _row())
  page, readme = tmp_path / "performance.md", tmp_path / "README.md"
  readme.write_text(f"# x\nbefore\n{report.README_BEGIN}\nold\n{report.README_END}\nafter\n")
  configs = tmp_path / "configs"
  configs.mkdir()
  zoo = 'from configs import common\n\n\ndef get_config():\n  return common.experiment("{}", "{}")\n'
  (configs / "umoe_base.py").write_text('"""umoe, base.\n\nMeasured: 1 ms (old).\n"""\n' + zoo.format("umoe", "base"))
  (configs / "moa_base.py").write_text('"""moa, base."""\n' + zoo.format("moa", "base"))
  other = '"""A hand-made config."""\nfrom configs import common\n\n\ndef get_config():\n  return 1\n'
  (configs / "special.py").write_text(other)
  paths = dict(directory=str(rows_dir), page_path=str(page), readme_path=str(readme),
               configs_dir=str(configs))
  assert report.main(["--check"], **paths) == 1                       # no page yet
  assert report.main([], **paths) == 0 and report.main(["--check"], **paths) == 0
  umoe = (configs / "umoe_base.py").read_text()
  assert umoe.startswith('"""umoe, base.\n\nTrain') and "(old)" not in umoe
  assert "python3 train.py --config=configs/umoe_base.py --workdir=runs/umoe_base" in umoe
  assert "293.8k tokens/s" in umoe and _row()["id"] in umoe and umoe.endswith(zoo.format("umoe", "base"))
  assert "not measured yet" in (configs / "moa_base.py").read_text()
  assert (configs / "special.py").read_text() == other                 # not a zoo config: untouched
  text = readme.read_text()
  assert text.startswith("# x\nbefore\n" + report.README_BEGIN + "\n<!-- generated")
  assert text.endswith(report.README_END + "\nafter\n") and "293.8k" in text and "old" not in text
  assert "## To measure\n\n- FP8 rows" in page.read_text()
  results.append(str(rows_dir / "h200.jsonl"), _row(value=300e3))
  capsys.readouterr()
  assert report.main(["--check"], **paths) == 1
  assert "stale: " in capsys.readouterr().err


def test_readme_without_markers_is_left_alone():
  text = "# README\nno markers here\n"
  assert report.with_readme_block(text, "table") == text
  assert report.with_readme_block(f"a{report.README_BEGIN}x{report.README_END}b", "t") == (
      f"a{report.README_BEGIN}\nt\n{report.README_END}b")


def test_config_docstrings_cite_rows_that_exist():
  rows = {r["id"]: r for r in results.load()}
  cited = 0
  for name in sorted(os.listdir(os.path.join(ROOT, "configs"))):
    if not name.endswith(".py"):
      continue
    with open(os.path.join(ROOT, "configs", name)) as f:
      doc = f.read()
    for tokens, rid in re.findall(r"([\d.]+)k tokens/s[^\n]*result (\S+)", doc):
      assert rid in rows, f"configs/{name} cites {rid}, no row of bench/results/"
      assert rows[rid]["config"] == name[:-3] and f"{rows[rid]['value'] / 1e3:.1f}" == tokens, name
      cited += 1
  assert cited >= 4


# The bench scripts' row writers, fed measured values (what a GPU run would hand them).

def _valid(measurement):
  m = dict(measurement)
  device = m.pop("device", "NVIDIA H200")
  row = results.make_row(date="2026-12-06", commit="abc1234", command="python3 bench/x.py",
                         device=results.device_name(device, m.pop("devices", 1)), **m)
  return results.validate(row)


def test_train_step_rows():
  import train_step
  args = train_step.parser().parse_args(["--runs=umoe_base:single", "--steps=3", "--zipf=1.1"])
  r = dict(config="umoe_base", layout="single", devices=1, device_kind="NVIDIA H200", batch=32,
           seq_len=1024, step_ms=111.5, tokens_per_s=293.8e3, mfu=0.269, peak_mem_gb=25.3,
           loss_check=True, step_times_ms=[110.8, 111.5, 112.5], xla_flags="")
  row = _valid(train_step.measurement(r, args))
  assert row["overrides"] == {"zipf": 1.1} and row["value"] == 293.8e3
  assert row["anchor"]["value"] == train_step.ANCHORS["NVIDIA H200"]["umoe_base"]
  assert row["anchor"]["what"] == "official PyTorch code, one H200"
  # each device kind against the official code on its own kind; a kind never measured: no anchor
  h100 = _valid(train_step.measurement(dict(r, device_kind="NVIDIA H100 80GB HBM3"), args))
  assert h100["anchor"]["value"] == 49.3e3 and h100["anchor"]["what"].endswith("one H100")
  a100 = dict(r, device_kind="NVIDIA A100-SXM4-80GB", scaling_efficiency=1.0)   # (as add_efficiency)
  assert _valid(train_step.measurement(a100, args))["anchor"] is None
  assert row["extra"]["step_ms"] == 111.5 and row["extra"]["step_ms_range"] == [110.8, 112.5]
  assert "switches" not in row["extra"]    # a row made without them says nothing of them
  ran = {key: i % 2 for i, key in enumerate(train_step.SWITCHES)}
  row = _valid(train_step.measurement(dict(r, **ran), args))
  assert row["extra"]["switches"] == ran and row["overrides"] == {"zipf": 1.1}
  multi = dict(r, layout="data@2", devices=2, exchange="auto", chunks=1, tokens_per_s=560e3,
               scaling_efficiency=560 / 587.6)
  row = _valid(train_step.measurement(multi, train_step.parser().parse_args([])))
  assert row["device"] == "NVIDIA H200 x2" and row["overrides"]["layout"] == "data@2"
  assert row["anchor"]["value"] == pytest.approx(587.6e3)
  assert train_step.measurement(dict(r, loss_check=False), args) is None
  assert train_step.measurement(dict(config="x", layout="single", error="boom"), args) is None


def test_gmm_rows():
  import gmm
  row = dict(torch_f=443.0, torch_fb=float("nan"), triton_fwd=461.0, triton_fwd_bwd=363.0,
             triton_dgrad=272.0, triton_wgrad=420.0, triton_err={"fwd": 1.7e-3},
             mosaic_fwd=float("nan"), mosaic_fwd_bwd=float("nan"))
  rows = [_valid(m) for m in gmm.measurements("base-up", row, ["triton", "mosaic"])]
  assert [(r["config"], r["metric"], r["value"]) for r in rows] == [
      ("gmm:base-up", "fwd_tflops", 461.0), ("gmm:base-up", "fwd_bwd_tflops", 363.0)]
  assert rows[0]["anchor"]["value"] == 443.0 and "same process" in rows[0]["anchor"]["what"]
  assert rows[1]["anchor"]["value"] == 259      # torch's backward failed: shared/anchors' figure
  assert rows[1]["extra"]["dgrad_tflops"] == 272.0
  h100 = gmm.measurements("base-up", row, ["triton"], "NVIDIA H100 80GB HBM3")
  assert h100[0]["anchor"]["value"] == 443.0 and h100[1]["anchor"] is None  # an H200's figure: no


def test_attention_core_rows():
  import attention_core
  t = lambda ms: dict(fwd_ms=ms, fwd_bwd_ms=4 * ms, fwd_tflops=100.0, fwd_bwd_tflops=80.0)
  row = {"xla": t(1.0), "triton": t(0.45), "triton_err": 1e-3, "delta": {"x": 1}}
  rows = [_valid(m) for m in attention_core.measurements("base", row)]
  got = {(json.dumps(r["overrides"], sort_keys=True), r["metric"]): r for r in rows}
  assert set(got) == {(o, m) for o in ('{"core": "xla"}', '{"core": "triton"}')
                      for m in ("fwd_ms", "fwd_bwd_ms")}
  triton = got['{"core": "triton"}', "fwd_bwd_ms"]
  assert triton["value"] == 1.8 and triton["anchor"]["value"] == 4.0
  assert triton["extra"] == {"fwd_bwd_tflops": 80.0}
  assert got['{"core": "xla"}', "fwd_ms"]["anchor"] is None
  tuned = attention_core.measurements("base", {"triton_recompute": t(0.6)}, tuned=True)
  assert _valid(tuned[0])["overrides"] == {"core": "triton", "core_backward": "recompute", "tiles": "swept"}


def test_a_config_docstring_shows_its_rows_command_for_that_config_alone():
  row = _row(command="python3 bench/train_step.py --runs=dense_base:single,umoe_base:single,"
                     "umoe_base:expert@2,umoe_base:single/precision=fp8,umoe_base:single/zipf=1.1 "
                     "--steps=10 --results=/root/out/rows.jsonl --out=/root/out")
  assert report._row_command(row) == (
      "python3 bench/train_step.py --runs=umoe_base:single,umoe_base:expert@2 --steps=10")
  fp8 = dict(row, overrides={"precision": "fp8"})
  assert report._row_command(fp8) == (
      "python3 bench/train_step.py --runs=umoe_base:single/precision=fp8 --steps=10")
  skew = dict(row, overrides={"zipf": 1.1})    # the number, not its spelling
  assert report._row_command(dict(skew, command=row["command"].replace("zipf=1.1", "zipf=1.10"))) == (
      "python3 bench/train_step.py --runs=umoe_base:single/zipf=1.10 --steps=10")
  # A piece at its default leaves no setting: rather every run of the config than none.
  plain = _row(command="python3 bench/train_step.py --runs=umoe_base:single/precision=bf16")
  assert report._row_command(plain) == plain["command"]


def test_an_environment_setting_stays_an_assignment():
  words = ["XLA_FLAGS=--a=1 --b=2", "python3", "bench/x.py", "--name=a b"]
  assert results.join_command(words) == "XLA_FLAGS='--a=1 --b=2' python3 bench/x.py '--name=a b'"
  assert shlex.split(results.join_command(words)) == words
  row = _row(command=results.join_command(words + ["--results=/o/rows.jsonl"]))
  assert report._row_command(row) == results.join_command(words)
  assert results.command_line(["bench/x.py", "A=1"]) == "python3 bench/x.py A=1"


# Rows read as today's code: retired settings (results.RETIRED) and how a row was taken.

def _retired(monkeypatch):
  monkeypatch.setattr(results, "RETIRED", {"old_on": (1, "abc1234", "now always on", {}),
                                           "old_off": (0, "abc1234", "removed", {}),
                                           "fp8_only": (1, "abc1234", "fp8 always", {"precision": "fp8"})})


def test_a_retired_setting_at_todays_value_leaves_the_row(monkeypatch):
  _retired(monkeypatch)
  row = _row(overrides={"old_on": 1, "trace_step": 4, "precision": "fp8"},
             command="python3 bench/train_step.py --runs=umoe_base:single/old_on=1/precision=fp8,"
                     "umoe_base:single/precision=fp8,umoe_base:single/old_off=1/precision=fp8 "
                     "--trace_step 4 --old_off=0 --steps=6")
  today, notes = results.as_today(row)
  assert notes == [] and today["overrides"] == {"precision": "fp8"} and today["id"] == row["id"]
  # the runs at today's value and the one left repeat: kept once; the gone run cannot run today
  assert today["command"] == "python3 bench/train_step.py --runs=umoe_base:single/precision=fp8 --steps=6"
  assert row["overrides"] == {"old_on": 1, "trace_step": 4, "precision": "fp8"}   # not changed in place
  plain = _row(overrides={"zipf": 1.1})
  assert results.as_today(plain) == (plain, [])
  for same in ("1", 1.0, True):    # a value read from a command, or written as a float
    today, notes = results.as_today(_row(overrides={"old_on": same}))
    assert today["overrides"] == {} and notes == []


def test_a_retired_setting_at_another_value_is_history(monkeypatch):
  _retired(monkeypatch)
  today, notes = results.as_today(_row(overrides={"old_off": 1, "old_on": "0"},
                                       command="python3 bench/train_step.py --old_off=1"))
  assert today["overrides"] == {"old_off": 1, "old_on": "0"} and today["command"] == "python3 bench/train_step.py"
  assert notes == ["`old_off=1`: removed (since abc1234)", "`old_on=0`: now always on (since abc1234)"]


def test_a_recorded_switch_that_went_makes_the_row_history(monkeypatch):
  _retired(monkeypatch)
  ran_off = _row(extra={"step_ms": 1.0, "switches": {"old_on": 0, "other": 1}})
  assert results.as_today(ran_off)[1] == ["`old_on=0`: now always on (since abc1234)"]
  ran_on = _row(extra={"step_ms": 1.0, "switches": {"old_on": 1, "old_off": 0}})
  assert results.as_today(ran_on) == (ran_on, [])


def test_a_retired_setting_outside_its_scope_says_nothing(monkeypatch):
  """An FP8 setting recorded on a bf16 row (every row records every switch) did not decide what it
  ran: the bf16 row is today's; the fp8 row at another value is history."""
  _retired(monkeypatch)
  bf16 = _row(overrides={"fp8_only": 0}, extra={"switches": {"fp8_only": 0}})
  today, notes = results.as_today(bf16)
  assert notes == [] and today["overrides"] == {}
  f8 = _row(overrides={"precision": "fp8"}, extra={"switches": {"fp8_only": 0}})
  assert results.as_today(f8)[1] == ["`fp8_only=0`: fp8 always (since abc1234)"]
  assert results.as_today(dict(f8, extra={"switches": {"fp8_only": 1}}))[1] == []
  monkeypatch.setitem(results.RETIRED, "moe_only", (1, "abc1234", "moe", {"config": ("a", "umoe_base")}))
  assert results.as_today(_row(extra={"switches": {"moe_only": 0}}))[1] == ["`moe_only=0`: moe (since abc1234)"]
  assert results.as_today(_row(config="dense_base", extra={"switches": {"moe_only": 0}}))[1] == []
  cmd = "python3 bench/train_step.py --runs=u:single/fp8_only=0,u:single/precision=fp8/fp8_only=0"
  assert results.as_today(_row(command=cmd))[0]["command"] == (
      "python3 bench/train_step.py --runs=u:single")


def test_the_page_reads_rows_as_todays_code(monkeypatch):
  _retired(monkeypatch)
  new = _row(value=300e3, overrides={"old_on": 1}, extra={"step_ms": 109.0})
  old = _row(value=250e3, date="2026-12-01", extra={"step_ms": 131.0})
  gone = _row(value=400e3, overrides={"old_off": 1})
  text = report.page([old, new, gone], "nothing")
  assert new["id"] in text and old["id"] not in text            # one group: the defaults, best row
  assert "old_on" not in text and gone["id"] not in text and "400.0k" not in text
  assert "- `old_off=1`: removed (since abc1234); 1 row of umoe_base" in (
      text.split("### Settings no longer offered")[1])
  assert new["id"] in report.readme_block([new])                 # a default row once read as today's
  # A device whose rows all ran gone settings still has its section, with that line alone.
  lone = _row(device="NVIDIA H100", overrides={"old_off": 1}, config="gmm:base-up", metric="fwd_tflops",
              value=400.0)
  section = report.page([new, lone], "nothing").split("## NVIDIA H100\n")[1].split("\n## ")[0]
  assert "`old_off=1`: removed (since abc1234); 1 row of gmm:base-up" in section
  assert "| " not in section


def test_no_bench_script_takes_a_retired_setting():
  for name in sorted(os.listdir(os.path.join(ROOT, "bench"))):
    if name.endswith(".py") and name != "results.py":
      with open(os.path.join(ROOT, "bench", name)) as f:
        text = f.read()
      for setting in results.RETIRED:
        assert not re.search(rf"[\"'/-]{setting}\b", text), f"bench/{name} still names {setting}"
