"""grain worker processes (data.worker_count > 0): deterministic and resumable. Slow: spawns workers."""
from __future__ import annotations

import json

import pytest

from umoe_jax import data


def _same(a, b) -> bool:
  return all((x["inputs"] == y["inputs"]).all() for x, y in zip(a, b, strict=True))


@pytest.mark.slow
def test_worker_processes_are_deterministic_and_resumable():
  cfg = data.default_data_config()
  cfg.worker_count = 2
  kw = dict(seq_len=64, global_batch_size=4, seed=0)
  it = data.make_train_iterator(cfg, **kw)
  reference = [next(it) for _ in range(10)]
  it.close()

  it = data.make_train_iterator(cfg, **kw)
  first = [next(it) for _ in range(4)]
  state = json.loads(json.dumps(it.get_state()))
  it.close()
  assert _same(first, reference[:4])

  resumed = data.make_train_iterator(cfg, **kw)
  resumed.set_state(state)
  assert _same([next(resumed) for _ in range(6)], reference[4:])
  resumed.close()
