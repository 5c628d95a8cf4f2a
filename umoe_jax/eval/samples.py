"""Per-item results of task scoring (`--log_samples`): one JSON object per item, as scored.

    records = []
    harness.score_all(scorer, tokenizer, specs, prepared, samples=records)
    output.write_jsonl("samples.jsonl", records)

Each record (lm-evaluation-harness's `--log_samples` carries the same facts):
  task             the result name it counts in (an MMLU subject: "mmlu_<subject>", with "subject"
                   and "category")
  doc_id           the item's index in its file (subject), 0-based
  kind             multiple_choice | schema | lm (RACE and MMLU items are multiple_choice)
  requests         [[context, continuation], ...] exactly as scored: few-shot examples and
                   description included, the continuation with its leading delimiter
  loglikelihoods   log p(continuation | context) of each request, nats
  greedy           whether every continuation token of each request is the model's argmax
  multiple_choice  gold, prediction (argmax of loglikelihoods), acc (0/1); prediction_norm (argmax
                   of loglikelihood / characters of the choice, lm-eval's acc_norm), acc_norm
  schema           gold, prediction, acc (the continuation is scored after each context option)
  lm               acc (= greedy[0]: the continuation is the greedy one)
Aggregated, they give the reported metrics: acc and acc_norm are the means of the items' 0/1,
lm's ppl is exp(-mean of loglikelihoods), MMLU's categories and overall pool their subjects' items.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def item_records(kind: str, docs: Sequence, requests: Sequence[Sequence[tuple[str, str]]],
                 ll: Sequence[np.ndarray], greedy: Sequence[np.ndarray]) -> list[dict]:
  """One record per doc (module docstring, without "task"): `requests[i]`, `ll[i]` and
  `greedy[i]` are doc i's requests and their scores."""
  out = []
  for i, (doc, reqs, l, g) in enumerate(zip(docs, requests, ll, greedy)):
    l = np.asarray(l, np.float64)
    rec = {"doc_id": i, "kind": kind, "requests": [list(r) for r in reqs],
           "loglikelihoods": [float(x) for x in l], "greedy": [bool(x) for x in g]}
    if kind == "lm":
      rec["acc"] = int(bool(g[0]))
    else:
      pred = int(np.argmax(l))   # ties: the first, as the aggregate metrics
      rec.update(gold=doc.gold, prediction=pred, acc=int(pred == doc.gold))
      if kind == "multiple_choice":
        chars = np.maximum(np.array([len(c) for c in doc.choices], np.float64), 1)
        norm = int(np.argmax(l / chars))
        rec.update(prediction_norm=norm, acc_norm=int(norm == doc.gold))
    out.append(rec)
  return out
