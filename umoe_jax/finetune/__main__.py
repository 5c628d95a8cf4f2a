r"""Fine-tune a pretrained model for text classification, or score a file with a fine-tuned one.

  python -m umoe_jax.finetune --config=configs/finetune/sst2.py --workdir=runs/sst2 \
      --config.init_from=runs/umoe_base [--config.train.freeze_routers=True ...]
  python -m umoe_jax.finetune predict --checkpoint=runs/sst2 --input=test.tsv --output=preds.jsonl

Training: running the same command again resumes from the latest checkpoint; SIGTERM / Ctrl-C save
and exit. `predict` writes one prediction per input record (JSONL, or CSV for a .csv output) and,
when the input has the label field, prints accuracy and macro-F1. Bad configs, data files and
checkpoints exit with status 2 and one line naming the file, line, key or value.
"""
from __future__ import annotations

import json
import logging as std_logging
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Fine-tuning config (configs/finetune/*.py).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Fine-tuning directory: checkpoints, logs, results.")
_FORCE_UNLOCK = flags.DEFINE_bool("force_unlock", False, "Take the workdir's lock even if another "
                                  "run holds it (one that is no longer running).")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "predict: a fine-tuning workdir.")
_INPUT = flags.DEFINE_string("input", None, "predict: JSONL / CSV / TSV / parquet file to score.")
_OUTPUT = flags.DEFINE_string("output", None, "predict: predictions file (.jsonl or .csv).")
_TEXT_FIELD = flags.DEFINE_string("text_field", "", "predict: text field (default: the training one).")
_LABEL_FIELD = flags.DEFINE_string("label_field", "", "predict: label field, scored when present "
                                   "(default: the training one).")
_FORMAT = flags.DEFINE_string("format", "auto", "predict: input format (auto = by extension).")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 64, "predict: texts per forward pass.")
_COMPUTE_DTYPE = flags.DEFINE_string("compute_dtype", "", "predict: compute dtype (\"\" = the "
                                     "checkpoint's).")


class _QuietLibraries(std_logging.Filter):
  """Drops the INFO chatter of Orbax (one line per file written) and its own error lines (a
  failed save: the run names it in one line); warnings pass. With UMOE_DEBUG=1 errors pass, with
  their tracebacks."""

  def filter(self, record):
    if "/orbax/" not in record.pathname:
      return True
    if record.levelno < std_logging.WARNING:
      return False
    debug = os.environ.get("UMOE_DEBUG", "") not in ("", "0")
    if record.levelno >= std_logging.ERROR and not debug:
      return False
    if record.exc_info and not debug:
      record.exc_info, record.exc_text = None, None
    return True


def _fail(e: Exception) -> None:
  # Printed once: absl's handler writes logging.error to the same stderr, which doubled the line.
  hint = getattr(e, "hint", "")  # (a busy workdir: how to go on)
  print(f"error: {e}" + (f"\n  hint: {hint}" if hint else ""), file=sys.stderr)
  raise SystemExit(2)


def _train() -> dict:
  if _CONFIG.value is None or not _WORKDIR.value:
    raise app.UsageError("fine-tuning needs --config=configs/finetune/<task>.py and --workdir=DIR")
  from umoe_jax.finetune import loop
  return loop.run(_CONFIG.value, _WORKDIR.value, force_unlock=_FORCE_UNLOCK.value)


def _predict() -> dict:
  if not (_CHECKPOINT.value and _INPUT.value and _OUTPUT.value):
    raise app.UsageError("predict needs --checkpoint=WORKDIR --input=FILE --output=FILE")
  from umoe_jax.finetune import predict
  return predict.predict_file(_CHECKPOINT.value, _INPUT.value, _OUTPUT.value,
                              text_field=_TEXT_FIELD.value, label_field=_LABEL_FIELD.value,
                              fmt=_FORMAT.value, batch_size=_BATCH_SIZE.value,
                              compute_dtype=_COMPUTE_DTYPE.value or None)


def main(argv) -> None:
  command = argv[1:] or ["train"]
  if len(command) != 1 or command[0] not in ("train", "predict"):
    raise app.UsageError(f"unexpected arguments {argv[1:]}; commands: train (default), predict")
  logging.get_absl_handler().addFilter(_QuietLibraries())
  from umoe_jax.finetune.data import DataError
  from umoe_jax.config import ConfigError
  from umoe_jax.train.checkpoint import CheckpointError, WorkdirError, quiet_orphaned_orbax_work
  quiet_orphaned_orbax_work()  # a damaged checkpoint: its error line, not TensorStore's echoes
  try:
    result = _predict() if command[0] == "predict" else _train()
  except (ConfigError, DataError, CheckpointError, WorkdirError, FileNotFoundError) as e:
    _fail(e)
  if command[0] == "predict":
    summary = {k: result[k] for k in ("count", "output", "accuracy", "macro_f1") if k in result}
  elif result.get("stopped"):
    summary = {"step": result["step"], "stopped": True}
  else:
    summary = {"best_epoch": result["best_epoch"],
               "dev": {k: result["dev"][k] for k in ("accuracy", "macro_f1")},
               **({"test": {k: result["test"][k] for k in ("accuracy", "macro_f1",
                                                           "majority_accuracy")}}
                  if "test" in result else {})}
  print(json.dumps(summary))


if __name__ == "__main__":
  from umoe_jax import flag_errors, stdout_errors
  from umoe_jax.config import files as config_file
  from umoe_jax.config import ConfigError
  try:
    config_file.check_argv(sys.argv)  # else config_flags' traceback (or IOError at first use)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(2) from None
  stdout_errors.run_and_exit(app.run, main, flags_parser=flag_errors.parser(exit_code=2))
