r"""Trains a model: python train.py --config=configs/<model>.py --workdir=DIR [--config.a.b=value ...]

Examples:
  python train.py --config=configs/umoe_tiny.py --workdir=runs/umoe_tiny
  python train.py --config=configs/umoe_tiny.py --workdir=runs/linux \
      --config.data.source=parquet \
      --config.data.train_path=../shared/data/corpora/linux-docs/train-00000-of-00001.parquet \
      --config.data.eval_path=../shared/data/corpora/linux-docs/validation-00000-of-00001.parquet \
      --config.data.tokenizer=../shared/data/tokenizers/gpt2/tokenizer.json \
      --config.model.vocab_size=50304
  tensorboard --logdir runs

Running it again with the same --workdir resumes from the latest checkpoint. SIGTERM / Ctrl-C save a
checkpoint and exit; a second Ctrl-C aborts at once. Config keys: configs/common.py and
umoe_jax/train/config.py.
"""
import logging as std_logging

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file (configs/*.py).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs and metrics.")
flags.mark_flags_as_required(["config", "workdir"])


class _QuietLibraries(std_logging.Filter):
  """Drops the INFO chatter of Orbax and grain (one line per file written); warnings pass."""

  def filter(self, record):
    return record.levelno >= std_logging.WARNING or not any(
        part in record.pathname for part in ("/orbax/", "/grain/"))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if "://" in _WORKDIR.value:  # os-level writers would make a local "gs:" directory
    raise SystemExit(
        f"--workdir={_WORKDIR.value}: the trainer writes its config, metrics and TensorBoard files "
        f"with local file I/O, so a URL is not a workdir; mount the bucket with Cloud Storage FUSE "
        f"(gcsfuse --implicit-dirs --rename-dir-limit=200000 BUCKET /gcs/BUCKET) and pass the "
        f"mount path, e.g. --workdir=/gcs/BUCKET/runs/NAME (docs/tpu.md)")
  logging.get_absl_handler().addFilter(_QuietLibraries())
  from umoe_jax.parallel import distributed
  distributed.initialize_from_env()  # before anything touches a device
  from umoe_jax.config import ConfigError
  from umoe_jax.train import loop
  try:
    result = loop.run(_CONFIG.value, _WORKDIR.value)
  except ConfigError as e:
    logging.error("config error: %s", e)
    raise SystemExit(f"config error: {e}") from None
  logging.info("done: step %d%s", result["step"], " (stopped by signal)" if result["stopped"] else "")


if __name__ == "__main__":
  app.run(main)
