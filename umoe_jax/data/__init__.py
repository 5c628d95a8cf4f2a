"""Training data: sources, tokenizers, packing and the grain pipeline (see pipeline.py for the flow).

Public API (what the trainer calls)::

    from umoe_jax import data
    cfg = data.default_data_config()          # ml_collections.ConfigDict; configs/ override fields
    tok = data.load_tokenizer(cfg)            # .vocab_size, .eos_id, .encode, .decode
    data.check_vocab(tok, model_vocab_size)   # ValueError if the tokenizer is larger than the model
    it = data.make_train_iterator(cfg, seq_len=1024, global_batch_size=64, seed=0,
                                  process_index=jax.process_index(), process_count=jax.process_count())
    batch = next(it)                          # {"inputs": int32 [B, T], "targets": int32 [B, T]}
    evals = data.make_eval_batches(cfg, seq_len=1024, global_batch_size=64, num_batches=20, ...)

`it` is a `grain.DatasetIterator`: checkpoint it with Orbax as an extra item (see checkpoint.py).
Pre-tokenize a large corpus once with `python -m umoe_jax.data.prepare` (see prepare.py).
"""
from __future__ import annotations

from ml_collections import ConfigDict

from umoe_jax.config.fields import optional
from umoe_jax.data.checkpoint import restore_args, save_args
from umoe_jax.data.pipeline import load_tokenizer, make_eval_batches, make_train_iterator
from umoe_jax.data.sources import SOURCES, DataError
from umoe_jax.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, check_vocab

__all__ = [
    "ByteTokenizer", "DataError", "HFTokenizer", "SOURCES", "Tokenizer", "check_vocab",
    "default_data_config", "load_tokenizer", "make_eval_batches", "make_train_iterator",
    "restore_args", "save_args",
]


def default_data_config() -> ConfigDict:
  """Defaults: the built-in corpus with the byte tokenizer, so training runs with no downloads."""
  return ConfigDict(dict(
      # The corpus: "builtin" (text that ships with Python, no download), "parquet", "jsonl",
      # "text" (a document per file) or "arrayrecord" (shards of `python -m umoe_jax.data.prepare`).
      source="builtin",
      train_path="",             # training data: a file, a directory (walked) or a glob; a URL works
      eval_path="",              # held-out data, read like train_path; "builtin" has its own split
      text_field="text",         # the column (parquet) or key (jsonl) holding a document's text
      tokenizer="byte",          # "byte" (257 ids) or a Hugging Face tokenizer.json path
      eos_token="",              # the EOS token of a tokenizer.json; "" = detect it
      shuffle=True,              # shuffle documents (globally for indexed sources, in windows for
                                 # streamed ones); False reads them in order
      shuffle_window=10_000,     # documents per shuffle window of parquet / jsonl streams
      num_epochs=optional(int),  # passes over the corpus; None = repeat forever, reshuffled each epoch
      read_threads=4,            # threads reading and tokenizing documents of indexed sources
      worker_count=0,            # > 0: that many grain worker processes prepare batches (for slow
                                 # tokenizers); 0 = in the training process
      prefetch_batches=2,        # with worker_count=0: batches a background thread prepares ahead
      # A damaged file / row group or a bad JSON line: "error" stops naming the file and line,
      # "skip" drops it (each logged once and counted).
      on_bad_record="error",
  ))
