"""dense model at base scale (see configs/common.py for the family and scale definitions).

Train (checkpoints and TensorBoard logs in the workdir):
  python3 train.py --config=configs/dense_base.py --workdir=runs/dense_base
Training step on NVIDIA H100 80GB HBM3 (bench/train_step.py, random tokens):
  python3 bench/train_step.py --steps=6 --warmup=2 --compilation_cache_dir=/tmp/jcc --runs=dense_base:single
  62.1 ms a step, 527.4k tokens/s, 41.1% MFU (32 x 1024 tokens, 2026-12-07), result 2026-12-07-h100-80gb-hbm3-tokens_per_s-f7e650fc
Training step on NVIDIA H200 (bench/train_step.py, random tokens):
  python3 bench/train_step.py --runs=dense_base:single --steps=10 --time_limit_s=250
  58.3 ms a step, 562.0k tokens/s, 43.8% MFU (32 x 1024 tokens, 2026-12-05), result 2026-12-05-h200-tokens_per_s-1a2fc4ee
Written by `python3 -m bench.report` from bench/results/ (every figure with its anchor:
docs/performance.md); do not edit below the first line.
"""
from configs import common


def get_config():
  return common.experiment("dense", "base")
