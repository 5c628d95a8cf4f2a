"""dense model at base scale (see configs/common.py for the family and scale definitions).

Training throughput (bench/train_step.py, the trainer's own jitted step on random tokens):
  python3 bench/train_step.py --runs=dense_base:single --steps=10
Measured: 58.7 ms a step, 558.1k tokens/s, 43.5% MFU (32 x 1024 tokens, one NVIDIA H200), result 2026-12-02-h200-tokens_per_s-a1f4200d
(bench/results/; every current figure, with its anchor: docs/performance.md).
"""
from configs import common


def get_config():
  return common.experiment("dense", "base")
