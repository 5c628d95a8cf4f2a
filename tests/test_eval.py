"""Zero-shot evaluation: JSONL readers (synthetic and the shared eval files), batched bucketed scoring
against a naive one-pair-at-a-time reference, acc / acc_norm / winogrande / lambada metrics on a
model with hand-set logits, and the CLI on a saved tiny checkpoint."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs.common
from conftest import ROOT, random_module
from umoe_jax.config import model_config
from umoe_jax.data.tokenizer import ByteTokenizer
from umoe_jax.eval import harness, tasks
from umoe_jax.model import CausalLM

SHARED_EVAL = os.path.join(os.path.dirname(ROOT), "shared", "data", "eval")
ROWS = {"arc_easy": 2376, "arc_challenge": 1172, "piqa": 1838, "winogrande": 1267,
        "lambada_openai": 5153, "hellaswag": 10042}
MAX_SEQ_LEN = 64


def _write_jsonl(path, records):
  with open(path, "w") as f:
    for r in records:
      f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
  return str(path)


def _synthetic_dir(tmp_path):
  """One small file per task, short enough that every request fits the 32-token bucket."""
  mc = [{"query": "Question: 2+2?", "choices": ["4", "five", "22"], "gold": 0},
        {"query": "Sky is", "choices": ["blue", "green"], "gold": 1},
        {"query": "Ice is", "choices": ["cold", "hot"], "gold": 0}]
  for name in ("arc_easy", "arc_challenge", "piqa", "hellaswag"):
    _write_jsonl(tmp_path / tasks.TASKS[name][0], mc)
  _write_jsonl(tmp_path / "winogrande.jsonl", [
      {"context_options": ["Ann beat Bo so Ann", "Ann beat Bo so Bo"], "continuation": "won.",
       "gold": 0},
      {"context_options": ["A cup or a jug: the cup", "A cup or a jug: the jug"],
       "continuation": "was bigger.", "gold": 1}])
  _write_jsonl(tmp_path / "lambada_openai.jsonl", [
      {"context": "the cat sat on the", "continuation": "mat"},
      {"context": "one two three", "continuation": "four"}])
  return str(tmp_path)


# ------------------------------------------------------------------------------------------------
# Readers


def test_read_synthetic_files(tmp_path):
  data_dir = _synthetic_dir(tmp_path)
  docs = tasks.load_task("arc_easy", data_dir)
  assert docs[0] == tasks.MultipleChoice("Question: 2+2?", ("4", "five", "22"), 0)
  assert docs[0].requests() == [("Question: 2+2?", " 4"), ("Question: 2+2?", " five"),
                                ("Question: 2+2?", " 22")]
  assert len(tasks.load_task("hellaswag_val", data_dir, limit=2)) == 2   # alias, limit
  wino = tasks.load_task("winogrande", data_dir)
  assert wino[1].gold == 1
  assert wino[0].requests() == [("Ann beat Bo so Ann", " won."), ("Ann beat Bo so Bo", " won.")]
  lam = tasks.load_task("lambada", data_dir)
  assert lam[0].requests() == [("the cat sat on the", " mat")]
  with pytest.raises(ValueError, match="unknown task 'nope'"):
    tasks.load_task("nope", data_dir)
  with pytest.raises(FileNotFoundError, match="eval file not found"):
    tasks.load_task("piqa", str(tmp_path / "missing"))


@pytest.mark.parametrize("kind,line,message", [
    ("multiple_choice", '{"query": "q", "choices": ["a", "b"], "gold": 1',
     r"invalid JSON \(Expecting ',' delimiter at column 48\)$"),   # past its 47 characters
    ("multiple_choice", '["q"]', "expected a JSON object"),
    ("multiple_choice", '{"choices": ["a", "b"], "gold": 0}', "missing key 'query'"),
    ("multiple_choice", '{"query": "q", "choices": ["a"], "gold": 0}', "at least 2 strings"),
    ("multiple_choice", '{"query": "q", "choices": ["a", 3], "gold": 0}', "at least 2 strings"),
    ("multiple_choice", '{"query": "q", "choices": ["a", "b"], "gold": 2}', r"in \[0, 2\)"),
    ("multiple_choice", '{"query": "q", "choices": ["a", "b"], "gold": true}', r"in \[0, 2\)"),
    ("multiple_choice", '{"query": 5, "choices": ["a", "b"], "gold": 0}', "'query' must be a string"),
    ("schema", '{"context_options": ["a", "b"], "gold": 0}', "missing key 'continuation'"),
    ("lm", '{"context": "c", "continuation": " "}', "'continuation' is empty"),
])
def test_malformed_record_names_file_and_line(tmp_path, kind, line, message):
  good = {"multiple_choice": {"query": "q", "choices": ["a", "b"], "gold": 0},
          "schema": {"context_options": ["a", "b"], "continuation": "c", "gold": 0},
          "lm": {"context": "c", "continuation": "d"}}[kind]
  path = _write_jsonl(tmp_path / "bad.jsonl", [good, "", line])
  with pytest.raises(tasks.TaskFormatError, match=f"bad.jsonl:3: .*{message}"):
    tasks.read_jsonl(path, kind)
  assert len(tasks.read_jsonl(path, kind, limit=1)) == 1     # stops before the bad line


@pytest.mark.skipif(not os.path.isdir(SHARED_EVAL),
                    reason=f"shared eval data not found at {SHARED_EVAL} (a fresh clone without ../shared)")
@pytest.mark.parametrize("name", sorted(ROWS))
def test_real_shared_files(name):
  docs = tasks.load_task(name, SHARED_EVAL)
  assert len(docs) == ROWS[name]
  kind = tasks.task_kind(name)
  if kind != "lm":
    n = {"arc_easy": 4, "arc_challenge": 4, "hellaswag": 4, "piqa": 2, "winogrande": 2}[name]
    assert all(len(d.requests()) == n for d in docs)
  assert all(c.startswith(" ") and len(c) > 1 for d in docs for _, c in d.requests())


# ------------------------------------------------------------------------------------------------
# Scoring against a naive reference


def _tiny_model_section():
  m = configs.common.model("umoe", "tiny")
  m.n_layers, m.d_model, m.vocab_size, m.max_seq_len = 1, 32, 257, MAX_SEQ_LEN
  m.compute_dtype, m.gmm_backend = "float32", "xla"
  m.moe.n_experts, m.moe.d_expert, m.ffn.top_k, m.attention.top_k = 4, 16, 2, 1
  m.attention.head_dim, m.attention.v_head_dim, m.attention.q_lora_rank = 16, 16, 4
  return m


@pytest.fixture(scope="module")
def tiny():
  m = _tiny_model_section()
  cfg = model_config(m)
  return m, random_module(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)), 5)


_forward = nnx.jit(lambda model, tokens: model(tokens)[0])


def _naive(model, ctx, cont):
  """Sum of log p(continuation) and all-greedy, from one unpadded forward of this pair alone."""
  seq = np.asarray(list(ctx) + list(cont), np.int32)[-(MAX_SEQ_LEN + 1):]
  logp = np.asarray(jax.nn.log_softmax(_forward(model, jnp.asarray(seq[None, :-1]))[0], -1),
                    np.float64)
  rows, targets = np.arange(len(seq) - 1)[-len(cont):], seq[1:][-len(cont):]
  return logp[rows, targets].sum(), bool((logp[rows].argmax(-1) == targets).all())


def test_pack_and_buckets():
  assert harness.bucket_lengths(64) == (32, 64)
  assert harness.bucket_lengths(1024) == (32, 64, 128, 256, 512, 1024)
  assert harness.bucket_lengths(100) == (32, 64, 100)
  w = harness.windows([1, 2, 3], [4, 5], max_seq_len=5)
  assert w == [([1, 2, 3, 4], [2, 3, 4, 5], 2)]
  w2 = harness.windows(list(range(10, 20)), [7], max_seq_len=5)         # context left-truncated
  assert w2 == [([15, 16, 17, 18, 19], [16, 17, 18, 19, 7], 1)]
  # a continuation longer than max_seq_len: the last 3 targets, then the first 3 after the context
  assert harness.windows([1, 2], [3, 4, 5, 6, 7, 8], max_seq_len=3) == [
      ([5, 6, 7], [6, 7, 8], 3), ([2, 3, 4], [3, 4, 5], 3)]
  tokens, targets, mask = harness.pack(w + w2, length=6, batch_size=3)
  np.testing.assert_array_equal(tokens[0], [1, 2, 3, 4, 0, 0])
  np.testing.assert_array_equal(targets[0], [2, 3, 4, 5, 0, 0])
  np.testing.assert_array_equal(mask[0], [0, 0, 1, 1, 0, 0])
  np.testing.assert_array_equal(tokens[1], [15, 16, 17, 18, 19, 0])
  np.testing.assert_array_equal(targets[1], [16, 17, 18, 19, 7, 0])
  np.testing.assert_array_equal(mask[1], [0, 0, 0, 0, 1, 0])
  assert not mask[2].any()


def test_scoring_matches_naive_reference(tiny):
  """Padded, bucketed, sorted, batched scoring == each pair run alone (float32, 1e-5). The pairs
  have two input lengths (64 and 20) to keep the reference's compilations few; sorted and batched by
  3 they give a full bucket-64 batch, one mixing 64 and 20 (right padding), a full and a partial
  bucket-32 batch. Two are longer than max_seq_len (left truncation), one continuation is the
  model's own greedy one."""
  _, model = tiny
  rng = np.random.default_rng(0)
  r = lambda n: rng.integers(0, 256, n).tolist()  # noqa: E731
  requests = [(r(15), r(6)), (r(20), r(1)), (r(30), r(35)), (r(44), r(21)), (r(90), r(3)),
              (r(5), r(60)), (r(3), r(18)), (r(2), r(19)), (r(10), r(11))]
  # A continuation the model predicts greedily: grown in a fixed 20-token buffer (causal, so the
  # zeros after position n never change its logits) to reuse the reference's length-20 compilation.
  buf = np.zeros((1, 20), np.int32)
  buf[0, :12] = r(12)
  for n in range(12, 20):
    buf[0, n] = int(np.argmax(_forward(model, jnp.asarray(buf))[0, n - 1]))
  seq = buf[0].tolist() + [int(np.argmax(_forward(model, jnp.asarray(buf))[0, -1]))]
  requests.append((seq[:12], seq[12:]))
  scorer = harness.Scorer(model, batch_size=3)
  assert scorer.buckets == (32, 64)
  ll, greedy = scorer.loglikelihood(requests)
  ref = [_naive(model, c, x) for c, x in requests]
  np.testing.assert_allclose(ll, [a for a, _ in ref], rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(greedy, [g for _, g in ref])
  assert greedy[-1] and not greedy[:-1].any()


def test_batch_size_far_above_the_work_pads_few_rows(tiny):
  """--batch_size=4096 for 3 windows: forwards of 4 rows, not 4096 (minutes of padding on a CPU,
  or out of memory), with the same log-likelihoods."""
  _, model = tiny
  rng = np.random.default_rng(2)
  requests = [(rng.integers(0, 256, n).tolist(), rng.integers(0, 256, 3).tolist())
              for n in (5, 9, 12)]
  big = harness.Scorer(model, batch_size=4096)
  shapes, forward = [], big._score
  big._score = lambda state, tokens, *rest: shapes.append(tokens.shape) or forward(state, tokens,
                                                                                   *rest)
  ll, greedy = big.loglikelihood(requests)
  assert shapes == [(4, 32)]
  ll2, greedy2 = harness.Scorer(model, batch_size=2).loglikelihood(requests)
  np.testing.assert_allclose(ll, ll2, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(greedy, greedy2)


def test_long_continuation_is_scored_in_windows(tiny):
  """A continuation of 80 tokens (> max_seq_len=64) after 5: windows score its last 64 targets after
  one more token, then its first 16 after the context; ll adds up, greedy is the AND."""
  _, model = tiny
  rng = np.random.default_rng(1)
  ctx, cont = rng.integers(0, 256, 5).tolist(), rng.integers(0, 256, 80).tolist()
  seq = ctx + cont
  ll, greedy = harness.Scorer(model, batch_size=3).loglikelihood([(ctx, cont)])
  last, g1 = _naive(model, seq[:21], seq[21:])      # inputs seq[20:84]: 64 tokens
  first, g2 = _naive(model, ctx, seq[5:21])         # inputs seq[0:20]
  np.testing.assert_allclose(ll, [last + first], rtol=1e-5, atol=1e-5)
  assert greedy[0] == (g1 and g2)


# ------------------------------------------------------------------------------------------------
# Metrics with a model of hand-set logits


@dataclasses.dataclass(frozen=True)
class _Cfg:
  max_seq_len: int = 32


class _BigramModel(nnx.Module):
  """logits[b, t] = table[tokens[b, t]]: the next byte depends only on the current one."""

  def __init__(self, table):
    self.cfg = _Cfg()
    self.table = nnx.Param(jnp.asarray(table, jnp.float32))

  def __call__(self, tokens):
    return self.table.value[tokens], {}


def _bigram(pairs):
  table = np.zeros((257, 257), np.float32)
  for a, b in pairs:
    table[ord(a), ord(b)] = 10.0
  return _BigramModel(table)


def test_choice_metrics_hand_made():
  # doc 0: acc picks choice 0 (-10 > -12) but per character choice 1 (-12/20 > -10/5).
  out = harness.choice_metrics([np.array([-10.0, -12.0]), np.array([-3.0, -1.0])], [1, 1],
                               [[5, 20], [1, 1]])
  assert (out["acc"], out["acc_norm"], out["n"]) == (0.5, 1.0, 2)
  assert math.isclose(out["acc_stderr"], 0.5) and out["acc_norm_stderr"] == 0.0


def test_multiple_choice_acc_and_acc_norm_forced():
  """The model strongly predicts "a" after " " and after "a": " aaaa" beats " b" (both acc and
  acc_norm), while " b" (ll ~ -10) vs " bbbbbbbbb" (ll ~ -90) splits acc and acc_norm."""
  model = _bigram([(" ", "a"), ("a", "a")])
  docs = [tasks.MultipleChoice("q", ("aaaa", "b"), 0), tasks.MultipleChoice("q", ("b", "bbbbbbbbb"), 1)]
  scorer = harness.Scorer(model, batch_size=4)
  out = harness.evaluate_docs(scorer, ByteTokenizer(), "multiple_choice", docs)
  assert (out["acc"], out["acc_norm"], out["n"]) == (0.5, 1.0, 2)
  ll, _ = scorer.loglikelihood(harness.encode_requests(ByteTokenizer(), docs[1].requests()))
  assert ll[0] > ll[1] and ll[0] / 1 < ll[1] / 9


def test_winogrande_and_lambada_forced():
  """After "a" the model predicts " ", after " " it predicts "m": options ending in "a" win; a
  LAMBADA item whose word is "m" after "...a" is greedy, one after "...b" is not."""
  model = _bigram([("a", " "), (" ", "m")])
  tok, scorer = ByteTokenizer(), harness.Scorer(model, batch_size=2)
  wino = [tasks.Schema(("x a", "x b"), "m", 0), tasks.Schema(("x b", "x a"), "m", 1)]
  assert harness.evaluate_docs(scorer, tok, "schema", wino)["acc"] == 1.0
  lam = [tasks.LanguageModeling("x a", "m"), tasks.LanguageModeling("x b", "m")]
  out = harness.evaluate_docs(scorer, tok, "lm", lam)
  ll, greedy = scorer.loglikelihood(harness.encode_requests(tok, [d.requests()[0] for d in lam]))
  assert greedy.tolist() == [True, False] and out["acc"] == 0.5
  # exact values: log p(" " | a) + log p(m | " ") = 2 (10 - log(e^10 + 256)); after b: uniform.
  lse = math.log(math.exp(10) + 256)
  want = [2 * (10 - lse), -math.log(257) + 10 - lse]
  np.testing.assert_allclose(ll, want, rtol=1e-5, atol=1e-5)
  assert math.isclose(out["ppl"], math.exp(-np.mean(want)), rel_tol=1e-5)   # LAMBADA's exp(-mean ll)


# ------------------------------------------------------------------------------------------------
# CLI


def test_cli_on_saved_checkpoint(tmp_path, tiny):
  from umoe_jax.interop.official import save_converted
  m, model = tiny
  ckpt = save_converted(model, m, str(tmp_path / "ckpt"))
  (tmp_path / "data").mkdir()
  data_dir = _synthetic_dir(tmp_path / "data")
  out_json = tmp_path / "results.json"
  env = dict(os.environ, PYTHONIOENCODING="utf-8", JAX_PLATFORMS="cpu")
  res = subprocess.run([sys.executable, "-m", "umoe_jax.eval.harness", f"--checkpoint={ckpt}",
                        "--tasks=arc_easy,winogrande,lambada_openai", f"--data_dir={data_dir}",
                        "--limit=2", "--batch_size=3", f"--json={out_json}"],
                       cwd=ROOT, env=env, capture_output=True, timeout=300)
  assert res.returncode == 0, res.stderr.decode()[-3000:]
  table = res.stdout.decode()
  for row in ("| arc_easy ", "acc_norm", "| winogrande ", "| lambada_openai ", "ppl"):
    assert row in table, table
  saved = json.loads(out_json.read_text())["results"]
  # The metrics by their definitions from the in-memory model: each (context, continuation) pair in
  # its own row, unpadded on the left (zeros after it change nothing: causal), one forward for all.
  tok = ByteTokenizer()
  pairs = {name: [[(tok.encode(c), tok.encode(x)) for c, x in d.requests()]
                  for d in tasks.load_task(name, data_dir, limit=2)]
           for name in ("arc_easy", "winogrande", "lambada_openai")}
  flat = [p for per_task in pairs.values() for doc in per_task for p in doc]
  rows = np.zeros((len(flat), MAX_SEQ_LEN), np.int32)
  for i, (c, x) in enumerate(flat):
    rows[i, :len(c) + len(x)] = c + x
  logp = np.asarray(jax.nn.log_softmax(_forward(model, jnp.asarray(rows)), -1), np.float64)
  per_pair = iter([(sum(logp[i, len(c) - 1 + j, t] for j, t in enumerate(x)),
                    all(np.argmax(logp[i, len(c) - 1 + j]) == t for j, t in enumerate(x)))
                   for i, (c, x) in enumerate(flat)])
  scored = {name: [[next(per_pair) for _ in doc] for doc in per_task]
            for name, per_task in pairs.items()}
  arc, wino = (list(zip(scored[n], tasks.load_task(n, data_dir, limit=2)))
               for n in ("arc_easy", "winogrande"))
  lam = scored["lambada_openai"]
  expected = {
      "arc_easy": {
          "acc": np.mean([np.argmax([ll for ll, _ in s]) == d.gold for s, d in arc]),
          "acc_norm": np.mean([np.argmax([ll / len(c) for (ll, _), c in zip(s, d.choices)]) == d.gold
                               for s, d in arc])},
      "winogrande": {"acc": np.mean([np.argmax([ll for ll, _ in s]) == d.gold for s, d in wino])},
      "lambada_openai": {"acc": np.mean([s[0][1] for s in lam]),
                         "ppl": math.exp(-np.mean([s[0][0] for s in lam]))},
  }
  for name, metrics in expected.items():
    assert saved[name]["n"] == 2
    for key, value in metrics.items():
      assert math.isclose(saved[name][key], value, rel_tol=1e-5), (name, key, saved[name][key])
