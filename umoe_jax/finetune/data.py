"""Classification data: reading labelled files, the label map, the dev carve-out, tokens and batches.

Files (the format follows the extension, or `data.format`):
  .jsonl / .json   one JSON object per line                       {"text": ..., "label": ...}
  .csv             comma-separated with a header row (RFC 4180 quoting, fields may span lines)
  .tsv             tab-separated with a header row, no quoting (GLUE's SST-2 files)
  .parquet         columns named by the fields
Each example is (text, label, where): `where` names the file and line ("train.csv:17", the first
line of a record whose quoted text spans lines; parquet: row) for error messages. Labels are names (strings) or integers.

The label map (`LabelMap`) is built from the training file alone: class i is the i-th name of
`data.label_names` when given, else of the sorted distinct training labels (numerically when every
label is an integer, e.g. "0"/"1" in a TSV). It is saved with the checkpoint. A dev or test label the
map does not hold is an error naming the file, line and value, and so is a class without training
examples (an integer label map with a gap, or a declared name that never occurs).

Without a dev file a dev split is carved from the training file (`carve_dev`): per class, the
texts whose sha256(seed, text) sorts first, up to `dev_fraction` of the class's examples (at least
one example stays in training). The split depends only on the texts, labels and the seed, not on the
file order, and all copies of a text of a class land on the same side.

`load_splits` puts it together for a run: (label map, train, dev, test) token rows and class ids.

Batches (`train_batch`, `eval_batches`): rows of token ids right-padded with `pad_id` to the
smallest bucket length that fits the longest row (powers of two from 32, and `max_len`: few compiled
shapes), lengths [B], labels [B] and weights [B] (0 for the rows that fill the last batch).
"""
from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import json
import os
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from umoe_jax import storage
from umoe_jax.finetune.config import FORMATS

_EXTENSIONS = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".csv": "csv",
               ".tsv": "tsv", ".parquet": "parquet"}


class DataError(ValueError):
  """A data file is missing, malformed or inconsistent; the message names the file (and line)."""


# The value of a CSV / TSV field past the end of a record's fields (a line cut short, or a quote
# never closed, which runs the field to the end of the file).
MISSING_FIELD = object()
_MISSING_HINT = ("the record has fewer fields than the header: a line cut short, or a quote never "
                 "closed?")


@dataclasses.dataclass(frozen=True)
class SettingNames:
  """How messages about a file read name its settings: the fine-tuning config's keys, or the flags
  of `predict` (the names the user typed)."""
  format: str = "data.format"
  text_field: str = "data.text_field"
  label_field: str = "data.label_field"


CONFIG_KEYS = SettingNames()
PREDICT_FLAGS = SettingNames(format="--format", text_field="--text_field",
                             label_field="--label_field")


@dataclasses.dataclass(frozen=True)
class Example:
  text: str
  label: Optional[str]      # the canonical label string (see `canonical_label`); None: unlabelled
  where: str                # "file:line" (parquet: "file:row N")


# ----------------------------------------------------------------------------------------------
# Reading files.


def file_format(path: str, fmt: str = "auto", names: SettingNames = CONFIG_KEYS) -> str:
  if fmt not in FORMATS:
    raise DataError(f"{names.format}={fmt!r}; valid: {', '.join(FORMATS)}")
  if fmt != "auto":
    return fmt
  ext = os.path.splitext(path)[1].lower()
  if ext not in _EXTENSIONS:
    raise DataError(f"{path}: cannot tell the format from the extension {ext!r} (known: "
                    f"{', '.join(sorted(_EXTENSIONS))}); set {names.format} to one of "
                    f"{', '.join(FORMATS[1:])}")
  return _EXTENSIONS[ext]


def _read_text(path: str) -> str:
  """The file as text: UTF-8, a leading byte-order mark dropped; other bytes are an error naming
  the line."""
  raw = storage.read_bytes(path)
  try:
    return raw.decode("utf-8-sig")
  except UnicodeDecodeError as e:
    line = raw[:e.start].count(b"\n") + 1
    raise DataError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x}); save the file as "
                    f"UTF-8") from None


def _records(path: str, fmt: str) -> Iterator[tuple[str, dict]]:
  """(where, record) for every record of the file."""
  name = storage.basename(path)
  if fmt == "jsonl":
    # split on "\n" only: str.splitlines would also cut at U+2028 etc. inside JSON strings
    for lineno, line in enumerate(_read_text(path).split("\n"), 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise DataError(f"{path}:{lineno}: not a JSON object ({e.msg})") from None
      if not isinstance(record, dict):
        raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
      yield f"{name}:{lineno}", record
  elif fmt in ("csv", "tsv"):
    kw = dict(delimiter="\t", quoting=csv.QUOTE_NONE) if fmt == "tsv" else {}
    reader = csv.reader(io.StringIO(_read_text(path), newline=""), **kw)
    start = 1
    try:
      header = next(reader, None)
      while header is not None:
        # A quoted field may span lines: a record is named by its first line (reader.line_num is
        # its last), where an editor shows it begin and where an unclosed quote opened.
        start = reader.line_num + 1
        row = next(reader, None)
        if row is None:
          break
        if not row:  # a blank line (skipped, as csv.DictReader does)
          continue
        if len(row) > len(header):
          raise DataError(f"{path}:{start}: more fields than the header {header}")
        # fields missing at the end are MISSING_FIELD (csv.DictReader's None reads as a JSON null)
        yield f"{name}:{start}", dict(zip(header, row + [MISSING_FIELD] * (len(header) - len(row))))
    except csv.Error as e:
      raise DataError(f"{path}:{start}: {e}") from None
  elif fmt == "parquet":
    import pyarrow.parquet as pq
    arrow_fs, arrow_path = storage.arrow_filesystem(path)  # (a URL: read through umoe_jax/storage)
    try:
      table = pq.read_table(arrow_path, filesystem=arrow_fs)
    except storage.StorageError:
      raise
    except Exception as e:  # pylint: disable=broad-except  (pyarrow raises several types)
      raise DataError(f"{path}: cannot read as parquet ({type(e).__name__}: {e})") from None
    for i, record in enumerate(table.to_pylist()):
      yield f"{name}:row {i}", record
  else:
    raise DataError(f"data.format={fmt!r}; valid: {', '.join(FORMATS)}")


def canonical_label(value: Any, where: str, field: str) -> str:
  """A label value -> its canonical string: integers (also 3.0, " 3") as decimal digits, strings
  stripped, booleans "true"/"false". Missing / empty values are errors naming `where`."""
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, (int, np.integer)):
    return str(int(value))
  if isinstance(value, float) and value.is_integer():
    return str(int(value))
  if isinstance(value, str) and value.strip():
    text = value.strip()
    return str(int(text)) if _is_int(text) else text
  raise DataError(f"{where}: label field {field!r} is {value!r}; expected a class name or an integer")


def _is_int(text: str) -> bool:
  try:
    int(text)
    return True
  except ValueError:
    return False


def read_examples(path: str, *, text_field: str, label_field: Optional[str], fmt: str = "auto",
                  key: str = "data.train_path", names: SettingNames = CONFIG_KEYS) -> list[Example]:
  """Every example of a file. `label_field=None`: unlabelled (labels None).

  Raises DataError naming the file and line for a missing file, an empty file, a record without
  the text or label field, or a non-string text. `key` (the config key or flag that gave `path`)
  is named in the messages about the whole file, `names` where they say which setting to change.
  """
  try:
    local = storage.expand(path)
  except storage.UnknownUserError as e:
    raise DataError(f"{key}={path!r}: {e}") from None
  if not storage.isfile(local):
    raise DataError(f"{key}={path!r}: no such file")
  path = local
  fmt = file_format(path, fmt, names)
  out = []
  for where, record in _records(path, fmt):
    fields = sorted(map(str, record))
    if text_field not in record:
      raise DataError(f"{path} ({where}): no text field {text_field!r} (fields: {fields}); set "
                      f"{names.text_field}")
    text = record[text_field]
    if text is MISSING_FIELD:
      raise DataError(f"{path} ({where}): no value of the text field {text_field!r}; "
                      f"{_MISSING_HINT}")
    if not isinstance(text, str) or not text.strip():
      raise DataError(f"{path} ({where}): text field {text_field!r} is {text!r}; expected a "
                      f"non-empty string")
    label = None
    if label_field is not None:
      if label_field not in record:
        raise DataError(f"{path} ({where}): no label field {label_field!r} (fields: {fields}); "
                        f"set {names.label_field}")
      if record[label_field] is MISSING_FIELD:
        raise DataError(f"{path} ({where}): no value of the label field {label_field!r}; "
                        f"{_MISSING_HINT}")
      label = canonical_label(record[label_field], f"{path} ({where})", label_field)
    out.append(Example(text=text, label=label, where=where))
  if not out:
    raise DataError(f"{key}={path!r}: the file holds no examples")
  return out


def has_field(path: str, field: str, fmt: str = "auto", names: SettingNames = CONFIG_KEYS) -> bool:
  """Whether the first record of the file has `field` (predict: score against labels if present)."""
  for _, record in _records(storage.expand(path), file_format(path, fmt, names)):
    return field in record
  return False


# ----------------------------------------------------------------------------------------------
# The label map.


@dataclasses.dataclass(frozen=True)
class LabelMap:
  """Class ids <-> label names. `kind` "int": every name is an integer (predictions written as ints)."""
  names: tuple[str, ...]
  kind: str = "str"

  def __post_init__(self):
    if len(set(self.names)) != len(self.names):
      raise DataError(f"label names {list(self.names)} repeat a name")

  @property
  def num_classes(self) -> int:
    return len(self.names)

  def index(self, name: str) -> int:
    return self.names.index(name)

  def value(self, class_id: int):
    """The label as written to predictions: an int for integer label maps, else the name."""
    name = self.names[class_id]
    return int(name) if self.kind == "int" else name

  def to_json(self) -> dict:
    return {"names": list(self.names), "kind": self.kind}

  @classmethod
  def from_json(cls, d: dict) -> "LabelMap":
    return cls(names=tuple(d["names"]), kind=d.get("kind", "str"))

  def ids(self, examples: Sequence[Example], *, path: str, train_path: str) -> np.ndarray:
    """int32 [N] class ids of labelled examples; a label outside the map is an error naming the
    file, the line and the value (all such values are listed, a few places each)."""
    known = {n: i for i, n in enumerate(self.names)}
    unseen: dict[str, list[str]] = {}
    for e in examples:
      if e.label not in known:
        unseen.setdefault(e.label, []).append(e.where)
    if unseen:
      parts = [f"{v!r} ({', '.join(w[:3])}{', ...' if len(w) > 3 else ''})"
               for v, w in sorted(unseen.items())]
      raise DataError(f"{path}: label(s) {'; '.join(parts)} never occur in the training file "
                      f"{train_path} (classes: {list(self.names)})")
    return np.asarray([known[e.label] for e in examples], np.int32)


def build_label_map(examples: Sequence[Example], *, path: str,
                    label_names: Optional[Sequence[Any]] = None) -> LabelMap:
  """The label map of the training examples (see the module docstring); every class must have
  at least one example, and there must be at least two classes."""
  counts: dict[str, int] = {}
  for e in examples:
    counts[e.label] = counts.get(e.label, 0) + 1
  if label_names:
    names = [canonical_label(n, "data.label_names", "label_names") for n in label_names]
    declared = set(names)
    extra = sorted(set(counts) - declared)
    if extra:
      where = next(e.where for e in examples if e.label == extra[0])
      raise DataError(f"{path} ({where}): label {extra[0]!r} is not one of data.label_names="
                      f"{names}")
    empty = [n for n in names if n not in counts]
    if empty:
      raise DataError(f"{path}: class(es) {empty} of data.label_names have no training examples")
    kind = "int" if all(_is_int(n) for n in names) else "str"
  elif all(_is_int(n) for n in counts):
    kind = "int"
    values = sorted(int(n) for n in counts)
    missing = sorted(set(range(values[0], values[-1] + 1)) - set(values))
    if missing:
      raise DataError(f"{path}: integer labels {values[0]}..{values[-1]} but class(es) {missing} "
                      f"have no training examples; set data.label_names to declare the classes")
    names = [str(v) for v in values]
  else:
    kind = "str"
    names = sorted(counts)
  if len(names) < 2:
    raise DataError(f"{path}: every training example has the label {names[0]!r}; a classifier "
                    f"needs at least two classes")
  return LabelMap(names=tuple(names), kind=kind)


def class_counts(ids: np.ndarray, num_classes: int) -> np.ndarray:
  return np.bincount(np.asarray(ids, np.int64), minlength=num_classes)


# ----------------------------------------------------------------------------------------------
# The dev carve-out.


def _split_key(seed: int, text: str) -> str:
  return hashlib.sha256(f"{seed}\x00{text}".encode("utf-8")).hexdigest()


def carve_dev(examples: Sequence[Example], fraction: float,
              seed: int) -> tuple[list[Example], list[Example]]:
  """(train, dev): per class, up to n_dev = min(round(fraction * n), n - 1) examples, taken as whole
  groups of equal texts in the order of sha256(seed, text); a group that would overshoot n_dev is
  passed over (so copies of a text never land on both sides)."""
  if not 0 < fraction < 1:
    raise DataError(f"data.dev_fraction={fraction!r} must be in (0, 1) when no data.dev_path is given")
  by_class: dict[str, dict[str, list[int]]] = {}
  for i, e in enumerate(examples):
    by_class.setdefault(e.label, {}).setdefault(e.text, []).append(i)
  dev_ids = set()
  for groups in by_class.values():
    n = sum(len(ids) for ids in groups.values())
    n_dev = min(int(round(fraction * n)), n - 1)
    taken = 0
    for text in sorted(groups, key=lambda text: _split_key(seed, text)):
      if taken + len(groups[text]) <= n_dev:
        dev_ids.update(groups[text])
        taken += len(groups[text])
  train = [e for i, e in enumerate(examples) if i not in dev_ids]
  dev = [e for i, e in enumerate(examples) if i in dev_ids]
  return train, dev


# ----------------------------------------------------------------------------------------------
# Tokens and batches.


def encode(texts: Sequence[str], tokenizer, *, max_len: int, bos_id: Optional[int] = None,
           append_eos: bool = True) -> list[np.ndarray]:
  """Texts -> int32 token rows of at most `max_len`: [bos] + the text's first tokens + [eos]."""
  reserved = (bos_id is not None) + bool(append_eos)
  if max_len <= reserved:
    raise DataError(f"data.max_len={max_len} leaves no room for text tokens")
  out = []
  for ids in tokenizer.encode_batch(list(texts)):
    row = ([bos_id] if bos_id is not None else []) + list(ids[:max_len - reserved])
    if append_eos:
      row.append(tokenizer.eos_id)
    out.append(np.asarray(row, np.int32))
  return out


def bucket_length(n: int, max_len: int, smallest: int = 32) -> int:
  """The padded length of a batch whose longest row has n tokens: a power of two >= smallest, or
  max_len (so a run compiles at most ~log2(max_len / 32) + 1 shapes)."""
  length = smallest
  while length < n and length < max_len:
    length *= 2
  return min(length, max_len) if n <= max_len else n


def collate(rows: Sequence[np.ndarray], labels: Optional[np.ndarray], *, batch_size: int,
            max_len: int, pad_id: int = 0) -> dict[str, np.ndarray]:
  """Rows -> {"tokens" int32 [B, L], "lengths" int32 [B], "labels" int32 [B], "weights" f32 [B]}.

  B = batch_size; rows beyond len(rows) are one padding token with weight 0 and label 0.
  """
  if len(rows) > batch_size:
    raise ValueError(f"{len(rows)} rows do not fit a batch of {batch_size}")
  length = bucket_length(max(len(r) for r in rows), max_len)
  tokens = np.full((batch_size, length), pad_id, np.int32)
  lengths = np.ones((batch_size,), np.int32)
  for i, r in enumerate(rows):
    tokens[i, :len(r)] = r
    lengths[i] = len(r)
  out_labels = np.zeros((batch_size,), np.int32)
  if labels is not None:
    out_labels[:len(rows)] = labels
  weights = np.zeros((batch_size,), np.float32)
  weights[:len(rows)] = 1.0
  return {"tokens": tokens, "lengths": lengths, "labels": out_labels, "weights": weights}


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
  """The training order of epoch `epoch`: a permutation of range(n), a pure function of (seed, epoch)."""
  return np.random.default_rng([seed, epoch]).permutation(n)


def steps_per_epoch(n: int, batch_size: int) -> int:
  return -(-n // batch_size)


def train_batch(rows: Sequence[np.ndarray], labels: np.ndarray, *, seed: int, step: int,
                batch_size: int, max_len: int, pad_id: int = 0) -> dict[str, np.ndarray]:
  """The batch of training step `step` (0-based): epoch step // S, its (step % S)-th slice of the
  epoch's order (S = steps per epoch; the last slice is filled with weight-0 rows). Resuming at a
  step gives the same batches as an uninterrupted run."""
  per_epoch = steps_per_epoch(len(rows), batch_size)
  epoch, i = divmod(step, per_epoch)
  idx = epoch_order(len(rows), seed, epoch)[i * batch_size:(i + 1) * batch_size]
  return collate([rows[j] for j in idx], labels[idx], batch_size=batch_size, max_len=max_len,
                 pad_id=pad_id)


def eval_batches(rows: Sequence[np.ndarray], labels: Optional[np.ndarray], *, batch_size: int,
                 max_len: int, pad_id: int = 0) -> Iterator[tuple[np.ndarray, dict]]:
  """(row indices, batch) over all rows, longest first (little padding; results are put back in
  file order by the caller through the indices)."""
  order = sorted(range(len(rows)), key=lambda i: (-len(rows[i]), i))
  for start in range(0, len(order), batch_size):
    idx = np.asarray(order[start:start + batch_size])
    yield idx, collate([rows[i] for i in idx], None if labels is None else labels[idx],
                       batch_size=batch_size, max_len=max_len, pad_id=pad_id)


# ----------------------------------------------------------------------------------------------
# The run's splits.


@dataclasses.dataclass
class Split:
  name: str                 # train | dev | test
  path: str                 # the file (dev carved from train: the train file, so noted)
  rows: list                # int32 token rows, `encode`d
  labels: np.ndarray        # int32 [N] class ids


def load_splits(config: Any, tokenizer) -> tuple[LabelMap, Split, Split, Optional[Split]]:
  """(label map, train, dev, test or None) of the fine-tuning config's `data` section: read,
  labelled against the training file, the dev split carved when there is no dev file, tokenized."""
  d, seed = config.data, config.train.seed
  kw = dict(text_field=d.text_field, label_field=d.label_field, fmt=d.format)
  train = read_examples(d.train_path, key="data.train_path", **kw)
  label_map = build_label_map(train, path=d.train_path, label_names=list(d.label_names))
  if d.dev_path:
    dev, dev_path = read_examples(d.dev_path, key="data.dev_path", **kw), d.dev_path
  else:
    train, dev = carve_dev(train, d.dev_fraction, seed)
    dev_path = f"{d.train_path} (dev carve-out)"
    if not dev:
      raise DataError(f"data.train_path={d.train_path!r}: too few examples per class to carve a dev "
                      f"split of data.dev_fraction={d.dev_fraction}; give data.dev_path")
  test = read_examples(d.test_path, key="data.test_path", **kw) if d.test_path else None

  def split(name, path, examples):
    ids = label_map.ids(examples, path=path, train_path=d.train_path)
    rows = encode([e.text for e in examples], tokenizer, max_len=d.max_len, bos_id=d.bos_id,
                  append_eos=d.append_eos)
    return Split(name, path, rows, ids)

  return (label_map, split("train", d.train_path, train), split("dev", dev_path, dev),
          split("test", d.test_path, test) if test is not None else None)

