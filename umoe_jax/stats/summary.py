"""`model_stats`: every statistic of one model as a JSON-ready dict (what the command prints as
JSON, and what the table and the model zoo are made from), with both cross-checks' verdicts."""
from __future__ import annotations

from typing import Any, Optional

from umoe_jax.counting import Count, as_model_config
from umoe_jax.stats.kv_cache import (itemsize, kv_cache_bytes_per_token, kv_cache_values_per_token,
                                     model_kv_cache_values_per_token)
from umoe_jax.stats.macs import forward_mac_breakdown, train_flops_per_token
from umoe_jax.stats.params import active_params, analytic_params
from umoe_jax.stats.real_model import model_params


def model_stats(cfg: Any, *, batch: int = 4, seq_len: Optional[int] = None, causal: bool = False,
                kv_dtype: str = "bfloat16", from_model: bool = True, name: str = "") -> dict:
  """All statistics of a model as a JSON-ready dict. `seq_len` defaults to `model.max_seq_len`."""
  cfg = as_model_config(cfg, name)
  seq_len = cfg.max_seq_len if seq_len is None else int(seq_len)
  comps = analytic_params(cfg)
  real = model_params(cfg) if from_model else None
  by_comp = {}
  for n in list(comps) + [n for n in (real or {}) if n not in comps]:
    c = comps.get(n, Count(0))
    by_comp[n] = {"total": c.total, "active": c.active,
                  "model": None if real is None else real.get(n, 0)}
  mismatches = ({} if real is None else
                {n: {"model": v["model"], "analytic": v["total"]}
                 for n, v in by_comp.items() if v["model"] != v["total"]})
  total_analytic = sum(c.total for c in comps.values())
  macs = forward_mac_breakdown(cfg, batch, seq_len, causal=causal)
  fwd = sum(macs.values())
  kv_values = kv_cache_values_per_token(cfg)
  kv = kv_cache_bytes_per_token(cfg, kv_dtype)
  kv_model = model_kv_cache_values_per_token(cfg) if from_model else None
  kv_check = ("skipped" if kv_model is None else
              "ok" if kv_model == sum(kv_values.values()) else "mismatch")
  emb = sum(comps[n].total for n in ("embedding", "lm_head") if n in comps)
  return {
      "name": name,
      "model": {
          "attention": cfg.attention.kind, "ffn": cfg.ffn.kind, "vocab_size": cfg.vocab_size,
          "d_model": cfg.d_model, "n_layers": cfg.n_layers, "max_seq_len": cfg.max_seq_len,
          "n_experts": cfg.moe.n_experts, "d_expert": cfg.moe.d_expert,
          "k_att": cfg.attention.top_k if cfg.attention_uses_experts else 0,
          "k_ffn": cfg.ffn.top_k if cfg.ffn_uses_experts else 0,
          "share_pool": cfg.moe.share_pool,
      },
      "params": {
          "total": sum(real.values()) if real is not None else total_analytic,
          "total_analytic": total_analytic,
          "total_non_embedding": total_analytic - emb,
          "active": active_params(cfg),
          "active_non_embedding": active_params(cfg, non_embedding=True),
          "by_component": by_comp,
          "check": "skipped" if real is None else ("ok" if not mismatches else "mismatch"),
          "mismatches": mismatches,
      },
      "macs": {
          "batch": batch, "seq_len": seq_len, "causal": causal,
          "forward": fwd, "forward_per_token": fwd / (batch * seq_len), "by_component": macs,
      },
      "flops": {
          "forward": 2 * fwd,
          "train_per_token": train_flops_per_token(cfg, seq_len, causal=causal),
      },
      "kv_cache": {
          "dtype": str(kv_dtype), "bytes_per_value": itemsize(kv_dtype),
          "values_per_token_per_layer": kv_values,
          "bytes_per_token_per_layer": kv["per_layer"],
          "bytes_per_token": kv["total"],
          "bytes_per_sequence": kv["total"] * seq_len,
          "model_values_per_token_per_layer": kv_model,
          "check": kv_check,
      },
  }
