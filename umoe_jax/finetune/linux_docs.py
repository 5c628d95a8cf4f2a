r"""A real text-classification set from the linux-docs corpus: which documentation subtree a file is in.

  python -m umoe_jax.finetune.linux_docs --output=data/linux_docs_cls \
      [--corpus=../shared/data/corpora/linux-docs/train-00000-of-00001.parquet] \
      [--num_classes=6] [--per_class=200] [--test_fraction=0.25]

Each document of the corpus (parquet: text, id, url) is labelled by the first path component after
`Documentation/` in its url (devicetree, ABI, userspace-api, admin-guide, driver-api, networking, ...);
the `num_classes` largest subtrees are kept. Per class, at most `per_class` documents are taken
(those whose id sorts first), and `test_fraction` of them (again by id) form the test split, so the
set is a deterministic function of the corpus and the arguments. Texts lose their leading SPDX
licence lines (they name the licence, not the subject) and are cut to `max_chars` characters.

Written files: train.jsonl ({"text", "label", "id"}) and test.csv (columns text, label, id): the two
layouts the fine-tuning command reads most often. No dev file: fine-tuning carves one.
"""
from __future__ import annotations

import collections
import csv
import io
import json
import os
import re
from typing import Optional

from umoe_jax import storage

DEFAULT_CORPUS = "../shared/data/corpora/linux-docs/train-00000-of-00001.parquet"
_LEADING_LICENCE = re.compile(r"\A(?:\s*\.\. SPDX-License-Identifier:[^\n]*\n|\s*\n)+")


def subtree(url: str) -> Optional[str]:
  """'debian:linux-doc-6.1/.../Documentation/admin-guide/perf/arm-cmn.rst.gz' -> 'admin-guide'."""
  _, sep, rest = url.partition("Documentation/")
  if not sep or "/" not in rest:
    return None
  return rest.split("/", 1)[0]


def clean_text(text: str, max_chars: int) -> str:
  return _LEADING_LICENCE.sub("", text)[:max_chars]


def build(corpus: str, output_dir: str, *, num_classes: int = 6, per_class: int = 200,
          test_fraction: float = 0.25, max_chars: int = 2000) -> dict:
  """Writes train.jsonl and test.csv into `output_dir`; returns {"train", "test", "classes"}.
  Raises ValueError naming the argument, the corpus or the output directory when one is unusable
  (checked before anything is written)."""
  import pyarrow.parquet as pq
  from umoe_jax.output import check_output_path
  for flag, value, ok, want in (
      ("num_classes", num_classes, num_classes >= 1, ">= 1"),
      ("per_class", per_class, per_class >= 2, ">= 2 (a train and a test document per class)"),
      ("test_fraction", test_fraction, 0 < test_fraction < 1, "in (0, 1)"),
      ("max_chars", max_chars, max_chars >= 1, ">= 1")):
    if not ok:
      raise ValueError(f"--{flag}={value} must be {want}")
  if not os.path.isfile(corpus):
    raise FileNotFoundError(f"linux-docs corpus {corpus!r}: no such file")
  check_output_path(output_dir, "--output", directory=True)  # before the corpus is read
  try:
    table = pq.read_table(corpus, columns=["text", "id", "url"]).to_pylist()
  except Exception as e:  # pylint: disable=broad-except  (pyarrow raises several types)
    raise ValueError(f"linux-docs corpus {corpus!r}: cannot read its text, id and url columns as "
                     f"parquet ({type(e).__name__}: {' '.join(str(e).split())})") from None
  by_class: dict[str, list[dict]] = collections.defaultdict(list)
  for row in table:
    label = subtree(row["url"])
    text = clean_text(row["text"], max_chars)
    if label is not None and text.strip():
      by_class[label].append({"text": text, "label": label, "id": row["id"]})
  classes = sorted(by_class, key=lambda c: (-len(by_class[c]), c))[:num_classes]
  train, test = [], []
  for c in classes:
    docs = sorted(by_class[c], key=lambda r: r["id"])[:per_class]
    n_test = max(1, int(round(test_fraction * len(docs))))
    test += docs[:n_test]
    train += docs[n_test:]
  if not train:  # e.g. a corpus whose classes hold one document each
    raise ValueError(f"linux-docs corpus {corpus!r}: no training documents (classes {classes}, "
                     f"--per_class={per_class}, --test_fraction={test_fraction})")
  train.sort(key=lambda r: r["id"])  # classes interleaved, as in a real file
  test.sort(key=lambda r: r["id"])
  # Atomic writes (storage.write_text): an interrupted run never leaves half a file behind.
  storage.write_text(os.path.join(output_dir, "train.jsonl"),
                     "".join(json.dumps(r) + "\n" for r in train))
  with io.StringIO(newline="") as f:
    writer = csv.DictWriter(f, fieldnames=["text", "label", "id"])
    writer.writeheader()
    writer.writerows(test)
    storage.write_text(os.path.join(output_dir, "test.csv"), f.getvalue())
  return {"train": len(train), "test": len(test), "classes": sorted(classes)}


def main(argv) -> None:
  del argv
  from absl import flags
  f = flags.FLAGS
  try:
    out = build(f.corpus, f.output, num_classes=f.num_classes, per_class=f.per_class,
                test_fraction=f.test_fraction, max_chars=f.max_chars)
  except (FileNotFoundError, ValueError) as e:
    raise SystemExit(f"error: {e}") from None
  print(json.dumps(out))


if __name__ == "__main__":
  from absl import app, flags
  flags.DEFINE_string("corpus", DEFAULT_CORPUS, "linux-docs parquet file (text, id, url).")
  flags.DEFINE_string("output", None, "Output directory (train.jsonl, test.csv).", required=True)
  flags.DEFINE_integer("num_classes", 6, "Keep this many of the largest subtrees.")
  flags.DEFINE_integer("per_class", 200, "At most this many documents per class.")
  flags.DEFINE_float("test_fraction", 0.25, "Share of each class held out as test.")
  flags.DEFINE_integer("max_chars", 2000, "Characters kept of each text.")
  from umoe_jax import flag_errors, stdout_errors
  stdout_errors.run_and_exit(app.run, main, flags_parser=flag_errors.parser(exit_code=1))
