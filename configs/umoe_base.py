"""umoe model at base scale (see configs/common.py for the family and scale definitions).

Training throughput (bench/train_step.py, the trainer's own jitted step on random tokens):
  python3 bench/train_step.py --runs=umoe_base:single --steps=10
Measured: 111.5 ms a step, 293.8k tokens/s, 26.9% MFU (32 x 1024 tokens, one NVIDIA H200), result 2026-12-05-h200-tokens_per_s-d7aad56e
(bench/results/; every current figure, with its anchor: docs/performance.md).
"""
from configs import common


def get_config():
  return common.experiment("umoe", "base")
