"""MMLU (Hendrycks et al., 57 subjects): the public CSV release, scored as lm-evaluation-harness does.

Data: the `data/` directory of the original release
(https://people.eecs.berkeley.edu/~hendrycks/data.tar, also github.com/hendrycks/test):
`dev/<subject>_dev.csv` (5 examples a subject), `val/<subject>_val.csv`, `test/<subject>_test.csv`. Rows have no header: question, A, B, C, D, answer (a letter A-D).

Prompt of one item (lm-eval's `mmlu` default template; k-shot examples are the first k dev rows):

    The following are multiple choice questions (with answers) about <subject, "_" -> " ">.\\n\\n
    <dev question>\\nA. <A>\\nB. <B>\\nC. <C>\\nD. <D>\\nAnswer: <letter>\\n\\n      (k times)
    <question>\\nA. <A>\\nB. <B>\\nC. <C>\\nD. <D>\\nAnswer:

scored by the log-likelihood of " A", " B", " C", " D" (acc). Averages: per subject; per category
(STEM, humanities, social sciences, other: lm-eval's grouping) and overall over all items of the
subjects evaluated (weighted by size, as lm-eval's `mmlu` group); `subject_mean` is the unweighted
mean over subjects.
"""
from __future__ import annotations

import csv
import math
import os
from typing import Optional, Sequence

from umoe_jax import storage
from umoe_jax.eval.errors import EvalError
from umoe_jax.eval.tasks import MultipleChoice, TaskFormatError

LETTERS = ("A", "B", "C", "D")
CATEGORIES = ("stem", "humanities", "social_sciences", "other")

_BY_CATEGORY = {
    "stem": """abstract_algebra anatomy astronomy college_biology college_chemistry
        college_computer_science college_mathematics college_physics computer_security
        conceptual_physics electrical_engineering elementary_mathematics high_school_biology
        high_school_chemistry high_school_computer_science high_school_mathematics
        high_school_physics high_school_statistics machine_learning""",
    "humanities": """formal_logic high_school_european_history high_school_us_history
        high_school_world_history international_law jurisprudence logical_fallacies moral_disputes
        moral_scenarios philosophy prehistory professional_law world_religions""",
    "social_sciences": """econometrics high_school_geography high_school_government_and_politics
        high_school_macroeconomics high_school_microeconomics high_school_psychology
        human_sexuality professional_psychology public_relations security_studies sociology
        us_foreign_policy""",
    "other": """business_ethics clinical_knowledge college_medicine global_facts human_aging
        management marketing medical_genetics miscellaneous nutrition professional_accounting
        professional_medicine virology""",
}
# subject -> category, the 57 subjects.
SUBJECTS: dict[str, str] = {s: c for c, names in _BY_CATEGORY.items() for s in names.split()}


def description(subject: str) -> str:
  return ("The following are multiple choice questions (with answers) about "
          f"{subject.replace('_', ' ')}.\n\n")


def format_question(question: str, options: Sequence[str]) -> str:
  return question.strip() + "".join(f"\n{l}. {o}" for l, o in zip(LETTERS, options)) + "\nAnswer:"


def read_csv(path: str, limit: Optional[int] = None) -> list[MultipleChoice]:
  """Rows of one MMLU CSV as items with choices ("A", "B", "C", "D"); errors name file:line."""
  if not storage.isfile(path):
    raise FileNotFoundError(f"MMLU file not found: {path!r}")
  docs = []
  with storage.open(path, encoding="utf-8", newline="") as f:
    reader = csv.reader(f)
    while limit is None or len(docs) < limit:
      start = reader.line_num + 1
      try:
        row = next(reader)
      except StopIteration:
        break
      except (csv.Error, UnicodeDecodeError) as e:
        raise TaskFormatError(f"{path}:{start}: unreadable CSV ({e})") from None
      if not row or not any(c.strip() for c in row):
        continue
      if len(row) != 6:
        raise TaskFormatError(f"{path}:{start}: expected 6 columns (question, A, B, C, D, answer), "
                              f"got {len(row)}")
      answer = row[5].strip()
      if answer not in LETTERS:
        raise TaskFormatError(f"{path}:{start}: answer must be one of A, B, C, D, got {answer!r}")
      docs.append(MultipleChoice(format_question(row[0], row[1:5]), LETTERS, LETTERS.index(answer)))
  if not docs:
    raise TaskFormatError(f"{path}: no rows")
  return docs


def subject_file(data_dir: str, split: str, subject: str) -> str:
  return storage.join(data_dir, split, f"{subject}_{split}.csv")


def find_subjects(data_dir: str, split: str = "test",
                  subjects: Optional[Sequence[str]] = None) -> list[str]:
  """The subjects to evaluate: `subjects` (validated), else every <subject>_<split>.csv found."""
  split_dir = storage.join(data_dir, split)
  if not storage.isdir(split_dir):
    raise FileNotFoundError(f"MMLU split directory not found: {split_dir!r} (expected the release's "
                            "data/ directory holding dev/, val/, test/)")
  if subjects:
    unknown = [s for s in subjects if s not in SUBJECTS]
    if unknown:
      raise EvalError(f"unknown MMLU subject(s) {unknown}; valid: {', '.join(sorted(SUBJECTS))}")
    return list(subjects)
  suffix = f"_{split}.csv"
  found = sorted(n[:-len(suffix)] for n in storage.listdir(split_dir) if n.endswith(suffix))
  if not found:
    raise EvalError(f"no *{suffix} files in {split_dir!r}")
  return found


def aggregate(per_subject: dict[str, dict]) -> dict[str, dict]:
  """{"mmlu_<category>": ..., "mmlu": ...} from per-subject {"acc", "n"}: size-weighted accuracy
  with the standard error of the pooled items; "mmlu" also has "subject_mean"."""

  def pooled(names):
    n = sum(per_subject[s]["n"] for s in names)
    acc = sum(per_subject[s]["acc"] * per_subject[s]["n"] for s in names) / n
    err = math.sqrt(acc * (1 - acc) / (n - 1)) if n > 1 else None
    return {"acc": acc, "acc_stderr": err, "n": n}

  out = {}
  for cat in CATEGORIES:
    names = [s for s in per_subject if SUBJECTS.get(s, "other") == cat]
    if names:
      out[f"mmlu_{cat}"] = dict(pooled(names), subjects=len(names))
  out["mmlu"] = dict(pooled(list(per_subject)), subjects=len(per_subject),
                     subject_mean=sum(m["acc"] for m in per_subject.values()) / len(per_subject))
  return out
