"""Silencing the echoes of Orbax operations abandoned after an error the command already reports.

A failed save (a full disk) or restore (a damaged checkpoint, a changed model) leaves TensorStore
reads and writes running; their failures surface later as unraisable exceptions and asyncio log
records, screenfuls of traceback that add nothing to the one error line. `quiet_orphaned_orbax_work`
drops them (not with UMOE_DEBUG=1); the two predicates say which ones are echoes.

It needs the standard library only (no jax, no orbax).
"""
from __future__ import annotations

import logging as std_logging
import os
import sys


def orphaned_orbax_work(unraisable) -> bool:
  """Whether an unraisable exception is the echo of an Orbax operation abandoned after an error
  that the command reports itself (so it adds nothing but a screenful of traceback):

  * after a failed save or restore, TensorStore completes the other reads / writes of that
    operation and calls back into the asyncio loop Orbax has already closed: 'Event loop is
    closed' (hundreds on a full disk, one per array of a damaged checkpoint);
  * after a failed restore (e.g. the model changed), the reads of the other arrays are coroutines
    that were never awaited; at exit Python finalises them and prints their read errors.
  """
  error, obj = unraisable.exc_value, unraisable.object
  if isinstance(error, RuntimeError) and "Event loop is closed" in str(error):
    return True
  code = getattr(obj, "cr_code", None)
  return code is not None and "/orbax/" in code.co_filename


def orphaned_orbax_record(record: std_logging.LogRecord) -> bool:
  """Whether a log record is asyncio's 'exception was never retrieved' for a future or Task of an
  Orbax operation that failed: a full disk fails every write of a save (the first failure is
  reported by the run, the others are logged when their futures are garbage-collected, in no fixed
  order); after a damaged checkpoint's first read error, TensorStore's other reads fail inside
  Tasks nobody awaits any more (their errors carry a `tensorstore_spec`; whether they are logged
  depends on timing). A write's error may carry no Orbax frame at all (TensorStore sets it on the
  future from its own threads); it names the save's in-progress directory, `*.orbax-checkpoint-tmp`,
  which only Orbax writes."""
  if "/asyncio/" not in record.pathname or not record.exc_info:
    return False
  message = str(record.exc_info[1])
  if "tensorstore_spec" in message or ".orbax-checkpoint-tmp" in message:
    return True
  tb = record.exc_info[2]
  while tb is not None:
    if "/orbax/" in tb.tb_frame.f_code.co_filename:
      return True
    tb = tb.tb_next
  return False


class _QuietOrphanedRecords(std_logging.Filter):
  def filter(self, record: std_logging.LogRecord) -> bool:
    return not orphaned_orbax_record(record)


def quiet_orphaned_orbax_work() -> None:
  """Drops, instead of printing, the unraisable exceptions `orphaned_orbax_work` recognises and the
  asyncio log records `orphaned_orbax_record` recognises, for the rest of the process (the
  commands call it at start-up; not with UMOE_DEBUG=1, or train.py --debug). Idempotent."""
  previous = sys.unraisablehook
  if getattr(previous, "quiets_orbax", False) or os.environ.get("UMOE_DEBUG", "") not in ("", "0"):
    return

  def hook(unraisable):
    if not orphaned_orbax_work(unraisable):
      previous(unraisable)

  hook.quiets_orbax = True
  sys.unraisablehook = hook
  std_logging.getLogger("asyncio").addFilter(_QuietOrphanedRecords())
