"""umoe model at large scale (see configs/common.py for the family and scale definitions).

Train (checkpoints and TensorBoard logs in the workdir):
  python3 train.py --config=configs/umoe_large.py --workdir=runs/umoe_large
Training step on NVIDIA H200 (bench/train_step.py, random tokens):
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 bench/train_step.py --runs=umoe_large:single --steps=5 --batch=32 --remat=none --in_process
  694.7 ms a step, 47.2k tokens/s, 33.2% MFU (2026-12-02), result 2026-12-02-h200-tokens_per_s-302cfef3
Written by `python3 -m bench.report` from bench/results/ (every figure with its anchor:
docs/performance.md); do not edit below the first line.
"""
from configs import common


def get_config():
  return common.experiment("umoe", "large")
