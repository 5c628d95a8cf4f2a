"""`log.profile_steps`: the trace holds exactly the training steps asked for.

The host dispatches steps before earlier ones have finished, so a trace started without waiting for
the device would also hold the queued steps. Executions are counted from the written `.xplane.pb`
(`jax.profiler.ProfileData`): every op event of a compiled program carries its module name
(`hlo_module`) and the id of the execution it belongs to (`run_id`); the distinct run ids of the
train step's module are the steps the trace holds.
"""
from __future__ import annotations

import glob
import os

import jax
import jax.numpy as jnp
import pytest

from test_train import small_config
from umoe_jax.train import profiler as profiler_lib


def trace_runs(logdir: str) -> list[str]:
  return sorted(glob.glob(os.path.join(logdir, "plugins", "profile", "*")))


def executions(run_dir: str, module: str) -> set[int]:
  """The run ids of `module`'s executions with at least one op event in the trace of `run_dir`."""
  paths = glob.glob(os.path.join(run_dir, "*.xplane.pb"))
  assert len(paths) == 1, paths
  data = jax.profiler.ProfileData.from_file(paths[0])
  runs = set()
  for plane in data.planes:
    for line in plane.lines:
      for event in line.events:
        stats = dict(event.stats)
        if stats.get("hlo_module") == module and "run_id" in stats:
          runs.add(int(stats["run_id"]))
  return runs


def step_annotations(run_dir: str) -> list[int]:
  data = jax.profiler.ProfileData.from_file(glob.glob(os.path.join(run_dir, "*.xplane.pb"))[0])
  return sorted(int(dict(e.stats)["step_num"]) for p in data.planes for l in p.lines
                for e in l.events if e.name == "train" and "step_num" in dict(e.stats))


@jax.jit
def heavy_step(x):
  """Milliseconds of CPU work per call, so that dispatched calls queue up behind each other."""
  for _ in range(4):
    x = jnp.tanh(x @ x) * 0.5
  return x, jnp.sum(x)


@pytest.mark.parametrize("chosen", [(7,), (7, 8)])
def test_profiler_waits_for_queued_steps(tmp_path, chosen):
  logdir = str(tmp_path)
  x = jnp.full((512, 512), 0.01, jnp.float32)
  jax.block_until_ready(heavy_step(x))  # compiled outside the trace
  with profiler_lib.StepProfiler(chosen, logdir) as prof:
    for step in range(1, 11):  # the host dispatches steps 1..6 at once; they queue on the device
      prof.before(step, x)
      x, metrics = heavy_step(x)
      prof.after(step, (x, metrics))
  jax.block_until_ready(x)
  runs = trace_runs(logdir)
  assert len(runs) == 1, runs
  assert len(executions(runs[0], "jit_heavy_step")) == len(chosen)
  assert step_annotations(runs[0]) == list(chosen)


def test_training_run_traces_the_steps_asked_for(tmp_path):
  from umoe_jax.train import loop
  workdir = str(tmp_path / "run")
  # Logs, evaluation and saves only at the end: nothing blocks the host between steps 2 and 8.
  cfg = small_config(num_steps=8, log_every=8, eval_every=0)
  cfg.checkpoint.every = 8
  cfg.log.profile_steps = (4, 5)
  assert loop.run(cfg, workdir)["step"] == 8
  runs = trace_runs(os.path.join(workdir, "tensorboard"))
  assert len(runs) == 1, runs
  assert len(executions(runs[0], "jit_train_step")) == 2
  assert step_annotations(runs[0]) == [4, 5]
