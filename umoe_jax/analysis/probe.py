"""The probe: a fixed set of N corpus tokens, and every router's picks on it from a forward pass.

  rows = probe_tokens(data_cfg, tokens=N, seq_len=T, seed=S)   # int32 [ceil(N / T), T]
  fn = jax.jit(functools.partial(route_outputs, graphdef=graphdef))
  routes = collect(fn, params, rows, n_tokens=N)                # {router: Routes}

The probe is the corpus packed as in training (documents + EOS, windows of T + 1 tokens, inputs =
the first T), documents shuffled by `seed`, read once: the same (data, seed, T) give the same probe
tokens for every checkpoint. The first N tokens of the windows (row by row) are the probe.

Routing is read from the model's own forward (`CausalLM(..., return_routes=True)`), without a
training step (as in evaluation: SMoE-Dropout at its full k, StableMoE's frozen token-id router).
Router names are "layer_<i>/<router>": "attention" and "ffn" (UMoE's two routers into one pool),
SwitchHead's "attention_v<h>" / "attention_o<h>".
"""
from __future__ import annotations

import dataclasses
import itertools
import re
from typing import Any, Callable, Optional, Sequence

import numpy as np

from umoe_jax.analysis.routing import NO_PICK

ROUTER_NAME = re.compile(r"^layer_(\d+)/(.+)$")


@dataclasses.dataclass(frozen=True)
class Routes:
  """One router's picks on the probe: expert_ids [N, K] int32, probs [N, E] float32."""
  expert_ids: np.ndarray
  probs: np.ndarray

  @property
  def n_experts(self) -> int:
    return int(self.probs.shape[-1])

  @property
  def top_k(self) -> int:
    return int(self.expert_ids.shape[-1])


def split_name(name: str) -> tuple[int, str]:
  """'layer_3/ffn' -> (3, 'ffn')."""
  m = ROUTER_NAME.match(name)
  if not m:
    raise ValueError(f"router name {name!r} is not of the form layer_<i>/<router>")
  return int(m.group(1)), m.group(2)


def select_routers(names: Sequence[str], wanted: Sequence[str]) -> list[str]:
  """The router names of `names` matching `wanted` (a router kind such as "ffn", or a full name
  such as "layer_0/ffn"); all of them if `wanted` is empty. An unknown name raises naming it."""
  names = sorted(names, key=split_name)
  if not wanted:
    return names
  kinds = sorted({split_name(n)[1] for n in names})
  out = []
  for w in wanted:
    hits = [n for n in names if n == w or split_name(n)[1] == w]
    if not hits:
      raise ValueError(f"unknown router name {w!r}; this model's routers: {', '.join(kinds)} "
                       f"(or one of them per layer, e.g. {names[0] if names else 'layer_0/ffn'})")
    out += [n for n in hits if n not in out]
  return sorted(out, key=split_name)


def probe_tokens(data_cfg: Any, *, tokens: int, seq_len: int, seed: int,
                 describe: str = "") -> np.ndarray:
  """int32 [ceil(tokens / seq_len), seq_len]: the probe's windows of the eval split of `data_cfg`.

  Raises ValueError naming the corpus (`describe`, else data_cfg's eval path) when it holds fewer
  than `tokens` tokens in windows of `seq_len`.
  """
  from umoe_jax import data as data_lib

  if tokens <= 0 or seq_len <= 0:
    raise ValueError(f"--tokens={tokens} and --seq_len={seq_len} must be positive")
  rows = -(-tokens // seq_len)
  ds = data_lib.pipeline.batched_dataset(data_cfg, split="eval", seq_len=seq_len, batch_size=1,
                                         seed=seed, shuffle=True, num_epochs=1)
  it = iter(ds)
  try:
    got = [b["inputs"][0] for b in itertools.islice(it, rows)]
  finally:
    it.close()
  if len(got) < rows:
    name = describe or data_cfg.get("eval_path") or data_cfg.source
    raise ValueError(f"probe corpus {name!r} holds {len(got) * seq_len:,} tokens in windows of "
                     f"{seq_len} ({len(got)} windows), fewer than --tokens={tokens:,}; use a larger "
                     f"corpus, fewer --tokens or a shorter --seq_len")
  return np.stack(got).astype(np.int32)


def route_outputs(params: Any, tokens: Any, *, graphdef: Any,
                  with_probs: bool = True) -> dict[str, tuple]:
  """{router: (expert_ids [B, T, K] int32, NO_PICK in slots without a pick; probs [B, T, E] float32
  or None)} of one forward pass of the model `graphdef` with `params` (a pure dict) on tokens [B, T];
  jit it with graphdef bound."""
  import jax.numpy as jnp
  from flax import nnx

  model = nnx.merge(graphdef, params)
  _, aux = model(tokens, return_routes=True)
  # Slots without a pick (top-P, expert choice: slot_mask False) read NO_PICK.
  ids = lambda r: (r.expert_ids if r.slot_mask is None
                   else jnp.where(r.slot_mask, r.expert_ids, NO_PICK))
  return {name: (ids(r), r.probs if with_probs else None) for name, r in aux["routes"].items()}


def collect(fn: Callable, params: Any, rows: np.ndarray, *, n_tokens: int,
            batch_size: int = 8, routers: Optional[Sequence[str]] = None,
            progress: Optional[Callable[[int], None]] = None) -> dict[str, Routes]:
  """Every router's picks on the probe rows [R, T] (the first n_tokens, row by row).

  `fn(params, tokens [b, T]) -> route_outputs(..., with_probs=True)`; a batch holds batch_size
  rows, or the power of two that holds every row when that is fewer; the last batch is padded with
  copies of the first row (causal routing: padding rows never change the real ones) so that one
  compile serves. `routers`: names to keep (default all). `progress(n)` is told the rows of each
  batch once routed.
  """
  import jax

  from umoe_jax.eval.scoring import rows_per_forward
  rows = np.asarray(rows, np.int32)
  n_rows, t = rows.shape
  batch_size = rows_per_forward(batch_size, n_rows)  # not hundreds of copies of the first row
  parts: dict[str, list] = {}
  for start in range(0, n_rows, batch_size):
    batch = rows[start:start + batch_size]
    real = len(batch)
    if real < batch_size:
      batch = np.concatenate([batch, np.repeat(rows[:1], batch_size - real, axis=0)])
    out = jax.device_get(fn(params, batch))
    for name, (ids, probs) in out.items():
      if routers is not None and name not in routers:
        continue
      parts.setdefault(name, []).append((np.asarray(ids)[:real], np.asarray(probs)[:real]))
    if progress:
      progress(real)
  flat = lambda chunks: np.concatenate(chunks).reshape(n_rows * t, -1)[:n_tokens]
  return {name: Routes(expert_ids=flat([c[0] for c in chunks]).astype(np.int32),
                       probs=flat([c[1] for c in chunks]).astype(np.float32))
          for name, chunks in parts.items()}


def shared_pool_pairs(model_cfg: Any, names: Sequence[str]) -> list[tuple[int, str, str]]:
  """(layer, attention router, FFN router) of every layer whose attention and FFN route into one
  expert pool (`moe.share_pool` with both sub-layers routed: UMoE), among `names`."""
  if not (model_cfg.moe.share_pool and model_cfg.attention_uses_experts
          and model_cfg.ffn_uses_experts):
    return []
  present = set(names)
  pairs = []
  for i in sorted({split_name(n)[0] for n in names}):
    att, ffn = f"layer_{i}/attention", f"layer_{i}/ffn"
    if att in present and ffn in present:
      pairs.append((i, att, ffn))
  return pairs
