"""`train.precision`: the operand precision of the model's large matmuls in a training run.

  bf16  every matmul in the compute dtype (`model.compute_dtype`), as the model is built anywhere
  fp8   FP8 (e4m3) operands with fine-grained float32 scales, float32 accumulation, outputs in the
        compute dtype, in the forward and input-gradient products (the weight gradients take the
        operands as they are) of the expert grouped matmuls (`umoe_jax.ops.fp8_gmm`), the dense FFN and the always-on experts
        (`umoe_jax.model.layers.fp8_dense`); the attention modules' own projections
        (`umoe_jax.model.attention.common.projection_kw` says why), the router, norms, softmax,
        attention core, embedding and LM head, the parameters and the optimizer state are as in bf16

`model_with_precision` runs in `umoe_jax.train.config.validate`, before anything is built: it
refuses in one ConfigError line what cannot take FP8 here (a TPU, a GPU without FP8 tensor cores, a
gmm backend without FP8 forms) and returns the ModelConfig carrying the precision
(`ModelConfig.matmul_precision`) to the layers. On CPU the FP8 products are emulated (quantised
operands, float32 products): the same values, for tests and small runs.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax

from umoe_jax.config import ConfigError, ModelConfig
from umoe_jax.ops.fp8_gmm import fp8_backend

FP8_CAPABILITY = (8, 9)   # NVIDIA FP8 tensor cores: Ada (8.9), Hopper (9.0) and later


def _capability(device: Any) -> Optional[tuple[int, int]]:
  """A CUDA device's compute capability as (major, minor); None when it reports none."""
  try:
    major, minor = str(getattr(device, "compute_capability", "")).split(".")[:2]
    return int(major), int(minor)
  except ValueError:
    return None


def check_device(device: Any) -> None:
  """ConfigError naming `device` unless it can run train.precision='fp8'."""
  kind = getattr(device, "device_kind", "?")
  if device.platform == "tpu":
    raise ConfigError(f"train.precision='fp8' does not run on TPU (device {kind!r}): FP8 runs on "
                      f"NVIDIA GPUs of compute capability 8.9+ (Ada, Hopper) and emulated on CPU; "
                      f"use train.precision='bf16'")
  if device.platform == "gpu":
    cc = _capability(device)
    if cc is None or cc < FP8_CAPABILITY:
      have = "no compute capability" if cc is None else f"compute capability {cc[0]}.{cc[1]}"
      raise ConfigError(f"train.precision='fp8' needs FP8 tensor cores (NVIDIA compute capability "
                        f"8.9+: Ada, Hopper); GPU {kind!r} has {have}; use train.precision='bf16'")


def _device() -> Any:
  """The device the run trains on (its kind is every device's)."""
  return jax.devices()[0]


def model_with_precision(model: ModelConfig, precision: str) -> ModelConfig:
  """`model` carrying `precision` (train.precision, already one of PRECISIONS); for fp8, first the
  checks of this process's device and of model.gmm_backend."""
  if precision == "fp8":
    check_device(_device())
    try:
      fp8_backend(model.gmm_backend)
    except ValueError as e:  # no FP8 form, or a backend that does not run here
      raise ConfigError(f"model.gmm_backend={model.gmm_backend!r} with train.precision='fp8': "
                        f"{e}") from None
  return dataclasses.replace(model, matmul_precision=precision)
