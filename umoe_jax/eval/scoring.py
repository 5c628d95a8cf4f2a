"""Batched log-likelihood scoring of token windows under a CausalLM, padded to a few bucket lengths.

    scorer = Scorer(model, batch_size=16)
    ll, greedy = scorer.loglikelihood([(ctx_ids, cont_ids), ...])     # float64 [N], bool [N]
    ll, greedy = scorer.score_windows([(inputs, targets, k), ...])      # one per window

A *window* is (inputs [n], targets [n], k) with n <= max_seq_len and targets[i] the token after
inputs[i]: its log-likelihood is the sum of log p(target) over the last k targets, and `greedy` says
whether each of them is the argmax. Requests (context c, continuation x):
  * the sequence c + x is cut to its last max_seq_len + 1 tokens (contexts truncated from the left),
    one window scores the len(x) continuation targets;
  * a continuation longer than max_seq_len (rare: long choices under a byte tokenizer) is scored in
    windows, last first: each scores up to max_seq_len targets after as many preceding tokens as fit
    (`windows`); their log-likelihoods add up, greedy is all of theirs.

Speed: windows are sorted by length (longest first), batched `batch_size` at a time, right-padded to
the smallest bucket length (powers of two from 32, and max_seq_len) that fits the batch, and the
batch is padded with empty rows to `batch_size` (fewer windows in all: the power of two that holds
them): one compiled forward per bucket (and such a smaller row count), at most
~log2(T/32)+1, shared by every Scorer of the same model graph (`compile_count()` counts them). The
device results stay on device until the last batch is dispatched, so the host packs batch i+1 while
the device runs batch i. Right padding never changes the real tokens (causal attention, per-token
dropless routing).

Memory: a batch materialises float32 logits [batch_size, bucket, V]; lower batch_size for big V.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from umoe_jax.eval.errors import EvalError


def rows_per_forward(batch_size: int, n_rows: int) -> int:
  """Rows of a batched forward over n_rows windows: batch_size, or the power of two that holds them
  all when that is fewer (few extra compiled shapes). A batch size far above the work (4096 for 2
  windows) would pad thousands of rows: minutes of compute, or out of memory. The scorer's and the
  routing probe's (`analysis.probe.collect`) batches."""
  return min(batch_size, 1 << max(n_rows - 1, 0).bit_length())

Request = tuple[Sequence[int], Sequence[int]]   # (context token ids, continuation token ids)
Window = tuple[list[int], list[int], int]       # (inputs, targets, number of scored targets at the end)

_TRACES = [0]   # how many times a scoring forward was traced (= compiled) in this process


def compile_count() -> int:
  """Number of scoring programs compiled so far in this process (one per model graph and shape)."""
  return _TRACES[0]


def bucket_lengths(max_seq_len: int, smallest: int = 32) -> tuple[int, ...]:
  """Padded sequence lengths: powers of two from `smallest` below max_seq_len, then max_seq_len."""
  out, n = [], smallest
  while n < max_seq_len:
    out.append(n)
    n *= 2
  return tuple(out) + (max_seq_len,)


def encode_requests(tokenizer, pairs: Sequence[tuple[str, str]],
                    bos_id: Optional[int] = None) -> list[tuple[list[int], list[int]]]:
  """(context, continuation) strings -> token ids, as lm-evaluation-harness's Hugging Face models
  encode them.

  Trailing whitespace of a context moves to the front of its continuation ("Answer: " + "B" is
  scored as "Answer:" + " B"); the continuation's ids are those of the whole text context +
  continuation after the context's own ids (encoded alone, " B" can differ: a Llama-2-style
  tokenizer prepends "▁" to every text it encodes). `bos_id` is put before every context; an empty
  context (and no BOS) becomes [eos_id].
  """
  contexts, wholes = [], []
  for context, continuation in pairs:
    stripped = context.rstrip()
    contexts.append(stripped)
    wholes.append(context + continuation)
  # One batch call each: the Rust tokenizer encodes in parallel; same ids as one by one.
  ctx_ids, whole_ids = tokenizer.encode_batch(contexts), tokenizer.encode_batch(wholes)
  out = []
  for (context, continuation), ctx, whole in zip(pairs, ctx_ids, whole_ids):
    cont = list(whole[len(ctx):])
    if not cont:
      raise EvalError(f"continuation {continuation!r} after {context[-40:]!r} encodes to no tokens")
    ctx = ([bos_id] if bos_id is not None else []) + list(ctx)
    out.append((ctx or [tokenizer.eos_id], cont))
  return out


def windows(context: Sequence[int], continuation: Sequence[int], max_seq_len: int) -> list[Window]:
  """The forward windows that score `continuation` after `context` (one unless the continuation is
  longer than max_seq_len): inputs [n] and targets [n] (n <= max_seq_len), the last k targets scored."""
  seq, c = list(context) + list(continuation), len(context)
  out, end = [], len(seq)                  # score targets seq[start:end] from inputs seq[a:end - 1]
  while end > c:
    a = max(0, end - 1 - max_seq_len)
    start = max(c, a + 1)
    out.append((seq[a:end - 1], seq[a + 1:end], end - start))
    end = start
  return out


def pack(batch: Sequence[Window], length: int, batch_size: int):
  """Windows -> (tokens, targets int32 [batch_size, length], mask bool [batch_size, length]).

  Row i holds window i right-padded with 0; mask marks its scored targets. Rows past len(batch) are
  all padding (mask False).
  """
  tokens = np.zeros((batch_size, length), np.int32)
  targets = np.zeros((batch_size, length), np.int32)
  mask = np.zeros((batch_size, length), bool)
  for i, (inputs, tgt, k) in enumerate(batch):
    n = len(inputs)
    if n > length:
      raise ValueError(f"window of {n} input tokens does not fit length {length}")
    tokens[i, :n] = inputs
    targets[i, :n] = tgt
    mask[i, n - k:n] = True
  return tokens, targets, mask


@functools.lru_cache(maxsize=8)
def _score_fn(graphdef):
  """Jitted (state, tokens, targets, mask [B, L]) -> (ll float32 [B], greedy bool [B])."""

  @jax.jit
  def score(state, tokens, targets, mask):
    _TRACES[0] += 1                                                               # trace time only
    logits, _ = nnx.merge(graphdef, state)(tokens)                                # [B, L, V] f32
    logits = logits.astype(jnp.float32)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    logp = target_logit - jax.nn.logsumexp(logits, axis=-1)                       # [B, L]
    ll = jnp.sum(jnp.where(mask, logp, 0.0), axis=-1)
    greedy = jnp.all((jnp.argmax(logits, axis=-1) == targets) | ~mask, axis=-1)
    return ll, greedy

  return score


class Scorer:
  """Batched log-likelihoods of continuations under a CausalLM (see the module docstring)."""

  def __init__(self, model: nnx.Module, batch_size: int = 16,
               buckets: Optional[Sequence[int]] = None):
    if batch_size < 1:
      raise EvalError(f"batch_size={batch_size} must be >= 1")
    self.max_seq_len = model.cfg.max_seq_len
    self.vocab_size = getattr(model.cfg, "vocab_size", None)
    self.batch_size = batch_size
    self.buckets = tuple(sorted(buckets)) if buckets else bucket_lengths(self.max_seq_len)
    if self.buckets[-1] < self.max_seq_len:
      self.buckets += (self.max_seq_len,)
    if self.buckets[-1] > self.max_seq_len:
      raise EvalError(f"bucket {self.buckets[-1]} exceeds max_seq_len={self.max_seq_len}")
    self.graphdef, self.state = nnx.split(model)
    self._score = _score_fn(self.graphdef)

  def bucket(self, n: int) -> int:
    """The padded length of a batch whose longest window has n inputs."""
    return next(b for b in self.buckets if b >= n)

  def _check_ids(self, tokens: np.ndarray) -> None:
    # An embedding lookup past the table gives garbage (NaN) rows, never an error: refuse here.
    if self.vocab_size is not None and tokens.size and (tokens.max() >= self.vocab_size
                                                        or tokens.min() < 0):
      bad = int(tokens.max() if tokens.max() >= self.vocab_size else tokens.min())
      raise EvalError(f"token id {bad} is outside the model's vocabulary [0, {self.vocab_size}): "
                      "the tokenizer does not fit this model")

  def score_windows(self, wins: Sequence[Window],
                    progress: Optional[Callable[[list[int]], None]] = None
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(ll float64 [N], greedy bool [N]) of every window, in window order; `progress(indices)` is
    told each batch's windows once the device has scored them (a progress bar's updates)."""
    for inputs, targets, k in wins:
      if (not 1 <= len(inputs) <= self.max_seq_len or len(targets) != len(inputs)
          or not 0 <= k <= len(inputs)):
        raise EvalError(f"bad window: {len(inputs)} inputs, {len(targets)} targets, {k} scored "
                        f"(max_seq_len={self.max_seq_len})")
    order = sorted(range(len(wins)), key=lambda j: -len(wins[j][0]))
    rows = rows_per_forward(self.batch_size, len(wins))
    pending = []
    reported = 0  # batches told to `progress`, in order

    def report(upto: int, wait: bool) -> None:  # (wait: batches before `upto` are known done)
      nonlocal reported
      while progress and reported < upto and (wait or pending[reported][1][0].is_ready()):
        progress(pending[reported][0])
        reported += 1

    for start in range(0, len(order), rows):
      idx = order[start:start + rows]
      tokens, targets, mask = pack([wins[j] for j in idx], self.bucket(len(wins[idx[0]][0])), rows)
      self._check_ids(tokens)
      self._check_ids(targets)
      pending.append((idx, self._score(self.state, jnp.asarray(tokens), jnp.asarray(targets),
                                       jnp.asarray(mask))))
      report(len(pending), wait=False)  # dispatch runs ahead of the device: count what it did
    ll, greedy = np.zeros(len(wins)), np.ones(len(wins), bool)
    for k, (idx, (out_ll, out_greedy)) in enumerate(pending):
      ll[idx] = np.asarray(out_ll, np.float64)[:len(idx)]
      greedy[idx] = np.asarray(out_greedy)[:len(idx)]
      report(k + 1, wait=True)
    return ll, greedy

  def loglikelihood(self, requests: Sequence[Request],
                    progress: Optional[Callable[[int], None]] = None
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(ll float64 [N], greedy bool [N]) of every request's continuation, in request order;
    `progress(n)` is told how many more requests are fully scored, batch by batch."""
    owner, wins = [], []
    for i, (ctx, cont) in enumerate(requests):
      if not ctx or not cont:
        raise EvalError("every request needs at least one context and one continuation token")
      for w in windows(ctx, cont, self.max_seq_len):
        owner.append(i)
        wins.append(w)
    left = np.bincount(np.asarray(owner, np.int64), minlength=len(requests))  # windows to go

    def windows_done(idx: list[int]) -> None:
      finished = 0
      for j in idx:
        left[owner[j]] -= 1
        finished += int(left[owner[j]] == 0)
      progress(finished)

    win_ll, win_greedy = self.score_windows(wins, windows_done if progress else None)
    ll, greedy = np.zeros(len(requests)), np.ones(len(requests), bool)
    np.add.at(ll, np.asarray(owner, np.int64), win_ll)
    np.logical_and.at(greedy, np.asarray(owner, np.int64), win_greedy)
    return ll, greedy
