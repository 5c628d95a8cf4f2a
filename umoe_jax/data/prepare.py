"""Tokenize a corpus once into ArrayRecord shards, for fast globally shuffled training.

    python -m umoe_jax.data.prepare --source=parquet \\
        --input=../shared/data/corpora/linux-docs/train-00000-of-00001.parquet \\
        --tokenizer=../shared/data/tokenizers/gpt2/tokenizer.json --output_dir=/data/linux-docs/train \\
        [--num_shards=4] [--text_field=text] [--split=train|validation (builtin only)]

Then train with `data.source="arrayrecord"`, `data.train_path=<output_dir>` (and the same
`data.tokenizer`; the loader checks it against metadata.json).

Output layout (`output_dir/`):
  data-00000-of-0000N.array_record ...  one record per document, in source order, dealt round-robin
                                       over the N shards (document i -> shard i % N); a record is the
                                       raw little-endian token ids of the document, *without* EOS
                                       (the loader appends it, as for raw text), dtype uint16 when
                                       vocab_size <= 65536 else uint32.
  metadata.json                        tokenizer, vocab_size, eos_id, dtype, counts, source.
Records are per document (not pre-packed chunks) so the loader can shuffle documents globally and
pack to any seq_len; ArrayRecord is written with group_size:1 so any record is one small read.

The output is written into a hidden sibling directory (`.<name>.prepare-<id>`) and swapped into
place only once complete (atomically with Linux renameat2(RENAME_EXCHANGE)), so `--overwrite`
replaces the whole previous output (no stale shards of a different --num_shards or tokenizer are
left behind), and a run that fails or is interrupted leaves the previous complete output as it was
(a hard-killed run may leave its hidden `.<name>.prepare-*` directory behind; delete it). For that,
`output_dir` may only hold a previous output (metadata.json, *.array_record); other files are
refused rather than deleted. The loader checks the shards it finds against metadata.json.

`output_dir` may be a URL (gs://bucket/tok/fineweb; any store of umoe_jax/storage, but training reads
ArrayRecord from local paths and gs:// only). array_record writes local files only, so the output is
written into a local temporary directory, then published: the previous output's metadata.json is
deleted first, then its shards, the new shards are uploaded, and metadata.json last. Object stores
have no directory swap, so metadata.json is the commit marker: the loader refuses shards without it,
and a publish that fails or is interrupted leaves an output without one (run it again); a complete
output always has the shards its metadata.json names.
"""
from __future__ import annotations

import argparse
import ctypes
import errno
import itertools
import json
import os
import re
import resource
import shutil
import sys
import uuid
from typing import Sequence

import grain
import numpy as np
from absl import logging

from umoe_jax import console, storage
from umoe_jax.data import default_data_config, sources
from umoe_jax.data.tokenizer import HFTokenizer, Tokenizer, make_tokenizer

_DOCS_PER_GROUP = 256  # Documents handed to the tokenizer at once (Rust-parallel for tokenizer.json).
_FILES_KEPT_OPEN = 64  # Open files besides the shard writers' (the input, grain's threads, ...).


shard_name = sources.shard_name


def _exchange(a: str, b: str) -> bool:
  """Atomically swaps two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
  try:
    renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
  except (AttributeError, OSError):
    return False
  renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
  at_fdcwd, rename_exchange = -100, 2
  if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
    return True
  err = ctypes.get_errno()
  if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
    return False
  raise OSError(err, os.strerror(err), a, None, b)


def _replace_dir(new: str, target: str) -> None:
  """Moves the complete directory `new` to `target`, replacing (and deleting) an existing one."""
  if not os.path.exists(target):
    os.rename(new, target)
    return
  if _exchange(new, target):  # `new` now holds the previous output.
    shutil.rmtree(new)
    return
  # Fallback (no renameat2): two renames; only between them is `target` briefly absent.
  old = f"{new}.old"
  os.rename(target, old)
  try:
    os.rename(new, target)
  except BaseException:
    os.rename(old, target)
    raise
  shutil.rmtree(old)


def _publish_remote(staged: str, output_dir: str) -> None:
  """Uploads the complete output in local `staged` to remote `output_dir`, metadata.json last
  (module docstring), after deleting the previous output there (its metadata.json first)."""
  meta = storage.join(output_dir, sources.METADATA_FILE)
  storage.remove(meta, missing_ok=True)
  if storage.isdir(output_dir):
    for name in storage.listdir(output_dir):
      if name.endswith(sources.ARRAYRECORD_SUFFIX):
        storage.remove(storage.join(output_dir, name))
  names = sorted(n for n in os.listdir(staged) if n != sources.METADATA_FILE)
  for i, name in enumerate(names):
    storage.upload_file(os.path.join(staged, name), storage.join(output_dir, name))
    logging.info("prepare: uploaded %s (%d of %d)", name, i + 1, len(names))
  storage.upload_file(os.path.join(staged, sources.METADATA_FILE), meta)


def _check_num_shards(num_shards: int) -> None:
  """At least one shard, and no more than can be open at once (every shard's writer holds its file
  open, and past the process's limit the next file opened fails: the input, named as unreadable)."""
  if num_shards < 1:
    raise ValueError(f"num_shards={num_shards} must be >= 1")
  limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]  # open files (ulimit -n)
  if limit != resource.RLIM_INFINITY and num_shards > limit - _FILES_KEPT_OPEN:
    raise ValueError(f"num_shards={num_shards}: every shard is written at once, one open file "
                     f"each, and this process may open {limit} files (ulimit -n); use at most "
                     f"{max(1, limit - _FILES_KEPT_OPEN)} shards")


def _make_staging_dir(output_dir: str, shown: str) -> str:
  """Makes the hidden sibling of `output_dir` the output is written into (module docstring); an
  OSError naming the output directory `shown` (as the caller spelled it), not the hidden one, where
  it cannot be made (a read-only or full file system, no permission)."""
  parent, name = os.path.split(output_dir)
  staging = os.path.join(parent, f".{name}.prepare-{uuid.uuid4().hex[:12]}")
  try:
    os.makedirs(parent, exist_ok=True)
    os.mkdir(staging)  # Mode from the umask, like a directory made by os.makedirs.
  except OSError as e:
    where = os.path.dirname(e.filename) if e.filename else parent
    raise OSError(f"output_dir {shown!r} cannot be written: making a directory in {where!r} "
                  f"failed ({e.strerror or e})") from e
  return staging


def _check_output_dir(output_dir: str, overwrite: bool, shown: str) -> None:
  """Refuses to replace a previous output without `overwrite`, or a directory holding other files;
  the errors name the output directory `shown` (as the caller spelled it)."""
  if not storage.exists(output_dir):
    existing = output_dir  # a local one is made below its nearest existing ancestor
    while not storage.is_url(existing) and existing != os.path.dirname(existing):
      existing = os.path.dirname(existing)
      if os.path.exists(existing):
        if not os.path.isdir(existing):  # (else makedirs' bare "[Errno 17] File exists")
          raise NotADirectoryError(f"output_dir {shown!r} cannot be created: {existing!r} "
                                   "is a file")
        break
    return
  if not storage.isdir(output_dir):
    raise NotADirectoryError(f"output_dir {shown!r} exists and is not a directory")
  entries = storage.listdir(output_dir)
  meta_path = storage.join(output_dir, sources.METADATA_FILE)
  if entries and not overwrite:
    what = (f"{storage.join(shown, sources.METADATA_FILE)!r} exists" if storage.exists(meta_path)
            else f"output_dir {shown!r} is not empty")
    raise FileExistsError(f"{what}; pass --overwrite to replace it")
  foreign = [e for e in entries if not (
      (e == sources.METADATA_FILE or e.endswith(sources.ARRAYRECORD_SUFFIX))
      and storage.isfile(storage.join(output_dir, e)))]
  if foreign:
    raise FileExistsError(
        f"output_dir {shown!r} holds files that are not a prepare output "
        f"({', '.join(map(repr, foreign[:8]))}{' ...' if len(foreign) > 8 else ''}); --overwrite "
        "replaces the whole directory, so move them away or pick another output_dir")


def _write_failed(output_dir: str, error: RuntimeError) -> OSError:
  """An OSError naming `output_dir` for array_record's writer error (a RuntimeError such as "write()
  failed: No space left on device; writing <shard>; at byte N; ...")."""
  cause = str(error).split(";")[0].strip() or type(error).__name__
  return OSError(f"output_dir {output_dir!r}: writing the shards failed ({cause}); a previous "
                 "output there is unchanged")


def _encode_group(tok: Tokenizer, texts: list[str]) -> list[np.ndarray]:
  if isinstance(tok, HFTokenizer):
    return [np.asarray(ids) for ids in tok.encode_batch(texts)]
  return [tok.encode_array(t) for t in texts]


def prepare(data_config, output_dir: str, *, split: str = "train", num_shards: int = 1,
            overwrite: bool = False, progress: bool = True) -> dict:
  """Writes `data_config`'s `split` ("train" / "eval") as ArrayRecord shards; returns the metadata.
  `progress`: a progress bar on stderr when it is a terminal (`console.progress`)."""
  from array_record.python.array_record_module import ArrayRecordWriter

  if data_config.source == "arrayrecord":
    raise ValueError("data.source='arrayrecord' is already tokenized; prepare reads raw text sources")
  _check_num_shards(num_shards)
  if not output_dir:  # (else the working directory, resolved)
    raise ValueError("output_dir='' names no directory")
  shown = output_dir  # as the caller spelled it, for the error messages
  remote = storage.is_url(output_dir)
  # Resolve symlinks: the real directory is the one swapped, next to it (same file system).
  output_dir = (storage.expand(output_dir) if remote else
                os.path.realpath(storage.expand_user(output_dir, "output_dir")))
  if remote:
    storage.check_bucket(output_dir)  # before the tokenizing, not after
  _check_output_dir(output_dir, overwrite, shown)
  tok = make_tokenizer(data_config.tokenizer, data_config.get("eos_token", ""))
  dtype = np.dtype(np.uint16 if tok.vocab_size <= 2**16 else np.uint32).newbyteorder("<")

  # The same document stream the loader reads: unshuffled, one pass, one process: file order.
  docs = sources.document_dataset(data_config, split=split, seed=0, shuffle=False, num_epochs=1)
  if isinstance(docs, grain.MapDataset):
    docs = docs.to_iter_dataset(grain.ReadOptions(num_threads=4, prefetch_buffer_size=64))
  total = sources.count_documents(data_config, split)

  if remote:  # staged locally (array_record writes local files), then published
    tmp_dir = storage.local_temp_dir("umoe-prepare-")
  else:
    tmp_dir = _make_staging_dir(output_dir, shown)
  try:
    try:
      writers = [ArrayRecordWriter(os.path.join(tmp_dir, shard_name(i, num_shards)), "group_size:1")
                 for i in range(num_shards)]
    except RuntimeError as e:
      raise _write_failed(shown, e) from e
    num_docs = num_tokens = 0
    doc_iter = iter(docs)
    with console.progress(total=total, unit="doc", desc=f"tokenizing {split}",
                          show=progress) as bar:
      while group := list(itertools.islice(doc_iter, _DOCS_PER_GROUP)):
        for ids in _encode_group(tok, group):
          try:
            writers[num_docs % num_shards].write(np.asarray(ids, dtype=dtype).tobytes())
          except RuntimeError as e:  # (a full disk, ...; not a read error of the input)
            raise _write_failed(shown, e) from e
          num_docs += 1
          num_tokens += len(ids)
        bar.set_postfix(tokens=f"{num_tokens:,}", refresh=False)  # (drawn by the update: once)
        bar.update(len(group))
    try:
      for w in writers:
        w.close()
    except RuntimeError as e:
      raise _write_failed(shown, e) from e

    path, key = sources.split_path(data_config, split)
    if num_tokens == 0:  # (empty files / texts): shards nothing could train on
      raise sources.DataError(f"{key}={path!r} ({data_config.source}) holds no text ({num_docs} "
                              f"document{'' if num_docs == 1 else 's'}, 0 tokens)")
    builtin_split = "validation" if split == "eval" else "train"
    meta = dict(
        format="one record per document: little-endian token ids, no EOS; document i in shard i % N",
        tokenizer=data_config.tokenizer, vocab_size=tok.vocab_size, eos_id=tok.eos_id,
        dtype=dtype.name, num_documents=num_docs, num_tokens=num_tokens, num_shards=num_shards,
        source=data_config.source, input=path or f"builtin:{builtin_split}",
        text_field=data_config.text_field)
    with open(os.path.join(tmp_dir, sources.METADATA_FILE), "w") as f:
      json.dump(meta, f, indent=2)
    _check_output_dir(output_dir, overwrite, shown)  # Still only a previous output (none added).
    if remote:
      _publish_remote(tmp_dir, output_dir)
    else:
      _replace_dir(tmp_dir, output_dir)
  finally:
    if os.path.exists(tmp_dir):  # Failed or interrupted: the previous output is untouched.
      shutil.rmtree(tmp_dir, ignore_errors=True)
  return meta

def main(argv: Sequence[str] | None = None) -> int:
  """The command line (module docstring). Bad input (a missing or damaged input file, a bad
  tokenizer, an output_dir that is a file or holds other files) prints one "error:" line naming it
  and returns 1; a bad flag exits 2 (argparse)."""
  p = argparse.ArgumentParser(prog="python -m umoe_jax.data.prepare", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--source", required=True, help="builtin | parquet | jsonl | text",
                 choices=[s for s in sources.SOURCES if s != "arrayrecord"])
  p.add_argument("--input", default="", help="file, directory or glob (not for builtin)")
  p.add_argument("--tokenizer", default="byte", help='"byte" or a tokenizer.json path')
  p.add_argument("--output_dir", required=True)
  p.add_argument("--num_shards", type=int, default=1)
  p.add_argument("--text_field", default=None,
                 help="parquet column / JSON key of the text (default: text)")
  p.add_argument("--eos_token", default="", help="EOS token of a tokenizer.json (default: auto)")
  p.add_argument("--split", default=None, choices=("train", "validation"),
                 help="builtin source only: which split to write (default: train)")
  p.add_argument("--overwrite", action="store_true")
  args = p.parse_args(argv)

  if args.source != "builtin" and not args.input:
    p.error(f"--input is required for --source={args.source}")
  ignored = _ignored_flag(args)
  if ignored:
    p.error(ignored)
  cfg = default_data_config()
  cfg.source = args.source
  cfg.tokenizer = args.tokenizer
  cfg.text_field = "text" if args.text_field is None else args.text_field
  cfg.eos_token = args.eos_token
  # `prepare` reads the split's path key; route --input there.
  split = "eval" if args.split == "validation" else "train"
  key = sources.split_path(cfg, split)[1]
  cfg[key.split(".")[1]] = args.input
  try:
    meta = prepare(cfg, args.output_dir, split=split, num_shards=args.num_shards,
                   overwrite=args.overwrite)
  except storage.StorageError:
    raise  # its line and hint: stdout_errors, every command's handler of a failing store
  except (ValueError, OSError) as e:  # DataError, a missing file, ...
    print(f"error: {_as_flags(str(e), key)}", file=sys.stderr)
    return 1
  print(json.dumps(meta, indent=2))
  return 0


def _ignored_flag(args: argparse.Namespace) -> str:
  """Why a flag given would be silently ignored by this --source / --tokenizer ("" if none is): a
  usage error rather than an output that is not what was asked for."""
  if args.source == "builtin" and args.input:
    return (f"--input={args.input!r} is not read by --source=builtin (it writes the built-in "
            "corpus; --split picks which split)")
  if args.source in ("builtin", "text") and args.text_field is not None:
    return (f"--text_field={args.text_field!r} is not read by --source={args.source} (its "
            "documents are whole texts, without fields); it names a parquet column or JSON key")
  if args.source != "builtin" and args.split is not None:
    return (f"--split={args.split} is not read by --source={args.source} (it picks a split of "
            "--source=builtin; --input names the data to prepare)")
  if args.eos_token and args.tokenizer in ("", "byte"):
    return (f"--eos_token={args.eos_token!r} is for a tokenizer.json --tokenizer; the byte "
            "tokenizer's EOS is id 256")
  return ""


def _as_flags(message: str, input_key: str) -> str:
  """`prepare`'s error message on one line, naming the command's flags where it names the
  arguments or config keys they set (output_dir 'x' -> --output_dir='x', data.train_path= ->
  --input=, ...)."""
  message = " ".join(message.split()).replace(f"{input_key}=", "--input=")
  message = message.replace("(data.tokenizer)", "(--tokenizer)").replace(
      "(data.text_field)", "(--text_field)")
  message = re.sub(r"(?<![-\w])output_dir '", "--output_dir='", message)
  message = re.sub(r"(?<![-\w])output_dir\b", "--output_dir", message)
  return re.sub(r"(?<![-\w])num_shards=", "--num_shards=", message)


if __name__ == "__main__":
  from umoe_jax import stdout_errors
  stdout_errors.run_and_exit(main)
