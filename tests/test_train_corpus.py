"""The tiny UMoE learns real text: linux-docs (parquet, FineWeb-Edu layout) with the GPT-2 tokenizer.

Needs `<repo>/../shared/data` (skipped in a fresh clone without it).
"""
from __future__ import annotations

import json
import os

import pytest

from test_train import small_config
from umoe_jax.train import loop

SHARED = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                      "shared", "data")
CORPUS = os.path.join(SHARED, "corpora", "linux-docs")
GPT2 = os.path.join(SHARED, "tokenizers", "gpt2", "tokenizer.json")

pytestmark = pytest.mark.skipif(
    not (os.path.isdir(CORPUS) and os.path.isfile(GPT2)),
    reason=f"shared data not found at {SHARED} (a fresh clone without ../shared)")


def test_tiny_umoe_learns_linux_docs(tmp_path):
  cfg = small_config(seq_len=64, global_batch_size=8, num_steps=40, learning_rate=1e-2,
                     warmup_steps=3, log_every=10, eval_every=20, eval_batches=4)
  cfg.model.vocab_size = 50304  # GPT-2's 50257 ids, padded to a multiple of 64
  cfg.data.update(dict(
      source="parquet",
      train_path=os.path.join(CORPUS, "train-00000-of-00001.parquet"),
      eval_path=os.path.join(CORPUS, "validation-00000-of-00001.parquet"),
      tokenizer=GPT2))
  cfg.checkpoint.every = 1000  # only the final save
  workdir = str(tmp_path / "linux")
  result = loop.run(cfg, workdir)
  assert result["step"] == 40
  evals = {}
  for line in open(os.path.join(workdir, "metrics.jsonl")):
    rec = json.loads(line)
    if "eval/loss" in rec:
      evals[rec["step"]] = rec["eval/loss"]
  assert sorted(evals) == [0, 20, 40]
  assert abs(evals[0] - 10.83) < 0.1  # ~uniform over 50304 ids at init: ln(50304) = 10.83
  assert evals[20] < evals[0] - 1.0
  assert evals[40] < evals[0] - 2.0, evals  # measured: 10.83 -> 7.7
