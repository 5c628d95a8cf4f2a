"""Cached decoding (issue 3): step-by-step logits equal the full forward pass for every attention kind
(also with left-padded batches), cache sizes equal the statistics, generate() and the CLI."""
from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs.common
from conftest import ROOT, random_module, rel_err, tiny_config
from umoe_jax import stats
from umoe_jax.config import model_config
from umoe_jax.model import CausalLM
from umoe_jax.model.cache import EMPTY, cache_bytes, cache_values_per_token, init_cache
from umoe_jax.model.decode import generate, left_pad, sample_logits

F32_BOUND = 1e-5

VARIANTS = {  # name: (family, overrides)
    "mha": ("dense", {}),
    "premix": ("umoe", {}),
    "premix_mla_ablations": ("umoe", {"attention.latent_dim": 5, "moe.gated": True,
                                      "moe.share_across_layers": True, "router.share_att_ffn": True}),
    "moa": ("moa", {"attention.n_experts": 5}),
    "switchhead": ("switchhead", {"attention.n_experts": 4, "attention.top_k": 1}),
    "postmix": ("umoe", {"attention.kind": "postmix"}),
    # routers fed by the route context (token ids of the new tokens while decoding) and X-MoE
    "premix_hash": ("umoe", {"router.kind": "hash"}),
    "premix_xmoe": ("umoe", {"router.kind": "xmoe", "router.xmoe_learn_temperature": False}),
}
# Only the cache sizes of these are checked (their caching code is that of a variant above).
MORE_VARIANTS = {
    "moa_original": ("moa", {"attention.n_experts": 5, "attention.n_shared_experts": 0}),
    "switchhead_sigmoid": ("switchhead", {"attention.n_experts": 4, "attention.top_k": 2,
                                          "router.kind": "topk_sigmoid", "router.balance_loss": "none"}),
    "postmix_full_keys": ("umoe", {"attention.kind": "postmix", "attention.q_lora_rank": None,
                                   "attention.n_shared_experts": 0}),
    "postmix_top_p": ("umoe", {"attention.kind": "postmix", "attention.top_k": 3,
                               "router.selection": "top_p", "router.entropy_coef": 1e-4}),
    "ffn_moe_hash": ("ffn_moe", {"router.kind": "hash"}),
    "ffn_moe_xmoe": ("ffn_moe", {"router.kind": "xmoe"}),
}

_full = nnx.jit(lambda model, tokens: model(tokens)[0])
_cached = nnx.jit(lambda model, tokens, positions, cache: model(tokens, positions, cache=cache))


def _model(name, seed=0, n_layers=2):
  family, over = {**VARIANTS, **MORE_VARIANTS}[name]
  cfg = tiny_config(family, n_layers=n_layers, **over)
  return cfg, random_module(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)), seed)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_cached_decoding_matches_full_forward(name):
  """A left-padded batch (row 1 three tokens shorter) decoded through the cache: prefill of the
  padded prompts, two single-token steps, one two-token chunk; every row's logits must equal the
  full forward pass of its own unpadded tokens (float32)."""
  # one layer keeps the compilations short; the ablation variant has two (a pool shared across layers)
  cfg, model = _model(name, seed=1, n_layers=2 if name == "premix_mla_ablations" else 1)
  assert_cached_decoding_matches_full(cfg, model)


def assert_cached_decoding_matches_full(cfg, model):
  """The check of `test_cached_decoding_matches_full_forward` for any CausalLM (float32)."""
  rng = np.random.default_rng(2)
  tokens = np.asarray(rng.integers(0, cfg.vocab_size, (2, 9)), np.int32)
  full = np.asarray(_full(model, jnp.asarray(tokens)))                          # [2, 9, V]
  lengths = [5, 2]                                                              # prompt lengths
  padded, positions = left_pad([tokens[0, :5].tolist(), tokens[1, :2].tolist()])
  cache = init_cache(cfg, 2, 10)
  logits, _, cache = _cached(model, jnp.asarray(padded), jnp.asarray(positions), cache)
  got = [np.asarray(logits)[:, -1:]]
  done = 0
  for width in (1, 1, 2):
    nxt = np.stack([tokens[b, lengths[b] + done:lengths[b] + done + width] for b in range(2)])
    pos = np.stack([np.arange(lengths[b] + done, lengths[b] + done + width) for b in range(2)])
    logits, _, cache = _cached(model, jnp.asarray(nxt), jnp.asarray(pos, jnp.int32), cache)
    got.append(np.asarray(logits))
    done += width
  got = np.concatenate(got, axis=1)                                             # [2, 5, V]
  assert int(cache.index) == 5 + done and got.shape[1] == 1 + done
  for b in range(2):
    want = full[b, lengths[b] - 1:lengths[b] + done]
    assert rel_err(got[b], want) < F32_BOUND, b
  # the padding slots of row 1 were never written with a position: never attended
  assert np.asarray(cache.key_positions)[1, :3].tolist() == [EMPTY] * 3
  assert np.asarray(cache.key_positions)[0, :9].tolist() == list(range(9))


def test_postmix_cached_decoding_keeps_slots_without_a_pick_out(monkeypatch):
  """Post-mixing with top-P attention routing: the cache remembers which of each token's (1+K)
  slots are entries, so decoding token by token equals the full forward pass, in which the unused
  slots get no attention; a router the cache keeps no masks for is refused, not attended."""
  from umoe_jax.model.attention import postmix
  cfg, model = _model("postmix_top_p", seed=1, n_layers=1)
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
  _, aux = model(tokens, return_routes=True)
  masks = [np.asarray(r.slot_mask) for name, r in aux["routes"].items() if "attention" in name]
  assert masks and not masks[0].all()                       # slots were left without a pick
  assert init_cache(cfg, 1, 1).layers[0]["slot_mask"].shape == (1, 1, 1 + 3)
  assert_cached_decoding_matches_full(cfg, model)
  monkeypatch.setattr(postmix, "router_masks_slots", lambda router: False)
  with pytest.raises(ValueError, match=r"model.router.selection='top_p'.*router_masks_slots"):
    _cached(model, tokens[:, :2], jnp.broadcast_to(jnp.arange(2, dtype=jnp.int32), (2, 2)),
            init_cache(cfg, 2, 4))


@pytest.mark.parametrize("name", sorted({**VARIANTS, **MORE_VARIANTS}))
def test_cache_size_equals_statistics(name):
  family, over = {**VARIANTS, **MORE_VARIANTS}[name]
  cfg = tiny_config(family, n_layers=2, **over)
  for dtype in ("bfloat16", "float32"):
    cache = init_cache(cfg, batch=3, max_len=5, dtype=dtype)
    per_token = cache_bytes(cache) // (3 * 5)
    assert per_token == stats.kv_cache_bytes_per_token(cfg, dtype=dtype)["total"]
  assert per_token == cache_values_per_token(cfg) * 4 * cfg.n_layers


@pytest.mark.parametrize("family,values", [("umoe", 192 + 768), ("umoe_mla", 192 + 192),
                                           ("dense", 2 * 4 * 192), ("moa", 192 + 192),
                                           ("switchhead", 2 * 4 * 192)])
def test_cache_layout_base(family, values):
  """Pre-mixing caches one key + the hidden state (or the MLA latent); MHA/SwitchHead K, V per head;
  MoA the shared single-head K, V."""
  assert cache_values_per_token(model_config(configs.common.model(family, "base"))) == values


def test_generate_greedy_is_deterministic_and_matches_argmax():
  cfg, model = _model("premix", seed=3, n_layers=1)
  prompts = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11]]
  out = generate(model, prompts, max_new_tokens=5)
  again = generate(model, prompts, max_new_tokens=5)
  np.testing.assert_array_equal(out.tokens, again.tokens)
  # one full forward pass of the right-padded prompt + continuation rows (padding comes last: the
  # causal logits before it are unaffected)
  rows = np.zeros((len(prompts), 5 + 5), np.int32)
  for i, p in enumerate(prompts):
    rows[i, :len(p) + 5] = p + out.tokens[i].tolist()
  logits = np.asarray(_full(model, jnp.asarray(rows)))
  for i, p in enumerate(prompts):
    np.testing.assert_array_equal(logits[i, len(p) - 1:len(p) + 4].argmax(-1), out.tokens[i])
  # sampling: reproducible per seed; top_p -> 0 is greedy; a row stops at EOS
  s1 = generate(model, prompts, max_new_tokens=5, temperature=1.0, top_p=0.9, seed=4)
  s2 = generate(model, prompts, max_new_tokens=5, temperature=1.0, top_p=0.9, seed=4)
  np.testing.assert_array_equal(s1.tokens, s2.tokens)
  tiny_p = generate(model, prompts, max_new_tokens=5, temperature=1.0, top_p=1e-6, seed=5)
  np.testing.assert_array_equal(tiny_p.tokens, out.tokens)
  eos = int(out.tokens[0, 1])
  stopped = generate(model, prompts, max_new_tokens=5, eos_id=eos)
  assert stopped.lengths[0] == 2 and stopped.tokens[0, 2:].tolist() == [eos] * 3
  assert stopped.sequences()[0] == out.tokens[0, :2].tolist()


def test_generate_rejects_prompt_ids_outside_the_vocabulary():
  cfg, model = _model("mha", n_layers=1)
  for bad in (cfg.vocab_size, -1):
    with pytest.raises(ValueError, match=rf"prompt token id {bad} .*vocab_size={cfg.vocab_size}"):
      generate(model, [[1, 2], [3, bad]], max_new_tokens=2)
  # Settings that cannot mean what was asked (a negative temperature decoded greedily, silently).
  for kw, message in (({"temperature": -0.8}, r"temperature=-0\.8 must be >= 0 \(0: greedy\)"),
                      ({"temperature": float("inf")}, r"temperature=inf must be finite"),
                      ({"top_p": 1.5}, r"top_p=1\.5 must be in \(0, 1\]"),
                      ({"max_new_tokens": 0}, r"max_new_tokens=0 must be >= 1")):
    with pytest.raises(ValueError, match=message):
      generate(model, [[1, 2]], **{"max_new_tokens": 2, **kw})


def test_sample_logits_top_p_support_and_frequencies():
  probs = np.array([0.5, 0.25, 0.15, 0.1])
  logits = jnp.asarray(np.tile(np.log(probs), (4000, 1)), jnp.float32)
  draw = lambda t, p, seed: np.asarray(sample_logits(logits, jax.random.key(seed), jnp.float32(t),
                                                     jnp.float32(p)))
  assert (draw(0.0, 1.0, 0) == 0).all()                              # greedy
  nucleus = draw(1.0, 0.7, 1)                                        # {0, 1}: 0.5 < 0.7 <= 0.75
  assert set(np.unique(nucleus)) == {0, 1}
  assert abs((nucleus == 0).mean() - 2 / 3) < 0.04
  full = np.bincount(draw(1.0, 1.0, 2), minlength=4) / 4000
  assert np.abs(full - probs).max() < 0.04
  cold = np.bincount(draw(0.5, 1.0, 3), minlength=4) / 4000         # p^2 renormalised
  assert np.abs(cold - probs ** 2 / (probs ** 2).sum()).max() < 0.04


def test_nucleus_is_the_smallest_set_whose_mass_reaches_top_p():
  """Four equally likely tokens (probabilities exactly 1/4 in float32): top_p = 0.5 is reached by
  two of them, so only two are ever drawn, not a third whose preceding mass equals top_p; the
  ties go to the lower ids, as the stable sort leaves them."""
  logits = jnp.zeros((4000, 4), jnp.float32)
  for top_p, support in ((0.5, {0, 1}), (0.75, {0, 1, 2}), (0.51, {0, 1, 2})):
    drawn = np.asarray(sample_logits(logits, jax.random.key(0), jnp.float32(1.0),
                                     jnp.float32(top_p)))
    assert set(np.unique(drawn)) == support, top_p


def test_cli_prints_a_continuation(tmp_path):
  # One labelled record per prompt (`generate.format_record`, whose layout tests/test_console.py
  # pins), separated by blank lines.
  from umoe_jax.data.tokenizer import ByteTokenizer
  from umoe_jax.generate import format_record
  from umoe_jax.interop.official import save_converted
  m = configs.common.model("umoe", "tiny")
  m.n_layers, m.compute_dtype, m.gmm_backend = 1, "float32", "xla"
  cfg = model_config(m)
  model = random_module(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)), 7)
  ckpt = save_converted(model, m, str(tmp_path / "ckpt"))
  prompts = ["Hello", "ab"]
  tok = ByteTokenizer()
  out = generate(model, [tok.encode(p) for p in prompts], max_new_tokens=4, eos_id=tok.eos_id)
  records = []
  for i, (p, ids) in enumerate(zip(prompts, out.sequences())):
    eos = bool(ids) and ids[-1] == tok.eos_id
    ids = ids[:-1] if eos else ids
    records.append(format_record(i, len(prompts), dict(
        prompt=p, continuation=tok.decode(ids), prompt_tokens=len(p), new_tokens=len(ids),
        stop="eos" if eos else "max_new_tokens", max_new_tokens=4)))
  expected = "\n\n".join(records) + "\n"
  env = dict(os.environ, PYTHONIOENCODING="utf-8", JAX_PLATFORMS="cpu")
  res = subprocess.run([sys.executable, "-m", "umoe_jax.generate", f"--checkpoint={ckpt}",
                        "--prompt=Hello", "--prompt=ab", "--max_new_tokens=4"],
                       cwd=ROOT, env=env, capture_output=True, timeout=300)
  assert res.returncode == 0, res.stderr.decode()[-3000:]
  assert res.stdout.decode("utf-8") == expected


def test_cli_names_a_prompt_that_is_not_utf8():
  # argv bytes that are not UTF-8 reach Python as surrogates; encoding them was a raw traceback.
  last = _generate_error_line("--config=configs/umoe_tiny.py", b"--prompt=ab\xffcd",
                              "--max_new_tokens=2")
  assert last == "error: --prompt=b'ab\\xffcd' is not valid UTF-8; pass the prompt as UTF-8 text"


def _generate_error_line(*args) -> str:
  """The last stderr line of `python -m umoe_jax.generate ARGS`, asserted to exit 1 with no
  traceback."""
  res = subprocess.run([sys.executable, "-m", "umoe_jax.generate", *args], cwd=ROOT,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, timeout=300)
  err = res.stderr.decode("utf-8", "replace")
  assert res.returncode == 1, err[-3000:]
  assert "Traceback" not in err, err[-3000:]
  return err.strip().splitlines()[-1]


@pytest.mark.parametrize("checkpoint", [False, True])
def test_cli_names_a_seed_outside_int64(tmp_path, checkpoint):
  # an OverflowError traceback from nnx.Rngs (random init) or jax.random.key (sampling) before
  args = ["--config=configs/umoe_tiny.py"]
  if checkpoint:
    from umoe_jax.interop.official import save_converted
    m = configs.common.model("umoe", "tiny")
    m.n_layers, m.compute_dtype, m.gmm_backend = 1, "float32", "xla"
    model = random_module(lambda: CausalLM(model_config(m), rngs=nnx.Rngs(0)), 7)
    args = [f"--checkpoint={save_converted(model, m, str(tmp_path / 'ckpt'))}", "--temperature=1"]
  last = _generate_error_line(*args, "--prompt=ab", "--max_new_tokens=2",
                              "--seed=99999999999999999999")
  assert last == "error: --seed=99999999999999999999 is outside the int64 range [-2**63, 2**63)"
