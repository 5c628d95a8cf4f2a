"""Corpus perplexity: sliding-window scoring against a naive per-token loop (token and WikiText word
level, several context / stride settings, batching and document order that must not matter,
--max_tokens), corpus readers of every format with real WikiText-2 word counts, and the seeded
word-swap attack (determinism, exact rate, vocabulary, layout)."""
from __future__ import annotations

import math
import os
import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import ROOT, random_module, tiny_config
from umoe_jax.data.tokenizer import ByteTokenizer
from umoe_jax.eval import attack, corpora, corpus_ppl
from umoe_jax.eval.errors import EvalError
from umoe_jax.eval.scoring import Scorer
from umoe_jax.model import CausalLM

WIKITEXT = os.path.join(os.path.dirname(ROOT), "shared", "data", "wikitext-2")
MAX_SEQ_LEN = 32
PAD = 32          # the naive reference's fixed row length (one compile)


@pytest.fixture(scope="module")
def model():
  cfg = tiny_config("umoe", vocab_size=257, max_seq_len=MAX_SEQ_LEN)
  return random_module(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)), 3)


_forward = nnx.jit(lambda model, tokens: model(tokens)[0])


def _context_start(j: int, n: int, context: int, stride: int) -> int:
  """Where target j's left context starts in seq = [prefix] + tokens, by the closed form of the
  rule: the first `context` targets see everything before them; target j >= context is scored by
  the window ending at e = min(n, context + stride * ceil((j + 1 - context) / stride)), which reads
  the `context` inputs before e."""
  if j < context:
    return 0
  end = min(n, context + stride * math.ceil((j + 1 - context) / stride))
  return end - context


def naive_nll(model, tokens, prefix, context, stride) -> np.ndarray:
  """-log p(tokens[j]) for every j, each from one forward of exactly its own left context."""
  seq = [prefix] + list(tokens)
  rows = np.zeros((-(-len(tokens) // 64) * 64, PAD), np.int32)   # whole [64, PAD] chunks: 1 compile
  last = np.zeros(len(tokens), np.int64)
  for j in range(len(tokens)):
    x = seq[_context_start(j, len(tokens), context, stride):j + 1]
    assert 1 <= len(x) <= context
    rows[j, :len(x)] = x
    last[j] = len(x) - 1
  out = []
  for s in range(0, len(rows), 64):
    n = min(64, len(tokens) - s)
    logits = np.asarray(_forward(model, jnp.asarray(rows[s:s + 64])), np.float64)[:n]
    logits = logits[np.arange(n), last[s:s + n]]                               # [n, V]
    m = logits.max(-1, keepdims=True)
    logp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
    out.append(-logp[np.arange(n), [seq[j + 1] for j in range(s, s + n)]])
  return np.concatenate(out)


TEXTS = [" = Valkyria Chronicles III = \n \n Senjō no Valkyria 3 : Unrecorded Chronicles is a "
         "tactical role @-@ playing video game . \n",
         " The game began development in 2010 , carrying over a large portion of the work . \n",
         "short"]


@pytest.mark.parametrize("context,stride", [(32, 32), (16, 5), (12, 1), (9, 9)])
def test_rolling_matches_naive_per_token_loop(model, context, stride):
  tok = ByteTokenizer()
  words = [corpora.wikitext_words(t) for t in TEXTS]
  out = corpus_ppl.corpus_perplexity(Scorer(model, batch_size=3), tok, TEXTS, words=words,
                                     context=context, stride=stride)
  nll = np.concatenate([naive_nll(model, tok.encode(t), tok.eos_id, context, stride)
                        for t in TEXTS])
  n_bytes = sum(len(t.encode()) for t in TEXTS)
  assert out["tokens"] == len(nll) == n_bytes      # bytes = tokens under the byte tokenizer
  np.testing.assert_allclose(out["nll"], nll.sum(), rtol=2e-5)
  np.testing.assert_allclose(out["token_ppl"], math.exp(nll.mean()), rtol=2e-5)
  np.testing.assert_allclose(out["word_ppl"], math.exp(nll.sum() / sum(words)), rtol=2e-5)
  np.testing.assert_allclose(out["bits_per_byte"], nll.sum() / math.log(2) / n_bytes, rtol=2e-5)
  assert out["words"] == sum(words) and out["documents"] == 3


def test_mean_document_ppl_averages_each_documents_own_perplexity(model):
  """mean_document_ppl is the plain mean over documents of exp(document NLL / its tokens): the
  short document counts as much as the long ones, unlike token_ppl."""
  tok = ByteTokenizer()
  out = corpus_ppl.corpus_perplexity(Scorer(model, batch_size=3), tok, TEXTS, context=16, stride=5)
  per_doc = [naive_nll(model, tok.encode(t), tok.eos_id, 16, 5) for t in TEXTS]
  want = np.mean([math.exp(nll.mean()) for nll in per_doc])
  np.testing.assert_allclose(out["mean_document_ppl"], want, rtol=2e-5)
  # The documents differ in perplexity, so a token-weighted mean would not match.
  assert not math.isclose(want, math.exp(np.concatenate(per_doc).mean()), rel_tol=1e-3)


def test_windows_cover_each_token_once_with_bounded_context():
  toks = list(range(100, 150))
  for context, stride in [(8, 8), (8, 3), (8, 1), (60, 7)]:
    wins = corpus_ppl.rolling_windows(toks, 7, context, stride)
    scored = [t for inputs, targets, k in wins for t in targets[len(targets) - k:]]
    assert scored == toks
    for i, (inputs, targets, k) in enumerate(wins):
      assert len(inputs) <= context and inputs[1:] == targets[:-1]
      if i:   # after the first window, the first scored token still sees context - stride + 1
        assert len(inputs) == min(context, len(toks) + 1)
        assert len(inputs) - k + 1 >= context - stride + 1
  assert corpus_ppl.rolling_windows([5, 6, 7], 1, 2, 1) == [([1, 5], [5, 6], 2), ([5, 6], [6, 7], 1)]
  with pytest.raises(EvalError, match="stride <= context"):
    corpus_ppl.rolling_windows(toks, 0, 4, 5)


def test_result_independent_of_batching_buckets_and_order(model):
  tok = ByteTokenizer()
  run = lambda scorer, texts: corpus_ppl.corpus_perplexity(scorer, tok, texts, context=20,  # noqa
                                                           stride=6)
  a = run(Scorer(model, batch_size=3), TEXTS)
  b = run(Scorer(model, batch_size=3, buckets=(24, 32)), TEXTS[::-1])   # other padding, batches
  assert a["tokens"] == b["tokens"]
  np.testing.assert_allclose(a["nll"], b["nll"], rtol=1e-6)
  np.testing.assert_allclose(a["mean_document_ppl"], b["mean_document_ppl"], rtol=1e-6)


def test_max_tokens_cuts_the_stream(model):
  tok = ByteTokenizer()
  n0 = len(tok.encode(TEXTS[0]))
  out = corpus_ppl.corpus_perplexity(Scorer(model, batch_size=3), tok, TEXTS,
                                     words=[corpora.wikitext_words(t) for t in TEXTS],
                                     max_tokens=n0 + 10)
  cut = tok.encode(TEXTS[1])[:10]
  nll = np.concatenate([naive_nll(model, tok.encode(TEXTS[0]), tok.eos_id, 32, 32),
                        naive_nll(model, cut, tok.eos_id, 32, 32)])
  assert (out["tokens"], out["documents"], out["bytes"]) == (n0 + 10, 2, n0 + 10)
  assert out["words"] == corpora.wikitext_words(TEXTS[0]) + corpora.wikitext_words(tok.decode(cut))
  np.testing.assert_allclose(out["nll"], nll.sum(), rtol=2e-5)
  # A cut before the first word of WikiText (its lines start with a space): no word scored, no
  # word perplexity (was a ZeroDivisionError).
  out = corpus_ppl.corpus_perplexity(Scorer(model), tok, [" = Title = \n"], words=[4], max_tokens=1)
  assert (out["tokens"], out["words"], out["word_ppl"]) == (1, 0, None)
  assert math.isfinite(out["token_ppl"]) and math.isfinite(out["bits_per_byte"])
  with pytest.raises(EvalError, match="exceeds the model's max_seq_len"):
    corpus_ppl.corpus_perplexity(Scorer(model), tok, TEXTS, context=64)
  for bad, message in ((dict(context=0), r"--context=0 must be >= 1"),   # 0 is not "default"
                       (dict(stride=0), r"--stride=0 must be in \[1, --context=32\] \(default"),
                       (dict(context=8, stride=9), r"--stride=9 must be in \[1, --context=8\]$")):
    with pytest.raises(EvalError, match=message):
      corpus_ppl.corpus_perplexity(Scorer(model), tok, TEXTS, **bad)


def test_validation_loss_is_token_weighted_over_batches():
  """perplexity.evaluate: loss = all masked tokens' NLL / their count (float64 numpy reference),
  over batches of unequal token counts, so it is not the mean of the batches' losses."""
  from umoe_jax.eval import perplexity
  rng = np.random.default_rng(0)
  batches, nll_sum, count = [], 0.0, 0.0
  for keep in (0.9, 0.2, 0.6):
    logits = rng.normal(0, 2, (2, 6, 11)).astype(np.float32)
    targets = rng.integers(0, 11, (2, 6)).astype(np.int32)
    mask = (rng.random((2, 6)) < keep).astype(np.float32)
    batches.append({"logits": logits, "targets": targets, "loss_mask": mask})
    x = logits.astype(np.float64)
    logp = x - x.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    nll_sum += -(np.take_along_axis(logp, targets[..., None], -1)[..., 0] * mask).sum()
    count += mask.sum()
  def step(params, b):
    del params
    return perplexity.token_nll(jnp.asarray(b["logits"]), jnp.asarray(b["targets"]),
                                jnp.asarray(b["loss_mask"]))

  out = perplexity.evaluate(step, None, batches)
  assert out["tokens"] == count
  np.testing.assert_allclose(out["loss"], nll_sum / count, rtol=1e-5)
  np.testing.assert_allclose(out["perplexity"], math.exp(nll_sum / count), rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# Corpora


def test_wikitext_word_count_by_hand():
  text = " = Title = \n \n Hello world , foo @-@ bar . \n"
  assert corpora.wikitext_words(text) == 3 + 7 + 3     # words + line ends
  assert corpora.detokenize_wikitext(" A 1 @,@ 000 @-@ year ( big ) test , \" ok \" . ") == \
      " A 1,000-year (big) test, \"ok\". "


@pytest.mark.skipif(not os.path.isdir(WIKITEXT), reason=f"WikiText-2 not found at {WIKITEXT}")
def test_real_wikitext_counts():
  test = corpora.read_corpus(os.path.join(WIKITEXT, "wiki.test.tokens"))
  valid = corpora.read_corpus(os.path.join(WIKITEXT, "wiki.valid.tokens"))
  assert (len(test.documents), test.words, valid.words) == (1, [245_569], [217_646])
  raw = corpora.read_corpus(os.path.join(WIKITEXT, "wiki.test.raw"))
  assert "\r" not in raw.documents[0] and raw.words == [241_211 + 2_891]   # no blank lines
  detok = corpora.read_corpus(os.path.join(WIKITEXT, "wiki.test.tokens"), detokenize=True)
  assert detok.words == [245_569] and " @-@ " not in detok.documents[0]


def test_corpus_formats(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq
  pq.write_table(pa.table({"text": ["one", "", "two"], "id": [1, 2, 3]}), tmp_path / "a.parquet")
  assert corpora.read_corpus(str(tmp_path / "a.parquet")).documents == ["one", "two"]
  with pytest.raises(EvalError, match="no column 'body'"):
    corpora.read_corpus(str(tmp_path / "a.parquet"), text_field="body")
  (tmp_path / "b.jsonl").write_text('{"text": "x y"}\n\n{"body": "z"}\n')
  with pytest.raises(EvalError, match=r"b.jsonl:3: .*string field 'text'"):
    corpora.read_corpus(str(tmp_path / "b.jsonl"))
  (tmp_path / "c.jsonl").write_text('{"text": "x y"}\n{"text": "z"\n')
  with pytest.raises(EvalError, match=r"c.jsonl:2: invalid JSON"):
    corpora.read_corpus(str(tmp_path / "c.jsonl"))
  docs = tmp_path / "docs"
  docs.mkdir()
  (docs / "1.txt").write_text("first\r\nline")
  (docs / "2.md").write_text("second")
  c = corpora.read_corpus(str(docs))
  assert c.documents == ["first\nline", "second"] and c.words is None
  with pytest.raises(FileNotFoundError, match="missing"):
    corpora.read_corpus(str(tmp_path / "missing.txt"))
  with pytest.raises(EvalError, match="mixes formats"):
    corpora.read_corpus(str(tmp_path / "*.*"))
  # A text file that is not UTF-8 (a Latin-1 export): named with its line, as JSON lines are.
  (tmp_path / "latin.txt").write_bytes(b"x" * 9000 + b"\nok\ncaf\xe9\n")
  with pytest.raises(EvalError, match=re.escape("latin.txt:3: not UTF-8 text (invalid continuation "
                                                "byte at byte 9007)")):
    corpora.read_corpus(str(tmp_path / "latin.txt"))


# ------------------------------------------------------------------------------------------------
# Attack


def test_attack_is_deterministic_at_the_exact_rate():
  rng = np.random.default_rng(5)
  vocab = [f"w{i}" for i in range(50)] + [",", ".", "@-@", "<unk>"]
  docs = [" ".join(rng.choice(vocab, 300)) + " \n \n = H = \n", " ".join(rng.choice(vocab, 120))]
  a1, s1 = attack.attack_documents(docs, rate=0.05, seed=3)
  a2, _ = attack.attack_documents(docs, rate=0.05, seed=3)
  a3, _ = attack.attack_documents(docs, rate=0.05, seed=4)
  assert a1 == a2 and a1 != a3
  words = [w for d in docs for w in d.split()]
  assert s1["words"] == len(words) == 300 + 3 + 120 and s1["substituted"] == round(0.05 * 423)
  new = [w for d in a1 for w in d.split()]
  changed = [(o, n) for o, n in zip(words, new) if o != n]
  assert len(new) == len(words) and len(changed) == s1["substituted"]   # every pick changes
  assert all(n in set(words) for _, n in changed)                      # the text's own vocabulary
  for d, a in zip(docs, a1):                                           # whitespace untouched
    assert re.findall(r"\s+", d) == re.findall(r"\s+", a)
  assert attack.attack_documents(docs, rate=0.0, seed=3)[0] == docs
  with pytest.raises(EvalError, match="rate"):
    attack.attack_documents(docs, rate=1.5)


def test_attack_substitutes_uniformly_over_the_vocabulary():
  """Many seeds on a 4-word text: each position is picked ~equally often and a picked "a" becomes
  each of the 3 other words ~1/3 of the time."""
  text = ["a b c d " * 25]
  picked, became = np.zeros(100), {"b": 0, "c": 0, "d": 0}
  for seed in range(400):
    out, _ = attack.attack_documents(text, rate=0.1, seed=seed)
    for i, (o, n) in enumerate(zip(text[0].split(), out[0].split())):
      if o != n:
        picked[i] += 1
        if o == "a":
          became[n] += 1
  assert picked.sum() == 400 * 10 and picked.std() < 12   # Binomial(400, 0.1): std 6 per position
  total = sum(became.values())
  assert all(abs(v / total - 1 / 3) < 0.06 for v in became.values()), became


def test_detokenized_max_tokens_counts_the_original_words(model, tmp_path):
  """--detokenize with --max_tokens: the cut document ends at its last complete line and its word
  count is that of the original lines (detokenized, line 0 has 5 words, originally 10)."""
  lines = [" 1 @,@ 000 people ( about ) live here . \n", " It is a well @-@ known town . \n",
           " The end . \n"]
  path = tmp_path / "w.tokens"
  path.write_text("".join(lines))
  corpus = corpora.read_corpus(str(path), detokenize=True)
  detok = [corpora.detokenize_wikitext(line) for line in lines]
  assert corpus.documents == ["".join(detok)] and corpus.originals == ["".join(lines)]
  assert detok[0] == " 1,000 people (about) live here. \n"
  tok = ByteTokenizer()
  kept = detok[0] + detok[1]
  out = corpus_ppl.corpus_perplexity(Scorer(model, batch_size=3), tok, corpus.documents,
                                     words=corpus.words, originals=corpus.originals,
                                     max_tokens=len(tok.encode(kept)) + 5)   # inside line 2
  assert (out["tokens"], out["bytes"]) == (len(kept), len(kept))
  assert out["words"] == (10 + 1) + (8 + 1)                              # words + line ends
  # A budget inside the first line: that said (was "the corpus encodes to no tokens").
  with pytest.raises(EvalError, match=re.escape(f"--max_tokens=5 is shorter than the corpus's first "
                                                f"line ({len(detok[0])} tokens)")):
    corpus_ppl.corpus_perplexity(Scorer(model), tok, corpus.documents, words=corpus.words,
                                 originals=corpus.originals, max_tokens=5)
  np.testing.assert_allclose(out["nll"], naive_nll(model, tok.encode(kept), tok.eos_id, 32, 32).sum(),
                             rtol=2e-5)
