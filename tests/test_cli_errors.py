"""`train.py` on bad input, as a user meets it: one subprocess per case (issue 12).

Each case asserts the message (naming the file, step or key), the exit code, that the output ends
with the project's own message (no traceback, no shutdown noise), and that the checkpoints written
before are untouched. A case that would hang fails on a timeout.

Cost: every run trains the same tiny dense model (1 layer, d=32, 4 x 32 byte tokens per step; the
paths under test do not depend on the architecture, tests/test_train.py runs them on UMoE) and the
subprocesses share a persistent compilation cache, so only the first run of each distinct program
(the fixture's, the exploding-LR run's, the skip run's) compiles; the rest start in seconds.
"""
from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import uuid

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 8
CONFIG = "configs/dense_tiny.py"  # what is tested is the command line, not the model: the cheapest
SMALL = [
    "--config.model.n_layers=1", "--config.model.d_model=32", "--config.model.ffn.d_ff=64",
    "--config.model.attention.head_dim=16", "--config.model.attention.v_head_dim=16",
    "--config.model.vocab_size=257", "--config.model.max_seq_len=64",
    "--config.train.global_batch_size=4", "--config.train.seq_len=32",
    f"--config.train.num_steps={STEPS}", "--config.train.eval_every=0",
    "--config.train.log_every=2", "--config.checkpoint.every=2", "--config.checkpoint.keep=4",
]
ONE_BATCH = 4 * 33  # tokens of one batch of SMALL


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory):
  """A directory all pytest-xdist workers of this session share (the session's base temp)."""
  base = tmp_path_factory.getbasetemp()
  shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
  path = shared / "cli_errors_shared"
  path.mkdir(exist_ok=True)
  return path


@contextlib.contextmanager
def exclusive(path):
  """Held by one process at a time (workers build the shared fixture once)."""
  with open(path, "w") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def compile_cache(shared_dir):
  """A persistent compilation cache for the subprocesses (JAX reads a half-written entry as a
  miss, so workers may share it)."""
  path = shared_dir / "jax_cache"
  path.mkdir(exist_ok=True)
  return str(path)


@pytest.fixture(scope="session")
def cli(compile_cache):
  """cli(workdir, *flags, timeout=) -> CompletedProcess of `python train.py` with SMALL."""

  def run(workdir, *args, timeout=240, prefix=(), config=CONFIG, env=None):
    env = dict(env or os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               JAX_COMPILATION_CACHE_DIR=compile_cache,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    env.pop("XLA_FLAGS", None)
    env.pop("UMOE_DEBUG", None)
    cmd = [sys.executable, *prefix, "train.py", f"--config={config}", f"--workdir={workdir}",
           *SMALL, *args]
    try:
      return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=timeout)
    except subprocess.TimeoutExpired as e:
      pytest.fail(f"train.py did not finish in {timeout} s (a hang): {' '.join(args)}\n"
                  f"{(e.stderr or b'')[-3000:]}")

  return run


def assert_fails(proc, code: int, kind: str, *patterns: str) -> str:
  """The run exited with `code` and its output ends with the project's one-line message (+ hint)
  matching `patterns`; no traceback or shutdown noise anywhere. Returns the message line."""
  out = proc.stdout + proc.stderr
  assert proc.returncode == code, out[-3000:]
  lines = [l for l in proc.stderr.splitlines() if l.strip()]
  assert lines[-1] == "  (--debug shows the traceback)", out[-3000:]
  assert lines[-2].startswith("  hint: "), out[-3000:]
  message = lines[-3]
  assert message.startswith(f"{kind}: "), out[-3000:]
  for pattern in patterns:
    assert re.search(pattern, message), (pattern, message)
  for noise in ("Traceback", "Event loop is closed", "sys.meta_path is None", "Exception ignored"):
    assert noise not in out, out[-5000:]
  return message


def tree_digest(path: str) -> str:
  """sha1 over the names and bytes of every file under `path`."""
  h = hashlib.sha1()
  for f in sorted(glob.glob(os.path.join(path, "**"), recursive=True)):
    if os.path.isfile(f):
      h.update(os.path.relpath(f, path).encode())
      with open(f, "rb") as fh:
        h.update(fh.read())
  return h.hexdigest()


def complete_steps(workdir: str) -> list[int]:
  d = os.path.join(workdir, "checkpoints")
  return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


def event_files(workdir: str) -> list[str]:
  return sorted(glob.glob(os.path.join(workdir, "tensorboard", "events.out.tfevents.*")))


def losses(workdir: str) -> dict[int, float]:
  out = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      rec = json.loads(line)
      if "train/loss" in rec:
        out[rec["step"]] = rec["train/loss"]
  return out


@pytest.fixture(scope="session")
def trained(cli, shared_dir):
  """A STEPS-step run from scratch (checkpoints 2, 4, 6, 8), built once per session; the tests
  copy it. (workdir, its stderr)."""
  workdir = str(shared_dir / "trained")
  log = shared_dir / "trained.stderr"
  with exclusive(shared_dir / "trained.lock"):
    if not log.exists():
      shutil.rmtree(workdir, ignore_errors=True)
      proc = cli(workdir)
      assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
      log.write_text(proc.stderr)
  assert complete_steps(workdir) == [2, 4, 6, 8]
  return workdir, log.read_text()


def copy_run(trained, tmp_path, name="run") -> str:
  dst = str(tmp_path / name)
  shutil.copytree(trained[0], dst)
  return dst


# ----------------------------------------------------------------------------------------------
# A good run says what it saved, how long it takes and where everything went.


def test_a_run_reports_checkpoints_progress_and_outputs(trained):
  workdir, err = trained
  for step in (2, 4, 6, 8):
    assert f"checkpoint: saving step {step} to {os.path.join(workdir, 'checkpoints', str(step))}" in err
  progress = [l for l in err.splitlines() if re.search(r"step +\d+/8 \|", l)]
  assert len(progress) == 4 and all(re.search(r"\d:\d\d:\d\d elapsed, ETA \d:\d\d:\d\d$", l)
                                    for l in progress), progress
  assert progress[-1].endswith("ETA 0:00:00")
  tail = err.strip().splitlines()[-4:]
  assert re.search(r"done: step 8 of 8 in \d:\d\d:\d\d$", tail[0]), tail
  assert tail[1].endswith(f"checkpoints: {workdir}/checkpoints (steps 2, 4, 6, 8; running the same "
                          "command again resumes from step 8)")
  assert tail[2].endswith(f"TensorBoard logs: {workdir}/tensorboard (tensorboard --logdir {workdir})")
  assert tail[3].endswith(f"metrics: {workdir}/metrics.jsonl; config: {workdir}/config.json")


# ----------------------------------------------------------------------------------------------
# 1. Too little data fails at start-up, naming the file and what it holds (used to spin forever).


def _write_parquet(path, texts, row_group_size=None):
  import pyarrow as pa
  import pyarrow.parquet as pq
  pq.write_table(pa.table({"text": pa.array(texts, pa.string())}), str(path),
                 row_group_size=row_group_size)
  return str(path)


@pytest.mark.parametrize("files, found", [
    ({"no_rows.parquet": [], "empty_documents.parquet": ["", None, ""]}, "holds 0 documents"),
    ({"short.parquet": ["ten bytes."]}, f"holds 1 non-empty document, 11 tokens with EOS; one "
                                        f"batch needs 4 x 33 = {ONE_BATCH} tokens"),
], ids=["no_documents", "fewer_tokens_than_a_batch"])
def test_too_little_data_fails_fast(cli, tmp_path, files, found):
  data = tmp_path / "data"
  data.mkdir()
  for name, texts in files.items():
    _write_parquet(data / name, texts)
  workdir = str(tmp_path / "run")
  proc = cli(workdir, "--config.data.source=parquet", f"--config.data.train_path={data}",
             timeout=90)
  assert_fails(proc, 1, "data error", re.escape(f"data.train_path='{data}' (parquet) {found}"))
  assert not os.path.exists(workdir)  # nothing written


# ----------------------------------------------------------------------------------------------
# 3. A full disk during a save (items 2 and 3): the step, the cause, the last complete step; a
# restart once there is space resumes from it.


@pytest.fixture
def small_disk(tmp_path):
  """A 1 MiB tmpfs (two checkpoints of SMALL fit) when this is root and mount works; else None
  (the full disk is then simulated: Orbax's save raises ENOSPC)."""
  mnt = str(tmp_path / "disk")
  os.makedirs(mnt)
  mounted = os.geteuid() == 0 and subprocess.run(
      ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", mnt], capture_output=True).returncode == 0
  yield mnt if mounted else None
  if mounted:
    subprocess.run(["umount", "-l", mnt], check=False)


_ENOSPC_AT_STEP_6 = ("import errno, runpy, sys; import orbax.checkpoint as ocp; real = "
                     "ocp.CheckpointManager.save\n"
                     "def save(self, step, *a, **k):\n"
                     "  if step >= 6: raise OSError(errno.ENOSPC, 'No space left on device')\n"
                     "  return real(self, step, *a, **k)\n"
                     "ocp.CheckpointManager.save = save; sys.argv = sys.argv[1:]; "
                     "runpy.run_path('train.py', run_name='__main__')\n")


@pytest.mark.parametrize("async_save", ["true", "false"])
def test_full_disk_names_the_step_and_the_last_checkpoint(cli, tmp_path, small_disk, async_save):
  if small_disk is None:  # simulated: the save of step 6 raises ENOSPC, as a full disk would
    workdir = str(tmp_path / "run")
    proc = cli(workdir, f"--config.checkpoint.async_save={async_save}",
               prefix=("-c", _ENOSPC_AT_STEP_6))
  else:
    workdir = os.path.join(small_disk, "run")
    proc = cli(workdir, f"--config.checkpoint.async_save={async_save}")
  message = assert_fails(proc, 1, "checkpoint save error", r"\(no space left on device\)")
  # Orbax's own error lines (absl's "E1205 12:00:00.000 ...", four per failed save) are not shown:
  # the one line above says it all (--debug shows them).
  assert not re.search(r"^E\d{4} \d\d:\d\d:\d\d", proc.stderr, re.M), proc.stderr[-3000:]
  failed, last = map(int, re.search(r"saving checkpoint step (\d+) to .* failed .*the last complete "
                                    r"checkpoint is step (\d+) \(a restart resumes from it\)",
                                    message).groups())
  assert failed == last + 2 and complete_steps(workdir)[-1] == last >= 2
  assert message.startswith(f"checkpoint save error: saving checkpoint step {failed} to "
                            f"{workdir}/checkpoints failed")
  assert not glob.glob(os.path.join(workdir, "checkpoints", "*.orbax-checkpoint-tmp*"))
  if async_save == "false":
    return
  # Space freed: the same command resumes from the last complete step and finishes.
  before = tree_digest(os.path.join(workdir, "checkpoints", str(last)))
  if small_disk is not None:
    subprocess.run(["mount", "-o", "remount,size=16m", small_disk], check=True)
  proc = cli(workdir)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"resumed from {workdir}/checkpoints step {last}" in proc.stderr
  assert complete_steps(workdir)[-1] == STEPS
  assert tree_digest(os.path.join(workdir, "checkpoints", str(last))) == before


def test_full_disk_under_the_logs_names_the_file(cli, tmp_path):
  # The disk can fill at a metrics write as well as at a save: metrics.jsonl on /dev/full (every
  # write fails with ENOSPC, as on a full disk) was a bare OSError traceback, three times over.
  workdir = tmp_path / "run"
  workdir.mkdir()
  os.symlink("/dev/full", workdir / "metrics.jsonl")
  proc = cli(str(workdir), "--config.checkpoint.every=1")
  message = assert_fails(proc, 1, "workdir error")
  assert message == (f"workdir error: writing {workdir}/metrics.jsonl failed (No space left on "
                     "device)"), message
  assert "run the same command again" in proc.stderr
  assert "Traceback" not in proc.stderr
  # The first metrics write is the run's session mark, before any step: it fails fast, nothing saved.
  assert complete_steps(str(workdir)) == []


# ----------------------------------------------------------------------------------------------
# 4. Damaged data: the file and the line / row group, also from a reader thread; or skipped.


def _damage_row_groups(path, keep=2):
  """Overwrites the page headers of every row group after the first `keep`."""
  import pyarrow.parquet as pq
  meta = pq.ParquetFile(path).metadata
  data = bytearray(open(path, "rb").read())
  for rg in range(keep, meta.num_row_groups):
    start = meta.row_group(rg).column(0).data_page_offset
    data[start:start + 64] = b"\xab" * 64
  open(path, "wb").write(bytes(data))


@pytest.fixture(scope="module")
def damaged_parquet(tmp_path_factory):
  """24 row groups of 5 documents (~300 tokens each); all but the first two damaged."""
  path = str(tmp_path_factory.mktemp("data") / "damaged.parquet")
  _write_parquet(path, [f"document {i} " * 5 for i in range(120)], row_group_size=5)
  _damage_row_groups(path)
  return path


def test_bad_json_line_is_named(cli, tmp_path):
  lines = [json.dumps({"text": f"line {i} " * 20}) for i in range(300)]
  lines[150] = '{"text": "unterminated'
  data = tmp_path / "train.jsonl"
  data.write_text("\n".join(lines) + "\n")
  proc = cli(str(tmp_path / "run"), "--config.data.source=jsonl",
             f"--config.data.train_path={data}", timeout=90)
  assert_fails(proc, 1, "data error", re.escape(f"{data}:151: not valid JSON"),
               re.escape("b'{\"text\": \"unterminated\\n'"))
  assert not os.path.exists(tmp_path / "run")


def test_truncated_parquet_footer_is_named(cli, tmp_path):
  data = _write_parquet(tmp_path / "train.parquet", ["some text " * 50] * 20)
  with open(data, "r+b") as f:
    f.truncate(os.path.getsize(data) - 10)
  proc = cli(str(tmp_path / "run"), "--config.data.source=parquet",
             f"--config.data.train_path={data}", timeout=90)
  assert_fails(proc, 1, "data error", re.escape(f"parquet file '{data}' cannot be opened"),
               "Parquet magic bytes not found")


def test_damaged_row_group_in_a_reader_thread_is_named(cli, tmp_path, damaged_parquet):
  proc = cli(str(tmp_path / "run"), "--config.data.source=parquet",
             f"--config.data.train_path={damaged_parquet}", "--config.data.shuffle_window=16")
  assert_fails(proc, 1, "data error",
               re.escape(f"parquet file '{damaged_parquet}': row group ") + r"([2-9]|1\d|2[0-3]) "
               r"cannot be read \(OSError")


def test_bad_records_can_be_skipped_and_are_logged(cli, tmp_path, damaged_parquet):
  workdir = str(tmp_path / "run")
  # (A small shuffle window: the default one would cycle the 10 good documents 1000 times to fill.)
  proc = cli(workdir, "--config.data.source=parquet", f"--config.data.train_path={damaged_parquet}",
             "--config.data.on_bad_record=skip", "--config.data.shuffle_window=16",
             "--config.checkpoint.every=8")
  assert proc.returncode == 0, proc.stderr[-3000:]
  skipped = re.findall(r"skipping bad data \(data.on_bad_record='skip'; bad records so far: (\d+)\): "
                       + re.escape(f"parquet file '{damaged_parquet}': row group ") + r"(\d+) ",
                       proc.stderr)
  # Each damaged row group is logged once, with a running count; only damaged ones are dropped.
  assert skipped and [int(n) for n, _ in skipped] == list(range(1, len(skipped) + 1))
  assert len({rg for _, rg in skipped}) == len(skipped) and all(int(rg) >= 2 for _, rg in skipped)
  assert complete_steps(workdir) == [STEPS]


# ----------------------------------------------------------------------------------------------
# 5 and 8. Every user error is one line and a non-zero exit, found before anything is written.


@pytest.mark.parametrize("case", ["workdir_is_a_file", "workdir_not_writable", "impossible_mesh",
                                  "unknown_override", "init_from_empty_directory",
                                  "config_does_not_load", "positional_argument"])
def test_user_errors_are_one_line_and_write_nothing(cli, tmp_path, case):
  workdir = str(tmp_path / "run")
  if case == "workdir_is_a_file":
    open(workdir, "w").close()
    proc = cli(workdir, timeout=90)
    assert_fails(proc, 1, "workdir error", re.escape(f"--workdir='{workdir}' is a file"))
    return
  if case == "workdir_not_writable":  # sysfs refuses new entries, even to root
    workdir = f"/sys/umoe-test-{uuid.uuid4().hex[:8]}"
    proc = cli(workdir, timeout=90)
    assert_fails(proc, 1, "workdir error", re.escape(f"--workdir='{workdir}' cannot be created in "
                                                     "'/sys'"))
  elif case == "impossible_mesh":
    proc = cli(workdir, "--config.mesh.data=3", timeout=90)
    assert_fails(proc, 1, "config error", r"mesh \{'data': 3, .*has 3 devices but 1 are available")
  elif case == "unknown_override":
    proc = cli(workdir, "--config.train.stepz=5", timeout=90)
    message = assert_fails(proc, 2, "config error", r"unknown key train\.stepz \(in "
                           r"--config\.train\.stepz\); valid keys of train: .*\bnum_steps\b")
    assert "AttributeError" not in message
    debug = cli(workdir, "--config.train.stepz=5", "--debug", timeout=90)  # the traceback, on demand
    assert debug.returncode != 0 and "Traceback (most recent call last)" in debug.stderr
  elif case == "positional_argument":  # a boolean flag's value after a space: absl printed --help
    proc = cli(workdir, "--config.data.shuffle", "false", timeout=90)
    assert_fails(proc, 2, "command-line error", re.escape("unexpected argument(s) ['false']: every "
                                                          "flag takes its value as --name=value"))
  elif case == "config_does_not_load":  # with an override: it used to report an _ErrorConfig
    bad = tmp_path / "bad_config.py"
    bad.write_text("def get_config():\n  raise ValueError('no such scale: huge')\n")
    proc = cli(workdir, "--config.train.num_steps=3", timeout=90, config=str(bad))
    assert_fails(proc, 2, "config error", re.escape(f"--config={bad} does not load (ValueError at "
                                                    "line 2: no such scale: huge)") + "$")
  else:
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = cli(workdir, f"--config.checkpoint.init_from={empty}", timeout=90)
    assert_fails(proc, 1, "config error", re.escape(f"checkpoint.init_from='{empty}' holds neither "
                                                    "params/"))
  assert not os.path.exists(workdir)


def test_failed_resume_is_one_line_and_changes_nothing(cli, trained, tmp_path):
  workdir = copy_run(trained, tmp_path)
  before = tree_digest(workdir)
  proc = cli(workdir, "--config.model.d_model=48")
  assert_fails(proc, 1, "checkpoint error",
               re.escape(f"checkpoint step 8 in {workdir}/checkpoints does not fit this config: "
                         "params/embed is (257, 32) on disk, (257, 48) here; "),
               re.escape(f"A run resumes with the model and optimizer config it was started with "
                         f"({workdir}/config.json)"))
  assert tree_digest(workdir) == before  # no event file, config.json, metrics, checkpoints


def test_nothing_to_do_writes_nothing(cli, trained, tmp_path):
  workdir = copy_run(trained, tmp_path)
  before = tree_digest(workdir)
  proc = cli(workdir)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"nothing to do: {workdir} is already at step 8 of train.num_steps=8" in proc.stderr
  assert tree_digest(workdir) == before and len(event_files(workdir)) == 1


# ----------------------------------------------------------------------------------------------
# 7. Divergence: a wrecked state is not saved, the last good one is named; skipped steps stop.


def test_exploding_learning_rate_is_not_checkpointed(cli, trained, tmp_path):
  workdir = copy_run(trained, tmp_path)
  for step in (6, 8):
    shutil.rmtree(os.path.join(workdir, "checkpoints", str(step)))
  good = {s: tree_digest(os.path.join(workdir, "checkpoints", str(s))) for s in (2, 4)}
  proc = cli(workdir, "--config.train.learning_rate=50")  # from step 4 on
  assert_fails(proc, 1, "training stopped",
               r"the state at step 8 failed the pre-save check \(the parameter norm grew to .*x its "
               r"[\d.]+ at step 4, the checkpoint this run resumed from",
               re.escape(f"the last good checkpoint is step 4 in {workdir}/checkpoints"))
  assert re.search(r"not saving checkpoint step 6: the parameter norm grew to .*; step 4, the last "
                   r"checkpoint that passed, is kept out of rotation", proc.stderr)
  assert complete_steps(workdir) == [2, 4]
  assert {s: tree_digest(os.path.join(workdir, "checkpoints", str(s))) for s in (2, 4)} == good
  # With the learning rate back, the same workdir resumes from step 4 and trains as before.
  proc = cli(workdir)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert all(losses(workdir)[s] == losses(trained[0])[s] for s in (6, 8))


def _poison_params(workdir: str, step: int) -> None:
  """Rewrites checkpoint `step` with NaN parameters (every later loss is NaN)."""
  import jax
  import orbax.checkpoint as ocp
  state_dir = os.path.join(workdir, "checkpoints", str(step), "state")
  tree = ocp.StandardCheckpointer().restore(state_dir)
  tree["params"] = jax.tree.map(lambda x: x * np.nan, tree["params"])
  shutil.rmtree(state_dir)
  writer = ocp.StandardCheckpointer()
  writer.save(state_dir, tree)
  writer.wait_until_finished()


@pytest.mark.parametrize("limit, expected", [
    (0, r"none of the 4 steps of this run \(9 to 12\) was applied: every loss or gradient was "
        r"non-finite"),
    (2, r"3 consecutive steps \(9 to 11\) had a non-finite loss or gradient and were skipped "
        r"\(train.max_consecutive_skips=2\)"),
])
def test_skipped_steps_stop_the_run(cli, trained, tmp_path, limit, expected):
  workdir = copy_run(trained, tmp_path)
  _poison_params(workdir, STEPS)
  before = tree_digest(os.path.join(workdir, "checkpoints"))
  proc = cli(workdir, "--config.train.on_nonfinite=skip", "--config.train.num_steps=12",
             f"--config.train.max_consecutive_skips={limit}")
  # Names where to resume from, as train.on_nonfinite='stop' does.
  assert_fails(proc, 1, "training stopped", expected, re.escape(
      f"; the last good checkpoint is step {STEPS} in {workdir}/checkpoints: resume from it"))
  assert tree_digest(os.path.join(workdir, "checkpoints")) == before  # no NaN state saved


def test_restore_step_resumes_from_a_chosen_step(cli, trained, tmp_path):
  workdir = copy_run(trained, tmp_path)
  four = tree_digest(os.path.join(workdir, "checkpoints", "4"))
  proc = cli(workdir, "--config.checkpoint.restore_step=4")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert ("resuming from checkpoint step 4 (checkpoint.restore_step): the newer checkpoints [6, 8] "
          f"were moved to {workdir}/checkpoints_abandoned") in proc.stderr
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints_abandoned")))[0].startswith("6-")
  assert complete_steps(workdir) == [2, 4, 6, 8]
  assert tree_digest(os.path.join(workdir, "checkpoints", "4")) == four
  # Steps 5..8 again from step 4's state and data position: the same losses as the first time.
  assert [losses(workdir)[s] for s in (6, 8)] == [losses(trained[0])[s] for s in (6, 8)]
  # The same command again continues the new branch instead of going back to step 4.
  proc = cli(workdir, "--config.checkpoint.restore_step=4")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "checkpoint.restore_step=4 was applied by an earlier run" in proc.stderr
  assert "nothing to do" in proc.stderr and complete_steps(workdir) == [2, 4, 6, 8]


# ----------------------------------------------------------------------------------------------
# 9. Another process count: state exact, data from the beginning of the new stream (documented).


def test_resume_on_another_process_count_restarts_the_data(cli, trained, tmp_path):
  workdir = copy_run(trained, tmp_path)
  shutil.rmtree(os.path.join(workdir, "checkpoints", "8"))
  data_dir = os.path.join(workdir, "checkpoints", "6", "data")
  saved = os.path.join(data_dir, "process_0-of-1.json")
  for i in range(2):  # as if two processes had written step 6
    shutil.copy(saved, os.path.join(data_dir, f"process_{i}-of-2.json"))
  os.remove(saved)
  proc = cli(workdir)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert ("checkpoint 6 holds the data position of 2 process(es), this run has 1: parameters, "
          "optimizer state and step restore exactly, but the data iterator restarts from the "
          "beginning of this run's stream") in proc.stderr
  # Step 7 trains step 6's parameters on the stream's first batch: not on the batch the 1-process
  # run saw at step 7, so step 8's logged loss differs from the straight run's.
  assert complete_steps(workdir)[-1] == STEPS
  assert losses(workdir)[8] != losses(trained[0])[8]


def small_config():
  """The experiment config of SMALL, in process."""
  import ast
  import configs.common
  config = configs.common.experiment("dense", "tiny")
  for flag in SMALL:
    key, value = flag[len("--config."):].split("=", 1)
    *parents, leaf = key.split(".")
    node = config
    for name in parents:
      node = node[name]
    node[leaf] = ast.literal_eval(value)
  return config


def test_restored_iterator_of_another_process_count_yields_the_first_batch(trained, tmp_path):
  """What the warning above says, batch by batch: restoring a checkpoint of 2 processes gives the
  saved parameters and step, and a data iterator that yields what a fresh one yields."""
  import jax
  import orbax.checkpoint as ocp
  from umoe_jax import config as model_config_lib
  from umoe_jax import data as data_lib
  from umoe_jax.parallel import mesh as mesh_lib, sharding
  from umoe_jax.train import checkpoint as ckpt_lib, loop, state as state_lib
  workdir = copy_run(trained, tmp_path)
  data_dir = os.path.join(workdir, "checkpoints", "8", "data")
  for i in range(2):
    shutil.copy(os.path.join(data_dir, "process_0-of-1.json"),
                os.path.join(data_dir, f"process_{i}-of-2.json"))
  os.remove(os.path.join(data_dir, "process_0-of-1.json"))
  cfg = small_config()
  mesh, rules = mesh_lib.make_mesh(cfg.mesh), sharding.normalize_rules(cfg.sharding_rules)
  progs = loop.config_programs(cfg, model_config_lib.model_config(cfg.model), mesh, rules)
  target = state_lib.checkpoint_tree(state_lib.with_shardings(progs.abstract, progs.shardings))
  make = lambda: data_lib.make_train_iterator(cfg.data, seq_len=32, global_batch_size=4, seed=0)
  restored, fresh = make(), make()
  with ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), keep=4) as ckpt:
    state, step = ckpt.restore(target, restored)
  assert step == 8 and int(state["step"]) == 8
  saved = ocp.StandardCheckpointer().restore(os.path.join(workdir, "checkpoints", "8", "state"))
  for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(saved["params"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for _ in range(3):
    np.testing.assert_array_equal(next(restored)["inputs"], next(fresh)["inputs"])
  restored.close()
  fresh.close()


# ----------------------------------------------------------------------------------------------
# 6. generate / eval's loader and the converter name the directory or file and what it lacks.


def test_load_model_names_the_directory_and_what_it_lacks(tmp_path):
  from umoe_jax.load import LoadError, load_model
  missing = str(tmp_path / "missing")
  with pytest.raises(LoadError, match=re.escape(f"checkpoint '{missing}': no such directory")):
    load_model(missing)
  (tmp_path / "a_file").write_text("x")
  with pytest.raises(LoadError, match=re.escape(f"checkpoint '{tmp_path}/a_file' is a file; pass "
                                                "the directory")):
    load_model(str(tmp_path / "a_file"))
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(LoadError, match=re.escape(f"checkpoint '{empty}' holds no parameters: "
                                                "expected params/")):
    load_model(str(empty))
  (empty / "params").mkdir()
  with pytest.raises(LoadError, match=re.escape(f"'{empty}' has no config.json")):
    load_model(str(empty))
  (empty / "config.json").write_text("{oops")
  with pytest.raises(LoadError, match=re.escape(f"{empty}/config.json is not valid JSON")):
    load_model(str(empty))
  # Cut short: its last line (json says "line 3 column 1", after the file's last line end).
  (empty / "config.json").write_text('{"model": {"d_model": 32},\n "train": {\n')
  with pytest.raises(LoadError, match=re.escape(
      f"{empty}/config.json is not valid JSON (Expecting property name enclosed in double quotes: "
      "line 2 column 12 (char 38))")):
    load_model(str(empty))


def test_random_init_seed_outside_int64_is_one_error_line(tmp_path):
  # The init seed of generate / eval without a checkpoint: an OverflowError traceback before.
  import configs.common
  from umoe_jax.load import LoadError, load_model
  with pytest.raises(LoadError, match=re.escape("--seed=100000000000000000000 is outside the int64 "
                                                "range [-2**63, 2**63)")):
    load_model(None, configs.common.experiment("umoe", "tiny"), seed=10**20)
  (tmp_path / "c.txt").write_text("hello world\n")
  res = subprocess.run([sys.executable, "-m", "umoe_jax.eval", "perplexity",
                        "--config=configs/umoe_tiny.py", f"--data={tmp_path / 'c.txt'}",
                        f"--seed={10**20}"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
  assert res.stderr.strip().splitlines()[-1] == (
      "error: --seed=100000000000000000000 is outside the int64 range [-2**63, 2**63)")


@pytest.mark.parametrize("case", ["config_not_json", "file_not_directory", "ours_not_official"])
def test_converter_names_the_file_and_the_problem(tmp_path, capsys, case):
  from umoe_jax.interop import official
  ckpt = tmp_path / "official"
  ckpt.mkdir()
  (ckpt / "model.safetensors").write_bytes(os.urandom(64))
  if case == "config_not_json":
    (ckpt / "config.json").write_text('{"model_type": "PremixMoe_v2",\n  oops}')
    arg, expected = str(ckpt), f"error: {ckpt}/config.json is not valid JSON (line 2, column 3: "
  elif case == "ours_not_official":  # a training workdir of this library (its config.json)
    (ckpt / "config.json").write_text(json.dumps({"model": {"d_model": 32}, "train": {}}))
    arg, expected = str(ckpt), (f"error: {ckpt}/config.json is this library's config (a training "
                                "workdir or a converted checkpoint")
  else:
    arg = str(ckpt / "model.safetensors")
    expected = f"error: {arg} is a file; pass the official checkpoint directory"
  # The converter's command line, in process: its exit status and what it prints.
  assert official.main([f"--checkpoint={arg}", f"--output={tmp_path / 'out'}"]) == 2
  err = capsys.readouterr().err
  assert err.strip().splitlines()[-1].startswith(expected), err
  assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("output", ["a_file", "a_file/converted"])
def test_converter_refuses_an_output_it_cannot_write_before_converting(tmp_path, capsys, monkeypatch,
                                                                       output):
  """An --output that is (or lies under) a file: one line naming it, before the weights are read
  (the conversion ran first, then failed with a bare "[Errno 17] File exists")."""
  from umoe_jax.interop import official
  (tmp_path / "a_file").write_text("x")
  converted = []
  monkeypatch.setattr(official, "import_official", lambda *a, **k: converted.append(a))
  fixture = os.path.join(ROOT, "tests", "data", "official", "umoe")
  assert official.main([f"--checkpoint={fixture}", f"--output={tmp_path / output}"]) == 2
  assert capsys.readouterr().err.strip() == (f"error: --output='{tmp_path / output}': "
                                             f"'{tmp_path / 'a_file'}' is a file, not a directory")
  assert not converted


# ----------------------------------------------------------------------------------------------
# Pieces the cases rely on, without a subprocess.


def test_config_files_that_do_not_load_are_named(tmp_path, capsys):
  """Every command's --config: a missing file, a syntax error, get_config() missing, raising or not
  a function is one ConfigError naming the file (config_flags gave tracebacks, or an IOError at
  first use)."""
  from umoe_jax.config import files as config_file
  from umoe_jax.config import ConfigError
  from umoe_jax.eval import cli as eval_cli
  files = {"syntax.py": "def get_config(:\n", "raises.py": "def get_config(arg):\n  raise "
           "RuntimeError('boom')\n", "typo.py": "def get_config(arg):\n  raise ValueError('bad "
           "scale')\n", "none.py": "x = 1\n", "deep.py": "from configs import common\n\n\ndef "
           "get_config(arg):\n  return common.experiment('umoe', 'huge')\n",
           "no_return.py": "def get_config(arg):\n  arg = 1\n",
           "not_callable.py": "get_config = 5\n"}
  for name, text in files.items():
    (tmp_path / name).write_text(text)
  cases = {"missing.py": ": no such file", "syntax.py": " does not load (SyntaxError at line 1: "
           "invalid syntax)", "raises.py": " does not load (RuntimeError at line 2: boom)",
           "typo.py": " does not load (ValueError at line 2: bad scale)", "none.py": " defines no "
           "get_config() (a config file is Python whose get_config() returns its ConfigDict)",
           # raised in configs/common.py: the line of the config file that called it
           "deep.py": " does not load (ValueError at line 5: unknown scale 'huge'; valid: tiny, "
           "base, large)", "no_return.py": " does not load: its get_config() returned None, not a "
           "ConfigDict (a missing return?)", "not_callable.py": ": its get_config is 5 (an int), "
           "not a function"}
  for name, message in cases.items():
    path = str(tmp_path / name)
    with pytest.raises(ConfigError, match=re.escape(f"--config={path}{message}") + "$"):
      config_file.check_argv(["prog", "--config", f"{path}:arg"])
  good = config_file.load("configs/dense_tiny.py")
  assert good.model.attention.kind == "mha" and not good.is_locked
  config_file.check_argv(["prog", "--checkpoint=x"])  # no --config: nothing to check
  # Overrides of keys the config lacks (config_flags: a bare AttributeError traceback).
  tiny = ["prog", "--config=configs/dense_tiny.py", "--config.train.num_steps=3"]
  config_file.check_argv(tiny + ["--noconfig.data.shuffle"])
  for arg, message in (("--config.train.stepz=1", "unknown key train.stepz (in --config.train."
                        "stepz); valid keys of train: b1, b2, compilation_cache_dir, eps, "),
                       ("--config.trian.steps=1", "unknown config key 'trian' (in --config.trian."
                        "steps); valid top-level keys: checkpoint, data, expert_parallel, log, "),
                       ("--config.model.d_model.x=1", "model.d_model is a value (=128), not a "
                        "section: no key model.d_model.x")):
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
      config_file.check_argv(tiny + [arg])
  # The evaluation command: one error line, exit status 2, before any model is built.
  missing = str(tmp_path / "missing.py")
  assert eval_cli.main(["perplexity", f"--config={missing}", "--data=x.txt"]) == 2
  err = capsys.readouterr().err
  assert err.strip() == f"error: --config={missing}: no such file", err
  assert eval_cli.main(["perplexity", "--config=configs/dense_tiny.py", "--config.model.bogus=1",
                        "--data=x.txt"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: unknown key model.bogus (in --config.model.bogus)"), err


def test_config_that_is_a_directory_is_named_with_its_config_files(tmp_path):
  """--config=<a directory>: said to be a directory (it was "no such file"), with the .py files in
  it that define a get_config (not a helper such as configs/common.py, nor a subdirectory)."""
  from umoe_jax.config import files as config_file
  from umoe_jax.config import ConfigError
  (tmp_path / "b_tiny.py").write_text("def get_config():\n  return {}\n")
  (tmp_path / "a_base.py").write_text("def get_config(arg):\n  return {}\n")
  (tmp_path / "helpers.py").write_text("# no config here: get_config is elsewhere\n")
  (tmp_path / "sub.py").mkdir()
  with pytest.raises(ConfigError, match=re.escape(f"--config={tmp_path} is a directory, not a "
                                                  "config file; its config files: a_base.py, "
                                                  "b_tiny.py") + "$"):
    config_file.load(str(tmp_path))
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(ConfigError, match=re.escape(
      f"--config={empty} is a directory, not a config file; it holds no .py file with a "
      "get_config()")):
    config_file.check_argv(["prog", f"--config={empty}"])
  with pytest.raises(ConfigError, match="its config files: dense_base.py, dense_large.py, "):
    config_file.load("configs")  # (common.py mentions get_config but defines none)


@pytest.mark.parametrize("returns, described", [
    ("5", "5 (an int)"), ("[1, 2]", "[1, 2] (a list)"), ("'umoe'", "'umoe' (a str)"),
    ("None", "None")])
def test_config_whose_get_config_returns_no_config_dict_is_named(tmp_path, returns, described):
  """get_config() returning an int, a list, ...: one error naming the file and the value (it was
  "AttributeError: 'int' object has no attribute 'keys'"); a dict is taken, as config_flags does."""
  from umoe_jax.config import files as config_file
  from umoe_jax.config import ConfigError
  path = tmp_path / "returns.py"
  path.write_text(f"def get_config():\n  return {returns}\n")
  missing_return = " (a missing return?)" if returns == "None" else ""
  with pytest.raises(ConfigError, match=re.escape(
      f"--config={path} does not load: its get_config() returned {described}, not a ConfigDict"
      f"{missing_return}") + "$"):
    config_file.load(str(path))
  path.write_text("def get_config():\n  return {'a': 1}\n")
  assert config_file.load(str(path)) == {"a": 1}


def test_config_arguments_that_get_config_cannot_take_are_named(tmp_path):
  """big_vision's --config=FILE:arg passes "arg" to get_config: an argument get_config() does not
  take, or a missing one of get_config(arg), is one error naming the file and the fix (it was a
  TypeError from inside the call); an argument it takes reaches it."""
  from umoe_jax.config import files as config_file
  from umoe_jax.config import ConfigError
  with pytest.raises(ConfigError, match=re.escape(
      "--config=configs/dense_tiny.py:base passes 'base' to get_config(), but the get_config() of "
      "configs/dense_tiny.py takes no argument: drop ':base'") + "$"):
    config_file.load("configs/dense_tiny.py:base")
  scaled = tmp_path / "scaled.py"
  scaled.write_text("from configs import common\n\n\ndef get_config(scale):\n"
                    "  return common.experiment('dense', scale)\n")
  with pytest.raises(ConfigError, match=re.escape(
      f"--config={scaled}: its get_config() needs an argument: pass it as --config={scaled}:ARG "
      "(big_vision style)") + "$"):
    config_file.load(str(scaled))
  assert config_file.load(f"{scaled}:tiny").model.d_model == 128
  assert config_file.load(f"{scaled}:base").model.d_model == 768
  defaulted = tmp_path / "defaulted.py"
  defaulted.write_text("def get_config(arg='x'):\n  return {'arg': arg}\n")
  assert config_file.load(str(defaulted)) == {"arg": "x"}
  assert config_file.load(f"{defaulted}:y") == {"arg": "y"}


def test_config_flag_that_is_empty_or_not_python_is_named(tmp_path):
  """--config= (empty) names no file (config_flags: an IOError traceback at first use of the
  config); a file that is not .py and does not load says so (a YAML config, say)."""
  from umoe_jax.config import files as config_file
  from umoe_jax.config import ConfigError
  for argv in (["prog", "--config="], ["prog", "--config", ""]):
    with pytest.raises(ConfigError, match=re.escape("--config= names no file") + "$"):
      config_file.check_argv(argv)
  yaml = tmp_path / "model.yaml"
  yaml.write_text("model: 1\n")  # (valid Python: an annotation)
  with pytest.raises(ConfigError, match=re.escape(f"--config={yaml} defines no get_config() ") +
                     ".*" + re.escape("; it is not a .py file: --config takes configs/*.py") + "$"):
    config_file.load(str(yaml))
  yaml.write_text("model:\n  d_model: 128\n")
  with pytest.raises(ConfigError, match=re.escape(
      f"--config={yaml} does not load (SyntaxError at line 1: invalid syntax); it is not a .py "
      "file:")):
    config_file.load(str(yaml))


@pytest.mark.parametrize("override, message", [
    ("train.num_steps=1.5", "train.num_steps takes an int (it is 300 in configs/umoe_tiny.py), not "
     "'1.5'"),
    ("train.learning_rate=fast", "train.learning_rate takes a float (it is 0.002 in "
     "configs/umoe_tiny.py), not 'fast'"),
    ("data.shuffle=maybe", "data.shuffle takes a bool (it is True in configs/umoe_tiny.py), not "
     "'maybe'"),
    ("model.attention.q_lora_rank=x", "model.attention.q_lora_rank takes an int or None (it is 8 "
     "in configs/umoe_tiny.py), not 'x'"),
    ("model=3", "model is a section, not a value: set its keys (--config.model.KEY=value)")])
def test_config_override_of_the_wrong_type_names_the_key_and_its_type(override, message):
  """--config.<key>=<value> that does not parse as the key's type: the key, its type and its value
  in the file (config_flags: "invalid literal for int() with base 10: '1.5'", or "`3` is not a
  dict" for a section)."""
  from umoe_jax.config import files as config_file
  from umoe_jax.config import ConfigError
  with pytest.raises(ConfigError, match=re.escape(f"--config.{override}: {message}") + "$"):
    config_file.check_argv(["prog", "--config=configs/umoe_tiny.py", f"--config.{override}"])


def test_config_overrides_of_the_right_type_pass_the_check():
  from umoe_jax.config import files as config_file
  config_file.check_argv(["prog", "--config=configs/umoe_tiny.py", "--config.train.num_steps=5",
                          "--config.train.learning_rate=1e-3", "--config.train.learning_rate=3",
                          "--config.data.shuffle=false", "--config.data.shuffle",
                          "--noconfig.data.shuffle", "--config.model.attention.q_lora_rank=None",
                          "--config.model.attention.q_lora_rank=4", "--config.log={'every': 2}",
                          "--config.data.source=parquet"])


def test_protected_step_survives_rotation(tmp_path):
  import jax.numpy as jnp
  from umoe_jax.train import checkpoint as ckpt_lib
  directory = str(tmp_path / "checkpoints")
  with ckpt_lib.Checkpointer(directory, keep=1, async_save=False) as ckpt:
    assert not os.path.exists(directory)  # nothing before the first save
    for step in (1, 2, 3, 4):
      ckpt.save(step, {"x": jnp.full((3,), float(step))}, metadata={"step": step})
      if step == 2:
        ckpt.protect(2)
    assert ckpt.steps() == [2, 4]
    assert ckpt_lib.step_metadata(directory, 2) == {"step": 2}
    ckpt.protect(None)
    ckpt.save(5, {"x": jnp.zeros(3)})
    assert ckpt.steps() == [5]
  assert ckpt_lib.step_metadata(directory, 5) == {}


def test_save_guard_judges_norm_growth_and_loss_spikes():
  from umoe_jax.train import guard
  g = guard.SaveGuard(max_loss_ratio=3.0, max_param_norm_ratio=4.0)  # from scratch
  losses = 2 + 0.1 * np.random.default_rng(0).standard_normal(20)
  for step in range(1, 21):  # losses around 2; the norm of fresh weights may grow (no reference)
    g.observe(step, {"loss": losses[step - 1], "applied": 1, "param_norm": 3.0 * step})
  assert g.check() is None
  g.commit(passed=True)  # saved at step 20: norm reference 60
  g.observe(21, {"loss": np.nan, "applied": 0, "param_norm": 60.0})  # skipped: state unchanged
  assert g.check() is None
  g.observe(22, {"loss": 7.0, "applied": 1, "param_norm": 60.0})
  median = float(np.median(losses))
  assert g.check() == (f"the mean loss of the last step is 7, {7 / median:.3g}x the median "
                       f"{median:.4g} of the steps before (checkpoint.max_loss_ratio=3)")
  g.commit(passed=False)
  g.observe(23, {"loss": 2.0, "applied": 1, "param_norm": 245.0})
  assert g.check() == ("the parameter norm grew to 245, 4.08x its 60 at step 20, the last "
                       "checkpoint that passed (checkpoint.max_param_norm_ratio=4)")
  g.observe(24, {"loss": 2.0, "applied": 1, "param_norm": float("inf")})
  assert g.check() == "the parameter norm is inf"
  # A resumed run: the references saved with its checkpoint.
  g = guard.SaveGuard(max_loss_ratio=3.0, max_param_norm_ratio=4.0,
                      reference={"param_norm": 10.0, "step": 4, "loss_median": 2.0})
  g.observe(5, {"loss": 7.0, "applied": 1, "param_norm": 11.0})
  assert g.check().startswith("the mean loss of the last step is 7, 3.5x the median 2 ")
  g.observe(6, {"loss": 2.0, "applied": 1, "param_norm": 41.0})
  assert "41, 4.1x its 10 at step 4, the checkpoint this run resumed from" in g.check()
  # Trained weights without saved references (init_from): judged against the first step.
  g = guard.SaveGuard(max_loss_ratio=0, max_param_norm_ratio=4.0, trained_start=True)
  g.observe(1, {"loss": 2.0, "applied": 1, "param_norm": 10.0})
  g.observe(2, {"loss": 90.0, "applied": 1, "param_norm": 39.0})
  assert g.check() is None  # loss check disabled, 3.9x
  g.observe(3, {"loss": 2.0, "applied": 1, "param_norm": 41.0})
  assert "its 10 after step 1, the first of this run" in g.check()
  assert guard.SaveGuard(max_loss_ratio=0, max_param_norm_ratio=0).check() is None


_ORPHAN_FILTER_CHECK = """
import asyncio, logging, sys
sys.argv = ["train.py"]
import train

def failed_write(filename):  # an exception raised inside code that lives at `filename`
  code = compile("def write():\\n  raise ValueError('RESOURCE_EXHAUSTED: No space left on device')",
                 filename, "exec")
  scope = {}
  exec(code, scope)
  try:
    scope["write"]()
  except ValueError as e:
    return e

def record(error, pathname):
  return logging.LogRecord("asyncio", logging.ERROR, pathname, 1771,
                           "_GatheringFuture exception was never retrieved", None,
                           (type(error), error, error.__traceback__))

loop_file = asyncio.base_events.__file__
orbax_error = failed_write("/site-packages/orbax/checkpoint/_src/serialization/serialization.py")
user_error = failed_write("/home/me/my_callback.py")
quiet, debug = train._QuietLibraries(debug=False), train._QuietLibraries(debug=True)
print(quiet.filter(record(orbax_error, loop_file)), quiet.filter(record(user_error, loop_file)),
      debug.filter(record(orbax_error, loop_file)))
"""


def test_orphaned_orbax_futures_are_not_printed():
  """After a failed async save, asyncio logs 'exception was never retrieved' for each of the save's
  other writes when their futures are collected (in CI this landed after the run's message): such a
  record is dropped when its exception comes from Orbax, kept for any other code and under --debug."""
  proc = subprocess.run([sys.executable, "-c", _ORPHAN_FILTER_CHECK], cwd=ROOT, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.split() == ["False", "True", "True"]


_ORBAX_ERROR_LINE_CHECK = """
import logging, sys
sys.argv = ["train.py"]
import train

def record(pathname, level=logging.ERROR):
  return logging.LogRecord("absl", level, pathname, 264, "Failed to run 3 Handler Commit operations",
                           None, None)

orbax = "/site-packages/orbax/checkpoint/_src/checkpointers/async_checkpointer.py"
quiet, debug = train._QuietLibraries(debug=False), train._QuietLibraries(debug=True)
print(quiet.filter(record(orbax)), quiet.filter(record(orbax, logging.WARNING)),
      quiet.filter(record("/home/me/x.py")), debug.filter(record(orbax)))
"""


def test_orbax_error_lines_are_dropped_but_kept_under_debug():
  """Orbax's own error lines (a failed save: four, from its threads) are dropped before the run's
  one error line; its warnings, other code's errors and --debug keep theirs."""
  proc = subprocess.run([sys.executable, "-c", _ORBAX_ERROR_LINE_CHECK], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.split() == ["False", "True", "True", "True"]


_TASK_FILTER_CHECK = """
import asyncio, logging
from umoe_jax.train import checkpoint

def failed_task(message):  # an exception raised inside asyncio's own code, as a TensorStore read's
  code = compile(f"def read():\\n  raise ValueError({message!r})", asyncio.tasks.__file__, "exec")
  scope = {}
  exec(code, scope)
  try:
    scope["read"]()
  except ValueError as e:
    return logging.LogRecord("asyncio", logging.ERROR, asyncio.base_events.__file__, 1, "Task "
                             "exception was never retrieved", None, (type(e), e, e.__traceback__))

store = failed_task("OUT_OF_RANGE: Error reading byte range [tensorstore_spec='{}']")
other = failed_task("my callback failed")
# A full disk: a save's write, failed on TensorStore's side (no Orbax frame), naming Orbax's
# in-progress directory (seen once in a clean-clone suite run after the one error line).
write = failed_task('RESOURCE_EXHAUSTED: Error writing "params.w/0" in OCDBT database at local file '
                    '"/run/checkpoints/6.orbax-checkpoint-tmp/state.orbax-checkpoint-tmp/": '
                    'No space left on device')
print(checkpoint.orphaned_orbax_record(store), checkpoint.orphaned_orbax_record(other),
      checkpoint.orphaned_orbax_record(write))
seen = []
handler = logging.Handler()
handler.emit = seen.append
logging.getLogger("asyncio").addHandler(handler)
checkpoint.quiet_orphaned_orbax_work()
for record in (store, other, write):
  logging.getLogger("asyncio").handle(record)
print(len(seen), seen[0].exc_info[1] if seen else None)
"""


def test_orphaned_tensorstore_tasks_are_not_printed():
  """A damaged checkpoint: after the loader's first read error, TensorStore's other reads fail in
  asyncio Tasks nobody awaits, and asyncio may log 'Task exception was never retrieved' for each
  (CI saw it once in test_damaged_checkpoint_is_one_error_line): the commands' quiet hook drops
  those records on the asyncio logger and keeps any other Task's error."""
  proc = subprocess.run([sys.executable, "-c", _TASK_FILTER_CHECK], cwd=ROOT, capture_output=True,
                        text=True, timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu", UMOE_DEBUG=""))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.split("\n")[:2] == ["True False True", "1 my callback failed"], proc.stdout


def test_every_command_help_lists_its_flags():
  """`--help` of each entry point names its options (the routing analysis and stats printed a
  docstring and no flag: absl lists only the flags of the program's own file)."""
  commands = {
      ("train.py",): ("--config", "--workdir"),
      ("-m", "umoe_jax.eval", "perplexity"): ("--checkpoint", "--context", "--stride"),
      ("-m", "umoe_jax.analysis", "routing"): ("--checkpoints", "--tokens", "--plots"),
      ("-m", "umoe_jax.stats"): ("--config", "--zoo"),
      ("-m", "umoe_jax.generate"): ("--checkpoint", "--prompt"),
      ("-m", "umoe_jax.finetune"): ("--config", "--workdir", "--input"),
      ("-m", "umoe_jax.data.prepare"): ("--source", "--output_dir"),
      ("-m", "umoe_jax.interop.official"): ("--checkpoint", "--output"),
  }
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  procs = {cmd: subprocess.Popen([sys.executable, *cmd, "--help"], cwd=ROOT, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for cmd in commands}
  for cmd, proc in procs.items():
    out, _ = proc.communicate(timeout=120)
    assert "Traceback" not in out, (cmd, out[-2000:])
    # absl's flag lines ("  --name: ...", "  --[no]name: ...") and argparse's ("  --name NAME")
    listed = {f"--{name}" for name in re.findall(r"^\s+--(?:\[no\])?([a-z_]+)\b", out, re.M)}
    assert set(commands[cmd]) <= listed, (cmd, sorted(listed), out[-2000:])


ENTRY_POINTS = ("train.py", "umoe_jax.eval", "umoe_jax.eval.harness", "umoe_jax.analysis",
                "umoe_jax.generate", "umoe_jax.stats", "umoe_jax.plot", "umoe_jax.finetune",
                "umoe_jax.finetune.linux_docs", "umoe_jax.data.prepare", "umoe_jax.interop.official")


@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
def test_help_exits_0_and_prints_usage(entry_point):
  """`--help` prints the usage (the command line it documents) and exits 0: absl's help flags exit
  1, which the absl commands (train.py, analysis, generate, stats, finetune, linux_docs) passed
  on."""
  command = [entry_point] if entry_point.endswith(".py") else ["-m", entry_point]
  usage = f"python {entry_point}" if entry_point.endswith(".py") else f"python -m {entry_point}"
  proc = subprocess.run([sys.executable, *command, "--help"], cwd=ROOT, capture_output=True,
                        text=True, timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
  assert usage in proc.stdout and "Traceback" not in proc.stderr, (proc.stdout[-2000:],
                                                                  proc.stderr[-2000:])


def test_every_command_reports_bad_flags_and_inputs_in_one_error_line(tmp_path):
  """A flag absl cannot parse (an unknown name, a value of the wrong type, a config override of the
  wrong type) was absl's "FATAL Flags parsing error" and a second line; the fine-tuning command
  printed each of its errors twice (a log line and the error line); the linux-docs set builder
  showed a traceback for an output it cannot write or a corpus that is not parquet. Each is one
  `error:` line now, with the command's usual exit status."""
  not_parquet = tmp_path / "corpus.parquet"
  not_parquet.write_text("not parquet\n")
  a_file = str(not_parquet)
  cases = {
      ("-m", "umoe_jax.stats", "--config=configs/dense_tiny.py", "--config.model.n_layers=abc"):
          (1, "error: --config.model.n_layers=abc: model.n_layers takes an int (it is 4 in "
              "configs/dense_tiny.py), not 'abc'"),
      ("-m", "umoe_jax.analysis", "routing", "--checkpoints=x", "--tokens=abc"):
          (1, "error: flag --tokens=abc: invalid literal for int() with base 10: 'abc'"),
      ("-m", "umoe_jax.generate", "--prompt=x", "--max_new_tokenz=3"):
          (1, "error: Unknown command line flag 'max_new_tokenz'. Did you mean: max_new_tokens ?"),
      ("-m", "umoe_jax.finetune", "--workdirr=x"):
          (2, "error: Unknown command line flag 'workdirr'. Did you mean: workdir ?"),
      ("-m", "umoe_jax.finetune", "predict", f"--checkpoint={tmp_path / 'none'}", "--input=x.csv",
       "--output=y.csv"):
          (2, f"error: checkpoint '{tmp_path / 'none'}': no such directory"),
      ("-m", "umoe_jax.finetune.linux_docs", f"--output={tmp_path / 'out'}", "--per_class=1"):
          (1, "error: --per_class=1 must be >= 2 (a train and a test document per class)"),
      ("-m", "umoe_jax.finetune.linux_docs", f"--corpus={a_file}", f"--output={a_file}/set"):
          (1, f"error: --output='{a_file}/set': '{a_file}' is a file, not a directory"),
      ("-m", "umoe_jax.finetune.linux_docs", f"--corpus={a_file}", f"--output={tmp_path / 'out'}"):
          (1, f"error: linux-docs corpus '{a_file}': cannot read its text, id and url columns as "
              "parquet (ArrowInvalid: "),
  }
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  procs = {cmd: subprocess.Popen([sys.executable, *cmd], cwd=ROOT, env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
           for cmd in cases}
  for cmd, proc in procs.items():
    _, err = proc.communicate(timeout=120)
    code, message = cases[cmd]
    # absl's INFO / WARNING lines of start-up (JAX's backends) are not part of the report
    lines = [l for l in err.strip().split("\n") if not re.match(r"[IW]\d{4} ", l)]
    assert proc.returncode == code, (cmd, err[-2000:])
    assert len(lines) == 1 and lines[0].startswith(message), (cmd, err[-2000:])
