"""moa model at base scale (see configs/common.py for the family and scale definitions).

Train (checkpoints and TensorBoard logs in the workdir):
  python3 train.py --config=configs/moa_base.py --workdir=runs/moa_base
Training step: not measured yet (docs/performance.md, "To measure"; the command for
  a row: python3 bench/train_step.py --runs=moa_base:single --steps=10).
Written by `python3 -m bench.report` from bench/results/ (every figure with its anchor:
docs/performance.md); do not edit below the first line.
"""
from configs import common


def get_config():
  return common.experiment("moa", "base")
