"""GPU and TPU kernels for umoe-jax. Importing this package registers the kernel backends of
`umoe_jax.ops.gmm`.

Backends:
  "mosaic"    Pallas Mosaic GPU (wgmma + TMA, pipelined), kernels/mgpu_gmm.py      platforms ("gpu",)
  "triton"    Triton through jax-triton, kernels/triton_gmm.py                      platforms ("gpu",)
              (its fused dispatch's fan-ins: kernels/triton_fan_in.py)
  "megablox"  Pallas TPU (JAX's megablox kernels), kernels/megablox_gmm.py          platforms ("tpu",)
              (+ "cpu" under UMOE_PALLAS_TPU_INTERPRET=1: the Pallas interpreter, for tests)

Every import here is guarded: on a CPU-only machine (no Triton, no jax_triton, a jax whose Pallas
Mosaic GPU API differs) importing this package must never fail; a backend whose module cannot load is
simply not registered, and `available()` keeps `auto` off a backend that cannot run here.
"""
from __future__ import annotations

import logging

from umoe_jax.ops import gmm as _gmm_api

from kernels import tuning  # noqa: F401  (pure Python)

_log = logging.getLogger(__name__)

# auto priority: higher wins. Set from the H200 measurements (2026-11-29-h200-fwd_tflops-97a81b91
# and the gmm rows beside it in bench/results/h200.jsonl); megablox is the one TPU kernel (against
# XLA ragged_dot there).
AUTO_PRIORITY = {"triton": 20, "mosaic": 10, "megablox": 10}


def _register(name, module_name, gmm_attr, tgmm_attr, row_index=False, activations=False,
              scaled_row_dot=False, fan_in_module=None):
  if name in _gmm_api.BACKENDS:
    return
  try:
    import importlib
    mod = importlib.import_module(module_name)
  except Exception as e:  # noqa: BLE001  (never break the import on machines without the toolchain)
    _log.debug("gmm backend %s not registered: %r", name, e)
    return
  gather_sum = None
  if fan_in_module is not None:  # the fused dispatch's K-way fan-ins (`GmmBackend.gather_sum`)
    try:
      gather_sum = importlib.import_module(fan_in_module).gather_sum
    except Exception as e:  # noqa: BLE001  (the backend still registers; XLA does the fan-ins)
      _log.debug("fan-in kernel %s not loaded: %r", fan_in_module, e)
  _gmm_api.BACKENDS.register(name)(_gmm_api.GmmBackend(
      gmm=getattr(mod, gmm_attr), tgmm=getattr(mod, tgmm_attr),
      platforms=tuple(getattr(mod, "PLATFORMS", ("gpu",))),
      auto_priority=AUTO_PRIORITY[name], available=mod.available, row_index=row_index,
      fused_activations=tuple(getattr(mod, "FUSED_ACTIVATIONS", ())) if activations else (),
      scaled_row_dot=scaled_row_dot, gather_sum=gather_sum))


_register("triton", "kernels.triton_gmm", "triton_gmm", "triton_tgmm", row_index=True,
          activations=True, scaled_row_dot=True, fan_in_module="kernels.triton_fan_in")
_register("mosaic", "kernels.mgpu_gmm", "mgpu_gmm", "mgpu_tgmm")
_register("megablox", "kernels.megablox_gmm", "megablox_gmm", "megablox_tgmm")
