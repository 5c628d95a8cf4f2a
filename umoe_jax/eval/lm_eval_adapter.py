"""lm-evaluation-harness adapter: our checkpoints as an lm-eval model named `umoe_jax`.

    pip install -r requirements-eval.txt
    python -m umoe_jax.eval lm-eval --model umoe_jax --model_args checkpoint=runs/umoe_base \\
        --tasks hellaswag,arc_easy --num_fewshot 0 --batch_size 16

`python -m umoe_jax.eval lm-eval ...` is lm-eval's own CLI (same arguments as `lm_eval ...`) after
this module has registered the model: lm-eval discovers only its built-in models by name, so the
bare `lm_eval` command cannot see ours. From Python:

    import lm_eval
    from umoe_jax.eval.lm_eval_adapter import UMoELM
    lm_eval.simple_evaluate(model=UMoELM(checkpoint="runs/umoe_base"), tasks=["piqa"])

model_args (all optional but one of checkpoint / config): checkpoint, config (a configs/*.py file),
tokenizer, bos_id, batch_size, compute_dtype (default float32), seed, max_gen_toks (default 256).

The three request types run on this library's code, so they score exactly as our own commands:
  loglikelihood          `Scorer.loglikelihood` on `encode_requests` (lm-eval's Hugging Face
                         encoding: a context's trailing spaces moved to the continuation, whose ids
                         are the tail of the whole text's; an empty context scored after EOS/BOS):
                         the numbers of `umoe_jax.eval tasks`;
  loglikelihood_rolling  `corpus_ppl.document_loglikelihoods` with context = stride = max_seq_len
                         after an EOS (BOS) prefix: lm-eval's rolling windows, and our `perplexity`;
  generate_until         `umoe_jax.model.decode.generate`, greedy unless do_sample / temperature > 0,
                         cut at the first `until` string; prompts left-truncated to fit max_seq_len.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any, Optional, Sequence

from umoe_jax.eval.errors import EvalError

try:
  import lm_eval.models  # noqa: F401  (registers lm-eval's own models first: they stay usable)
  from lm_eval.api.model import LM
  from lm_eval.api.registry import register_model
except ImportError as e:   # optional dependency
  raise ImportError("lm-evaluation-harness is not installed: pip install -r requirements-eval.txt"
                    ) from e

from umoe_jax.eval.corpus_ppl import document_loglikelihoods
from umoe_jax.eval.scoring import Scorer, encode_requests

MODEL_NAME = "umoe_jax"


def _int_or_none(x: Any) -> Optional[int]:
  return None if x is None or x == "" else int(x)


@register_model(MODEL_NAME)
class UMoELM(LM):
  """An lm-eval `LM` over a CausalLM of this library (module docstring)."""

  def __init__(self, checkpoint: Optional[str] = None, config: Optional[str] = None,
               tokenizer: Optional[str] = None, bos_id: Any = None, batch_size: Any = 16,
               compute_dtype: str = "float32", seed: Any = 0, max_gen_toks: Any = 256,
               max_batch_size: Any = None, device: Any = None, *, model=None, tokenizer_obj=None):
    super().__init__()
    if model is None:
      from umoe_jax.load import load_model_and_tokenizer
      cfg = None
      if config:
        from umoe_jax.stats import load_config_file
        cfg = load_config_file(config)
      model, tokenizer_obj, _ = load_model_and_tokenizer(checkpoint, cfg, tokenizer=tokenizer,
                                                         seed=int(seed),
                                                         compute_dtype=compute_dtype)
    elif tokenizer_obj is None:
      raise EvalError("UMoELM(model=...) needs tokenizer_obj= too")
    if isinstance(batch_size, str) and batch_size.startswith("auto"):
      batch_size = 16   # no memory probing: a fixed size that fits a base model's logits
    self.model, self.tokenizer = model, tokenizer_obj
    self.bos_id = _int_or_none(bos_id)
    self.batch_size = int(batch_size)
    self.max_gen_toks = int(max_gen_toks)
    self.scorer = Scorer(model, batch_size=self.batch_size)

  @classmethod
  def create_from_arg_obj(cls, arg_dict: dict, additional_config: Optional[dict] = None
                          ) -> "UMoELM":
    """LM's, except that a key of --model_args (batch_size, max_batch_size, device) wins over the
    command's own flag: LM's passes both, a TypeError since lm-eval's --batch_size always has a value."""
    extra = {k: v for k, v in (additional_config or {}).items()
             if v is not None and k not in arg_dict}
    return cls(**arg_dict, **extra)

  @classmethod
  def create_from_arg_string(cls, arg_string: str,
                             additional_config: Optional[dict] = None) -> "UMoELM":
    from lm_eval.utils import simple_parse_args_string
    return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

  @classmethod
  def from_model(cls, model, tokenizer, *, batch_size: int = 16, bos_id: Optional[int] = None,
                 max_gen_toks: int = 256) -> "UMoELM":
    """An adapter over a model already in memory (no checkpoint read)."""
    return cls(model=model, tokenizer_obj=tokenizer, batch_size=batch_size, bos_id=bos_id,
               max_gen_toks=max_gen_toks)

  @property
  def tokenizer_name(self) -> str:
    return str(getattr(self.tokenizer, "name", type(self.tokenizer).__name__))

  def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
    pairs = [tuple(r.args) for r in requests]
    if not pairs:
      return []
    ll, greedy = self.scorer.loglikelihood(encode_requests(self.tokenizer, pairs, self.bos_id))
    return [(float(a), bool(b)) for a, b in zip(ll, greedy)]

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    texts = [r.args[0] for r in requests]
    if not texts:
      return []
    prefix = self.bos_id if self.bos_id is not None else self.tokenizer.eos_id
    ll = document_loglikelihoods(self.scorer, [self.tokenizer.encode(t) for t in texts], prefix)
    return [float(x) for x in ll]

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    out: list[Optional[str]] = [None] * len(requests)
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(requests):   # one decode batch per distinct set of generation arguments
      groups.setdefault(repr(sorted((r.args[1] or {}).items())), []).append(i)
    for idx in groups.values():
      kwargs = dict(requests[idx[0]].args[1] or {})
      for start in range(0, len(idx), self.batch_size):
        chunk = idx[start:start + self.batch_size]
        texts = self._generate([requests[i].args[0] for i in chunk], kwargs)
        for i, t in zip(chunk, texts):
          out[i] = t
    return out  # type: ignore[return-value]

  def _generate(self, contexts: Sequence[str], kwargs: dict) -> list[str]:
    from umoe_jax.model.decode import generate
    until = kwargs.get("until") or []
    until = [until] if isinstance(until, str) else [u for u in until if u]
    max_seq_len = self.scorer.max_seq_len
    max_new = max(1, min(int(kwargs.get("max_gen_toks", self.max_gen_toks)), max_seq_len - 1))
    temperature = float(kwargs.get("temperature", 0.0) or 0.0)
    if not kwargs.get("do_sample", temperature > 0):
      temperature = 0.0
    prompts = []
    for c in contexts:
      ids = ([self.bos_id] if self.bos_id is not None else []) + list(self.tokenizer.encode(c))
      prompts.append((ids or [self.tokenizer.eos_id])[-(max_seq_len - max_new):])
    res = generate(self.model, prompts, max_new_tokens=max_new, temperature=temperature,
                   top_p=float(kwargs.get("top_p", 1.0) or 1.0), eos_id=self.tokenizer.eos_id)
    texts = []
    for ids in res.sequences():
      if ids and ids[-1] == self.tokenizer.eos_id:
        ids = ids[:-1]
      text = self.tokenizer.decode(ids)
      for u in until:
        text = text.split(u, 1)[0]
      texts.append(text)
    return texts


# This repository's top-level kernels/ package: in a Python started in the repository root it comes
# before Hugging Face's `kernels` distribution, and its __getattr__ raises an ImportError saying so.
_OWN_KERNELS_INIT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "kernels",
    "__init__.py")


def _kernels_shadowed(error: BaseException) -> Optional[ImportError]:
  """The ImportError of our kernels/ standing in for Hugging Face's `kernels` in `error`'s chain
  (transformers may re-raise an import's error wrapped in its own), else None."""
  own = os.path.realpath(_OWN_KERNELS_INIT)
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, ImportError) and error.path and os.path.realpath(error.path) == own:
      return error
    error = error.__cause__ or error.__context__
  return None


# lm-eval's names of its transformers backend, which loads `pretrained=` with from_pretrained.
_HF_MODELS = ("hf", "hf-auto", "huggingface")
# huggingface_hub's repo id form (name or org/name, each part starting and ending with a word
# character): such a value that is no local path is left to lm-eval, which looks it up on the Hub.
_HUB_ID = re.compile(r"(?:\w(?:[\w.-]*\w)?/)?\w(?:[\w.-]*\w)?")


def _hf_pretrained_error(argv: Sequence[str]) -> Optional[str]:
  """Why `--model hf`'s `pretrained=` names no model directory (a missing local path, a file, a
  directory without config.json), else None; transformers' own error for these is a traceback."""
  if "-h" in argv or "--help" in argv:
    return None
  parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
  parser.add_argument("--model", "-M")
  parser.add_argument("--model_args", "-a", nargs="+", action="extend", default=[])
  parser.add_argument("--config", "-C")
  try:
    args, _ = parser.parse_known_args(list(argv))
  except argparse.ArgumentError:
    return None   # lm-eval's parser says what is wrong
  model = args.model or (None if args.config else "hf")   # lm-eval's default model; a YAML's own
  pretrained = None
  for value in args.model_args:   # `k=v,k2=v2` words or one JSON object, as lm-eval reads them
    if value.lstrip().startswith("{"):
      try:
        pretrained = json.loads(value).get("pretrained", pretrained)
      except (ValueError, AttributeError):
        return None
      continue
    for item in value.split(","):
      key, _, val = item.partition("=")
      if key.strip() == "pretrained":
        pretrained = val
  if model not in _HF_MODELS or not isinstance(pretrained, str):
    return None
  path = os.path.expanduser(pretrained)
  expected = (f"--model {model} expects a transformers model directory (config.json and weights), "
              "such as `python -m umoe_jax.interop export --format=hf` writes (docs/interop.md)")
  if os.path.isdir(path):
    if os.path.isfile(os.path.join(path, "config.json")):
      return None
    return f"pretrained={pretrained!r}: no config.json in this directory; {expected}"
  if os.path.exists(path):
    return f"pretrained={pretrained!r} is a file, not a directory; {expected}"
  if _HUB_ID.fullmatch(pretrained) and ".." not in pretrained and "--" not in pretrained:
    return None
  return f"pretrained={pretrained!r}: no such directory, nor a Hub id (org/name); {expected}"


def run_lm_eval_cli(argv: Sequence[str]) -> int:
  """lm-eval's command line (`lm_eval ...` arguments) with `umoe_jax` registered; exit status.
  Our model's bad input (a missing checkpoint or config file, a tokenizer larger than the model), a
  --model or task name lm-eval does not know and a Hub that cannot be reached for a task's data are
  one "error:" line and status 1, as in the other commands;
  so is `--model hf` started in the repository root, where transformers' `from kernels import ...`
  finds this repository's kernels/ (docs/interop.md), and `--model hf` with a `pretrained=` that
  names no model directory, before lm-eval starts."""
  from lm_eval.__main__ import cli_evaluate

  from umoe_jax.config.schema import ConfigError
  from umoe_jax.load import LoadError
  hf_error = _hf_pretrained_error(argv)
  if hf_error:
    print(f"error: {hf_error}", file=sys.stderr)
    return 1
  saved = sys.argv
  sys.argv = ["lm-eval"] + list(argv)
  try:
    cli_evaluate()
  except SystemExit as e:
    return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
  except (EvalError, LoadError, ConfigError, FileNotFoundError) as e:  # ValueErrors, not lm-eval's
    print(f"error: {e}", file=sys.stderr)
    return 1
  except ValueError as e:  # lm-eval's "Tasks not found: x" or unknown --model (typos); any other is
    if str(e).startswith("Attempted to load model"):   # a bug: its traceback
      print(f"error: {e}", file=sys.stderr)
      return 1
    if not str(e).startswith("Tasks not found"):
      raise
    print(f"error: {e} (lm-eval's task names, `lm-eval ls tasks`, or --include_path DIR with "
          "your task YAMLs)", file=sys.stderr)
    return 1
  except ConnectionError as e:  # a task whose data lm-eval fetches (datasets) from an unreachable Hub
    print(f"error: {e}: lm-eval's built-in tasks download their data; offline, give local files "
          "(--include_path with a task YAML, or `python -m umoe_jax.eval tasks` on JSONL files)",
          file=sys.stderr)
    return 1
  except (ImportError, RuntimeError) as e:  # only the kernels/ shadow; others keep a traceback
    shadow = _kernels_shadowed(e)
    if shadow is None:
      raise
    print(f"error: {shadow}", file=sys.stderr)
    return 1
  finally:
    sys.argv = saved
  return 0


if __name__ == "__main__":
  from umoe_jax import stdout_errors
  stdout_errors.run_and_exit(run_lm_eval_cli, sys.argv[1:])
