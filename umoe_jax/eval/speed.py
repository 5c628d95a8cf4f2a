"""Inference speed: prefill latency, cached decoding tokens/s, KV-cache bytes, peak memory.

    row = measure(model, batch=32, prompt_len=512, new_tokens=128)
    print(format_table([row]))

`python -m umoe_jax.eval speed` runs it on a checkpoint or a config (`umoe_jax.eval.cli`). For one
batch size B, with the programs `generate()` runs (`umoe_jax.model.decode.decoding_programs`):
  prefill   one forward pass of B prompts of `prompt_len` seeded random tokens (ids >= 1) that fills
            a KV cache of prompt_len + new_tokens slots and returns the last position's logits;
            ms, and prompt tokens/s = B * prompt_len / time;
  decode    the on-device decoding loop (`lax.while_loop`) after that prefill: `new_tokens` greedy
            tokens with no EOS, i.e. new_tokens - 1 cached forward steps of B tokens (the first
            token comes from the prefill's logits); ms per step, and tokens/s = B / step time;
  KV cache  bytes of the cache arrays the prefill returned (their nbytes, positions not counted),
            per token = bytes / (B * slots), against `umoe_jax.stats.kv_cache_bytes_per_token` in
            the cache's dtype (the model zoo's column);
  memory    the device's `peak_bytes_in_use` after the row (the process's peak so far: rows run
            smallest batch first), None where the backend reports no memory statistics (CPU).
Timing: a first untimed call compiles each program; then `warmup` untimed runs and the median of
`repeats` runs, each ended by `block_until_ready` (wall clock: what a caller of generate() waits,
dispatch included). Every run gets a fresh cache (the programs donate it), made outside the timing.
The first decode's tokens are returned ("tokens"): the greedy continuation generate() gives.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from umoe_jax import stats
from umoe_jax.model.cache import cache_bytes, init_cache
from umoe_jax.model.decode import decoding_programs, left_pad
from umoe_jax.output import fmt, markdown_table


def median_seconds(fn: Callable, setup: Callable[[], tuple], warmup: int,
                   repeats: int) -> tuple[float, list[float]]:
  """(median, all) wall seconds of fn(*setup()), setup untimed (fresh donated inputs each run)."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*setup()))
  times = []
  for _ in range(repeats):
    args = jax.block_until_ready(setup())
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times), times


def peak_bytes() -> Optional[int]:
  """The device's peak bytes in use so far, or None where the backend keeps no statistics (CPU)."""
  return (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")


def random_prompts(vocab_size: int, batch: int, prompt_len: int, seed: int = 0) -> np.ndarray:
  """[batch, prompt_len] int32 token ids in [1, vocab_size) (never 0, a common padding id)."""
  rng = np.random.default_rng(seed)
  return rng.integers(1, vocab_size, size=(batch, prompt_len), dtype=np.int32)


def measure(model: nnx.Module, batch: int, *, prompt_len: int, new_tokens: int, warmup: int = 1,
            repeats: int = 5, cache_dtype: Optional[str] = None, seed: int = 0) -> dict:
  """One row of the module docstring's measurements for `batch` sequences (a JSON-ready dict, plus
  "tokens": the first decode's [batch, new_tokens] greedy tokens as a numpy array)."""
  cfg = model.cfg
  slots = prompt_len + new_tokens
  if batch < 1 or prompt_len < 1 or new_tokens < 2 or repeats < 1 or warmup < 0:
    raise ValueError(f"need batch, prompt_len, repeats >= 1, new_tokens >= 2 (one cached step), "
                     f"warmup >= 0; got {batch}, {prompt_len}, {repeats}, {new_tokens}, {warmup}")
  if slots > cfg.max_seq_len:
    raise ValueError(f"prompt_len ({prompt_len}) + new_tokens ({new_tokens}) = {slots} exceeds "
                     f"model.max_seq_len={cfg.max_seq_len}")
  graphdef, state = nnx.split(model)
  prefill, decode = decoding_programs(graphdef)
  prompts = random_prompts(cfg.vocab_size, batch, prompt_len, seed)
  tokens, positions = (jnp.asarray(a) for a in left_pad(prompts.tolist()))
  fresh_cache = lambda: init_cache(cfg, batch, slots, cache_dtype)
  greedy, top_p, no_eos = jnp.float32(0), jnp.float32(1), jnp.int32(-1)
  next_pos, key = positions[:, -1] + 1, jax.random.key(0)
  decode_n = lambda *a: decode(*a, max_new_tokens=new_tokens)

  t0 = time.perf_counter()
  logits, cache = jax.block_until_ready(prefill(state, tokens, positions, fresh_cache()))
  compile_prefill_s = time.perf_counter() - t0
  measured = cache_bytes(cache)                          # the arrays themselves, not a formula
  dtype = jax.tree.leaves(cache.layers)[0].dtype
  t0 = time.perf_counter()
  out, _, _ = jax.block_until_ready(decode_n(state, logits, cache, next_pos, key, greedy, top_p,
                                             no_eos))
  compile_decode_s = time.perf_counter() - t0
  out = np.asarray(out)
  del logits, cache

  prefill_s, prefill_times = median_seconds(
      prefill, lambda: (state, tokens, positions, fresh_cache()), warmup, repeats)

  def prefilled():
    logits, cache = prefill(state, tokens, positions, fresh_cache())
    return state, logits, cache, next_pos, key, greedy, top_p, no_eos

  decode_s, decode_times = median_seconds(decode_n, prefilled, warmup, repeats)
  step_s = decode_s / (new_tokens - 1)
  predicted = stats.kv_cache_bytes_per_token(cfg, dtype=dtype)["total"]
  return dict(
      batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, cache_dtype=str(dtype),
      prefill_ms=1e3 * prefill_s, prefill_tokens_per_s=batch * prompt_len / prefill_s,
      decode_ms_per_step=1e3 * step_s, decode_tokens_per_s=batch / step_s,
      decode_total_ms=1e3 * decode_s,
      kv_cache_bytes=measured, kv_bytes_per_token_measured=measured / (batch * slots),
      kv_bytes_per_token_stats=predicted, kv_match=measured == predicted * batch * slots,
      peak_bytes=peak_bytes(), compile_prefill_s=compile_prefill_s,
      compile_decode_s=compile_decode_s, prefill_times_ms=[1e3 * t for t in prefill_times],
      decode_times_ms=[1e3 * t for t in decode_times], tokens=out)


def param_bytes(model: nnx.Module) -> int:
  """Bytes of the model's parameters as placed."""
  return sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def param_dtypes(model: nnx.Module) -> str:
  """The dtypes of the model's parameters, e.g. "float32" or "bfloat16, float32"."""
  return ", ".join(sorted({str(x.dtype) for x in jax.tree.leaves(nnx.state(model, nnx.Param))}))


def cast_params(model: nnx.Module, dtype: str) -> nnx.Module:
  """The model with every parameter cast to `dtype` (a checkpoint stores float32; a model is
  often served in bfloat16)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  return nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(dtype), params), rest)


def _mib(b: Optional[float]) -> str:
  return "n/a" if b is None else f"{b / 2**20:,.2f}"


def format_table(rows: Sequence[dict]) -> str:
  """One Markdown row per batch size; the KV column shows measured (stats' prediction) per token."""
  head = ("batch", "prefill ms", "prefill tok/s", "decode ms/step", "decode tok/s",
          "KV B/token measured (stats)", "KV MiB", "peak MiB")
  body = [(str(r["batch"]), f"{r['prefill_ms']:.2f}", fmt(round(r["prefill_tokens_per_s"])),
           f"{r['decode_ms_per_step']:.3f}", f"{r['decode_tokens_per_s']:,.1f}",
           f"{r['kv_bytes_per_token_measured']:,.0f} ({r['kv_bytes_per_token_stats']:,})"
           + ("" if r["kv_match"] else " MISMATCH"),
           _mib(r["kv_cache_bytes"]), _mib(r["peak_bytes"])) for r in rows]
  return markdown_table([head] + body)
