"""ConfigDict <-> `ModelConfig`: building the dataclasses with errors that name key and value,
and the defaults as a ConfigDict (the one source of the model defaults)."""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Mapping

from umoe_jax.config.checks import validate
from umoe_jax.config.removed import drop_removed
from umoe_jax.config.schema import ConfigError, ModelConfig, config_fields, resolve_router


def _to_plain(obj: Any) -> Any:
  if hasattr(obj, "to_dict"):
    return obj.to_dict()
  return obj


def _coerce(value: Any, annotation: Any, path: str) -> Any:
  origin = typing.get_origin(annotation)
  if origin in (typing.Union, types.UnionType):
    args = typing.get_args(annotation)
    if value is None and type(None) in args:
      return None
    (inner,) = [a for a in args if a is not type(None)]
    return _coerce(value, inner, path)
  if dataclasses.is_dataclass(annotation):
    return _build(annotation, value, path)
  if annotation is bool:
    if not isinstance(value, bool):
      raise ConfigError(f"{path}={value!r}: expected true/false")
    return value
  if annotation is int:
    if isinstance(value, bool) or not isinstance(value, int):
      raise ConfigError(f"{path}={value!r}: expected an integer")
    return value
  if annotation is float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ConfigError(f"{path}={value!r}: expected a number")
    return float(value)
  if annotation is str:
    if not isinstance(value, str):
      raise ConfigError(f"{path}={value!r}: expected a string")
    return value
  return value


def _build(cls, values: Any, path: str):
  values = _to_plain(values)
  if not isinstance(values, Mapping):
    raise ConfigError(f"{path}={values!r}: expected a mapping of {cls.__name__} fields")
  hints = typing.get_type_hints(cls)
  fields = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(values) - fields)
  if unknown:
    raise ConfigError(f"unknown key {path}.{unknown[0]} (={values[unknown[0]]!r}); "
                      f"valid keys of {path}: {', '.join(sorted(fields))}")
  kwargs = {k: _coerce(v, hints[k], f"{path}.{k}") for k, v in values.items()}
  return cls(**kwargs)


def resolve(cfg: ModelConfig) -> ModelConfig:
  """Fills the defaults that depend on other keys in `model.router` (`resolve_router`); the
  sub-layers' routers resolve theirs in `ModelConfig.router_for`."""
  return dataclasses.replace(cfg, router=resolve_router(cfg.router, cfg))


def model_config(cfg: Any) -> ModelConfig:
  """Builds, resolves and validates a `ModelConfig` from a ConfigDict / mapping (`config.model`);
  removed keys (a config.json of an older run) are dropped with a warning (`drop_removed`)."""
  if isinstance(cfg, ModelConfig):
    return validate(resolve(cfg))
  return validate(resolve(_build(ModelConfig, drop_removed(_to_plain(cfg)), "model")))


def to_dict(cfg: ModelConfig) -> dict:
  return dataclasses.asdict(cfg)


def default_config_dict(cls=ModelConfig):
  """The dataclass defaults as an ml_collections ConfigDict (the one source of the model defaults).

  Optional fields (`Optional[int]` ...) become `config.fields.optional` fields, so that the command
  line can set them to a value or to None (`--config.model.attention.q_lora_rank=None`,
  `--config.model.attention.latent_dim=192`).
  """
  import ml_collections
  from umoe_jax.config.fields import optional

  hints = typing.get_type_hints(cls)
  out = {}
  for f in config_fields(cls):
    value = getattr(cls(), f.name)
    args = typing.get_args(hints[f.name])
    if dataclasses.is_dataclass(value):
      out[f.name] = default_config_dict(type(value))
    elif type(None) in args:
      (inner,) = [a for a in args if a is not type(None)]
      out[f.name] = optional(inner, value)
    else:
      out[f.name] = value
  return ml_collections.ConfigDict(out)
