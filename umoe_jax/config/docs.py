"""docs/configuration.md, generated from the comments where each config key is declared.

  python3 -m umoe_jax.config.docs           # writes docs/configuration.md
  python3 -m umoe_jax.config.docs --check   # exit 1 when the page is not what the source gives now

A key's text is its comment in the source (`umoe_jax.config.comments` reads it), its default the
value the code builds; this module only groups the keys by topic (`TOPICS`) and lays the page out.
A key without a comment, or one no topic claims, is an error: the page documents every key the
trainer and the fine-tuning command accept (`keys()`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import typing
from typing import Any, Iterator, NamedTuple

from umoe_jax.config import comments, schema

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = os.path.join(ROOT, "docs", "configuration.md")
COMMAND = "python3 -m umoe_jax.config.docs"
# Keys of the per sub-layer router sections: every `model.router` key but the layer-level ones,
# each None = inherit. The page documents them once, as this pattern, not 2 x 30 times.
SUBLAYER_ROUTER = "model.{attention,ffn}.router.<key>"


class Key(NamedTuple):
  part: str                 # "train" (train.py) or "finetune" (python -m umoe_jax.finetune)
  name: str                 # dotted, as after --config.
  default: Any
  doc: str


class Topic(NamedTuple):
  part: str
  title: str
  intro: str
  prefixes: tuple[str, ...]  # a key belongs to the topic with its longest matching prefix


_ROUTER_OPTIONS = tuple(f"model.router.{k}" for k in (
    "xmoe_", "hash_seed", "smoe_dropout_", "stablemoe_", "aoe_dim"))
_ROUTER_SELECTION = tuple(f"model.router.{k}" for k in (
    "selection", "top_p", "expert_choice_", "mixing", "similarity_temperature",
    "attention_temperature"))
_KERNELS = ("model.gmm_backend", "model.attention.core", "model.moe.fuse_", "model.router.logits_dtype",
            "model.router.topk_backend", "train.precision")
_MEMORY = ("model.scan_layers", "train.remat", "train.loss_chunk_tokens", "train.fused_loss_head",
           "train.grad_accum_steps", "train.mu_dtype", "train.compilation_cache_dir")
_OPTIMIZER = tuple(f"train.{k}" for k in (
    "learning_rate", "warmup_", "min_lr_ratio", "b1", "b2", "eps", "weight_decay", "grad_clip"))

TOPICS = (
    Topic("train", "Model", "The decoder's shape and numerics. The defaults are the base scale's width "
          "and depth; each `configs/<family>_<scale>.py` sets the shape of its scale.", ("model.",)),
    Topic("train", "Attention", "`model.attention.kind` picks the attention variant; the other keys "
          "shape it, and each says which kinds read it. Pre-mixing (`premix`) is UMoE's attention: "
          "its routed experts come from the layer's expert pool (`model.moe`).",
          ("model.attention.",)),
    Topic("train", "FFN", "The FFN sub-layer: a dense MLP, a routed MoE into the layer's expert pool, "
          "or none (all experts to attention).", ("model.ffn.",)),
    Topic("train", "Expert pool", "The routed experts of a layer: E two-matrix MLPs D -> F -> D. In "
          "UMoE the attention and the FFN route into this one pool.", ("model.moe.",)),
    Topic("train", "Router", "How tokens pick experts, for every routed sub-layer (the per sub-layer "
          "sections below override it), and the losses that keep the load balanced.",
          ("model.router.",)),
    Topic("train", "Router selection and mixing", "How a router with a probability distribution "
          "turns it into picks: top-k, top-P or expert choice, optionally after mixing the "
          "distributions over related tokens.", _ROUTER_SELECTION),
    Topic("train", "Router kinds' options", "Keys that only one `model.router.kind` reads; the prefix "
          "names the kind.", _ROUTER_OPTIONS),
    Topic("train", "Per sub-layer routers", "UMoE's attention and FFN have a router each. Their "
          "sections take any `model.router` key but `share_att_ffn`; a key left at None inherits "
          "`model.router`'s, so `--config.model.ffn.router.kind=aoe` changes the FFN's router only.",
          ("model.attention.router", "model.ffn.router")),
    Topic("train", "Kernels", "Which implementation runs the hot operations. `auto` picks per "
          "platform; the others exist to compare, debug or trade speed for memory. They change how the "
          "model runs, not what it computes (up to rounding). More in [kernels.md](kernels.md).",
          _KERNELS),
    Topic("train", "Training loop", "Batch, length, steps and the evaluation and logging cadence. "
          "The tiny configs override the batch, length and steps to train on a CPU in minutes.",
          ("train.",)),
    Topic("train", "Optimizer and schedule", "AdamW with linear warmup and cosine decay, as the "
          "official UMoE recipe. Resuming with other schedule keys reshapes the rest of the schedule "
          "(with a warning).", _OPTIMIZER),
    Topic("train", "Memory and compile time", "Levers that trade step time for device memory or "
          "compile time; none changes the loss or gradients beyond rounding.", _MEMORY),
    Topic("train", "Data", "The training corpus, its tokenizer and the input pipeline "
          "([data.md](data.md)). Every path may be a `gs://`, `s3://` or `hf://` URL.", ("data.",)),
    Topic("train", "Checkpoints", "Orbax checkpoints in `WORKDIR/checkpoints/`: when they are "
          "written, how many are kept, where a run starts from, and the guard that keeps a "
          "diverged state out ([training.md](training.md)).", ("checkpoint.",)),
    Topic("train", "Logging", "TensorBoard, `metrics.jsonl` and the profiler.", ("log.",)),
    Topic("train", "Parallelism", "The device mesh, how parameters map onto it and how expert "
          "parallelism exchanges tokens ([parallelism.md](parallelism.md)).",
          ("mesh.", "sharding_rules", "expert_parallel.")),
    Topic("finetune", "Fine-tuning: data", "`python -m umoe_jax.finetune` has a config of its own "
          "(`configs/finetune/*.py` start from `umoe_jax.finetune.config.default_config()`); "
          "[finetuning.md](finetuning.md) explains the command. Its data section names the "
          "labelled files and how texts become tokens.", ("init_from", "data.")),
    Topic("finetune", "Fine-tuning: model", "The classification head over the pretrained decoder.",
          ("model.",)),
    Topic("finetune", "Fine-tuning: training", "Epochs, batches and two learning rates: one for the "
          "new head, a smaller one for the pretrained body.", ("train.",)),
    Topic("finetune", "Fine-tuning: checkpoints and logs", "Saves at every epoch end (the best dev "
          "epoch apart), TensorBoard and `metrics.jsonl`.", ("checkpoint.", "log.")),
)

_SCHEMA = ("umoe_jax/config/schema.py", "class")
# (part, key prefix, source file, "class" or "function", name): where each section's keys are declared.
SOURCES = (
    ("train", "model.", *_SCHEMA, "ModelConfig"),
    ("train", "model.attention.", *_SCHEMA, "AttentionConfig"),
    ("train", "model.ffn.", *_SCHEMA, "FFNConfig"),
    ("train", "model.moe.", *_SCHEMA, "MoEConfig"),
    ("train", "model.router.", *_SCHEMA, "RouterConfig"),
    ("train", "data.", "umoe_jax/data/__init__.py", "function", "default_data_config"),
    ("train", "train.", "umoe_jax/train/config.py", "function", "default_train_config"),
    ("train", "checkpoint.", "umoe_jax/train/config.py", "function", "default_checkpoint_config"),
    ("train", "log.", "umoe_jax/train/config.py", "function", "default_log_config"),
    ("train", "", "configs/common.py", "function", "experiment"),
    ("finetune", "", "umoe_jax/finetune/config.py", "function", "default_config"),
)


def _source_docs() -> dict[tuple[str, str], str]:
  out = {}
  for part, prefix, path, kind, name in SOURCES:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
      text = f.read()
    found = comments.class_fields(text, name) if kind == "class" else comments.function_keys(text, name)
    out.update({(part, prefix + k): doc for k, doc in found.items()})
  return out


def _model_defaults(cls=schema.ModelConfig, prefix: str = "model.") -> Iterator[tuple[str, Any]]:
  hints = typing.get_type_hints(cls)
  for f in schema.config_fields(cls):
    value = getattr(cls(), f.name)
    if hints[f.name] is schema.RouterOverrides:
      yield prefix + f.name, None
    elif dataclasses.is_dataclass(value):
      yield from _model_defaults(type(value), f"{prefix}{f.name}.")
    else:
      yield prefix + f.name, value


def _flat(section: Any, prefix: str) -> Iterator[tuple[str, Any]]:
  for k in section.keys():
    value = section[k]
    if hasattr(value, "keys"):
      yield from _flat(value, f"{prefix}{k}.")
    else:
      yield prefix + k, value


def defaults() -> list[tuple[str, str, Any]]:
  """(part, key, default) of every key the two commands accept, in declaration order."""
  import configs.common
  from umoe_jax import data
  from umoe_jax.finetune import config as finetune_config
  from umoe_jax.train import config as train_config

  out = [("train", k, v) for k, v in _model_defaults()]
  exp = configs.common.experiment("umoe", "tiny")
  sections = [("data", data.default_data_config()), ("train", train_config.default_train_config()),
              ("checkpoint", train_config.default_checkpoint_config()),
              ("log", train_config.default_log_config()), ("mesh", exp.mesh),
              ("expert_parallel", exp.expert_parallel)]
  for name, section in sections:
    out += [("train", k, v) for k, v in _flat(section, name + ".")]
  out.insert(len(out) - len(exp.expert_parallel), ("train", "sharding_rules", exp.sharding_rules))
  out += [("finetune", k, v) for k, v in _flat(finetune_config.default_config(), "")]
  return out


def keys() -> list[Key]:
  """Every key with its default and its comment, in the order of the sources; a key without a
  comment raises ValueError."""
  docs = _source_docs()
  order = {k: i for i, k in enumerate(docs)}
  out = []
  for part, name, default in defaults():
    doc = docs.get((part, name), "")
    if not doc:
      raise ValueError(f"config key {name!r} ({part}) has no comment where it is declared "
                       f"({', '.join(s[2] for s in SOURCES if s[0] == part)})")
    out.append(Key(part, name, default, doc))
  return sorted(out, key=lambda k: order[(k.part, k.name)])


def topic_of(key: Key) -> Topic:
  best = max(((len(p), t) for t in TOPICS if t.part == key.part for p in t.prefixes
              if key.name == p or key.name.startswith(p)), default=None, key=lambda x: x[0])
  if best is None:
    raise ValueError(f"config key {key.name!r} ({key.part}) is in no topic of "
                     f"umoe_jax.config.docs.TOPICS")
  return best[1]


def fmt(value: Any) -> str:
  """A default as it is written on the command line or in a config file."""
  if value is None or isinstance(value, (bool, int, float)):
    return repr(value)
  if isinstance(value, str):
    return json.dumps(value)
  if isinstance(value, (tuple, list)):
    inner = ", ".join(fmt(v) for v in value)
    return f"({inner},)" if isinstance(value, tuple) and len(value) == 1 else (
        f"({inner})" if isinstance(value, tuple) else f"[{inner}]")
  return repr(value)


def display_name(key: Key) -> str:
  if key.name in ("model.attention.router", "model.ffn.router"):
    return SUBLAYER_ROUTER
  return key.name


def sentence(text: str) -> str:
  """A comment with a full stop (its first word stays as written: it is often a name)."""
  text = text.strip()
  return text if text.endswith((".", "!", "?")) else text + "."


def page() -> str:
  grouped: dict[Topic, list[Key]] = {t: [] for t in TOPICS}
  seen = set()
  for key in keys():
    name = (key.part, display_name(key))
    if name in seen:
      continue
    seen.add(name)
    grouped[topic_of(key)].append(key)
  out = ["# Configuration", "",
         f"<!-- generated by `{COMMAND}` from the comments in the config sources; do not edit -->", "",
         "Every key below can be set on the command line as `--config.<key>=<value>` (optional keys "
         "also take `None`) or in a config file. The defaults are the library's; "
         "`configs/<family>_<scale>.py` set the model's shape and each scale's batch, length, steps "
         "and checkpoint cadence (`configs/common.py`). The whole config is checked before anything "
         "is built: an unknown key or a bad value stops with one line naming it.", "",
         "Training (`train.py`): " + ", ".join(
             f"[{t.title}](#{_anchor(t.title)})" for t in TOPICS if t.part == "train") + ".", "",
         "Fine-tuning (`python -m umoe_jax.finetune`): " + ", ".join(
             f"[{t.title.partition(': ')[2]}](#{_anchor(t.title)})" for t in TOPICS
             if t.part == "finetune") + ".", ""]
  for topic in TOPICS:
    if not grouped[topic]:
      raise ValueError(f"topic {topic.title!r} has no keys")
    out += [f"## {topic.title}", "", topic.intro, ""]
    for key in grouped[topic]:
      out.append(f"- `{display_name(key)}` (default `{fmt(key.default)}`): {sentence(key.doc)}")
    out.append("")
  return "\n".join(out)


def _anchor(title: str) -> str:
  """GitHub's heading anchor: lower case, punctuation but '-' dropped, spaces to '-'."""
  kept = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
  return kept.replace(" ", "-")


def main(argv: list[str]) -> int:
  check = "--check" in argv[1:]
  unknown = [a for a in argv[1:] if a != "--check"]
  if unknown:
    print(f"error: unknown argument {unknown[0]!r}; usage: {COMMAND} [--check]", file=sys.stderr)
    return 2
  text = page()
  if check:
    current = open(PAGE, encoding="utf-8").read() if os.path.exists(PAGE) else ""
    if current != text:
      print(f"error: {os.path.relpath(PAGE, ROOT)} is stale: run `{COMMAND}`", file=sys.stderr)
      return 1
    return 0
  with open(PAGE, "w", encoding="utf-8") as f:
    f.write(text)
  print(f"wrote {os.path.relpath(PAGE, ROOT)}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
