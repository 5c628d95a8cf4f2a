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

--workdir and the data / tokenizer paths may be URLs (gs://bucket/runs/NAME; data also s3://, hf://):
umoe_jax/storage.

Running it again with the same --workdir resumes from the latest checkpoint
(--config.checkpoint.restore_step=N: from step N). One run at a time per workdir: a second one is
refused, naming the first (--force_unlock takes the lock of a run that is no longer running).
SIGTERM / Ctrl-C save a checkpoint and exit; a second Ctrl-C aborts at once. Config keys:
configs/common.py and umoe_jax/train/config.py.

An error a user can fix (config, data, checkpoint, workdir, mesh, divergence) prints one line naming
the bad value or file, plus a hint, and exits with status 1 (2 for a bad command line); `--debug`
(or UMOE_DEBUG=1) shows the traceback as well.
"""
import logging as std_logging
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file (configs/*.py).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs and metrics.")
_DEBUG = flags.DEFINE_bool("debug", False, "Show the traceback of errors (also: UMOE_DEBUG=1).")
_FORCE_UNLOCK = flags.DEFINE_bool("force_unlock", False, "Take the workdir's lock even if another "
                                  "run holds it (one that is no longer running; docs/training.md).")
flags.mark_flags_as_required(["config", "workdir"])

EXIT_USER_ERROR = 1
EXIT_USAGE = 2


def _debug(argv=None) -> bool:
  if os.environ.get("UMOE_DEBUG", "") not in ("", "0"):
    return True
  if argv is not None:  # before the flags are parsed
    return "--debug" in argv or "-debug" in argv
  return _DEBUG.value


class _QuietLibraries(std_logging.Filter):
  """Drops the INFO chatter of Orbax and grain (one line per file written) and Orbax's own error
  lines (a failed save logs four `E...` lines from its threads; the loop reports the error itself,
  in one line); warnings pass. With --debug, errors pass with their tracebacks."""

  def __init__(self, debug: bool):
    super().__init__()
    self.debug = debug

  def filter(self, record):
    from umoe_jax.train.checkpoint import orphaned_orbax_record  # (lazy: jax, orbax)
    if not self.debug and orphaned_orbax_record(record):
      return False
    library = any(part in record.pathname for part in ("/orbax/", "/grain/"))
    if not library:
      return True
    if record.levelno < std_logging.WARNING:
      return False
    if not self.debug and record.levelno >= std_logging.ERROR and "/orbax/" in record.pathname:
      return False
    if not self.debug and record.exc_info:
      record.exc_info, record.exc_text = None, None
    return True


def _fail(kind: str, error: BaseException, hint: str, code: int = EXIT_USER_ERROR):
  message = " ".join(str(error).split()) or type(error).__name__
  lines = [f"{kind}: {message}"]
  if hint:
    lines.append(f"  hint: {hint}")
  if not _debug(sys.argv):
    lines.append("  (--debug shows the traceback)")
  print("\n".join(lines), file=sys.stderr, flush=True)
  raise SystemExit(code)


def _parse_flags(argv):
  """absl's flag parsing, with every failure as one line (exit 2) instead of a traceback."""
  from umoe_jax import flag_errors, stdout_errors
  debug = _debug(argv)
  try:
    return flag_errors.parse_flags(argv)
  except Exception as e:  # pylint: disable=broad-except
    if debug or stdout_errors.is_stdout_error(e):  # --help into a full device: reported at exit
      raise
    from umoe_jax.config import files as config_file
    from umoe_jax.config import ConfigError
    try:
      config_file.check_argv(argv)
    except ConfigError as config_error:
      loads = not str(config_error).startswith("--config=")
      _fail("config error", config_error, "python train.py --helpfull lists the flags; configs/"
            "common.py and umoe_jax/train/config.py list the keys" if loads else config_file.HINT,
            EXIT_USAGE)
    except Exception:  # pylint: disable=broad-except  (report the original error below)
      pass
    what = str(e) if isinstance(e, flags.Error) else f"{type(e).__name__}: {e}"
    _fail("command-line error", what, "python train.py --helpfull lists the flags", EXIT_USAGE)


def _hint(error: BaseException) -> str:
  from umoe_jax.config import ConfigError
  from umoe_jax.train import checkpoint as ckpt_lib
  from umoe_jax.train import loop
  hint = getattr(error, "hint", "")
  if hint:
    return hint
  if isinstance(error, ckpt_lib.CheckpointSaveError):
    return "free space (or fix the directory) and run the same command again"
  if isinstance(error, ckpt_lib.CheckpointMismatchError):
    return "pass the config the run was started with, or another --workdir for the new one"
  if isinstance(error, ckpt_lib.CheckpointError):
    return ("a run resumes with the config it was started with; --config.checkpoint.restore_step=N "
            "picks another checkpoint")
  if isinstance(error, ckpt_lib.WorkdirError):
    return "pass a writable directory (or a directory in a gs:// bucket) as --workdir"
  if isinstance(error, FileNotFoundError):  # storage.ObjectNotFoundError: a URL that is not there
    return "check the URL: the bucket's name, the object's path, and your access to them"
  if isinstance(error, (loop.NonFiniteError, loop.DivergenceError)):
    return "lower train.learning_rate (or raise train.warmup_steps) and resume from a good checkpoint"
  if isinstance(error, ConfigError):
    return "configs/common.py and umoe_jax/train/config.py list every key and its meaning"
  return ""


_KINDS = (("ConfigError", "config error"), ("DataError", "data error"),
          ("CheckpointSaveError", "checkpoint save error"), ("CheckpointError", "checkpoint error"),
          ("WorkdirError", "workdir error"), ("NonFiniteError", "training stopped"),
          ("DivergenceError", "training stopped"), ("StorageError", "storage error"),
          ("ObjectNotFoundError", "storage error"))


def _kind(error: BaseException) -> str:
  names = {cls.__name__ for cls in type(error).__mro__}
  return next((kind for name, kind in _KINDS if name in names), "error")


def _load_config():
  """The --config ConfigDict; a file that does not load is a one-line error (ml_collections defers
  it to the first use of the config)."""
  from umoe_jax.config import files as config_file
  from umoe_jax.config import ConfigError
  config = _CONFIG.value
  try:
    config.keys()
  except Exception as e:  # pylint: disable=broad-except  (the error of loading the file)
    if _debug():
      raise
    try:
      config_file.check_argv(sys.argv)
    except ConfigError as error:
      e = error
    _fail("config error", e, config_file.HINT, EXIT_USAGE)
  return config


def main(argv):
  if len(argv) > 1:  # (absl's UsageError: the whole --help, then the message, exit 1)
    _fail("command-line error", f"unexpected argument(s) {argv[1:]}: every flag takes its value "
          "as --name=value (a boolean one --name=false or --noname)",
          "python train.py --helpfull lists the flags", EXIT_USAGE)
  debug = _debug()
  logging.get_absl_handler().addFilter(_QuietLibraries(debug))
  from umoe_jax.parallel import distributed
  distributed.initialize_from_env()  # before anything touches a device
  if not debug:
    from umoe_jax.train.checkpoint import quiet_orphaned_orbax_work
    quiet_orphaned_orbax_work()
  from umoe_jax.train import loop
  config = _load_config()
  try:
    result = loop.run(config, _WORKDIR.value, force_unlock=_FORCE_UNLOCK.value)
  except loop.USER_ERRORS as e:
    if debug:
      raise
    _fail(_kind(e), e, _hint(e))
  except KeyboardInterrupt:
    if debug:
      raise
    print("aborted (second Ctrl-C): no checkpoint saved for the current step", file=sys.stderr)
    raise SystemExit(130) from None
  for line in loop.summary(result, config):
    logging.info("%s", line)


if __name__ == "__main__":
  from umoe_jax import stdout_errors
  stdout_errors.run_and_exit(app.run, main, flags_parser=_parse_flags)
