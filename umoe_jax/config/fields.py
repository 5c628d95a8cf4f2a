"""ConfigDict fields that the command line can set to None.

ml_collections types a field by its default and parses `--config.a.b=None` with that type's parser,
so an optional integer (`--config.model.attention.q_lora_rank=None`, the full-query ablation) fails
in flag parsing: "invalid literal for int()". `optional(int, 16)` is a `FieldReference` whose type
accepts the value type and None, with a registered flag parser that reads "None" / "none" / "null"
as None and anything else like the value type:

    m.attention.q_lora_rank = optional(int, 16)      # --config...q_lora_rank=None | 8
    m.expert_parallel.capacity_factor = optional(float)   # None by default; --config...=1.25

Plain values assigned later (`m.attention.q_lora_rank = 8` in a config file) keep the field's type.
"""
from __future__ import annotations

from typing import Any, Optional

from absl import flags
from ml_collections import config_dict, config_flags

_NONE_WORDS = ("none", "null")


class _OptionalType(type):
  """isinstance(v, Optional<inner>): v is None or a value of the inner type (bool is no number,
  an int is a float)."""

  def __instancecheck__(cls, obj: Any) -> bool:
    if obj is None:
      return True
    if cls.inner in (int, float) and isinstance(obj, bool):
      return False
    return isinstance(obj, (int, float) if cls.inner is float else cls.inner)


def _optional_type(inner: type) -> type:
  return _OptionalType(f"Optional{inner.__name__.capitalize()}", (), {"inner": inner})


_VALUE_PARSERS = {int: flags.IntegerParser(), float: flags.FloatParser(), bool: flags.BooleanParser(),
                  str: flags.ArgumentParser()}
OPTIONAL_TYPES = {inner: _optional_type(inner) for inner in _VALUE_PARSERS}


class _OptionalParser(flags.ArgumentParser):
  """Parses "None" / "none" / "null" as None, anything else with the value type's parser."""

  def __init__(self, inner: type):
    super().__init__()
    self.inner = inner

  def parse(self, argument: Any) -> Any:
    if argument is None:
      return None
    if isinstance(argument, str) and argument.strip().lower() in _NONE_WORDS:
      return None
    return _VALUE_PARSERS[self.inner].parse(argument)

  def flag_type(self) -> str:
    return f"{self.inner.__name__} or None"


for _inner, _type in OPTIONAL_TYPES.items():
  config_flags.register_flag_parser_for_type(_type, _OptionalParser(_inner))


def optional(inner: type, default: Optional[Any] = None) -> config_dict.FieldReference:
  """A ConfigDict field of type `inner` or None (default `default`) that the command line can set
  to either (`--config.key=None`)."""
  if inner not in OPTIONAL_TYPES:
    raise TypeError(f"optional({inner!r}): supported value types are "
                    f"{', '.join(t.__name__ for t in OPTIONAL_TYPES)}")
  return config_dict.FieldReference(default, field_type=OPTIONAL_TYPES[inner])
