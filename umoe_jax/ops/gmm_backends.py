"""The grouped-matmul backends: `BACKENDS`, one `GmmBackend` per name, and `resolve_backend`, the choice
`backend="auto"` makes.

  xla       jax.lax.ragged_dot_general, anywhere (umoe_jax/ops/ragged.py); its FP8 forms are the
            emulation of umoe_jax/ops/fp8.py
  masked    one dense product per group, masked: an independent cross-check, never picked by auto
  triton    kernels/gmm/triton_gmm.py (NVIDIA sm90 through jax-triton; fan-ins kernels/gmm/triton_fan_in.py;
            FP8 forms kernels/gmm/triton_fp8_gmm.py)
  mosaic    kernels/gmm/mosaic_gmm.py (Pallas Mosaic GPU)
  megablox  kernels/gmm/megablox_gmm.py (Pallas TPU; on CPU too under UMOE_PALLAS_TPU_INTERPRET=1)

The kernel backends are registered the first time a backend is resolved, each only where its module
imports (a machine without Triton, jax_triton or Pallas Mosaic GPU simply lacks it, and a library-only
install has no kernels package at all); `available()` keeps auto off one that cannot run here.
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from umoe_jax.ops import fp8
from umoe_jax.ops.ragged import xla_gmm, xla_tgmm
from umoe_jax.registry import Registry

_log = logging.getLogger(__name__)

GmmFn = Callable[..., jax.Array]


@dataclasses.dataclass(frozen=True)
class GmmBackend:
  """The raw (non-differentiable) operations of one backend.

  Attributes:
    gmm: `(lhs [M,K], rhs [G,K,N], group_sizes [G] int32, *, transpose_rhs: bool, out_dtype) -> [M,N]`
      (with transpose_rhs: lhs [M,N] -> [M,K]).
    tgmm: `(lhs [M,K], rhs [M,N], group_sizes [G] int32, *, num_groups: int, out_dtype) -> [G,K,N]`.
    platforms: platforms ("cpu", "gpu", "tpu") on which the backend runs.
    auto_priority: higher wins when `backend="auto"`; negative never picked automatically.
    available: optional probe (e.g. "is jax_triton importable") checked before `auto` picks it.
    row_index: the ops also take `lhs_index` [M] / `row_scale` [M] / `row_dot` [M, N] (gmm; with
      `row_dot` they return (out, dots [M] float32), dots[r] = <unscaled out[r], row_dot[r]>) and
      `lhs_index` / `rhs_index` / `lhs_scale` [M] (tgmm): operand rows read through an index, rows
      scaled and row dots taken inside the kernel, which lets `umoe_jax.ops.fused_dispatch` skip
      the permuted copies. Others get these done by XLA around the kernel.
    fused_activations: activation names the row-index gmm also takes into its epilogue as
      `epi_act` (with `row_dot`: the dot is taken with act(row_dot) and the output multiplied by
      act'(row_dot)); XLA does this for other names.
    scaled_row_dot: the row-index gmm with `row_dot` and `row_scale` also takes
      `scaled_row_dot=True` and returns (out, dots, scaled [M, N] in row_dot's dtype), scaled[r] =
      act(row_dot[r]) (rounded to its dtype; row_dot[r] without `epi_act`) * row_scale[r], written
      by the epilogue (gmm_combine's weight-gradient rows, `moe.fuse_weight_rows`).
    gather_sum: optional `(rows [M, D], index [N, K] int32, weights [N, K] or None) -> [N, D]`,
      out[n] = sum_k weights[n, k] * rows[index[n, k]] accumulated in float32 (no gradient): the
      fused dispatch's K-way fan-ins (`fused_dispatch._fan_in`); None: XLA's take + sum.
    fp8_gmm: optional `(lhs_q, lhs_scale, rhs_q, rhs_scale, group_sizes, *, transpose_rhs, out_dtype)`,
      the gmm on FP8 operands quantised by `umoe_jax.ops.fp8` (lhs in 1 x 128 tiles along its
      contraction, rhs in 128 x 128 blocks), float32 accumulation; None: no FP8 form (refused under
      train.precision=fp8). `umoe_jax.ops.fp8.emulated_gmm` is the reference and xla's form. With
      `row_index` it also takes `lhs_index` [M] (rows lhs_q[lhs_index] and their scales). The
      weight gradient has no FP8 form: it runs in bf16 by `tgmm` (`umoe_jax.ops.fp8_gmm`).
    fp8_quantize: optional `(x [M, C]) -> (q, scale)`, bit for bit
      `umoe_jax.ops.fp8.quantize_tiles(x, axis=1)`, in one pass over x (XLA's takes two); None:
      that.
    fp8_quantize_blocks: optional `(w [G, K, N] or [K, N]) -> (q, scale)`, bit for bit
      `umoe_jax.ops.fp8.quantize_blocks(w)`, in one pass over w; taken under
      `umoe_jax.ops.fp8_gmm.KERNEL_BLOCKS`.
    fp8_quantize_out: activation names for which `fp8_gmm` also takes `quantize_out=NAME` and
      returns (out, q, scale), (q, scale) the tiles of act(out) (`umoe_jax.ops.epilogue.activate`,
      then `fp8_quantize`) from its epilogue: the next FP8 product's operand
      (`umoe_jax.ops.fp8_gmm.quantized_gmm_out`); others get it by a pass after the product.
  """
  gmm: GmmFn
  tgmm: GmmFn
  platforms: tuple[str, ...]
  auto_priority: int = 0
  available: Callable[[], bool] = lambda: True
  row_index: bool = False
  fused_activations: tuple[str, ...] = ()
  scaled_row_dot: bool = False
  gather_sum: Optional[GmmFn] = None
  fp8_gmm: Optional[GmmFn] = None
  fp8_quantize: Optional[Callable] = None
  fp8_quantize_out: tuple[str, ...] = ()
  fp8_quantize_blocks: Optional[Callable] = None


BACKENDS: Registry[GmmBackend] = Registry("gmm backend")

BACKENDS.register("xla")(GmmBackend(
    gmm=xla_gmm, tgmm=xla_tgmm, platforms=("cpu", "gpu", "tpu"), auto_priority=0,
    fp8_gmm=fp8.emulated_gmm))


def _group_ids(group_sizes, num_rows):
  """Group index of every row [M] (rows past the last group get `G`, i.e. no group)."""
  ends = jnp.cumsum(group_sizes)
  return jnp.searchsorted(ends, jnp.arange(num_rows), side="right")


def _masked_gmm(lhs, rhs, group_sizes, *, transpose_rhs, out_dtype):
  # One dense product per group over all rows, masked: G times the FLOPs, but only O(M*N) memory and
  # nothing but dot + select, so it lowers anywhere. Useful as an independent cross-check.
  ids = _group_ids(group_sizes, lhs.shape[0])
  out_dim = rhs.shape[1] if transpose_rhs else rhs.shape[2]

  def body(g, acc):
    w = rhs[g].T if transpose_rhs else rhs[g]
    part = jnp.dot(lhs, w, preferred_element_type=jnp.float32)
    return acc + jnp.where((ids == g)[:, None], part, 0.0)

  acc = jax.lax.fori_loop(0, rhs.shape[0], body, jnp.zeros((lhs.shape[0], out_dim), jnp.float32))
  return acc.astype(out_dtype)


def _masked_tgmm(lhs, rhs, group_sizes, *, num_groups, out_dtype):
  ids = _group_ids(group_sizes, lhs.shape[0])
  one_hot = (ids[:, None] == jnp.arange(num_groups)[None, :]).astype(lhs.dtype)  # [M, G]
  out = jnp.einsum("mg,mk,mn->gkn", one_hot, lhs, rhs, preferred_element_type=jnp.float32)
  return out.astype(out_dtype)


BACKENDS.register("masked")(GmmBackend(
    gmm=_masked_gmm, tgmm=_masked_tgmm, platforms=("cpu", "gpu", "tpu"), auto_priority=-1))


# The kernel backends: (module, gmm, tgmm, fan-in module or None, row-index and epilogue extras, FP8
# module or None: its FP8_GMM is the backend's fp8_gmm; FP8 quantiser module or None: its
# QUANTIZE_ROWS and QUANTIZE_BLOCKS are the backend's fp8_quantize and fp8_quantize_blocks).
# auto priority, higher wins: set from the H200 measurements (2026-11-29-h200-fwd_tflops-97a81b91
# and the gmm rows beside it in bench/results/h200.jsonl); megablox is the one TPU kernel.
KERNELS = {
    "triton": dict(module="kernels.gmm.triton_gmm", gmm="triton_gmm", tgmm="triton_tgmm", priority=20,
                   fan_in="kernels.gmm.triton_fan_in", row_index=True, activations=True, scaled_row_dot=True,
                   fp8="kernels.gmm.triton_fp8_gmm", fp8_quantize="kernels.gmm.triton_fp8_quant"),
    "mosaic": dict(module="kernels.gmm.mosaic_gmm", gmm="mgpu_gmm", tgmm="mgpu_tgmm", priority=10,
                   fp8="kernels.gmm.mosaic_fp8_gmm"),
    "megablox": dict(module="kernels.gmm.megablox_gmm", gmm="megablox_gmm", tgmm="megablox_tgmm",
                     priority=10),
}
AUTO_PRIORITY = {name: spec["priority"] for name, spec in KERNELS.items()}


def _register_kernel(name: str, module: str, gmm: str, tgmm: str, priority: int, fan_in=None,
                     row_index=False, activations=False, scaled_row_dot=False, fp8=None,
                     fp8_quantize=None) -> None:
  try:
    mod = importlib.import_module(module)
  except Exception as e:  # noqa: BLE001  (never fail on machines without the toolchain)
    _log.debug("gmm backend %s not registered: %r", name, e)
    return
  gather_sum = None
  if fan_in is not None:  # the fused dispatch's K-way fan-ins (`GmmBackend.gather_sum`)
    try:
      gather_sum = importlib.import_module(fan_in).gather_sum
    except Exception as e:  # noqa: BLE001  (the backend still registers; XLA does the fan-ins)
      _log.debug("fan-in kernel %s not loaded: %r", fan_in, e)
  fp8_form, quantize, quantize_out, quantize_blocks = None, None, (), None
  if fp8 is not None:  # the FP8 forms (`GmmBackend.fp8_gmm` / `fp8_quantize` / `fp8_quantize_out`)
    try:
      fp8_module = importlib.import_module(fp8)
      fp8_form = fp8_module.FP8_GMM
      if fp8_quantize is not None:
        quantizers = importlib.import_module(fp8_quantize)
        quantize, quantize_blocks = quantizers.QUANTIZE_ROWS, quantizers.QUANTIZE_BLOCKS
        quantize_out = tuple(getattr(fp8_module, "QUANTIZE_OUT", ()))
    except Exception as e:  # noqa: BLE001  (the backend still registers, without FP8 forms)
      _log.debug("FP8 kernel %s not loaded: %r", fp8, e)
      fp8_form, quantize, quantize_out, quantize_blocks = None, None, (), None
  BACKENDS.register(name)(GmmBackend(
      gmm=getattr(mod, gmm), tgmm=getattr(mod, tgmm),
      platforms=tuple(getattr(mod, "PLATFORMS", ("gpu",))), auto_priority=priority,
      available=mod.available, row_index=row_index,
      fused_activations=tuple(getattr(mod, "FUSED_ACTIVATIONS", ())) if activations else (),
      scaled_row_dot=scaled_row_dot, gather_sum=gather_sum, fp8_gmm=fp8_form,
      fp8_quantize=quantize, fp8_quantize_out=quantize_out, fp8_quantize_blocks=quantize_blocks))


_KERNELS_LOADED = False


def register_builtin_kernels() -> None:
  """Registers the kernel backends of `KERNELS` that import here (once)."""
  global _KERNELS_LOADED
  if _KERNELS_LOADED:
    return
  _KERNELS_LOADED = True
  for name, spec in KERNELS.items():
    if name not in BACKENDS:
      _register_kernel(name, **spec)


def resolve_backend(name: str, platform: Optional[str] = None) -> str:
  """Maps `name` (a backend or "auto") to a concrete backend name for `platform`.

  Raises ValueError naming the backend when it is unknown or cannot run on the platform.
  """
  register_builtin_kernels()
  platform = platform or jax.devices()[0].platform
  if name != "auto":
    backend = BACKENDS.get(name)
    if platform not in backend.platforms:
      raise ValueError(f"gmm backend {name!r} does not run on platform {platform!r} "
                       f"(it runs on {', '.join(backend.platforms)})")
    return name
  return BACKENDS.ranked(platform)[0]
