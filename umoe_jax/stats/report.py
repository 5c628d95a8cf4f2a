"""The readable report of `model_stats(...)`: numbers with decimal prefixes and the plain-text
tables the command prints."""
from __future__ import annotations

import json

from umoe_jax.output import text_table

# What each component of the tables is, in the order they are listed.
DESCRIPTIONS = {
    "embedding": "token embedding table",
    "attention": "attention projections (q, k, v, o; UMoE: key, shared and residual queries)",
    "attention_routed": "per-expert attention weights (UMoE: low-rank expert queries)",
    "attention_scores": "q . k^T",
    "attention_mix": "a . V (UMoE: mixing the hidden states, width d)",
    "routers": "router logits",
    "experts": "routed expert pool",
    "shared_experts": "always-on experts",
    "ffn": "dense MLP",
    "norms": "RMSNorm scales",
    "lm_head": "output projection",
}


def human(n: float, unit: str = "") -> str:
  """1234567 -> '1.23M' (decimal prefixes, as the paper's 'M' params and 'G' MACs)."""
  for div, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
    if abs(n) >= div:
      return f"{n / div:.2f}{prefix}{unit}"
  return f"{n:g}{unit}"


def human_bytes(n: float) -> str:
  for div, prefix in ((2 ** 30, "GiB"), (2 ** 20, "MiB"), (2 ** 10, "KiB")):
    if n >= div:
      return f"{n / div:.2f} {prefix}"
  return f"{int(n)} B"


def format_table(s: dict) -> str:
  """A readable plain-text report of `model_stats(...)`."""
  m, p, mac, fl, kv = s["model"], s["params"], s["macs"], s["flops"], s["kv_cache"]
  lines = []
  title = s["name"] or "model"
  desc = (f"attention={m['attention']}  ffn={m['ffn']}  d={m['d_model']}  layers={m['n_layers']}  "
          f"vocab={m['vocab_size']}")
  if m["n_experts"]:
    desc += (f"  experts E={m['n_experts']} x d_e={m['d_expert']}  k_att={m['k_att']}  "
             f"k_ffn={m['k_ffn']}{'  (one pool)' if m['share_pool'] and m['k_att'] and m['k_ffn'] else ''}")
  lines += [title, "  " + desc, ""]

  rows = [("Parameters", "total", "active", "exact", "model", "")]
  for n, c in p["by_component"].items():
    check = "" if c["model"] is None else ("ok" if c["model"] == c["total"] else "MISMATCH")
    rows.append(("  " + n, human(c["total"]), human(c["active"]), f"{c['total']:,}",
                 "" if c["model"] is None else f"{c['model']:,}", check))
  rows.append(("  total", human(p["total"]), human(p["active"]), f"{p['total_analytic']:,}",
               "" if p["check"] == "skipped" else f"{p['total']:,}", p["check"]))
  rows.append(("  non-embedding", human(p["total_non_embedding"]),
               human(p["active_non_embedding"]), "", "", ""))
  lines += text_table(rows) + [""]

  rule = "T(T+1)/2 visible pairs" if mac["causal"] else "full T x T attention, as the paper"
  rows = [(f"Forward MACs (B={mac['batch']}, T={mac['seq_len']}; {rule})", "MACs", "share")]
  for n, v in mac["by_component"].items():
    rows.append(("  " + n, human(v), f"{100 * v / mac['forward']:.1f}%"))
  rows.append(("  total", human(mac["forward"]), "100.0%"))
  rows.append(("  per token", human(mac["forward_per_token"]), ""))
  lines += text_table(rows) + [""]
  lines.append(f"Forward FLOPs (2 x MACs): {human(fl['forward'])}   "
               f"training FLOPs per token (3 x forward): {human(fl['train_per_token'])}")
  lines.append("")
  parts = " + ".join(f"{k} {v}" for k, v in kv["values_per_token_per_layer"].items())
  values = sum(kv["values_per_token_per_layer"].values())
  lines.append(f"KV cache ({kv['dtype']}, {kv['bytes_per_value']} B/value): per token per layer "
               f"{parts} = {values} values = {kv['bytes_per_token_per_layer']:,} B; "
               f"all {m['n_layers']} layers {kv['bytes_per_token']:,} B/token "
               f"({human_bytes(kv['bytes_per_token'])}); "
               f"{human_bytes(kv['bytes_per_sequence'])} per sequence of {mac['seq_len']}"
               + ("" if kv["check"] == "skipped" else f"; model cache layout: {kv['check']}"))
  lines.append("")
  used = [n for n in DESCRIPTIONS if n in p["by_component"] or n in mac["by_component"]]
  width = max(len(n) for n in used)
  lines += ["Components:"] + [f"  {n.ljust(width)}  {DESCRIPTIONS[n]}" for n in used]
  if kv["check"] == "mismatch":
    lines += ["", f"WARNING: the model's cache holds {kv['model_values_per_token_per_layer']} "
              f"values per token and layer, the analytic count {values}"]
  if p["check"] == "mismatch":
    lines += ["", "WARNING: the real model and the analytic count differ: "
              + json.dumps(p["mismatches"])]
  return "\n".join(lines)
