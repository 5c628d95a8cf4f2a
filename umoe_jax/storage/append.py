"""`AppendFile`: a log file that grows (metrics.jsonl, TensorBoard event files), local or remote.

Object stores cannot append to an object. Remotely the file's whole content is kept in a local
temporary file (the existing object's content first, when opened on one that exists, as a resumed
run does) and uploaded whole, replacing the object, at `flush()` when `flush_secs` have passed
since the last upload and always at `close()`. A reader sees the last upload; a process killed
without closing loses at most `flush_secs` of records. Locally it is an ordinary file in append mode
whose `flush()` hands the bytes to the OS.

`lines=True` (JSON lines): a last line without its newline (a writer killed mid-line) is an
incomplete record; it is cut off (with a warning) before anything is appended, so that the file
stays whole lines (appending after it would leave a broken line in the middle for every reader).
"""
from __future__ import annotations

import builtins
import shutil
import tempfile
import time
from typing import Union

from absl import logging

from umoe_jax.storage import files

REMOTE_FLUSH_SECS = 10.0


class AppendFile:
  """open(path, "ab") that works on object stores too (module docstring). Takes bytes or str."""

  def __init__(self, path: str, flush_secs: float = REMOTE_FLUSH_SECS, *, lines: bool = False):
    self.path = path
    self.remote = files.is_url(path)
    self.flush_secs = flush_secs
    self.closed = False
    self._dirty = False
    if not self.remote:
      files.makedirs(files.dirname(files.abspath(path)))
      if lines and files.exists(path):
        _cut_partial_line(path, path)
      self._file = builtins.open(path, "ab")
      return
    self._file = tempfile.NamedTemporaryFile(prefix="umoe-append-", suffix=".part")
    if files.exists(path):
      with files.open(path, "rb") as src:
        shutil.copyfileobj(src, self._file, 8 << 20)
      self._file.flush()
      if lines and _cut_partial_line(self._file.name, path):
        self._file.seek(0, 2)
        self._dirty = True  # the next upload replaces the object with the whole lines
    self._uploaded = time.monotonic()

  def write(self, data: Union[bytes, str]) -> int:
    if isinstance(data, str):
      data = data.encode("utf-8")
    self._file.write(data)
    if self.remote:
      self._dirty = True
    return len(data)

  def flush(self, force: bool = False) -> None:
    """Local: to the OS. Remote: uploads if anything changed and `flush_secs` passed (or `force`)."""
    self._file.flush()
    if not self.remote or not self._dirty:
      return
    if force or time.monotonic() - self._uploaded >= self.flush_secs:
      files.upload_file(self._file.name, self.path)
      self._dirty = False
      self._uploaded = time.monotonic()

  def close(self) -> None:
    if self.closed:
      return
    try:
      self.flush(force=True)
    finally:
      self.closed = True
      self._file.close()

  def __enter__(self) -> "AppendFile":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _cut_partial_line(local_path: str, name: str) -> int:
  """Truncates local file `local_path` after its last newline (a last line without one is an
  incomplete record); returns the bytes cut, logged naming `name`."""
  with builtins.open(local_path, "r+b") as f:
    end = f.seek(0, 2)
    pos, block = end, 1 << 16
    while pos > 0:
      start = max(0, pos - block)
      f.seek(start)
      chunk = f.read(pos - start)
      i = chunk.rfind(b"\n")
      if i >= 0:
        keep = start + i + 1
        break
      pos = start
    else:
      keep = 0
    if keep < end:
      f.truncate(keep)
      logging.warning("%s: dropped its last line, cut short (%d bytes; a run killed while writing "
                      "it)", name, end - keep)
    return end - keep
