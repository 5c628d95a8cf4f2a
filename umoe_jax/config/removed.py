"""Config keys and values that were removed, and what a config that names one gets.

A run's config.json keeps the keys of the version that wrote it, so `drop_removed` takes a removed
key out of such a model section (or maps a removed value to the one that now does the same) with
one warning naming it: the run's checkpoints still load. A command line that sets a removed key
(`--config.model.router.one_pass=true`) gets an error saying what runs now (`REMOVED_KEYS`).
"""
from __future__ import annotations

import logging
from typing import Any, Mapping

_log = logging.getLogger(__name__)

_ONE_PASS = ("the routers compute softmax, top-k and balance statistics as separate ops, as "
             "one_pass=false did")

# Removed key (as after --config.) -> what runs now.
REMOVED_KEYS = {
    "model.router.one_pass": _ONE_PASS,
    "model.attention.router.one_pass": _ONE_PASS,
    "model.ffn.router.one_pass": _ONE_PASS,
}

# Key -> {removed value: the value that now computes the same}.
REMOVED_VALUES = {
    "model.attention.core_backward": {"stored": "stored_pairs"},
}

_warned: set[str] = set()   # one warning a message per process, however often a config is built


def drop_removed(section: Any, prefix: str = "model") -> Any:
  """A copy of the mapping `section` (the config at `prefix`, nested sections as mappings) without
  the removed keys and with removed values mapped, after one warning naming them all; `section`
  itself when it names none. A removed sub-layer key left at None (inherit) goes without a word."""
  notes: list[tuple[str, str]] = []
  out = _drop(section, prefix, notes)
  if not notes:
    return section
  by_reason: dict[str, list[str]] = {}
  for setting, reason in notes:
    by_reason.setdefault(reason, []).append(setting)
  message = "config: ignoring " + "; ".join(f"{', '.join(settings)} (removed: {reason})"
                                           for reason, settings in by_reason.items())
  if message not in _warned:
    _warned.add(message)
    _log.warning(message)
  return out


def _drop(section: Any, prefix: str, notes: list[tuple[str, str]]) -> Any:
  if not isinstance(section, Mapping):
    return section
  out = {}
  for name, value in section.items():
    key = f"{prefix}.{name}"
    if key in REMOVED_KEYS:
      if value is not None:
        notes.append((f"{key}={value!r}", REMOVED_KEYS[key]))
      continue
    new = REMOVED_VALUES.get(key, {}).get(value) if isinstance(value, str) else None
    if new is not None:
      notes.append((f"{key}={value!r}", f"runs as {new!r}, which stores the same scores"))
      value = new
    out[name] = _drop(value, key, notes)
  return out
