"""Document sources: files on disk (or the built-in corpus) -> a grain dataset of documents.

A document is a `str` (raw text sources) or a 1-D integer `np.ndarray` of token ids (pre-tokenized
ArrayRecord shards, no EOS). Two families, chosen by how cheaply one document can be read alone:

* Indexed (`text`, `builtin`, `arrayrecord`): any document is one cheap read, so the source is a
  `grain.MapDataset` of documents with a **global shuffle** (a fresh permutation every epoch).
  `text` means one document per file (a directory is walked recursively; hidden files skipped).
* Streamed (`parquet`, `jsonl`): documents live in compressed row groups / long files, so reading one
  at random would decode ~1000. These are cut into *chunks* (a parquet row group; a 64 MiB byte
  range of a JSON-lines file); the list of chunks is globally shuffled, chunks are read one after
  another (two reader threads decode ahead) and flattened into documents, and the documents are
  shuffled inside a window of `shuffle_window` documents
  (`grain.experimental.WindowShuffleIterDataset`); a window of 10,000 spans ~10 FineWeb row groups.
  Order is still a pure function of the seed; the shuffle is just local within the window.

Process sharding (each JAX process reads only its share): indexed sources take documents
`[process_index::process_count]`; streamed sources take chunks `[process_index::process_count]` when
there are at least as many chunks as processes, otherwise every process reads every chunk and keeps
documents `[process_index::process_count]` of each. Shares are disjoint and together cover the data;
their sizes can differ by a chunk, so processes reach the end of an epoch at different steps (use
`num_epochs=None` for training and stop on a step count).

Bad data (`data.on_bad_record`): a file that cannot be opened (a parquet footer that is truncated),
a row group that cannot be decoded, a JSON-lines line that is not a JSON object with a string
`text_field`, or a text file that cannot be read or is not UTF-8 raises `DataError` naming the file
and the row group / line ("error", the default), or is dropped with a warning naming it and a running count ("skip"). A
whole file that cannot be opened is dropped under "skip" too; a missing `text_field` column stays an
error (that is a config mistake, not a bad record).

Paths may be URLs (gs://, s3://, hf://, ...; umoe_jax/storage): files, directories (prefixes) and
globs resolve remotely, parquet row groups are read by byte range through pyarrow and JSON-lines
chunks by seek + line reads (bounded memory, no whole-file download), and each chunk / file read is
retried on transient errors (a reset connection, 5xx). ArrayRecord shards are read by
array_record's C++ reader: local paths and gs:// only.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import threading
from typing import Any, Sequence

import grain
import numpy as np
from absl import logging

from umoe_jax import storage
from umoe_jax.data import builtin
from umoe_jax.storage import retry

SOURCES = ("builtin", "parquet", "jsonl", "text", "arrayrecord")
BAD_RECORD_POLICIES = ("error", "skip")

INDEXED_SOURCES = ("builtin", "text", "arrayrecord")
JSONL_CHUNK_BYTES = 64 << 20  # Large enough that chunk bookkeeping is free, small enough to shard.
ARRAYRECORD_SUFFIX = ".array_record"
METADATA_FILE = "metadata.json"


class DataError(ValueError):
  """A data file is empty, unreadable or holds a bad record; the message names the file (and the
  line or row group). `hint` says what to do about it."""

  def __init__(self, message: str, hint: str = ""):
    super().__init__(message)
    self.hint = hint


SKIP_HINT = "set --config.data.on_bad_record=skip to drop bad records (each is logged and counted)"


class _BadRecords:
  """Applies data.on_bad_record: raise DataError, or drop the record with a warning naming it.

  Each bad record is logged and counted once per process (later epochs drop it silently); reader
  threads share the count, each grain worker process has its own.
  """

  def __init__(self):
    self.seen: set[str] = set()
    self._lock = threading.Lock()  # reader threads: counts and log lines in one order

  @property
  def skipped(self) -> int:
    return len(self.seen)

  def __call__(self, policy: str, what: str) -> None:
    if policy != "skip":
      raise DataError(what, hint=SKIP_HINT)
    with self._lock:
      if what not in self.seen:
        self.seen.add(what)
        logging.warning("skipping bad data (data.on_bad_record='skip'; bad records so far: %d): %s",
                        len(self.seen), what)


bad_record = _BadRecords()


def check_bad_record_policy(policy: str) -> None:
  if policy not in BAD_RECORD_POLICIES:
    raise ValueError(f"data.on_bad_record={policy!r}; valid: {', '.join(BAD_RECORD_POLICIES)}")


def _one_line(e: BaseException, limit: int = 300) -> str:
  text = " ".join(str(e).split())
  return f"{type(e).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


# ----------------------------------------------------------------------------------------------
# File resolution and validation.


def resolve_files(path: str, suffixes: Sequence[str] = (), *, key: str = "data.train_path") -> list[str]:
  """A file, a directory (walked recursively for `suffixes`; all files if empty) or a glob -> sorted files.

  Raises FileNotFoundError naming `path` (and the config `key` it came from) when nothing matches.
  """
  if not path:
    raise ValueError(f"{key} is empty; set it to a file, directory or glob")
  path = storage.expand(path)
  if not storage.is_url(path) and os.path.isfile(path):  # a local name may hold "[" literally
    return [path]
  if storage.has_magic(path):
    files = storage.glob(path, files_only=True)
    if not files:
      raise FileNotFoundError(f"{key}={path!r}: glob matches no files")
    return files
  if storage.isfile(path):
    return [path]
  if storage.isdir(path):
    files = storage.find_files(path, tuple(suffixes))
    if not files:
      what = f"{'/'.join(suffixes)} files" if suffixes else "files"
      raise FileNotFoundError(f"{key}={path!r}: directory has no {what}")
    return files
  raise FileNotFoundError(f"{key}={path!r}: no such file or directory")


def shard_name(index: int, num_shards: int) -> str:
  """File name of shard `index` of a `prepare` output of `num_shards` shards."""
  return f"data-{index:05d}-of-{num_shards:05d}{ARRAYRECORD_SUFFIX}"


def read_metadata(files: Sequence[str]) -> dict[str, Any]:
  """The `metadata.json` written by `prepare` next to the ArrayRecord shards."""
  return _read_metadata_in(storage.dirname(files[0]))


def _read_metadata_in(directory: str) -> dict[str, Any]:
  meta_path = storage.join(directory, METADATA_FILE)
  if not storage.isfile(meta_path):
    raise FileNotFoundError(f"{meta_path!r} missing: ArrayRecord shards must come from "
                            "`python -m umoe_jax.data.prepare` (a prepare into a bucket writes it "
                            "last: an interrupted one leaves none)")
  return json.loads(storage.read_text(meta_path))


ARRAYRECORD_SCHEMES = ("", "gs")  # what array_record's reader opens itself


def check_arrayrecord_location(path: str, key: str = "data.train_path") -> None:
  """ValueError unless array_record can read shards at `path` (local, or gs://)."""
  if storage.scheme(path) not in ARRAYRECORD_SCHEMES:
    raise ValueError(f"{key}={path!r}: ArrayRecord shards are read by array_record's reader, "
                     f"which opens local paths and gs:// only, not {storage.scheme(path)}://; copy "
                     "them to a local disk or a gs:// bucket (or prepare into one)")


def _name_some(paths: Sequence[str], limit: int = 8) -> str:
  more = f" ... and {len(paths) - limit} more" if len(paths) > limit else ""
  return ", ".join(repr(p) for p in paths[:limit]) + more


def arrayrecord_files(path: str, key: str = "data.train_path") -> tuple[list[str], dict[str, Any]]:
  """(shards in shard order, metadata) of a `prepare` output, checked against its metadata.json.

  The shards found under `path` must be exactly the `num_shards` files metadata.json describes:
  a stray shard (e.g. left by an earlier run with a different --num_shards, or from another
  directory below `path`) would otherwise be read too, duplicating documents or decoding ids of
  another tokenizer; a missing one would silently drop data. Either raises ValueError naming them.
  """
  check_arrayrecord_location(path, key)
  files = [storage.normpath(f) for f in resolve_files(path, (ARRAYRECORD_SUFFIX,), key=key)]
  expanded = storage.expand(path)
  top_meta = storage.join(expanded, METADATA_FILE)
  root = storage.normpath(expanded if storage.isfile(top_meta) else storage.dirname(files[0]))
  meta = _read_metadata_in(root)
  meta_path = storage.join(root, METADATA_FILE)
  n = meta.get("num_shards")
  if not isinstance(n, int) or n < 1:
    raise ValueError(f"{meta_path!r}: bad num_shards={n!r}")
  expected = [storage.join(root, shard_name(i, n)) for i in range(n)]
  unexpected = sorted(set(files) - set(expected))
  missing = [f for f in expected if f not in set(files)]
  if unexpected or missing:
    problems = ([f"unexpected {_name_some(unexpected)}"] if unexpected else []) + (
        [f"missing {_name_some(missing)}"] if missing else [])
    raise ValueError(
        f"{key}={path!r}: the ArrayRecord shards found do not match {meta_path!r} "
        f"(num_shards={n}): {'; '.join(problems)}. Stale shards of an earlier prepare run or "
        "files copied in? Re-run `python -m umoe_jax.data.prepare --overwrite` into this "
        "directory, or remove the unexpected files.")
  return expected, meta


# ----------------------------------------------------------------------------------------------
# Chunks of streamed sources. Frozen dataclasses: hashable, picklable (grain worker processes).


@dataclasses.dataclass(frozen=True)
class Chunk:
  """A unit read in one go: a parquet row group (`index`) or a jsonl byte range [`start`, `stop`)."""
  kind: str
  path: str
  index: int = 0
  start: int = 0
  stop: int = 0
  doc_offset: int = 0  # Keep documents [doc_offset::doc_stride] (process sharding of few chunks).
  doc_stride: int = 1


def _remote_retry(fn, what: str, path: str):
  """fn(), retried on transient errors when `path` is a URL (storage.retry; a read is idempotent);
  other errors pass unchanged, so that damaged data is still reported as such."""
  if not storage.is_url(path):
    return fn()
  return retry.call(fn, what, path, transient_only=True)


def _open_parquet(path: str):
  """pq.ParquetFile(path) (reads only the footer; remote files by byte range through the storage
  layer); DataError naming the file if it is not one."""
  import pyarrow.parquet as pq
  try:
    def open_file():
      arrow_fs, arrow_path = storage.arrow_filesystem(path)
      return pq.ParquetFile(arrow_path, filesystem=arrow_fs) if arrow_fs else pq.ParquetFile(path)
    return _remote_retry(open_file, "opening", path)
  except storage.StorageError:
    raise
  except Exception as e:  # pylint: disable=broad-except  (pyarrow raises ArrowInvalid, OSError, ...)
    raise DataError(f"parquet file {path!r} cannot be opened ({_one_line(e)}): truncated, damaged or "
                    "not a parquet file", hint=SKIP_HINT) from e


def _parquet_chunks(files: Sequence[str], text_field: str, on_bad_record: str = "error") -> list[Chunk]:
  chunks = []
  for path in files:
    try:
      meta = _open_parquet(path)
    except DataError as e:
      if on_bad_record != "skip":
        raise
      bad_record(on_bad_record, f"{e} (the whole file)")
      continue
    names = meta.schema_arrow.names
    if text_field not in names:
      raise DataError(f"parquet file {path!r} has no column {text_field!r} (data.text_field); "
                      f"columns: {names}", hint="set data.text_field to the column with the text")
    column_type = meta.schema_arrow.field(text_field).type
    if not _is_text_type(column_type):  # (else a TypeError deep in the tokenizer or packer)
      raise DataError(f"parquet file {path!r}: column {text_field!r} (data.text_field) holds "
                      f"{column_type}, not strings; columns: {names}",
                      hint="set data.text_field to the column with the text")
    chunks += [Chunk("parquet", path, index=rg) for rg in range(meta.num_row_groups)]
  return chunks


def _is_text_type(arrow_type) -> bool:
  """A parquet column of strings (also large / view strings, dictionary-encoded)."""
  import pyarrow as pa
  if pa.types.is_dictionary(arrow_type):
    arrow_type = arrow_type.value_type
  return (pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)
          or pa.types.is_string_view(arrow_type))


def _jsonl_chunks(files: Sequence[str], text_field: str, on_bad_record: str = "error") -> list[Chunk]:
  chunks = []
  for path in files:
    if on_bad_record != "skip":  # Fail early on the first record rather than in a reader thread.
      _remote_retry(lambda: _check_first_record(path, text_field), "reading", path)
    size = storage.size(path)
    chunks += [Chunk("jsonl", path, start=s, stop=min(s + JSONL_CHUNK_BYTES, size))
               for s in range(0, size, JSONL_CHUNK_BYTES)]
  return chunks


def _check_first_record(path: str, text_field: str) -> None:
  with storage.open(path, "rb") as f:
    for lineno, line in enumerate(f, 1):
      if line.strip():
        try:
          _jsonl_text(line, text_field)
        except ValueError as e:
          raise DataError(f"{path}:{lineno}: {e}", hint=SKIP_HINT) from None
        return


def _jsonl_text(line: bytes, text_field: str) -> str | None:
  """The text of one JSON-lines record (None: null); ValueError saying what is wrong otherwise."""
  try:
    # without the line end: json would place an unterminated record at "line 2 column 1"
    record = json.loads(line.rstrip(b"\r\n"))
  except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
    snippet = f"{line[:80]!r}{'...' if len(line) > 80 else ''}"
    raise ValueError(f"not valid JSON ({_one_line(e, 120)}): {snippet}") from None
  if not isinstance(record, dict):
    raise ValueError(f"record is a JSON {_json_type(record)}, not an object with a field "
                     f"{text_field!r} (data.text_field)")
  if text_field not in record:
    raise ValueError(f"record without field {text_field!r} (data.text_field); record keys: "
                     f"{list(record)}")
  text = record[text_field]
  if text is not None and not isinstance(text, str):
    raise ValueError(f"field {text_field!r} is a JSON {_json_type(text)}, not a string")
  return text


def _json_type(value) -> str:
  """JSON's name of a decoded value's type (a Python list is an "array")."""
  names = ((bool, "boolean"), ((int, float), "number"), (str, "string"), (list, "array"),
           (dict, "object"))
  return next(name for types, name in names if isinstance(value, types))


def _lines_before(path: str, offset: int) -> int:
  """Number of newlines in the first `offset` bytes of `path` (line numbers for messages only)."""
  count = 0
  with storage.open(path, "rb") as f:
    while offset > 0:
      block = f.read(min(offset, 1 << 22))
      if not block:
        break
      count += block.count(b"\n")
      offset -= len(block)
  return count


def _read_jsonl_chunk(chunk: Chunk, text_field: str, on_bad_record: str) -> list:
  texts = []
  first_line = None  # line number of the chunk's first line: counted only when a message needs it
  with storage.open(chunk.path, "rb") as f:
    # A line belongs to the chunk holding its first byte: skip the tail of a line that started
    # in the previous chunk (seeking one byte back keeps a line that starts exactly at `start`).
    if chunk.start > 0:
      f.seek(chunk.start - 1)
      f.readline()
    start = f.tell()
    index = 0  # of the current line within the chunk
    while f.tell() < chunk.stop:
      line = f.readline()
      if not line:
        break
      index += 1
      if not line.strip():
        continue
      try:
        texts.append(_jsonl_text(line, text_field))
      except ValueError as e:
        if first_line is None:
          first_line = _lines_before(chunk.path, start) + 1
        bad_record(on_bad_record, f"{chunk.path}:{first_line + index - 1}: {e}")
  return texts


def read_chunk(chunk: Chunk, text_field: str, on_bad_record: str = "error") -> list[str]:
  """All non-empty documents of one chunk, in file order (after the chunk's doc striding).

  Bad records follow `on_bad_record` (module docstring): DataError naming the file and row group /
  line, or dropped with a warning.
  """
  if chunk.kind == "parquet":
    def read():
      with _open_parquet(chunk.path) as pf:
        return pf.read_row_group(chunk.index, columns=[text_field]).column(0).to_pylist()
    try:
      texts = _remote_retry(read, f"reading row group {chunk.index} of", chunk.path)
    except storage.StorageError:
      raise
    except Exception as e:  # pylint: disable=broad-except  (damaged pages: ArrowInvalid, OSError)
      what = (str(e) if isinstance(e, DataError) else
              f"parquet file {chunk.path!r}: row group {chunk.index} cannot be read ({_one_line(e)})")
      bad_record(on_bad_record, what)
      return []
  else:
    texts = _remote_retry(lambda: _read_jsonl_chunk(chunk, text_field, on_bad_record),
                          f"reading bytes {chunk.start}-{chunk.stop} of", chunk.path)
  texts = texts[chunk.doc_offset::chunk.doc_stride]
  return [t for t in texts if t]  # Null / empty documents would only add a stray EOS.


class _Documents(grain.experimental.FlatMapTransform):
  """A chunk's list of documents -> its documents one by one (FlatMapIterDataset)."""
  max_fan_out = 0  # Only MapDataset.flat_map uses it; the IterDataset form takes any fan-out.

  def flat_map(self, documents: list[str]) -> list[str]:
    return documents


# ----------------------------------------------------------------------------------------------
# Indexed sources: a sequence of items plus a function reading one item.


def _read_text(path: str) -> str:
  """The file's text, newlines made "\\n" (as universal newlines); ValueError naming the line and
  offset of the first byte that is not UTF-8 (a latin-1 or binary file: not replaced silently)."""
  with storage.open(path, "rb") as f:
    raw = f.read()
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    line = raw.count(b"\n", 0, e.start) + 1
    raise ValueError(f"not UTF-8 text: line {line}, byte {e.start} "
                     f"({raw[e.start:e.start + 1]!r}: {e.reason})") from None
  return text.replace("\r\n", "\n").replace("\r", "\n")


@dataclasses.dataclass(frozen=True)
class _ReadTextFile:
  on_bad_record: str = "error"

  def __call__(self, path: str) -> str:
    try:
      return _remote_retry(lambda: _read_text(path), "reading", path)
    except OSError as e:
      bad_record(self.on_bad_record, f"text file {path!r} cannot be read ({_one_line(e)})")
      return ""
    except ValueError as e:  # not UTF-8
      bad_record(self.on_bad_record, f"text file {path!r}: {e}")
      return ""


@dataclasses.dataclass(frozen=True)
class _DecodeTokens:
  dtype: str

  def __call__(self, record: bytes) -> np.ndarray:
    return np.frombuffer(record, dtype=self.dtype)


def _indexed(config, path: str, key: str, split: str) -> tuple[Any, Any]:
  """(random-access items, read function) for an indexed source."""
  if config.source == "builtin":
    return builtin.document_names("validation" if split == "eval" else "train"), builtin.read_document
  if config.source == "text":
    return resolve_files(path, key=key), _ReadTextFile(config.get("on_bad_record", "error"))
  files, meta = arrayrecord_files(path, key)
  records = grain.sources.ArrayRecordDataSource(files)
  if len(records) != meta["num_documents"]:
    raise ValueError(f"{key}={path!r}: the shards hold {len(records)} records but metadata.json "
                     f"says num_documents={meta['num_documents']}: shards of another prepare run? "
                     "Re-run `python -m umoe_jax.data.prepare --overwrite`.")
  return records, _DecodeTokens(meta["dtype"])


# ----------------------------------------------------------------------------------------------


def check_source(name: str) -> None:
  if name not in SOURCES:
    raise ValueError(f"unknown data.source {name!r}; valid choices: {', '.join(SOURCES)}")


def split_path(config, split: str) -> tuple[str, str]:
  """(path, config key) of the "train" or "eval" split."""
  key = "train_path" if split == "train" else "eval_path"
  return config.get(key, ""), f"data.{key}"


def document_dataset(config, *, split: str, seed: int, shuffle: bool, num_epochs: int | None,
                     process_index: int = 0, process_count: int = 1
                     ) -> grain.MapDataset | grain.IterDataset:
  """Documents of this process's share, shuffled by `seed`, repeated `num_epochs` (None: forever).

  Returns a `grain.MapDataset` (indexed sources) or `grain.IterDataset` (streamed sources) whose
  elements are `str` or `np.ndarray` token arrays (see module docstring).
  """
  check_source(config.source)
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} not in [0, process_count={process_count})")
  path, key = split_path(config, split)
  seed = int(seed) % 2**32  # grain's index shuffle takes 32-bit seeds.

  if config.source in INDEXED_SOURCES:
    items, read = _indexed(config, path, key, split)
    ds = grain.MapDataset.source(items)[process_index::process_count]
    if len(ds) == 0:
      raise ValueError(f"{key}={path!r} ({config.source}) has {len(items)} documents, fewer than "
                       f"process_count={process_count}")
    if shuffle:
      ds = ds.shuffle(seed=seed)
    # repeat *after* shuffle: grain then reseeds the permutation for every epoch.
    return ds.repeat(num_epochs).map(read)

  on_bad = config.get("on_bad_record", "error")
  check_bad_record_policy(on_bad)
  files = resolve_files(path, (".parquet",) if config.source == "parquet" else (), key=key)
  make_chunks = _parquet_chunks if config.source == "parquet" else _jsonl_chunks
  chunks = make_chunks(files, config.text_field, on_bad)
  if not chunks:
    raise DataError(f"{key}={path!r} ({config.source}) holds no data: {_name_some(files, 3)} "
                    f"{'have' if len(files) > 1 else 'has'} no row groups / bytes",
                    hint=f"point {key} at files with documents")
  if len(chunks) >= process_count:
    chunks = chunks[process_index::process_count]
  else:
    chunks = [dataclasses.replace(c, doc_offset=process_index, doc_stride=process_count)
              for c in chunks]
  ds = grain.MapDataset.source(chunks)
  if shuffle:
    ds = ds.shuffle(seed=seed)
  ds = ds.repeat(num_epochs).map(functools.partial(read_chunk, text_field=config.text_field,
                                                   on_bad_record=on_bad))
  # Reader threads decode the next chunks while documents of the current one are consumed. The
  # flat map's state is (position in the chunk list, index inside the chunk): a restore re-reads
  # one chunk.
  ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=2))
  ds = grain.experimental.FlatMapIterDataset(ds, _Documents())
  if shuffle and config.shuffle_window > 1:
    ds = grain.experimental.WindowShuffleIterDataset(
        ds, window_size=config.shuffle_window, seed=(seed + 1) % 2**32)
  return ds


def count_documents(config, split: str = "train") -> int | None:
  """Number of documents of a split when it is known without reading the text (for progress bars)."""
  path, key = split_path(config, split)
  if config.source in INDEXED_SOURCES:
    return len(_indexed(config, path, key, split)[0])
  if config.source == "parquet":
    return sum(_open_parquet(f).metadata.num_rows for f in resolve_files(path, (".parquet",), key=key))
  return None
