"""One run per workdir (umoe_jax/train/lock.py, issue 47): a second run is refused naming the first,
a killed run's lock is taken over, --force_unlock takes a live one, and on gs:// (tests/fake_gcs.py)
of runs starting together exactly one wins.

The train.py cases run real processes with the tiny model and compilation cache of
tests/test_cli_errors.py; the first run is held at its step-4 checkpoint until the test lets it go.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest

from fake_gcs import fake_gcs  # noqa: F401  (the fixture)
from test_cli_errors import cli, compile_cache, shared_dir  # noqa: F401  (fixtures)
from test_cli_errors import CONFIG, ROOT, SMALL, STEPS, assert_fails, complete_steps, tree_digest

from umoe_jax.storage import conditional
from umoe_jax.train import lock

HOST = socket.gethostname()

# train.py, held after its step-4 checkpoint is complete until $UMOE_TEST_GO exists.
_HELD_AT_STEP_4 = (
    "import os, runpy, sys, time\n"
    "from umoe_jax.train import loop\n"
    "real = loop.Trainer.save\n"
    "def save(self):\n"
    "  ok = real(self)\n"
    "  if self.step == 4:\n"
    "    self.s.checkpointer.wait()\n"
    "    open(os.environ['UMOE_TEST_READY'], 'w').close()\n"
    "    while not os.path.exists(os.environ['UMOE_TEST_GO']):\n"
    "      time.sleep(0.05)\n"
    "  return ok\n"
    "loop.Trainer.save = save\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path('train.py', run_name='__main__')\n")


def _held_run(workdir: str, tmp_path, compile_cache) -> tuple[subprocess.Popen, str]:
  """train.py on `workdir` in the background, returned once it holds checkpoint 4 (and the lock);
  (the process, the file whose creation lets it go on)."""
  ready, go = str(tmp_path / "ready"), str(tmp_path / "go")
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
             JAX_COMPILATION_CACHE_DIR=compile_cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0", UMOE_TEST_READY=ready, UMOE_TEST_GO=go)
  env.pop("XLA_FLAGS", None)
  env.pop("UMOE_DEBUG", None)
  proc = subprocess.Popen([sys.executable, "-c", _HELD_AT_STEP_4, "train.py", f"--config={CONFIG}",
                           f"--workdir={workdir}", *SMALL], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 240
  while not os.path.exists(ready):
    if proc.poll() is not None or time.monotonic() > deadline:
      proc.kill()
      pytest.fail(f"the first run did not reach step 4:\n{proc.communicate()[1][-3000:]}")
    time.sleep(0.1)
  return proc, go


def _steps_logged(workdir: str) -> list[int]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line)["step"] for line in f if "train/loss" in line]


def _holder(workdir: str) -> dict:
  with open(os.path.join(workdir, lock.LOCK_FILE)) as f:
    return json.load(f)


def test_a_second_run_is_refused_and_the_first_is_untouched(cli, compile_cache, tmp_path):
  workdir = str(tmp_path / "run")
  first, go = _held_run(workdir, tmp_path, compile_cache)
  try:
    before = tree_digest(workdir)
    with open(os.path.join(workdir, "config.json")) as f:
      config_before = f.read()
    start = time.monotonic()
    second = cli(workdir, "--config.train.learning_rate=0.01", timeout=120)
    message = assert_fails(second, 1, "workdir error",
                           re.escape(f"--workdir='{workdir}' is in use by another run: process "
                                     f"{first.pid} on host {HOST} (train.py), started "),
                           r"started \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC, last heartbeat \d+ s ago")
    assert "--force_unlock" in second.stderr.splitlines()[-2]  # the hint
    assert time.monotonic() - start < 60, "refused only after the setup"
    assert "initialised" not in second.stderr and "resumed" not in second.stderr, message
    assert tree_digest(workdir) == before  # checkpoints, config.json, metrics, events, lock
    assert _holder(workdir)["pid"] == first.pid
  finally:
    open(go, "w").close()
  out, err = first.communicate(timeout=240)
  assert first.returncode == 0, err[-3000:]
  assert complete_steps(workdir) == [2, 4, 6, 8]
  assert _steps_logged(workdir) == list(range(2, STEPS + 1, 2))  # each step once
  with open(os.path.join(workdir, "config.json")) as f:
    assert f.read() == config_before  # not the second run's learning rate
  assert not os.path.exists(os.path.join(workdir, lock.LOCK_FILE))  # released at exit


def test_a_killed_runs_lock_is_taken_over(cli, compile_cache, tmp_path):
  workdir = str(tmp_path / "run")
  first, _ = _held_run(workdir, tmp_path, compile_cache)
  first.kill()  # SIGKILL: no cleanup, the lock file stays
  first.communicate(timeout=60)
  assert _holder(workdir)["pid"] == first.pid
  second = cli(workdir)
  assert second.returncode == 0, second.stderr[-3000:]
  assert re.search(re.escape(f"{workdir}: taking over the lock of process {first.pid} on host "
                             f"{HOST} (train.py), started ") + r".*: that run ended without "
                   r"releasing it \(killed\?\)", second.stderr), second.stderr[-3000:]
  assert f"resumed from {workdir}/checkpoints step 4" in second.stderr
  assert complete_steps(workdir)[-1] == STEPS
  assert not os.path.exists(os.path.join(workdir, lock.LOCK_FILE))


def test_force_unlock_takes_a_live_runs_lock_and_that_run_stops(cli, tmp_path):
  workdir = str(tmp_path / "run")
  with lock.hold(workdir, command="holder", heartbeat_secs=3600) as held:
    refused = cli(workdir, timeout=120)
    assert_fails(refused, 1, "workdir error", re.escape(f"process {os.getpid()} on host {HOST} "
                                                        "(holder)"))
    forced = cli(workdir, "--force_unlock")
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert re.search(re.escape(f"taking over the lock of process {os.getpid()} on host {HOST} "
                               "(holder)") + r".*: --force_unlock", forced.stderr), forced.stderr
    assert complete_steps(workdir)[-1] == STEPS
    # The run whose lock was taken notices at its next heartbeat and refuses to save.
    held.refresh()
    assert held.lost and "was taken over by another run" in held.lost
    with pytest.raises(lock.WorkdirError, match="taken over by another run"):
      held.check()
  assert os.path.isdir(os.path.join(workdir, "checkpoints"))  # its release removed nothing


# ----------------------------------------------------------------------------------------------
# The lock itself, in this process.


def test_local_lock_heartbeat_release_and_directories(tmp_path):
  existing = tmp_path / "empty_parent"
  existing.mkdir()
  workdir = str(existing / "a" / "run")
  with lock.hold(workdir, command="t", heartbeat_secs=0.05) as held:
    first = _holder(workdir)
    assert (first["host"], first["pid"], first["command"]) == (HOST, os.getpid(), "t")
    time.sleep(0.3)
    assert _holder(workdir)["heartbeat"] > first["heartbeat"]  # the thread rewrites it
    with pytest.raises(lock.WorkdirBusyError, match=r"is in use by another run: process "
                       rf"{os.getpid()} on host {re.escape(HOST)} \(t\)"):
      lock.WorkdirLock(workdir, "u").acquire()
    assert held.lost is None
  # A run that wrote nothing leaves no directory behind, but never removes one it did not make.
  assert not os.path.exists(existing / "a") and existing.is_dir()
  with lock.hold(workdir, command="t"):
    open(os.path.join(workdir, "x"), "w").close()
  assert sorted(os.listdir(workdir)) == ["x"]


def test_local_lock_held_by_a_leftover_of_a_gone_process_is_taken_over(tmp_path, caplog):
  """The flock held (by a process that outlived the run, e.g. a child that inherited the file)
  while the run named in the file is gone: taken over, with a warning; alive: refused."""
  import fcntl
  workdir = tmp_path / "run"
  workdir.mkdir()
  path = workdir / lock.LOCK_FILE
  for pid, taken in ((os.getpid(), False), (_dead_pid(), True)):
    path.write_text(json.dumps({"host": HOST, "pid": pid, "command": "old", "started": 0.0,
                                "heartbeat": time.time(), "token": "old"}))
    with open(path) as leftover:
      fcntl.flock(leftover, fcntl.LOCK_EX | fcntl.LOCK_NB)
      held = lock.WorkdirLock(str(workdir), "new")
      if not taken:
        with pytest.raises(lock.WorkdirBusyError, match=rf"process {pid} on host"):
          held.acquire()
        continue
      held.acquire()
      try:
        assert f"taking over the lock of process {pid} on host {HOST} (old)" in caplog.text
        assert "its process is gone" in caplog.text
        assert _holder(str(workdir))["token"] == held.info["token"]
      finally:
        held.release()
  assert not path.exists()


def test_only_process_zero_takes_the_lock(tmp_path, monkeypatch):
  import jax
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  workdir = str(tmp_path / "run")
  with lock.hold(workdir, command="t") as held:
    assert held is None and not os.path.exists(workdir)


@pytest.fixture
def gs_workdir(fake_gcs):
  url = fake_gcs.new_url("runs/locked")
  return url, fake_gcs.local(f"{url}/{lock.LOCK_FILE}")


def _race(url: str, n: int = 8) -> list:
  """`n` threads acquiring the lock of `url` at once; each one's WorkdirLock or error."""
  barrier, out = threading.Barrier(n), [None] * n

  def one(i):
    held = lock.WorkdirLock(url, f"racer{i}")
    barrier.wait()
    try:
      held.acquire()
      out[i] = held
    except lock.WorkdirBusyError as e:
      out[i] = e

  threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  return out


def test_gs_lock_race_has_one_winner(gs_workdir):
  url, local = gs_workdir
  results = _race(url)
  winners = [r for r in results if isinstance(r, lock.WorkdirLock)]
  assert len(winners) == 1, results
  assert all("is in use by another run" in str(r) for r in results if r not in winners)
  with open(local) as f:
    assert json.load(f)["token"] == winners[0].info["token"]
  winners[0].release()
  assert not os.path.exists(local)


def _write_lock(local: str, **info) -> None:
  base = {"host": HOST, "pid": os.getpid(), "command": "old", "started": time.time() - 3600,
          "heartbeat": time.time(), "token": "old"}
  os.makedirs(os.path.dirname(local), exist_ok=True)
  with open(local, "w") as f:
    json.dump(dict(base, **info), f)


def _dead_pid() -> int:
  proc = subprocess.Popen([sys.executable, "-c", "pass"])
  proc.wait()
  return proc.pid


@pytest.mark.parametrize("holder, taken", [
    (dict(host="elsewhere", heartbeat=time.time() + 10**6), False),  # another host, beating
    (dict(host="elsewhere", heartbeat=0.0), True),                  # another host, silent
    (dict(pid="dead"), True),                                      # this host, process gone
    (dict(heartbeat=0.0), False),                                  # this host, process alive
])
def test_gs_stale_lock_is_taken_over_with_a_warning(gs_workdir, holder, taken, caplog):
  url, local = gs_workdir
  holder = dict(holder, heartbeat=min(holder.get("heartbeat", time.time()), time.time()))
  if holder.get("pid") == "dead":
    holder["pid"] = _dead_pid()
  _write_lock(local, **holder)
  held = lock.WorkdirLock(url, "new", stale_secs=600)
  if not taken:
    with pytest.raises(lock.WorkdirBusyError, match="is in use by another run"):
      held.acquire()
    return
  held.acquire()
  try:
    assert re.search(r"taking over the lock of process .* \(old\).*: (its process is gone|no "
                     r"heartbeat for \d+ s)", caplog.text), caplog.text
    with open(local) as f:
      assert json.load(f)["token"] == held.info["token"]
  finally:
    held.release()


def test_gs_refresh_and_release_respect_a_takeover(gs_workdir):
  url, local = gs_workdir
  first = lock.WorkdirLock(url, "first", heartbeat_secs=3600)
  first.acquire()
  second = lock.WorkdirLock(url, "second")
  second.acquire(force=True)
  first.refresh()
  assert first.lost and "(second)" in first.lost
  first.release()  # not the holder any more: the object stays the second run's
  with open(local) as f:
    assert json.load(f)["token"] == second.info["token"]
  second.release()
  assert not os.path.exists(local)


@pytest.mark.extras("google.cloud.storage")
def test_gs_conditional_writes_through_google_cloud_storage(fake_gcs, monkeypatch):
  """The storage layer's own client (not the tests' HTTP stand-in) against the fake server's
  preconditions: create once, replace and delete only at the generation read."""
  monkeypatch.setitem(conditional.BACKENDS, "gs", conditional.GCSObjects())
  url = fake_gcs.new_url("conditional") + "/lock.json"
  generation = conditional.create_new(url, b"one")
  with pytest.raises(conditional.PreconditionFailed, match="exists already"):
    conditional.create_new(url, b"two")
  assert conditional.read_versioned(url) == (b"one", generation)
  newer = conditional.replace_if(url, b"three", generation)
  with pytest.raises(conditional.PreconditionFailed):
    conditional.replace_if(url, b"four", generation)
  with pytest.raises(conditional.PreconditionFailed):
    conditional.delete_if(url, generation)
  assert conditional.read_versioned(url) == (b"three", newer)
  conditional.delete_if(url, newer)
  with pytest.raises(FileNotFoundError):
    conditional.read_versioned(url)
  results = _race(fake_gcs.new_url("runs/raced"))
  winners = [r for r in results if isinstance(r, lock.WorkdirLock)]
  assert len(winners) == 1, results
  winners[0].release()


def test_gs_heartbeat_whose_reply_was_lost_keeps_the_lock(gs_workdir, monkeypatch):
  """A heartbeat write that landed but whose reply was lost is retried and fails its precondition
  (the generation is its own now): the run still holds the lock, it did not lose it."""
  url, local = gs_workdir
  monkeypatch.setenv("UMOE_STORAGE_RETRY_DELAY", "0.01")
  real = conditional.BACKENDS["gs"]

  class ReplyLost:
    def __getattr__(self, name):
      return getattr(real, name)

    def replace(self, *args):
      monkeypatch.setitem(conditional.BACKENDS, "gs", real)  # once
      real.replace(*args)
      raise ConnectionResetError(104, "Connection reset by peer")

  held = lock.WorkdirLock(url, "t", heartbeat_secs=3600)
  held.acquire()
  monkeypatch.setitem(conditional.BACKENDS, "gs", ReplyLost())
  held.refresh()
  assert held.lost is None
  held.refresh()  # at the generation it adopted
  assert held.lost is None
  held.release()
  assert not os.path.exists(local)
