"""One process of a `umoe_jax.train.loop.run` on CPU (launched by tests/test_parallel.py).

Usage: train_worker.py WORKDIR NUM_STEPS LAYOUT   (WORKDIR: a directory or a gs:// URL)   (LAYOUT: mesh sizes, e.g. "fsdp=2,expert=4",
                                                 optionally with ",exchange=ragged")
  With JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID set, the process joins a
  multi-process run first (`distributed.initialize_from_env`, as train.py does). Running it again
  with a larger NUM_STEPS on the same WORKDIR resumes from the latest checkpoint.
  Writes WORKDIR/summary_<process>.json: the run's summary and process info.
"""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from umoe_jax.parallel import distributed  # noqa: E402

distributed.initialize_from_env()

import grain  # noqa: E402
import jax  # noqa: E402

import configs.common  # noqa: E402
from umoe_jax import data as data_lib  # noqa: E402
from umoe_jax import storage  # noqa: E402
from umoe_jax.train import loop  # noqa: E402


class GlobalStreamSlice(grain.DatasetIterator):
  """This process's rows of the *single-process* batch stream.

  The data pipeline shards documents per process (so 1 and 2 processes pack different sequences);
  to compare a multi-process run with a one-process run token for token, every process reads the
  one-process stream and keeps its contiguous block of rows, which is the block of the global
  batch its devices hold (`sharding.global_batch` / make_array_from_process_local_data).
  """

  def __init__(self, parent):
    super().__init__(parent)
    self._it = parent

  def __next__(self):
    batch = next(self._it)
    per = next(iter(batch.values())).shape[0] // jax.process_count()
    lo = jax.process_index() * per
    return {k: v[lo:lo + per] for k, v in batch.items()}

  def get_state(self):
    return self._it.get_state()

  def set_state(self, state):
    self._it.set_state(state)

  def close(self):
    close = getattr(self._it, "close", None)
    if close is not None:
      close()


_real_iterator = data_lib.make_train_iterator


def _one_process_stream(*args, **kwargs):
  kwargs.update(process_index=0, process_count=1)
  return GlobalStreamSlice(_real_iterator(*args, **kwargs))


data_lib.make_train_iterator = _one_process_stream


def config(num_steps: int, layout: str):
  """umoe tiny shrunk (2 layers, d=32, 8 experts so that expert=8 splits them), float32."""
  c = configs.common.experiment("umoe", "tiny")
  m = c.model
  m.n_layers, m.d_model, m.max_seq_len, m.compute_dtype = 2, 32, 64, "float32"
  m.moe.n_experts, m.moe.d_expert = 8, 16
  m.ffn.top_k, m.attention.top_k = 2, 1
  m.attention.head_dim, m.attention.q_lora_rank = 16, 4
  c.train.update(dict(global_batch_size=8, seq_len=32, num_steps=num_steps, learning_rate=3e-3,
                      warmup_steps=2, log_every=1, eval_every=1000, eval_batches=1))
  c.checkpoint.update(dict(every=2, keep=3))
  c.log.routing_probe_batches = 0  # one compile less per process (tested in test_analysis_run)
  settings = dict(kv.split("=") for kv in layout.split(","))
  c.expert_parallel.exchange = settings.pop("exchange", "auto")
  c.mesh = {k: int(v) for k, v in settings.items()}
  return c


def main(workdir: str, num_steps: str, layout: str):
  summary = loop.run(config(int(num_steps), layout), workdir)
  out = dict(summary={k: v for k, v in summary.items() if k in ("step", "start", "stopped")},
             info=distributed.process_info())
  storage.write_text(storage.join(workdir, f"summary_{jax.process_index()}.json"), json.dumps(out))
  if jax.process_count() > 1:
    jax.distributed.shutdown()


if __name__ == "__main__":
  main(*sys.argv[1:4])
