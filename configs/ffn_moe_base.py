"""ffn_moe model at base scale (see configs/common.py for the family and scale definitions).

Train (checkpoints and TensorBoard logs in the workdir):
  python3 train.py --config=configs/ffn_moe_base.py --workdir=runs/ffn_moe_base
Training step on NVIDIA H100 80GB HBM3 (bench/train_step.py, random tokens):
  python3 bench/train_step.py --runs=ffn_moe_base:single --steps=5 --warmup=2 --time_limit_s=225
  94.2 ms a step, 347.8k tokens/s, 27.3% MFU (32 x 1024 tokens, 2026-12-06), result 2026-12-06-h100-80gb-hbm3-tokens_per_s-ecc7fa7a
Training step on NVIDIA H200 (bench/train_step.py, random tokens):
  python3 bench/train_step.py --runs=ffn_moe_base:single --steps=10 --time_limit_s=250
  85.8 ms a step, 382.1k tokens/s, 30.0% MFU (32 x 1024 tokens, 2026-12-05), result 2026-12-05-h200-tokens_per_s-21782a13
Written by `python3 -m bench.report` from bench/results/ (every figure with its anchor:
docs/performance.md); do not edit below the first line.
"""
from configs import common


def get_config():
  return common.experiment("ffn_moe", "base")
