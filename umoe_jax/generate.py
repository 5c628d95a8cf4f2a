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
official tokenizer adds BOS). Several --prompt flags run as one left-padded batch. See
`umoe_jax.model.decode` for the decoding itself.

Each prompt prints as one record, the records separated by a blank line:

    === prompt 1 of 2 ===
    prompt       | Once upon a time
    continuation | , there was a
                 | small village.
    (16 prompt tokens, 28 new tokens; stopped at --max_new_tokens=28)

Every line of the texts starts after "| " (a text's newlines never end its record; control
characters such as a carriage return or ESC are shown escaped, as \\r and \\x1b). With --jsonl,
each prompt is instead one JSON object on one line, for scripts: {"prompt", "continuation",
"prompt_tokens", "new_tokens" (without the EOS), "stop" ("eos" | "max_new_tokens"), and the
settings: "checkpoint", "step", "tokenizer", "max_new_tokens", "temperature", "top_p", "seed"}.
"""
from __future__ import annotations

import json
import sys
import unicodedata

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
_JSONL = flags.DEFINE_bool("jsonl", False, "Print one JSON object per prompt (for scripts) instead "
                           "of the labelled records.")


def _shown(line: str) -> str:
  """`line` with control characters (but tab) escaped as repr does: a model's stray \\r or ESC
  would otherwise overwrite the line or restyle the terminal."""
  return "".join(repr(c)[1:-1] if c != "\t" and unicodedata.category(c) in ("Cc", "Zl", "Zp")
                 else c for c in line)


def _field(label: str, text: str) -> list[str]:
  """`text` under `label`, one "| " line per line of the text (so a newline never ends a record);
  its spaces are kept, trailing ones too (a continuation may be nothing else)."""
  return [f"{label if i == 0 else '':<12} |" + (f" {_shown(line)}" if line else "")
          for i, line in enumerate(text.split("\n"))]


def _plural(n: int, word: str) -> str:
  return f"{n} {word}{'' if n == 1 else 's'}"


def format_record(index: int, count: int, record: dict) -> str:
  """The labelled record of one prompt (module docstring); `record` is its --jsonl object."""
  stop = ("then EOS" if record["stop"] == "eos"
          else f"stopped at --max_new_tokens={record['max_new_tokens']}")
  return "\n".join([f"=== prompt {index + 1} of {count} ===",
                    *_field("prompt", record["prompt"]),
                    *_field("continuation", record["continuation"]),
                    f"({_plural(record['prompt_tokens'], 'prompt token')}, "
                    f"{_plural(record['new_tokens'], 'new token')}; {stop})"])


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
  settings = dict(checkpoint=_CHECKPOINT.value, step=info["step"], tokenizer=info["tokenizer"],
                  max_new_tokens=_MAX_NEW.value, temperature=_TEMPERATURE.value,
                  top_p=_TOP_P.value, seed=_SEED.value)
  sequences = out.sequences()
  for i, (prompt, ids) in enumerate(zip(_PROMPT.value, sequences)):
    eos = _STOP_AT_EOS.value and bool(ids) and ids[-1] == tokenizer.eos_id
    ids = ids[:-1] if eos else ids
    record = dict(prompt=prompt, continuation=tokenizer.decode(ids), prompt_tokens=len(prompts[i]),
                  new_tokens=len(ids), stop="eos" if eos else "max_new_tokens", **settings)
    if _JSONL.value:
      print(json.dumps(record))
    else:
      print(("\n" if i else "") + format_record(i, len(sequences), record))
  return 0


if __name__ == "__main__":
  from umoe_jax import flag_errors, stdout_errors
  from umoe_jax.config import files as config_file
  from umoe_jax.config import ConfigError
  try:
    config_file.check_argv(sys.argv)  # else a raw traceback of config_flags
  except ConfigError as e:
    raise SystemExit(f"error: {e}") from None
  stdout_errors.run_and_exit(app.run, main, flags_parser=flag_errors.parser(exit_code=1))
