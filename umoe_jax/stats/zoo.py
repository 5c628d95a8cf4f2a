"""The model zoo: the statistics of every config file of a directory matching the zoo patterns, as
the markdown table of docs/model_zoo.md (`python -m umoe_jax.stats --zoo`)."""
from __future__ import annotations

import fnmatch
import os
import sys
from typing import Sequence

from umoe_jax.config import files as config_file
from umoe_jax.config import ConfigError, ModelConfig
from umoe_jax.counting import as_model_config
from umoe_jax.stats.summary import model_stats

ZOO_PATTERNS = ("*_tiny.py", "*_base.py", "*_large.py")


def load_config_file(path: str):
  """`get_config()` of a config file, loaded by `config_file.load_file` (one loader: a ConfigError
  naming the file, "zoo config PATH", and the line of a syntax error or of what raised; no
  get_config; a get_config returning no ConfigDict); its parent directory's parent goes on
  sys.path (for `from configs import common`)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(path)))
  if root not in sys.path:
    sys.path.insert(0, root)
  return config_file.load_file(path, label=f"zoo config {path}")


def zoo_model(path: str) -> ModelConfig:
  """The model of the zoo config file `path`; a ConfigError naming the file where its model is not
  valid (was the bare "model.d_model=-3 must be positive", no file named)."""
  cfg = load_config_file(path)
  try:
    return as_model_config(cfg)
  except ConfigError as e:
    raise ConfigError(f"zoo config {path}: {e}") from e


def zoo_files(config_dir: str = "configs", patterns: Sequence[str] = ZOO_PATTERNS) -> list[str]:
  """Config files matching `patterns`, ordered by scale (pattern order), then name."""
  names = sorted(os.listdir(config_dir))
  out = []
  for pattern in patterns:
    out += [os.path.join(config_dir, n) for n in names if fnmatch.fnmatch(n, pattern)]
  return out


def zoo_rows(config_dir: str = "configs", patterns: Sequence[str] = ZOO_PATTERNS, *,
             batch: int = 4, kv_dtype: str = "bfloat16", from_model: bool = True) -> list[dict]:
  """`model_stats` of every zoo config at its `max_seq_len` (1024 for base/large = the paper's)."""
  rows = []
  for path in zoo_files(config_dir, patterns):
    name = os.path.relpath(path, os.path.dirname(os.path.abspath(config_dir)))
    rows.append(model_stats(zoo_model(path), batch=batch, kv_dtype=kv_dtype,
                            from_model=from_model, name=name))
  return rows


def _in_units(n: float, div: float, suffix: str) -> str:
  x = n / div
  return f"{x:,.1f}{suffix}" if x >= 10 else f"{x:.3f}{suffix}"


def zoo_markdown(config_dir: str = "configs", patterns: Sequence[str] = ZOO_PATTERNS, *,
                 batch: int = 4, kv_dtype: str = "bfloat16", from_model: bool = True) -> str:
  """The model zoo as a markdown table (what `python -m umoe_jax.stats --zoo` prints).

  Parameters in M (10^6), MACs in G (10^9) like the paper's Table 1; MACs of `batch` sequences of
  the model's `max_seq_len` tokens, counted like the paper (full T x T attention)."""
  lines = [
      "| config | attention / FFN | total params | active params | "
      f"forward MACs ({batch}×T) | T | train FLOPs/token | KV cache/token ({kv_dtype}) | "
      "KV values/token/layer |",
      "|---|---|--:|--:|--:|--:|--:|--:|--:|"]
  for s in zoo_rows(config_dir, patterns, batch=batch, kv_dtype=kv_dtype, from_model=from_model):
    m, p, kv = s["model"], s["params"], s["kv_cache"]
    if p["check"] == "mismatch":
      raise ValueError(f"{s['name']}: model and analytic parameter counts differ: {p['mismatches']}")
    if kv["check"] == "mismatch":
      raise ValueError(f"{s['name']}: model and analytic KV-cache sizes differ")
    values = " + ".join(str(v) for v in kv["values_per_token_per_layer"].values())
    lines.append(
        f"| `{s['name']}` | {m['attention']} / {m['ffn']} | {_in_units(p['total'], 1e6, 'M')} | "
        f"{_in_units(p['active'], 1e6, 'M')} | {_in_units(s['macs']['forward'], 1e9, 'G')} | "
        f"{s['macs']['seq_len']} | {_in_units(s['flops']['train_per_token'], 1e6, 'M')} | "
        f"{kv['bytes_per_token']:,} B | {values} |")
  return "\n".join(lines)
