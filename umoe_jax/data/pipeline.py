"""The grain pipeline: documents -> tokens + EOS -> packed [T+1] windows -> {"inputs", "targets"} batches.

    documents (sources.document_dataset: per-process share, shuffled by seed, repeated)
      -> map: token ids of the document, then EOS            {"tokens": int32 [L+1]}
      -> ConcatThenSplitIterDataset: concatenate everything, cut into T+1 windows; the zero-padded
         last window of a finite stream is dropped            {"tokens": int32 [T+1], ...}
      -> map: inputs = window[:-1], targets = window[1:]      {"inputs": [T], "targets": [T]}
      -> batch(global_batch_size // process_count, drop_remainder=True)
      -> mp_prefetch(worker_count) if worker_count > 0, else a background thread prefetching
         `prefetch_batches` batches (overlaps input with the train step)

Batches are `{"inputs": int32 [B, T], "targets": int32 [B, T]}`, B = global_batch_size //
process_count per process. Windows do not overlap, so the concatenation of all windows is exactly
the token stream (doc_1, EOS, doc_2, EOS, ...). Documents are packed back to back with no
`segment_ids`: attention crosses document boundaries, and the EOS between documents tells the model
that context is unrelated (the GPT-2 / nanoGPT convention); there is no padding, so no loss mask.

Every stage is a grain dataset, so the whole iterator state (position in the chunk list, open
readers, shuffle window, packing remainder, prefetch) is `get_state()` / `set_state()` JSON, and a
restored iterator yields exactly the batches the uninterrupted one would have yielded. The order is a
pure function of (data, seed, process_index, process_count, worker_count).

Too little data: a training stream is repeated forever, so a process whose share of one epoch holds
no full batch (an empty file, documents that are all empty, fewer tokens than one batch) would spin
through empty epochs. `make_train_iterator` therefore first reads one pass of this process's share,
in file order, until it has one batch of tokens (cheap: a batch's worth of documents on a real
corpus), and raises `sources.DataError` naming the path, the documents and the tokens it found.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Any, Iterator

from absl import flags
import grain
import numpy as np

from umoe_jax.data import sources
from umoe_jax.data.sources import DataError
from umoe_jax.data.tokenizer import Tokenizer, make_tokenizer

Batch = dict[str, np.ndarray]


def load_tokenizer(data_config) -> Tokenizer:
  """The tokenizer named by `data_config.tokenizer` ("byte" or a tokenizer.json path).

  For `source="arrayrecord"` it also checks that the shards of both splits were written with a
  tokenizer of the same vocabulary size and EOS id (metadata.json), since token ids there are already
  fixed (held-out shards of another tokenizer would be scored as this one's ids).
  """
  tok = make_tokenizer(data_config.tokenizer, data_config.get("eos_token", ""))
  if data_config.source != "arrayrecord":
    return tok
  for key in ("train_path", "eval_path"):
    path = data_config.get(key, "")
    if not path:
      continue
    try:
      _, meta = sources.arrayrecord_files(path, f"data.{key}")
    except FileNotFoundError:
      if key == "train_path":
        raise
      continue  # held-out shards are named where they are read (unused with train.eval_every=0)
    if (meta["vocab_size"], meta["eos_id"]) != (tok.vocab_size, tok.eos_id):
      raise ValueError(
          f"data.tokenizer={data_config.tokenizer!r} (vocab {tok.vocab_size}, eos {tok.eos_id}) does "
          f"not match the tokenizer the shards in data.{key}={path!r} were prepared with: "
          f"{meta['tokenizer']!r} (vocab {meta['vocab_size']}, eos {meta['eos_id']})")
  return tok


@dataclasses.dataclass(frozen=True)
class _Tokenize:
  """document (str, or int array from ArrayRecord) -> {"tokens": int32 [L+1]} ending in EOS."""
  tokenizer: Any

  def __call__(self, doc) -> dict[str, np.ndarray]:
    ids = self.tokenizer.encode_array(doc) if isinstance(doc, str) else doc
    out = np.empty(len(ids) + 1, np.int32)
    out[:-1] = ids
    out[-1] = self.tokenizer.eos_id
    return {"tokens": out}


def _is_full(window: dict[str, np.ndarray]) -> bool:
  # ConcatThenSplit pads only the last window of a finite stream (segment id 0 marks padding).
  return bool(window["tokens_segment_ids"][-1] != 0)


def _to_example(window: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  tokens = window["tokens"]  # [T+1]
  return {"inputs": tokens[:-1], "targets": tokens[1:]}


def _slices_as_tuples(state: Any) -> Any:
  """A state after a JSON round trip, with ConcatThenSplit's (start, stop) slices as tuples again.

  grain 0.2.18's packer stores slices as tuples and tests `slice != (-1, -1)`; JSON turns them into
  lists, so `[-1, -1] != (-1, -1)` would make a restored packer invent a remainder and skip data.
  """
  if isinstance(state, dict):
    return {k: ({f: tuple(sl) for f, sl in v.items()} if k == "remainder_slices"
                else _slices_as_tuples(v)) for k, v in state.items()}
  if isinstance(state, list):
    return [_slices_as_tuples(v) for v in state]
  return state


class _JsonStateIterator(grain.DatasetIterator):
  """Passes elements through; `set_state` accepts states that went through JSON (Orbax files)."""

  def __next__(self):
    return next(self._parent)

  def get_state(self) -> dict[str, Any]:
    return self._parent.get_state()

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(_slices_as_tuples(state))


class _JsonStateIterDataset(grain.IterDataset):

  def __iter__(self) -> grain.DatasetIterator:
    return _JsonStateIterator(self._parent.__iter__())


def per_process_batch_size(global_batch_size: int, process_count: int) -> int:
  if global_batch_size <= 0 or global_batch_size % process_count:
    raise ValueError(f"global_batch_size={global_batch_size} must be a positive multiple of "
                     f"process_count={process_count}")
  return global_batch_size // process_count


def batched_dataset(data_config, *, split: str, seq_len: int, batch_size: int, seed: int,
                    shuffle: bool, num_epochs: int | None, process_index: int = 0,
                    process_count: int = 1, tokenizer: Tokenizer | None = None) -> grain.IterDataset:
  """The `grain.IterDataset` of per-process batches {"inputs", "targets"}: int32 [batch_size, seq_len].

  No prefetching or worker processes; `make_train_iterator` adds those.
  """
  if seq_len <= 0:
    raise ValueError(f"seq_len={seq_len} must be positive")
  tok = tokenizer or load_tokenizer(data_config)
  docs = sources.document_dataset(
      data_config, split=split, seed=seed, shuffle=shuffle, num_epochs=num_epochs,
      process_index=process_index, process_count=process_count)
  ds = docs.map(_Tokenize(tok))
  if isinstance(ds, grain.MapDataset):
    # Reader threads read and tokenize documents ahead of the packer, keeping their order.
    threads = data_config.get("read_threads", 4)
    ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=4 * threads))
  ds = grain.experimental.ConcatThenSplitIterDataset(ds, length_struct={"tokens": seq_len + 1})
  ds = ds.filter(_is_full).map(_to_example)
  return ds.batch(batch_size, drop_remainder=True)


def _split_name(data_config, split: str) -> str:
  path, key = sources.split_path(data_config, split)
  return f"{key}={path!r}" if data_config.source != "builtin" else f"the built-in corpus ({split})"


def check_one_batch(data_config, *, split: str, seq_len: int, batch_size: int,
                    process_index: int = 0, process_count: int = 1,
                    tokenizer: Tokenizer | None = None) -> None:
  """Raises DataError unless one pass over this process's share of `split` holds one batch.

  Packing cuts the token stream (documents + EOS) into windows of seq_len + 1 tokens, so a batch
  needs batch_size * (seq_len + 1) tokens. Reads documents in file order and stops as soon as there
  are enough; the message gives the documents and tokens of the whole pass otherwise.
  """
  tok = tokenizer or load_tokenizer(data_config)
  need = batch_size * (seq_len + 1)
  docs = sources.document_dataset(data_config, split=split, seed=0, shuffle=False, num_epochs=1,
                                   process_index=process_index, process_count=process_count)
  skipped_before = sources.bad_record.skipped
  it = iter(docs)
  n_docs = n_tokens = 0
  try:
    for doc in it:
      length = len(tok.encode_array(doc) if isinstance(doc, str) else doc)
      n_docs += length > 0  # (indexed sources pass empty files / records on)
      n_tokens += length + 1  # + EOS
      if n_tokens >= need:
        return
  finally:
    close = getattr(it, "close", None)
    if close is not None:
      close()
  share = f" (the share of process {process_index} of {process_count})" if process_count > 1 else ""
  skipped = sources.bad_record.skipped - skipped_before
  dropped = f", {skipped} bad records skipped" if skipped else ""
  found = ("0 documents (no rows, or only empty / null texts)" if n_docs == 0 else
           f"{n_docs} non-empty document{'s' if n_docs > 1 else ''}, {n_tokens:,} tokens with EOS")
  raise DataError(
      f"{_split_name(data_config, split)} ({data_config.source}){share} holds {found}{dropped}; one "
      f"batch needs {batch_size} x {seq_len + 1} = {need:,} tokens",
      hint="use more data, or lower train.global_batch_size / train.seq_len")


def make_train_iterator(data_config, *, seq_len: int, global_batch_size: int, seed: int,
                        process_index: int = 0, process_count: int = 1) -> grain.DatasetIterator:
  """The checkpointable iterator of this process's training batches.

  Yields {"inputs": int32 [B, T], "targets": int32 [B, T]} with B = global_batch_size //
  process_count and T = seq_len; forever if `data_config.num_epochs` is None. Save / restore its
  position with `it.get_state()` / `it.set_state(state)` or with Orbax through
  `grain.checkpoint.CheckpointSave(it)` / `grain.checkpoint.CheckpointRestore(it)` (see
  `umoe_jax.data.checkpoint`). Raises DataError (`check_one_batch`) if one epoch of this process's
  share holds no full batch.
  """
  batch_size = per_process_batch_size(global_batch_size, process_count)
  tok = load_tokenizer(data_config)
  check_one_batch(data_config, split="train", seq_len=seq_len, batch_size=batch_size,
                  process_index=process_index, process_count=process_count, tokenizer=tok)
  ds = batched_dataset(
      data_config, split="train", seq_len=seq_len, batch_size=batch_size, seed=seed,
      shuffle=data_config.shuffle, num_epochs=data_config.num_epochs,
      process_index=process_index, process_count=process_count, tokenizer=tok)
  if data_config.worker_count > 0:
    # Worker w runs the whole pipeline on its slice w::worker_count of the document stream; outputs
    # are taken round-robin, so the order is deterministic for a given worker_count (but differs
    # from worker_count=0).
    if not flags.FLAGS.is_parsed():  # grain reads its absl flags in workers; outside absl.app.run
      flags.FLAGS.mark_as_parsed()   # (scripts, tests) take their defaults.
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=data_config.worker_count))
  elif data_config.get("prefetch_batches", 0) > 0:
    ds = grain.experimental.ThreadPrefetchIterDataset(
        ds, prefetch_buffer_size=data_config.prefetch_batches)
  return iter(_JsonStateIterDataset(ds))


def make_eval_batches(data_config, *, seq_len: int, global_batch_size: int, num_batches: int,
                      process_index: int = 0, process_count: int = 1) -> list[Batch]:
  """The first `num_batches` held-out batches of this process, in file order, as a list.

  Same packing as training, no shuffle, one pass; the list is built once, so every evaluation sees
  the same batches. If the eval data holds fewer batches, the list is shorter (with a warning).
  Eval data: `data_config.eval_path` (the built-in source uses its held-out split).
  """
  ds = batched_dataset(
      data_config, split="eval", seq_len=seq_len,
      batch_size=per_process_batch_size(global_batch_size, process_count), seed=0, shuffle=False,
      num_epochs=1, process_index=process_index, process_count=process_count)
  it = iter(ds)
  batches = list(itertools.islice(it, num_batches))
  it.close()
  if len(batches) < num_batches:
    logging.warning("eval data %r holds only %d batches of %d x %d tokens (asked for %d)",
                    data_config.eval_path or data_config.source, len(batches), global_batch_size,
                    seq_len, num_batches)
  return batches


def iterate_tokens(batches: Iterator[Batch]) -> Iterator[int]:
  """The token stream behind a sequence of batches (row by row: inputs + last target). For tests."""
  for b in batches:
    for inputs, targets in zip(b["inputs"], b["targets"]):
      yield from inputs.tolist()
      yield int(targets[-1])
