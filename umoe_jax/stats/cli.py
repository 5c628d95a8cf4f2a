"""The command line, `python -m umoe_jax.stats` (the usage is in the `umoe_jax.stats` docstring).

Flags are defined only when run as a program, so importing the package (the trainer does, for MFU)
never registers flags that could clash with the caller's.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Mapping, Optional, Sequence

from umoe_jax.config import ModelConfig
from umoe_jax.counting import as_model_config
from umoe_jax.stats.report import format_table
from umoe_jax.stats.summary import model_stats
from umoe_jax.stats.zoo import ZOO_PATTERNS, zoo_files, zoo_markdown


def _define_flags():
  from absl import flags
  from ml_collections import config_flags
  config_flags.DEFINE_config_file("config", None, "Experiment config file (configs/*.py).",
                                  lock_config=True)
  flags.DEFINE_integer("batch", 4, "Sequences per forward pass for the MAC count.")
  flags.DEFINE_integer("seq_len", None, "Tokens per sequence (default: model.max_seq_len).")
  flags.DEFINE_bool("causal", False, "Count only the visible (causal) attention pairs.")
  flags.DEFINE_string("kv_dtype", "bfloat16", "KV-cache dtype.")
  flags.DEFINE_bool("json", False, "Print one JSON object instead of the table.")
  flags.DEFINE_bool("zoo", False, "Print the markdown model-zoo table of --zoo_dir and exit.")
  flags.DEFINE_string("zoo_dir", "configs", "Directory of zoo configs.")
  flags.DEFINE_bool("from_model", True, "Count parameters on the (abstract) model and cross-check "
                    "the analytic breakdown; off = analytic only.")
  # `--help` lists the key flags of the program's file (sys.argv[0]), not of this module.
  for flag in flags.FLAGS.get_key_flags_for_module(__name__):
    flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)
  return flags.FLAGS


def _main(argv):
  from absl import flags
  from ml_collections import config_flags
  if len(argv) > 1:
    raise SystemExit(f"error: unexpected arguments: {' '.join(argv[1:])}")
  from umoe_jax.config import ConfigError
  FLAGS = flags.FLAGS
  _check_flags(FLAGS)
  if FLAGS.zoo:
    try:
      print(zoo_markdown(FLAGS.zoo_dir, batch=FLAGS.batch, kv_dtype=FLAGS.kv_dtype))
    except ConfigError as e:  # a zoo config that does not load, or an invalid model section
      raise SystemExit(f"error: {e}") from None
    return 0
  if FLAGS.config is None:
    raise SystemExit("--config=configs/<model>.py is required (or --zoo)")
  name = config_flags.get_config_filename(FLAGS["config"])
  try:
    _check_seq_len(as_model_config(FLAGS.config, f"--config={name}"), FLAGS.seq_len)
    s = model_stats(FLAGS.config, batch=FLAGS.batch, seq_len=FLAGS.seq_len, causal=FLAGS.causal,
                    kv_dtype=FLAGS.kv_dtype, from_model=FLAGS.from_model, name=name)
  except ConfigError as e:  # an override the model refuses, e.g. --config.model.d_model=-3
    raise SystemExit(f"error: {e}") from None
  overrides = config_flags.get_override_values(FLAGS["config"])
  if overrides:
    s["overrides"] = overrides
  if FLAGS.json:
    print(json.dumps(s, indent=1, default=str))
  else:
    if overrides:
      s["name"] += "  " + " ".join(f"{k}={v}" for k, v in _flatten(overrides).items())
    print(format_table(s))
  return 1 if "mismatch" in (s["params"]["check"], s["kv_cache"]["check"]) else 0


def _check_flags(FLAGS) -> None:
  """The command's own flags, before any model is built (else a ZeroDivisionError, a TypeError
  of numpy's or a FileNotFoundError far from the flag)."""
  from umoe_jax.stats.kv_cache import itemsize
  if FLAGS.batch < 1:
    raise SystemExit(f"error: --batch={FLAGS.batch} must be >= 1")
  if FLAGS.seq_len is not None and FLAGS.seq_len < 1:
    raise SystemExit(f"error: --seq_len={FLAGS.seq_len} must be >= 1")
  try:
    itemsize(FLAGS.kv_dtype)
  except TypeError:
    raise SystemExit(f"error: --kv_dtype={FLAGS.kv_dtype!r} is not a numeric dtype (e.g. bfloat16, "
                     "float16, float32, int8, float8_e4m3fn)") from None
  if FLAGS.zoo:
    _check_zoo_dir(FLAGS.zoo_dir)


def _check_zoo_dir(zoo_dir: str) -> None:
  """--zoo_dir is a directory holding zoo configs (else an empty table, exit status 0)."""
  if "://" in zoo_dir:
    raise SystemExit(f"error: --zoo_dir={zoo_dir!r}: zoo configs are Python files, imported from a "
                     "local directory (copy them here first)")
  if not os.path.exists(zoo_dir):
    raise SystemExit(f"error: --zoo_dir={zoo_dir!r}: no such directory")
  if not os.path.isdir(zoo_dir):
    raise SystemExit(f"error: --zoo_dir={zoo_dir!r} is a file, not a directory of zoo configs")
  if not zoo_files(zoo_dir):
    raise SystemExit(f"error: --zoo_dir={zoo_dir!r} holds no zoo config: expected config files "
                     f"named {', '.join(ZOO_PATTERNS)} (like configs/umoe_tiny.py)")


def _check_seq_len(model: ModelConfig, seq_len: Optional[int]) -> None:
  """--seq_len within the model's max_seq_len: the model refuses longer sequences for every
  attention kind (`LM._decoder`; the trainer's train.seq_len check), so their counts describe no
  forward pass the model can run."""
  max_seq_len = model.max_seq_len
  if seq_len is not None and seq_len > max_seq_len:
    raise SystemExit(f"error: --seq_len={seq_len} exceeds the model's max_seq_len={max_seq_len}; "
                     "lower --seq_len or raise --config.model.max_seq_len")


def _flatten(d: Mapping, prefix: str = "") -> dict:
  """{"model": {"n_layers": 2}} -> {"model.n_layers": 2}: the overrides as the command spells them."""
  out = {}
  for k, v in d.items():
    if isinstance(v, Mapping):
      out.update(_flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def run_cli(argv: Optional[Sequence[str]] = None) -> None:
  """Runs the command on `argv` (default: sys.argv); exits 1 when a cross-check finds a mismatch."""
  from absl import app

  from umoe_jax import flag_errors
  from umoe_jax.config import files as config_file
  from umoe_jax.config import ConfigError
  try:
    config_file.check_argv(sys.argv if argv is None else argv)  # else config_flags' traceback
  except ConfigError as e:
    raise SystemExit(f"error: {e}") from None
  _define_flags()
  app.run(_main, argv=list(argv) if argv is not None else None,
          flags_parser=flag_errors.parser(exit_code=1))

