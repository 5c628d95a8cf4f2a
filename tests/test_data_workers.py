"""grain worker processes (data.worker_count > 0): a resumed iterator continues exactly.

Slow (~30-60 s on 2 cores): every iterator spawns worker processes that import grain.
"""
from __future__ import annotations

import json

import pytest

from umoe_jax import data


@pytest.mark.slow
def test_worker_processes_resume_exactly():
  cfg = data.default_data_config()
  cfg.worker_count = 2
  kw = dict(seq_len=64, global_batch_size=4, seed=0)
  it = data.make_train_iterator(cfg, **kw)
  for _ in range(4):
    next(it)
  state = json.loads(json.dumps(it.get_state()))  # As stored by Orbax.
  reference = [next(it) for _ in range(6)]
  it.close()

  resumed = data.make_train_iterator(cfg, **kw)
  resumed.set_state(state)
  got = [next(resumed) for _ in range(6)]
  resumed.close()
  for a, b in zip(got, reference, strict=True):
    assert (a["inputs"] == b["inputs"]).all() and (a["targets"] == b["targets"]).all()
