"""The model and tokenizer an evaluation runs on, with errors a user can act on.

    model, tokenizer, info = load_for_eval(checkpoint="runs/umoe_tiny")
    model, tokenizer, info = load_for_eval(config=cfg)            # random parameters (benchmarks)

`checkpoint` is a training workdir (config.json + checkpoints/<step>) or a converted official
checkpoint (config.json + params/); the architecture comes from its config.json, else from `config`
(an experiment ConfigDict, e.g. `--config=configs/umoe_base.py`). The tokenizer is `tokenizer`
("byte" or a tokenizer.json), else the experiment config's `data.tokenizer`, else "byte"; it must fit
the model (its ids below model.vocab_size). Every failure is an EvalError naming the path.
"""
from __future__ import annotations

import os
from typing import Any, Optional

from umoe_jax.eval.errors import EvalError


def tokenizer_spec(flag: Optional[str], saved: Optional[dict], config: Any) -> tuple[str, str]:
  """(tokenizer spec, eos token): the flag, else the checkpoint's (or config's) data.tokenizer,
  else "byte"."""
  if flag:
    return flag, ""
  for source in (saved, config.to_dict() if config is not None else None):
    data = (source or {}).get("data") or {}
    if data.get("tokenizer"):
      return data["tokenizer"], data.get("eos_token", "") or ""
  return "byte", ""


def load_for_eval(checkpoint: Optional[str] = None, config: Any = None, *,
                  tokenizer: Optional[str] = None, seed: int = 0,
                  compute_dtype: Optional[str] = "float32"):
  """(CausalLM, tokenizer, info {"checkpoint", "tokenizer", "model"}) (module docstring)."""
  from umoe_jax.data.tokenizer import check_vocab, make_tokenizer
  from umoe_jax.model.decode import load_model, read_checkpoint_config

  if checkpoint is None and config is None:
    raise EvalError("give --checkpoint=DIR, or --config=configs/<model>.py for random parameters")
  saved = None
  if checkpoint is not None:
    if not os.path.isdir(checkpoint):
      raise EvalError(f"checkpoint directory {checkpoint!r} does not exist")
    saved = read_checkpoint_config(checkpoint)
    if saved is None and config is None:
      raise EvalError(f"checkpoint {checkpoint!r} has no config.json (looked in it and its parent): "
                      "pass --config=configs/<model>.py with its architecture")
  try:
    model, model_section, saved = load_model(checkpoint, config, seed=seed,
                                             compute_dtype=compute_dtype or None)
  except (ValueError, FileNotFoundError, KeyError) as e:
    raise EvalError(f"cannot load the model from {checkpoint or 'the config'}: {e}") from e
  spec, eos_token = tokenizer_spec(tokenizer, saved, config)
  try:
    tok = make_tokenizer(spec, eos_token)
    check_vocab(tok, model_section.vocab_size)
  except (ValueError, FileNotFoundError) as e:
    raise EvalError(str(e)) from e
  info = {"checkpoint": checkpoint, "tokenizer": spec, "model": {
      k: model_section.get(k) for k in ("vocab_size", "d_model", "n_layers", "max_seq_len",
                                        "compute_dtype")}}
  return model, tok, info
