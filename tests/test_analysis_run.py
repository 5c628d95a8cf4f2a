"""Routing analysis of a real (tiny) training run: the trainer's routing probe and profiler, the
routing command end to end on two of its checkpoints, and the command's bad-input errors.

One run for the module (8 steps, checkpoints at 4 and 8) over the linux-docs corpus with the GPT-2
tokenizer from `../shared/data`; without it the run uses the built-in corpus and the end-to-end
command test skips.
"""
from __future__ import annotations

import functools
import glob
import gzip
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from test_train import ROOT, small_config
from umoe_jax.analysis import cli as analysis_cli
from umoe_jax.analysis import checkpoints as ckpt
from umoe_jax.analysis import probe, routing
from umoe_jax.config import ConfigError
from umoe_jax.load import load_params

SHARED = os.path.join(os.path.dirname(ROOT), "shared", "data")
CORPUS = os.path.join(SHARED, "corpora", "linux-docs")
GPT2 = os.path.join(SHARED, "tokenizers", "gpt2", "tokenizer.json")
HAVE_SHARED = os.path.isdir(CORPUS) and os.path.isfile(GPT2)
VALIDATION = os.path.join(CORPUS, "validation-00000-of-00001.parquet")
ROUTERS = ["layer_0/attention", "layer_0/ffn", "layer_1/attention", "layer_1/ffn"]


def run_config():
  cfg = small_config(num_steps=8, learning_rate=1e-2, log_every=4, eval_every=4, eval_batches=1)
  cfg.checkpoint.update(dict(every=4, keep=3))
  cfg.log.profile_steps = (5, 6)
  cfg.log.routing_probe_batches = 1  # (small_config turns it off)
  cfg.data.shuffle_window = 64  # a small shuffle window: no need to read the whole corpus first
  if HAVE_SHARED:
    cfg.model.vocab_size = 50304  # GPT-2's 50257 ids, padded
    cfg.data.update(dict(source="parquet", tokenizer=GPT2, eval_path=VALIDATION,
                         train_path=os.path.join(CORPUS, "train-00000-of-00001.parquet")))
  return cfg


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  from umoe_jax.train import loop
  workdir = str(tmp_path_factory.mktemp("analysis_run"))
  cfg = run_config()
  result = loop.run(cfg, workdir)
  assert result["step"] == 8
  return workdir, cfg


def _records(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def test_training_logs_routing_fluctuation(run):
  workdir, cfg = run
  recs = [r for r in _records(workdir) if "routing/top1_change" in r]
  assert [r["step"] for r in recs] == [4, 8]  # every evaluation after the first (the baseline)
  # Each compared with the previous evaluation, on one held-out batch of 4 x 32 tokens.
  assert [(r["routing/previous_step"], r["routing/probe_tokens"]) for r in recs] == [(0, 128),
                                                                                     (4, 128)]
  for r in recs:
    for name in ROUTERS:
      assert 0 <= r[f"routing/{name}/top1_change"] <= 1 and 0 <= r[f"routing/{name}/jaccard"] <= 1
    assert r["routing/top1_change"] == pytest.approx(
        np.mean([r[f"routing/{n}/top1_change"] for n in ROUTERS]), rel=1e-12)
    assert r["routing/layer_0/attention/jaccard"] == pytest.approx(
        1 - r["routing/layer_0/attention/top1_change"], abs=1e-12)  # top-1 attention routing
  # Recompute step 8's figures from the checkpoints of steps 4 and 8 on the first held-out batch.
  import jax

  from umoe_jax import data as data_lib
  from umoe_jax.train import state as state_lib
  batch = data_lib.make_eval_batches(cfg.data, seq_len=cfg.train.seq_len, num_batches=1,
                                     global_batch_size=cfg.train.global_batch_size)[0]
  refs = ckpt.resolve([f"{workdir}/checkpoints/4", f"{workdir}/checkpoints/8"])
  model_cfg = ckpt.model_configs(refs)[0]
  parts = state_lib.model_parts(model_cfg)
  fn = jax.jit(functools.partial(probe.route_outputs, graphdef=parts.graphdef))
  ids = []
  for ref in refs:
    params = load_params(ref, parts.abstract_params)
    routes = probe.collect(fn, params, batch["inputs"], n_tokens=batch["inputs"].size,
                           batch_size=len(batch["inputs"]))
    ids.append({name: r.expert_ids for name, r in routes.items()})
  for name in ROUTERS:
    a, b = ids[0][name], ids[1][name]
    change = np.mean([x[0] != y[0] for x, y in zip(a, b)])
    jac = np.mean([len(set(x) & set(y)) / len(set(x) | set(y)) for x, y in zip(a, b)])
    assert recs[1][f"routing/{name}/top1_change"] == pytest.approx(change, abs=1e-9)
    assert recs[1][f"routing/{name}/jaccard"] == pytest.approx(jac, abs=1e-9)
  assert recs[1]["routing/top1_change"] > 0  # the routing did move in 4 steps at this LR


def test_tensorboard_has_routing_images_and_scalars(run):
  from tensorboard.backend.event_processing import event_accumulator
  workdir, _ = run
  acc = event_accumulator.EventAccumulator(os.path.join(workdir, "tensorboard"),
                                           size_guidance={event_accumulator.IMAGES: 0})
  acc.Reload()
  images = acc.Images("routing/load_heatmap")
  assert [e.step for e in images] == [0, 4, 8]
  png = images[-1].encoded_image_string
  assert png[:8] == b"\x89PNG\r\n\x1a\n" and images[-1].width > 300 and images[-1].height > 150
  assert [e.step for e in acc.Scalars("routing/jaccard")] == [4, 8]


def test_profiler_traces_the_chosen_steps(run):
  workdir, _ = run
  runs = glob.glob(os.path.join(workdir, "tensorboard", "plugins", "profile", "*"))
  assert len(runs) == 1, runs  # steps 5 and 6: one trace
  xplanes = glob.glob(os.path.join(runs[0], "*.xplane.pb"))
  assert xplanes and os.path.getsize(xplanes[0]) > 1000
  traces = glob.glob(os.path.join(runs[0], "*.trace.json.gz"))
  if traces:  # the step annotations: steps 5 and 6, no other
    with gzip.open(traces[0], "rt") as f:
      events = json.load(f)["traceEvents"]
    steps = {int(e["args"]["step_num"]) for e in events
             if e.get("name") == "train" and "step_num" in e.get("args", {})}
    assert steps == {5, 6}


@pytest.mark.skipif(not HAVE_SHARED, reason=f"shared data not found at {SHARED} (a fresh clone "
                    "without ../shared): the command's end-to-end test reads linux-docs")
def test_routing_command_end_to_end(run, tmp_path):
  workdir, _ = run
  out_json, plots_dir = str(tmp_path / "routing.json"), str(tmp_path / "plots")
  n = 2048
  proc = subprocess.run(
      [sys.executable, "-m", "umoe_jax.analysis", "routing",
       f"--checkpoints={workdir}/checkpoints/4,{workdir}/checkpoints/8", f"--data={VALIDATION}",
       f"--tokens={n}", "--seed=1", f"--json={out_json}", f"--plots={plots_dir}"],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  for name in ROUTERS:
    assert name in proc.stdout
  assert "top-1 changed" in proc.stdout and "Shared expert pool" in proc.stdout
  assert any(l.split()[1:2] == ["4->8"] for l in proc.stdout.splitlines() if l.startswith("layer_"))
  rep = json.load(open(out_json))
  assert rep["probe"]["tokens"] == n and rep["probe"]["seq_len"] == 32
  assert [c["step"] for c in rep["checkpoints"]] == [4, 8]
  assert sorted(rep["routers"]) == ROUTERS
  for ck in rep["checkpoints"]:
    for name, s in ck["routers"].items():
      info = rep["routers"][name]
      assert sum(s["expert_counts"]) == n * info["top_k"]
      assert 0 <= s["entropy"] <= np.log(info["n_experts"]) + 1e-6
      assert s["dead_experts"] == sum(c == 0 for c in s["expert_counts"])
    # Layer 0's attention router sees only the token embedding: a function of the token id.
    assert ck["routers"]["layer_0/attention"]["token_consistency"] == 1.0
    for layer in ("layer_0", "layer_1"):
      pool = ck["shared_pool"][layer]
      att, ffn = np.array(pool["attention_picks"]), np.array(pool["ffn_picks"])
      np.testing.assert_array_equal(att, ck["routers"][f"{layer}/attention"]["expert_counts"])
      np.testing.assert_allclose(pool["attention_share"], att / (att + ffn))
      assert pool["attention_share_balanced"] == 1 / 3  # K_att = 1, K_ffn = 2
  (fluct,) = rep["fluctuation"]
  assert (fluct["from"], fluct["to"]) == ("4", "8")
  f = fluct["routers"]["layer_0/attention"]
  assert f["jaccard"] == pytest.approx(1 - f["top1_change"], abs=1e-12)
  for name in ("load_heatmap_4", "load_heatmap_8", "attention_share_8", "fluctuation"):
    with open(os.path.join(plots_dir, f"{name}.png"), "rb") as png:
      assert png.read(8) == b"\x89PNG\r\n\x1a\n"


def test_fluctuation_compares_each_checkpoint_with_the_previous(run, monkeypatch):
  """Three checkpoints 4, 8, 8: each pair compares a checkpoint with the one just before it, so
  the second pair (8 -> 8, the same routing) changes nothing while the first (4 -> 8) does, by
  the figures of those two checkpoints' picks."""
  workdir, _ = run
  picks = []
  collect = probe.collect
  def recording(*args, **kwargs):
    routes = collect(*args, **kwargs)
    picks.append({name: r.expert_ids for name, r in routes.items()})
    return routes
  monkeypatch.setattr(probe, "collect", recording)
  rep = analysis_cli.analyze([f"{workdir}/checkpoints/{s}" for s in (4, 8, 8)], tokens=256,
                             batch_size=4)
  assert len(picks) == 3
  first, second = rep["fluctuation"]
  assert [(f["from"], f["to"]) for f in rep["fluctuation"]] == [("4", "8"), ("8", "8")]
  assert sorted(second["routers"]) == sorted(first["routers"]) == ROUTERS
  for name in ROUTERS:
    assert second["routers"][name] == {"top1_change": 0.0, "jaccard": 1.0}
    a, b = picks[0][name], picks[1][name]
    change = np.mean([x[0] != y[0] for x, y in zip(a, b)])
    jac = np.mean([len(set(x) & set(y)) / len(set(x) | set(y)) for x, y in zip(a, b)])
    assert first["routers"][name]["top1_change"] == pytest.approx(change, abs=1e-12)
    assert first["routers"][name]["jaccard"] == pytest.approx(jac, abs=1e-12)
  assert max(f["top1_change"] for f in first["routers"].values()) > 0  # the routing moved


# ------------------------------------------------------------------------------------------------
# Bad input: clear errors naming the value


def _fake_run(tmp_path, workdir, name, **model):
  """A run directory whose config.json changes model keys, over the real run's step-8 files."""
  fake = tmp_path / name
  (fake / "checkpoints").mkdir(parents=True)
  config = json.load(open(os.path.join(workdir, "config.json")))
  for key, value in model.items():
    *sections, leaf = key.split(".")
    table = config["model"]
    for section in sections:
      table = table[section]
    table[leaf] = value
  (fake / "config.json").write_text(json.dumps(config))
  os.symlink(os.path.join(workdir, "checkpoints", "8"), fake / "checkpoints" / "8")
  return str(fake / "checkpoints" / "8")


def test_glob_skips_a_save_in_progress(run, tmp_path):
  """'<workdir>/checkpoints/*' while the run trains: Orbax's unfinished <step>.orbax-checkpoint-tmp-<t>
  directory is not a checkpoint (it was taken for a workdir without checkpoints: an error)."""
  workdir, _ = run
  fake = tmp_path / "live"
  (fake / "checkpoints" / "12.orbax-checkpoint-tmp-1733000000").mkdir(parents=True)
  shutil.copy(os.path.join(workdir, "config.json"), fake / "config.json")
  for step in ("4", "8"):
    os.symlink(os.path.join(workdir, "checkpoints", step), fake / "checkpoints" / step)
  assert [r.step for r in ckpt.resolve(f"{fake}/checkpoints/*")] == [4, 8]


def test_glob_matching_no_checkpoint_directory(tmp_path):
  """A pattern whose matches are all files or saves in progress: named (was an IndexError)."""
  (tmp_path / "checkpoints" / "12.orbax-checkpoint-tmp-1733000000").mkdir(parents=True)
  (tmp_path / "config.json").write_text("{}")
  for pattern in (f"{tmp_path}/*.json", f"{tmp_path}/checkpoints/*"):
    with pytest.raises(ValueError, match=f"checkpoint pattern '{re.escape(pattern)}' matches no "
                                         "checkpoint directory"):
      analysis_cli.analyze(pattern, tokens=64)


def test_checkpoints_of_different_shapes(run, tmp_path):
  workdir, _ = run
  other = _fake_run(tmp_path, workdir, "wide", **{"moe.n_experts": 8})
  with pytest.raises(ValueError, match=r"different model shapes: .*wide/checkpoints/8 has "
                                       r"model\.moe\.n_experts=8 vs 4"):
    analysis_cli.analyze([f"{workdir}/checkpoints/4", other], tokens=64)
  # A config.json that does not describe its checkpoint's arrays: the read names the checkpoint.
  liar = ckpt.resolve(_fake_run(tmp_path, workdir, "liar", **{"moe.d_expert": 8}))[0]
  from umoe_jax.train import state as state_lib
  parts = state_lib.model_parts(ckpt.model_configs([liar])[0])
  with pytest.raises(ValueError, match=r"cannot read the parameters of checkpoint .*liar.*: "
                                       r"parameter layers\.0\.\S+ is \(16, 32\) in the "
                                       r"checkpoint, \(8, 32\) in the model"):
    load_params(liar, parts.abstract_params)


def test_probe_corpus_shorter_than_n_tokens(run, tmp_path):
  workdir, _ = run
  short = tmp_path / "short.jsonl"
  short.write_text(json.dumps({"text": "a few words " * 40}) + "\n" +
                   json.dumps({"text": "and a few more"}) + "\n")
  with pytest.raises(ValueError, match=r"probe corpus '.*short\.jsonl' holds \d+ tokens in windows "
                                       r"of 32 .*fewer than --tokens=100,000"):
    analysis_cli.analyze(f"{workdir}/checkpoints/8", data=str(short), tokens=100_000)


def test_unknown_router_and_missing_paths(run, tmp_path):
  workdir, _ = run
  with pytest.raises(ValueError, match=r"unknown router name 'experts'; this model's routers: "
                                       r"attention, ffn"):
    analysis_cli.analyze(f"{workdir}/checkpoints/8", tokens=64, routers=["experts"])
  with pytest.raises(ValueError, match=r"--data='/nonexistent/x.parquet': no such file"):
    analysis_cli.analyze(f"{workdir}/checkpoints/8", data="/nonexistent/x.parquet")
  with pytest.raises(ValueError, match=r"checkpoint '.*nowhere': no such directory"):
    analysis_cli.analyze(str(tmp_path / "nowhere"))
  with pytest.raises(ValueError, match=r"holds no parameters: expected params/"):
    analysis_cli.analyze(str(tmp_path))
  with pytest.raises(ValueError, match=r"--batch_size=0 must be >= 1"):
    analysis_cli.analyze(f"{workdir}/checkpoints/8", tokens=64, batch_size=0)
  # A tokenizer is named once (the message was "tokenizer 'X': tokenizer file not found: 'X'").
  missing = str(tmp_path / "tok.json")
  with pytest.raises(ValueError, match="^" + re.escape(f"tokenizer file not found: {missing!r}")):
    analysis_cli.analyze(f"{workdir}/checkpoints/8", tokens=64, tokenizer=missing)


def test_tokenizer_larger_than_the_checkpoints_vocabulary(run, tmp_path):
  """The checkpoint fixes vocab_size: the advice is another --tokenizer (load.py's check), not
  "set model.vocab_size >= N" (a config change that cannot apply to trained parameters)."""
  workdir, _ = run
  small = _fake_run(tmp_path, workdir, "small_vocab", vocab_size=256)  # the byte tokenizer has 257
  with pytest.raises(ValueError, match=r"tokenizer 'byte' has 257 tokens, but the model of "
                                       r"checkpoint .*small_vocab.* has vocab_size 256 .*pass "
                                       r"--tokenizer=") as e:
    analysis_cli.analyze(small, tokens=64, tokenizer="byte")
  assert "model.vocab_size >=" not in str(e.value)


@pytest.mark.parametrize("key,value,match", [
    ("profile_steps", (0,), r"log.profile_steps=\(0,\): step 0 is not an integer in \[1, "
                            r"train.num_steps=8\]"),
    ("profile_steps", (3, 9), r"step 9 is not an integer in \[1, train.num_steps=8\]"),
    ("routing_probe_batches", -1, r"log.routing_probe_batches=-1 must be an integer >= 0"),
    ("routing_probe_batches", 3, r"log.routing_probe_batches=3 exceeds train.eval_batches=2"),
])
def test_log_analysis_keys_are_validated(key, value, match):
  from umoe_jax.train import config as config_lib
  cfg = small_config(num_steps=8)
  cfg.log[key] = value
  with pytest.raises(ConfigError, match=match):
    config_lib.validate(cfg)


def test_routing_command_usage_errors():
  proc = subprocess.run([sys.executable, "-m", "umoe_jax.analysis", "routing",
                         "--checkpoints=/nonexistent/run"], cwd=ROOT, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode != 0 and "checkpoint '/nonexistent/run': no such directory" in proc.stderr
  # An output that could not be written is named before the analysis runs (was a traceback after).
  proc = subprocess.run([sys.executable, "-m", "umoe_jax.analysis", "routing",
                         "--checkpoints=/nonexistent/run", "--json=/proc/umoe-test/r.json"],
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0 and proc.stderr.strip().splitlines()[-1] == (
      "error: --json='/proc/umoe-test/r.json': cannot create '/proc/umoe-test' (No such file or "
      "directory)"), proc.stderr[-2000:]
  proc = subprocess.run([sys.executable, "-m", "umoe_jax.analysis", "stats"], cwd=ROOT,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0 and "usage: python -m umoe_jax.analysis {routing}" in proc.stderr


def _routing_command(*flags):
  return subprocess.run([sys.executable, "-m", "umoe_jax.analysis", "routing", "--tokens=64",
                         *flags], cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.isdir("/proc/self"),
                    reason="needs root: /proc passes the writability check only for root")
def test_json_that_cannot_be_written_at_the_end(run):
  """A --json that passes the check before the analysis but fails when written (here /proc, as
  root; elsewhere a full disk): one error line after the report (was an OSError traceback)."""
  workdir, _ = run
  proc = _routing_command(f"--checkpoints={workdir}/checkpoints/8", "--json=/proc/umoe-test.json")
  assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert "layer_0/ffn" in proc.stdout  # the report came out
  assert proc.stderr.strip().splitlines()[-1].startswith(
      "error: cannot write --json='/proc/umoe-test.json' ("), proc.stderr[-3000:]


def test_plot_that_cannot_be_written(run, tmp_path):
  """A --plots file that cannot be written once the analysis runs (here a directory in its place;
  elsewhere a full disk): one error line naming it (was an OSError traceback)."""
  workdir, _ = run
  plots_dir = tmp_path / "plots"
  (plots_dir / "load_heatmap_8.png" / "x").mkdir(parents=True)
  proc = _routing_command(f"--checkpoints={workdir}/checkpoints/8", f"--plots={plots_dir}")
  assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert proc.stderr.strip().splitlines()[-1] == (
      f"error: cannot write --plots={str(plots_dir)!r}: "
      f"{str(plots_dir / 'load_heatmap_8.png')!r} (Is a directory)"), proc.stderr[-3000:]
