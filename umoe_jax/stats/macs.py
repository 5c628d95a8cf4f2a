"""Forward MACs (the paper's counting, by component) and the FLOPs derived from them for MFU.

The counting rule is in the `umoe_jax.stats` docstring: per token the kinds' `token_macs` and the
pool experts they pick, per (query, key) pair the kinds' `pair_macs` and the mixing routers', over
all T x T pairs like the paper unless `causal`.
"""
from __future__ import annotations

from typing import Any

from umoe_jax.counting import (MAC_COMPONENTS, as_model_config, linear, merge, ordered,
                               routed_expert)
from umoe_jax.stats.kinds import attention_stats, ffn_stats
from umoe_jax.stats.params import layer_pools
from umoe_jax.stats.router_counts import router_pair_macs


def forward_mac_breakdown(cfg: Any, batch: int = 4, seq_len: int = 1024, *,
                          causal: bool = False) -> dict[str, int]:
  """Forward MACs of `batch` sequences of `seq_len` tokens, by component (the definition is in
  the `umoe_jax.stats` docstring)."""
  cfg = as_model_config(cfg)
  att, ffn = attention_stats(cfg.attention.kind), ffn_stats(cfg.ffn.kind)
  per_token: dict[str, int] = {}
  merge(per_token, att.token_macs(cfg))
  merge(per_token, ffn.token_macs(cfg))
  pool_experts = sum(picks * routed_expert(cfg, aoe)[0] for picks, aoe in layer_pools(cfg))
  merge(per_token, {"experts": pool_experts})
  tokens = batch * seq_len
  out = {name: macs * tokens * cfg.n_layers for name, macs in per_token.items()}
  pairs = batch * att.pairs(cfg, seq_len, causal)
  merge(out, {name: macs * pairs * cfg.n_layers for name, macs in att.pair_macs(cfg).items()})
  merge(out, {"routers": router_pair_macs(cfg) * pairs * cfg.n_layers})
  merge(out, {"lm_head": linear(cfg.d_model, cfg.vocab_size) * tokens})
  return ordered(out, MAC_COMPONENTS)


def forward_macs(cfg: Any, batch: int = 4, seq_len: int = 1024, *, causal: bool = False) -> int:
  """Forward MACs of `batch` x `seq_len` tokens, counted like the paper (full T x T attention)."""
  return sum(forward_mac_breakdown(cfg, batch, seq_len, causal=causal).values())


def forward_flops(cfg: Any, batch: int = 4, seq_len: int = 1024, *, causal: bool = False) -> int:
  """2 x forward MACs."""
  return 2 * forward_macs(cfg, batch, seq_len, causal=causal)


def train_flops_per_token(cfg: Any, seq_len: int, *, causal: bool = False) -> float:
  """Training FLOPs per token for MFU: 3 x forward FLOPs per token (forward, backward to inputs,
  backward to weights) for sequences of `seq_len`. Attention counted over the full T x T matrix
  like the paper (and PaLM's 6N + 12LHQT), or over the T(T+1)/2 visible pairs with `causal=True`."""
  return 3.0 * forward_flops(cfg, 1, seq_len, causal=causal) / seq_len
