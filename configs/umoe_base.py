"""umoe model at base scale (see configs/common.py for the family and scale definitions).

Train (checkpoints and TensorBoard logs in the workdir):
  python3 train.py --config=configs/umoe_base.py --workdir=runs/umoe_base
Training step on NVIDIA H100 80GB HBM3 (bench/train_step.py, random tokens):
  python3 bench/train_step.py --runs=umoe_base:single --steps=5 --warmup=2 --time_limit_s=185
  123.0 ms a step, 266.5k tokens/s, 24.4% MFU (32 x 1024 tokens, 2026-12-06), result 2026-12-06-h100-80gb-hbm3-tokens_per_s-fb27156a
Training step on NVIDIA H200 (bench/train_step.py, random tokens):
  XLA_FLAGS=--xla_gpu_per_fusion_autotune_cache_dir=/tmp/atc python3 bench/train_step.py --steps=10 --runs=umoe_base:single
  111.5 ms a step, 293.8k tokens/s, 26.9% MFU (2026-12-05), result 2026-12-05-h200-tokens_per_s-d7aad56e
Written by `python3 -m bench.report` from bench/results/ (every figure with its anchor:
docs/performance.md); do not edit below the first line.
"""
from configs import common


def get_config():
  return common.experiment("umoe", "base")
