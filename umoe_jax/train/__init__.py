"""Training: config sections and checks, optimizer, train state, the jitted step, checkpoints,
metrics and the loop.

    from umoe_jax import train
    train.run(config, workdir)      # what `python train.py --config=... --workdir=...` calls

Modules: config (sections, up-front validation), optimizer (AdamW, schedule, decay mask), state
(TrainState, init, shardings), step (train_step / loss), programs (the jitted init / eval / train
step, cached), setup (everything built before the first step; the start state), checkpoint (the
Orbax Checkpointer), checkpoint_metadata (steps, metadata and shapes read without restoring; the
errors), resume (where a run starts: own checkpoint, init_from, scratch), workdir (layout, checks,
config.json), orbax_noise (quieting Orbax's echoes after a failure), metrics (TensorBoard, JSONL,
console, MFU), loop (the Trainer, `run`).
"""


def run(config, workdir, **kwargs):
  """`umoe_jax.train.loop.run` (imported lazily so that config files stay cheap to load)."""
  from umoe_jax.train.loop import run as _run
  return _run(config, workdir, **kwargs)
