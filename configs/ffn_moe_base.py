"""ffn_moe model at base scale (see configs/common.py for the family and scale definitions).

Training throughput (bench/train_step.py, the trainer's own jitted step on random tokens):
  python3 bench/train_step.py --runs=ffn_moe_base:single --steps=10
Measured: 86.4 ms a step, 379.3k tokens/s, 29.8% MFU (32 x 1024 tokens, one NVIDIA H200), result 2026-12-04-h200-tokens_per_s-ae354880
(bench/results/; every current figure, with its anchor: docs/performance.md).
"""
from configs import common


def get_config():
  return common.experiment("ffn_moe", "base")
