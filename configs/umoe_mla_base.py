"""umoe_mla model at base scale (official small-mla-UMoE-1024; see configs/common.py)."""
from configs import common


def get_config():
  return common.experiment("umoe_mla", "base")
