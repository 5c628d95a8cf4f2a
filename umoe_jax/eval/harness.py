"""Zero-shot evaluation by log-likelihood scoring (HellaSwag, PIQA, ARC-E/C, WinoGrande, LAMBADA).

    python -m umoe_jax.eval.harness --checkpoint=DIR --tasks=arc_easy,piqa [--limit=N]
        [--data_dir=../shared/data/eval] [--batch_size=16] [--tokenizer=...] [--json=out.json]

    scorer = Scorer(model, batch_size=16)
    ll, greedy = scorer.loglikelihood([(ctx_ids, cont_ids), ...])   # float64 [N], bool [N]
    results = evaluate(model, tokenizer, ["arc_easy", "winogrande"], limit=100)

Scoring one request (context tokens c, continuation tokens x):
  * the sequence c + x is cut to its last max_seq_len + 1 tokens (contexts truncated from the left),
    inputs = seq[:-1], targets = seq[1:]; the log-likelihood is the sum of log p(target) over the
    len(x) continuation targets, and `greedy` says whether every one of them is the argmax.
  * A continuation longer than max_seq_len (rare: long choices under a byte tokenizer) is scored in
    windows, last first: each scores up to max_seq_len targets after as many preceding tokens as fit
    (`windows`); their log-likelihoods add up, greedy is all of theirs.
  * Windows are sorted by length (longest first), batched `batch_size` at a time, right-padded to the
    smallest bucket length (powers of two from 32, and max_seq_len) that fits the batch, and the batch
    is padded with empty rows to `batch_size`: one compiled forward per bucket, at most ~log2(T/32)+1.
    Right padding never changes the real tokens (causal attention, per-token dropless routing).

Metrics (as lm-evaluation-harness computes them):
  multiple_choice  acc = argmax_i ll_i == gold; acc_norm = argmax_i ll_i / len(choice_i in characters) == gold
  schema           acc = argmax over context options of ll(continuation | option) == gold
  lm               acc = every continuation token greedy; ppl = exp(-mean over items of ll)
  *_stderr is the standard error of the mean over items.

Memory: a batch materialises float32 logits [batch_size, bucket, V]; lower --batch_size for big V.
"""
from __future__ import annotations

import functools
import json
import math
import sys
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from umoe_jax.eval import tasks as tasks_lib

Request = tuple[Sequence[int], Sequence[int]]   # (context token ids, continuation token ids)


def bucket_lengths(max_seq_len: int, smallest: int = 32) -> tuple[int, ...]:
  """Padded sequence lengths: powers of two from `smallest` below max_seq_len, then max_seq_len."""
  out, n = [], smallest
  while n < max_seq_len:
    out.append(n)
    n *= 2
  return tuple(out) + (max_seq_len,)


def encode_requests(tokenizer, pairs: Sequence[tuple[str, str]],
                    bos_id: Optional[int] = None) -> list[tuple[list[int], list[int]]]:
  """(context, continuation) strings -> token ids, each part encoded on its own.

  `bos_id` is put before every context; an empty context (and no BOS) becomes [eos_id].
  """
  out = []
  for context, continuation in pairs:
    ctx = ([bos_id] if bos_id is not None else []) + list(tokenizer.encode(context))
    cont = list(tokenizer.encode(continuation))
    if not cont:
      raise ValueError(f"continuation {continuation!r} encodes to no tokens")
    out.append((ctx or [tokenizer.eos_id], cont))
  return out


Window = tuple[list[int], list[int], int]   # (inputs, targets, number of scored targets at the end)


def windows(context: Sequence[int], continuation: Sequence[int], max_seq_len: int) -> list[Window]:
  """The forward windows that score `continuation` after `context` (one unless the continuation is
  longer than max_seq_len): inputs [n] and targets [n] (n <= max_seq_len), the last k targets scored."""
  seq, c = list(context) + list(continuation), len(context)
  out, end = [], len(seq)                  # score targets seq[start:end] from inputs seq[a:end - 1]
  while end > c:
    a = max(0, end - 1 - max_seq_len)
    start = max(c, a + 1)
    out.append((seq[a:end - 1], seq[a + 1:end], end - start))
    end = start
  return out


def pack(batch: Sequence[Window], length: int, batch_size: int):
  """Windows -> (tokens, targets int32 [batch_size, length], mask bool [batch_size, length]).

  Row i holds window i right-padded with 0; mask marks its scored targets. Rows past len(batch) are
  all padding (mask False).
  """
  tokens = np.zeros((batch_size, length), np.int32)
  targets = np.zeros((batch_size, length), np.int32)
  mask = np.zeros((batch_size, length), bool)
  for i, (inputs, tgt, k) in enumerate(batch):
    n = len(inputs)
    if n > length:
      raise ValueError(f"window of {n} input tokens does not fit length {length}")
    tokens[i, :n] = inputs
    targets[i, :n] = tgt
    mask[i, n - k:n] = True
  return tokens, targets, mask


@functools.lru_cache(maxsize=8)
def _score_fn(graphdef):
  """Jitted (state, tokens, targets, mask [B, L]) -> (ll float32 [B], greedy bool [B])."""

  @jax.jit
  def score(state, tokens, targets, mask):
    logits, _ = nnx.merge(graphdef, state)(tokens)                                # [B, L, V] f32
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    logp = target_logit - jax.nn.logsumexp(logits, axis=-1)                       # [B, L]
    ll = jnp.sum(jnp.where(mask, logp, 0.0), axis=-1)
    greedy = jnp.all((jnp.argmax(logits, axis=-1) == targets) | ~mask, axis=-1)
    return ll, greedy

  return score


class Scorer:
  """Batched log-likelihoods of continuations under a CausalLM (see the module docstring)."""

  def __init__(self, model: nnx.Module, batch_size: int = 16,
               buckets: Optional[Sequence[int]] = None):
    if batch_size < 1:
      raise ValueError(f"batch_size={batch_size} must be >= 1")
    self.max_seq_len = model.cfg.max_seq_len
    self.batch_size = batch_size
    self.buckets = tuple(sorted(buckets)) if buckets else bucket_lengths(self.max_seq_len)
    if self.buckets[-1] < self.max_seq_len:
      self.buckets += (self.max_seq_len,)
    if self.buckets[-1] > self.max_seq_len:
      raise ValueError(f"bucket {self.buckets[-1]} exceeds max_seq_len={self.max_seq_len}")
    self.graphdef, self.state = nnx.split(model)
    self._score = _score_fn(self.graphdef)

  def _bucket(self, n: int) -> int:
    return next(b for b in self.buckets if b >= n)

  def loglikelihood(self, requests: Sequence[Request]) -> tuple[np.ndarray, np.ndarray]:
    """(ll float64 [N], greedy bool [N]) of every request's continuation, in request order."""
    owner, wins = [], []
    for i, (ctx, cont) in enumerate(requests):
      if not ctx or not cont:
        raise ValueError("every request needs at least one context and one continuation token")
      for w in windows(ctx, cont, self.max_seq_len):
        owner.append(i)
        wins.append(w)
    order = sorted(range(len(wins)), key=lambda j: -len(wins[j][0]))
    ll, greedy = np.zeros(len(requests)), np.ones(len(requests), bool)
    for start in range(0, len(order), self.batch_size):
      idx = order[start:start + self.batch_size]
      batch = pack([wins[j] for j in idx], self._bucket(len(wins[idx[0]][0])), self.batch_size)
      out_ll, out_greedy = self._score(self.state, *map(jnp.asarray, batch))
      who = np.asarray([owner[j] for j in idx])
      np.add.at(ll, who, np.asarray(out_ll, np.float64)[:len(idx)])
      np.logical_and.at(greedy, who, np.asarray(out_greedy)[:len(idx)])
    return ll, greedy


# ------------------------------------------------------------------------------------------------
# Metrics


def _mean_stderr(x: np.ndarray) -> tuple[float, Optional[float]]:
  """(mean, standard error of the mean; None for a single item)."""
  x = np.asarray(x, np.float64)
  err = float(np.std(x, ddof=1) / math.sqrt(len(x))) if len(x) > 1 else None
  return float(np.mean(x)), err


def choice_metrics(ll: Sequence[np.ndarray], gold: Sequence[int],
                   choice_chars: Optional[Sequence[Sequence[int]]] = None) -> dict:
  """Per-item choice log-likelihoods -> {"acc", "acc_stderr"[, "acc_norm", "acc_norm_stderr"], "n"}.

  `choice_chars`: characters of each choice (acc_norm divides ll by them); None: acc only.
  Ties go to the first choice.
  """
  hits = np.array([int(np.argmax(l)) == g for l, g in zip(ll, gold)])
  out = dict(zip(("acc", "acc_stderr"), _mean_stderr(hits)))
  if choice_chars is not None:
    norm = np.array([int(np.argmax(np.asarray(l) / np.maximum(np.asarray(c, np.float64), 1))) == g
                     for l, c, g in zip(ll, choice_chars, gold)])
    out.update(zip(("acc_norm", "acc_norm_stderr"), _mean_stderr(norm)))
  out["n"] = len(hits)
  return out


def evaluate_docs(scorer: Scorer, tokenizer, kind: str, docs: Sequence[tasks_lib.Doc],
                  bos_id: Optional[int] = None) -> dict:
  """Metrics of one task's documents (kind: "multiple_choice", "schema" or "lm")."""
  pairs = [p for d in docs for p in d.requests()]
  ll, greedy = scorer.loglikelihood(encode_requests(tokenizer, pairs, bos_id))
  if kind == "lm":
    acc, acc_err = _mean_stderr(greedy)
    return {"acc": acc, "acc_stderr": acc_err, "ppl": math.exp(min(-float(np.mean(ll)), 700.0)),
            "n": len(docs)}
  splits = np.cumsum([len(d.requests()) for d in docs])[:-1]
  per_doc = np.split(ll, splits)
  gold = [d.gold for d in docs]
  if kind == "multiple_choice":
    return choice_metrics(per_doc, gold, [[len(c) for c in d.choices] for d in docs])
  if kind == "schema":
    return choice_metrics(per_doc, gold)
  raise ValueError(f"unknown task kind {kind!r}")


def evaluate(model: nnx.Module, tokenizer, task_names: Sequence[str], *,
             data_dir: str = tasks_lib.DEFAULT_DATA_DIR, limit: Optional[int] = None,
             batch_size: int = 16, bos_id: Optional[int] = None, log=None) -> dict[str, dict]:
  """{task: metrics} for every task, reading `data_dir`; `log(str)` gets one line per task."""
  scorer = Scorer(model, batch_size=batch_size)
  results = {}
  for name in task_names:
    name = tasks_lib.resolve_task(name)
    t0 = time.perf_counter()
    docs = tasks_lib.load_task(name, data_dir, limit)
    results[name] = evaluate_docs(scorer, tokenizer, tasks_lib.task_kind(name), docs, bos_id)
    results[name]["seconds"] = round(time.perf_counter() - t0, 2)
    if log:
      log(f"{name}: {len(docs)} items in {results[name]['seconds']:.1f} s")
  return results


def format_table(results: dict[str, dict]) -> str:
  """One row per (task, metric): | task | n | metric | value | stderr |."""
  rows = [("task", "n", "metric", "value", "stderr")]
  for name, m in results.items():
    for key in ("acc", "acc_norm", "ppl"):
      if key in m:
        err = m.get(f"{key}_stderr")
        rows.append((name, str(m["n"]), key, f"{m[key]:.4f}" if m[key] < 1e6 else f"{m[key]:.4e}",
                     "" if err is None else f"{err:.4f}"))
  widths = [max(len(r[i]) for r in rows) for i in range(5)]
  lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
  lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
  return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# CLI


def _tokenizer_spec(flag: Optional[str], saved: Optional[dict], config) -> tuple[str, str]:
  """--tokenizer, else the checkpoint's (or --config's) data.tokenizer, else "byte"."""
  if flag:
    return flag, ""
  for source in (saved, config.to_dict() if config is not None else None):
    data = (source or {}).get("data") or {}
    if data.get("tokenizer"):
      return data["tokenizer"], data.get("eos_token", "") or ""
  return "byte", ""


def _define_flags():
  from absl import flags
  from ml_collections import config_flags
  config_flags.DEFINE_config_file("config", None, "Experiment config (configs/*.py): used when the "
                                  "checkpoint has no config.json, or without --checkpoint (random).")
  flags.DEFINE_string("checkpoint", None, "Training workdir or converted checkpoint directory.")
  flags.DEFINE_string("tasks", ",".join(tasks_lib.TASKS), "Comma-separated tasks: "
                      + ", ".join(tasks_lib.TASKS) + ".")
  flags.DEFINE_string("data_dir", tasks_lib.DEFAULT_DATA_DIR, "Directory of the eval JSONL files.")
  flags.DEFINE_integer("limit", None, "Evaluate only the first N items of each task.")
  flags.DEFINE_integer("batch_size", 16, "Requests per forward pass.")
  flags.DEFINE_string("tokenizer", None, '"byte" or a tokenizer.json (default: the config\'s '
                      "data.tokenizer, else byte).")
  flags.DEFINE_integer("bos_id", None, "Token id put before every context (1 for Llama-2).")
  flags.DEFINE_string("json", None, "Also write the results to this JSON file.")
  flags.DEFINE_string("compute_dtype", "float32", 'Compute dtype ("" = keep the config\'s).')
  flags.DEFINE_integer("seed", 0, "Init seed without a checkpoint.")
  return flags.FLAGS


def main(argv) -> int:
  """The CLI (flags from `_define_flags`); prints the table, optionally writes --json."""
  from absl import flags

  from umoe_jax.data.tokenizer import check_vocab, make_tokenizer
  from umoe_jax.model.decode import load_model

  if len(argv) > 1:
    raise SystemExit(f"unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  if f.checkpoint is None and f.config is None:
    raise SystemExit("give --checkpoint=DIR, or --config=configs/<model>.py for random parameters")
  names = [tasks_lib.resolve_task(t) for t in f.tasks.split(",") if t.strip()]
  model, model_section, saved = load_model(f.checkpoint, f.config, seed=f.seed,
                                           compute_dtype=f.compute_dtype or None)
  spec, eos_token = _tokenizer_spec(f.tokenizer, saved, f.config)
  tokenizer = make_tokenizer(spec, eos_token)
  check_vocab(tokenizer, model_section.vocab_size)
  log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
  log(f"model: {f.checkpoint or '(random parameters)'}; tokenizer: {spec}; tasks: {', '.join(names)}")
  results = evaluate(model, tokenizer, names, data_dir=f.data_dir, limit=f.limit,
                     batch_size=f.batch_size, bos_id=f.bos_id, log=log)
  print(format_table(results))
  if f.json:
    with open(f.json, "w") as out:
      json.dump({"checkpoint": f.checkpoint, "tokenizer": spec, "limit": f.limit,
                 "results": results}, out, indent=2)
  return 0


if __name__ == "__main__":
  from absl import app
  _define_flags()
  app.run(main)
