"""ffn_moe model at tiny scale (see configs/common.py for the family and scale definitions).

Train (checkpoints and TensorBoard logs in the workdir):
  python3 train.py --config=configs/ffn_moe_tiny.py --workdir=runs/ffn_moe_tiny
"""
from configs import common


def get_config():
  return common.experiment("ffn_moe", "tiny")
