"""Tokenizers: a dependency-free byte-level default and Hugging Face `tokenizer.json` files.

Both expose the same small interface (`Tokenizer`): `vocab_size`, `eos_id`, `encode(str) -> list[int]`,
`encode_batch(list[str]) -> list[list[int]]`, `encode_array(str) -> int32 [L]` and
`decode(list[int]) -> str`. The pipeline only ever
calls `encode`/`encode_batch` on one document at a time and appends `eos_id` itself, so tokenizers
are used *without* their own special-token post-processing (no BOS/EOS insertion by the tokenizer).

`config.tokenizer` chooses:
  * "byte": UTF-8 bytes 0..255 plus EOS = 256 (V = 257). Lossless for any text, needs no files.
  * a path or URL of a `tokenizer.json` (e.g. ../shared/data/tokenizers/gpt2/tokenizer.json,
    gs://bucket/tok/tokenizer.json; read through umoe_jax/storage): loaded with the `tokenizers` library; EOS is `config.eos_token` if set, else the first of `_EOS_CANDIDATES` that
    the vocabulary contains.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from umoe_jax import json_errors, storage

# Common end-of-document tokens, most specific first: GPT-2 / GPT-NeoX, Llama-3, Llama-2/T5, Gemma.
_EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")


class Tokenizer(Protocol):
  vocab_size: int
  eos_id: int

  def encode(self, text: str) -> list[int]: ...

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

  def encode_array(self, text: str) -> np.ndarray: ...  # int32 [L]; what the pipeline uses.

  def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
  """UTF-8 bytes as tokens: ids 0..255 are bytes, 256 is EOS. V = 257."""

  name = "byte"
  vocab_size = 257
  eos_id = 256

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [self.encode(t) for t in texts]

  def encode_array(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

  def decode(self, ids: Sequence[int]) -> str:
    # EOS (and any out-of-range id) has no bytes; a cut inside a multi-byte character decodes to U+FFFD.
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
  """A Hugging Face `tokenizers.Tokenizer` loaded from a `tokenizer.json` file."""

  def __init__(self, path: str, eos_token: str = ""):
    import tokenizers  # Imported lazily: the byte tokenizer needs nothing.

    if storage.isdir(path):  # Accept the folder of a Hugging Face tokenizer too.
      path = storage.join(path, "tokenizer.json")
    if not storage.isfile(path):
      raise FileNotFoundError(f"tokenizer file not found: {path!r} (data.tokenizer)")
    text = storage.read_text(path, errors="replace")
    try:
      self._tok = tokenizers.Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON.
      raise ValueError(f"cannot read tokenizer file {path!r} (data.tokenizer): "
                       f"{_not_a_tokenizer(text) or e}") from e
    self.name = path
    # Added tokens (e.g. <|endoftext|>) can sit above the base vocabulary: count them.
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    candidates = (eos_token,) if eos_token else _EOS_CANDIDATES
    ids = [self._tok.token_to_id(t) for t in candidates]
    found = [i for i in ids if i is not None]
    if not found:
      raise ValueError(
          f"tokenizer {path!r} has no end-of-document token among {list(candidates)}; "
          "set data.eos_token to one of its tokens")
    self.eos_id = int(found[0])

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    # Rust-side parallel over documents (prepare uses this); same ids as `encode` one by one.
    return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

  def encode_array(self, text: str) -> np.ndarray:
    return np.asarray(self.encode(text), dtype=np.int32)

  def decode(self, ids: Sequence[int]) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _not_a_tokenizer(text: str) -> str:
  """Why `text` is no tokenizer.json, where `tokenizers`' own message misleads ("expected `,` or
  `}` at line 1 column 5" for valid JSON of another schema); "" to keep its message."""
  import json
  try:
    data = json.loads(text)
  except ValueError as e:
    return f"not valid JSON ({json_errors.message(e)})"
  if not isinstance(data, dict) or "model" not in data:
    what = f"keys {sorted(data)[:8]}" if isinstance(data, dict) else f"a JSON {type(data).__name__}"
    return (f"valid JSON but not a Hugging Face tokenizer.json (no \"model\" entry; it has "
            f"{what})")
  return ""


def make_tokenizer(spec: str, eos_token: str = "") -> Tokenizer:
  """"byte" (or "") -> ByteTokenizer; anything else is a path to a tokenizer.json."""
  if spec in ("", "byte"):
    return ByteTokenizer()
  return HFTokenizer(storage.expand(spec), eos_token=eos_token)


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int) -> None:
  """Raises ValueError when token ids could index past the model's embedding table."""
  if tokenizer.vocab_size > model_vocab_size:
    raise ValueError(
        f"tokenizer {getattr(tokenizer, 'name', type(tokenizer).__name__)!r} has "
        f"{tokenizer.vocab_size} tokens but the model's vocab_size is {model_vocab_size}; "
        f"set model.vocab_size >= {tokenizer.vocab_size}")
