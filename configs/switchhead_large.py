"""switchhead model at large scale (see configs/common.py for the family and scale definitions)."""
from configs import common


def get_config():
  return common.experiment("switchhead", "large")
