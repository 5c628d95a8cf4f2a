"""umoe model at large scale (see configs/common.py for the family and scale definitions).

Training throughput (bench/train_step.py, the trainer's own jitted step on random tokens):
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 bench/train_step.py --runs=umoe_large:single --steps=5 --batch=32 --remat=none --in_process
Measured: 694.7 ms a step, 47.2k tokens/s, 33.2% MFU (32 x 1024 tokens, no remat, one NVIDIA H200), result 2026-12-02-h200-tokens_per_s-302cfef3
(bench/results/; every current figure, with its anchor: docs/performance.md).
"""
from configs import common


def get_config():
  return common.experiment("umoe", "large")
