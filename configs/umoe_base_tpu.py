"""umoe at base scale for a TPU slice (docs/tpu.md): splash attention, megablox expert matmuls
(model.gmm_backend=auto picks them on TPU), bf16 compute, FSDP over the slice's chips (ICI).

  # on every worker of the slice (gcloud ... --worker=all), workdir on a gcsfuse mount:
  python train.py --config=configs/umoe_base_tpu.py --workdir=/gcs/BUCKET/runs/umoe_base
  # N slices (multi-slice): data parallel across slices over DCN
  ... --config.mesh.data=N
"""
from configs import common


def get_config():
  config = common.experiment("umoe", "base")
  config.model.attention.core = "splash"   # XLA where splash cannot run (decoding, T % 128 != 0)
  config.mesh = dict(data=1, fsdp=-1, tensor=1, expert=1)
  return config
