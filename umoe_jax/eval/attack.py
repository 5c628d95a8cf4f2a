"""Attacked text (Mutual-Inform / MomentumSMoE's "attacked WikiText-103"): seeded random word swaps.

    attacked, stats = attack_documents(corpus.documents, rate=0.025, seed=0)

The scheme (the papers do not publish theirs; this one is simple and reproducible):
  * words are the maximal runs of non-whitespace characters of the text (WikiText's tokens: words,
    punctuation, "@-@", "<unk>"); whitespace, line breaks and document boundaries are kept as they are;
  * the vocabulary is the sorted set of distinct words of all documents together;
  * exactly round(rate * number of words) word positions are chosen uniformly without replacement
    over the whole corpus (numpy `default_rng(seed)`), and each chosen word is replaced by a word
    drawn uniformly from the vocabulary minus itself (so every chosen position changes).
The word count is unchanged, so word-level perplexities of clean and attacked text share a
denominator. The same documents, rate and seed always give the same text.
"""
from __future__ import annotations

import re
from typing import Sequence

import numpy as np

from umoe_jax.eval.errors import EvalError

DEFAULT_RATE = 0.025
_WORD = re.compile(r"\S+")


def attack_documents(documents: Sequence[str], rate: float = DEFAULT_RATE,
                     seed: int = 0) -> tuple[list[str], dict]:
  """(attacked documents, {"words", "substituted", "vocabulary", "rate", "seed"})."""
  if not 0 <= rate <= 1:
    raise EvalError(f"attack rate={rate} must be in [0, 1]")
  spans = [[m.span() for m in _WORD.finditer(d)] for d in documents]
  words = [d[a:b] for d, sp in zip(documents, spans) for a, b in sp]
  vocab = sorted(set(words))
  n_sub = int(round(rate * len(words)))
  if n_sub and len(vocab) < 2:
    raise EvalError("the text has fewer than 2 distinct words: nothing to substitute with")
  rng = np.random.default_rng(seed)
  chosen = np.sort(rng.choice(len(words), size=n_sub, replace=False)) if n_sub else np.zeros(0, int)
  index = {w: i for i, w in enumerate(vocab)}
  draws = rng.integers(0, len(vocab) - 1, size=n_sub) if n_sub else np.zeros(0, int)
  replacement = {}
  for pos, r in zip(chosen.tolist(), draws.tolist()):
    own = index[words[pos]]
    replacement[pos] = vocab[r + 1 if r >= own else r]     # uniform over the vocabulary minus itself
  out, pos = [], 0
  for doc, sp in zip(documents, spans):
    pieces, last = [], 0
    for a, b in sp:
      if pos in replacement:
        pieces += [doc[last:a], replacement[pos]]
        last = b
      pos += 1
    out.append("".join(pieces) + doc[last:])
  return out, {"words": len(words), "substituted": n_sub, "vocabulary": len(vocab), "rate": rate,
               "seed": seed}
