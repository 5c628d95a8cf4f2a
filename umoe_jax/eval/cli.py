"""`python -m umoe_jax.eval <command> [flags]`: every evaluation as one command on a checkpoint.

  tasks       zero-/few-shot tasks: known names, PATH:KIND files, task spec files (`taskspec`)
  mmlu        MMLU from its public CSV release (per subject, category, overall; 5-shot by default)
  race        RACE from its public release (lm-eval's scoring)
  perplexity  token / word (WikiText) perplexity and bits per byte of a corpus, sliding windows
  attack      clean vs word-swap-attacked perplexity of a corpus, side by side
  speed       prefill latency, decoding tokens/s, KV-cache bytes, peak memory (`speed`)
  lm-eval     lm-evaluation-harness's own CLI with this library's model registered (`umoe_jax`)

Common flags: --checkpoint (a training workdir, one of its checkpoints/<step>, or a converted
checkpoint: `umoe_jax.load`), --config (architecture when the checkpoint has no config.json, or
alone for random parameters), --tokenizer, --bos_id,
--compute_dtype, --batch_size, --json (results written atomically at the end). `<command> --help`
lists a command's flags. A bad input (unknown task, missing file, malformed line, too many shots, a
checkpoint without config, a tokenizer larger than the model) prints one "error:" line and exits 1;
a bad flag exits 2.
"""
from __future__ import annotations

import sys
import textwrap
import time
from typing import Callable, Optional, Sequence

from absl import flags
from ml_collections import config_flags

from umoe_jax import console
from umoe_jax.config import files as config_file
from umoe_jax.config import ConfigError
from umoe_jax.eval import harness, speed
from umoe_jax.eval import tasks as tasks_lib
from umoe_jax.eval.attack import attack_documents
from umoe_jax.eval.corpora import read_corpus, words_counted
from umoe_jax.eval.corpus_ppl import corpus_perplexity, rates, truncate
from umoe_jax.eval.errors import EvalError
from umoe_jax.eval.scoring import Scorer
from umoe_jax.eval.taskspec import TaskSpec, parse_task_list
from umoe_jax.load import LoadError, load_model, load_model_and_tokenizer
from umoe_jax.output import check_output_path, fmt, markdown_table, write_json, write_jsonl
from umoe_jax.train.checkpoint import quiet_orphaned_orbax_work


def _log(msg: str) -> None:
  console.note(msg)  # (above the progress bar, on a terminal)


# ------------------------------------------------------------------------------------------------
# Flags


def _common_flags(fv: flags.FlagValues) -> None:
  config_flags.DEFINE_config_file("config", None, "Experiment config (configs/*.py): the "
                                  "architecture when the checkpoint has no config.json, or alone "
                                  "for random parameters.", flag_values=fv)
  flags.DEFINE_string("checkpoint", None, "Training workdir (its latest step), one of its "
                      "checkpoints/<step> directories, or a converted checkpoint.", flag_values=fv)
  flags.DEFINE_string("tokenizer", None, '"byte" or a tokenizer.json (default: the config\'s '
                      "data.tokenizer, else byte).", flag_values=fv)
  flags.DEFINE_integer("bos_id", None, "Token id put before every context / document (1 for "
                       "Llama-2); default: none for tasks, EOS before documents.", flag_values=fv)
  flags.DEFINE_integer("batch_size", 16, "Windows per forward pass.", flag_values=fv)
  flags.DEFINE_string("json", None, "Also write the results to this JSON file.", flag_values=fv)
  flags.DEFINE_string("compute_dtype", "float32", 'Compute dtype ("" = keep the config\'s).',
                      flag_values=fv)
  flags.DEFINE_integer("seed", 0, "Init seed without a checkpoint.", flag_values=fv)


def _task_flags(fv, *, tasks_default: Optional[str], fewshot_default: int) -> None:
  if tasks_default is not None:
    flags.DEFINE_string("tasks", tasks_default, "Comma-separated: task names ("
                        + ", ".join(tasks_lib.TASKS) + "), PATH:KIND or NAME=PATH:KIND files "
                        "(kinds multiple_choice|mc, schema, lm|cloze, race, mmlu), task spec files "
                        "(.yaml/.json).", flag_values=fv)
    flags.DEFINE_string("data_dir", tasks_lib.DEFAULT_DATA_DIR, "Directory of the known tasks' "
                        "JSONL files.", flag_values=fv)
  flags.DEFINE_integer("limit", None, "Score only the first N items of each task (subject).",
                       flag_values=fv)
  flags.DEFINE_integer("num_fewshot", fewshot_default, "Examples before each item (tasks "
                       "without their own num_fewshot).", flag_values=fv)
  flags.DEFINE_integer("fewshot_seed", 1234, "Seed of the few-shot draw (lm-eval's default).",
                       flag_values=fv)
  flags.DEFINE_string("log_samples", None, "Also write every item (its requests as scored, "
                      "log-likelihoods, prediction, gold, correctness) to this JSON-lines file "
                      "(umoe_jax/eval/samples.py).", flag_values=fv)


def _corpus_flags(fv) -> None:
  flags.DEFINE_string("data", None, "Corpus: a file, directory or glob (parquet, jsonl, text, "
                      "WikiText .tokens/.raw).", flag_values=fv)
  flags.DEFINE_enum("format", "auto", ["auto", "parquet", "jsonl", "text", "wikitext"],
                    "Corpus format (auto: by file suffix).", flag_values=fv)
  flags.DEFINE_string("text_field", "text", "Column / key of the text (parquet, jsonl).",
                      flag_values=fv)
  flags.DEFINE_integer("context", None, "Tokens per scoring window (default: max_seq_len).",
                       flag_values=fv)
  flags.DEFINE_integer("stride", None, "New tokens scored per window after the first "
                       "(default: --context; smaller = more left context per token).",
                       flag_values=fv)
  flags.DEFINE_integer("max_tokens", None, "Score only the first N tokens of the corpus.",
                       flag_values=fv)
  flags.DEFINE_bool("detokenize", False, "WikiText: undo its tokenisation before scoring (word "
                    "counts stay those of the original).", flag_values=fv)


# ------------------------------------------------------------------------------------------------
# Commands


def _load(f):
  model, tokenizer, info = load_model_and_tokenizer(f.checkpoint, f.config, tokenizer=f.tokenizer,
                                                    seed=f.seed,
                                                    compute_dtype=f.compute_dtype or None)
  vocab = info["model"]["vocab_size"]
  if f.bos_id is not None and f.bos_id >= vocab:  # else "the tokenizer does not fit" when scored
    raise EvalError(f"--bos_id={f.bos_id} is outside the model's vocabulary [0, {vocab})")
  step = f" (step {info['step']})" if info["step"] is not None else ""
  _log(f"model: {f.checkpoint or '(random parameters)'}{step}; tokenizer: {info['tokenizer']}")
  return model, tokenizer, info


def _run_tasks(f, task_entries) -> tuple[str, dict]:
  if f.log_samples is not None:  # fail before any scoring when the items could not be written
    try:
      check_output_path(f.log_samples, "--log_samples")
    except ValueError as e:
      raise EvalError(str(e)) from None
  specs = parse_task_list(task_entries, getattr(f, "data_dir", tasks_lib.DEFAULT_DATA_DIR))
  prepared = harness.prepare_all(specs, num_fewshot=f.num_fewshot, limit=f.limit,   # before the
                                 fewshot_seed=f.fewshot_seed)                       # model loads
  model, tokenizer, info = _load(f)
  samples = [] if f.log_samples is not None else None
  results = harness.score_all(Scorer(model, f.batch_size), tokenizer, specs, prepared, f.bos_id,
                              log=_log, samples=samples)
  if samples is not None:
    try:
      write_jsonl(f.log_samples, samples)
    except OSError as e:  # checked before the scoring, but a disk can fill up since
      raise EvalError(f"cannot write --log_samples={f.log_samples!r} ({e.strerror or e})") from None
    _log(f"wrote {len(samples)} items to {f.log_samples}")
  return harness.format_table(results), dict(info, limit=f.limit, results=results,
                                             log_samples=f.log_samples)


def cmd_tasks(f):
  return _run_tasks(f, f.tasks)


def cmd_mmlu(f):
  if not f.data_dir:
    raise EvalError("give --data_dir=<MMLU data/ directory holding dev/, val/, test/>")
  subjects = tuple(s.strip() for s in f.subjects.split(",") if s.strip()) if f.subjects else None
  return _run_tasks(f, [TaskSpec(name="mmlu", kind="mmlu", path=f.data_dir,
                                 num_fewshot=f.num_fewshot, split=f.split, subjects=subjects)])


def cmd_race(f):
  if not f.data:
    raise EvalError("give --data=<RACE directory, file or .jsonl>, e.g. RACE/test/high")
  return _run_tasks(f, [TaskSpec(name="race", kind="race", path=f.data)])


def _check_window_flags(f) -> None:
  """--context / --stride / --max_tokens (/ --rate) values, before the corpus is read or the model
  loads (--context against max_seq_len needs the model: checked when scoring)."""
  if f.context is not None and f.context < 1:
    raise EvalError(f"--context={f.context} must be >= 1 (tokens per scoring window)")
  if f.stride is not None and not 1 <= f.stride <= (f.context or f.stride):
    raise EvalError(f"--stride={f.stride} must be in [1, --context={f.context}]" if f.context
                    else f"--stride={f.stride} must be >= 1")
  if f.max_tokens is not None and f.max_tokens < 1:
    raise EvalError(f"--max_tokens={f.max_tokens} must be >= 1")
  if "rate" in f and not 0 <= f.rate <= 1:
    raise EvalError(f"--rate={f.rate} must be in [0, 1] (the fraction of words substituted)")


def _corpus(f):
  if not f.data:
    raise EvalError("give --data=<corpus file, directory or glob>")
  _check_window_flags(f)
  return read_corpus(f.data, f.format, text_field=f.text_field, detokenize=f.detokenize)


_PPL_ROWS = ("documents", "tokens", "words", "bytes", "token_ppl", "word_ppl", "bits_per_byte",
             "mean_document_ppl")


def cmd_perplexity(f):
  corpus = _corpus(f)
  model, tokenizer, info = _load(f)
  t0 = time.perf_counter()
  out = corpus_perplexity(Scorer(model, f.batch_size), tokenizer, corpus.documents,
                          words=corpus.words, context=f.context, stride=f.stride, bos_id=f.bos_id,
                          max_tokens=f.max_tokens, originals=corpus.originals)
  out["seconds"] = round(time.perf_counter() - t0, 2)
  _log(f"{corpus.name}: {out['tokens']:,} tokens in {out['seconds']:.1f} s "
       f"(context {out['context']}, stride {out['stride']})")
  rows = [("metric", corpus.name)] + [(k, fmt(out[k])) for k in _PPL_ROWS if k in out]
  table = markdown_table(rows)
  if "words" in out:
    out["words_counted"] = words_counted(corpus.name, out["words"], out["line_ends"])
    table += "\n" + textwrap.fill(out["words_counted"], 100)
  return table, dict(info, data=f.data, detokenize=f.detokenize, results=out)


def cmd_attack(f):
  corpus = _corpus(f)
  model, tokenizer, info = _load(f)
  # --max_tokens cuts the clean text first; the attack then hits only what is scored.
  clean_docs, words, _ = truncate(tokenizer, corpus.documents, corpus.words, f.max_tokens,
                                  corpus.originals)
  attacked, stats = attack_documents(clean_docs, rate=f.rate, seed=f.attack_seed)
  scorer = Scorer(model, f.batch_size)
  clean, hit = (corpus_perplexity(scorer, tokenizer, docs, words=words, context=f.context,
                                  stride=f.stride, bos_id=f.bos_id, label=label)
                for docs, label in ((clean_docs, "clean"), (attacked, "attacked")))
  _log(f"{corpus.name}: {stats['substituted']} of the {stats['words']} whitespace-separated words "
       f"scored substituted (rate {f.rate}, seed {f.attack_seed})")
  # The attacked text has its own token and byte counts: dividing its NLL by them can make it look
  # better per byte than the clean text; the third column divides by the clean text's counts.
  counts = {k: clean[k] for k in ("documents", "tokens", "bytes", "words") if k in clean}
  on_clean = dict(counts, **rates(hit["nll"], clean["tokens"], clean["bytes"], clean.get("words")))
  rows = [("metric", "clean", "attacked (own counts)", "attacked (clean counts)")]
  rows += [(k, fmt(clean[k]), fmt(hit[k]), fmt(on_clean.get(k))) for k in _PPL_ROWS if k in clean]
  diff = lambda k: f"{hit[k] - clean[k]:+,}"
  table = markdown_table(rows) + "\n" + textwrap.fill(
      f"token_ppl and bits_per_byte divide each column's NLL by the tokens and bytes in that "
      f"column: 'own counts' by the attacked text's ({diff('tokens')} tokens, {diff('bytes')} "
      "bytes against the clean text), 'clean counts' by the clean text's, the denominators of "
      "'clean'"
      + (" (word_ppl: the clean text's words in every column; the attack keeps the word count)"
         if "words" in clean else ""), 100)
  if "words" in clean:
    note = words_counted(corpus.name, clean["words"], clean["line_ends"])
    table += "\n" + textwrap.fill(note, 100)
  return table, dict(info, data=f.data, detokenize=f.detokenize, attack=stats,
                     results={"clean": clean, "attacked": hit,
                              "attacked_on_clean_counts": on_clean})


def _int_list(text: str, flag: str) -> list[int]:
  try:
    values = sorted({int(v) for v in text.split(",") if v.strip()})
  except ValueError:
    values = []
  if not values or values[0] < 1:
    raise EvalError(f"{flag}={text!r} must be comma-separated integers >= 1")
  return values


def cmd_speed(f):
  if f["batch_size"].present:  # (a common flag: silently unused would mislead)
    raise EvalError("speed measures the batch sizes of --batches (e.g. --batches=1,32), not "
                    "--batch_size")
  batches = _int_list(f.batches, "--batches")
  for name in ("prompt_len", "new_tokens", "repeats"):
    if f[name].value is not None and f[name].value < (2 if name == "new_tokens" else 1):
      raise EvalError(f"--{name}={f[name].value} must be >= {2 if name == 'new_tokens' else 1}")
  if f.warmup < 0:
    raise EvalError(f"--warmup={f.warmup} must be >= 0")
  for name in ("cache_dtype", "param_dtype"):
    if f[name].value:
      import jax.numpy as jnp
      try:
        ok = jnp.issubdtype(jnp.dtype(f[name].value), jnp.floating)
      except TypeError:
        ok = False
      if not ok:
        raise EvalError(f"--{name}={f[name].value!r} is not a floating-point dtype "
                        "(e.g. bfloat16, float32)")
  import jax
  model, section, ref = load_model(f.checkpoint, f.config, seed=f.seed,
                                   compute_dtype=f.compute_dtype or None)
  step = ref.step if ref is not None else None
  if f.param_dtype:
    model = speed.cast_params(model, f.param_dtype)
  cfg = model.cfg
  new = f.new_tokens if f.new_tokens is not None else min(128, cfg.max_seq_len // 2)
  prompt = f.prompt_len if f.prompt_len is not None else min(1024, cfg.max_seq_len - new)
  if prompt < 1 or prompt + new > cfg.max_seq_len:
    raise EvalError(f"--prompt_len={prompt} + --new_tokens={new} must fit the model's "
                    f"max_seq_len={cfg.max_seq_len} (prompt at least 1 token)")
  _log(f"model: {f.checkpoint or '(random parameters)'}"
       f"{f' (step {step})' if step is not None else ''}; {_device_kind()}; prompt {prompt} "
       f"tokens, {new} new tokens, median of {f.repeats}")
  rows = []
  for b in batches:
    try:
      row = speed.measure(model, b, prompt_len=prompt, new_tokens=new, warmup=f.warmup,
                          repeats=f.repeats, cache_dtype=f.cache_dtype or None, seed=f.seed)
    except (ValueError, ConfigError) as e:  # a router that cannot decode with a cache, ...
      raise EvalError(str(e)) from None
    except jax.errors.JaxRuntimeError as e:
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      raise EvalError(f"batch {b} does not fit in device memory (prompt {prompt} + {new} tokens): "
                      f"{str(e).splitlines()[0][:300]}; try smaller --batches") from None
    row.pop("tokens")
    _log(f"batch {b}: prefill {row['prefill_ms']:.2f} ms, decode {row['decode_tokens_per_s']:,.1f} "
         f"tokens/s (compile {row['compile_prefill_s']:.1f} + {row['compile_decode_s']:.1f} s)")
    rows.append(row)
  settings = dict(prompt_len=prompt, new_tokens=new, warmup=f.warmup, repeats=f.repeats,
                  device=_device_kind(), param_dtype=speed.param_dtypes(model),
                  compute_dtype=cfg.compute_dtype, cache_dtype=rows[0]["cache_dtype"],
                  param_bytes=speed.param_bytes(model))
  head = (f"model: {cfg.n_layers} layers, d_model {cfg.d_model}, parameters "
          f"{settings['param_bytes'] / 2**20:,.1f} MiB ({settings['param_dtype']}), compute "
          f"{cfg.compute_dtype}, KV cache {settings['cache_dtype']}\n"
          f"run: prompt {prompt} tokens, {new} new tokens, median of {f.repeats} runs on "
          f"{settings['device']}\n"
          "decode tok/s = batch / ms per cached step; peak: the device's peak bytes in use so far\n"
          "(n/a: the backend reports none, as on CPU)\n\n")
  info = {"checkpoint": f.checkpoint, "step": step, "model": {k: section.get(k) for k in (
      "vocab_size", "d_model", "n_layers", "max_seq_len", "compute_dtype")}}
  return head + speed.format_table(rows), dict(info, settings=settings, results=rows)


def _device_kind() -> str:
  import jax
  return jax.devices()[0].device_kind


def _flags_speed(fv):
  fv.set_default("compute_dtype", "")  # the config's, as the model would be served
  flags.DEFINE_string("batches", "1,32", "Batch sizes to measure, comma-separated.", flag_values=fv)
  flags.DEFINE_integer("prompt_len", None, "Prompt tokens (default: min(1024, max_seq_len - "
                       "new_tokens)).", flag_values=fv)
  flags.DEFINE_integer("new_tokens", None, "Tokens decoded after the prompt (default: min(128, "
                       "max_seq_len / 2)).", flag_values=fv)
  flags.DEFINE_integer("warmup", 1, "Untimed runs before the timed ones.", flag_values=fv)
  flags.DEFINE_integer("repeats", 5, "Timed runs (the median is reported).", flag_values=fv)
  flags.DEFINE_string("cache_dtype", None, "KV-cache dtype (default: the compute dtype).",
                      flag_values=fv)
  flags.DEFINE_string("param_dtype", None, "Cast the parameters to this dtype (e.g. bfloat16, as "
                      "served; default: as loaded).", flag_values=fv)


def _flags_tasks(fv):
  _task_flags(fv, tasks_default=",".join(tasks_lib.TASKS), fewshot_default=0)


def _flags_mmlu(fv):
  _task_flags(fv, tasks_default=None, fewshot_default=5)
  flags.DEFINE_string("data_dir", None, "MMLU's data/ directory (dev/, val/, test/ of "
                      "<subject>_<split>.csv).", flag_values=fv)
  flags.DEFINE_string("subjects", None, "Comma-separated subjects (default: all found).",
                      flag_values=fv)
  flags.DEFINE_enum("split", "test", ["test", "val"], "Split to score.", flag_values=fv)


def _flags_race(fv):
  _task_flags(fv, tasks_default=None, fewshot_default=0)
  flags.DEFINE_string("data", None, "RACE data: a directory of its .txt files (e.g. "
                      "RACE/test/high), one file, or a .jsonl of article objects.", flag_values=fv)


def _flags_attack(fv):
  _corpus_flags(fv)
  flags.DEFINE_float("rate", 0.025, "Fraction of words substituted.", flag_values=fv)
  flags.DEFINE_integer("attack_seed", 0, "Seed of the substitution.", flag_values=fv)


COMMANDS: dict[str, tuple[Callable, Callable, str]] = {
    "tasks": (_flags_tasks, cmd_tasks, "zero-/few-shot tasks"),
    "harness": (_flags_tasks, cmd_tasks, "the same as tasks"),
    "mmlu": (_flags_mmlu, cmd_mmlu, "MMLU, per subject / category / overall"),
    "race": (_flags_race, cmd_race, "RACE (lm-eval's scoring)"),
    "perplexity": (_corpus_flags, cmd_perplexity, "corpus perplexity, sliding windows"),
    "attack": (_flags_attack, cmd_attack, "clean vs attacked perplexity"),
    "speed": (_flags_speed, cmd_speed, "prefill, decoding tokens/s, KV bytes, peak memory"),
}


def _usage(prog: str) -> str:
  lines = [f"usage: {prog} <command> [--flags]  (<command> --help for its flags)", "commands:"]
  lines += [f"  {name:<11} {doc}" for name, (_, _, doc) in COMMANDS.items()]
  lines.append(f"  {'lm-eval':<11} lm-evaluation-harness's CLI with --model umoe_jax registered")
  return "\n".join(lines)


def main(argv: Sequence[str], prog: str = "python -m umoe_jax.eval") -> int:
  """Runs `argv` = [command, flags...]; returns the exit status (module docstring)."""
  argv = list(argv)
  if not argv or argv[0] in ("-h", "--help", "help"):
    print(_usage(prog))
    return 0 if argv else 2
  command, rest = argv[0], argv[1:]
  if command in ("lm-eval", "lm_eval"):
    try:
      from umoe_jax.eval.lm_eval_adapter import run_lm_eval_cli
    except ImportError as e:
      print(f"error: {e}", file=sys.stderr)
      return 1
    return run_lm_eval_cli(rest)
  if command not in COMMANDS:
    print(f"error: unknown command {command!r}\n{_usage(prog)}", file=sys.stderr)
    return 2
  define, run, _ = COMMANDS[command]
  fv = flags.FlagValues()
  _common_flags(fv)
  define(fv)
  if any(a in ("-h", "--help", "--helpfull") for a in rest):
    print(f"usage: {prog} {command} [--flags]\n\n{fv.get_help()}")
    return 0
  try:
    config_file.check_argv(rest)  # else config_flags' traceback (or an IOError at first use)
    extra = fv([f"{prog} {command}"] + rest)[1:]
  except (flags.Error, ConfigError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if extra:
    print(f"error: unexpected arguments {extra}", file=sys.stderr)
    return 2
  quiet_orphaned_orbax_work()  # a damaged checkpoint: its error line, not TensorStore's echoes
  try:
    if fv.batch_size < 1:
      raise EvalError(f"--batch_size={fv.batch_size} must be >= 1")
    if fv.bos_id is not None and fv.bos_id < 0:
      raise EvalError(f"--bos_id={fv.bos_id} must be a token id >= 0")
    if fv.json is not None:  # fail before any scoring when the results could not be written
      try:
        check_output_path(fv.json, "--json")
      except ValueError as e:
        raise EvalError(str(e)) from None
    table, payload = run(fv)
  except (EvalError, LoadError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  print(table, flush=True)
  if fv.json:
    try:
      write_json(fv.json, dict(command=command, **payload))
    except OSError as e:  # checked before the scoring, but a disk can fill up since
      print(f"error: cannot write --json={fv.json!r} ({e.strerror or e}); the results are the "
            "table above", file=sys.stderr)
      return 1
    _log(f"wrote {fv.json}")
  return 0
