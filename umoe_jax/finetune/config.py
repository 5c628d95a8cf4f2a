"""The fine-tuning config (`default_config()`; configs/finetune/*.py start from it) and its check.

Sections:
  init_from    a training workdir or a converted official checkpoint (`umoe_jax.interop.official`):
               the backbone's architecture (its config.json) and parameters
  data         files, fields, labels, the dev carve-out, tokenizer and sequence length
  model        pooling, head dropout, compute dtype, remat
  train        epochs, batch sizes, the two learning rates (head, body), AdamW, freezing, balance loss
  checkpoint   extra saves within an epoch, how many to keep
  log          TensorBoard, JSONL, progress bar
`validate(config)` checks every key and value before any file is read; errors name the key.
"""
from __future__ import annotations

from typing import Any

import ml_collections
from ml_collections import config_dict

from umoe_jax.config import ConfigError
from umoe_jax.config.fields import optional

FORMATS = ("auto", "jsonl", "csv", "tsv", "parquet")   # data.format
POOLINGS = ("last", "mean")                             # model.pooling
SECTIONS = ("init_from", "data", "model", "train", "checkpoint", "log")
SELECT_METRICS = ("accuracy", "macro_f1")


def default_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.init_from = ""                 # the pretrained model: a training workdir or a converted
                                   # official checkpoint (required)
  c.data = ml_collections.ConfigDict(dict(
      train_path="",               # JSONL / CSV / TSV / parquet file with a text and a label field
      dev_path="",                 # dev file; "" = carve data.dev_fraction out of the training file
      test_path="",                # test file, scored with the best dev checkpoint; "" = none
      format="auto",               # file format: "auto" (by extension), jsonl, csv, tsv or parquet
      text_field="text",           # the field (column, key) holding the text
      label_field="label",         # the field holding the label: a name or an integer
      label_names=(),              # the class order; () = the sorted training labels
      dev_fraction=0.1,            # share of each class carved out as dev, by a hash of (seed,
                                   # text): the same split for any file order
      tokenizer="",                # "" = the init_from run's tokenizer; else "byte" or a
                                   # tokenizer.json
      eos_token="",                # the EOS token of a tokenizer.json; "" = detect it
      bos_id=optional(int),        # a token put first in every text (1 for Llama-2 checkpoints)
      append_eos=True,             # EOS after every text: the token "last" pooling reads
      max_len=128,                 # tokens per text, BOS / EOS included; longer texts are cut
  ))
  c.model = ml_collections.ConfigDict(dict(
      pooling="last",              # features for the head: "last" (the last real token) or "mean"
                                   # (the mean over real tokens)
      head_dropout=0.1,            # dropout on the pooled features, in training only
      compute_dtype="",            # "" = the checkpoint's (bfloat16 in the recipes); e.g. float32
      # What each decoder block keeps for the backward pass, as train.remat: none, block, dots or
      # dots_no_batch (True / False = block / none).
      remat=config_dict.FieldReference("none", field_type=object),
  ))
  c.train = ml_collections.ConfigDict(dict(
      seed=0,                      # head init, data order, dropout and the dev carve-out
      epochs=3,                    # passes over the training split
      batch_size=32,               # texts per step
      eval_batch_size=64,          # texts per dev / test forward pass
      head_learning_rate=1e-3,     # peak learning rate of the new classification head
      body_learning_rate=3e-5,     # peak learning rate of the pretrained decoder (unused with
                                   # freeze_body)
      warmup_ratio=0.06,           # linear warmup over this share of the steps, then cosine decay
      min_lr_ratio=0.0,            # the cosine decay's floor, as a fraction of the peak
      b1=0.9,                      # AdamW's first-moment decay
      b2=0.999,                    # AdamW's second-moment decay
      eps=1e-8,                    # AdamW's epsilon
      weight_decay=0.01,           # AdamW's weight decay; not on norm scales and the head bias
      grad_clip=1.0,               # global-norm clipping over the trained parameters; 0 disables
      freeze_body=False,           # train the head only (a linear probe)
      freeze_routers=False,        # keep every router's parameters as pretrained; routing still
                                   # follows the adapting hidden states
      balance_loss_weight=1.0,     # weight of the routers' balance losses in the objective
      select_metric="accuracy",    # the dev metric that picks the best checkpoint: accuracy or
                                   # macro_f1 (for unbalanced classes)
      log_every=10,                # steps between TensorBoard / metrics.jsonl records
  ))
  c.checkpoint = ml_collections.ConfigDict(dict(
      every=0,                     # extra saves every N steps; 0 = at the end of every epoch only
      keep=2,                      # newest training checkpoints kept (the best one is kept apart)
      async_save=True,             # write in a background thread while training continues
  ))
  c.log = ml_collections.ConfigDict(dict(
      tensorboard=True,            # TensorBoard event files in `WORKDIR/tensorboard`
      jsonl=True,                  # `WORKDIR/metrics.jsonl`, one JSON object per record
      progress=True,               # a bar on a terminal; else (or False) one line per log_every
  ))
  return c


def _check(cond: bool, message: str) -> None:
  if not cond:
    raise ConfigError(message)


def _check_keys(section: Any, defaults: Any, name: str) -> None:
  keys, valid = set(section.keys()), set(defaults.keys())
  unknown, missing = sorted(keys - valid), sorted(valid - keys)
  _check(not unknown, f"unknown key {name}.{unknown[0] if unknown else ''}; valid keys of {name}: "
                      f"{', '.join(sorted(valid))}")
  _check(not missing, f"config section {name} lacks key {name}.{missing[0] if missing else ''} "
                      f"(start configs from umoe_jax.finetune.config.default_config())")


def validate(config: Any) -> None:
  """Raises ConfigError naming the key and value of the first bad setting."""
  defaults = default_config()
  unknown = sorted(set(config.keys()) - set(SECTIONS))
  _check(not unknown, f"unknown config key {unknown[0] if unknown else ''!r}; valid top-level keys: "
                      f"{', '.join(SECTIONS)}")
  for name in SECTIONS[1:]:
    _check(name in config, f"config lacks the {name!r} section (start from default_config())")
    _check_keys(config[name], defaults[name], name)
  _check(bool(config.get("init_from")), "init_from is empty: set --config.init_from to a training "
         "workdir or a converted checkpoint (python -m umoe_jax.interop.official)")
  d, m, t, ck = config.data, config.model, config.train, config.checkpoint
  _check(bool(d.train_path), "data.train_path is empty; set it to a JSONL / CSV / TSV / parquet file")
  _check(d.format in FORMATS, f"data.format={d.format!r}; valid: {', '.join(FORMATS)}")
  _check(bool(d.text_field) and bool(d.label_field),
         f"data.text_field={d.text_field!r} and data.label_field={d.label_field!r} must be set")
  _check(d.dev_path or 0 < d.dev_fraction < 1,
         f"data.dev_fraction={d.dev_fraction!r} must be in (0, 1) when data.dev_path is empty")
  _check(d.max_len >= 2, f"data.max_len={d.max_len!r} must be >= 2")
  names = tuple(d.label_names)
  # ml_collections reads an unquoted --config.data.label_names=a,b as the one name "a,b".
  if len(names) == 1 and isinstance(names[0], str) and "," in names[0]:
    split = tuple(n.strip() for n in names[0].split(","))
    raise ConfigError(f"data.label_names={names!r} is one name holding commas; pass the names as "
                      f"a tuple: --config.data.label_names=\"{split!r}\"")
  _check(m.pooling in POOLINGS, f"model.pooling={m.pooling!r}; valid: {', '.join(POOLINGS)}")
  _check(0 <= m.head_dropout < 1, f"model.head_dropout={m.head_dropout!r} must be in [0, 1)")
  from umoe_jax.model.remat import POLICIES as REMAT_POLICIES  # (lazy: the model package)
  _check(isinstance(m.remat, bool) or (isinstance(m.remat, str) and m.remat in REMAT_POLICIES),
         f"model.remat={m.remat!r}; valid: {', '.join(REMAT_POLICIES)} (or a bool)")
  _check(t.epochs >= 1, f"train.epochs={t.epochs!r} must be >= 1")
  _check(t.batch_size >= 1, f"train.batch_size={t.batch_size!r} must be >= 1")
  _check(t.eval_batch_size >= 1, f"train.eval_batch_size={t.eval_batch_size!r} must be >= 1")
  _check(t.head_learning_rate > 0, f"train.head_learning_rate={t.head_learning_rate!r} must be > 0")
  _check(t.freeze_body or t.body_learning_rate > 0,
         f"train.body_learning_rate={t.body_learning_rate!r} must be > 0 (or set train.freeze_body)")
  _check(0 <= t.warmup_ratio <= 1, f"train.warmup_ratio={t.warmup_ratio!r} must be in [0, 1]")
  _check(0 <= t.min_lr_ratio <= 1, f"train.min_lr_ratio={t.min_lr_ratio!r} must be in [0, 1]")
  _check(0 <= t.b1 < 1 and 0 <= t.b2 < 1, f"train.b1={t.b1!r}, train.b2={t.b2!r} must be in [0, 1)")
  _check(t.eps > 0, f"train.eps={t.eps!r} must be > 0")
  _check(t.weight_decay >= 0, f"train.weight_decay={t.weight_decay!r} must be >= 0")
  _check(t.grad_clip >= 0, f"train.grad_clip={t.grad_clip!r} must be >= 0 (0 disables)")
  _check(t.balance_loss_weight >= 0,
         f"train.balance_loss_weight={t.balance_loss_weight!r} must be >= 0")
  _check(t.select_metric in SELECT_METRICS,
         f"train.select_metric={t.select_metric!r}; valid: {', '.join(SELECT_METRICS)}")
  _check(t.log_every >= 1, f"train.log_every={t.log_every!r} must be >= 1")
  _check(ck.every >= 0, f"checkpoint.every={ck.every!r} must be >= 0 (0: at epoch ends only)")
  _check(ck.keep >= 1, f"checkpoint.keep={ck.keep!r} must be >= 1")
