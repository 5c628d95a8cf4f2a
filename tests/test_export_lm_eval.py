"""lm-evaluation-harness's `hf` backend on an exported directory scores as `python -m umoe_jax.eval
lm-eval` on the checkpoint: the same task scores (to 1e-4) and the same per-item log-likelihoods.

A random UMoE model (routers peaked, as in tests/test_export_hf.py) with the GPT-2 tokenizer is saved
as a checkpoint and exported with `--format=hf`. Both runs use lm-eval's own command line on the same
local task YAMLs over real eval rows (../shared/data/eval): multiple choice with acc / acc_norm and
few-shot prompts, a winogrande-style multiple-input task, a LAMBADA-style loglikelihood task and a
rolling-loglikelihood task whose documents span several windows of the model's 128 positions. Ours
runs in-process (`python -m umoe_jax.eval lm-eval --model umoe_jax`); the `hf` backend (`lm-eval run
--model hf --model_args pretrained=DIR,trust_remote_code=True`) in a process started outside the
repository, as a user runs it (the repository root on sys.path shadows the `kernels` distribution
that transformers imports; docs/interop.md).
"""
from __future__ import annotations

import glob
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT
from test_eval_cli import _lm_eval_tasks
from test_export_hf import model_config, peaked
from umoe_jax.eval import cli
from umoe_jax.interop import official
from umoe_jax.interop.__main__ import main as interop_main
from umoe_jax.model.lm import build_model

pytestmark = pytest.mark.extras("torch", "transformers", "lm_eval")

SHARED = os.path.join(os.path.dirname(ROOT), "shared", "data")
GPT2 = os.path.join(SHARED, "tokenizers", "gpt2", "tokenizer.json")
SHOTS = {"umoe_mc": 2, "umoe_wino": 1, "umoe_lam": 0, "umoe_roll": 0}
ROWS = 16


def _head(src: str, dst, n: int) -> str:
  with open(src) as f:
    lines = [next(f) for _ in range(n)]
  dst.write_text("".join(lines))
  return str(dst)


def _results(out_dir) -> tuple[dict, dict]:
  """(results of the one results_*.json under out_dir, {task: samples sorted by doc_id})."""
  [path] = glob.glob(os.path.join(out_dir, "**", "results_*.json"), recursive=True)
  with open(path) as f:
    results = json.load(f)["results"]
  samples = {}
  for task in SHOTS:
    [path] = glob.glob(os.path.join(out_dir, "**", f"samples_{task}_*.jsonl"), recursive=True)
    with open(path) as f:
      samples[task] = sorted((json.loads(line) for line in f), key=lambda s: s["doc_id"])
  return results, samples


def _loglikelihoods(sample: dict) -> np.ndarray:
  """The log-likelihoods lm-eval logged for one item (one per choice, or one)."""
  resps = sample["filtered_resps"]
  if not isinstance(resps, list):
    return np.array([float(resps)])
  return np.array([float(r[0]) if isinstance(r, list) else float(r) for r in resps])


@pytest.fixture(scope="module")
def both(tmp_path_factory):
  """(ours, theirs): (results, samples) of the two lm-eval runs."""
  if not os.path.isfile(GPT2) or not os.path.isdir(os.path.join(SHARED, "eval")):
    pytest.skip(f"needs the shared eval sets and GPT-2 tokenizer in {SHARED} (absent in a fresh clone)")
  tmp = tmp_path_factory.mktemp("hf_lm_eval")
  cfg = model_config("umoe")
  cfg.vocab_size, cfg.max_seq_len = 50304, 128
  model = build_model(cfg, seed=11)
  peaked(model)
  ckpt = official.save_converted(model, cfg, str(tmp / "ckpt"))
  with open(os.path.join(ckpt, "config.json")) as f:
    saved = json.load(f)
  saved["data"] = {"tokenizer": GPT2, "eos_token": "<|endoftext|>"}
  with open(os.path.join(ckpt, "config.json"), "w") as f:
    json.dump(saved, f)
  hf_dir = tmp / "hf"
  assert interop_main(["export", f"--checkpoint={ckpt}", f"--out={hf_dir}", "--format=hf"]) == 0

  ev = os.path.join(SHARED, "eval")
  mc = _head(os.path.join(ev, "arc_easy.jsonl"), tmp / "mc.jsonl", ROWS)
  wino = _head(os.path.join(ev, "winogrande.jsonl"), tmp / "wino.jsonl", ROWS)
  lam = _head(os.path.join(ev, "lambada_openai.jsonl"), tmp / "lam.jsonl", ROWS)
  with open(os.path.join(SHARED, "wikitext-2", "wiki.test.raw"), encoding="utf-8") as f:
    paragraphs = [p.strip() for p in f.read().split("\n") if len(p.strip()) > 400][:4]
  (tmp / "docs.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
  task_dir = _lm_eval_tasks(tmp, mc, wino, lam, str(tmp / "docs.jsonl"), SHOTS)

  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  env.update(HF_HOME=str(tmp / "hf_home"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
             TOKENIZERS_PARALLELISM="false")
  common = ["--tasks", ",".join(SHOTS), "--include_path", task_dir, "--batch_size", "8",
            "--log_samples"]
  saved_env = {k: os.environ.get(k) for k in ("HF_HOME", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE",
                                               "TOKENIZERS_PARALLELISM")}
  os.environ.update({k: env[k] for k in saved_env})
  try:
    assert cli.main(["lm-eval", "--model", "umoe_jax", "--model_args", f"checkpoint={ckpt}",
                     "--output_path", str(tmp / "ours"), *common]) == 0
  finally:
    for k, v in saved_env.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
  # lm-eval's own CLI, started in tmp (not the repository root) with no PYTHONPATH: sys.path has
  # neither umoe_jax nor the repository's kernels/.
  done = subprocess.run(
      [sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--model_args",
       f"pretrained={hf_dir},trust_remote_code=True,dtype=float32", "--device", "cpu",
       "--output_path", str(tmp / "theirs"), *common],
      cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-4000:]
  return _results(tmp / "ours"), _results(tmp / "theirs")


METRICS = {"umoe_mc": ("acc", "acc_norm"), "umoe_wino": ("acc",), "umoe_lam": ("acc", "perplexity"),
           "umoe_roll": ("bits_per_byte",)}


@pytest.mark.parametrize("task", list(SHOTS))
def test_hf_backend_scores_equal_ours(both, task):
  (ours, _), (theirs, _) = both
  for metric in METRICS[task]:
    a, b = ours[task][f"{metric},none"], theirs[task][f"{metric},none"]
    assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4), (task, metric, a, b)


@pytest.mark.parametrize("task", list(SHOTS))
def test_hf_backend_item_loglikelihoods_equal_ours(both, task):
  (_, ours), (_, theirs) = both
  assert [s["doc_id"] for s in ours[task]] == [s["doc_id"] for s in theirs[task]]
  assert len(ours[task]) == (ROWS if task != "umoe_roll" else 4)
  for a, b in zip(ours[task], theirs[task]):
    assert a["arguments"] == b["arguments"]   # the same prompts, few-shot examples included
    la, lb = _loglikelihoods(a), _loglikelihoods(b)
    np.testing.assert_allclose(lb, la, rtol=1e-5, atol=1e-4)
  if task == "umoe_mc":   # a random model's choices are not all alike: acc is not decided by ties
    spread = [np.ptp(_loglikelihoods(s)) for s in ours[task]]
    assert min(spread) > 1e-3


def test_hf_backend_started_in_the_repository_root_is_one_error_line(tmp_path):
  """`python -m umoe_jax.eval lm-eval --model hf` from the repository root: transformers' `from
  kernels import ...` finds the repository's kernels/, whose ImportError is the command's one
  "error:" line and status 1, with no traceback before it (docs/interop.md)."""
  cfg = model_config("dense")
  ckpt = official.save_converted(build_model(cfg), cfg, str(tmp_path / "ckpt"))
  hf_dir = tmp_path / "hf"
  assert interop_main(["export", f"--checkpoint={ckpt}", f"--out={hf_dir}", "--format=hf"]) == 0
  rows = tmp_path / "mc.jsonl"
  rows.write_text("".join(json.dumps({"query": f"Is {i} even?", "choices": ["yes", "no"],
                                      "gold": i % 2}) + "\n" for i in range(2)))
  (tmp_path / "mc.yaml").write_text(
      f"task: umoe_root\ndataset_path: json\ntest_split: test\ndataset_kwargs:\n  data_files:\n"
      f"    test: {rows}\noutput_type: multiple_choice\ndoc_to_text: '{{{{query}}}}'\n"
      "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{gold}}'\nmetric_list:\n  - metric: acc\n")
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
  env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
  done = subprocess.run(
      [sys.executable, "-m", "umoe_jax.eval", "lm-eval", "--model", "hf", "--model_args",
       f"pretrained={hf_dir},trust_remote_code=True,dtype=float32", "--device", "cpu",
       "--tasks", "umoe_root", "--include_path", str(tmp_path)],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
  lines = done.stderr.strip().splitlines()
  assert lines[-1].startswith("error: 'kernels' here is umoe-jax's own kernels/ package") and \
      "start Python with -P" in lines[-1], done.stderr[-3000:]
  assert sum("umoe-jax's own kernels/" in line for line in lines) == 1, done.stderr[-3000:]
