"""The path layer (umoe_jax/storage) and the data sources on a remote store (issue 19).

Remote = gs:// served offline by tests/fake_gcs.py (a local directory behind fsspec and a GCS JSON
API server for the C++ clients). Checked against independent references: the same files read
locally with pyarrow / json / array_record, byte counts of what was read, hand-built exceptions.
The training runs on gs:// are in tests/test_storage_run.py.
"""
from __future__ import annotations

import json
import logging
import os
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fake_gcs import FakeGCSFileSystem, fake_gcs  # noqa: F401  (the fixture)
from umoe_jax import data as data_lib
from umoe_jax import storage
from umoe_jax.data import prepare as prepare_lib
from umoe_jax.data import sources
from umoe_jax.storage import retry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
  monkeypatch.setenv("UMOE_STORAGE_RETRY_DELAY", "0.01")
  FakeGCSFileSystem.faults.clear()
  yield
  FakeGCSFileSystem.faults.clear()


def no_scheme_directories(*dirs):
  """No local directory named after the scheme ("gs:"), nor epath's "/gs" root, was created."""
  for d in (*dirs, ROOT, os.getcwd(), "/"):
    assert not os.path.exists(os.path.join(d, "gs:")), d
  assert not os.path.exists("/gs")


def test_url_paths_keep_their_scheme():
  url = "gs://bucket/runs/a/"
  assert storage.is_url(url) and not storage.is_url("/tmp/a") and not storage.is_url("C:/x")
  assert storage.expand(url) == storage.abspath(url) == storage.normpath(url) == "gs://bucket/runs/a"
  assert storage.join("gs://bucket/runs", "a", "b.json") == "gs://bucket/runs/a/b.json"
  assert storage.dirname("gs://bucket/runs/a") == "gs://bucket/runs"
  assert storage.basename("gs://bucket/runs/a/") == "a"
  assert storage.bucket_url("gs://bucket/runs/a") == "gs://bucket"
  assert storage.bucket_url("hf://datasets/x/y") == storage.bucket_url("/tmp/x") == ""
  assert storage.abspath("~/x") == os.path.join(os.path.expanduser("~"), "x")


def test_remote_files_round_trip_atomically(fake_gcs, tmp_path):
  base = fake_gcs.new_url("files")
  storage.makedirs(base)  # object stores: nothing to make, and nothing made
  assert not storage.exists(base)
  storage.write_text(f"{base}/a/config.json", '{"x": 1}\n')
  storage.write_bytes(f"{base}/a/b/blob.bin", bytes(range(256)))
  storage.write_text(f"{base}/a/.hidden/x.txt", "hidden")
  storage.write_text(f"{base}/a/.dot.txt", "hidden")
  with open(fake_gcs.local(f"{base}/a/config.json")) as f:  # the object itself
    assert f.read() == '{"x": 1}\n'
  assert storage.read_bytes(f"{base}/a/b/blob.bin") == bytes(range(256))
  assert storage.size(f"{base}/a/b/blob.bin") == 256
  assert storage.isdir(f"{base}/a") and storage.isfile(f"{base}/a/config.json")
  assert storage.listdir(f"{base}/a") == [".dot.txt", ".hidden", "b", "config.json"]
  assert storage.find_files(f"{base}/a") == [f"{base}/a/b/blob.bin", f"{base}/a/config.json"]
  assert storage.find_files(f"{base}/a", (".json",)) == [f"{base}/a/config.json"]
  assert storage.glob(f"{base}/*/*.json") == [f"{base}/a/config.json"]
  assert storage.glob(f"{base}/a/*", files_only=True) == [f"{base}/a/config.json"]
  with storage.open(f"{base}/a/config.json") as f:
    assert json.load(f) == {"x": 1}
  with pytest.raises(ValueError, match="object stores cannot append"):
    storage.open(f"{base}/a/config.json", "a")
  storage.move(f"{base}/a/b", f"{base}/moved/b")
  assert not storage.exists(f"{base}/a/b") and storage.read_bytes(f"{base}/moved/b/blob.bin")
  storage.rmtree(f"{base}/moved")
  assert not storage.exists(f"{base}/moved")
  local = tmp_path / "local.json"
  storage.write_text(str(local), "x")  # locally: a temporary sibling renamed over it
  assert local.read_text() == "x" and os.listdir(tmp_path) == ["local.json"]
  no_scheme_directories(tmp_path)


def test_failed_local_write_keeps_the_old_file(tmp_path, monkeypatch):
  """A local write that fails after its temporary file is written (the rename fails) or while it
  is written (the fsync fails) leaves the old content whole and no temporary file behind; the
  rename it attempts moves a complete copy of the new content."""
  from umoe_jax.storage import files
  rng = np.random.default_rng(11)
  old, new = rng.bytes(3000), rng.bytes(5000)
  target = tmp_path / "out" / "state.bin"
  source = tmp_path / "source.bin"
  source.write_bytes(new)
  real_replace = os.replace
  renamed = []

  def failing_replace(src, dst):
    if os.path.abspath(dst) != str(target):
      return real_replace(src, dst)
    # The temporary sibling is complete when it is renamed, and it is not the target itself.
    assert os.path.abspath(src) != str(target)
    with open(src, "rb") as f:
      renamed.append(f.read())
    raise OSError(28, "No space left on device")

  def failing_fsync(fd):
    raise OSError(5, "Input/output error")

  writes = [lambda: storage.write_bytes(str(target), new),
            lambda: storage.write_text(str(target), new.hex()),
            lambda: storage.upload_file(str(source), str(target))]
  for write in writes:
    target.parent.mkdir(exist_ok=True)
    target.write_bytes(old)
    with monkeypatch.context() as m:
      m.setattr(files.os, "replace", failing_replace)
      with pytest.raises(OSError, match="No space left"):
        write()
    assert target.read_bytes() == old
    assert os.listdir(target.parent) == ["state.bin"]  # the temporary file is removed
  assert renamed == [new, new.hex().encode(), new]
  with monkeypatch.context() as m:
    m.setattr(files.os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="Input/output error"):
      storage.write_bytes(str(target), new)
  assert target.read_bytes() == old and os.listdir(target.parent) == ["state.bin"]
  storage.write_bytes(str(target), new)  # and without a failure the new content lands whole
  assert target.read_bytes() == new and os.listdir(target.parent) == ["state.bin"]


def test_missing_bucket_and_object_name_the_url(fake_gcs):
  with pytest.raises(FileNotFoundError, match=r"gs://no-such-bucket/x\.json: no such file or "
                     r"object \(or its bucket does not exist"):
    storage.write_text("gs://no-such-bucket/x.json", "x")
  with pytest.raises(FileNotFoundError, match="bucket gs://no-such-bucket does not exist"):
    storage.check_bucket("gs://no-such-bucket/runs/a")
  missing = fake_gcs.new_url("missing") + "/x.txt"
  with pytest.raises(FileNotFoundError, match=f"{missing}: no such file or object"):
    storage.read_text(missing)
  with pytest.raises(storage.StorageError, match="unknown storage protocol 'nosuch'"):
    storage.exists("nosuch://bucket/x")


class _HTTPError(Exception):
  def __init__(self, status):
    super().__init__(f"HTTP {status}")
    self.response = type("Response", (), {"status_code": status})()


def test_transient_errors_are_told_apart():
  wrapped = OSError("read failed")
  wrapped.__cause__ = ConnectionResetError(104, "Connection reset by peer")
  server_disconnected = type("ServerDisconnectedError", (Exception,), {})
  for e in (TimeoutError("timed out"), ConnectionResetError(), _HTTPError(503), _HTTPError(429),
            wrapped, server_disconnected("gone"), OSError(110, "Connection timed out")):
    assert retry.is_transient(e), e
  for e in (FileNotFoundError("x"), PermissionError("x"), _HTTPError(404), _HTTPError(403),
            ValueError("bad parquet"), OSError(28, "No space left on device")):
    assert not retry.is_transient(e), e


def test_transient_errors_are_retried_and_logged(fake_gcs, caplog):
  url = fake_gcs.new_url("retry") + "/x.txt"
  storage.write_text(url, "payload")
  FakeGCSFileSystem.fail("open", 2, ConnectionResetError(104, "Connection reset by peer"))
  with caplog.at_level(logging.WARNING):
    assert storage.read_text(url) == "payload"
  retries = [r.getMessage() for r in caplog.records if "retry" in r.getMessage()]
  assert len(retries) == 2, retries
  assert retries[0].startswith(f"storage: reading {url} failed (ConnectionResetError: ")
  assert "retry 1 of 5" in retries[0] and "retry 2 of 5" in retries[1]


def test_persistent_and_permanent_errors_fail_naming_the_url(fake_gcs, monkeypatch):
  url = fake_gcs.new_url("retry") + "/x.txt"
  storage.write_text(url, "payload")
  monkeypatch.setenv("UMOE_STORAGE_RETRIES", "3")
  FakeGCSFileSystem.fail("open", 10**6, TimeoutError("read timed out"))
  with pytest.raises(storage.StorageError, match=f"reading {url} failed after 3 attempts .*"
                     "TimeoutError: read timed out") as e:
    storage.read_text(url)
  assert "transient error persisted" in e.value.hint
  FakeGCSFileSystem.fail("open", 1, PermissionError("403 Forbidden"))  # no retry: one failure
  with pytest.raises(storage.StorageError, match="access denied or no credentials") as e:
    storage.read_text(url)
  assert "GOOGLE_APPLICATION_CREDENTIALS" in e.value.hint


def test_append_file_reuploads_whole_and_resumes(fake_gcs):
  url = fake_gcs.new_url("append") + "/metrics.jsonl"
  local = fake_gcs.local(url)
  f = storage.AppendFile(url, flush_secs=3600)
  f.write('{"step": 1}\n')
  f.flush()  # throttled: nothing uploaded yet
  assert not os.path.exists(local)
  f.flush(force=True)
  assert open(local).read() == '{"step": 1}\n'
  f.write('{"step": 2}\n')
  f.close()
  assert open(local).read() == '{"step": 1}\n{"step": 2}\n'
  with storage.AppendFile(url, flush_secs=0) as g:  # a resumed run appends to what is there
    g.write(b'{"step": 3}\n')
    g.flush()
    assert open(local).read().count("step") == 3
  assert open(local).read().splitlines()[-1] == '{"step": 3}'


def test_append_file_of_lines_cuts_a_partial_last_line(fake_gcs, tmp_path):
  """A run killed mid-line leaves a fragment: with lines=True a resumed writer drops it (its record
  was glued to the fragment: a broken line mid-file for every reader); bytes files (TensorBoard
  events) and complete or empty files are left as they are."""
  for path in (str(tmp_path / "metrics.jsonl"), fake_gcs.new_url("lines") + "/metrics.jsonl"):
    local = path if not storage.is_url(path) else fake_gcs.local(path)
    os.makedirs(os.path.dirname(local), exist_ok=True)
    long = "".join(f'{{"step": {i}, "x": "{"y" * 100}"}}\n' for i in range(1000))  # > 64 KiB
    for before, lines, after in (('{"step": 1}\n{"st', True, '{"step": 1}\n{"step": 2}\n'),
                                 (long + '{"step": 1, "x": "y' + "y" * 70000, True,
                                  long + '{"step": 2}\n'),
                                 ('{"step": 1}\n', True, '{"step": 1}\n{"step": 2}\n'),
                                 ('{"st', True, '{"step": 2}\n'),
                                 ('', True, '{"step": 2}\n'),
                                 ('\x00\x01', False, '\x00\x01{"step": 2}\n')):
      with open(local, "w") as f:
        f.write(before)
      with storage.AppendFile(path, lines=lines) as f:
        f.write('{"step": 2}\n')
      assert open(local).read() == after, (path, before)
      if lines:  # every line is a whole record
        assert open(local).read().splitlines()[-1] == '{"step": 2}', (path, before)


def _texts(n, seed):
  rng = np.random.default_rng(seed)
  return [" ".join(f"w{int(i)}" for i in rng.integers(0, 50, rng.integers(5, 40))) for _ in range(n)]


def _data_config(**kw):
  cfg = data_lib.default_data_config()
  cfg.update(kw)
  return cfg


def test_remote_parquet_streams_row_groups(fake_gcs, tmp_path):
  """A row group read from a bucket reads a bounded part of the file (not the whole file), and
  the documents equal pyarrow's local read; a glob of the bucket finds the shards."""
  texts = _texts(800, 0)
  local = tmp_path / "shard.parquet"
  pad = [np.random.default_rng(i).bytes(8192) for i in range(len(texts))]  # incompressible: 6.5 MB
  pq.write_table(pa.table({"text": texts, "pad": pad}), local, row_group_size=100)
  base = fake_gcs.new_url("parquet")
  for name in ("train-0.parquet", "train-1.parquet"):
    storage.upload_file(str(local), f"{base}/{name}")
  storage.write_text(f"{base}/notes.txt", "not data")
  files = sources.resolve_files(f"{base}/train-*.parquet", (".parquet",))
  assert files == [f"{base}/train-0.parquet", f"{base}/train-1.parquet"]
  assert sources.resolve_files(base + "/", (".parquet",)) == files  # a prefix, walked
  chunks = sources._parquet_chunks(files, "text")
  assert len(chunks) == 16 and chunks[5] == sources.Chunk("parquet", files[0], index=5)
  FakeGCSFileSystem.bytes_read.clear()
  got = sources.read_chunk(chunks[5], "text")
  assert got == pq.ParquetFile(local).read_row_group(5).column("text").to_pylist()
  read = FakeGCSFileSystem.bytes_read[files[0].split("://")[1]]
  assert 0 < read < os.path.getsize(local) / 20, (read, os.path.getsize(local))
  # a reset connection in the middle of the stream: the row group is read again
  FakeGCSFileSystem.fail("open", 1, ConnectionResetError(104, "reset"))
  assert sources.read_chunk(chunks[9], "text") == texts[900 - 800:1000 - 800]
  # damage is still a data error naming the file (not a storage error)
  storage.write_bytes(f"{base}/bad.parquet", local.read_bytes()[:-100])
  with pytest.raises(sources.DataError, match=f"parquet file '{base}/bad.parquet' cannot be opened"):
    sources._parquet_chunks([f"{base}/bad.parquet"], "text")
  no_scheme_directories(tmp_path)


def test_remote_jsonl_chunks_and_text_files(fake_gcs, monkeypatch):
  texts = _texts(300, 1)
  body = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
  base = fake_gcs.new_url("jsonl")
  storage.write_bytes(f"{base}/a.jsonl", body)
  monkeypatch.setattr(sources, "JSONL_CHUNK_BYTES", len(body) // 3 + 7)  # cuts inside lines
  chunks = sources._jsonl_chunks([f"{base}/a.jsonl"], "text")
  assert len(chunks) == 3
  FakeGCSFileSystem.fail("open", 1, ConnectionResetError(104, "reset"))
  assert sum((sources.read_chunk(c, "text") for c in chunks), []) == texts
  storage.write_bytes(f"{base}/bad.jsonl", body + b'{"txt": 1}\n')
  with pytest.raises(sources.DataError, match=f"{base}/bad.jsonl:301: record without field 'text'"):
    sum((sources.read_chunk(c, "text") for c in
         sources._jsonl_chunks([f"{base}/bad.jsonl"], "text", "skip")), [])
  storage.write_bytes(f"{base}/docs/b.txt", b"line one\r\nline two\n")
  assert sources._ReadTextFile()(f"{base}/docs/b.txt") == "line one\nline two\n"


def test_prepare_into_a_bucket_and_train_reader(fake_gcs, tmp_path):
  """prepare's shards uploaded to gs:// read back (array_record's own gs:// reader) as the local
  output does; a second prepare replaces them (no stale shard); a failed upload leaves no
  metadata.json, so the loader refuses the output."""
  texts = _texts(60, 2)
  pq.write_table(pa.table({"text": texts}), tmp_path / "in.parquet", row_group_size=16)
  cfg = _data_config(source="parquet", train_path=str(tmp_path / "in.parquet"))
  out = fake_gcs.new_url("prepared")
  prepare_lib.prepare(cfg, out, num_shards=3, progress=False)
  prepare_lib.prepare(cfg, str(tmp_path / "local_out"), num_shards=3, progress=False)
  assert storage.listdir(out) == sorted(os.listdir(tmp_path / "local_out"))

  def documents(path):
    c = _data_config(source="arrayrecord", train_path=path)
    ds = sources.document_dataset(c, split="train", seed=0, shuffle=False, num_epochs=1)
    return [np.asarray(d).tolist() for d in ds]

  assert documents(out) == documents(str(tmp_path / "local_out"))
  assert documents(out)[0] == list(texts[0].encode())
  with pytest.raises(FileExistsError, match="metadata.json' exists; pass --overwrite"):
    prepare_lib.prepare(cfg, out, num_shards=2, progress=False)
  prepare_lib.prepare(cfg, out, num_shards=2, progress=False, overwrite=True)
  assert storage.listdir(out) == ["data-00000-of-00002.array_record",
                                  "data-00001-of-00002.array_record", "metadata.json"]
  # the connection drops for good after the first shard is uploaded
  FakeGCSFileSystem.fail("open", 10**6, ConnectionResetError(104, "reset"), after=1)
  with pytest.raises(storage.StorageError, match=f"uploading to {out}/data-00001-of-00002"
                     r"\.array_record failed after 6 attempts"):
    prepare_lib.prepare(cfg, out, num_shards=2, progress=False, overwrite=True)
  FakeGCSFileSystem.faults.clear()
  assert storage.listdir(out) == ["data-00000-of-00002.array_record"]  # no commit marker
  with pytest.raises(FileNotFoundError, match="metadata.json' missing"):
    documents(out)
  with pytest.raises(ValueError, match="array_record's reader, which opens local paths and gs:// "
                     "only, not s3://"):
    sources.arrayrecord_files("s3://bucket/prepared")
  no_scheme_directories(tmp_path)


def test_url_workdirs_are_checked_before_anything_runs(fake_gcs):
  from umoe_jax.train import checkpoint as ckpt_lib
  ckpt_lib.check_workdir(fake_gcs.new_url("runs/ok"))  # a new directory in an existing bucket
  cases = {"gs://no-such-bucket/runs/a": "bucket gs://no-such-bucket does not exist",
           "gs://umoe-test": "is a bucket: pass a directory in it, e.g. gs://umoe-test/runs/NAME",
           "s3://bucket/runs/a": "checkpoints \\(Orbax\\) are written to local paths and gs:// "
                                 "only, not s3://",
           "hf://datasets/x/y": "only, not hf://"}
  obj = fake_gcs.new_url("runs") + "/file"
  storage.write_text(obj, "x")
  cases[obj] = "is a file \\(an object\\), not a directory"
  for workdir, message in cases.items():
    with pytest.raises(ckpt_lib.WorkdirError, match=message):
      ckpt_lib.check_workdir(workdir)


UNKNOWN_USER = "umoe_no_such_user_x7"


def test_tilde_of_an_unknown_user_is_an_error_naming_the_flag(tmp_path, monkeypatch, capsys):
  """os.path.expanduser leaves '~user/x' as it is when there is no such user: the commands made a
  directory literally named '~user' in the working directory. Now each output flag is refused."""
  from umoe_jax.output import check_output_path
  from umoe_jax.train.workdir import WorkdirError, check_workdir
  monkeypatch.chdir(tmp_path)
  path = f"~{UNKNOWN_USER}/out"
  unknown = (f"{path!r}: unknown user {UNKNOWN_USER!r} in {path!r} (~{UNKNOWN_USER} is the home "
             f"directory of user")
  assert storage.expand_user("~/x", "--out") == os.path.expanduser("~/x")  # ~ and URLs: unchanged
  assert storage.expand_user("gs://b/~x", "--out") == "gs://b/~x"
  with pytest.raises(ValueError, match=re.escape(f"--json={unknown}")):
    check_output_path(path, "--json")
  with pytest.raises(ValueError, match=re.escape(f"--plots={unknown}")):
    check_output_path(path, "--plots", directory=True)
  with pytest.raises(WorkdirError, match=re.escape(f"--workdir={unknown}")):
    check_workdir(path)
  from umoe_jax.config import ConfigError
  from umoe_jax.train.setup import use_compilation_cache
  with pytest.raises(ConfigError, match=re.escape(f"train.compilation_cache_dir={unknown}")):
    use_compilation_cache(path)
  jsonl = tmp_path / "d.jsonl"
  jsonl.write_text(json.dumps({"text": "a document"}) + "\n")
  assert prepare_lib.main(["--source=jsonl", f"--input={jsonl}", f"--output_dir={path}"]) == 1
  assert capsys.readouterr().err.startswith(f"error: --output_dir={unknown}")
  assert os.listdir(tmp_path) == ["d.jsonl"]  # no directory named '~umoe_no_such_user_x7'


NO_USER = "umoe_no_such_user"


def test_expand_of_unknown_user_is_an_error():
  """`~user/...` of no user of this machine: storage.expand / abspath raise UnknownUserError (a
  FileNotFoundError and a ValueError) naming the user and the path, instead of leaving `~user` as a
  relative directory name (then "no such file" naming `~user`, or a directory named so)."""
  from umoe_jax.storage.files import UnknownUserError
  for fn in (storage.expand, storage.abspath):
    with pytest.raises(UnknownUserError, match=f"unknown user '{NO_USER}' in '~{NO_USER}/x'"):
      fn(f"~{NO_USER}/x")
    assert fn("~/x") == os.path.expanduser("~/x")  # ~ of this user, a URL: as they were
    assert fn("gs://b/~x/") == "gs://b/~x"
  assert issubclass(UnknownUserError, FileNotFoundError) and issubclass(UnknownUserError, ValueError)


def test_input_path_of_unknown_user_is_one_error_line(tmp_path):
  """An input path `~user/...` of no user: one "error:" line saying the user is unknown, no
  traceback (was "no such file/directory" naming `~user`, as a path under the working directory)."""
  import subprocess
  import sys
  bad = f"~{NO_USER}/x"
  commands = [
      [sys.executable, "-m", "umoe_jax.eval", "perplexity", f"--checkpoint={bad}",
       "--data=README.md"],
      [sys.executable, "-m", "umoe_jax.data.prepare", "--source=text", f"--input={bad}",
       f"--output_dir={tmp_path / 'out'}"],
      [sys.executable, "-m", "umoe_jax.stats", f"--config={bad}.py"],
      [sys.executable, "-m", "umoe_jax.generate", f"--checkpoint={bad}", "--prompt=hi"],
      [sys.executable, "train.py", "--config=configs/umoe_tiny.py", f"--workdir={tmp_path / 'w'}",
       f"--config.checkpoint.init_from={bad}"],
  ]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  procs = [(cmd, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)) for cmd in commands]
  for cmd, proc in procs:
    _, stderr = proc.communicate(timeout=300)
    lines = [line for line in stderr.strip().splitlines()
             if not line.startswith("  ")]  # (train.py's indented hint lines)
    assert proc.returncode != 0 and "Traceback" not in stderr, (cmd, stderr[-2000:])
    assert len(lines) == 1 and f"unknown user '{NO_USER}' in '{bad}" in lines[0], (cmd, stderr)
