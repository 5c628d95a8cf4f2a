"""`AppendFile`: a log file that grows (metrics.jsonl, TensorBoard event files), local or remote.

Object stores cannot append to an object. Remotely the file's whole content is kept in a local
temporary file (the existing object's content first, when opened on one that exists, as a resumed
run does) and uploaded whole, replacing the object, at `flush()` when `flush_secs` have passed
since the last upload and always at `close()`. A reader sees the last upload; a process killed
without closing loses at most `flush_secs` of records. Locally it is an ordinary file in append mode
whose `flush()` hands the bytes to the OS.
"""
from __future__ import annotations

import builtins
import shutil
import tempfile
import time
from typing import Union

from umoe_jax.storage import files

REMOTE_FLUSH_SECS = 10.0


class AppendFile:
  """open(path, "ab") that works on object stores too (module docstring). Takes bytes or str."""

  def __init__(self, path: str, flush_secs: float = REMOTE_FLUSH_SECS):
    self.path = path
    self.remote = files.is_url(path)
    self.flush_secs = flush_secs
    self.closed = False
    if not self.remote:
      files.makedirs(files.dirname(files.abspath(path)))
      self._file = builtins.open(path, "ab")
      return
    self._file = tempfile.NamedTemporaryFile(prefix="umoe-append-", suffix=".part")
    if files.exists(path):
      with files.open(path, "rb") as src:
        shutil.copyfileobj(src, self._file, 8 << 20)
    self._dirty = False
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
