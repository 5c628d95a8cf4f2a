"""The training loop on CPU: resume equivalence, TensorBoard/JSONL output, damaged checkpoints,
non-finite handling, restore onto another device count.

Every run uses the same tiny UMoE and optimizer settings, so the compiled programs are shared
(`loop.programs` is cached): only the first run of a worker pays for compilation.
"""
from __future__ import annotations

import gc
import glob
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import types

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import configs.common
from umoe_jax import data as data_lib
from umoe_jax.train import checkpoint as ckpt_lib
from umoe_jax.train import loop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_STEPS = 8


def small_config(**train):
  """umoe tiny, shrunk: 2 layers, d=32, 4 experts; 4 x 32 byte tokens per step."""
  c = configs.common.experiment("umoe", "tiny")
  m = c.model
  m.n_layers, m.d_model, m.max_seq_len = 2, 32, 64
  m.moe.n_experts, m.moe.d_expert = 4, 16
  m.ffn.top_k, m.attention.top_k = 2, 1
  m.attention.head_dim, m.attention.q_lora_rank = 16, 4
  c.train.update(dict(global_batch_size=4, seq_len=32, num_steps=NUM_STEPS, learning_rate=3e-3,
                      warmup_steps=2,
                      log_every=1, eval_every=4, eval_batches=2))
  c.train.update(train)
  c.checkpoint.update(dict(every=2, keep=3))
  c.log.peak_flops = 1e12  # no CPU entry in the peak table: exercise MFU anyway
  c.log.routing_probe_batches = 0  # one compile less per run; tests/test_analysis_run.py tests it
  return c


class Recorder(grain.DatasetIterator):
  """Passes batches through, recording a hash of each; batch number `poison_at` (1-based) gets
  out-of-vocabulary token ids, which make the loss NaN (jnp.take fills with NaN)."""

  def __init__(self, parent, log, poison_at=None, vocab=512):
    super().__init__(parent)
    self._it, self.log, self.poison_at, self.vocab = parent, log, poison_at, vocab
    self.count = 0

  def __next__(self):
    batch = next(self._it)
    self.count += 1
    self.log.append(hashlib.sha1(batch["inputs"].tobytes()).hexdigest())
    if self.count == self.poison_at:
      batch = dict(batch, inputs=np.full_like(batch["inputs"], 10 * self.vocab))
    return batch

  def get_state(self):
    return self._it.get_state()

  def set_state(self, state):
    self._it.set_state(state)

  def close(self):
    close = getattr(self._it, "close", None)
    if close is not None:
      close()


class Recording:
  def __init__(self):
    self.batches: list[str] = []   # hash of every batch the runs read, in order
    self.poison_at = None          # batch number (1-based, per run) made non-finite


@pytest.fixture
def record(monkeypatch):
  """Wraps the data iterator of the runs in the test (see `Recorder`)."""
  rec = Recording()
  real = data_lib.make_train_iterator

  def make(*args, **kwargs):
    return Recorder(real(*args, **kwargs), rec.batches, rec.poison_at)

  monkeypatch.setattr(data_lib, "make_train_iterator", make)
  return rec


def jsonl(workdir, key="train/loss"):
  """{step: value} of one metric (the last record of a step wins, as after a resume)."""
  out = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      rec = json.loads(line)
      if key in rec:
        out[rec["step"]] = rec[key]
  return out


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
  """NUM_STEPS steps in one go; yields (workdir, batch hashes)."""
  workdir = str(tmp_path_factory.mktemp("straight"))
  log = []
  real = data_lib.make_train_iterator
  data_lib.make_train_iterator = lambda *a, **k: Recorder(real(*a, **k), log)
  try:
    result = loop.run(small_config(), workdir)
  finally:
    data_lib.make_train_iterator = real
  assert result["step"] == NUM_STEPS and not result["stopped"] and result["start"] == "scratch"
  return workdir, log


def test_resume_after_sigterm_is_identical(straight_run, tmp_path, record):
  straight_dir, straight_batches = straight_run
  workdir = str(tmp_path / "resumed")
  half = NUM_STEPS // 2 + 1  # not a multiple of checkpoint.every: the signal forces the save

  frozen = {}  # step -> objects in the permanent generation (train/host_gc.py)

  def send_sigterm(step):
    frozen[step] = gc.get_freeze_count()
    if step == half:
      os.kill(os.getpid(), signal.SIGTERM)

  handler_before = signal.getsignal(signal.SIGTERM)
  first = loop.run(small_config(), workdir, step_hook=send_sigterm)
  assert first["stopped"] and first["step"] == half
  # The heap is frozen once the step is compiled (after step 1) and given back when the loop ends.
  assert sorted(frozen) == list(range(1, half + 1)) and min(frozen.values()) > 0
  assert gc.get_freeze_count() == 0
  assert half in ckpt_lib.complete_steps(os.path.join(workdir, "checkpoints"))
  assert signal.getsignal(signal.SIGTERM) == handler_before  # the run's handler is removed

  second = loop.run(small_config(), workdir)
  assert second["start"] == "workdir" and second["step"] == NUM_STEPS and not second["stopped"]

  assert record.batches == straight_batches  # same batches, same order, across the interruption
  want, got = jsonl(straight_dir), jsonl(workdir)
  assert sorted(got) == list(range(1, NUM_STEPS + 1))
  assert [got[s] for s in sorted(got)] == [want[s] for s in sorted(want)]  # bit-identical losses
  assert jsonl(workdir, "eval/loss") == jsonl(straight_dir, "eval/loss")


def test_tensorboard_and_jsonl(straight_run):
  from tensorboard.backend.event_processing import event_accumulator
  workdir, _ = straight_run
  acc = event_accumulator.EventAccumulator(os.path.join(workdir, "tensorboard"),
                                           size_guidance={event_accumulator.SCALARS: 0,
                                                          event_accumulator.HISTOGRAMS: 0})
  acc.Reload()
  tags = set(acc.Tags()["scalars"])
  expected = {"train/loss", "train/lm_loss", "train/perplexity", "train/balance_loss",
              "train/learning_rate", "train/grad_norm", "train/skipped_steps",
              "perf/tokens_per_sec", "perf/step_time_s", "perf/mfu", "eval/loss",
              "eval/perplexity"}
  for layer in range(2):
    for router in ("attention", "ffn"):
      for metric in ("balance_loss", "entropy", "load_max_mean", "load_cv"):
        expected.add(f"moe/layer_{layer}/{router}/{metric}")
  assert expected <= tags, sorted(expected - tags)
  loss = acc.Scalars("train/loss")
  assert [e.step for e in loss] == list(range(1, NUM_STEPS + 1))
  assert [e.step for e in acc.Scalars("eval/loss")] == [0, 4, 8]
  ppl = {e.step: e.value for e in acc.Scalars("train/perplexity")}
  lm = {e.step: e.value for e in acc.Scalars("train/lm_loss")}
  assert np.isclose(ppl[3], np.exp(lm[3]), rtol=1e-5)
  lr = [e.value for e in acc.Scalars("train/learning_rate")]
  assert np.allclose(lr[:3], [0.0, 1.5e-3, 3e-3])  # linear warmup over 2 steps, then cosine
  assert all(e.value >= 1.0 for e in acc.Scalars("moe/layer_0/ffn/load_max_mean"))
  hist = acc.Histograms("moe/layer_1/attention/expert_load")
  assert hist and len(hist[-1].histogram_value.bucket) == 4
  # 4 sequences x 32 tokens x top-1 picks per step:
  assert sum(hist[-1].histogram_value.bucket) == 4 * 32 * 1

  records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  assert any("moe/layer_0/attention/balance_loss" in r for r in records)
  assert json.load(open(os.path.join(workdir, "config.json")))["train"]["num_steps"] == NUM_STEPS


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_damaged_latest_checkpoint_falls_back(straight_run, tmp_path, damage, caplog):
  straight_dir, _ = straight_run
  workdir = str(tmp_path / "run")
  shutil.copytree(straight_dir, workdir)
  ckpt_dir = os.path.join(workdir, "checkpoints")
  assert ckpt_lib.complete_steps(ckpt_dir) == [4, 6, 8]
  files = [f for f in glob.glob(os.path.join(ckpt_dir, "8", "state", "**", "*"), recursive=True)
           if os.path.isfile(f) and os.path.getsize(f) > 100]
  assert files
  for f in files:
    if damage == "truncate":
      with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) // 2)
    else:
      os.remove(f)
  # The run resumes from step 6 and trains steps 7 and 8 again.
  with caplog.at_level("WARNING"):
    result = loop.run(small_config(), workdir)
  assert result["start"] == "workdir" and result["step"] == NUM_STEPS
  assert any("checkpoint step 8" in r.getMessage() and "cannot be restored" in r.getMessage()
             for r in caplog.records)
  assert any("resumed from checkpoint step 6" in r.getMessage() for r in caplog.records)
  assert not any("learning-rate schedule" in r.getMessage() for r in caplog.records)  # unchanged
  assert glob.glob(os.path.join(workdir, "checkpoints_damaged", "8-*"))
  # Steps 7 and 8 were trained again from step 6's state and data position: same losses.
  assert jsonl(workdir)[8] == jsonl(straight_dir)[8]
  assert ckpt_lib.complete_steps(ckpt_dir)[-1] == 8


def test_resume_from_an_older_step_replaces_the_later_points(straight_run, tmp_path):
  """A run resumed from step 4 while steps 5-8 were logged (checkpoint.restore_step): TensorBoard
  and `plot.read_metrics` show steps 5-8 once, with the new run's values. Before, TensorBoard showed
  both branches (a zigzag) and plot kept the abandoned branch's steps 5 and 7."""
  from tensorboard.backend.event_processing import event_accumulator
  from umoe_jax.plot import runs as plot
  straight_dir, _ = straight_run
  workdir = str(tmp_path / "run")
  shutil.copytree(straight_dir, workdir)
  # Another learning rate (other values) and log interval (steps 5 and 7 are not logged again).
  cfg = small_config(learning_rate=1e-3, log_every=2)
  cfg.checkpoint.restore_step = 4
  result = loop.run(cfg, workdir)
  assert result["start"] == "workdir" and result["step"] == NUM_STEPS
  old, new = jsonl(straight_dir), jsonl(workdir)
  assert new[6] != old[6] and new[8] != old[8]
  acc = event_accumulator.EventAccumulator(os.path.join(workdir, "tensorboard"),
                                           size_guidance={event_accumulator.SCALARS: 0})
  acc.Reload()
  loss = [(e.step, e.value) for e in acc.Scalars("train/loss")]
  assert [s for s, _ in loss] == [1, 2, 3, 4, 6, 8]
  np.testing.assert_allclose([v for _, v in loss], [old[1], old[2], old[3], old[4], new[6], new[8]],
                             rtol=1e-6)  # (TensorBoard keeps float32)
  evals = [(e.step, e.value) for e in acc.Scalars("eval/loss")]
  assert [s for s, _ in evals] == [0, 4, 8]
  assert np.isclose(evals[-1][1], jsonl(workdir, "eval/loss")[8], rtol=1e-6)
  assert evals[-1][1] != jsonl(straight_dir, "eval/loss")[8]
  # The plots read metrics.jsonl the same way.
  metrics = plot.read_metrics(workdir)
  for key in ("train/loss", "eval/loss"):
    steps, values = metrics[key]
    assert steps == [e.step for e in acc.Scalars(key)], key
    np.testing.assert_allclose(values, [e.value for e in acc.Scalars(key)], rtol=1e-6)


def test_extending_a_run_warns_of_the_new_schedule(straight_run, tmp_path, caplog):
  """Raising train.num_steps on resume stretches the cosine: one warning names the change and the
  learning rate the next step trains with, the one the run then logs."""
  import re
  straight_dir, _ = straight_run
  workdir = str(tmp_path / "run")
  shutil.copytree(straight_dir, workdir)
  with caplog.at_level("WARNING"):
    result = loop.run(small_config(num_steps=NUM_STEPS + 2), workdir)
  assert result["start"] == "workdir" and result["step"] == NUM_STEPS + 2
  [message] = [r.getMessage() for r in caplog.records if "learning-rate schedule" in r.getMessage()]
  match = re.fullmatch(
      re.escape(f"resuming with another learning-rate schedule than {workdir}/config.json: "
                f"train.num_steps {NUM_STEPS} -> {NUM_STEPS + 2}: the learning rate at step "
                f"{NUM_STEPS}, where this run resumes, becomes ") + r"(\S+) \(was (\S+)\)", message)
  assert match, message
  new, was = map(float, match.groups())
  lr = jsonl(workdir, "train/learning_rate")
  # (the old schedule had reached its floor at step 8; the new one is back up the cosine)
  assert np.isclose(lr[NUM_STEPS + 1], new, rtol=1e-2) and new > 10 * was


def test_init_from_another_run(straight_run, tmp_path):
  """checkpoint.init_from takes the params of another run; step, optimizer and data start fresh."""
  straight_dir, _ = straight_run
  cfg = small_config(eval_every=NUM_STEPS)
  cfg.checkpoint.init_from = straight_dir
  workdir = str(tmp_path / "finetune")
  result = loop.run(cfg, workdir)
  assert result["start"] == "init_from" and result["step"] == NUM_STEPS
  evals = jsonl(workdir, "eval/loss")
  assert evals[0] == jsonl(straight_dir, "eval/loss")[NUM_STEPS]  # the same params at step 0
  # A second run in the same workdir resumes from its own checkpoint, not from init_from.
  cfg.train.num_steps = NUM_STEPS  # unchanged: nothing left to do
  assert loop.run(cfg, workdir)["start"] == "workdir"


def test_nonfinite_stop_names_the_step(tmp_path, record):
  record.poison_at = 3
  workdir = str(tmp_path / "nan")
  cfg = small_config(log_every=100, eval_every=0)  # the check happens at the step-4 save
  with pytest.raises(loop.NonFiniteError, match=r"at step 3 \(loss=nan"):
    loop.run(cfg, workdir)
  # The state was never saved past the last good step.
  assert ckpt_lib.complete_steps(os.path.join(workdir, "checkpoints")) == [2]


def _saved_state(workdir, step):
  return ocp.StandardCheckpointer().restore(os.path.join(workdir, "checkpoints", str(step), "state"))


def test_nonfinite_skip_leaves_state_unchanged(tmp_path, record):
  from tensorboard.backend.event_processing import event_accumulator
  record.poison_at = 3
  workdir = str(tmp_path / "skip")
  cfg = small_config(on_nonfinite="skip", eval_every=0, log_every=2)
  cfg.checkpoint.update(dict(every=1, keep=NUM_STEPS))
  result = loop.run(cfg, workdir)
  assert result["step"] == NUM_STEPS and result["train"]["train/skipped_steps"] == 1
  s2, s3, s4 = (_saved_state(workdir, s) for s in (2, 3, 4))
  assert int(s3["step"]) == 3 and int(s3["skipped"]) == 1 and int(s2["skipped"]) == 0
  for a, b in zip(jax_leaves(s2["params"]) + jax_leaves(s2["opt_state"]),
                  jax_leaves(s3["params"]) + jax_leaves(s3["opt_state"])):
    np.testing.assert_array_equal(a, b)  # bit-identical: nothing of step 3 was applied
  assert all(np.isfinite(x).all() for x in jax_leaves(s4["params"]))
  assert not np.array_equal(jax_leaves(s3["params"])[0], jax_leaves(s4["params"])[0])
  # The interval of steps 3 (NaN) and 4 is logged with step 4's values alone, and says so.
  losses = jsonl(workdir)
  assert sorted(losses) == [2, 4, 6, 8] and all(np.isfinite(v) for v in losses.values())
  assert jsonl(workdir, "train/interval_skipped_steps") == {2: 0, 4: 1, 6: 0, 8: 0}
  assert jsonl(workdir, "train/skipped_steps") == {2: 0, 4: 1, 6: 1, 8: 1}
  acc = event_accumulator.EventAccumulator(os.path.join(workdir, "tensorboard"))
  acc.Reload()
  assert [e.step for e in acc.Scalars("train/loss")] == [2, 4, 6, 8]  # none dropped


def _step_programs(cfg):
  """(programs, mesh, rules) of `cfg`: the cached ones its runs use."""
  from umoe_jax import config as model_config_lib
  from umoe_jax.parallel import mesh as mesh_lib, sharding
  mesh = mesh_lib.make_mesh(cfg.get("mesh"))
  rules = sharding.normalize_rules(cfg.get("sharding_rules"))
  model_cfg = model_config_lib.model_config(cfg.model)
  return loop.config_programs(cfg, model_cfg, mesh, rules), mesh, rules


def test_nonfinite_stop_halts_this_run_only():
  """Under "stop", a NaN step halts the state for the rest of *its* run (every later update is
  dropped, with applied=0); a state resumed from its checkpoint tree (skipped > 0) trains again."""
  from umoe_jax.parallel import sharding
  from umoe_jax.train import state as state_lib
  cfg = small_config()  # on_nonfinite="stop": the program of the other runs of this module
  progs, mesh, rules = _step_programs(cfg)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 256, size=(4, 33), dtype=np.int32)
  good = sharding.global_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, mesh, rules)
  bad = sharding.global_batch({"inputs": np.full((4, 32), 10 * 512, np.int32),
                               "targets": tokens[:, 1:]}, mesh, rules)
  embed = lambda st: np.asarray(st.params["embed"]).copy()
  state = progs.init_fn(0)  # as in `loop.run`: init outside use_mesh, steps inside
  with sharding.use_mesh(mesh, rules):
    seen = []
    for batch in (good, bad, good):
      state, m = progs.train_fn(state, batch)
      seen.append((int(m["nonfinite"]), int(m["applied"]), bool(state.halted), embed(state)))
    assert [x[:3] for x in seen] == [(0, 1, False), (1, 0, True), (0, 0, True)]
    np.testing.assert_array_equal(seen[2][3], seen[0][3])  # frozen at the last good step
    assert int(state.skipped) == 2 and int(state.step) == 3
    # A new run from this state's checkpoint tree: halted is not carried over, skipped is.
    tree = state_lib.checkpoint_tree(state)
    assert "halted" not in tree
    resumed = state_lib.from_checkpoint_tree(tree, progs.not_halted_fn())
    resumed, m = progs.train_fn(resumed, good)
    assert (int(m["nonfinite"]), int(m["applied"]), bool(resumed.halted)) == (0, 1, False)
    assert int(resumed.skipped) == 2 and not np.array_equal(embed(resumed), seen[2][3])


def test_resume_with_skipped_steps_under_stop_trains(straight_run, tmp_path):
  """A checkpoint with skipped=1 (from a run under "skip") resumed under the default "stop" trains
  on: same losses as the straight run (its optimizer state is the same), nothing dropped."""
  from umoe_jax.train import state as state_lib
  straight_dir, _ = straight_run
  workdir = str(tmp_path / "run")
  shutil.copytree(straight_dir, workdir)
  ckpt_dir = os.path.join(workdir, "checkpoints")
  for step in (6, 8):
    shutil.rmtree(os.path.join(ckpt_dir, str(step)))
  cfg = small_config()
  progs, _, _ = _step_programs(cfg)
  state_dir = os.path.join(ckpt_dir, "4", "state")
  abstract = state_lib.with_shardings(progs.abstract, progs.shardings)
  # The on-disk layout of a step's state (written before and since TrainState.halted existed).
  target = {k: getattr(abstract, k) for k in ("step", "params", "opt_state", "rng", "skipped")}
  tree = ocp.StandardCheckpointer().restore(state_dir, target)
  tree["skipped"] = jax.device_put(np.int32(1), tree["skipped"].sharding)
  shutil.rmtree(state_dir)
  writer = ocp.StandardCheckpointer()
  writer.save(state_dir, tree)
  writer.wait_until_finished()

  result = loop.run(cfg, workdir)
  assert result["start"] == "workdir" and result["step"] == NUM_STEPS
  assert result["train"]["train/skipped_steps"] == 1  # carried over, none added
  got, want = jsonl(workdir), jsonl(straight_dir)
  assert [got[s] for s in range(5, NUM_STEPS + 1)] == [want[s] for s in range(5, NUM_STEPS + 1)]
  assert all(jsonl(workdir, "train/interval_skipped_steps")[s] == 0
             for s in range(5, NUM_STEPS + 1))
  final = _saved_state(workdir, NUM_STEPS)
  assert int(final["skipped"]) == 1 and int(final["step"]) == NUM_STEPS
  np.testing.assert_array_equal(final["params"]["embed"],
                                _saved_state(straight_dir, NUM_STEPS)["params"]["embed"])


def _close_orphaned_orbax_reads():
  """A restore that fails on a shape mismatch leaves Orbax read coroutines pending on its closed
  event loop; finalise them now (their errors are the expected ones) rather than as an
  'exception ignored' warning in whichever later test or interpreter exit collects them."""
  gc.collect()
  for obj in gc.get_objects():
    if (isinstance(obj, types.CoroutineType) and obj.cr_frame is not None
        and "orbax" in obj.cr_code.co_filename):
      try:
        obj.close()
      except Exception:  # pylint: disable=broad-except
        pass
  gc.collect()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning",
                            "ignore:coroutine .* was never awaited:RuntimeWarning")
def test_failed_resume_keeps_config_json(straight_run, tmp_path):
  """A resume that fails because the model changed leaves config.json describing the checkpoints,
  so the run can still be loaded (and resumed with its old config)."""
  from umoe_jax import load
  straight_dir, _ = straight_run
  workdir = str(tmp_path / "run")
  shutil.copytree(straight_dir, workdir)
  config_file = os.path.join(workdir, "config.json")
  before = open(config_file).read()
  cfg = small_config()
  cfg.model.d_model = 48
  with pytest.raises(ckpt_lib.CheckpointError, match="checkpoint step 8 .* does not fit this config: "
                     r"params/embed is \(512, 32\) on disk, \(512, 48\) here"):
    loop.run(cfg, workdir)
  _close_orphaned_orbax_reads()
  assert open(config_file).read() == before
  assert json.load(open(config_file))["model"]["d_model"] == 32
  assert not glob.glob(os.path.join(workdir, "config.json.tmp*"))
  assert ckpt_lib.complete_steps(os.path.join(workdir, "checkpoints")) == [4, 6, 8]
  model, section, _ = load.load_model(workdir)
  assert section.d_model == 32
  np.testing.assert_array_equal(np.asarray(model.embed.value),
                                _saved_state(straight_dir, NUM_STEPS)["params"]["embed"])
  assert loop.run(small_config(), workdir)["start"] == "workdir"  # the old config still resumes
  assert open(config_file).read() == before


def jax_leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


_RESTORE_ON_TWO_DEVICES = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
    from test_train import small_config
    from umoe_jax import config as model_config_lib
    from umoe_jax.parallel import mesh as mesh_lib, sharding
    from umoe_jax.train import checkpoint as ckpt_lib, loop, state as state_lib
    cfg = small_config()
    cfg.mesh = dict(data=1, fsdp=2, tensor=1, expert=1)
    mesh = mesh_lib.make_mesh(cfg.mesh)
    rules = sharding.normalize_rules(cfg.sharding_rules)
    progs = loop.config_programs(cfg, model_config_lib.model_config(cfg.model), mesh, rules)
    target = state_lib.checkpoint_tree(state_lib.with_shardings(progs.abstract, progs.shardings))
    ckpt = ckpt_lib.Checkpointer({ckpt_dir!r}, keep=3, async_save=False)
    state, step = ckpt.restore_latest(target)
    ckpt.close()
    embed = state["params"]["embed"]
    out = dict(step=step, devices=len(embed.sharding.device_set),
               shard_rows=[s.data.shape for s in embed.addressable_shards],
               embed_sum=float(np.asarray(embed, np.float64).sum()),
               opt_sum=sum(float(np.asarray(x, np.float64).sum())
                           for x in jax.tree.leaves(state["opt_state"])))
    print("RESULT" + json.dumps(out))
""")


def test_restore_onto_two_devices(straight_run):
  """A checkpoint written on one device restores onto a 2-device mesh with FSDP-sharded params."""
  workdir, _ = straight_run
  ckpt_dir = os.path.join(workdir, "checkpoints")
  saved = _saved_state(workdir, NUM_STEPS)
  code = _RESTORE_ON_TWO_DEVICES.format(root=ROOT, tests=os.path.join(ROOT, "tests"),
                                        ckpt_dir=ckpt_dir)
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, JAX_PLATFORMS="cpu",
                                 XLA_FLAGS="--xla_force_host_platform_device_count=2"))
  line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")]
  assert proc.returncode == 0 and line, proc.stderr[-3000:]
  out = json.loads(line[0][len("RESULT"):])
  assert out["step"] == NUM_STEPS and out["devices"] == 2
  vocab, d = saved["params"]["embed"].shape
  assert out["shard_rows"] == [[vocab, d // 2]] * 2  # embed [V, D]: D split over fsdp=2
  assert out["embed_sum"] == np.asarray(saved["params"]["embed"], np.float64).sum()
  assert np.isclose(out["opt_sum"], sum(x.astype(np.float64).sum()
                                        for x in jax_leaves(saved["opt_state"])))


def test_optimizer_matches_a_numpy_adamw_with_global_clipping():
  """Three updates of `make_optimizer` equal AdamW written out in numpy: the gradient clipped by its
  global norm over every leaf (before Adam's moments), the configured b1 / b2 / eps, bias
  correction, the warmup learning rate, and decoupled weight decay on all but the norm scale."""
  import jax.numpy as jnp
  from umoe_jax.train import optimizer as opt_lib

  t = small_config().train
  # b2 far from b1, eps near the second moment's root, small clip: a swap or a missed term shows.
  t.update(dict(learning_rate=0.1, warmup_steps=4, num_steps=10, b1=0.8, b2=0.5, eps=0.3,
                weight_decay=0.2, grad_clip=0.5, mu_dtype="float32"))
  rng = np.random.default_rng(0)
  params = {"w": rng.standard_normal((3, 2)), "norm": {"scale": rng.standard_normal(4)}}
  mask = {"w": True, "norm": {"scale": False}}
  tx = opt_lib.make_optimizer(t, mask)
  p = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
  state = tx.init(p)
  ref = jax.tree.map(np.copy, params)
  mu = jax.tree.map(np.zeros_like, params)
  nu = jax.tree.map(np.zeros_like, params)
  for count in range(1, 4):
    grads = {"w": rng.standard_normal((3, 2)), "norm": {"scale": 3 * rng.standard_normal(4)}}
    updates, state = tx.update(jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), grads), state, p)
    p = jax.tree.map(lambda a, u: a + u, p, updates)
    # numpy: one norm over both leaves (the scale's large gradient makes the clip bind)
    norm = np.sqrt(sum(float(np.sum(g ** 2)) for g in jax.tree.leaves(grads)))
    assert norm > t.grad_clip
    lr = t.learning_rate * (count - 1) / t.warmup_steps   # optax counts from 0 at the first update
    for path in (("w",), ("norm", "scale")):
      get = lambda tree: tree[path[0]] if len(path) == 1 else tree[path[0]][path[1]]
      g = get(grads) * t.grad_clip / norm
      m = get(mu)
      m[...] = t.b1 * m + (1 - t.b1) * g
      v = get(nu)
      v[...] = t.b2 * v + (1 - t.b2) * g ** 2
      adam = (m / (1 - t.b1 ** count)) / (np.sqrt(v / (1 - t.b2 ** count)) + t.eps)
      decay = t.weight_decay * get(ref) if path == ("w",) else 0.0
      get(ref)[...] -= lr * (adam + decay)
  for path, leaf in jax.tree_util.tree_leaves_with_path(p):
    key = jax.tree_util.keystr(path)
    expected = ref["w"] if key == "['w']" else ref["norm"]["scale"]
    np.testing.assert_allclose(np.asarray(leaf), expected, rtol=1e-5, atol=1e-6, err_msg=key)
