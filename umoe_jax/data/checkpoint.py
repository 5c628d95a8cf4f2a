"""Checkpointing the training iterator with Orbax, next to the model state.

The iterator from `make_train_iterator` is a `grain.DatasetIterator`; its state is a small JSON dict
(`it.get_state()` / `it.set_state(state)`). grain ships an Orbax handler for it: on save each process
writes `process_<i>-of-<n>.json` into the item's directory, on restore it reads its own file back into
the iterator *in place*. Restoring needs the same process_count (and the same data config, seed and
worker_count) as the run that saved.

Use it as an extra item of the trainer's CheckpointManager::

    import orbax.checkpoint as ocp
    from umoe_jax import data

    mngr = ocp.CheckpointManager(workdir, item_names=("state", "data"), options=...)
    it = data.make_train_iterator(cfg.data, seq_len=..., global_batch_size=..., seed=...,
                                  process_index=jax.process_index(), process_count=jax.process_count())
    # save (after the step that consumed the last batch):
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                            data=data.save_args(it)))
    # resume: a fresh iterator from the same config, then restore into it
    step = mngr.latest_step()
    restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                          data=data.restore_args(it)))
    # `it` now continues exactly where the saved run was (restored["data"] is `it`).

The grain handler is synchronous, so the state is captured inside `mngr.save(...)` even with async
checkpointing; calling `next(it)` right after `save` returns is safe.
"""
from __future__ import annotations

import grain


def save_args(iterator: grain.DatasetIterator):
  """`grain.checkpoint.CheckpointSave(iterator)`: an Orbax args item for `ocp.args.Composite`."""
  return grain.checkpoint.CheckpointSave(iterator)


def restore_args(iterator: grain.DatasetIterator):
  """`grain.checkpoint.CheckpointRestore(iterator)`: restores the saved position into `iterator`."""
  return grain.checkpoint.CheckpointRestore(iterator)
