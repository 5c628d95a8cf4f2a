"""The pretrained backbone a fine-tuning run starts from (`init_from`): a training workdir or a
converted official checkpoint (`umoe_jax.interop.official`).

  read_backbone           its architecture: the model section of its config.json
  tokenizer_spec          data.tokenizer, else the pretraining run's data.tokenizer
  load_backbone_params    its parameters (the latest step of a workdir, or params/ of a converted one)
Errors are ConfigErrors naming init_from.
"""
from __future__ import annotations

import os
from typing import Any

import jax
import ml_collections
from flax import nnx

from umoe_jax import storage
from umoe_jax.config import ConfigError
from umoe_jax.finetune.predict import device_sharding
from umoe_jax.train import checkpoint as ckpt_lib


def read_backbone(config: Any) -> tuple[ml_collections.ConfigDict, dict]:
  """(model section, the whole config.json dict) of init_from."""
  from umoe_jax.load import finetune_message, finetune_workdir, read_checkpoint_config
  path = storage.expand(config.init_from)
  if not storage.isdir(path):
    if storage.isfile(path):
      raise ConfigError(f"init_from={config.init_from!r} is a file, not a checkpoint directory (a "
                        "training workdir, or a converted checkpoint's directory)")
    raise ConfigError(f"init_from={config.init_from!r}: no such directory")
  workdir = finetune_workdir(path)
  if workdir is not None:  # else "does not name its tokenizer (a converted checkpoint)"
    raise ConfigError(f"init_from={finetune_message(config.init_from, workdir)}")
  saved = read_checkpoint_config(path)
  if saved is None or not isinstance(saved, dict) or "model" not in saved:
    raise ConfigError(f"init_from={config.init_from!r} has no config.json with a 'model' section: "
                      f"not a training workdir or a converted checkpoint, so the architecture is "
                      f"unknown")
  return ml_collections.ConfigDict(saved["model"]), saved


def tokenizer_spec(config: Any, saved: dict) -> tuple[str, str]:
  """(tokenizer, eos_token): data.tokenizer, else the pretraining run's data.tokenizer (`saved`:
  init_from's config.json). A tokenizer file's path is made absolute (classifier.json keeps it)."""
  d = config.data
  if d.tokenizer:
    spec, eos = d.tokenizer, d.eos_token
  else:
    pretrain = saved.get("data") or {}
    if not pretrain.get("tokenizer"):
      raise ConfigError(f"init_from={config.init_from!r} does not name its tokenizer (a converted "
                        f"checkpoint): set data.tokenizer (and data.bos_id=1 for Llama-2)")
    spec, eos = pretrain["tokenizer"], d.eos_token or pretrain.get("eos_token", "")
  if spec != "byte" and os.path.exists(os.path.expanduser(spec)):
    spec = os.path.abspath(os.path.expanduser(spec))
  return spec, eos


def load_backbone_params(config: Any, abstract_params: Any) -> dict:
  """The backbone's parameters (pure dict, on the first device) from init_from.
  `abstract_params`: the classifier's nnx.State of parameters (its "backbone" part is restored)."""
  backbone = abstract_params["backbone"]
  device = device_sharding()
  shardings = jax.tree.map(lambda _: device, nnx.to_pure_dict(backbone))
  try:
    return ckpt_lib.load_init_params(storage.abspath(config.init_from),
                                     backbone, shardings)
  except ConfigError:
    raise
  except Exception as e:  # pylint: disable=broad-except  (Orbax: missing / mismatched arrays)
    raise ConfigError(f"init_from={config.init_from!r}: its parameters do not restore into the "
                      f"architecture of its config.json ({type(e).__name__}: {str(e)[:300]})") from None
