"""ffn_moe model at base scale (see configs/common.py for the family and scale definitions).

Train (checkpoints and TensorBoard logs in the workdir):
  python3 train.py --config=configs/ffn_moe_base.py --workdir=runs/ffn_moe_base
Training step on NVIDIA H100 80GB HBM3 (bench/train_step.py, random tokens):
  python3 bench/train_step.py --steps=6 --warmup=2 --compilation_cache_dir=/tmp/jcc --runs=ffn_moe_base:single
  93.7 ms a step, 349.8k tokens/s, 27.5% MFU (32 x 1024 tokens, 2026-12-07), result 2026-12-07-h100-80gb-hbm3-tokens_per_s-6c29253c
Training step on NVIDIA H200 (bench/train_step.py, random tokens):
  python3 bench/train_step.py --runs=ffn_moe_base:single --steps=10 --time_limit_s=250
  85.8 ms a step, 382.1k tokens/s, 30.0% MFU (32 x 1024 tokens, 2026-12-05), result 2026-12-05-h200-tokens_per_s-21782a13
Written by `python3 -m bench.report` from bench/results/ (every figure with its anchor:
docs/performance.md); do not edit below the first line.
"""
from configs import common


def get_config():
  return common.experiment("ffn_moe", "base")
