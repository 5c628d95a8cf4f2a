"""`--log_samples` of `python -m umoe_jax.eval tasks | mmlu | race` (umoe_jax/eval/samples.py): the
JSONL holds one record per item, in file order; aggregated from its raw fields (log-likelihoods,
gold, the scored requests), the items give exactly the metrics the command reports (acc, acc_norm,
their standard errors, lm's ppl; MMLU per subject, category and overall); the logged
log-likelihoods are the model's own for the logged requests; a path that cannot be written fails
before any scoring."""
from __future__ import annotations

import json
import math
import sys
from collections import defaultdict

import numpy as np
import pytest

from conftest import ROOT
from test_eval import _synthetic_dir
from test_eval_tasks import ARTICLE, _jsonl, _mmlu_fixture
from umoe_jax.eval import cli, mmlu
from umoe_jax.eval.scoring import Scorer, encode_requests
from umoe_jax.load import load_model_and_tokenizer

CONFIG = f"{ROOT}/configs/dense_tiny.py"
SMALL = ["--config.model.n_layers=1", "--config.model.d_model=32", "--config.model.max_seq_len=128"]


def run_cli(capsys, monkeypatch, *argv):
  """(exit status, stdout, stderr) in-process, sys.argv as a real run has it (config_flags reads
  its --config.<key> overrides from there)."""
  argv = [str(a) for a in argv]
  monkeypatch.setattr(sys, "argv", ["python -m umoe_jax.eval", *argv])
  code = cli.main(argv)
  out = capsys.readouterr()
  return code, out.out, out.err


def _read(path):
  return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _mean_stderr(x):
  x = np.asarray(x, np.float64)
  return float(x.mean()), (float(np.std(x, ddof=1) / math.sqrt(len(x))) if len(x) > 1 else None)


def _choice_metrics(items, norm: bool) -> dict:
  """acc (and acc_norm) recomputed from the raw fields: argmax of the log-likelihoods (divided by
  the characters of the choice, the continuation without its leading space) against gold."""
  out = {}
  hits = [int(np.argmax(r["loglikelihoods"])) == r["gold"] for r in items]
  out["acc"], out["acc_stderr"] = _mean_stderr(hits)
  if norm:
    hits = [int(np.argmax(np.array(r["loglikelihoods"]) /
                          [max(len(c) - 1, 1) for _, c in r["requests"]])) == r["gold"]
            for r in items]
    out["acc_norm"], out["acc_norm_stderr"] = _mean_stderr(hits)
  return out


def _by_task(records):
  out = defaultdict(list)
  for r in records:
    out[r["task"]].append(r)
  return out


def _assert_close(got: dict, want: dict, where: str):
  for key, value in want.items():
    if value is None:
      assert got[key] is None, (where, key)
    else:
      assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-15), (where, key)


def test_tasks_samples_aggregate_to_the_reported_metrics(tmp_path, capsys, monkeypatch):
  data_dir = _synthetic_dir(tmp_path)
  rng = np.random.default_rng(0)
  mine = _jsonl(tmp_path / "mine.jsonl", [
      {"query": f"{a} + {b} =", "choices": [str(a + b), str(a * b + 1), "zero"],
       "gold": int(rng.integers(3))} for a, b in rng.integers(1, 20, (14, 2)).tolist()])
  res, log = tmp_path / "res.json", tmp_path / "out" / "samples.jsonl"
  code, _, err = run_cli(capsys, monkeypatch, "tasks", f"--config={CONFIG}", *SMALL,
                         f"--data_dir={data_dir}", f"--tasks=arc_easy,winogrande,lambada_openai,"
                         f"sums={mine}:mc", "--num_fewshot=1", f"--json={res}",
                         f"--log_samples={log}")
  assert code == 0, err
  results = json.loads(res.read_text())["results"]
  by_task = _by_task(_read(log))
  assert list(by_task) == ["arc_easy", "winogrande", "lambada_openai", "sums"]
  for name, items in by_task.items():
    assert [r["doc_id"] for r in items] == list(range(results[name]["n"])), name
  for name in ("arc_easy", "sums"):
    _assert_close(results[name], _choice_metrics(by_task[name], norm=True), name)
    # the stored per-item fields say the same as the raw ones
    assert np.mean([r["acc"] for r in by_task[name]]) == results[name]["acc"]
    assert np.mean([r["acc_norm"] for r in by_task[name]]) == results[name]["acc_norm"]
  _assert_close(results["winogrande"], _choice_metrics(by_task["winogrande"], norm=False), "wg")
  lam = by_task["lambada_openai"]
  acc, err_ = _mean_stderr([r["greedy"][0] for r in lam])
  ppl = math.exp(-np.mean([r["loglikelihoods"][0] for r in lam]))
  _assert_close(results["lambada_openai"], {"acc": acc, "acc_stderr": err_, "ppl": ppl}, "lambada")
  assert 0 < results["sums"]["acc"] < 1           # a task whose aggregate the items can get wrong

  # The requests are the items' own, few-shot example first, and their log-likelihoods the model's.
  first = by_task["sums"][0]
  assert [c for _, c in first["requests"]] == [" " + c for c in json.loads(
      open(mine).readline())["choices"]]
  assert first["requests"][0][0].endswith("\n\n" + json.loads(open(mine).readline())["query"])
  model, tok, _ = load_model_and_tokenizer(None, _config_with(SMALL))   # the command's model
  records = [r for items in by_task.values() for r in items]
  pairs = [tuple(q) for r in records for q in r["requests"]]
  ll, greedy = Scorer(model, 8).loglikelihood(encode_requests(tok, pairs))
  np.testing.assert_allclose(ll, [x for r in records for x in r["loglikelihoods"]], rtol=1e-5)
  assert list(greedy) == [g for r in records for g in r["greedy"]]


def _config_with(overrides):
  """configs/dense_tiny.py's experiment config with --config.model.<key>=<int> overrides."""
  import importlib.util
  spec = importlib.util.spec_from_file_location("dense_tiny", CONFIG)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  for o in overrides:
    key, value = o[len("--config.model."):].split("=")
    setattr(config.model, key, int(value))
  return config


def test_mmlu_samples_aggregate_per_subject_category_and_overall(tmp_path, capsys, monkeypatch):
  data = _mmlu_fixture(tmp_path / "mmlu", subjects=(("abstract_algebra", "CCCAB"),
                                                    ("philosophy", "CBDA"), ("virology", "CAB")))
  res, log = tmp_path / "mmlu.json", tmp_path / "mmlu.jsonl"
  code, _, err = run_cli(capsys, monkeypatch, "mmlu", f"--config={CONFIG}", *SMALL,
                         f"--data_dir={data}", "--num_fewshot=2", f"--json={res}",
                         f"--log_samples={log}")
  assert code == 0, err
  results = json.loads(res.read_text())["results"]
  records = _read(log)
  by_subject = defaultdict(list)
  for r in records:
    assert r["task"] == f"mmlu_{r['subject']}" and r["category"] == mmlu.SUBJECTS[r["subject"]]
    assert [c for _, c in r["requests"]] == [" A", " B", " C", " D"]
    by_subject[r["subject"]].append(r)
  assert {s: len(v) for s, v in by_subject.items()} == {"abstract_algebra": 5, "philosophy": 4,
                                                        "virology": 3}
  for subject, items in by_subject.items():
    want = _choice_metrics(items, norm=False)
    assert results[f"mmlu_{subject}"]["n"] == len(items)
    _assert_close(results[f"mmlu_{subject}"], want, subject)

  def pooled(items):
    hits = [int(np.argmax(r["loglikelihoods"])) == r["gold"] for r in items]
    acc = float(np.mean(hits))
    return {"acc": acc, "acc_stderr": math.sqrt(acc * (1 - acc) / (len(hits) - 1)), "n": len(hits)}

  for category in ("stem", "humanities", "other"):
    items = [r for r in records if r["category"] == category]
    _assert_close(results[f"mmlu_{category}"], pooled(items), category)
  _assert_close(results["mmlu"], pooled(records), "mmlu")
  assert results["mmlu"]["subject_mean"] == pytest.approx(np.mean(
      [np.mean([int(np.argmax(r["loglikelihoods"])) == r["gold"] for r in v])
       for v in by_subject.values()]), rel=1e-12)


def test_race_samples_aggregate(tmp_path, capsys, monkeypatch):
  arts = _jsonl(tmp_path / "race.jsonl", [ARTICLE, dict(ARTICLE, answers=["A", "B", "A"]),
                                          dict(ARTICLE, answers=["A", "B", "D"])])
  res, log = tmp_path / "race.json", tmp_path / "race.jsonl.out"
  code, _, err = run_cli(capsys, monkeypatch, "race", f"--config={CONFIG}", *SMALL,
                         f"--data={arts}", f"--json={res}", f"--log_samples={log}")
  assert code == 0, err
  got = json.loads(res.read_text())["results"]["race"]
  items = _read(log)
  assert [r["gold"] for r in items] == [2, 0, 3] and {r["task"] for r in items} == {"race"}
  assert all(r["requests"][0][0].startswith("Article: Tom has a red ball.") for r in items)
  _assert_close(got, dict(_choice_metrics(items, norm=True), n=3), "race")


def test_log_samples_path_that_cannot_be_written_fails_before_scoring(tmp_path, capsys,
                                                                      monkeypatch):
  (tmp_path / "file").write_text("x")
  for command, flags in (("tasks", ["--tasks=arc_easy", f"--data_dir={_synthetic_dir(tmp_path)}"]),
                         ("race", ["--data=/nonexistent"]), ("mmlu", ["--data_dir=/nonexistent"])):
    code, out, err = run_cli(capsys, monkeypatch, command, f"--config={CONFIG}", *SMALL, *flags,
                             f"--log_samples={tmp_path}/file/s.jsonl")
    assert code == 1 and out == "" and err.count("error:") == 1, (command, err)
    assert "--log_samples=" in err and "is a file, not a directory" in err, err
    assert "model:" not in err                       # refused before the model loaded
