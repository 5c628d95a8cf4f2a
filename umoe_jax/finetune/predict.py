"""A fine-tuned checkpoint: its layout, loading it, and scoring texts with it.

Fine-tuning workdir layout (`umoe_jax.finetune.loop.run` writes it):
  <workdir>/config.json        the fine-tuning config
  <workdir>/classifier.json    what scoring needs: the backbone's model section, the number of classes,
                               pooling, the label map {"names", "kind"}, the tokenizer spec and
                               sequence settings, the text and label fields
  <workdir>/best/<step>/state  Orbax: {"params"} of the epoch with the best dev score
  <workdir>/checkpoints/<step>/state   Orbax: params, optimizer state, step, RNG, best score (resume)
  <workdir>/results.json       best epoch, dev and test metrics, the majority-class baselines
  <workdir>/test_predictions.jsonl, metrics.jsonl, tensorboard/

    model, meta = load_finetuned("runs/ft")
    probs = probabilities(model, rows, batch_size=64, max_len=meta["max_len"])      # [N, C]

`predict_file` (the `python -m umoe_jax.finetune predict` subcommand) writes one prediction per input
record, in input order: JSONL {"index", "prediction", "probability", "probs": {name: p}} (plus
"label" when the input has labels) or CSV with the same columns (one `prob_<name>` column per class).
"""
from __future__ import annotations

import csv
import functools
import io
import json
import os
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from umoe_jax import json_errors
from umoe_jax import load as load_lib
from umoe_jax import storage
from umoe_jax.config import ConfigError
from umoe_jax.finetune import data as data_lib
from umoe_jax.finetune.metrics import classification_metrics

CLASSIFIER_FILE = load_lib.CLASSIFIER_FILE
BEST_DIR = "best"
RESULTS_FILE = "results.json"


def write_json(path: str, obj: Any) -> None:
  """Writes JSON atomically (storage.write_text; a reader never sees half a file), local or a URL."""
  storage.write_text(path, json.dumps(obj, indent=2) + "\n")


def read_meta(checkpoint: str) -> dict:
  """The classifier.json of a fine-tuning workdir; a clear error when it is not one."""
  path = storage.join(checkpoint, CLASSIFIER_FILE)
  if not storage.isdir(checkpoint):
    raise ConfigError(f"checkpoint {checkpoint!r}: no such directory")
  if not storage.isfile(path):
    raise ConfigError(f"checkpoint {checkpoint!r} has no {CLASSIFIER_FILE}: not a fine-tuning workdir "
                      f"(python -m umoe_jax.finetune --config=... --workdir=DIR writes one)")
  try:
    meta = json.loads(storage.read_text(path))
  except json.JSONDecodeError as e:
    raise ConfigError(f"{path}: not valid JSON ({json_errors.message(e)})") from None
  for key in ("model", "labels", "pooling", "tokenizer", "max_len"):
    if key not in meta:
      raise ConfigError(f"{path} lacks the key {key!r}")
  return meta


def make_classifier(meta: dict, *, compute_dtype: Optional[str] = None):
  """The abstract SequenceClassifier of classifier.json (ShapeDtypeStruct parameters)."""
  import ml_collections
  from umoe_jax.finetune.model import abstract_classifier
  section = ml_collections.ConfigDict(meta["model"])
  if compute_dtype:
    section.compute_dtype = compute_dtype
  return abstract_classifier(section, len(meta["labels"]["names"]), pooling=meta["pooling"],
                             dropout=meta.get("head_dropout", 0.0))


def device_sharding() -> jax.sharding.Sharding:
  """Where fine-tuning and scoring run: the first device."""
  return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def single_device_target(abstract_tree: Any) -> Any:
  """ShapeDtypeStructs on the first device: an Orbax restore target."""
  device = device_sharding()
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                      abstract_tree)


def load_finetuned(checkpoint: str, *, compute_dtype: Optional[str] = None):
  """(SequenceClassifier with the best dev checkpoint's parameters, classifier.json dict)."""
  from umoe_jax.train.checkpoint import Checkpointer, CheckpointError
  meta = read_meta(checkpoint)
  model = make_classifier(meta, compute_dtype=compute_dtype)
  graphdef, abstract = nnx.split(model, nnx.Param)
  best = os.path.join(checkpoint, BEST_DIR)
  ckpt = Checkpointer(best, keep=1, async_save=False)
  try:
    if not ckpt.steps():
      raise ConfigError(f"checkpoint {checkpoint!r} has no best checkpoint in {best} (the run ended "
                        f"before its first epoch)")
    target = {"params": single_device_target(nnx.to_pure_dict(abstract))}
    try:
      restored, _ = ckpt.restore_latest(target)
    except CheckpointError as e:
      raise ConfigError(f"checkpoint {checkpoint!r}: {e}") from None
  finally:
    ckpt.close()
  nnx.replace_by_pure_dict(abstract, restored["params"])
  return nnx.merge(graphdef, abstract), meta


@functools.lru_cache(maxsize=8)
def probs_fn(graphdef):
  """Jitted (params, tokens [B, L], lengths [B]) -> class probabilities float32 [B, C]."""

  @jax.jit
  def probs(params, tokens, lengths):
    logits, _ = nnx.merge(graphdef, params)(tokens, lengths)
    return jax.nn.softmax(logits, axis=-1)

  return probs


def probabilities(model_or_parts, rows: Sequence[np.ndarray], *, batch_size: int,
                  max_len: int) -> np.ndarray:
  """float32 [N, C] class probabilities of token rows, in row order.

  `model_or_parts`: a SequenceClassifier, or (graphdef, params pure dict) inside the training loop.
  """
  if isinstance(model_or_parts, tuple):
    graphdef, params = model_or_parts
  else:
    graphdef, state = nnx.split(model_or_parts, nnx.Param)
    params = nnx.to_pure_dict(state)
  fn = probs_fn(graphdef)
  out = None
  for idx, batch in data_lib.eval_batches(rows, None, batch_size=batch_size, max_len=max_len):
    p = np.asarray(fn(params, jnp.asarray(batch["tokens"]), jnp.asarray(batch["lengths"])))
    if out is None:
      out = np.zeros((len(rows), p.shape[1]), np.float32)
    out[idx] = p[:len(idx)]
  return out


def nll(probs: np.ndarray, labels: np.ndarray) -> float:
  """Mean negative log-likelihood of the true classes."""
  picked = probs[np.arange(len(labels)), labels].astype(np.float64)
  return float(-np.mean(np.log(np.maximum(picked, 1e-30))))


def score(probs: np.ndarray, labels: np.ndarray, num_classes: int) -> dict:
  """classification_metrics + "loss" (mean NLL) of probabilities [N, C] against class ids [N]."""
  out = classification_metrics(labels, probs.argmax(axis=1), num_classes)
  out["loss"] = nll(probs, labels)
  return out


def write_predictions(path: str, probs: np.ndarray, label_map: data_lib.LabelMap,
                      gold: Optional[Sequence[Any]] = None) -> None:
  """One row per example (see the module docstring); .csv -> CSV, anything else JSON lines."""
  preds = probs.argmax(axis=1)
  names = label_map.names
  with io.StringIO(newline="") as f:
    if path.endswith(".csv"):
      writer = csv.writer(f)
      writer.writerow(["index", "prediction", "probability"] + (["label"] if gold else [])
                      + [f"prob_{n}" for n in names])
      for i, (c, p) in enumerate(zip(preds, probs)):
        writer.writerow([i, label_map.value(c), f"{p[c]:.6f}"] + ([gold[i]] if gold else [])
                        + [f"{x:.6f}" for x in p])
    else:
      for i, (c, p) in enumerate(zip(preds, probs)):
        row = {"index": i, "prediction": label_map.value(c), "probability": round(float(p[c]), 6)}
        if gold:
          row["label"] = gold[i]
        row["probs"] = {n: round(float(x), 6) for n, x in zip(names, p)}
        f.write(json.dumps(row) + "\n")
    storage.write_text(path, f.getvalue())  # atomic, local or a URL


def tokenizer_of(meta: dict):
  from umoe_jax.data.tokenizer import make_tokenizer
  return make_tokenizer(meta["tokenizer"], meta.get("eos_token", ""))


def predict_file(checkpoint: str, input_path: str, output_path: str, *, text_field: str = "",
                 label_field: str = "", fmt: str = "auto", batch_size: int = 64,
                 compute_dtype: Optional[str] = None) -> dict:
  """Scores every record of `input_path`; returns {"count", "output"} plus the metrics when the
  input has the label field (unseen labels are then an error naming file and line)."""
  from umoe_jax.output import check_output_path
  if batch_size < 1:
    raise ConfigError(f"--batch_size={batch_size} must be >= 1")
  try:  # before the scoring: its results could not be written at the end
    check_output_path(output_path, "--output")
  except ValueError as e:
    raise ConfigError(str(e)) from None
  meta = read_meta(checkpoint)
  text_field = text_field or meta.get("text_field", "text")
  label_field = label_field or meta.get("label_field", "label")
  flags = data_lib.PREDICT_FLAGS  # the settings are flags here, not config keys
  labelled = (data_lib.has_field(input_path, label_field, fmt, flags) if os.path.isfile(input_path)
              else False)
  examples = data_lib.read_examples(input_path, text_field=text_field,
                                    label_field=label_field if labelled else None, fmt=fmt,
                                    key="--input", names=flags)
  label_map = data_lib.LabelMap.from_json(meta["labels"])
  ids = (label_map.ids(examples, path=input_path, train_path=meta.get("train_path", "?"))
         if labelled else None)
  model, meta = load_finetuned(checkpoint, compute_dtype=compute_dtype)
  tokenizer = tokenizer_of(meta)
  rows = data_lib.encode([e.text for e in examples], tokenizer, max_len=meta["max_len"],
                         bos_id=meta.get("bos_id"), append_eos=meta.get("append_eos", True))
  probs = probabilities(model, rows, batch_size=batch_size, max_len=meta["max_len"])
  gold = [label_map.value(i) for i in ids] if labelled else None
  write_predictions(output_path, probs, label_map, gold)
  out = {"count": len(examples), "output": output_path}
  if labelled:
    out.update(score(probs, ids, label_map.num_classes))
  return out
