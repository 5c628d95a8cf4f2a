"""umoe_mla model at base scale (official small-mla-UMoE-1024; see configs/common.py).

Train (checkpoints and TensorBoard logs in the workdir):
  python3 train.py --config=configs/umoe_mla_base.py --workdir=runs/umoe_mla_base
Training step: not measured yet (docs/performance.md, "To measure"; the command for
  a row: python3 bench/train_step.py --runs=umoe_mla_base:single --steps=10).
Written by `python3 -m bench.report` from bench/results/ (every figure with its anchor:
docs/performance.md); do not edit below the first line.
"""
from configs import common


def get_config():
  return common.experiment("umoe_mla", "base")
