"""Tests of umoe_jax.data: packing, determinism, resume, process sharding, prepare, sources, errors.

Small corpora are written to tmp_path; tests on the real linux-docs corpus and GPT-2 tokenizer need
`<repo>/../shared` and skip without it. The built-in source needs nothing.
"""
from __future__ import annotations

import json
import pathlib
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from umoe_jax import data
from umoe_jax.data import pipeline, prepare, sources

SHARED = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "data"
LINUX_DOCS = SHARED / "corpora" / "linux-docs"
GPT2 = SHARED / "tokenizers" / "gpt2" / "tokenizer.json"
needs_shared = pytest.mark.skipif(
    not LINUX_DOCS.is_dir() or not GPT2.is_file(),
    reason=f"shared data not found at {SHARED} (fresh clone without ../shared)")

# Distinct, variable-length documents, including multi-byte UTF-8 and one longer than seq_len.
DOCS = [f"doc {i}: " + "abcdefghij"[: i % 10] * (i % 4 + 1) + ("é∑" if i % 3 == 0 else "")
        for i in range(40)] + ["L" * 200]


def _cfg(**overrides):
  cfg = data.default_data_config()
  cfg.update(overrides)
  return cfg


def _write_text_dir(root: pathlib.Path, docs=DOCS) -> pathlib.Path:
  root.mkdir()
  for i, d in enumerate(docs):
    (root / f"{i:03d}.txt").write_text(d, encoding="utf-8")
  return root


def _write_parquet(path: pathlib.Path, docs=DOCS, row_group_size=7, column="text") -> pathlib.Path:
  pq.write_table(pa.table({column: docs, "id": [str(i) for i in range(len(docs))]}), path,
                 row_group_size=row_group_size)
  return path


def _write_jsonl(path: pathlib.Path, docs=DOCS, field="body") -> pathlib.Path:
  path.write_text("".join(json.dumps({field: d, "n": i}) + "\n" for i, d in enumerate(docs)))
  return path


def _byte_stream(docs) -> list[int]:
  out = []
  for d in docs:
    out += list(d.encode("utf-8")) + [256]
  return out


def _take(it, n):
  return [next(it) for _ in range(n)]


def _same(a, b) -> bool:
  return len(a) == len(b) and all(
      (x["inputs"] == y["inputs"]).all() and (x["targets"] == y["targets"]).all() for x, y in zip(a, b))


def _all_batches(cfg, seq_len, batch):
  it = data.make_train_iterator(cfg, seq_len=seq_len, global_batch_size=batch, seed=0)
  out = list(it)
  it.close()
  return out


# ----------------------------------------------------------------------------------------------
# Packing.


def test_packing_is_the_eos_separated_stream_in_order(tmp_path):
  cfg = _cfg(source="text", train_path=str(_write_text_dir(tmp_path / "docs")), shuffle=False,
             num_epochs=1)
  seq_len, batch = 16, 3
  batches = _all_batches(cfg, seq_len, batch)
  for b in batches:
    assert set(b) == {"inputs", "targets"}
    assert b["inputs"].shape == b["targets"].shape == (batch, seq_len)
    assert b["inputs"].dtype == b["targets"].dtype == np.int32
    np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
  expected = _byte_stream(DOCS)
  rows = len(expected) // (seq_len + 1) // batch * batch  # Only the incomplete tail is dropped.
  got = list(pipeline.iterate_tokens(batches))
  assert len(got) == rows * (seq_len + 1)
  assert got == expected[:len(got)]
  # EOS sits exactly after each document, nowhere else.
  eos_positions = [i for i, t in enumerate(got) if t == 256]
  assert eos_positions == [i for i, t in enumerate(expected[:len(got)]) if t == 256]


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_streamed_sources_give_the_same_stream_as_text(tmp_path, monkeypatch, kind):
  # Tiny jsonl chunks: documents straddle many chunk boundaries; each must be read exactly once.
  monkeypatch.setattr(sources, "JSONL_CHUNK_BYTES", 97)
  path = (_write_parquet(tmp_path / "d.parquet") if kind == "parquet"
          else _write_jsonl(tmp_path / "d.jsonl"))
  cfg = _cfg(source=kind, train_path=str(path), text_field="text" if kind == "parquet" else "body",
             shuffle=False, num_epochs=1)
  got = list(pipeline.iterate_tokens(_all_batches(cfg, 8, 2)))
  assert got == _byte_stream(DOCS)[:len(got)]
  assert len(got) > len(_byte_stream(DOCS)) - 2 * 9


# ----------------------------------------------------------------------------------------------
# Determinism and resume.


def test_same_seed_same_batches_different_seed_different():
  cfg = _cfg()  # builtin corpus, byte tokenizer
  kw = dict(seq_len=64, global_batch_size=4)
  a = _take(data.make_train_iterator(cfg, seed=0, **kw), 4)
  b = _take(data.make_train_iterator(cfg, seed=0, **kw), 4)
  c = _take(data.make_train_iterator(cfg, seed=1, **kw), 4)
  assert _same(a, b)
  assert not _same(a, c)


def test_streamed_chunk_order_follows_the_seed(tmp_path):
  """Streamed sources with the window shuffle off: the row groups (chunks) come in an order set by
  the seed, each row group's documents together and in file order, every document once."""
  file_docs = DOCS[:40]                                          # 8 row groups of 5
  path = _write_parquet(tmp_path / "d.parquet", docs=file_docs, row_group_size=5)
  cfg = _cfg(source="parquet", train_path=str(path), shuffle_window=1)

  def chunk_order(seed):
    docs = list(sources.document_dataset(cfg, split="train", seed=seed, shuffle=True, num_epochs=1))
    order = [file_docs.index(d) // 5 for d in docs[::5]]       # row group of each run's first doc
    assert docs == [d for g in order for d in file_docs[5 * g:5 * g + 5]]
    return order

  assert chunk_order(3) == chunk_order(3)
  assert len({tuple(chunk_order(seed)) for seed in (0, 1, 2)}) == 3


@pytest.mark.parametrize("kind", ["builtin", "parquet"])
def test_resume_from_json_state_matches_uninterrupted_run(tmp_path, kind):
  cfg = _cfg(prefetch_batches=2)
  if kind == "parquet":  # Streamed path: chunk shuffle + interleave + window shuffle.
    cfg.update(dict(source="parquet", train_path=str(_write_parquet(tmp_path / "d.parquet")),
                    shuffle_window=8, num_epochs=None))
  kw = dict(seq_len=8, global_batch_size=2, seed=5)
  reference = _take(data.make_train_iterator(cfg, **kw), 40)  # Several epochs of the small parquet.
  for consumed in (0, 3, 17):
    it = data.make_train_iterator(cfg, **kw)
    _take(it, consumed)
    state = json.loads(json.dumps(it.get_state()))  # What an Orbax checkpoint stores.
    fresh = data.make_train_iterator(cfg, **kw)
    fresh.set_state(state)
    assert _same(_take(fresh, 6), reference[consumed:consumed + 6]), consumed


def test_resume_through_orbax_checkpoint_manager(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  cfg = _cfg()
  kw = dict(seq_len=32, global_batch_size=2, seed=3)
  reference = _take(data.make_train_iterator(cfg, **kw), 12)

  it = data.make_train_iterator(cfg, **kw)
  _take(it, 7)
  with ocp.CheckpointManager(tmp_path / "ckpt", item_names=("data",)) as mngr:  # async by default
    mngr.save(7, args=ocp.args.Composite(data=data.save_args(it)))
    _take(it, 2)  # The run goes on while the checkpoint finishes.
    mngr.wait_until_finished()
  with ocp.CheckpointManager(tmp_path / "ckpt", item_names=("data",)) as mngr:
    fresh = data.make_train_iterator(cfg, **kw)
    mngr.restore(mngr.latest_step(), args=ocp.args.Composite(data=data.restore_args(fresh)))
  assert _same(_take(fresh, 5), reference[7:12])


# ----------------------------------------------------------------------------------------------
# Process sharding.


def _documents(cfg, process_index, process_count):
  ds = sources.document_dataset(cfg, split="train", seed=7, shuffle=True, num_epochs=1,
                                process_index=process_index, process_count=process_count)
  if hasattr(ds, "to_iter_dataset"):
    ds = ds.to_iter_dataset()
  return list(ds)


@pytest.mark.parametrize("kind,row_group_size", [("text", 0), ("parquet", 5), ("parquet", 1000)])
def test_processes_read_disjoint_shares_that_cover_the_data(tmp_path, kind, row_group_size):
  # parquet/1000 is one row group for two processes: every process reads it and keeps every
  # second document.
  path = (_write_text_dir(tmp_path / "docs") if kind == "text"
          else _write_parquet(tmp_path / "d.parquet", row_group_size=row_group_size))
  cfg = _cfg(source=kind, train_path=str(path), shuffle_window=4)
  shares = [_documents(cfg, p, 2) for p in range(2)]
  assert not set(shares[0]) & set(shares[1])
  assert sorted(shares[0] + shares[1]) == sorted(DOCS)

  # The batches each process gets: per-process batch = global / process_count, different data.
  its = [data.make_train_iterator(cfg, seq_len=8, global_batch_size=4, seed=0, process_index=p,
                                  process_count=2) for p in range(2)]
  b0, b1 = next(its[0]), next(its[1])
  assert b0["inputs"].shape == b1["inputs"].shape == (2, 8)
  assert not (b0["inputs"] == b1["inputs"]).all()


# ----------------------------------------------------------------------------------------------
# prepare -> ArrayRecord -> load.


def test_prepare_round_trip_equals_on_the_fly_tokenization(tmp_path):
  jsonl = _write_jsonl(tmp_path / "d.jsonl")
  raw = _cfg(source="jsonl", train_path=str(jsonl), eval_path=str(jsonl), text_field="body")
  out = tmp_path / "prepared"
  meta = prepare.prepare(raw, str(out), split="train", num_shards=1, progress=False)
  assert meta["num_documents"] == len(DOCS) and meta["dtype"] == "uint16"
  assert meta["num_tokens"] == len(_byte_stream(DOCS)) - len(DOCS)
  rec = _cfg(source="arrayrecord", train_path=str(out), eval_path=str(out))
  kw = dict(seq_len=8, global_batch_size=2, num_batches=1000)
  assert _same(data.make_eval_batches(rec, **kw), data.make_eval_batches(raw, **kw))

  # Several shards: same documents (dealt round-robin), and training reads them all.
  out3 = tmp_path / "prepared3"
  prepare.main(["--source=jsonl", f"--input={jsonl}", "--text_field=body", f"--output_dir={out3}",
                "--num_shards=3"])
  assert len(list(out3.glob("*.array_record"))) == 3
  docs = _documents(_cfg(source="arrayrecord", train_path=str(out3)), 0, 1)
  assert sorted(bytes(d.astype(np.uint8)).decode() for d in docs) == sorted(DOCS)
  with pytest.raises(FileExistsError, match="overwrite"):
    prepare.prepare(raw, str(out3), progress=False)


def _prepared_docs(path) -> list[str]:
  docs = _documents(_cfg(source="arrayrecord", train_path=str(path)), 0, 1)
  return sorted(bytes(d.astype(np.uint8)).decode() for d in docs)


def _hidden(directory: pathlib.Path) -> list[str]:
  return [p.name for p in directory.iterdir() if p.name.startswith(".")]


def test_overwrite_with_fewer_shards_replaces_the_whole_output(tmp_path, monkeypatch, capsys):
  jsonl = _write_jsonl(tmp_path / "d.jsonl")
  out = tmp_path / "prepared"
  args = ["--source=jsonl", f"--input={jsonl}", "--text_field=body", f"--output_dir={out}"]
  prepare.main(args + ["--num_shards=3"])
  prepare.main(args + ["--num_shards=1", "--overwrite"])
  # The 3 old shards are gone: every document is read exactly once.
  assert sorted(p.name for p in out.iterdir()) == ["data-00000-of-00001.array_record",
                                                   "metadata.json"]
  assert _prepared_docs(out) == sorted(DOCS)
  assert not _hidden(tmp_path)  # No temporary directory left behind.
  # The same without renameat2 (two-rename fallback).
  monkeypatch.setattr(prepare, "_exchange", lambda a, b: False)
  prepare.main(args + ["--num_shards=2", "--overwrite"])
  assert len(list(out.glob("*.array_record"))) == 2
  assert _prepared_docs(out) == sorted(DOCS) and not _hidden(tmp_path)

  # Files that are not a prepare output are never deleted by --overwrite.
  (out / "notes.txt").write_text("mine")
  capsys.readouterr()
  assert prepare.main(args + ["--overwrite"]) == 1  # one error line, no traceback
  assert capsys.readouterr().err.startswith(f"error: --output_dir='{out}' holds files that are "
                                            "not a prepare output ('notes.txt')")
  assert (out / "notes.txt").read_text() == "mine" and _prepared_docs(out) == sorted(DOCS)
  # A non-empty directory without metadata.json (e.g. an older interrupted run) needs --overwrite.
  partial = tmp_path / "partial"
  partial.mkdir()
  (partial / "data-00000-of-00009.array_record").write_bytes(b"")
  assert prepare.main([*args[:3], f"--output_dir={partial}"]) == 1
  assert capsys.readouterr().err == (f"error: --output_dir='{partial}' is not empty; pass "
                                     "--overwrite to replace it\n")  # (was the bare path)
  # An empty --output_dir was the working directory ("error: '' is not empty; pass --overwrite").
  assert prepare.main([*args[:3], "--output_dir="]) == 1
  assert capsys.readouterr().err == "error: --output_dir='' names no directory\n"
  # Bad input is one line naming the flag's value (it was a traceback naming data.train_path).
  assert prepare.main(["--source=parquet", f"--input={tmp_path}/none.parquet",
                       f"--output_dir={tmp_path}/p"]) == 1
  assert capsys.readouterr().err == f"error: --input='{tmp_path}/none.parquet': no such file or " \
                                    "directory\n"
  assert prepare.main([*args, "--num_shards=0"]) == 1
  assert capsys.readouterr().err == "error: --num_shards=0 must be >= 1\n"
  # An output_dir below a file: named as such (it was makedirs' "[Errno 17] File exists: ...").
  assert prepare.main([*args[:3], f"--output_dir={jsonl}/sub/out"]) == 1
  assert capsys.readouterr().err == (f"error: --output_dir='{jsonl}/sub/out' cannot be created: "
                                     f"'{jsonl}' is a file\n")
  prepare.main([*args[:3], f"--output_dir={partial}", "--overwrite"])
  assert _prepared_docs(partial) == sorted(DOCS)


def test_loader_rejects_shards_that_do_not_match_metadata(tmp_path):
  jsonl = _write_jsonl(tmp_path / "d.jsonl")
  raw = _cfg(source="jsonl", train_path=str(jsonl), text_field="body")
  out = tmp_path / "prepared"
  prepare.prepare(raw, str(out), num_shards=2, progress=False)
  cfg = _cfg(source="arrayrecord", train_path=str(out))
  stray = out / "data-00000-of-00003.array_record"
  stray.write_bytes((out / "data-00000-of-00002.array_record").read_bytes())
  for load in (lambda: _documents(cfg, 0, 1), lambda: _train(cfg), lambda: data.load_tokenizer(cfg)):
    with pytest.raises(ValueError, match=r"unexpected '[^']*data-00000-of-00003.array_record'"):
      load()
  stray.unlink()
  (out / "sub").mkdir()  # A shard in a subdirectory is found by the recursive walk: also refused.
  (out / "sub" / "x.array_record").write_bytes(b"")
  with pytest.raises(ValueError, match="unexpected.*sub/x.array_record"):
    _documents(cfg, 0, 1)
  (out / "sub" / "x.array_record").unlink()
  shard1 = (out / "data-00001-of-00002.array_record").read_bytes()
  (out / "data-00001-of-00002.array_record").unlink()
  with pytest.raises(ValueError, match="missing '[^']*data-00001-of-00002.array_record'"):
    _documents(cfg, 0, 1)
  # A same-named shard of another run: the record count no longer matches metadata.json.
  prepare.prepare(_cfg(source="text", train_path=str(_write_text_dir(tmp_path / "few", DOCS[:6]))),
                  str(tmp_path / "few_out"), num_shards=2, progress=False)
  (out / "data-00001-of-00002.array_record").write_bytes(
      (tmp_path / "few_out" / "data-00001-of-00002.array_record").read_bytes())
  with pytest.raises(ValueError, match="records but metadata.json says num_documents=41"):
    _documents(cfg, 0, 1)
  (out / "data-00001-of-00002.array_record").write_bytes(shard1)
  assert _prepared_docs(out) == sorted(DOCS)
  assert _prepared_docs(out / "*.array_record") == sorted(DOCS)  # A glob of the whole output.


def _word_tokenizer(path: pathlib.Path) -> pathlib.Path:
  """A word-level tokenizer.json of DOCS' words (ids of another vocabulary than the byte one)."""
  import tokenizers
  from tokenizers import models, pre_tokenizers
  words = sorted({w for d in DOCS for w in d.split()})
  tok = tokenizers.Tokenizer(models.WordLevel(
      {w: i for i, w in enumerate(words + ["[UNK]", "<|endoftext|>"])}, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.save(str(path))
  return path


def test_eval_shards_of_another_tokenizer_are_refused(tmp_path):
  # Held-out shards prepared with another tokenizer held ids of that vocabulary, and were scored
  # as the training tokenizer's (only data.train_path's metadata.json was checked).
  from configs import common
  from umoe_jax.config import ConfigError, model_config
  from umoe_jax.train import config as train_config
  jsonl = _write_jsonl(tmp_path / "d.jsonl")
  raw = _cfg(source="jsonl", train_path=str(jsonl), eval_path=str(jsonl), text_field="body")
  prepare.prepare(raw, str(tmp_path / "train"), progress=False)
  words = _word_tokenizer(tmp_path / "words.json")
  prepare.prepare(_cfg(**{**raw, "tokenizer": str(words)}), str(tmp_path / "eval"), split="eval",
                  progress=False)
  cfg = _cfg(source="arrayrecord", train_path=str(tmp_path / "train"),
             eval_path=str(tmp_path / "eval"))
  message = (rf"does not match the tokenizer the shards in data.eval_path='{tmp_path}/eval' were "
             rf"prepared with: '{words}' \(vocab \d+, eos \d+\)")
  with pytest.raises(ValueError, match=message):
    data.load_tokenizer(cfg)
  with pytest.raises(ValueError, match=message):
    data.make_eval_batches(cfg, seq_len=8, global_batch_size=2, num_batches=1)
  train = train_config.default_train_config()
  train.update(seq_len=8, global_batch_size=2, eval_every=10)
  with pytest.raises(ConfigError, match=message):  # at start-up, before anything is built
    train_config.check_data(cfg, train, model_config(common.model("dense", "tiny")))
  # Shards of the same tokenizer pass.
  prepare.prepare(raw, str(tmp_path / "eval"), split="eval", overwrite=True, progress=False)
  assert data.load_tokenizer(cfg).vocab_size == 257


def test_prepare_onto_a_full_disk_names_the_output(tmp_path, capsys):
  # array_record's writer raises RuntimeError ("write() failed: No space left on device; ..."):
  # it was a traceback, not the one error line of the other failures.
  import os
  import subprocess
  disk = tmp_path / "disk"
  disk.mkdir()
  if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs",
                                          str(disk)], capture_output=True).returncode:
    pytest.skip("needs root to mount a small tmpfs")
  try:
    jsonl = _write_jsonl(tmp_path / "d.jsonl", [f"document {i} " * 40 for i in range(200)])
    assert prepare.main(["--source=jsonl", f"--input={jsonl}", "--text_field=body",
                         f"--output_dir={disk}/out", "--num_shards=2"]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (  # (after tqdm's progress line)
        f"error: --output_dir='{disk}/out': writing the shards failed (write() failed: No space left "
        "on device); a previous output there is unchanged")
    assert not os.listdir(disk)  # the staging directory is removed
  finally:
    subprocess.run(["umount", "-l", str(disk)], check=False)


def _refuse_directories_below(read_only: pathlib.Path, monkeypatch) -> None:
  """os.mkdir below `read_only` fails as on a read-only file system (the tests may run as root,
  whom chmod does not stop)."""
  import errno
  import os
  mkdir = os.mkdir

  def read_only_mkdir(path, *args, **kwargs):
    if os.path.abspath(path).startswith(f"{read_only}{os.sep}"):
      raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
    return mkdir(path, *args, **kwargs)
  monkeypatch.setattr(os, "mkdir", read_only_mkdir)


def test_prepare_into_a_read_only_directory_names_the_output_dir(tmp_path, monkeypatch, capsys):
  # The error named the hidden staging directory (".out.prepare-<id>"), not the --output_dir given.
  jsonl = _write_jsonl(tmp_path / "d.jsonl")
  read_only = tmp_path / "ro"
  read_only.mkdir()
  _refuse_directories_below(read_only, monkeypatch)
  monkeypatch.chdir(tmp_path)
  args = ["--source=jsonl", f"--input={jsonl}", "--text_field=body"]
  for output_dir in ("ro/out", "ro/new/out"):  # named as given; the second needs ro/new made first
    assert prepare.main([*args, f"--output_dir={output_dir}"]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: --output_dir='{output_dir}' cannot be written: making a directory in "
        f"'{read_only}' failed (Read-only file system)")
  assert not list(read_only.iterdir())


def test_prepare_flags_that_would_be_ignored_or_exhaust_open_files(tmp_path, monkeypatch, capsys):
  import resource
  jsonl = _write_jsonl(tmp_path / "d.jsonl")
  out = tmp_path / "out"
  # --input with the builtin corpus, --eos_token with the byte tokenizer: were silently ignored.
  for bad, message in (
      (["--source=builtin", f"--input={jsonl}"],
       f"--input='{jsonl}' is not read by --source=builtin (it writes the built-in corpus; --split "
       "picks which split)"),
      (["--source=jsonl", f"--input={jsonl}", "--eos_token=</s>"],
       "--eos_token='</s>' is for a tokenizer.json --tokenizer; the byte tokenizer's EOS is id 256"),
      # --text_field of text files or the built-in corpus, --split of a corpus given by --input.
      (["--source=text", f"--input={jsonl}", "--text_field=body"],
       "--text_field='body' is not read by --source=text (its documents are whole texts, without "
       "fields); it names a parquet column or JSON key"),
      (["--source=builtin", "--text_field=body"],
       "--text_field='body' is not read by --source=builtin (its documents are whole texts, "
       "without fields); it names a parquet column or JSON key"),
      (["--source=jsonl", f"--input={jsonl}", "--split=validation"],
       "--split=validation is not read by --source=jsonl (it picks a split of --source=builtin; "
       "--input names the data to prepare)")):
    with pytest.raises(SystemExit) as exit_info:
      prepare.main([*bad, f"--output_dir={out}"])
    assert exit_info.value.code == 2
    usage_error = capsys.readouterr().err.splitlines()[-1]
    assert usage_error == f"python -m umoe_jax.data.prepare: error: {message}"
  # More shards than files may be open: the error blamed the input ("text file 'd.jsonl' cannot be
  # read (OSError: [Errno 24] Too many open files") once the writers had used the limit up.
  monkeypatch.setattr(resource, "getrlimit", lambda kind: (100, 100))
  assert prepare.main(["--source=jsonl", f"--input={jsonl}", "--text_field=body",
                       f"--output_dir={out}", "--num_shards=40"]) == 1
  assert capsys.readouterr().err == (
      "error: --num_shards=40: every shard is written at once, one open file each, and this "
      "process may open 100 files (ulimit -n); use at most 36 shards\n")
  assert not out.exists()


@pytest.mark.parametrize("previous", [True, False])
def test_failed_prepare_leaves_the_previous_output_loadable(tmp_path, monkeypatch, previous):
  from array_record.python import array_record_module

  jsonl = _write_jsonl(tmp_path / "d.jsonl")
  raw = _cfg(source="jsonl", train_path=str(jsonl), text_field="body")
  out = tmp_path / "prepared"
  if previous:
    prepare.prepare(raw, str(out), num_shards=3, progress=False)
  before = sorted(p.name for p in out.iterdir()) if previous else None
  real_writer = array_record_module.ArrayRecordWriter

  class CrashingWriter:  # Fails once the first shard holds some documents: a crash mid-write.
    writes = 0

    def __init__(self, path, options):
      self._w = real_writer(path, options)

    def write(self, record):
      CrashingWriter.writes += 1
      if CrashingWriter.writes > 5:
        raise RuntimeError("simulated crash")
      self._w.write(record)

    def close(self):
      self._w.close()

  monkeypatch.setattr(array_record_module, "ArrayRecordWriter", CrashingWriter)
  with pytest.raises(OSError, match=r"writing the shards failed \(simulated crash\)"):
    prepare.prepare(raw, str(out), num_shards=1, overwrite=True, progress=False)
  assert not _hidden(tmp_path)
  if previous:
    assert sorted(p.name for p in out.iterdir()) == before
    assert _prepared_docs(out) == sorted(DOCS)
  else:
    assert not out.exists()


# ----------------------------------------------------------------------------------------------
# Real data (../shared) and the built-in source.


@needs_shared
def test_linux_docs_parquet_with_gpt2_tokenizer(tmp_path):
  cfg = _cfg(source="parquet", train_path=str(LINUX_DOCS), tokenizer=str(GPT2), shuffle_window=64,
             eval_path=str(LINUX_DOCS / "validation-00000-of-00001.parquet"))
  tok = data.load_tokenizer(cfg)
  assert (tok.vocab_size, tok.eos_id) == (50257, 50256)
  assert tok.encode("Hello world") == [15496, 995]
  data.check_vocab(tok, 50304)
  # Directory -> both parquet files; train reads its own path, eval its own.
  assert len(sources.resolve_files(str(LINUX_DOCS), (".parquet",))) == 2
  texts = pq.read_table(LINUX_DOCS / "validation-00000-of-00001.parquet").column("text").to_pylist()
  for text in texts[:3]:
    assert tok.decode(tok.encode(text)) == text

  evals = data.make_eval_batches(cfg, seq_len=256, global_batch_size=4, num_batches=2)
  assert len(evals) == 2
  stream = list(pipeline.iterate_tokens(evals))
  expected = tok.encode(texts[0]) + [tok.eos_id] + tok.encode(texts[1]) + [tok.eos_id]
  n = min(len(stream), len(expected))
  assert stream[:n] == expected[:n]

  it = data.make_train_iterator(cfg, seq_len=128, global_batch_size=2, seed=0)
  b = next(it)
  assert b["inputs"].max() < tok.vocab_size
  assert len(tok.decode(b["inputs"][0])) > 100


@needs_shared
def test_prepared_linux_docs_validation_matches_parquet(tmp_path):
  parquet = str(LINUX_DOCS / "validation-00000-of-00001.parquet")
  raw = _cfg(source="parquet", eval_path=parquet, tokenizer=str(GPT2))
  prepare.prepare(raw, str(tmp_path / "val"), split="eval", num_shards=1, progress=False)
  rec = _cfg(source="arrayrecord", train_path=str(tmp_path / "val"), eval_path=str(tmp_path / "val"),
             tokenizer=str(GPT2))
  kw = dict(seq_len=512, global_batch_size=8, num_batches=5)
  assert _same(data.make_eval_batches(rec, **kw), data.make_eval_batches(raw, **kw))


def test_builtin_source_needs_no_files():
  cfg = data.default_data_config()
  assert cfg.source == "builtin" and cfg.tokenizer == "byte"
  tok = data.load_tokenizer(cfg)
  assert (tok.vocab_size, tok.eos_id) == (257, 256)
  assert tok.decode(tok.encode("naïve ∑ text")) == "naïve ∑ text"
  b = next(data.make_train_iterator(cfg, seq_len=1024, global_batch_size=2, seed=0))
  assert b["inputs"].shape == (2, 1024) and b["inputs"].max() <= 256
  evals = data.make_eval_batches(cfg, seq_len=1024, global_batch_size=2, num_batches=3)
  again = data.make_eval_batches(cfg, seq_len=1024, global_batch_size=2, num_batches=3)
  assert len(evals) == 3 and _same(evals, again)  # The same held-out batches every eval.
  # Held-out documents are not training documents.
  train = {n for n, _ in data.builtin.document_names("train")}
  assert not train & {n for n, _ in data.builtin.document_names("validation")}


def test_eval_batches_stop_when_eval_data_runs_out(tmp_path):
  cfg = _cfg(source="text", eval_path=str(_write_text_dir(tmp_path / "docs")))
  evals = data.make_eval_batches(cfg, seq_len=16, global_batch_size=2, num_batches=10_000)
  assert 0 < len(evals) == len(_byte_stream(DOCS)) // 17 // 2


# ----------------------------------------------------------------------------------------------
# Bad inputs name the bad value.


def _train(cfg):
  return data.make_train_iterator(cfg, seq_len=8, global_batch_size=2, seed=0)


def test_errors_name_the_bad_value(tmp_path):
  missing = str(tmp_path / "nope.parquet")
  with pytest.raises(FileNotFoundError, match="nope.parquet"):
    _train(_cfg(source="parquet", train_path=missing))
  with pytest.raises(FileNotFoundError, match=r"\*\.zzz"):
    _train(_cfg(source="jsonl", train_path=str(tmp_path / "*.zzz")))
  with pytest.raises(ValueError, match="data.train_path"):
    _train(_cfg(source="parquet", train_path=""))
  wrong_col = _write_parquet(tmp_path / "c.parquet", column="content")
  with pytest.raises(ValueError, match="'text'.*columns: \\['content'"):
    _train(_cfg(source="parquet", train_path=str(wrong_col)))
  with pytest.raises(ValueError, match="'body'"):
    _train(_cfg(source="jsonl", train_path=str(_write_jsonl(tmp_path / "d.jsonl", field="txt")),
                text_field="body"))
  with pytest.raises(ValueError, match="'hdfs'.*builtin"):
    _train(_cfg(source="hdfs"))
  bad_tok = tmp_path / "tokenizer.json"
  bad_tok.write_text("{not json")
  with pytest.raises(ValueError, match="tokenizer.json"):
    data.load_tokenizer(_cfg(tokenizer=str(bad_tok)))
  with pytest.raises(FileNotFoundError, match="missing.json"):
    data.load_tokenizer(_cfg(tokenizer=str(tmp_path / "missing.json")))
  with pytest.raises(ValueError, match="257 tokens.*vocab_size is 256"):
    data.check_vocab(data.ByteTokenizer(), 256)
  with pytest.raises(ValueError, match="global_batch_size=3"):
    data.make_train_iterator(_cfg(), seq_len=8, global_batch_size=3, seed=0, process_count=2)
  with pytest.raises(ValueError, match="data.eval_path"):
    data.make_eval_batches(_cfg(source="parquet"), seq_len=8, global_batch_size=2, num_batches=1)


def test_added_tokens_count_in_the_tokenizer_vocabulary(tmp_path):
  """An EOS added above a tokenizer's base vocabulary (ids 0..4, <|endoftext|> = 5) counts in
  vocab_size, so check_vocab refuses a model whose embedding would end before that id."""
  from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
  hf = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2, "c": 3, "d": 4}, unk_token="<unk>"))
  hf.pre_tokenizer = pre_tokenizers.Whitespace()
  hf.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
  hf.save(str(tmp_path / "tokenizer.json"))
  tok = data.load_tokenizer(_cfg(tokenizer=str(tmp_path / "tokenizer.json")))
  assert (tok.vocab_size, tok.eos_id) == (6, 5)
  assert tok.encode("a c <|endoftext|>") == [1, 3, 5]
  data.check_vocab(tok, 6)
  with pytest.raises(ValueError, match="has 6 tokens but the model's vocab_size is 5"):
    data.check_vocab(tok, 5)


def test_a_json_file_that_is_no_tokenizer_is_named_as_such(tmp_path):
  """`tokenizers` says "expected `,` or `}` at line 1 column 5" of valid JSON of another schema."""
  cases = {'{"a": 1}': 'valid JSON but not a Hugging Face tokenizer.json (no "model" entry; it has '
                       "keys ['a'])",
           "[1, 2]": 'valid JSON but not a Hugging Face tokenizer.json (no "model" entry; it has a '
                     "JSON list)",
           "{not json": "not valid JSON (Expecting property name enclosed in double quotes: line 1 "
                        "column 2 (char 1))",
           # cut short: its last line, not json's line 3 column 1 (after the last line end)
           '{"version": "1.0",\n "model": {\n': "not valid JSON (Expecting property name enclosed "
                                                 "in double quotes: line 2 column 12 (char 30))"}
  for i, (text, why) in enumerate(cases.items()):
    path = tmp_path / f"tok{i}.json"
    path.write_text(text)
    with pytest.raises(ValueError) as e:
      data.load_tokenizer(_cfg(tokenizer=str(path)))
    assert str(e.value) == f"cannot read tokenizer file {str(path)!r} (data.tokenizer): {why}"
  with pytest.raises(ValueError, match=r"set model\.vocab_size >= 257$"):
    data.check_vocab(data.ByteTokenizer(), 256)


def test_a_text_file_that_is_not_utf8_is_named_or_skipped(tmp_path):
  """It used to be read with U+FFFD in place of its bytes, silently; newlines stay universal."""
  root = _write_text_dir(tmp_path / "docs", DOCS[:5])
  (root / "001.txt").write_bytes("caf\u00e9 au lait\r\nline two\rthree".encode("utf-8"))
  (root / "003.txt").write_bytes("first line\nnaïve, in latin-1".encode("latin-1"))
  cfg = _cfg(source="text", train_path=str(root))
  read = lambda c: list(sources.document_dataset(c, split="train", seed=0, shuffle=False,
                                                 num_epochs=1))
  byte = "naïve".encode("latin-1").index(b"\xef") + len("first line\n")
  with pytest.raises(sources.DataError) as e:
    read(cfg)
  assert str(e.value) == (f"text file {str(root / '003.txt')!r}: not UTF-8 text: line 2, byte "
                          f"{byte} (b'\\xef': invalid continuation byte)")
  cfg.on_bad_record = "skip"
  with open(root / "001.txt", encoding="utf-8") as f:  # Python's universal newlines
    crlf = f.read()
  assert read(cfg) == [DOCS[0], crlf, DOCS[2], "", DOCS[4]]


def test_empty_documents_are_not_counted_and_prepare_refuses_no_text(tmp_path, capsys):
  """Empty text files are documents of an indexed source: the too-little-data message counted
  them as non-empty, and prepare wrote (exit 0) shards of 0 tokens."""
  root = _write_text_dir(tmp_path / "docs", ["", "abc", "", "de"])
  cfg = _cfg(source="text", train_path=str(root))
  with pytest.raises(sources.DataError) as e:
    pipeline.check_one_batch(cfg, split="train", seq_len=8, batch_size=2)
  assert str(e.value) == (f"data.train_path={str(root)!r} (text) holds 2 non-empty documents, 9 "
                          "tokens with EOS; one batch needs 2 x 9 = 18 tokens")
  empty = _write_text_dir(tmp_path / "empty", ["", ""])
  out = tmp_path / "prepared"
  assert prepare.main(["--source=text", f"--input={empty}", f"--output_dir={out}"]) == 1
  assert capsys.readouterr().err.endswith(
      f"error: --input={str(empty)!r} (text) holds no text (2 documents, 0 tokens)\n")
  assert not out.exists() and not _hidden(tmp_path)
  (tmp_path / "tok.json").write_text('{"a": 1}')  # prepare's messages name its own flags
  assert prepare.main(["--source=text", f"--input={root}", f"--tokenizer={tmp_path / 'tok.json'}",
                       f"--output_dir={out}"]) == 1
  assert "(--tokenizer): valid JSON but not" in capsys.readouterr().err


@pytest.mark.parametrize("line,why", [("[1, 2]", "record is a JSON array, not an object with a field "
                                       "'body' (data.text_field)"),
                                      ('{"body": 5}', "field 'body' is a JSON number, not a string"),
                                      ('{"body": true}', "field 'body' is a JSON boolean, not a string"),
                                      # cut short: its column on its line (json said line 2 column 1)
                                      ('{"body": "x",', "not valid JSON (JSONDecodeError: Expecting "
                                       "property name enclosed in double quotes: line 1 column 14 "
                                       "(char 13)): b'{\"body\": \"x\",\\n'")])
def test_a_jsonl_record_of_the_wrong_type_is_named(tmp_path, line, why):
  """(An array was "record without field 'body'; record keys: list"; a number "is a int".)"""
  path = _write_jsonl(tmp_path / "d.jsonl", DOCS[:2])
  path.write_text(path.read_text() + line + "\n")
  cfg = _cfg(source="jsonl", train_path=str(path), text_field="body")
  with pytest.raises(sources.DataError) as e:
    list(sources.document_dataset(cfg, split="train", seed=0, shuffle=False, num_epochs=1))
  assert str(e.value) == f"{path}:3: {why}"


def test_a_parquet_text_column_that_is_not_strings_is_named(tmp_path, capsys):
  """(Integers, lists or bytes in data.text_field's column ended in a TypeError / ValueError
  traceback from the tokenizer or the packer.)"""
  for name, values, type_name in (("ints", list(range(40)), "int64"),
                                  ("lists", [["a", "b"]] * 40, "list<element: string>"),
                                  ("bytes", [b"abc" * 20] * 40, "binary")):
    path = tmp_path / f"{name}.parquet"
    pq.write_table(pa.table({"text": values, "id": list(range(40))}), path)
    cfg = _cfg(source="parquet", train_path=str(path))
    with pytest.raises(sources.DataError) as e:
      _train(cfg)
    assert str(e.value) == (f"parquet file '{path}': column 'text' (data.text_field) holds "
                            f"{type_name}, not strings; columns: ['text', 'id']")
    assert prepare.main(["--source=parquet", f"--input={path}",
                         f"--output_dir={tmp_path / 'out'}"]) == 1  # its flag named
    assert capsys.readouterr().err.splitlines()[-1].startswith(
        f"error: parquet file '{path}': column 'text' (--text_field) holds {type_name}")
  # Dictionary-encoded and large strings are text.
  texts = pa.array(DOCS).dictionary_encode()
  for column in (texts, pa.array(DOCS, pa.large_string())):
    path = tmp_path / "strings.parquet"
    pq.write_table(pa.table({"text": column}), path)
    assert sorted(_documents(_cfg(source="parquet", train_path=str(path)), 0, 1)) == sorted(DOCS)
