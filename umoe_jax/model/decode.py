"""Autoregressive generation with a KV cache: greedy, temperature and top-p (nucleus) sampling.

    out = generate(model, [[5, 9, 2], [7]], max_new_tokens=16)                  # greedy
    out = generate(model, prompts, max_new_tokens=16, temperature=0.8, top_p=0.95, seed=1)
    out.tokens  # [B, max_new_tokens] int32 (after a row's EOS: eos_id);  out.lengths [B]

How it runs:
  * The prompts are **left-padded** to the longest one, P tokens: row i's L_i tokens sit in slots
    [P - L_i, P) at positions 0 .. L_i - 1, its padding slots get position -1 (never attended, see
    `umoe_jax.model.cache`). Every row then writes its next token into the same slot P + s, so the
    cache needs one scalar write index and each step is the same compiled program for the whole batch.
  * One jitted forward pass over the padded prompt fills the cache (prefill); then one jitted
    on-device loop (`lax.while_loop`, the cache in its state) samples a token, feeds it back and
    samples the next, until `max_new_tokens` or every row has emitted EOS: no host round-trip per
    token, one device -> host copy of the result. Both are compiled once per model graph, batch
    size, prompt length and `max_new_tokens`; temperature, top-p, EOS and the RNG key are traced.
  * temperature == 0 is greedy (argmax, deterministic); otherwise logits / temperature, restricted to
    the smallest set of most likely tokens whose probability reaches top_p (top_p=1: all), sampled.
  * A row that emits `eos_id` keeps emitting `eos_id`; generation stops early when every row has.

The cache holds, per layer and token, what the attention kind declares (`cache_shapes`): pre-mixing
one key and the hidden state (or an MLA latent), MHA keys and values, MoA the shared key and value,
SwitchHead each head's key and value after its expert V projection, post-mixing (1+K) of each (and,
with a router that leaves slots without a pick, each slot's mask: masked slots are never attended).

A model from a checkpoint directory: `umoe_jax.load.load_model`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from umoe_jax.model.cache import EMPTY, init_cache


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """Prompts -> (tokens [B, P] int32, positions [B, P] int32): left-padded, padding at position -1."""
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("generate needs at least one prompt and every prompt at least one token")
  p = max(len(x) for x in prompts)
  tokens = np.full((len(prompts), p), pad_id, np.int32)
  positions = np.full((len(prompts), p), EMPTY, np.int32)
  for i, x in enumerate(prompts):
    tokens[i, p - len(x):] = np.asarray(x, np.int32)
    positions[i, p - len(x):] = np.arange(len(x), dtype=np.int32)
  return tokens, positions


def sample_logits(logits: jax.Array, key: jax.Array, temperature: jax.Array,
                  top_p: jax.Array) -> jax.Array:
  """logits [B, V] -> token ids [B] int32: argmax when temperature <= 0, else top-p sampling."""
  logits = logits.astype(jnp.float32)

  def greedy(logits):
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)

  def nucleus(logits):
    scaled = logits / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-scaled, axis=-1)                                        # most likely first
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs    # mass of the strictly more likely tokens
    keep = before < top_p                          # the first token is always kept
    sorted_logits = jnp.where(keep, sorted_logits, -jnp.inf)
    choice = jax.random.categorical(key, sorted_logits, axis=-1)                 # index into order
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)

  # a branch, not a select: greedy decoding skips the sort over the vocabulary
  return jax.lax.cond(temperature > 0, nucleus, greedy, logits)


@functools.lru_cache(maxsize=16)
def decoding_programs(graphdef):
  """(prefill, decode) for one model graph (`nnx.split(model)[0]`), jitted; each compiles once per
  batch size, prompt length, cache length (and `max_new_tokens` for decode).

  prefill(state, tokens [B, P], positions [B, P], cache) -> (last logits [B, V] float32, cache)
  decode(state, logits [B, V], cache, next_pos [B], key, temperature, top_p, eos_id,
         max_new_tokens=N) -> (tokens [B, N] int32, lengths [B] int32, cache)

  `decode` is one on-device `lax.while_loop`: sample a token, feed it, sample the next, ... until N
  tokens or every row has emitted `eos_id` (-1 = no EOS). temperature, top_p [] float32, eos_id []
  int32 and the key are traced. Both donate the cache they are given.
  """

  def forward(state, tokens, positions, cache):
    model = nnx.merge(graphdef, state)
    logits, _, cache = model(tokens, positions, cache=cache, last_logits_only=True)
    return logits[:, -1], cache

  @functools.partial(jax.jit, static_argnames="max_new_tokens", donate_argnames="cache")
  def decode(state, logits, cache, next_pos, key, temperature, top_p, eos_id, *, max_new_tokens):
    n = max_new_tokens
    b = logits.shape[0]

    def pick(s, logits, key, done, lengths, out):
      """Samples token s of every row; a finished row repeats eos_id."""
      key, sub = jax.random.split(key)
      tok = jnp.where(done, eos_id, sample_logits(logits, sub, temperature, top_p))
      newly = ~done & (tok == eos_id)
      lengths = jnp.where(newly, s + 1, lengths)
      out = jax.lax.dynamic_update_slice(out, tok[:, None], (0, s))
      return tok, key, done | newly, lengths, out

    def cond(carry):
      s, _, _, _, done, _, _ = carry
      return (s < n) & ~jnp.all(done)

    def body(carry):
      s, tok, key, cache, done, lengths, out = carry
      # the token sampled at step s - 1 sits at position prompt length + s - 1
      logits, cache = forward(state, tok[:, None], (next_pos + s - 1)[:, None], cache)
      tok, key, done, lengths, out = pick(s, logits, key, done, lengths, out)
      return s + 1, tok, key, cache, done, lengths, out

    # After an early stop the unwritten columns keep eos_id (with no EOS every column is written).
    out = jnp.full((b, n), eos_id, jnp.int32)
    first = pick(0, logits, key, jnp.zeros((b,), bool), jnp.full((b,), n, jnp.int32), out)
    tok, key, done, lengths, out = first
    carry = (jnp.int32(1), tok, key, cache, done, lengths, out)
    _, _, _, cache, _, lengths, out = jax.lax.while_loop(cond, body, carry)
    return out, lengths, cache

  return jax.jit(forward, donate_argnames="cache"), decode


@dataclasses.dataclass
class GenerateOutput:
  tokens: np.ndarray       # [B, N] int32 new tokens (eos_id after a row's end)
  lengths: np.ndarray      # [B] new tokens of each row up to and including its EOS
  prompt_tokens: np.ndarray     # [B, P] the left-padded prompts
  prompt_positions: np.ndarray  # [B, P] their positions (-1 = padding)

  def sequences(self) -> list[list[int]]:
    """Each row's new tokens up to and including its EOS."""
    return [self.tokens[i, :n].tolist() for i, n in enumerate(self.lengths)]


def generate(model: nnx.Module, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
             eos_id: Optional[int] = None, pad_id: int = 0,
             cache_dtype: Optional[str] = None) -> GenerateOutput:
  """Continues every prompt (a list of token ids) by up to `max_new_tokens` tokens.

  Args:
    model: a `CausalLM`.
    prompts: B token-id lists of any lengths >= 1 (left-padded internally).
    max_new_tokens: tokens to generate per row.
    temperature: 0 = greedy; > 0 = sample from softmax(logits / temperature).
    top_p: nucleus sampling mass in (0, 1] (only with temperature > 0).
    seed: RNG seed of the sampling.
    eos_id: stop a row at this token (None: never).
    pad_id: token id put in padding slots (never attended).
    cache_dtype: dtype of the cache (default: the model's compute dtype).
  """
  cfg = model.cfg
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
  if not 0 < top_p <= 1:
    raise ValueError(f"top_p={top_p} must be in (0, 1]")
  if not temperature >= 0:  # a negative one (or NaN) would silently decode greedily
    raise ValueError(f"temperature={temperature} must be >= 0 (0: greedy)")
  if temperature == float("inf"):  # logits / inf = 0: uniform over the vocabulary, the model ignored
    raise ValueError(f"temperature={temperature} must be finite")
  if eos_id is not None and not 0 <= eos_id < cfg.vocab_size:
    raise ValueError(f"eos_id={eos_id} is outside the model's vocabulary [0, {cfg.vocab_size})")
  tokens, positions = left_pad(prompts, pad_id)
  bad = tokens[(tokens < 0) | (tokens >= cfg.vocab_size)]
  if bad.size:  # an embedding lookup out of range would silently give NaN / garbage rows
    raise ValueError(f"prompt token id {int(bad[0])} is outside the model's vocabulary "
                     f"[0, {cfg.vocab_size}) (model.vocab_size={cfg.vocab_size})")
  b, p = tokens.shape
  total = p + max_new_tokens
  if total > cfg.max_seq_len:
    raise ValueError(f"prompt ({p}) + max_new_tokens ({max_new_tokens}) = {total} exceeds "
                     f"model.max_seq_len={cfg.max_seq_len}")
  graphdef, state = nnx.split(model)
  prefill, decode = decoding_programs(graphdef)
  cache = init_cache(cfg, b, total, cache_dtype)
  logits, cache = prefill(state, jnp.asarray(tokens), jnp.asarray(positions), cache)
  out, lengths, _ = decode(state, logits, cache, jnp.asarray(positions[:, -1] + 1),
                           jax.random.key(seed), jnp.float32(temperature), jnp.float32(top_p),
                           jnp.int32(-1 if eos_id is None else eos_id),
                           max_new_tokens=max_new_tokens)
  out, lengths = jax.device_get((out, lengths))  # the only device -> host copy of the decoding
  return GenerateOutput(tokens=np.asarray(out), lengths=np.asarray(lengths), prompt_tokens=tokens,
                        prompt_positions=positions)
