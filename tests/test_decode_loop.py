"""The on-device decoding loop of `generate()` (issue 11, item 7) against a naive per-token reference
that recomputes the full forward pass of every sequence for each new token: greedy and sampled
(same RNG stream) for every attention variant, left-padded prompts of different lengths, early stop at
EOS, and one compilation for a whole decode (no per-token retrace, no per-token host dispatch)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from test_decode import _model
from umoe_jax.model import decode as decode_lib
from umoe_jax.model.cache import init_cache
from umoe_jax.model.decode import generate, sample_logits
from umoe_jax.model.lm import CausalLM

# One per attention kind (+ MLA latent values with a pool shared across layers, + a router that
# reads the fed token ids), each with a left-padded batch: prompt lengths 5, 2, 7.
LOOP_VARIANTS = ("mha", "premix", "premix_mla_ablations", "moa", "switchhead", "postmix",
                 "premix_hash")
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 3, 2, 1, 0]]
N_NEW = 6

_full = nnx.jit(lambda model, tokens: model(tokens)[0])
_sample = jax.jit(sample_logits)


def naive_generate(model, prompts, n, *, temperature=0.0, top_p=1.0, seed=0, eos_id=None):
  """Reference decoding: for each new token, the full forward pass (no cache) of every row's own
  tokens, right-padded in one [B, L] buffer (causal: the padding after a row's tokens cannot change
  its logits); the same key-splitting order as `generate`. -> (tokens [B, n], lengths [B])."""
  b = len(prompts)
  lens = np.array([len(p) for p in prompts])
  buf = np.zeros((b, lens.max() + n), np.int32)
  for i, p in enumerate(prompts):
    buf[i, :len(p)] = p
  key = jax.random.key(seed)
  out = np.zeros((b, n), np.int32)
  lengths = np.full((b,), n)
  done = np.zeros((b,), bool)
  for s in range(n):
    logits = np.asarray(_full(model, jnp.asarray(buf)))                        # [B, L, V]
    last = logits[np.arange(b), lens + s - 1]                                  # [B, V]
    key, sub = jax.random.split(key)
    tok = np.asarray(_sample(jnp.asarray(last), sub, jnp.float32(temperature), jnp.float32(top_p)))
    if eos_id is not None:
      tok = np.where(done, eos_id, tok)
      lengths[~done & (tok == eos_id)] = s + 1
      done |= tok == eos_id
    out[:, s] = tok
    buf[np.arange(b), lens + s] = tok
  return out, lengths


@pytest.mark.parametrize("name", LOOP_VARIANTS)
def test_loop_matches_naive_per_token_reference(name):
  _, model = _model(name, seed=3, n_layers=2 if name == "premix_mla_ablations" else 1)
  greedy = generate(model, PROMPTS, max_new_tokens=N_NEW)
  want, _ = naive_generate(model, PROMPTS, N_NEW)
  np.testing.assert_array_equal(greedy.tokens, want)
  assert greedy.lengths.tolist() == [N_NEW] * 3
  np.testing.assert_array_equal(greedy.tokens, generate(model, PROMPTS, max_new_tokens=N_NEW).tokens)
  sampled = generate(model, PROMPTS, max_new_tokens=N_NEW, temperature=1.3, top_p=0.9, seed=11)
  want, _ = naive_generate(model, PROMPTS, N_NEW, temperature=1.3, top_p=0.9, seed=11)
  np.testing.assert_array_equal(sampled.tokens, want)
  again = generate(model, PROMPTS, max_new_tokens=N_NEW, temperature=1.3, top_p=0.9, seed=11)
  np.testing.assert_array_equal(again.tokens, sampled.tokens)  # deterministic for a seed
  other = generate(model, PROMPTS, max_new_tokens=N_NEW, temperature=1.3, top_p=0.9, seed=12)
  assert (other.tokens != sampled.tokens).any()  # and the seed matters


def test_early_stop_at_eos_with_different_prompt_lengths():
  """Rows 1 and 2 continue row 0's prompt by its first two / one greedy tokens, so they meet row 0's
  5th token two / one steps earlier; with that token as EOS every row stops before N, and the loop
  stops feeding tokens after the step where the last row finished (the cache's write index and
  positions show how many it fed). Same shapes as PROMPTS: the compilations are shared."""
  cfg, model = _model("premix", seed=5, n_layers=1)
  base = [3, 14, 15, 9, 2]
  free, _ = naive_generate(model, [base, base, base + [0, 0]], N_NEW)
  free = free[0]
  eos = int(free[4])
  prompts = [base, base + free[:2].tolist(), base + free[:1].tolist()]
  offsets = [0, 2, 1]
  first = [list(free[o:]).index(eos) + 1 for o in offsets]  # each row's EOS step (+1)
  assert max(first) < N_NEW
  want, want_len = naive_generate(model, prompts, N_NEW, eos_id=eos)
  out = generate(model, prompts, max_new_tokens=N_NEW, eos_id=eos)
  np.testing.assert_array_equal(out.tokens, want)
  np.testing.assert_array_equal(out.lengths, want_len)
  assert out.lengths.tolist() == first
  for i, o in enumerate(offsets):  # up to EOS the continuation of the free run; after it only EOS
    assert out.sequences()[i] == free[o:o + first[i]].tolist()
    assert out.tokens[i, first[i]:].tolist() == [eos] * (N_NEW - first[i])
  # the loop itself: tokens fed after the prefill = steps run - 1
  graphdef, state = nnx.split(model)
  prefill, decode = decode_lib.decoding_programs(graphdef)
  tokens, positions = decode_lib.left_pad(prompts)
  p = tokens.shape[1]
  for eos_id, fed in ((eos, max(first) - 1), (-1, N_NEW - 1)):
    logits, cache = prefill(state, jnp.asarray(tokens), jnp.asarray(positions),
                            init_cache(cfg, 3, p + N_NEW))
    _, _, cache = decode(state, logits, cache, jnp.asarray(positions[:, -1] + 1), jax.random.key(0),
                         jnp.float32(0), jnp.float32(1), jnp.int32(eos_id), max_new_tokens=N_NEW)
    assert int(cache.index) == p + fed, eos_id
    n0 = len(prompts[0])  # row 0's new tokens sit at positions n0, n0 + 1, ...
    assert np.asarray(cache.key_positions)[0, p:].tolist() == (
        list(range(n0, n0 + fed)) + [-1] * (N_NEW - fed))


def test_a_decode_compiles_once_and_dispatches_two_programs(monkeypatch):
  """A decode of N tokens traces the model twice (prefill + the loop body) whatever N, and the host
  dispatches two programs (prefill, decode loop), not one per token; new prompts of the same padded
  shape, another temperature / top-p / seed / EOS reuse both compilations."""
  _, model = _model("mha", seed=2, n_layers=1)
  traces = []
  forward = CausalLM.__call__
  monkeypatch.setattr(CausalLM, "__call__", lambda self, *a, **k: traces.append(1) or
                      forward(self, *a, **k))
  calls = {"prefill": 0, "decode": 0}
  programs = decode_lib.decoding_programs

  def counted(graphdef):
    prefill, decode = programs(graphdef)

    def count(name, fn):
      def run(*a, **k):
        calls[name] += 1
        return fn(*a, **k)
      return run
    return count("prefill", prefill), count("decode", decode)

  monkeypatch.setattr(decode_lib, "decoding_programs", counted)
  generate(model, [[1, 2, 3], [4]], max_new_tokens=9)
  assert len(traces) == 2 and calls == {"prefill": 1, "decode": 1}
  generate(model, [[5], [6, 7, 8]], max_new_tokens=9, temperature=0.7, top_p=0.5, seed=3, eos_id=2)
  assert len(traces) == 2 and calls == {"prefill": 2, "decode": 2}
