"""Every `python -m umoe_jax.eval` command end to end on a tiny trained checkpoint (tasks with few-shot
and task files, mmlu, race, perplexity on WikiText-2, attack), the lm-evaluation-harness adapter
against our own harness on the same items, and bad input: one error line, a non-zero exit, no
result file written.

The checkpoint is trained once per session (a dense 1-layer model, 3 steps on the built-in corpus,
byte tokenizer); commands run in-process through `cli.main` (sharing compiled scoring programs),
one of each kind also as a subprocess.
"""
from __future__ import annotations

import glob
import json
import math
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import configs.common
from conftest import ROOT
from test_eval import _synthetic_dir
from test_eval_tasks import ARTICLE, _jsonl, _mmlu_fixture
from umoe_jax.data.tokenizer import ByteTokenizer
from umoe_jax.eval import cli, corpora, corpus_ppl, fewshot, harness, taskspec
from umoe_jax.eval import tasks as tasks_lib
from umoe_jax.eval.scoring import Scorer, encode_requests
from umoe_jax.load import LoadError, load_model_and_tokenizer

WIKITEXT = os.path.join(os.path.dirname(ROOT), "shared", "data", "wikitext-2")
GPT2 = os.path.join(os.path.dirname(ROOT), "shared", "data", "tokenizers", "gpt2", "tokenizer.json")
ENV = dict(os.environ, PYTHONIOENCODING="utf-8", JAX_PLATFORMS="cpu")


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
  """(workdir, model, tokenizer) of a dense 1-layer model trained 3 steps (checkpoints 2 and 3)."""
  from umoe_jax.train import loop
  c = configs.common.experiment("dense", "tiny")
  c.model.n_layers, c.model.d_model, c.model.max_seq_len = 1, 32, 64
  c.train.update(dict(global_batch_size=4, seq_len=64, num_steps=3, learning_rate=3e-3,
                      warmup_steps=1, log_every=1, eval_every=0))
  c.checkpoint.update(dict(every=1, keep=2))
  c.log.tensorboard = False
  workdir = str(tmp_path_factory.mktemp("eval_ckpt"))
  assert loop.run(c, workdir)["step"] == 3
  model, tok, _ = load_model_and_tokenizer(workdir)
  return workdir, model, tok


def run_cli(capsys, *argv):
  """(exit status, stdout, stderr) of `python -m umoe_jax.eval *argv`, in-process."""
  code = cli.main([str(a) for a in argv])
  out = capsys.readouterr()
  return code, out.out, out.err


# ------------------------------------------------------------------------------------------------
# Commands


def test_tasks_command_fewshot_files_and_spec(trained, tmp_path, capsys):
  ckpt, model, tok = trained
  data_dir = _synthetic_dir(tmp_path)
  mine = _jsonl(tmp_path / "mine.jsonl", [{"query": f"{i} + {i} =", "choices": [str(2 * i), "7"],
                                           "gold": 0} for i in range(5)])
  (tmp_path / "suite.yaml").write_text("- {name: lam2, path: lambada_openai.jsonl, kind: cloze, "
                                       "num_fewshot: 0}\n")
  out_json = tmp_path / "res" / "tasks.json"
  code, table, err = run_cli(capsys, "tasks", f"--checkpoint={ckpt}", f"--data_dir={data_dir}",
                             f"--tasks=arc_easy,winogrande,sums={mine}:mc,{tmp_path}/suite.yaml",
                             "--num_fewshot=1", "--batch_size=4", f"--json={out_json}")
  assert code == 0, err
  for row in ("| arc_easy ", "| winogrande ", "| sums ", "| lam2 ", "acc_norm", "ppl"):
    assert row in table, table
  saved = json.loads(out_json.read_text())
  assert saved["command"] == "tasks" and saved["checkpoint"] == ckpt
  expected = harness.evaluate(model, tok, ["arc_easy", "winogrande", f"sums={mine}:mc",
                                           f"{tmp_path}/suite.yaml"], data_dir=data_dir,
                              num_fewshot=1, batch_size=4)
  for name, m in expected.items():
    assert saved["results"][name]["num_fewshot"] == (0 if name == "lam2" else 1)
    for key in ("acc", "acc_norm", "ppl"):
      if key in m:
        assert math.isclose(saved["results"][name][key], m[key], rel_tol=1e-6), (name, key)
  # the few-shot items really are in the prompts: 2-shot log-likelihoods differ from 0-shot ones
  docs = tasks_lib.read_jsonl(mine, "mc")
  zero = Scorer(model).loglikelihood(encode_requests(tok, [r for d in docs for r in d.requests()]))
  pre = fewshot.fewshot_prefixes(docs, 2)
  two = Scorer(model).loglikelihood(encode_requests(
      tok, [r for d, p in zip(docs, pre) for r in d.requests(p)]))
  assert not np.allclose(zero[0], two[0])


def test_mmlu_and_race_commands(trained, tmp_path, capsys):
  ckpt, model, tok = trained
  data = _mmlu_fixture(tmp_path / "mmlu")
  code, table, err = run_cli(capsys, "mmlu", f"--checkpoint={ckpt}", f"--data_dir={data}",
                             "--num_fewshot=3", f"--json={tmp_path}/mmlu.json")
  assert code == 0, err
  for row in ("| mmlu_abstract_algebra ", "| mmlu_stem ", "| mmlu_humanities ", "| mmlu "):
    assert row in table, table
  got = json.loads((tmp_path / "mmlu.json").read_text())["results"]
  want = harness.evaluate_spec(Scorer(model), tok, taskspec.TaskSpec("mmlu", "mmlu", data,
                                                                     num_fewshot=3))
  assert {k: (v["acc"], v["n"]) for k, v in got.items()} == {k: (v["acc"], v["n"])
                                                            for k, v in want.items()}
  arts = _jsonl(tmp_path / "race.jsonl", [ARTICLE, dict(ARTICLE, answers=["A", "B", "A"])])
  code, table, err = run_cli(capsys, "race", f"--checkpoint={ckpt}", f"--data={arts}",
                             f"--json={tmp_path}/race.json")
  assert code == 0 and "| race " in table, err
  got = json.loads((tmp_path / "race.json").read_text())["results"]["race"]
  want = harness.evaluate_spec(Scorer(model), tok, taskspec.TaskSpec("race", "race", arts))["race"]
  assert (got["acc"], got["acc_norm"], got["n"]) == (want["acc"], want["acc_norm"], 2)


@pytest.mark.skipif(not os.path.isdir(WIKITEXT), reason=f"WikiText-2 not found at {WIKITEXT}")
def test_perplexity_and_attack_commands_on_wikitext(trained, tmp_path, capsys):
  ckpt, model, tok = trained
  path = os.path.join(WIKITEXT, "wiki.test.tokens")
  flags = [f"--checkpoint={ckpt}", f"--data={path}", "--max_tokens=700", "--context=48",
           "--stride=16", "--batch_size=8"]
  code, table, err = run_cli(capsys, "perplexity", *flags, f"--json={tmp_path}/ppl.json")
  assert code == 0, err
  for row in ("| token_ppl ", "| word_ppl ", "| bits_per_byte ", "| words "):
    assert row in table, table
  got = json.loads((tmp_path / "ppl.json").read_text())["results"]
  corpus = corpora.read_corpus(path)
  want = corpus_ppl.corpus_perplexity(Scorer(model, 8), tok, corpus.documents, words=corpus.words,
                                      context=48, stride=16, max_tokens=700)
  assert got["tokens"] == 700 and got["words"] == want["words"] > 100
  for key in ("token_ppl", "word_ppl", "bits_per_byte"):
    assert math.isclose(got[key], want[key], rel_tol=1e-6), key
  assert got["word_ppl"] > got["token_ppl"]     # a word is several byte tokens

  code, table, err = run_cli(capsys, "attack", *flags, "--rate=0.1", "--attack_seed=1",
                             f"--json={tmp_path}/attack.json")
  assert code == 0 and "| metric " in table and "attacked" in table, err
  res = json.loads((tmp_path / "attack.json").read_text())
  assert res["results"]["clean"]["token_ppl"] == got["token_ppl"]
  assert res["results"]["attacked"]["words"] == got["words"]   # the attack hit the scored text
  assert res["attack"]["substituted"] == round(0.1 * res["attack"]["words"])
  assert res["results"]["attacked"]["nll"] != got["nll"]


def test_checkpoint_flag_takes_a_step_directory(trained, tmp_path, capsys):
  """--checkpoint=<workdir>/checkpoints/<step> evaluates that step's parameters (the arrays Orbax
  saved there), the workdir itself its latest step."""
  import orbax.checkpoint as ocp
  ckpt, model, _ = trained
  saved = {s: ocp.StandardCheckpointer().restore(os.path.join(ckpt, "checkpoints", str(s), "state"))
           for s in (2, 3)}
  np.testing.assert_array_equal(np.asarray(model.embed.value), saved[3]["params"]["embed"])
  step2, _, info = load_model_and_tokenizer(os.path.join(ckpt, "checkpoints", "2"))
  assert info["step"] == 2
  np.testing.assert_array_equal(np.asarray(step2.embed.value), saved[2]["params"]["embed"])
  assert not np.array_equal(saved[2]["params"]["embed"], saved[3]["params"]["embed"])
  doc = tmp_path / "doc.txt"
  doc.write_text("The quick brown fox jumps over the lazy dog. " * 2)
  nll = {}
  for step in (2, 3):
    code, _, err = run_cli(capsys, "perplexity", f"--checkpoint={ckpt}/checkpoints/{step}",
                           f"--data={doc}", f"--json={tmp_path}/{step}.json")
    assert code == 0 and f"(step {step})" in err, err
    nll[step] = json.loads((tmp_path / f"{step}.json").read_text())["results"]["nll"]
  want = corpus_ppl.corpus_perplexity(Scorer(step2), ByteTokenizer(), [doc.read_text()])["nll"]
  assert math.isclose(nll[2], want, rel_tol=1e-6) and not math.isclose(nll[2], nll[3])


def test_module_entry_points_in_subprocesses(trained, tmp_path):
  ckpt, _, _ = trained
  doc = tmp_path / "doc.txt"
  doc.write_text("The quick brown fox jumps over the lazy dog. " * 4)
  res = subprocess.run([sys.executable, "-m", "umoe_jax.eval", "perplexity", f"--checkpoint={ckpt}",
                        f"--data={doc}"], cwd=ROOT, env=ENV, capture_output=True, timeout=300)
  assert res.returncode == 0, res.stderr.decode()[-3000:]
  assert "| token_ppl " in res.stdout.decode() and "| tokens            | 180 " in res.stdout.decode()
  res = subprocess.run([sys.executable, "-m", "umoe_jax.eval.harness", "--tasks=nope",
                        f"--checkpoint={ckpt}"], cwd=ROOT, env=ENV, capture_output=True,
                       timeout=300)
  assert res.returncode == 1
  assert res.stderr.decode().strip().splitlines()[-1].startswith("error: unknown task 'nope'")
  assert "Traceback" not in res.stderr.decode()


def _with_damaged_steps(ckpt: str, tmp_path, steps, size: int = 10) -> str:
  """A copy of the trained workdir whose `steps` have their array chunks truncated to `size` bytes
  (their metadata intact, so they look complete until read); the copy's path."""
  damaged = tmp_path / "damaged"
  shutil.copytree(ckpt, damaged)
  for step in steps:
    chunks = glob.glob(str(damaged / "checkpoints" / str(step) / "state" / "ocdbt.process_*" / "d"
                           / "*"))
    assert chunks
    for path in chunks:
      os.truncate(path, size)
  return str(damaged)


def test_damaged_checkpoint_is_one_error_line(trained, tmp_path):
  """Every step's array files truncated: the loader's one error line naming the checkpoint
  directory and each step's failure, not also one 'Event loop is closed' traceback per array that
  TensorStore finishes reading after Orbax gave up; before it, one warning per step tried.
  (Only the arrays' chunks: a step whose metadata is damaged too is incomplete, and skipped.)"""
  ckpt, _, _ = trained
  damaged = _with_damaged_steps(ckpt, tmp_path, (2, 3))
  doc = tmp_path / "doc.txt"
  doc.write_text("The quick brown fox jumps over the lazy dog.")
  env = {k: v for k, v in ENV.items() if k != "UMOE_DEBUG"}
  res = subprocess.run([sys.executable, "-m", "umoe_jax.eval", "perplexity",
                        f"--checkpoint={damaged}", f"--data={doc}"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
  assert res.returncode == 1, res.stderr[-3000:]
  lines = [line for line in res.stderr.splitlines() if line.strip()]
  assert len(lines) == 3 and lines[-1].startswith(
      f"error: no checkpoint step in {damaged}/checkpoints can be loaded (step 3: LoadError: "
      f"cannot read the parameters of checkpoint {damaged}/checkpoints/3 (damaged files"), \
      res.stderr[-3000:]
  assert f"; step 2: LoadError: cannot read the parameters of checkpoint {damaged}/checkpoints/2 " \
         "(damaged files" in lines[-1], lines[-1]
  for line, step in zip(lines, (3, 2)):  # the fallback's warnings, newest step first
    assert (f"checkpoint step {step} in {damaged}/checkpoints cannot be restored (LoadError: "
            in line and line.endswith("; trying the previous one")), res.stderr[-3000:]


def test_damaged_latest_step_falls_back_to_the_previous_one(trained, tmp_path, caplog):
  """The newest step's array files truncated (its metadata sound, so it looks complete): the
  workdir loads the previous step's parameters, as a resume does, with a warning naming the
  damaged step and the cause (was: an error, though step 2 was intact)."""
  import orbax.checkpoint as ocp
  ckpt, _, _ = trained
  damaged = _with_damaged_steps(ckpt, tmp_path, (3,))
  saved2 = ocp.StandardCheckpointer().restore(os.path.join(ckpt, "checkpoints", "2", "state"))
  for path in (damaged, os.path.join(damaged, "checkpoints")):
    caplog.clear()
    with caplog.at_level("WARNING"):
      loaded, _, info = load_model_and_tokenizer(path)
    assert info["step"] == 2
    np.testing.assert_array_equal(np.asarray(loaded.embed.value), saved2["params"]["embed"])
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"checkpoint step 3 in {damaged}/checkpoints cannot be restored "
                            f"(LoadError: cannot read the parameters of checkpoint "
                            f"{damaged}/checkpoints/3 (damaged files") and "Error reading" in m
               for m in messages), messages
    assert any("loaded checkpoint step 2 instead of the newer step(s) [3]" in m
               for m in messages), messages


def test_damaged_named_step_is_an_error_naming_it(trained, tmp_path):
  """A damaged step asked for by its directory: an error naming it, no fallback to step 2. The
  error gives TensorStore's reason, which names the array and the file, not Orbax's wrapper of it
  ("See full TensorStore details: <bound method ... spec of TensorStore({...", cut at 300
  characters before it said anything)."""
  ckpt, _, _ = trained
  damaged = _with_damaged_steps(ckpt, tmp_path, (3,), size=100)
  with pytest.raises(LoadError, match=re.escape(f"checkpoint {damaged}/checkpoints/3 (damaged files, "
                                                "or not the model of its config): ValueError: ")
                     + r"[A-Z_]+: .*Error reading \"params\.") as error:
    load_model_and_tokenizer(os.path.join(damaged, "checkpoints", "3"))
  assert "TensorStore details" not in str(error.value), error.value


def _with_partial_step(ckpt: str, tmp_path, step: int, what: str) -> str:
  """A copy of the trained workdir with a newer numbered step `what` ("empty", or "no_state": its
  state/ gone, as a crash mid-save on gs:// or a copy cut short leaves it); the copy's path."""
  workdir = str(tmp_path / "crashed")
  shutil.copytree(ckpt, workdir)
  partial = os.path.join(workdir, "checkpoints", str(step))
  if what == "empty":
    os.makedirs(partial)
  else:
    shutil.copytree(os.path.join(workdir, "checkpoints", "3"), partial)
    shutil.rmtree(os.path.join(partial, "state"))
  return workdir


@pytest.mark.parametrize("what,why", [("empty", "is empty"),
                                      ("no_state", "has no state/ (the parameters)")])
def test_an_incomplete_latest_step_falls_back_to_the_previous_one(trained, tmp_path, caplog, what,
                                                                  why):
  """A numbered step folder a crash left empty or without its parameters is skipped with a warning
  naming it and why, and the newest complete step loads (was: "holds no parameters")."""
  ckpt, model, _ = trained
  workdir = _with_partial_step(ckpt, tmp_path, 300, what)
  with caplog.at_level("WARNING"):
    loaded, _, info = load_model_and_tokenizer(workdir)
  assert info["step"] == 3
  np.testing.assert_array_equal(np.asarray(loaded.embed.value), np.asarray(model.embed.value))
  assert any(f"skipping checkpoint step 300: {workdir}/checkpoints/300 {why}" in r.getMessage()
             for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_no_complete_step_or_an_incomplete_named_step_is_an_error(trained, tmp_path):
  """No complete step left: one error naming the checkpoint directory and each step's problem. A
  step asked for by its directory that is incomplete: an error naming it, no fallback."""
  ckpt, _, _ = trained
  workdir = _with_partial_step(ckpt, tmp_path, 300, "no_state")
  with pytest.raises(LoadError, match=re.escape(
      f"checkpoint step 300 cannot be loaded: {workdir}/checkpoints/300 has no state/ (the "
      f"parameters): the step is incomplete; pass the workdir {workdir} for its latest complete "
      "step")):
    load_model_and_tokenizer(os.path.join(workdir, "checkpoints", "300"))
  for step in (2, 3):
    shutil.rmtree(os.path.join(workdir, "checkpoints", str(step), "state"))
  with pytest.raises(LoadError, match=re.escape(
      f"no complete checkpoint step in {workdir}/checkpoints (step 300: {workdir}/checkpoints/300 "
      f"has no state/ (the parameters): the step is incomplete; step 3: ")):
    load_model_and_tokenizer(workdir)


# ------------------------------------------------------------------------------------------------
# Bad input


def _bad_inputs(tmp, ckpt):
  data_dir = _synthetic_dir(tmp)
  bad = tmp / "bad.jsonl"
  bad.write_text('{"query": "q", "choices": ["a", "b"], "gold": 0}\n{"query": "q", "choices"\n')
  no_config = tmp / "no_config"
  shutil.copytree(os.path.join(ckpt, "checkpoints"), no_config / "checkpoints")
  common = [f"--checkpoint={ckpt}", f"--data_dir={data_dir}"]
  return [
      (["tasks", *common, "--tasks=nope"], 1, "unknown task 'nope'"),
      (["tasks", *common, f"--tasks={bad}:essay"], 1, "unknown task kind 'essay'"),
      (["tasks", *common, f"--tasks={tmp}/missing.jsonl:mc"], 1, "data not found"),
      (["tasks", *common, f"--tasks={bad}:mc"], 1, "bad.jsonl:2: invalid JSON"),
      (["tasks", *common, "--tasks=winogrande", "--num_fewshot=2"], 1,
       "winogrande: 2 shots requested but the other items of the file have only 1 example"),
      (["tasks", f"--checkpoint={no_config}", f"--data_dir={data_dir}", "--tasks=piqa"], 1,
       "has no config.json"),
      (["tasks", *common, "--tasks=piqa", f"--tokenizer={GPT2}"], 1,
       "has 50257 tokens, but the model of checkpoint "),
      # A BOS id the model has no embedding for is named (it was "the tokenizer does not fit").
      (["tasks", *common, "--tasks=piqa", "--bos_id=512"], 1,
       "--bos_id=512 is outside the model's vocabulary [0, 512)"),
      (["perplexity", f"--checkpoint={ckpt}", f"--data={bad}", "--bos_id=-1"], 1,
       "--bos_id=-1 must be a token id >= 0"),
      (["perplexity", f"--checkpoint={ckpt}", f"--data={tmp}/none.txt"], 1, "no such file"),
      (["perplexity", f"--checkpoint={ckpt}", f"--data={bad}"], 1,
       "bad.jsonl:1: expected an object with a string field 'text'"),
      (["mmlu", f"--checkpoint={ckpt}", f"--data_dir={tmp}"], 1, "MMLU split directory not found"),
      (["tasks", "--tasks=piqa"], 1, "give --checkpoint=DIR"),
      (["evaluate"], 2, "unknown command 'evaluate'"),
      (["tasks", "--no_such_flag=1"], 2, "no_such_flag"),
  ]


def test_bad_input_one_line_nonzero_exit_nothing_written(trained, tmp_path, capsys):
  ckpt, _, _ = trained
  out_json = tmp_path / "out" / "res.json"
  for argv, status, message in _bad_inputs(tmp_path, ckpt):
    if not os.path.exists(GPT2) and GPT2 in " ".join(argv):
      continue
    code, out, err = run_cli(capsys, *argv, f"--json={out_json}")
    assert code == status, (argv, err)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], (argv, err)
    assert "Traceback" not in err and not out.strip(), (argv, out)
    assert not out_json.exists() and not [p for p in tmp_path.glob("out/*") if ".tmp" in p.name]


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.isdir("/proc/self"),
                    reason="needs root: /proc passes the writability check only for root")
def test_json_that_cannot_be_written_at_the_end(trained, tmp_path, capsys):
  """A --json that passes the check before scoring but fails when written (here /proc, as root;
  elsewhere a full disk): one error line after the table (was an OSError traceback)."""
  ckpt, _, _ = trained
  doc = tmp_path / "doc.txt"
  doc.write_text("The quick brown fox jumps over the lazy dog.")
  code, out, err = run_cli(capsys, "perplexity", f"--checkpoint={ckpt}", f"--data={doc}",
                           "--json=/proc/umoe-test.json")
  assert code == 1 and "token_ppl" in out and "Traceback" not in err, err[-3000:]
  assert err.strip().splitlines()[-1].startswith(
      "error: cannot write --json='/proc/umoe-test.json' ("), err[-3000:]


def test_bad_window_flags_fail_before_the_model_loads(trained, tmp_path, capsys):
  """Flag values that cannot work are named before the corpus is read and the model loaded (a
  base model takes minutes to load); --stride against the default --context once it is known."""
  ckpt, _, _ = trained
  doc = tmp_path / "doc.txt"
  doc.write_text("The quick brown fox jumps over the lazy dog.")
  common = [f"--checkpoint={ckpt}", f"--data={doc}"]
  for argv, message in [
      (["perplexity", *common, "--max_tokens=-5"], "--max_tokens=-5 must be >= 1"),
      (["perplexity", *common, "--context=0"],
       "--context=0 must be >= 1 (tokens per scoring window)"),
      (["attack", *common, "--context=16", "--stride=20"],
       "--stride=20 must be in [1, --context=16]"),
      (["attack", *common, "--rate=1.5"], "--rate=1.5 must be in [0, 1] (the fraction of words "
                                         "substituted)"),
      (["tasks", f"--checkpoint={ckpt}", "--tasks=piqa", "--batch_size=0"],
       "--batch_size=0 must be >= 1"),
      (["perplexity", *common, "--stride=100"],
       "--stride=100 must be in [1, --context=64] (default: the model's max_seq_len)")]:
    code, out, err = run_cli(capsys, *argv)
    assert code == 1 and not out, (argv, err)
    lines = err.strip().splitlines()
    assert lines[-1] == f"error: {message}", (argv, err)
    assert ("--stride=100" in argv) == any(l.startswith("model: ") for l in lines), (argv, err)


# ------------------------------------------------------------------------------------------------
# lm-evaluation-harness adapter


def _lm_eval_tasks(tmp, mc, wino, lam, docs, shots):
  """Custom lm-eval task YAMLs over our local JSONL files (lm-eval's multiple_choice, winogrande-
  style multiple-input, loglikelihood and loglikelihood_rolling outputs). A loglikelihood task gets
  no target delimiter from lm-eval: the space is in its target, as in lm-eval's lambada_openai."""
  d = tmp / "lm_eval_tasks"
  d.mkdir()
  (d / "utils.py").write_text("def gold(doc):\n  return doc['gold']\n\n"
                              "def options(doc):\n  return doc['context_options']\n")
  head = lambda t: (f"num_fewshot: {shots[t]}\ndataset_path: json\ntest_split: test\n"  # noqa
                    "fewshot_split: test\n")
  files = lambda p: f"dataset_kwargs:\n  data_files:\n    test: {p}\n"  # noqa: E731
  (d / "mc.yaml").write_text(
      f"task: umoe_mc\n{head('umoe_mc')}{files(mc)}output_type: multiple_choice\n"
      "doc_to_text: '{{query}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{gold}}'\n"
      "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
  (d / "wino.yaml").write_text(
      f"task: umoe_wino\n{head('umoe_wino')}{files(wino)}output_type: multiple_choice\n"
      "doc_to_text: !function utils.gold\ndoc_to_choice: !function utils.options\n"
      "doc_to_target: '{{continuation}}'\nmetric_list:\n  - metric: acc\n")
  (d / "lam.yaml").write_text(
      f"task: umoe_lam\n{head('umoe_lam')}{files(lam)}output_type: loglikelihood\n"
      "doc_to_text: '{{context}}'\ndoc_to_target: \"{{' ' + continuation}}\"\n"
      "metric_list:\n  - metric: perplexity\n  - metric: acc\n")
  (d / "roll.yaml").write_text(
      f"task: umoe_roll\ndataset_path: json\ntest_split: test\n{files(docs)}"
      "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
      "metric_list:\n  - metric: bits_per_byte\n")
  return str(d)


@pytest.mark.extras("lm_eval")
def test_lm_eval_adapter_matches_our_harness(trained, tmp_path, monkeypatch, capsys):
  for var, value in (("HF_DATASETS_OFFLINE", "1"), ("HF_HUB_OFFLINE", "1"),
                     ("HF_HOME", str(tmp_path / "hf")), ("TOKENIZERS_PARALLELISM", "false")):
    monkeypatch.setenv(var, value)
  import lm_eval
  from lm_eval.tasks import TaskManager
  from umoe_jax.eval import lm_eval_adapter
  ckpt, model, tok = trained
  data_dir = _synthetic_dir(tmp_path)
  rng = np.random.default_rng(0)
  mc = _jsonl(tmp_path / "mc.jsonl", [{"query": f"Is {i} even?", "choices": ["yes", "no", "odd"],
                                       "gold": int(i % 2)} for i in range(6)])
  docs = _jsonl(tmp_path / "docs.jsonl", [{"text": " ".join(rng.choice(["ab", "cd", "e", "fgh"], n))}
                                          for n in (10, 40, 70)])    # 1 to 4 windows of 64
  wino, lam = os.path.join(data_dir, "winogrande.jsonl"), os.path.join(data_dir,
                                                                       "lambada_openai.jsonl")
  shots = {"umoe_mc": 2, "umoe_wino": 1, "umoe_lam": 0, "umoe_roll": 0}
  task_dir = _lm_eval_tasks(tmp_path, mc, wino, lam, docs, shots)
  tm = TaskManager(include_path=task_dir, include_defaults=False)
  res = lm_eval.simple_evaluate(model=lm_eval_adapter.MODEL_NAME, model_args=f"checkpoint={ckpt}",
                                tasks=list(shots), task_manager=tm, batch_size=4,
                                log_samples=True, bootstrap_iters=0)
  # per-item log-likelihoods: lm-eval's prompts through the adapter == our prompts, our scorer
  scorer = Scorer(model, batch_size=4)
  for task, path, kind in (("umoe_mc", mc, "multiple_choice"), ("umoe_wino", wino, "schema"),
                           ("umoe_lam", lam, "lm")):
    ours_docs = tasks_lib.read_jsonl(path, kind)
    pre = fewshot.fewshot_prefixes(ours_docs, shots[task])
    samples = sorted(res["samples"][task], key=lambda s: s["doc_id"])
    theirs = [np.array([r[0] for r in s["filtered_resps"]]) if kind != "lm" else
              np.array([s["filtered_resps"][0][0]]) for s in samples]
    ours = [scorer.loglikelihood(encode_requests(tok, d.requests(p)))[0]
            for d, p in zip(ours_docs, pre)]
    assert len(theirs) == len(ours)
    for a, b in zip(theirs, ours):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    metrics = harness.evaluate_spec(scorer, tok, taskspec.TaskSpec(task, kind, path,
                                                                   num_fewshot=shots[task]))[task]
    got = res["results"][task]
    assert math.isclose(got["acc,none"], metrics["acc"], abs_tol=1e-9), task
    if kind == "multiple_choice":
      assert math.isclose(got["acc_norm,none"], metrics["acc_norm"], abs_tol=1e-9)
    if kind == "lm":
      assert math.isclose(got["perplexity,none"], metrics["ppl"], rel_tol=1e-4)
  texts = [json.loads(line)["text"] for line in open(docs)]
  ppl = corpus_ppl.corpus_perplexity(scorer, tok, texts)
  assert math.isclose(res["results"]["umoe_roll"]["bits_per_byte,none"], ppl["bits_per_byte"],
                      rel_tol=1e-4)

  # lm-eval's own command line, through `python -m umoe_jax.eval lm-eval`
  code, table, err = run_cli(capsys, "lm-eval", "--model", "umoe_jax", "--model_args",
                             f"checkpoint={ckpt}", "--tasks", "umoe_mc", "--include_path", task_dir,
                             "--batch_size", "4", "--output_path", tmp_path / "lm_eval_out")
  assert code == 0 and "umoe_mc" in table, err[-3000:]
  [out_file] = list((tmp_path / "lm_eval_out").glob("**/results_*.json"))
  assert json.loads(out_file.read_text())["results"]["umoe_mc"]["acc,none"] == \
      res["results"]["umoe_mc"]["acc,none"]
  # ... and our model's bad input there: one error line (was a LoadError traceback).
  code, out, err = run_cli(capsys, "lm-eval", "--model", "umoe_jax", "--model_args",
                           f"checkpoint={tmp_path}/missing", "--tasks", "umoe_mc", "--include_path",
                           task_dir)
  assert code == 1 and "Traceback" not in err, err[-3000:]
  assert err.strip().splitlines()[-1] == f"error: checkpoint '{tmp_path}/missing': no such directory"
  # A built-in task whose data lm-eval downloads, with no Hub to reach: one line (was datasets'
  # ConnectionError traceback).
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  code, out, err = run_cli(capsys, "lm-eval", "--model", "umoe_jax", "--model_args",
                           f"checkpoint={ckpt}", "--tasks", "hellaswag", "--limit", "2")
  assert code == 1 and "Traceback" not in err, err[-3000:]
  assert re.match(r"error: Couldn't reach '\S*hellaswag' on the Hub .*: lm-eval's built-in tasks "
                  r"download their data", err.strip().splitlines()[-1]), err[-3000:]

  # generate_until: greedy decoding of our decode loop, cut at the stop string
  from lm_eval.api.instance import Instance
  from umoe_jax.model.decode import generate
  lm = lm_eval_adapter.UMoELM.from_model(model, tok, batch_size=2)
  reqs = [Instance("generate_until", {}, (c, {"until": ["e"], "max_gen_toks": 6}), 0)
          for c in ("The cat", "A")]
  outs = lm.generate_until(reqs)
  for (c, _), o in zip([r.args for r in reqs], outs):
    full = tok.decode(generate(model, [tok.encode(c)], max_new_tokens=6,
                               eos_id=tok.eos_id).sequences()[0])
    assert o == full.split("e", 1)[0] and "e" not in o


@pytest.mark.extras("lm_eval")
def test_lm_eval_model_args_batch_size_wins(trained, tmp_path, monkeypatch, capsys):
  """batch_size in --model_args (documented there) beside lm-eval's own --batch_size, which always
  has a value: the model's wins (it was a TypeError traceback, 'multiple values for keyword');
  an unknown task name is one error line."""
  from umoe_jax.eval import lm_eval_adapter
  ckpt, _, _ = trained
  lm = lm_eval_adapter.UMoELM.create_from_arg_string(
      f"checkpoint={ckpt},batch_size=3", {"batch_size": 1, "max_batch_size": None, "device": None})
  assert lm.batch_size == lm.scorer.batch_size == 3
  lm = lm_eval_adapter.UMoELM.create_from_arg_string(f"checkpoint={ckpt}", {"batch_size": "5"})
  assert lm.batch_size == 5
  # Through lm-eval's CLI, on a local task.
  mc = _jsonl(tmp_path / "mc.jsonl", [{"query": f"Is {i} even?", "choices": ["yes", "no"],
                                       "gold": int(i % 2)} for i in range(4)])
  (tmp_path / "mc.yaml").write_text(
      f"task: umoe_bs\ndataset_path: json\ntest_split: test\ndataset_kwargs:\n  data_files:\n"
      f"    test: {mc}\noutput_type: multiple_choice\ndoc_to_text: '{{{{query}}}}'\n"
      "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{gold}}'\nmetric_list:\n  - metric: acc\n")
  for var, value in (("HF_DATASETS_OFFLINE", "1"), ("HF_HUB_OFFLINE", "1"),
                     ("HF_HOME", str(tmp_path / "hf"))):
    monkeypatch.setenv(var, value)
  code, out, err = run_cli(capsys, "lm-eval", "--model", "umoe_jax", "--model_args",
                           f"checkpoint={ckpt},batch_size=2", "--tasks", "umoe_bs",
                           "--include_path", tmp_path)
  assert code == 0 and "umoe_bs" in out, err[-3000:]
  # A task name lm-eval does not know: one error line (was lm-eval's ValueError traceback).
  code, out, err = run_cli(capsys, "lm-eval", "--model", "umoe_jax", "--model_args",
                           f"checkpoint={ckpt}", "--tasks", "umoe_bz", "--include_path", tmp_path)
  assert code == 1 and "Traceback" not in err, err[-3000:]
  assert err.strip().splitlines()[-1].startswith("error: Tasks not found: umoe_bz"), err[-3000:]


@pytest.mark.extras("lm_eval")
def test_lm_eval_cli_turns_only_the_kernels_shadow_into_one_line(monkeypatch, capsys):
  """The repository's kernels/ standing in for Hugging Face's `kernels` (its own ImportError, or
  that error wrapped as transformers 4 wraps a failed import) is one "error:" line and status 1;
  any other ImportError or RuntimeError stays a traceback (a bug or a broken install, not bad input).
  tests/test_export_lm_eval.py runs the real case, `--model hf` in the repository root."""
  import lm_eval.__main__
  with pytest.raises(ImportError) as info:
    from kernels import LayerRepository  # noqa: F401  (the first name transformers imports)
  shadow = info.value
  assert shadow.path == os.path.join(ROOT, "kernels", "__init__.py")

  def raising(error: BaseException, cause: BaseException | None = None):
    def cli_evaluate():
      raise error from cause
    return cli_evaluate

  wrapped = RuntimeError("Failed to import transformers.activations")
  for fails in (raising(shadow), raising(wrapped, shadow)):
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", fails)
    code, out, err = run_cli(capsys, "lm-eval", "--model", "hf")
    assert code == 1 and err == f"error: {shadow}\n" and out == "", err
  for error in (ImportError("No module named 'accelerate'", name="accelerate"),
                RuntimeError("CUDA out of memory")):
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", raising(error))
    with pytest.raises(type(error)) as info:
      cli.main(["lm-eval", "--model", "hf"])
    assert info.value is error


@pytest.mark.extras("lm_eval")
def test_lm_eval_cli_hf_pretrained_that_names_no_model_directory(tmp_path, monkeypatch, capsys):
  """`--model hf` (its other names, lm-eval's default model) whose `pretrained=` is a missing local
  path, a file or a directory without config.json: one "error:" line naming it, status 1, before
  lm-eval starts (was transformers' "Unrecognized model in ..." ValueError traceback). A model
  directory, a Hub id (name or org/name) and other models' arguments go on to lm-eval unchanged."""
  import lm_eval.__main__
  calls = []
  monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: calls.append(list(sys.argv)))
  missing, empty, afile = tmp_path / "missing", tmp_path / "no_config", tmp_path / "model.bin"
  empty.mkdir()
  afile.write_bytes(b"\0")
  monkeypatch.chdir(tmp_path)
  cases = [
      (["--model", "hf", "--model_args", f"pretrained={missing}"], missing, "no such directory"),
      (["--model", "hf", "--model_args", f"pretrained={empty},dtype=float32"], empty,
       "no config.json in this directory"),
      (["run", "--model", "hf-auto", "-a", json.dumps({"pretrained": str(afile)})], afile,
       "is a file, not a directory"),
      (["--model_args", "dtype=float32", f"pretrained={missing}"], missing, "no such directory"),
      (["--model", "huggingface", "--model_args", "pretrained=./no_config"], "./no_config",
       "no config.json"),
      (["--model", "hf", "--model_args", "pretrained=nested/missing/dir"], "nested/missing/dir",
       "no such directory")]
  for args, bad, why in cases:
    code, out, err = run_cli(capsys, "lm-eval", *args, "--tasks", "arc_easy")
    assert code == 1 and out == "" and len(err.splitlines()) == 1, (args, err)
    assert err.startswith(f"error: pretrained='{bad}'") and why in err, (args, err)
    assert "umoe_jax.interop export --format=hf" in err and "config.json" in err, err
  assert calls == []

  model = tmp_path / "exported"
  model.mkdir()
  (model / "config.json").write_text("{}")
  for args in (["--model", "hf", "--model_args", f"pretrained={model},trust_remote_code=True"],
               ["--model", "hf", "--model_args", "pretrained=exported"],
               ["--model", "hf", "-a", json.dumps({"pretrained": str(model)})],
               ["--model", "hf", "--model_args", "pretrained=EleutherAI/pythia-14m"],
               ["--model", "hf", "--model_args", "pretrained=gpt2"],
               ["--model", "umoe_jax", "--model_args", f"checkpoint={missing}"],
               ["--config", str(tmp_path / "run.yaml"), "--model_args", f"pretrained={missing}"]):
    calls.clear()
    code, out, err = run_cli(capsys, "lm-eval", *args, "--tasks", "arc_easy")
    assert code == 0 and err == "" and calls == [["lm-eval", *args, "--tasks", "arc_easy"]], args


@pytest.mark.extras("lm_eval")
def test_lm_eval_cli_unknown_model_or_bad_umoe_config_is_one_line(monkeypatch, capsys):
  """A --model name lm-eval does not know (lm-eval's registry ValueError) and our adapter's config=
  naming no file (a ConfigError) are one "error:" line each, status 1 (were tracebacks); the
  adapter's missing checkpoint= is covered in test_lm_eval_adapter_matches_our_harness."""
  import lm_eval.__main__
  from lm_eval.api.registry import get_model
  from umoe_jax.eval import lm_eval_adapter

  monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: get_model("umoe"))
  code, out, err = run_cli(capsys, "lm-eval", "--model", "umoe", "--tasks", "arc_easy")
  assert code == 1 and len(err.splitlines()) == 1, err
  assert err.startswith("error: Attempted to load model 'umoe'") and "umoe_jax" in err, err

  monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: lm_eval_adapter.UMoELM.
                      create_from_arg_string("config=/no/such/umoe.py"))
  code, out, err = run_cli(capsys, "lm-eval", "--model", "umoe_jax", "--tasks", "arc_easy")
  assert code == 1 and err == "error: zoo config /no/such/umoe.py: no such file\n", err
