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
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
from typing import Sequence

import grain
import numpy as np
from tqdm import tqdm

from umoe_jax.data import default_data_config, sources
from umoe_jax.data.tokenizer import HFTokenizer, Tokenizer, make_tokenizer

_DOCS_PER_GROUP = 256  # Documents handed to the tokenizer at once (Rust-parallel for tokenizer.json).


def shard_name(index: int, num_shards: int) -> str:
  return f"data-{index:05d}-of-{num_shards:05d}{sources.ARRAYRECORD_SUFFIX}"


def _encode_group(tok: Tokenizer, texts: list[str]) -> list[np.ndarray]:
  if isinstance(tok, HFTokenizer):
    return [np.asarray(ids) for ids in tok.encode_batch(texts)]
  return [tok.encode_array(t) for t in texts]


def prepare(data_config, output_dir: str, *, split: str = "train", num_shards: int = 1,
            overwrite: bool = False, progress: bool = True) -> dict:
  """Writes `data_config`'s `split` ("train" / "eval") as ArrayRecord shards; returns the metadata."""
  from array_record.python.array_record_module import ArrayRecordWriter

  if data_config.source == "arrayrecord":
    raise ValueError("data.source='arrayrecord' is already tokenized; prepare reads raw text sources")
  if num_shards < 1:
    raise ValueError(f"num_shards={num_shards} must be >= 1")
  meta_path = os.path.join(output_dir, sources.METADATA_FILE)
  if os.path.exists(meta_path) and not overwrite:
    raise FileExistsError(f"{meta_path!r} exists; pass --overwrite to replace it")
  tok = make_tokenizer(data_config.tokenizer, data_config.get("eos_token", ""))
  dtype = np.dtype(np.uint16 if tok.vocab_size <= 2**16 else np.uint32).newbyteorder("<")

  # The same document stream the loader reads: unshuffled, one pass, one process: file order.
  docs = sources.document_dataset(data_config, split=split, seed=0, shuffle=False, num_epochs=1)
  if isinstance(docs, grain.MapDataset):
    docs = docs.to_iter_dataset(grain.ReadOptions(num_threads=4, prefetch_buffer_size=64))
  total = sources.count_documents(data_config, split)

  os.makedirs(output_dir, exist_ok=True)
  writers = [ArrayRecordWriter(os.path.join(output_dir, shard_name(i, num_shards)), "group_size:1")
             for i in range(num_shards)]
  num_docs = num_tokens = 0
  doc_iter = iter(docs)
  with tqdm(total=total, unit="doc", disable=not progress, desc=f"tokenizing {split}") as bar:
    while group := list(itertools.islice(doc_iter, _DOCS_PER_GROUP)):
      for ids in _encode_group(tok, group):
        writers[num_docs % num_shards].write(np.asarray(ids, dtype=dtype).tobytes())
        num_docs += 1
        num_tokens += len(ids)
      bar.update(len(group))
      bar.set_postfix(tokens=f"{num_tokens:,}")
  for w in writers:
    w.close()

  path, _ = sources.split_path(data_config, split)
  builtin_split = "validation" if split == "eval" else "train"
  meta = dict(
      format="one record per document: little-endian token ids, no EOS; document i in shard i % N",
      tokenizer=data_config.tokenizer, vocab_size=tok.vocab_size, eos_id=tok.eos_id,
      dtype=dtype.name, num_documents=num_docs, num_tokens=num_tokens, num_shards=num_shards,
      source=data_config.source, input=path or f"builtin:{builtin_split}",
      text_field=data_config.text_field)
  with open(meta_path, "w") as f:
    json.dump(meta, f, indent=2)
  return meta


def main(argv: Sequence[str] | None = None) -> None:
  p = argparse.ArgumentParser(prog="python -m umoe_jax.data.prepare", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--source", required=True, help="builtin | parquet | jsonl | text")
  p.add_argument("--input", default="", help="file, directory or glob (not for builtin)")
  p.add_argument("--tokenizer", default="byte", help='"byte" or a tokenizer.json path')
  p.add_argument("--output_dir", required=True)
  p.add_argument("--num_shards", type=int, default=1)
  p.add_argument("--text_field", default="text", help="parquet column / JSON key of the text")
  p.add_argument("--eos_token", default="", help="EOS token of a tokenizer.json (default: auto)")
  p.add_argument("--split", default="train", choices=("train", "validation"),
                 help="builtin source only: which split to write")
  p.add_argument("--overwrite", action="store_true")
  args = p.parse_args(argv)

  cfg = default_data_config()
  cfg.source = args.source
  cfg.tokenizer = args.tokenizer
  cfg.text_field = args.text_field
  cfg.eos_token = args.eos_token
  sources.check_source(cfg.source)
  if cfg.source != "builtin" and not args.input:
    p.error(f"--input is required for --source={cfg.source}")
  # `prepare` reads the split's path key; route --input there.
  split = "eval" if args.split == "validation" else "train"
  cfg[sources.split_path(cfg, split)[1].split(".")[1]] = args.input
  meta = prepare(cfg, args.output_dir, split=split, num_shards=args.num_shards,
                 overwrite=args.overwrite)
  print(json.dumps(meta, indent=2))


if __name__ == "__main__":
  main()
