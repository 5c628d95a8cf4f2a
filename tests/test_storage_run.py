"""`train.py` with its workdir, data and tokenizer in a bucket (issue 19), as a user runs it.

gs://umoe-test/ is served offline by tests/fake_gcs.py; the subprocesses reach it through their
sitecustomize (fsspec, etils.epath under Orbax) and the GCS test endpoints of TensorStore. The run
is compared with the same run on local copies of the files: the same losses, step for step, after
a resume in the bucket. Same tiny model and compilation cache as tests/test_cli_errors.py.
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fake_gcs import fake_gcs  # noqa: F401  (the fixture)
from test_cli_errors import cli, compile_cache, shared_dir  # noqa: F401  (fixtures)
from test_cli_errors import assert_fails, tree_digest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = [f"w{i}" for i in range(200)]


def no_scheme_directories(*dirs):
  """No local directory named after the scheme ("gs:") was made, nor epath's "/gs" root."""
  for d in (*dirs, ROOT, "/"):
    assert not os.path.exists(os.path.join(d, "gs:")), d
  assert not os.path.exists("/gs")


def _write_inputs(directory: str) -> None:
  """A word-level tokenizer.json (202 ids: fits the vocab of 257) and parquet shards of its words."""
  import tokenizers
  from tokenizers import models, pre_tokenizers
  vocab = {w: i for i, w in enumerate(WORDS + ["[UNK]", "<|endoftext|>"])}
  tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  os.makedirs(os.path.join(directory, "tok"))
  tok.save(os.path.join(directory, "tok", "tokenizer.json"))
  rng = np.random.default_rng(0)
  os.makedirs(os.path.join(directory, "data"))
  for name, n in (("train-00000.parquet", 150), ("train-00001.parquet", 150), ("val.parquet", 40)):
    docs = [" ".join(rng.choice(WORDS, rng.integers(10, 60))) for _ in range(n)]
    pq.write_table(pa.table({"text": docs}), os.path.join(directory, "data", name),
                   row_group_size=25)


def data_flags(base: str) -> list[str]:
  return ["--config.data.source=parquet", f"--config.data.train_path={base}/data/train-*.parquet",
          f"--config.data.eval_path={base}/data/val.parquet", f"--config.data.tokenizer={base}/tok",
          "--config.train.eval_every=4", "--config.train.eval_batches=1",
          # a learning rate that does not depend on train.num_steps, so that a run stopped at
          # step 4 and resumed to 8 takes the steps of a straight run to 8
          "--config.train.warmup_steps=2", "--config.train.min_lr_ratio=1.0"]


@pytest.fixture(scope="module")
def inputs(fake_gcs, tmp_path_factory):
  """(bucket prefix, local directory) holding the same tokenizer and data."""
  local = str(tmp_path_factory.mktemp("storage_inputs"))
  _write_inputs(local)
  bucket = fake_gcs.new_url("inputs")
  shutil.copytree(local, fake_gcs.local(bucket))
  return bucket, local


def losses(metrics_file: str) -> dict:
  out = {}
  with open(metrics_file) as f:
    for line in f:
      rec = json.loads(line)
      for key in ("train/loss", "eval/loss"):
        if rec.get(key) is not None:
          out[(key, rec["step"])] = rec[key]
  return out


@pytest.fixture(scope="module")
def remote_run(cli, fake_gcs, inputs, tmp_path_factory):
  """Steps 1-4 in the bucket (with transient errors injected), then a resume to step 8 there;
  (workdir URL, its stderr of both runs)."""
  bucket, _ = inputs
  workdir = fake_gcs.new_url("runs/a")
  env = fake_gcs.env()
  flaky = dict(env, UMOE_FAKE_GCS_FAULTS="open=2,ls=1", UMOE_STORAGE_RETRY_DELAY="0.01")
  first = cli(workdir, *data_flags(bucket), "--config.train.num_steps=4", env=flaky)
  assert first.returncode == 0, first.stderr[-4000:]
  second = cli(workdir, *data_flags(bucket), env=env)
  assert second.returncode == 0, second.stderr[-4000:]
  return workdir, first.stderr, second.stderr


def test_a_run_in_a_bucket_resumes_there_and_matches_a_local_run(cli, fake_gcs, inputs, remote_run,
                                                                 tmp_path):
  workdir, first, second = remote_run
  local = fake_gcs.local(workdir)
  # transient errors were retried and reported, and the run went on
  retries = re.findall(r"storage: \w+ .* failed \(ConnectionResetError.*retry \d of \d", first)
  assert len(retries) == 3, first[-3000:]
  tail = [l.split("] ", 1)[-1] for l in second.strip().splitlines()[-4:]]
  assert tail[1] == (f"checkpoints: {workdir}/checkpoints (steps 2, 4, 6, 8; running the same "
                     "command again resumes from step 8)"), tail
  assert tail[2] == f"TensorBoard logs: {workdir}/tensorboard (tensorboard --logdir {workdir})"
  assert f"resumed from {workdir}/checkpoints step 4" in second
  assert sorted(os.listdir(os.path.join(local, "checkpoints"))) == ["2", "4", "6", "8"]
  assert all(os.path.exists(os.path.join(local, "checkpoints", s, "commit_success.txt"))
             for s in ("2", "4", "6", "8"))  # Orbax's commit marker on object stores
  saved = json.load(open(os.path.join(local, "config.json")))
  assert saved["data"]["train_path"] == f"{inputs[0]}/data/train-*.parquet"
  # the same run on local copies: the same losses, though the bucket run was resumed at step 4
  ref = str(tmp_path / "local_run")
  proc = cli(ref, *data_flags(inputs[1]))
  assert proc.returncode == 0, proc.stderr[-3000:]
  want, got = losses(os.path.join(ref, "metrics.jsonl")), losses(os.path.join(local, "metrics.jsonl"))
  assert sorted(got) == sorted(want) and len(want) == 4 + 3, (sorted(got), sorted(want))
  assert max(abs(got[k] - want[k]) for k in want) < 1e-6, (got, want)
  # TensorBoard reads the event files from the bucket (one per run, both complete)
  from tensorboard.backend.event_processing import event_multiplexer
  mux = event_multiplexer.EventMultiplexer()
  mux.AddRunsFromDirectory(f"{workdir}/tensorboard")
  mux.Reload()
  steps = sorted(e.step for run in mux.Runs() for e in mux.Scalars(run, "train/loss"))
  assert steps == [2, 4, 6, 8] and len(glob.glob(os.path.join(local, "tensorboard", "*"))) == 2
  no_scheme_directories(tmp_path)


def test_a_damaged_checkpoint_in_a_bucket_is_moved_aside(cli, fake_gcs, inputs, remote_run,
                                                          tmp_path):
  workdir = fake_gcs.new_url("runs/damaged")
  shutil.copytree(fake_gcs.local(remote_run[0]), fake_gcs.local(workdir))
  ckpts = os.path.join(fake_gcs.local(workdir), "checkpoints")
  six = tree_digest(os.path.join(ckpts, "6"))
  os.remove(os.path.join(ckpts, "8", "state", "manifest.ocdbt"))
  proc = cli(workdir, *data_flags(inputs[0]), env=fake_gcs.env())  # to step 8 again
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert re.search(rf"resumed from checkpoint step 6 instead of the damaged step\(s\) \[8\] "
                   rf"\(moved to {workdir}/checkpoints_damaged\)", proc.stderr), proc.stderr[-3000:]
  moved = os.listdir(os.path.join(fake_gcs.local(workdir), "checkpoints_damaged"))
  assert len(moved) == 1 and moved[0].startswith("8-")
  assert sorted(os.listdir(ckpts), key=int) == ["2", "4", "6", "8"]  # 8 trained again
  assert os.path.exists(os.path.join(ckpts, "8", "state", "manifest.ocdbt"))
  assert tree_digest(os.path.join(ckpts, "6")) == six
  no_scheme_directories(tmp_path)


@pytest.mark.parametrize("case", ["missing_bucket", "no_data", "unreachable_tokenizer"])
def test_bucket_errors_are_one_line_naming_the_url(cli, fake_gcs, inputs, case, tmp_path):
  bucket, _ = inputs
  workdir = fake_gcs.new_url("runs/err")
  env = fake_gcs.env()
  if case == "missing_bucket":
    proc = cli("gs://no-such-bucket/runs/x", *data_flags(bucket), env=env, timeout=90)
    assert_fails(proc, 1, "workdir error", re.escape(
        "--workdir='gs://no-such-bucket/runs/x': gs://no-such-bucket/runs/x: bucket "
        "gs://no-such-bucket does not exist"))
  elif case == "no_data":
    proc = cli(workdir, *data_flags(bucket), f"--config.data.train_path={bucket}/nothing/*.parquet",
               env=env, timeout=90)
    assert_fails(proc, 1, "config error", re.escape(
        f"data.train_path='{bucket}/nothing/*.parquet': no such file, directory or glob match"))
  else:  # the store keeps failing: retried, then reported
    env.update(UMOE_FAKE_GCS_FAULTS="open=1000", UMOE_STORAGE_RETRIES="2",
               UMOE_STORAGE_RETRY_DELAY="0.01")
    proc = cli(workdir, *data_flags(bucket), env=env, timeout=90)
    assert_fails(proc, 1, "config error", re.escape(
        f"data.tokenizer='{bucket}/tok': reading {bucket}/tok/tokenizer.json failed after 2 "
        "attempts"), "ConnectionResetError")
  assert not os.path.exists(fake_gcs.local(workdir))  # nothing written
  no_scheme_directories(tmp_path)
