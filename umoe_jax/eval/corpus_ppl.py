"""Perplexity of a corpus with sliding-window scoring: token-level, word-level (WikiText), bits/byte.

    out = corpus_perplexity(Scorer(model, batch_size=16), tokenizer, corpus.documents,
                            words=corpus.words, context=1024, stride=512)
    out["token_ppl"], out["word_ppl"], out["bits_per_byte"]

Each document is tokenized alone and preceded by one prefix token (BOS if given, else EOS: the
training stream puts EOS between documents), so its first token is predicted too. The tokens are
scored in windows of at most `context` inputs; the first window scores its first min(N, context)
tokens, every later one the next `stride` tokens given the `context` tokens before its end:

    seq = [prefix] + tokens                 # N + 1 ids; target j is tokens[j] = seq[j + 1]
    window ends e_0 = min(N, context), e_i = min(N, e_{i-1} + stride)
    window i: inputs seq[max(0, e_i - context) : e_i], scores targets e_{i-1} .. e_i - 1

so every token is scored exactly once, with at least context - stride + 1 tokens of left context
(all of them near the start) and at most `context`. stride = context (the default) is
lm-evaluation-harness's `loglikelihood_rolling`; stride = 1 gives every token the full `context`
window (the slowest, and the best perplexity). Results do not depend on how windows are batched.

Metrics (NLL in nats, summed over all scored tokens of all documents):
  token_ppl        exp(NLL / tokens)
  word_ppl         exp(NLL / words), words = WikiText word count of the original text
                   (`corpora.wikitext_words`; only when `words` are given)
  bits_per_byte    NLL / (ln 2 * UTF-8 bytes of the scored text)
  mean_document_ppl  mean over documents of exp(document NLL / its tokens) (UMoE's FineWeb number)

`max_tokens` scores only the first tokens of the corpus (documents in order, the last one cut);
a cut document's bytes and words are counted on the decoded scored tokens (a cut inside a
multi-byte character decodes its 1-3 scored bytes to U+FFFD, 3 bytes: off by at most 2 bytes; the
tokenizer interface has no byte-exact decode for every kind of tokenizer). A detokenized WikiText
document (`originals` given) is cut at its last complete line instead, and its words are those of
the original lines (detokenizing merges words: "1 @,@ 000" is three, "1,000" one).
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import numpy as np

from umoe_jax import console
from umoe_jax.eval.corpora import wikitext_words
from umoe_jax.eval.errors import EvalError
from umoe_jax.eval.scoring import Scorer, Window


def rolling_windows(tokens: Sequence[int], prefix: int, context: int, stride: int) -> list[Window]:
  """The windows that score every token of `tokens` once (module docstring): (inputs, targets, k)."""
  if context < 1 or not 1 <= stride <= context:
    raise EvalError(f"need context >= 1 and 1 <= stride <= context, got context={context}, "
                    f"stride={stride}")
  seq, n = [prefix] + list(tokens), len(tokens)
  out, done = [], 0
  while done < n:
    end = min(n, context if done == 0 else done + stride)
    a = max(0, end - context)
    out.append((seq[a:end], seq[a + 1:end + 1], end - done))
    done = end
  return out


def window_sizes(scorer: Scorer, context: Optional[int], stride: Optional[int]) -> tuple[int, int]:
  """(context, stride) with their defaults: max_seq_len, and the context (0 is no default)."""
  context = scorer.max_seq_len if context is None else context
  return context, context if stride is None else stride


def _safe_exp(x: float) -> float:
  return math.exp(min(x, 700.0))


def document_loglikelihoods(scorer: Scorer, token_lists: Sequence[Sequence[int]], prefix: int, *,
                            context: Optional[int] = None, stride: Optional[int] = None,
                            progress: Optional[Callable[[int], None]] = None) -> np.ndarray:
  """Sum of log p(token) over each document's tokens (float64 [D]); defaults: context =
  max_seq_len, stride = context. `progress(n)` is told the tokens scored, batch by batch."""
  given = context
  context, stride = window_sizes(scorer, context, stride)
  if context > scorer.max_seq_len:
    raise EvalError(f"--context={context} exceeds the model's max_seq_len={scorer.max_seq_len}")
  if context < 1:
    raise EvalError(f"--context={context} must be >= 1")
  if not 1 <= stride <= context:
    default = "" if given is not None else " (default: the model's max_seq_len)"
    raise EvalError(f"--stride={stride} must be in [1, --context={context}]{default}")
  owner, wins = [], []
  for i, toks in enumerate(token_lists):
    for w in rolling_windows(toks, prefix, context, stride):
      owner.append(i)
      wins.append(w)
  ll, _ = scorer.score_windows(
      wins, progress and (lambda idx: progress(sum(wins[j][2] for j in idx))))
  out = np.zeros(len(token_lists))
  np.add.at(out, np.asarray(owner, np.int64), ll)
  return out


def _first_lines(text: str, n: int) -> str:
  """The first n lines of `text`, each with its line end."""
  end = 0
  for _ in range(n):
    end = text.index("\n", end) + 1
  return text[:end]


def truncate(tokenizer, documents: Sequence[str], words: Optional[Sequence[int]],
             max_tokens: Optional[int], originals: Optional[Sequence[str]] = None
             ) -> tuple[list[str], Optional[list[int]], list[list[int]]]:
  """(documents, words, token lists) of the first `max_tokens` tokens (None: all) of the corpus:
  documents in order, the last one cut (its text then is the decoded scored tokens, and its words
  those of that text; with `originals`, the detokenized documents' originals line for line, it
  ends at its last complete line, with the words of those original lines); documents that encode
  to no tokens are dropped."""
  if max_tokens is not None and max_tokens < 1:
    raise EvalError(f"--max_tokens={max_tokens} must be >= 1")
  texts, counts, token_lists = [], [], []
  budget = max_tokens
  for i, doc in enumerate(documents):
    toks = list(tokenizer.encode(doc))
    if not toks:
      continue
    n_words = words[i] if words is not None else None
    cut = budget is not None and len(toks) > budget
    if cut:
      doc = tokenizer.decode(toks[:budget])
      if originals is not None:
        lines = doc.count("\n")              # complete lines among the scored tokens
        doc = _first_lines(documents[i], lines)
        n_words = wikitext_words(_first_lines(originals[i], lines))
        toks = list(tokenizer.encode(doc))
      else:
        toks = toks[:budget]
        n_words = wikitext_words(doc) if words is not None else None
      if not toks:                            # the first line alone is over the budget
        if not token_lists:  # else "the corpus encodes to no tokens", which it does not
          first = len(tokenizer.encode(_first_lines(documents[i], 1)))
          raise EvalError(f"--max_tokens={max_tokens} is shorter than the corpus's first line "
                          f"({first} tokens): with --detokenize only whole lines are scored")
        break
    texts.append(doc)
    token_lists.append(toks)
    if words is not None:
      counts.append(n_words)
    if cut:
      break
    if budget is not None:
      budget -= len(toks)
      if budget <= 0:
        break
  if not token_lists:
    raise EvalError("the corpus encodes to no tokens")
  return texts, (counts if words is not None else None), token_lists


def rates(nll: float, tokens: int, n_bytes: int, words: Optional[int] = None) -> dict:
  """token_ppl, bits_per_byte (and word_ppl when `words` is given; None for 0 words) of a summed
  NLL over these counts (module docstring)."""
  out = {"token_ppl": _safe_exp(nll / tokens),
         "bits_per_byte": nll / (math.log(2) * max(n_bytes, 1))}
  if words is not None:
    # No word scored (--max_tokens inside the leading whitespace of a line): no word perplexity.
    out["word_ppl"] = _safe_exp(nll / words) if words else None
  return out


def corpus_perplexity(scorer: Scorer, tokenizer, documents: Sequence[str], *,
                      words: Optional[Sequence[int]] = None, context: Optional[int] = None,
                      stride: Optional[int] = None, bos_id: Optional[int] = None,
                      max_tokens: Optional[int] = None,
                      originals: Optional[Sequence[str]] = None, label: str = "perplexity") -> dict:
  """Metrics of the module docstring, plus the counts ("documents", "tokens", "bytes"; with `words`
  also "words" and "line_ends", the line ends among them). A terminal's stderr shows a progress
  bar named `label` over the tokens (`console.progress`)."""
  texts, counts, token_lists = truncate(tokenizer, documents, words, max_tokens, originals)
  prefix = bos_id if bos_id is not None else tokenizer.eos_id
  total = sum(len(t) for t in token_lists)
  with console.progress(total=total, desc=label, unit="token", unit_scale=True) as bar:
    ll = document_loglikelihoods(scorer, token_lists, prefix, context=context, stride=stride,
                                 progress=bar.update)
  lengths = np.array([len(t) for t in token_lists])
  nll, n_tokens = -float(ll.sum()), int(lengths.sum())
  n_bytes = sum(len(t.encode("utf-8")) for t in texts)
  out = {"documents": len(token_lists), "tokens": n_tokens, "bytes": n_bytes, "nll": nll,
         "mean_document_ppl": float(np.mean([_safe_exp(x) for x in -ll / lengths])),
         **dict(zip(("context", "stride"), window_sizes(scorer, context, stride)))}
  if counts is not None:
    out["words"] = sum(counts)
    # (detokenizing keeps the lines: the scored text has the original's line ends)
    out["line_ends"] = sum(t.count("\n") for t in texts)
  out.update(rates(nll, n_tokens, n_bytes, out.get("words")))
  return out
