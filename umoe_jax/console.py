"""What a command shows on the terminal beside its results: progress bars with an ETA, notes that
do not tear a bar, and JAX's platform probe kept quiet.

    with progress(total=n, desc="arc_easy", unit="request") as bar:
      bar.update(k)
    for row in progress(rows, desc="routing", unit="window"): ...
    note("model: runs/a (step 100)")     # one stderr line, printed above a running bar
    quiet_platform_probe()               # once per command (stdout_errors.run_and_exit calls it)

A bar draws on stderr, and only when stderr is a terminal: a test, a pipe or a CI log sees the same
lines with or without it, and stdout (the results) never holds one. Every command's bar comes from
`progress`, so they all look and behave alike.
"""
from __future__ import annotations

import logging
import sys
from typing import Any, Iterable, Optional, TextIO

from tqdm import tqdm

_PROBE_LOGGER = "jax._src.xla_bridge"


def is_terminal(stream: Any) -> bool:
  """Whether `stream` is an interactive terminal (False for files, pipes, closed or fake streams)."""
  try:
    return bool(stream.isatty())
  except (AttributeError, ValueError, OSError):  # (no isatty, or a closed stream)
    return False


def progress(iterable: Optional[Iterable] = None, *, total: Optional[float] = None,
             desc: str = "", unit: str = "it", unit_scale: bool = False, initial: float = 0,
             show: bool = True, stream: Optional[TextIO] = None) -> tqdm:
  """A tqdm bar on `stream` (default: stderr at the call), off unless it is a terminal (and `show`).

  Off, it still takes every call (`update`, iteration, `set_postfix` do nothing), so callers need
  not test whether it shows; `bar.disable` says it is off (for one that logs lines instead). It
  vanishes when closed: what stays on the terminal is the command's own summary lines.
  `unit_scale` writes large counts as 12.3k (tokens)."""
  stream = sys.stderr if stream is None else stream
  return tqdm(iterable, total=total, desc=desc or None, unit=unit, unit_scale=unit_scale,
              initial=initial, file=stream, disable=not (show and is_terminal(stream)), leave=False,
              dynamic_ncols=True, mininterval=0.5, smoothing=0.1)


def note(message: str, stream: Optional[TextIO] = None) -> None:
  """`message` as a line on `stream` (default stderr) that a running bar is redrawn below, rather
  than being torn in two by it."""
  stream = sys.stderr if stream is None else stream
  tqdm.write(message, file=stream)
  stream.flush()


class _DropBackendProbe(logging.Filter):
  """Drops JAX's INFO line for a platform it only tried ("Unable to initialize backend 'tpu':
  ... libtpu.so ..." on every machine without a TPU). Its WARNINGs stay: a GPU or TPU that is
  present but unusable, and a platform asked for by JAX_PLATFORMS raises instead of logging."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not (record.levelno <= logging.INFO
                and str(record.msg).startswith("Unable to initialize backend"))


def quiet_platform_probe() -> None:
  """Silences the INFO line of JAX's optional-platform probe (see `_DropBackendProbe`); platform
  selection is unchanged. Idempotent."""
  logger = logging.getLogger(_PROBE_LOGGER)
  if not any(isinstance(f, _DropBackendProbe) for f in logger.filters):
    logger.addFilter(_DropBackendProbe())
