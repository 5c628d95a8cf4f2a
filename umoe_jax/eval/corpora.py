"""Evaluation corpora for perplexity: parquet / JSON-lines / text files and WikiText files.

    corpus = read_corpus("../shared/data/wikitext-2/wiki.test.tokens")     # format "auto"
    corpus.documents      # list[str], scored one by one
    corpus.words          # WikiText word count (None for other corpora)

Formats (`fmt`, "auto" picks by file suffix; a path is a file, a directory or a glob):
  parquet   one document per row of column `text_field` (FineWeb-Edu layout)          .parquet
  jsonl     one document per line, field `text_field`                                 .jsonl .json
  text      one document per file                                                     anything else
  wikitext  the whole file is one document (the test set as one stream, as WikiText-103
            results are computed), with word counts                                   .tokens .raw

WikiText word count (the denominator of word-level perplexity): W = whitespace-separated words +
line ends, i.e. every word-level token of the original file plus one <eos> per line, the counts
the word-level WikiText models are scored on and that the MoA / SwitchHead / UMoE WikiText-103
perplexities are normalised by: 245,569 for the test and 217,646 for the validation split (WikiText-2
and WikiText-103 share them). It is counted on the original text, before `--detokenize`. (The raw
file in ../shared/data has no blank lines, so it counts 244,102; use the .tokens file for paper
numbers.) Windows line ends (CRLF) are read as "\\n".

`detokenize_wikitext` undoes WikiText's tokenisation (" @-@ " -> "-", spaces before punctuation and
inside brackets and quotes, ...), for models trained on ordinary text.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Optional

from umoe_jax import storage
from umoe_jax.data.sources import resolve_files
from umoe_jax.eval.errors import EvalError
from umoe_jax.eval.jsonl import read_records

FORMATS = ("auto", "parquet", "jsonl", "text", "wikitext")


@dataclasses.dataclass
class Corpus:
  name: str
  documents: list[str]                  # what is scored (detokenized if asked)
  words: Optional[list[int]] = None     # WikiText word count of each original document
  originals: Optional[list[str]] = None  # with --detokenize: the documents before it, line for line


def wikitext_words(text: str) -> int:
  """Word-level tokens of WikiText text: words + one <eos> per line end (module docstring)."""
  return len(text.split()) + text.count("\n")


def words_counted(name: str, words: int, line_ends: int) -> str:
  """What a word count of corpus `name` holds, for the output: its words and line ends, and for a
  .raw file that it is that file's own (the papers count the word-level .tokens files)."""
  text = (f"words = {words - line_ends:,} whitespace-separated words + {line_ends:,} line ends "
          "(one <eos> per line, blank lines included)")
  if name.endswith(".raw"):
    text += (f"; counted on the raw file {name}, its own words and lines: the papers count the "
             "word-level .tokens file (245,569 for the WikiText test split, 217,646 for "
             "validation), so this word_ppl is not comparable to theirs")
  return text


# (pattern, replacement) applied in order; WikiText puts spaces around every token.
_DETOK_RULES = [
    (r" @([-,.])@ ", r"\1"),            # number separators: 1 @,@ 000 -> 1,000
    (r" ([.,:;!?%])", r"\1"),           # no space before punctuation
    (r" 's\b", "'s"), (r"s ' ", "s' "), (r" n't\b", "n't"),
    (r"\( ", "("), (r" \)", ")"), (r"\[ ", "["), (r" \]", "]"), (r"\{ ", "{"), (r" \}", "}"),
    (r'" ([^"\n]*?) "', r'"\1"'),       # " quoted " -> "quoted"
    (r"= = = ", "=== "), (r" = = =", " ==="), (r"= = ", "== "), (r" = =", " =="),
]


def detokenize_wikitext(text: str) -> str:
  """WikiText's tokenised form -> ordinary text (see `_DETOK_RULES`), line by line: no rule
  matches a line end, so line i of the result is line i of `text` detokenized."""
  for pattern, repl in _DETOK_RULES:
    text = re.sub(pattern, repl, text)
  return text


def _format_of(path: str, fmt: str) -> str:
  if fmt != "auto":
    return fmt
  if path.endswith(".parquet"):
    return "parquet"
  if path.endswith((".jsonl", ".json")):
    return "jsonl"
  if path.endswith((".tokens", ".raw")):
    return "wikitext"
  return "text"


def _read_text(path: str) -> str:
  try:
    with storage.open(path, encoding="utf-8") as f:   # universal newlines: CRLF -> "\n"
      return f.read()
  except UnicodeDecodeError as e:  # (read() decodes the whole file: e.start is its byte offset)
    with storage.open(path, "rb") as f:
      line = f.read(e.start).count(b"\n") + 1
    raise EvalError(f"{path}:{line}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _read_jsonl(path: str, text_field: str) -> list[str]:
  docs = []
  for where, rec in read_records(path):
    if not isinstance(rec, dict) or not isinstance(rec.get(text_field), str):
      raise EvalError(f"{where}: expected an object with a string field {text_field!r} "
                      "(--text_field)")
    docs.append(rec[text_field])
  return docs


def _read_parquet(path: str, text_field: str) -> list[str]:
  import pyarrow.parquet as pq
  try:
    arrow_fs, arrow_path = storage.arrow_filesystem(path)  # remote files: by byte range
    pf = pq.ParquetFile(arrow_path, filesystem=arrow_fs) if arrow_fs else pq.ParquetFile(path)
  except storage.StorageError:  # the store failed (after retries), not the file: stdout_errors
    raise                       # reports it with its hint
  except Exception as e:   # pyarrow.ArrowInvalid and friends
    raise EvalError(f"{path}: not a readable parquet file ({e})") from None
  if text_field not in pf.schema_arrow.names:
    raise EvalError(f"{path}: no column {text_field!r} (--text_field); columns: "
                    f"{pf.schema_arrow.names}")
  return [t for t in pf.read(columns=[text_field]).column(0).to_pylist() if t]


def read_corpus(path: str, fmt: str = "auto", *, text_field: str = "text",
                detokenize: bool = False) -> Corpus:
  """The documents under `path` (module docstring); empty documents are dropped."""
  if fmt not in FORMATS:
    raise EvalError(f"unknown corpus format {fmt!r}; valid: {', '.join(FORMATS)}")
  try:
    files = resolve_files(path, key="--data")
  except ValueError as e:
    raise EvalError(str(e)) from None
  formats = {_format_of(f, fmt) for f in files}
  if len(formats) > 1:
    raise EvalError(f"--data={path!r} mixes formats {sorted(formats)}; pass one kind of file or "
                    "--format")
  kind = formats.pop()
  docs: list[str] = []
  for f in files:
    if kind == "parquet":
      docs += _read_parquet(f, text_field)
    elif kind == "jsonl":
      docs += _read_jsonl(f, text_field)
    else:
      docs.append(_read_text(f))
  docs = [d for d in docs if d]
  if not docs:
    raise EvalError(f"--data={path!r}: no text")
  words = [wikitext_words(d) for d in docs] if kind == "wikitext" else None
  originals = None
  if kind == "wikitext" and detokenize:
    originals, docs = docs, [detokenize_wikitext(d) for d in docs]
  return Corpus(name=os.path.basename(os.path.normpath(path)), documents=docs, words=words,
                originals=originals)
