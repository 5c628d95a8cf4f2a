"""Evaluation speed: a 2,000-item multiple-choice task scored by the harness on a random model.

Scores the first --limit items of a task (default HellaSwag validation, 4 choices an item: 8,000
requests) exactly as `python -m umoe_jax.eval tasks` does (encode, window, sort by length, pad to a
bucket, one jitted forward per batch, metrics), on randomly initialised parameters of --config
(default UMoE-base) with the GPT-2 tokenizer (model.vocab_size set to --vocab_size=50304). Two
passes: the first includes compilation, the second reuses every compiled bucket. Prints seconds,
items/s, requests/s, compiles, the padding overhead and (as a sanity check on the numbers, not a
score) the accuracy of the random model, about 1/4.

  python3 bench/eval_speed.py                                            # GPU: UMoE-base
  python3 bench/eval_speed.py --config=configs/umoe_tiny.py --limit=50   # CPU check
  python3 bench/eval_speed.py --task=arc_easy --batch_size=64 --out=$OUT
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import numpy as np  # noqa: E402

SHARED = os.path.join(os.path.dirname(ROOT), "shared", "data")


def log(*a):
  print(*a, flush=True)


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", default=os.path.join(ROOT, "configs", "umoe_base.py"))
  p.add_argument("--task", default="hellaswag", help="a known task name (umoe_jax.eval.tasks)")
  p.add_argument("--data_dir", default=os.path.join(SHARED, "eval"))
  p.add_argument("--limit", type=int, default=2000)
  p.add_argument("--batch_size", type=int, default=32)
  p.add_argument("--tokenizer", default=os.path.join(SHARED, "tokenizers", "gpt2", "tokenizer.json"))
  p.add_argument("--vocab_size", type=int, default=50304)
  p.add_argument("--compute_dtype", default="bfloat16")
  p.add_argument("--passes", type=int, default=2)
  p.add_argument("--out", default=None, help="directory for eval_speed.json")
  args = p.parse_args()

  from umoe_jax import stats
  from umoe_jax.eval import harness, scoring
  from umoe_jax.eval import tasks as tasks_lib
  from umoe_jax.load import load_model_and_tokenizer

  config = stats.load_config_file(args.config)
  with config.unlocked():
    config.model.vocab_size = args.vocab_size
  model, tok, info = load_model_and_tokenizer(config=config, tokenizer=args.tokenizer,
                                              compute_dtype=args.compute_dtype)
  name = tasks_lib.resolve_task(args.task)
  kind = tasks_lib.task_kind(name)
  docs = tasks_lib.load_task(name, args.data_dir, args.limit)
  scorer = scoring.Scorer(model, batch_size=args.batch_size)

  # The batching plan (what the scorer will pad), for the padding overhead.
  t0 = time.perf_counter()
  pairs = [r for d in docs for r in d.requests()]
  requests = scoring.encode_requests(tok, pairs)
  encode_s = time.perf_counter() - t0
  lengths = sorted((len(w[0]) for c, x in requests
                    for w in scoring.windows(c, x, scorer.max_seq_len)), reverse=True)
  padded = sum(scorer.bucket(lengths[i]) * args.batch_size
               for i in range(0, len(lengths), args.batch_size))
  buckets = sorted({scorer.bucket(lengths[i]) for i in range(0, len(lengths), args.batch_size)})
  log(f"device: {jax.devices()[0].device_kind}; config {os.path.basename(args.config)} "
      f"({info['model']}); task {name}: {len(docs)} items, {len(requests)} requests, "
      f"{sum(lengths):,} tokens, padded to {padded:,} ({padded / sum(lengths):.2f}x) in "
      f"{-(-len(lengths) // args.batch_size)} batches of {args.batch_size}, buckets {buckets}")

  runs = []
  for i in range(args.passes):
    before = scoring.compile_count()
    t0 = time.perf_counter()
    metrics = harness.evaluate_docs(scorer, tok, kind, docs)
    seconds = time.perf_counter() - t0
    runs.append(dict(seconds=seconds, compiles=scoring.compile_count() - before,
                     items_per_s=len(docs) / seconds, requests_per_s=len(requests) / seconds))
    log(f"pass {i + 1}: {seconds:.2f} s, {len(docs) / seconds:.1f} items/s, "
        f"{len(requests) / seconds:.1f} requests/s, {runs[-1]['compiles']} compiles; "
        f"acc {metrics['acc']:.3f} (random model)")
  result = dict(device=jax.devices()[0].device_kind, config=args.config, task=name,
                items=len(docs), requests=len(requests), tokens=sum(lengths), padded_tokens=padded,
                buckets=buckets, batch_size=args.batch_size, compute_dtype=args.compute_dtype,
                encode_s=encode_s, passes=runs)
  log("\n| pass | seconds | items/s | requests/s | compiles |\n|--:|--:|--:|--:|--:|")
  for i, r in enumerate(runs):
    log(f"| {i + 1} | {r['seconds']:.2f} | {r['items_per_s']:.1f} | {r['requests_per_s']:.1f} | "
        f"{r['compiles']} |")
  if not np.isfinite(metrics["acc"]):
    raise SystemExit("non-finite accuracy")
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "eval_speed.json"), "w") as f:
      json.dump(result, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
