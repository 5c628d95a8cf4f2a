"""Generate text from a checkpoint (or a randomly initialised model) on the command line.

  python -m umoe_jax.generate --checkpoint=DIR --prompt="Once upon a time"
  python -m umoe_jax.generate --config=configs/umoe_tiny.py --prompt="abc" --prompt="hello"   # random init
  python -m umoe_jax.generate --checkpoint=DIR --prompt="..." --temperature=0.8 --top_p=0.95 --seed=1

--checkpoint accepts (`umoe_jax.load`)
  * a converted official checkpoint (`python -m umoe_jax.interop.official --output=DIR`):
    DIR/config.json {"model": ...} + DIR/params (Orbax);
  * a training workdir (DIR/config.json + DIR/checkpoints/<step>/state; the latest step is used),
    its checkpoints/ directory, or one step's directory DIR/checkpoints/<step>.
The architecture comes from the checkpoint's config.json; --config is needed only without one (or
without a checkpoint: random parameters, `--seed`). The tokenizer is --tokenizer, else the config's
`data.tokenizer` (the experiment config of a workdir or of --config), else the byte tokenizer; a
converted official checkpoint needs --tokenizer=<the Llama-2 tokenizer.json> (and --bos_id=1: the
official tokenizer adds BOS). Each prompt's continuation is printed on its own line (several --prompt
flags run as one left-padded batch). See `umoe_jax.model.decode` for the decoding itself.
"""
from __future__ import annotations

import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file (configs/*.py); "
                                          "used when the checkpoint has no config.json.")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Checkpoint directory (converted or training "
                                  "workdir); omitted = random parameters from --config.")
_PROMPT = flags.DEFINE_multi_string("prompt", None, "Prompt text (repeat for a batch).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 32, "Tokens to generate per prompt.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 = greedy; > 0 = sampling temperature.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass (with --temperature > 0).")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed (and init seed without a checkpoint).")
_TOKENIZER = flags.DEFINE_string("tokenizer", None, '"byte" or a tokenizer.json path (default: the '
                                 "config's data.tokenizer, else byte).")
_BOS = flags.DEFINE_integer("bos_id", None, "Token id put before every prompt (e.g. 1 for Llama-2).")
_STOP_AT_EOS = flags.DEFINE_bool("stop_at_eos", True, "Stop a prompt at the tokenizer's EOS.")
_COMPUTE_DTYPE = flags.DEFINE_string("compute_dtype", "float32", "Compute dtype for generation "
                                     '("" = keep the config\'s).')


def main(argv) -> int:
  if len(argv) > 1:
    raise SystemExit(f"unexpected arguments: {argv[1:]}")
  if not _PROMPT.value:
    raise SystemExit("--prompt is required")
  for p in _PROMPT.value:  # bytes that are not UTF-8 arrive as surrogates: a UnicodeEncodeError later
    try:
      p.encode("utf-8")
    except UnicodeEncodeError:
      raise SystemExit(f"error: --prompt={p.encode('utf-8', 'surrogateescape')!r} is not valid "
                       "UTF-8; pass the prompt as UTF-8 text") from None
  if not flags.FLAGS["verbosity"].present:  # Orbax's INFO lines would bury the continuations
    logging.set_verbosity(logging.WARNING)
  from umoe_jax.load import LoadError, check_seed, load_model_and_tokenizer
  from umoe_jax.model.decode import generate
  from umoe_jax.train.checkpoint import quiet_orphaned_orbax_work
  quiet_orphaned_orbax_work()  # a damaged checkpoint: its error line, not TensorStore's echoes

  try:
    check_seed(_SEED.value)  # also the sampling seed, with a checkpoint
    model, tokenizer, info = load_model_and_tokenizer(
        _CHECKPOINT.value, _CONFIG.value, tokenizer=_TOKENIZER.value, seed=_SEED.value,
        compute_dtype=_COMPUTE_DTYPE.value or None)
  except (LoadError, FileNotFoundError) as e:  # (~user of no user: storage.UnknownUserError)
    raise SystemExit(f"error: {e}") from None
  if _CHECKPOINT.value is None:
    print("(no --checkpoint: random parameters)", file=sys.stderr)
  prompts = [([_BOS.value] if _BOS.value is not None else []) + tokenizer.encode(p)
             for p in _PROMPT.value]
  try:
    out = generate(model, prompts, max_new_tokens=_MAX_NEW.value, temperature=_TEMPERATURE.value,
                   top_p=_TOP_P.value, seed=_SEED.value,
                   eos_id=tokenizer.eos_id if _STOP_AT_EOS.value else None)
  except ValueError as e:  # prompt + max_new_tokens over max_seq_len, an empty prompt, top_p
    raise SystemExit(f"error: {e}") from None
  for ids in out.sequences():
    if _STOP_AT_EOS.value and ids and ids[-1] == tokenizer.eos_id:
      ids = ids[:-1]
    print(tokenizer.decode(ids))
  return 0


if __name__ == "__main__":
  from umoe_jax import config_file, flag_errors, stdout_errors
  from umoe_jax.config import ConfigError
  try:
    config_file.check_argv(sys.argv)  # else a raw traceback of config_flags
  except ConfigError as e:
    raise SystemExit(f"error: {e}") from None
  stdout_errors.run_and_exit(app.run, main, flags_parser=flag_errors.parser(exit_code=1))
