"""What the Pallas TPU kernels (megablox grouped matmul, splash attention) share: the TPU generation of
a device, and the interpreter switch that lets them run on a CPU.

  generation("TPU v5 lite") -> "v5e"     (None for a device that is not a TPU)
  UMOE_PALLAS_TPU_INTERPRET=1            run every Pallas TPU kernel through the Pallas interpreter
                                         (`interpret=True`): on CPU they then stand in for the TPU
                                         (the `megablox` gmm backend registers for CPU too and the
                                         `splash` attention core runs there). Slow: tests only.

`jax.Device.device_kind` of each generation (as reported by the TPU runtime):
  v4 "TPU v4", v5e "TPU v5 lite", v5p "TPU v5" / "TPU v5p", v6e "TPU v6 lite", v7x "TPU7x".
"""
from __future__ import annotations

import contextlib
import os
import re
from typing import Optional

import jax

INTERPRET_ENV = "UMOE_PALLAS_TPU_INTERPRET"

# device_kind -> generation, first match (lower case) wins: "tpu v5 lite" before "tpu v5".
_GENERATIONS: tuple[tuple[str, str], ...] = (
    ("tpu v4 lite", "v4i"), ("tpu v4", "v4"),
    ("tpu v5 lite", "v5e"), ("tpu v5e", "v5e"), ("tpu v5p", "v5p"), ("tpu v5", "v5p"),
    ("tpu v6 lite", "v6e"), ("tpu v6e", "v6e"), ("tpu v6", "v6e"),
    ("tpu7x", "v7x"), ("tpu v7", "v7x"),
)


def generation(device_kind: Optional[str] = None) -> Optional[str]:
  """TPU generation ("v4", "v5e", "v5p", "v6e", "v7x", ...) of `device_kind` (default: the first
  device's), or None when it is not a TPU."""
  kind = (jax.devices()[0].device_kind if device_kind is None else device_kind).lower().strip()
  for prefix, gen in _GENERATIONS:
    if kind.startswith(prefix):
      return gen
  m = re.match(r"tpu ?v?(\d+)", kind)
  return f"v{m.group(1)}" if m else None


def interpret() -> bool:
  """True when UMOE_PALLAS_TPU_INTERPRET is set (to anything but "" or "0")."""
  return os.environ.get(INTERPRET_ENV, "") not in ("", "0")


def runs_here() -> bool:
  """Whether Pallas TPU kernels can run on the default backend: a TPU, or the interpreter."""
  return interpret() or jax.default_backend() == "tpu"


def outside_vma_check():
  """A context in which a library Pallas kernel may be called inside `shard_map(check_vma=True)`.

  There `pallas_call` wants every output's varying mesh axes spelled out (`ShapeDtypeStruct(...,
  manual_axis_type=...)`), which JAX's megablox kernels do not do. The kernels only ever see one
  device's shard, so the check is switched off around the call (JAX's own switch, private: a no-op
  where it is absent) and the caller restores the outputs' varying axes (`ops.varying.vary_like`,
  as `umoe_jax.ops.gmm` does for every backend).
  """
  try:
    from jax._src import config as jax_config
    return jax_config._check_vma(False)  # pylint: disable=protected-access
  except (ImportError, AttributeError):
    return contextlib.nullcontext()
