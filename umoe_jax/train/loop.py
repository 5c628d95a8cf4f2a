"""The training loop: `run(config, workdir)`.

  setup.py: validate the whole config, the workdir and the start point -> mesh -> model,
  optimizer, state shardings, jitted functions (programs.py) -> data -> start state (own checkpoint
  > checkpoint.init_from > scratch); then here: config.json, TensorBoard / JSONL writers
  -> loop (Trainer): step, log every `log_every`, evaluate every `eval_every`, save every
  `checkpoint.every` (if the save guard passes the state, guard.py) -> final save; SIGTERM / SIGINT
  save the current step and return.

Nothing is written to the workdir before the start state exists: a run that fails a check, fails to
resume, or has nothing to do leaves the workdir as it was (its lock, lock.py, is held from the
start and removed at exit). Every resource (data iterator, checkpoint manager, writers) is closed
on every exit path, so an error is the last thing a run prints.
Errors a user can fix are the classes in USER_ERRORS; their messages name the bad value or file.

The loop keeps a host-side step counter and reads device metrics only at log, eval and save
points, so the host runs ahead of the device between them.
"""
from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from typing import Any, Callable, Optional

import jax
import numpy as np
from absl import logging

from umoe_jax import storage
from umoe_jax.train import routing_probe as routing_probe_lib
from umoe_jax.config import ConfigError
from umoe_jax.data.sources import DataError
from umoe_jax.eval import perplexity
from umoe_jax.parallel import sharding as sharding_lib
from umoe_jax.train import checkpoint as ckpt_lib
from umoe_jax.train import guard as guard_lib
from umoe_jax.train import expert_load
from umoe_jax.train import host_gc
from umoe_jax.train import lock as lock_lib
from umoe_jax.train import metrics as metrics_lib
from umoe_jax.train import optimizer as opt_lib
from umoe_jax.train import profiler as profiler_lib
from umoe_jax.train import state as state_lib
from umoe_jax.train import wandb_writer
# The compiled programs and the run's setup live in their own modules; these names stay importable
# from here (train.py, bench/ and the tests use them as `loop.<name>`).
from umoe_jax.train.programs import (OPTIMIZER_KEYS, STEP_KEYS, Programs,  # noqa: F401
                                     config_programs, expert_chunks, expert_parallel_settings,
                                     programs)
from umoe_jax.train.setup import Setup, initial_state, setup, use_compilation_cache  # noqa: F401


class NonFiniteError(FloatingPointError):
  """The loss or the gradient norm became NaN / inf (train.on_nonfinite="stop")."""


DivergenceError = guard_lib.DivergenceError

# What a user can fix: `train.py` prints these as one line (plus a hint), without a traceback.
USER_ERRORS = (ConfigError, DataError, ckpt_lib.CheckpointError, ckpt_lib.WorkdirError,
               NonFiniteError, DivergenceError, storage.StorageError, storage.ObjectNotFoundError)


class StopRequest:
  """Turns SIGTERM / SIGINT into a request to save and return at the next step boundary.

  A second SIGINT while the request is pending raises KeyboardInterrupt (abort without saving).
  """

  SIGNALS = (signal.SIGTERM, signal.SIGINT)
  SYNC_EVERY = 10

  def __init__(self):
    self.signum: Optional[int] = None
    self._previous: dict[int, Any] = {}

  def __enter__(self) -> "StopRequest":
    if threading.current_thread() is threading.main_thread():
      for sig in self.SIGNALS:
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous.clear()

  def _handle(self, signum, frame) -> None:
    del frame
    if self.signum is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt
    self.signum = signum
    logging.warning("received %s: saving a checkpoint at the end of this step, then exiting",
                    signal.Signals(signum).name)

  def requested(self, step: int) -> bool:
    """Whether to stop before `step`. With several processes all must stop at the same step (the
    save is collective), so the flag is combined across processes every SYNC_EVERY steps only (a
    per-step all-gather would block the host on the device every step)."""
    flag = self.signum is not None
    if jax.process_count() > 1:
      if step % self.SYNC_EVERY:
        return False
      from jax.experimental import multihost_utils
      flag = bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))
    return flag


class Trainer:
  """The loop over steps, with its logging, evaluation, checkpointing and stop handling."""

  def __init__(self, s: Setup, state, step: int, *, step_hook: Optional[Callable[[int], None]],
               heap: host_gc.FrozenHeap, profiler: Optional[profiler_lib.StepProfiler] = None):
    self.s, self.state, self.step = s, state, step
    self.profiler = profiler or profiler_lib.StepProfiler()
    # Frozen once the step is compiled (host_gc.py: no collector pause inside the timed steps); the
    # caller's `with` block releases it when the loop ends.
    self.heap = heap
    self.routing_probe = routing_probe_lib.make_routing_probe(s)  # log.routing_probe_batches
    self.t = s.config.train
    self.step_hook = step_hook
    self.pending: list = []          # device metrics of steps not yet fetched
    self.fetched: list = []          # host metrics of this log interval
    self.last_saved = step           # the step of the state last saved or started from
    # The newest checkpoint of this run's lineage that passed the save guard (None: none yet).
    self.last_checkpoint: Optional[int] = step if s.source.kind == "workdir" else None
    self.refused: Optional[tuple[int, str]] = None  # (step, reason) of the last refused save
    self.first_step = step + 1
    ck = s.config.checkpoint
    self.guard = guard_lib.SaveGuard(max_loss_ratio=ck.max_loss_ratio,
                                     max_param_norm_ratio=ck.max_param_norm_ratio,
                                     reference=s.resume_metadata.get("guard"),
                                     trained_start=s.source.kind != "scratch")
    self.skips = guard_lib.SkipLimit(self.t.max_consecutive_skips)
    s.checkpointer.protect(s.resume_metadata.get("protected_step"))
    self.run_start = time.perf_counter()
    self.last_eval: Optional[dict] = None
    self.last_scalars: dict = {}
    self.skipped_total = int(jax.device_get(state.skipped))  # over the whole run
    self.tokens_per_step = self.t.global_batch_size * self.t.seq_len
    try:
      self.flops_per_token = metrics_lib.train_flops_per_token(s.model_cfg, self.t.seq_len)
    except Exception as e:  # pylint: disable=broad-except  (MFU is optional)
      logging.warning("no FLOPs count for MFU (%s)", e)
      self.flops_per_token = None
    self.dead_window = expert_load.DeadExpertWindow(s.config.log.get("dead_expert_window", 0))
    self.peak_flops = metrics_lib.peak_flops_per_device(jax.devices()[0].device_kind,
                                                        s.config.log.peak_flops)
    self._timer_start = None
    self._timer_steps = 0

  # -- metrics ---------------------------------------------------------------------------------

  def _fetch(self) -> None:
    """Moves pending metrics to the host; applies train.on_nonfinite and the skip limit."""
    if not self.pending:
      return
    pending, self.pending = self.pending, []
    host = jax.device_get([m for _, m in pending])
    for (step, _), m in zip(pending, host):
      dropped = not int(m["applied"])
      self.skipped_total += dropped
      if dropped and not int(m["nonfinite"]):
        # Only a state halted by an earlier non-finite step of this run drops a finite update, and
        # that step raised below first: this is a bug, never to be passed over silently.
        raise RuntimeError(f"the update of step {step} was dropped although its loss and gradient "
                           f"are finite (the train state is halted)")
      if int(m["nonfinite"]):
        msg = (f"non-finite loss or gradient at step {step} (loss={float(m['loss'])}, "
               f"grad_norm={float(m['grad_norm'])})")
        if self.t.on_nonfinite == "stop":
          raise NonFiniteError(
              f"{msg}; stopping (train.on_nonfinite='stop'). That update was not applied; "
              f"{self._last_checkpoint_advice()}; or set train.on_nonfinite='skip' to skip such "
              f"steps")
        logging.warning("%s: update skipped (train.on_nonfinite='skip')", msg)
      self.guard.observe(step, m)
      self.fetched.append(m)
      with self._naming_last_checkpoint():
        self.skips.observe(step, not dropped)  # DivergenceError past train.max_consecutive_skips

  @contextlib.contextmanager
  def _naming_last_checkpoint(self):
    """A DivergenceError of the skip limit ends with where to resume from, as the stop policy's."""
    try:
      yield
    except DivergenceError as e:
      raise DivergenceError(f"{e}; {self._last_checkpoint_advice()}") from None

  def _last_checkpoint_advice(self) -> str:
    if self.last_checkpoint is None:
      return ("no checkpoint of this run passed the save guard: lower train.learning_rate and start "
              "over")
    return (f"the last good checkpoint is step {self.last_checkpoint} in "
            f"{self.s.checkpointer.directory}: resume from it with a lower train.learning_rate "
            f"(--config.checkpoint.restore_step={self.last_checkpoint} if newer ones exist)")

  def _start_timer(self) -> None:
    self._timer_start, self._timer_steps = time.perf_counter(), 0

  def log(self) -> None:
    self._fetch()
    if not self.fetched:
      return
    scalars, counts = metrics_lib.summarize(self.fetched)
    if self._timer_start is not None and self._timer_steps:
      scalars.update(metrics_lib.perf_scalars(
          steps=self._timer_steps, tokens=self._timer_steps * self.tokens_per_step,
          seconds=time.perf_counter() - self._timer_start, num_devices=jax.device_count(),
          flops_per_token=self.flops_per_token, peak_flops=self.peak_flops))
    else:
      scalars["perf/step_time_s"] = float("nan")
    scalars["train/skipped_steps"] = float(self.skipped_total)
    self.dead_window.observe(self.fetched)
    scalars.update(self.dead_window.scalars())
    self.s.writer.scalars(self.step, scalars)
    self.s.writer.expert_histograms(self.step, counts)
    if jax.process_index() == 0:
      eta = (self.t.num_steps - self.step) * scalars["perf/step_time_s"]
      metrics_lib.log_line(metrics_lib.console_line(
          self.step, self.t.num_steps, scalars, elapsed_s=time.perf_counter() - self.run_start,
          eta_s=eta))
    self.last_scalars = scalars
    self.fetched = []
    self._start_timer()

  def evaluate(self, stop: Optional[StopRequest] = None) -> None:
    try:
      self._evaluate()
    except Exception:  # pylint: disable=broad-except
      if stop is None or stop.signum is None:
        raise
      # A job-wide SIGTERM also kills the compiler's subprocesses (ptxas): skip this evaluation;
      # the loop saves the (intact) state at the next step boundary.
      logging.warning("evaluation at step %d interrupted by the stop request", self.step)

  def _evaluate(self) -> None:
    t0 = time.perf_counter()
    batches = (sharding_lib.global_batch(b, self.s.mesh, self.s.rules) for b in self.s.eval_batches)
    result = perplexity.evaluate(self.s.programs.eval_fn, self.state.params, batches)
    self.s.writer.scalars(self.step, {"eval/loss": result["loss"],
                                      "eval/perplexity": result["perplexity"]})
    if jax.process_index() == 0:
      metrics_lib.log_line(f"eval step {self.step}: loss {result['loss']:.4f} | ppl "
                           f"{result['perplexity']:.2f} | {result['tokens']:,.0f} tokens | "
                           f"{time.perf_counter() - t0:.1f} s")
    if self.routing_probe is not None:
      self.routing_probe.log(self.step, self.state.params, self.s.writer)
    self.last_eval = {"step": self.step, **result}

  def save(self) -> bool:
    """Saves the current step if the save guard passes it; False (with a warning) if not."""
    if self.step == self.last_saved:
      return True
    if self.refused is not None and self.refused[0] == self.step:
      return False
    self._fetch()  # never checkpoint past a non-finite step in "stop" mode
    problem = self.guard.check()
    self.guard.commit(passed=problem is None)
    ckpt = self.s.checkpointer
    if problem is not None:
      self.refused = (self.step, problem)
      ckpt.protect(self.last_checkpoint)
      kept = ("" if self.last_checkpoint is None else
              f"; step {self.last_checkpoint}, the last checkpoint that passed, is kept out of "
              "rotation")
      logging.warning("not saving checkpoint step %d: %s%s", self.step, problem, kept)
      return False
    metadata = {"guard": self.guard.metadata(), "protected_step": ckpt.protected,
                "restored_from": self.s.restored_from}
    if self.s.lock is not None:
      self.s.lock.check()  # another run took the workdir over: never save over its checkpoints
    ckpt.save(self.step, state_lib.checkpoint_tree(self.state), self.s.train_iter, metadata)
    self.last_saved = self.last_checkpoint = self.step
    self.refused = None
    return True

  def _refused_error(self) -> DivergenceError:
    step, problem = self.refused
    return DivergenceError(f"the state at step {step} failed the pre-save check ({problem}) and "
                           f"was not saved; {self._last_checkpoint_advice()}")

  # -- loop ------------------------------------------------------------------------------------

  def train(self, stop: StopRequest) -> bool:
    """Runs to train.num_steps; returns True if stopped early by a signal (after saving)."""
    t, ck = self.t, self.s.config.checkpoint
    if self.step == 0 and t.eval_every:
      self.evaluate(stop)
    first = True
    while self.step < t.num_steps:
      if stop.requested(self.step) or self.s.checkpointer.manager.reached_preemption(self.step):
        self.log()
        if not self.save():
          raise self._refused_error()
        logging.warning("stopped at step %d on request; checkpoint saved", self.step)
        return True
      try:
        host_batch = next(self.s.train_iter)
      except StopIteration:
        self.log()
        self.save()
        raise DataError(f"the training data ran out after data.num_epochs="
                        f"{self.s.config.data.num_epochs} epoch(s), at step {self.step} of "
                        f"train.num_steps={t.num_steps}",
                        hint="set data.num_epochs=None (repeat) or lower train.num_steps") from None
      batch = sharding_lib.global_batch(host_batch, self.s.mesh, self.s.rules)
      self.profiler.before(self.step + 1, self.state)
      try:
        self.state, m = self.s.programs.train_fn(self.state, batch)
      except Exception:  # pylint: disable=broad-except
        if first and stop.signum is not None:
          # A job-wide SIGTERM also kills the compiler's subprocesses (ptxas), so the first step
          # of a run can fail while compiling; nothing was trained yet, so nothing new to save.
          logging.warning("interrupted while compiling the first step of this run (step %d); "
                          "no new checkpoint", self.step + 1)
          return True
        raise
      self.step += 1
      self.profiler.after(self.step, (self.state, m))
      self.pending.append((self.step, m))
      if first:  # compile + first step: excluded from throughput
        first = False
        jax.block_until_ready(m)
        logging.info("step %d (the first of this run, with compilation) done", self.step)
        self.heap.freeze()
        self._start_timer()
      else:
        self._timer_steps += 1
      if self.step_hook is not None:
        self.step_hook(self.step)
      if self.step % t.log_every == 0 or self.step == t.num_steps:
        self.log()
      if t.eval_every and (self.step % t.eval_every == 0 or self.step == t.num_steps):
        jax.block_until_ready(m)
        paused = time.perf_counter()
        self.evaluate(stop)
        if self._timer_start is not None:
          self._timer_start += time.perf_counter() - paused
      if self.step == t.num_steps:  # a run that applied nothing must not end with a checkpoint
        self._fetch()
        with self._naming_last_checkpoint():
          self.skips.check_some_applied(self.first_step, self.step)
      if self.step % ck.every == 0 or self.step == t.num_steps:
        paused = time.perf_counter()
        self.save()
        if self._timer_start is not None:
          self._timer_start += time.perf_counter() - paused
    if self.refused is not None and self.refused[0] == self.step:
      raise self._refused_error()
    return False


def run(config: Any, workdir: str, *, step_hook: Optional[Callable[[int], None]] = None,
        force_unlock: bool = False) -> dict:
  """Trains `config` in `workdir` (resuming if it holds checkpoints). Returns a summary dict:
  {"step", "stopped" (by a signal), "start" (workdir | init_from | scratch), "eval" (last
  validation result or None), "train" (last logged scalars), "workdir", "checkpoints" (complete
  steps), "elapsed_s"}. Raises one of USER_ERRORS for what a user can fix.

  The run holds the workdir's lock (lock.py) from before setup to its end; `force_unlock` takes it
  from whichever run holds it. `step_hook(step)` is called after each step is dispatched (tests use
  it to send signals).
  """
  t0 = time.perf_counter()
  with contextlib.ExitStack() as stack:
    workdir_lock = stack.enter_context(lock_lib.hold(workdir, command="train.py",
                                                     force=force_unlock))
    s = setup(config, workdir, stack)
    s.lock = workdir_lock
    state, step, start = initial_state(s)
    result = {"step": step, "stopped": False, "start": start, "eval": None, "train": {},
              "workdir": workdir}
    if step >= config.train.num_steps:
      logging.info("nothing to do: %s is at step %d of train.num_steps=%d", workdir, step,
                   config.train.num_steps)
      return dict(result, checkpoints=s.checkpointer.steps(), elapsed_s=time.perf_counter() - t0,
                  nothing_to_do=True)
    if start == "workdir" and s.restored_from == step:
      s.checkpointer.set_aside_newer(step)  # this run continues another branch from `step`
    if start == "workdir":
      warn_schedule_change(workdir, config, step, step - int(jax.device_get(state.skipped)))
    # Only now is anything written: the config fits the start state.
    ckpt_lib.write_config(workdir, config)
    is_main = jax.process_index() == 0
    sink = wandb_writer.WandbWriter.from_config(config, workdir) if is_main else None
    s.writer = metrics_lib.MetricWriter(workdir, tensorboard=config.log.tensorboard,
                                        jsonl=config.log.jsonl, is_main=is_main,
                                        sinks=[sink] if sink is not None else [])
    stack.push(s.writer.__exit__)  # (quiet while another error is reported)
    # What earlier runs logged after `step` is an abandoned branch when this one resumes from an
    # older step: TensorBoard and plot drop it. A run from step 0 logs step 0 again (its evaluation).
    s.writer.start_session(step + 1 if step else 0)
    logging.info("starting at step %d (%s) in %s", step, start, workdir)
    with StopRequest() as stop, sharding_lib.use_mesh(s.mesh, s.rules,
                                                      expert_capacity_factor=s.capacity_factor,
                                                      expert_exchange=s.exchange,
                                                      expert_chunks=s.chunks), \
        profiler_lib.StepProfiler.from_config(config, workdir) as profiler, \
        host_gc.FrozenHeap() as heap:
      trainer = Trainer(s, state, step, step_hook=step_hook, profiler=profiler, heap=heap)
      stopped = trainer.train(stop)
      trainer.log()
    s.checkpointer.wait()  # the last (async) save's failure is this run's error
    return dict(result, step=trainer.step, stopped=stopped, eval=trainer.last_eval,
                train=trainer.last_scalars, checkpoints=s.checkpointer.steps(),
                elapsed_s=time.perf_counter() - t0)


def warn_schedule_change(workdir: str, config: Any, step: int, count: int) -> None:
  """Warns when a run resumes with other learning-rate schedule keys than its config.json says:
  extending a run (train.num_steps) is intended, but it reshapes the rest of the schedule, so the
  learning rate can jump at the resumed step."""
  if jax.process_index() != 0:
    return
  path = storage.join(workdir, ckpt_lib.CONFIG_FILE)
  try:
    saved = json.loads(storage.read_text(path))["train"]
  except (OSError, ValueError, KeyError, TypeError):
    return  # nothing to compare with (written before config.json existed, or removed)
  change = opt_lib.schedule_change(saved, config.train, step, count)
  if change is not None:
    logging.warning("resuming with another learning-rate schedule than %s: %s", path, change)


def summary(result: dict, config: Any) -> list[str]:
  """Closing lines for the console: what the run did and where its outputs are."""
  workdir = storage.abspath(result["workdir"])
  steps = result.get("checkpoints") or []
  how = " (stopped by a signal)" if result["stopped"] else ""
  if result.get("nothing_to_do"):
    lines = [f"nothing to do: {workdir} is already at step {result['step']} of train.num_steps="
             f"{config.train.num_steps} (raise train.num_steps to train on)"]
  else:
    lines = [f"done: step {result['step']} of {config.train.num_steps}{how} in "
             f"{metrics_lib.duration(result.get('elapsed_s'))}"]
  if steps:
    lines.append(f"checkpoints: {storage.join(workdir, ckpt_lib.CHECKPOINT_DIR)} (steps "
                 f"{', '.join(map(str, steps))}; running the same command again resumes from "
                 f"step {steps[-1]})")
  if config.log.tensorboard:
    lines.append(f"TensorBoard logs: {storage.join(workdir, 'tensorboard')} (tensorboard "
                 f"--logdir {workdir})")
  if config.log.jsonl:
    lines.append(f"metrics: {storage.join(workdir, 'metrics.jsonl')}; config: "
                 f"{storage.join(workdir, ckpt_lib.CONFIG_FILE)}")
  return lines
