"""Standard output that cannot be written (umoe_jax/stdout_errors.py): a full device is one
`error:` line and status 1, a pipe closed by its reader a quiet status 1; never a traceback.

Real entry points run in subprocesses with stdout on /dev/full or on a pipe whose read end is
closed before they start (as `| head -1` after its first line, without the race); the helper's
own cases (a large write, an error the command catches, an unrelated OSError) run in small
scripts that import no JAX.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FULL = "error: cannot write to standard output: No space left on device"

# Cheap commands covering each way an entry point ends: a printed result after main returns
# (stats), absl's --help inside flag parsing (analysis) and train.py's own flag parser, and a
# plain `main(argv) -> status` (eval).
COMMANDS = {
    "stats": ["-m", "umoe_jax.stats", "--config=configs/dense_tiny.py"],
    "analysis --help": ["-m", "umoe_jax.analysis", "--help"],
    "train.py --help": ["train.py", "--help"],
    "eval --help": ["-m", "umoe_jax.eval", "--help"],
}


@contextlib.contextmanager
def _stdout(kind: str):
  """A file descriptor for a child's stdout: /dev/full, or a pipe nobody reads any more."""
  if kind == "full":
    fd = os.open("/dev/full", os.O_WRONLY)
  else:
    read_end, fd = os.pipe()
    os.close(read_end)
  try:
    yield fd
  finally:
    os.close(fd)


def _run(args, kind: str, timeout: float = 120) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  with _stdout(kind) as fd:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, stdout=fd,
                          stderr=subprocess.PIPE, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def command_runs():
  """{(name, kind): (returncode, stderr)} of every COMMANDS entry on both broken stdouts, run
  concurrently (each starts a Python and imports; together they take about one command's time)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  procs = {}
  for name, args in COMMANDS.items():
    for kind in ("full", "closed pipe"):
      with _stdout(kind) as fd:  # the child holds its own copy
        procs[name, kind] = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env,
                                             stdout=fd, stderr=subprocess.PIPE, text=True)
  runs = {}
  for key, proc in procs.items():
    _, stderr = proc.communicate(timeout=240)
    runs[key] = (proc.returncode, stderr)
  return runs


@pytest.mark.parametrize("name", COMMANDS)
def test_full_stdout_is_one_error_line(command_runs, name):
  returncode, stderr = command_runs[name, "full"]
  assert returncode == 1, stderr[-3000:]
  assert stderr.strip().splitlines() == [FULL], stderr[-3000:]


@pytest.mark.parametrize("name", COMMANDS)
def test_closed_pipe_exits_quietly(command_runs, name):
  returncode, stderr = command_runs[name, "closed pipe"]
  assert returncode == 1, stderr[-3000:]
  assert stderr == "", stderr[-3000:]


def _script(body: str, kind: str) -> subprocess.CompletedProcess:
  """`body` (defining main) run through stdout_errors.run_and_exit, stdout broken as `kind`."""
  code = "import os, sys\nfrom umoe_jax import stdout_errors\n" + textwrap.dedent(body) + (
      "\nstdout_errors.run_and_exit(main)\n")
  return _run(["-c", code], kind, timeout=60)


@pytest.mark.parametrize("kind", ["full", "closed pipe"])
def test_a_write_larger_than_the_buffer(kind):
  """One print of 1 MB goes to the file descriptor at once and, failing, leaves nothing in the
  buffer for the last flush to fail on: still stdout's error."""
  proc = _script("""
      def main():
        print("x" * 1_000_000)
        return 0
      """, kind)
  assert proc.returncode == 1, proc.stderr
  assert proc.stderr.strip().splitlines() == ([FULL] if kind == "full" else []), proc.stderr


def test_a_caught_write_error_is_still_reported():
  """A command catching its print's OSError (as absl's --help does with EPIPE) lost its output."""
  proc = _script("""
      def main():
        try:
          print("x" * 1_000_000)
        except OSError:
          pass
        return 0
      """, "full")
  assert (proc.returncode, proc.stderr.strip().splitlines()) == (1, [FULL]), proc.stderr


def test_other_errors_and_statuses_are_the_commands():
  """An OSError not of stdout keeps its traceback; a status of a command whose output was written
  is its own (stdout on a healthy pipe)."""
  code = ("import sys\nfrom umoe_jax import stdout_errors\n"
          "def main(status):\n  print('result')\n"
          "  if status == 'raise':\n    open('/nonexistent/file')\n  return int(status)\n"
          "stdout_errors.run_and_exit(main, sys.argv[1])\n")
  for status in ("0", "3"):
    proc = subprocess.run([sys.executable, "-c", code, status], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (int(status), "result\n", "")
  proc = subprocess.run([sys.executable, "-c", code, "raise"], cwd=ROOT, capture_output=True,
                        text=True, timeout=60)
  assert proc.returncode == 1 and proc.stdout == "result\n", proc
  assert "Traceback" in proc.stderr and "FileNotFoundError" in proc.stderr, proc.stderr
