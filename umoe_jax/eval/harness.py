"""Task evaluation by log-likelihood scoring (HellaSwag, PIQA, ARC-E/C, WinoGrande, LAMBADA, any JSONL
task file, RACE, MMLU), zero- or few-shot, as lm-evaluation-harness scores them.

    results = evaluate(model, tokenizer, ["arc_easy", "winogrande"], limit=100, num_fewshot=3)
    results = evaluate(model, tokenizer, ["mine=data/q.jsonl:mc", "suite.yaml"])
    metrics = evaluate_docs(Scorer(model), tokenizer, "multiple_choice", docs, prefixes=...)

The CLI is `python -m umoe_jax.eval tasks ...` (`umoe_jax.eval.cli`); `python -m
umoe_jax.eval.harness ...` is the same command. Scoring itself (windows, buckets, batches) is in
`umoe_jax.eval.scoring`; prompts with examples in `umoe_jax.eval.fewshot`; which tasks in
`umoe_jax.eval.taskspec`.

Metrics (as lm-evaluation-harness computes them):
  multiple_choice  acc = argmax_i ll_i == gold;
                   acc_norm = argmax_i ll_i / len(choice_i in characters) == gold
  schema           acc = argmax over context options of ll(continuation | option) == gold
  lm               acc = every continuation token greedy; ppl = exp(-mean over items of ll)
  race             multiple_choice over each article's last question (`umoe_jax.eval.race`)
  mmlu             acc per subject, per category and overall (`umoe_jax.eval.mmlu`)
  *_stderr is the standard error of the mean over items.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Optional, Sequence

import numpy as np
from flax import nnx

from umoe_jax import console, storage
from umoe_jax.eval import fewshot, mmlu, race, samples as samples_lib
from umoe_jax.eval import tasks as tasks_lib
from umoe_jax.eval.errors import EvalError
from umoe_jax.eval.scoring import (Request, Scorer, Window, bucket_lengths,  # noqa: F401 (re-exported)
                                   compile_count, encode_requests, pack, windows)
from umoe_jax.eval.taskspec import TaskSpec, parse_task_list
from umoe_jax.output import fmt, markdown_table

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
                  bos_id: Optional[int] = None, prefixes: Optional[Sequence[str]] = None,
                  progress=None, samples: Optional[list] = None) -> dict:
  """Metrics of one task's documents (kind: "multiple_choice", "schema" or "lm"); `prefixes[i]`
  (few-shot examples, `umoe_jax.eval.fewshot`) goes before every context of docs[i];
  `progress(n)` counts the requests scored (`Scorer.loglikelihood`); `samples`, a list, gets one
  record per document (`umoe_jax.eval.samples`)."""
  prefixes = prefixes if prefixes is not None else [""] * len(docs)
  per_doc_requests = [d.requests(p) for d, p in zip(docs, prefixes)]
  pairs = [r for reqs in per_doc_requests for r in reqs]
  ll, greedy = scorer.loglikelihood(encode_requests(tokenizer, pairs, bos_id), progress)
  if samples is not None:
    cuts = np.cumsum([len(r) for r in per_doc_requests])[:-1]
    samples += samples_lib.item_records(kind, docs, per_doc_requests, np.split(ll, cuts),
                                        np.split(np.asarray(greedy), cuts))
  if kind == "lm":
    acc, acc_err = _mean_stderr(greedy)
    return {"acc": acc, "acc_stderr": acc_err, "ppl": math.exp(min(-float(np.mean(ll)), 700.0)),
            "n": len(docs)}
  splits = np.cumsum([len(r) for r in per_doc_requests])[:-1]
  per_doc = np.split(ll, splits)
  gold = [d.gold for d in docs]
  if kind == "multiple_choice":
    return choice_metrics(per_doc, gold, [[len(c) for c in d.choices] for d in docs])
  if kind == "schema":
    return choice_metrics(per_doc, gold)
  raise EvalError(f"unknown task kind {kind!r}")


# ------------------------------------------------------------------------------------------------
# Tasks


@dataclasses.dataclass
class PreparedTask:
  """One scored unit: items and their prompt prefixes (an MMLU subject is one)."""
  name: str
  kind: str                         # multiple_choice | schema | lm
  docs: list
  prefixes: Optional[list[str]]
  num_fewshot: int
  mmlu_subject: Optional[str] = None


def _read(spec: TaskSpec, path: str, limit: Optional[int]) -> list[tasks_lib.Doc]:
  if not storage.exists(path):
    raise FileNotFoundError(f"task {spec.name!r}: data not found: {path!r}")
  if spec.kind == "race":
    return race.load_race(path, limit)
  return tasks_lib.read_jsonl(path, spec.kind, limit)


def prepare(spec: TaskSpec, *, num_fewshot: int = 0, limit: Optional[int] = None,
            fewshot_seed: int = fewshot.DEFAULT_SEED) -> list[PreparedTask]:
  """Reads a task's items and builds its prompts, without scoring (all input errors surface here).

  The spec's own num_fewshot / limit / fewshot_seed win over the arguments (mmlu: 5-shot from dev,
  first_n, one PreparedTask per subject).
  """
  limit = spec.limit if spec.limit is not None else limit
  if limit is not None and limit < 1:   # else every reader would report an empty file
    raise EvalError(f"task {spec.name!r}: limit={limit} must be >= 1 (--limit, or the task "
                    "spec's limit)")
  seed = spec.fewshot_seed if spec.fewshot_seed is not None else fewshot_seed
  if spec.kind == "mmlu":
    k = spec.num_fewshot if spec.num_fewshot is not None else 5
    out = []
    for subject in mmlu.find_subjects(spec.path, spec.split, spec.subjects):
      docs = mmlu.read_csv(mmlu.subject_file(spec.path, spec.split, subject), limit)
      pool = (mmlu.read_csv(mmlu.subject_file(spec.fewshot_path or spec.path, "dev", subject))
              if k else None)
      prefixes = fewshot.fewshot_prefixes(
          docs, k, pool=pool, exclude_self=False, seed=seed,
          sampler=spec.fewshot_sampler or "first_n",
          description=spec.description or mmlu.description(subject), task=f"{spec.name}_{subject}")
      out.append(PreparedTask(f"{spec.name}_{subject}", "multiple_choice", docs, prefixes, k,
                              mmlu_subject=subject))
    return out
  k = spec.num_fewshot if spec.num_fewshot is not None else num_fewshot
  docs = _read(spec, spec.path, limit)
  prefixes = None
  if k:
    separate = spec.fewshot_path is not None
    pool = _read(spec, spec.fewshot_path if separate else spec.path, None)
    prefixes = fewshot.fewshot_prefixes(docs, k, pool=pool, exclude_self=not separate, seed=seed,
                                        sampler=spec.fewshot_sampler or "random",
                                        description=spec.description, task=spec.name)
  elif spec.description:
    prefixes = [spec.description] * len(docs)
  kind = "multiple_choice" if spec.kind == "race" else spec.kind
  return [PreparedTask(spec.name, kind, docs, prefixes, k)]


def score(scorer: Scorer, tokenizer, spec: TaskSpec, prepared: Sequence[PreparedTask],
          bos_id: Optional[int] = None, progress=None,
          samples: Optional[list] = None) -> dict[str, dict]:
  """{result name: metrics} of one prepared task (mmlu: subjects, categories, overall);
  `progress(n)` counts the requests scored; `samples`, a list, gets every item's record
  (`umoe_jax.eval.samples`)."""
  out = {}
  for p in prepared:
    records = [] if samples is not None else None
    m = evaluate_docs(scorer, tokenizer, p.kind, p.docs, bos_id, p.prefixes, progress, records)
    if records is not None:
      extra = ({"subject": p.mmlu_subject, "category": mmlu.SUBJECTS.get(p.mmlu_subject, "other")}
               if p.mmlu_subject is not None else {})
      samples += [dict(task=p.name, **extra, **r) for r in records]
    if p.mmlu_subject is not None:
      m = {"acc": m["acc"], "acc_stderr": m["acc_stderr"], "n": m["n"],
           "category": mmlu.SUBJECTS.get(p.mmlu_subject, "other")}
    out[p.name] = dict(m, num_fewshot=p.num_fewshot)
  if spec.kind == "mmlu":
    agg = mmlu.aggregate({p.mmlu_subject: out[p.name] for p in prepared})
    k = prepared[0].num_fewshot
    out.update({spec.name + name[len("mmlu"):]: dict(m, num_fewshot=k) for name, m in agg.items()})
  return out


def evaluate_spec(scorer: Scorer, tokenizer, spec: TaskSpec, *, num_fewshot: int = 0,
                  limit: Optional[int] = None, bos_id: Optional[int] = None,
                  fewshot_seed: int = fewshot.DEFAULT_SEED) -> dict[str, dict]:
  """{result name: metrics} of one task (`prepare`, then `score`)."""
  prepared = prepare(spec, num_fewshot=num_fewshot, limit=limit, fewshot_seed=fewshot_seed)
  return score(scorer, tokenizer, spec, prepared, bos_id)


def prepare_all(specs: Sequence[TaskSpec], **kw) -> list[list[PreparedTask]]:
  """`prepare` of every task (keyword arguments as `prepare`)."""
  return [prepare(s, **kw) for s in specs]


def score_all(scorer: Scorer, tokenizer, specs: Sequence[TaskSpec],
              prepared: Sequence[Sequence[PreparedTask]], bos_id: Optional[int] = None,
              log=None, samples: Optional[list] = None) -> dict[str, dict]:
  """{result name: metrics} of every prepared task, with its "seconds"; `log(str)` per task;
  `samples`, a list, gets every item's record (`umoe_jax.eval.samples`).
  A terminal's stderr shows one progress bar over all the tasks' requests (`console.progress`)."""
  results = {}
  total = sum(len(d.requests()) for prep in prepared for p in prep for d in p.docs)
  with console.progress(total=total, desc=specs[0].name if specs else "", unit="request") as bar:
    for spec, prep in zip(specs, prepared):
      bar.set_description(spec.name, refresh=False)
      t0 = time.perf_counter()
      out = score(scorer, tokenizer, spec, prep, bos_id, bar.update, samples)
      seconds = round(time.perf_counter() - t0, 2)
      for m in out.values():
        m["seconds"] = seconds
      results.update(out)
      if log:
        log(f"{spec.name}: {out[spec.name]['n']} items in {seconds:.1f} s")
  return results


def evaluate(model: nnx.Module, tokenizer, task_names: str | Sequence[str | TaskSpec], *,
             data_dir: str = tasks_lib.DEFAULT_DATA_DIR, limit: Optional[int] = None,
             batch_size: int = 16, bos_id: Optional[int] = None, num_fewshot: int = 0,
             fewshot_seed: int = fewshot.DEFAULT_SEED, log=None) -> dict[str, dict]:
  """{task: metrics} for every task (`taskspec.parse_task_list` entries: names, PATH:KIND, spec
  files, TaskSpecs); `log(str)` gets one line per task.

  Every task is read and its prompts built before any is scored, so a missing file, a malformed
  line or too many shots fails in seconds, not after the tasks before it.
  """
  specs = parse_task_list(task_names, data_dir)
  prepared = prepare_all(specs, num_fewshot=num_fewshot, limit=limit, fewshot_seed=fewshot_seed)
  return score_all(Scorer(model, batch_size=batch_size), tokenizer, specs, prepared, bos_id, log)


def format_table(results: dict[str, dict]) -> str:
  """One row per (task, metric): | task | n | shots | metric | value | stderr |."""
  rows = [("task", "n", "shots", "metric", "value", "stderr")]
  for name, m in results.items():
    for key in ("acc", "acc_norm", "ppl"):
      if key in m:
        rows.append((name, str(m["n"]), str(m.get("num_fewshot", "")), key, fmt(float(m[key])),
                     fmt(m.get(f"{key}_stderr"))))
  return markdown_table(rows)


if __name__ == "__main__":
  import sys

  from umoe_jax import stdout_errors
  from umoe_jax.eval.cli import main
  stdout_errors.run_and_exit(main, ["tasks"] + sys.argv[1:], prog="python -m umoe_jax.eval.harness")
