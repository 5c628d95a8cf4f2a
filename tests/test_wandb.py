"""Weights & Biases logging (`log.wandb=True`): an offline run's files hold what metrics.jsonl holds.

The run file (`offline-run-*/run-<id>.wandb`) is W&B's record log: a 7-byte header (":W&B", magic,
version), then LevelDB log framing (32 KiB blocks of records, each with a 7-byte header: CRC32,
length, type FULL / FIRST / MIDDLE / LAST) around serialized `wandb_internal_pb2.Record`s; its
`history` records are the logged rows, one per step.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import struct

import numpy as np
import pytest

from test_train import small_config
from umoe_jax.config import ConfigError
from umoe_jax.train import metrics as metrics_lib


def wandb_records(path: str, block: int = 32768):
  from wandb.proto import wandb_internal_pb2
  data = open(path, "rb").read()
  assert data[:4] == b":W&B", data[:7]
  pos, chunks = 7, []
  while pos + 7 <= len(data):
    left = block - pos % block
    if left < 7:  # a block's tail too short for a header is zero padding
      pos += left
      continue
    _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
    if kind == 0 and length == 0:
      pos += left
      continue
    chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
    chunks = [chunk] if kind in (1, 2) else chunks + [chunk]
    if kind in (1, 4):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(b"".join(chunks))
      yield record


def history(path: str) -> dict[int, dict]:
  """{step: {key: value}} of a run file's history rows (nested keys joined with '/')."""
  rows: dict[int, dict] = {}
  for r in wandb_records(path):
    if r.WhichOneof("record_type") == "history":
      row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
      rows.setdefault(int(row["_step"]), {}).update(row)
  return rows


def media(row: dict, tag: str) -> dict:
  """The fields of a histogram or image logged as `tag` (W&B flattens them to '<tag>/<field>')."""
  return {k[len(tag) + 1:]: v for k, v in row.items() if k.startswith(tag + "/")}


def _wandb_config(**log):
  cfg = small_config(num_steps=8, log_every=2, eval_every=4, eval_batches=1)
  cfg.log.update(dict(wandb=True, wandb_mode="offline", wandb_project="umoe-test",
                      routing_probe_batches=1, dead_expert_window=2, **log))
  return cfg


@pytest.mark.extras("wandb")
def test_offline_run_holds_the_scalars_histograms_and_images(tmp_path, monkeypatch):
  from umoe_jax.train import loop
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
  monkeypatch.setenv("WANDB_SILENT", "true")
  os.makedirs(tmp_path / "wandb_dir")
  workdir = str(tmp_path / "run")
  assert loop.run(_wandb_config(wandb_name="tiny-offline"), workdir)["step"] == 8
  files = glob.glob(str(tmp_path / "wandb_dir" / "wandb" / "offline-run-*" / "run-*.wandb"))
  assert len(files) == 1, files
  run_id = open(os.path.join(workdir, "wandb_run_id")).read().strip()
  assert files[0].endswith(f"run-{run_id}.wandb")
  rows = history(files[0])
  jsonl = {}
  for line in open(os.path.join(workdir, "metrics.jsonl")):
    rec = json.loads(line)
    if not rec.get("session_start"):
      jsonl.setdefault(rec["step"], {}).update(rec)
  assert sorted(rows) == sorted(jsonl) == [0, 2, 4, 6, 8]
  for step, rec in jsonl.items():
    scalars = {k: v for k, v in rec.items() if k != "step" and v is not None}
    assert scalars
    for key, value in scalars.items():
      assert rows[step].get(key) == pytest.approx(value, rel=1e-12, abs=0), (step, key)
  # The new load figures reach W&B too; dead experts once two steps ran.
  assert "moe/layer_0/ffn/load_p90_mean" in rows[2] and "moe/dead_experts" in rows[2]
  # Expert-load histograms: one bucket per expert (4 experts), heights = the interval's tokens.
  hist = media(rows[8], "moe/layer_0/ffn/expert_load")
  assert hist["_type"] == "histogram" and hist["bins"] == [-0.5, 0.5, 1.5, 2.5, 3.5]
  assert sum(hist["values"]) == 2 * 4 * 32 * 2  # 2 steps x 4 x 32 tokens x top-2
  # The routing probe's heatmap: an image file of the run at every evaluation.
  for step in (0, 4, 8):
    image = media(rows[step], "routing/load_heatmap")
    assert image["_type"] == "image-file" and image["width"] > 300
    assert os.path.isfile(os.path.join(os.path.dirname(files[0]), "files", image["path"]))
  # A resumed run continues the same W&B run (its id is kept in the workdir).
  cfg = _wandb_config(wandb_name="tiny-offline")
  cfg.train.num_steps = 10
  assert loop.run(cfg, workdir)["step"] == 10
  files = glob.glob(str(tmp_path / "wandb_dir" / "wandb" / "offline-run-*" / "run-*.wandb"))
  assert len(files) == 2 and all(f.endswith(f"run-{run_id}.wandb") for f in files)
  newer = max(files, key=os.path.getmtime)
  assert sorted(history(newer)) == [10]


@pytest.mark.parametrize("key,value,match", [
    ("wandb_mode", "shared", r"log.wandb_mode='shared'; valid: online, offline, disabled"),
    ("wandb_project", "", r"log.wandb_project='' must be a non-empty project name"),
    ("dead_expert_window", -1, r"log.dead_expert_window=-1 must be an integer >= 0"),
])
def test_log_keys_are_validated(key, value, match):
  from umoe_jax.train import config as config_lib
  cfg = small_config()
  cfg.log.wandb = True
  cfg.log[key] = value
  with pytest.raises(ConfigError, match=match):
    config_lib.validate(cfg)


def test_wandb_without_the_package_is_one_line(monkeypatch):
  from umoe_jax.train import config as config_lib
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "wandb" else real(name, *a))
  cfg = small_config()
  cfg.log.wandb = True
  with pytest.raises(ConfigError, match=r"^log.wandb=True needs the wandb package: pip install -r "
                                        r"requirements-wandb.txt$"):
    config_lib.validate(cfg)
  cfg.log.wandb = False
  config_lib.validate(cfg)  # off: the package is not needed


class RecordingSink:
  def __init__(self):
    self.calls = []

  def scalars(self, step, values):
    self.calls.append(("scalars", step, dict(values)))

  def histogram(self, step, tag, counts):
    self.calls.append(("histogram", step, tag, np.asarray(counts).tolist()))

  def image(self, step, tag, png):
    self.calls.append(("image", step, tag, png))

  def close(self):
    self.calls.append(("close",))


def test_metric_writer_gives_its_sinks_every_record(tmp_path):
  from matplotlib.figure import Figure

  from umoe_jax.plot import figures as plots
  png = plots.png_bytes(Figure(figsize=(1, 1)))
  sink = RecordingSink()
  with metrics_lib.MetricWriter(str(tmp_path), sinks=[sink]) as w:
    w.scalars(3, {"train/loss": 2.5, "train/bad": float("nan")})
    w.expert_histograms(3, {"layer_0/ffn": np.array([1, 0, 5]), "layer_1/ffn": np.zeros(3)})
    w.image(3, "routing/load_heatmap", png)
  assert sink.calls == [("scalars", 3, {"train/loss": 2.5}),   # finite values, as TensorBoard
                        ("histogram", 3, "moe/layer_0/ffn/expert_load", [1.0, 0.0, 5.0]),
                        ("image", 3, "routing/load_heatmap", png), ("close",)]
  other = RecordingSink()
  w = metrics_lib.MetricWriter(str(tmp_path / "p1"), is_main=False, sinks=[other])
  w.scalars(1, {"train/loss": 1.0})
  w.close()
  assert other.calls == []  # only process 0 writes
