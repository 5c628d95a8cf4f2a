"""A command's standard output that cannot be written, as one `error:` line, not a traceback.

Every entry point runs its main function through `run_and_exit`:

    if __name__ == "__main__":
      stdout_errors.run_and_exit(main)                                       # returns a status
      stdout_errors.run_and_exit(app.run, main, flags_parser=flag_errors.parser())   # absl

A full device (`> /dev/full`: ENOSPC) or another write error is "error: cannot write to standard
output: <cause>" on stderr and exit status 1. A pipe closed by its reader (`| head -1`:
BrokenPipeError) ends the command quietly with status 1, as the Python docs recommend (signal.html,
"Note on SIGPIPE"). Output is buffered, so the error often comes only at the last flush: that
flush is `run_and_exit`'s, not the interpreter's at exit (whose error would print as "Exception
ignored ..."), and after an error stdout's file descriptor points at os.devnull, so the
interpreter's flush has nothing left to fail on.

A command that turns every error of a step into its own message (train.py's flag parsing) lets
stdout's errors pass: `is_stdout_error(e)`.

Being every command's start, `run_and_exit` also keeps JAX's platform probe quiet
(`console.quiet_platform_probe`: no "Unable to initialize backend 'tpu'" line without a TPU), and
is every command's one handler of a failing store (umoe_jax/storage): a StorageError (a missing
client library, no credentials, a failed request) or a missing object or bucket escaping `main`,
itself or as the cause of another error, is

    storage error: <what failed, naming the URL>
      hint: <what to install or check>

on stderr and exit status 1, not a traceback (UMOE_DEBUG=1 shows the traceback).
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, NoReturn


class _TrackedStdout:
  """sys.stdout, remembering the OSErrors of its writes and flushes (a write's error may be caught,
  absl's --help ignores EPIPE, or lose its data without leaving any in the buffer: stdout failed
  all the same)."""

  def __init__(self, stream):
    self._stream = stream
    self.errors: list[OSError] = []

  def _call(self, method: str, *args):
    try:
      return getattr(self._stream, method)(*args)
    except OSError as e:
      self.errors.append(e)
      raise

  def caused(self, error: BaseException) -> bool:
    """Whether one of stdout's errors is `error` or in its chain (raise from, or while handling)."""
    while error is not None:
      if any(error is e for e in self.errors):
        return True
      error = error.__cause__ or error.__context__
    return False

  def write(self, text):
    return self._call("write", text)

  def writelines(self, lines):
    return self._call("writelines", lines)

  def flush(self):
    return self._call("flush")

  def __getattr__(self, name: str) -> Any:
    return getattr(self._stream, name)


def is_stdout_error(error: BaseException) -> bool:
  """Whether `error` comes from writing standard output under `run_and_exit` (for a command that
  turns every error of a step into its own message: this one is run_and_exit's to report)."""
  return isinstance(sys.stdout, _TrackedStdout) and sys.stdout.caused(error)


def storage_failure(error: BaseException):
  """The storage layer's StorageError or ObjectNotFoundError that is `error` or caused it (its
  __cause__ / __context__ chain), or None."""
  from umoe_jax.storage.retry import ObjectNotFoundError, StorageError
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, (StorageError, ObjectNotFoundError)):
      return error
    error = error.__cause__ or error.__context__
  return None


def storage_error_lines(error: BaseException) -> list[str]:
  """"storage error: <message>" and its hint line, of a `storage_failure`."""
  hint = getattr(error, "hint", "") or (
      "check the URL: the bucket's name, the object's path, and your access to them"
      if isinstance(error, FileNotFoundError) else "")
  lines = [f"storage error: {' '.join(str(error).split())}"]
  return lines + ([f"  hint: {hint}"] if hint else [])


def _debug() -> bool:
  return os.environ.get("UMOE_DEBUG", "") not in ("", "0")


def _discard_stdout(stream) -> None:
  """Points stdout's file descriptor at os.devnull: what is still buffered goes nowhere."""
  try:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, stream.fileno())
    os.close(devnull)
  except (OSError, ValueError):  # no file descriptor (a test's captured stream)
    pass


def run_and_exit(main: Callable[..., Any], *args: Any, **kwargs: Any) -> NoReturn:
  """sys.exit(main(*args, **kwargs)), with standard output's write errors handled as the module
  docstring says (a SystemExit of `main`, absl.app.run's way to end, keeps its status)."""
  from umoe_jax import console
  console.quiet_platform_probe()  # every command starts here: no "libtpu" line on a CPU machine
  original = sys.stdout
  stdout = sys.stdout = _TrackedStdout(original)
  try:
    try:
      status = main(*args, **kwargs)
    except SystemExit as e:
      status = e.code
    except Exception as e:  # pylint: disable=broad-except  (stdout's error, or one raised from it)
      failure = None if stdout.caused(e) or _debug() else storage_failure(e)
      if failure is not None:
        print("\n".join(storage_error_lines(failure)), file=sys.stderr, flush=True)
      elif not stdout.caused(e):
        raise
      status = 1
    try:
      stdout.flush()
    except OSError:
      pass  # recorded in stdout.errors
  finally:
    sys.stdout = original
  if not stdout.errors:
    raise SystemExit(status)
  _discard_stdout(original)
  error = stdout.errors[0]
  if not isinstance(error, BrokenPipeError):
    cause = error.strerror or str(error)
    print(f"error: cannot write to standard output: {cause}", file=sys.stderr, flush=True)
  raise SystemExit(1)
