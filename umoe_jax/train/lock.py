"""One run per workdir: `<workdir>/lock.json`, taken before anything is written, released at exit.

    with lock.hold(workdir, command="train.py", force=False):
      ...  # train

A second run on a workdir in use stops at once with WorkdirBusyError naming the holder (host,
process id, start time, last heartbeat). The lock file holds those as JSON; a thread of the holder
rewrites its `heartbeat` every HEARTBEAT_SECS.

A lock left by a run that was killed (kill -9, a lost VM) is taken over with a warning naming it:
  * local workdir: the holder keeps the file flock()ed; the kernel releases that when its process
    dies, so a file nobody holds is left over. A file still held by a process of this host that is
    gone (an orphaned child holding it) is left over as well.
  * gs://: the holder ran on this host and its process is gone, or its heartbeat is older than
    STALE_SECS. The object is created with a generation precondition (`ifGenerationMatch=0`) and
    taken over, refreshed and deleted only at the generation last seen
    (umoe_jax/storage/conditional.py), so of two runs starting at once exactly one wins.
`force=True` (`--force_unlock`) takes the lock whoever holds it.

With several processes only process 0 takes the lock; the others learn whether it did and stop
with it. If another run takes the lock over while this one still runs, the next save stops this run
(`check`) instead of writing over the other's checkpoints.
"""
from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import socket
import threading
import time
import uuid
from typing import Iterator, Optional

from absl import logging

from umoe_jax import storage
from umoe_jax.storage import conditional
from umoe_jax.train.workdir import WorkdirError, check_workdir

LOCK_FILE = "lock.json"
HEARTBEAT_SECS = 60.0
STALE_SECS = 600.0  # gs://: a holder on another host is gone after this long without a heartbeat
FORCE_HINT = ("wait for that run to end (or stop it); if it is no longer running, pass "
              "--force_unlock")


class WorkdirBusyError(WorkdirError):
  """Another run holds the workdir's lock."""

  hint = FORCE_HINT


def _process_start(pid: int) -> Optional[str]:
  """The start time of process `pid` in clock ticks since boot (/proc), telling a reused process
  id apart; None where /proc is not there."""
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      return f.read().rsplit(b")", 1)[1].split()[19].decode()
  except (OSError, IndexError):
    return None


def _alive(pid: int, start: Optional[str]) -> bool:
  """Whether process `pid` of this host runs (and is the one that started at `start`)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's process
    pass
  now = _process_start(pid)
  return start is None or now is None or now == start


def _utc(t: float) -> str:
  return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def describe(info: dict, now: Optional[float] = None) -> str:
  """'process 123 on host h (train.py), started <time>, last heartbeat N s ago'."""
  if not info:
    return "an unreadable lock file"
  now = time.time() if now is None else now
  text = (f"process {info.get('pid')} on host {info.get('host')!s} ({info.get('command', '?')}), "
          f"started {_utc(float(info.get('started', 0)))}")
  if "heartbeat" in info:
    text += f", last heartbeat {max(0.0, now - float(info['heartbeat'])):.0f} s ago"
  return text


def _parse(data: bytes) -> dict:
  try:
    info = json.loads(data.decode("utf-8"))
  except (UnicodeDecodeError, ValueError):
    return {}
  return info if isinstance(info, dict) else {}


class WorkdirLock:
  """The lock of one workdir, held by this process (`hold` makes and releases it)."""

  def __init__(self, workdir: str, command: str, heartbeat_secs: float = HEARTBEAT_SECS,
               stale_secs: float = STALE_SECS):
    self.workdir = workdir
    self.path = storage.join(workdir, LOCK_FILE)
    self.remote = storage.is_url(workdir)
    self.heartbeat_secs, self.stale_secs = heartbeat_secs, stale_secs
    now = time.time()
    self.info = {"host": socket.gethostname(), "pid": os.getpid(),
                 "process_start": _process_start(os.getpid()), "command": command,
                 "started": round(now, 3), "heartbeat": round(now, 3), "token": uuid.uuid4().hex}
    self.lost: Optional[str] = None      # why this run no longer holds the lock
    self._fd: Optional[int] = None       # local: the flock()ed file
    self._generation: Optional[int] = None  # gs://: the object's generation last written
    self._made = None                    # local: (workdir, its nearest existing ancestor)
    self._stop = threading.Event()
    self._thread: Optional[threading.Thread] = None
    self._mutex = threading.Lock()

  # -- judging a holder ------------------------------------------------------------------------

  def _gone(self, info: dict) -> str:
    """Why the holder `info` is gone ("" if it may still run)."""
    if info.get("host") == self.info["host"] and isinstance(info.get("pid"), int):
      if not _alive(info["pid"], info.get("process_start")):
        return "its process is gone"
      return ""
    if self.remote:
      age = time.time() - float(info.get("heartbeat", 0))
      if age > self.stale_secs:
        return f"no heartbeat for {age:.0f} s (more than {self.stale_secs:.0f} s)"
    return ""

  def _busy(self, info: dict) -> WorkdirBusyError:
    return WorkdirBusyError(f"--workdir={self.workdir!r} is in use by another run: "
                            f"{describe(info)} (lock {self.path})")

  def _take_over(self, info: dict, why: str) -> None:
    logging.warning("%s: taking over the lock of %s: %s", self.workdir, describe(info), why)

  def _data(self) -> bytes:
    return (json.dumps(self.info, sort_keys=True) + "\n").encode()

  # -- acquiring -------------------------------------------------------------------------------

  def acquire(self, force: bool = False) -> None:
    """Takes the lock or raises WorkdirBusyError (module docstring)."""
    if self.remote:
      self._acquire_remote(force)
    else:
      self._acquire_local(force)
    self._thread = threading.Thread(target=self._beat, name="workdir-lock-heartbeat", daemon=True)
    self._thread.start()

  def _acquire_remote(self, force: bool) -> None:
    for _ in range(5):
      try:
        self._generation = conditional.create_new(self.path, self._data())
        return
      except conditional.PreconditionFailed:
        pass
      try:
        data, generation = conditional.read_versioned(self.path)
      except FileNotFoundError:  # released meanwhile: try again
        continue
      info = _parse(data)
      if info.get("token") == self.info["token"]:  # our own create, retried after a lost reply
        self._generation = generation
        return
      why = "--force_unlock" if force else (self._gone(info) if info else "unreadable")
      if not why:
        raise self._busy(info)
      try:
        self._generation = conditional.replace_if(self.path, self._data(), generation)
      except conditional.PreconditionFailed:
        continue  # refreshed or taken by another run meanwhile: judge it again
      self._take_over(info, why)
      return
    raise WorkdirBusyError(f"--workdir={self.workdir!r}: its lock {self.path} changes hands too "
                           "fast to be taken (several runs starting at once?)")

  def _acquire_local(self, force: bool) -> None:
    import fcntl  # (POSIX)
    workdir = os.path.abspath(storage.expand(self.workdir))
    existing = workdir
    while not os.path.isdir(existing):
      existing = os.path.dirname(existing)
    self._made = (workdir, existing) if workdir != existing else None
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, LOCK_FILE)
    for _ in range(5):
      fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
      try:
        try:
          fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
          info = _parse(_read_fd(fd))
          why = "--force_unlock" if force else (self._gone(info) if info else "")
          if not why:
            raise self._busy(info) from None
          self._take_over(info, why)
          _unlink_if_same(path, fd)  # a new file (the holder keeps the old one), locked below
          continue
        except OSError as e:
          if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
          raise WorkdirError(f"--workdir={self.workdir!r}: its file system cannot lock files "
                             f"({e.strerror}), so a second run on it could not be refused") from None
        if not _same_file(path, fd):  # released (unlinked) while we waited: lock the new file
          continue
        old = _parse(_read_fd(fd))
        if old and old.get("token") != self.info["token"]:
          self._take_over(old, "that run ended without releasing it (killed?)")
        _write_fd(fd, self._data())
        self._fd, fd = fd, None
        return
      finally:
        if fd is not None:
          os.close(fd)
    raise WorkdirBusyError(f"--workdir={self.workdir!r}: its lock {path} changes hands too fast "
                           "to be taken (several runs starting at once?)")

  # -- holding ---------------------------------------------------------------------------------

  def refresh(self) -> None:
    """Rewrites the heartbeat; notes in `lost` when another run has taken the lock over."""
    with self._mutex:
      if self.lost is not None or (self._fd is None and self._generation is None):
        return
      self.info["heartbeat"] = round(time.time(), 3)
      if self.remote:
        try:
          self._generation = conditional.replace_if(self.path, self._data(), self._generation)
        except (conditional.PreconditionFailed, FileNotFoundError):
          try:  # a retried write of ours whose first try landed: the object is still this run's
            data, generation = conditional.read_versioned(self.path)
          except FileNotFoundError:
            data, generation = b"", None
          if _parse(data).get("token") == self.info["token"]:
            self._generation = generation
          else:
            self._lost()
      else:
        if not _same_file(self.path, self._fd):
          self._lost()
          return
        _write_fd(self._fd, self._data())

  def _lost(self) -> None:
    try:
      holder = describe(_parse(storage.read_bytes(self.path)))
    except OSError:
      holder = "nobody (the lock file was removed)"
    self.lost = (f"the lock of --workdir={self.workdir!r} was taken over by another run ({holder}); "
                 "this run stops so as not to write over its checkpoints")
    logging.error("%s", self.lost)

  def _beat(self) -> None:
    while not self._stop.wait(self.heartbeat_secs):
      try:
        self.refresh()
      except Exception as e:  # pylint: disable=broad-except  (a network error: try again later)
        logging.warning("%s: refreshing the lock's heartbeat failed (%s)", self.path, e)

  def check(self) -> None:
    """WorkdirError if another run has taken this run's lock over (a save would overwrite its
    checkpoints)."""
    if self.lost is not None:
      error = WorkdirError(self.lost)
      error.hint = "the other run owns the workdir now: give this one another --workdir"
      raise error

  def release(self) -> None:
    """Deletes the lock (if still this run's); a workdir this lock created and nothing else wrote
    to is removed again."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=30)
    with self._mutex:
      try:
        if self.remote and self._generation is not None and self.lost is None:
          try:
            conditional.delete_if(self.path, self._generation)
          except (conditional.PreconditionFailed, FileNotFoundError):
            pass  # taken over meanwhile: the lock is the other run's now
        elif self._fd is not None:
          if _same_file(self.path, self._fd):
            os.unlink(self.path)
          os.close(self._fd)
          if self._made is not None:  # a run that wrote nothing leaves no directory behind
            made, existing = self._made
            with contextlib.suppress(OSError):  # not empty: the run wrote to it
              while made != existing:
                os.rmdir(made)
                made = os.path.dirname(made)
      finally:
        self._fd, self._generation = None, None


def _read_fd(fd: int) -> bytes:
  """The lock file's content; read again when torn (read while its holder rewrote it)."""
  for _ in range(3):
    data = os.pread(fd, 1 << 16, 0)
    if _parse(data):
      break
    time.sleep(0.01)
  return data


def _write_fd(fd: int, data: bytes) -> None:
  """The whole file `fd` becomes `data` (written in place: its length changes little, so a reader
  sees whole JSON nearly always and tolerates a torn read)."""
  os.pwrite(fd, data, 0)
  os.ftruncate(fd, len(data))
  os.fsync(fd)


def _same_file(path: str, fd: int) -> bool:
  try:
    st = os.stat(path)
  except FileNotFoundError:
    return False
  own = os.fstat(fd)
  return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _unlink_if_same(path: str, fd: int) -> None:
  if _same_file(path, fd):
    with contextlib.suppress(FileNotFoundError):
      os.unlink(path)


@contextlib.contextmanager
def hold(workdir: str, *, command: str, force: bool = False,
         heartbeat_secs: float = HEARTBEAT_SECS,
         stale_secs: float = STALE_SECS) -> Iterator[Optional[WorkdirLock]]:
  """The lock of `workdir` for the `with` block (None on processes other than 0). Raises
  WorkdirError for a workdir that cannot hold a run, WorkdirBusyError for one in use."""
  import jax
  check_workdir(workdir)
  lock, error = None, None
  if jax.process_index() == 0:
    lock = WorkdirLock(workdir, command, heartbeat_secs, stale_secs)
    try:
      lock.acquire(force)
    except Exception as e:  # pylint: disable=broad-except  (raised below, after the others learn)
      lock, error = None, e
  if jax.process_count() > 1:
    import numpy as np
    from jax.experimental import multihost_utils
    ok = bool(multihost_utils.broadcast_one_to_all(np.asarray(error is None)))
    if not ok and error is None:
      error = WorkdirError(f"process 0 could not take the lock of --workdir={workdir!r} (its "
                           "log says why); every process stops")
  if error is not None:
    raise error
  try:
    yield lock
  finally:
    if lock is not None:
      lock.release()
