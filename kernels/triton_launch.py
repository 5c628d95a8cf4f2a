"""How the Triton kernels' launches reach XLA: jax-triton's custom call, or jaxlib's typed-FFI
Triton handler.

jax-triton (0.3.1) lowers `triton_call` to the legacy custom call "triton_kernel_call" (API version
2, the launch proto in `backend_config`). XLA:GPU records fusions, cuBLAS and cuDNN calls into CUDA
graphs (command buffers), but of the custom calls only typed-FFI handlers that declare themselves
command-buffer compatible; so each Triton kernel of a step is launched on its own from the host.
jaxlib registers the same launcher as the typed-FFI handler "triton_kernel_call_ffi" (the one
Pallas' Triton lowering emits), which reads the same compressed launch proto from the attribute
`opaque`. With the FFI route on, jax-triton lowers the launch as before (so it compiles and caches
the kernel exactly as it did) and its custom call is then re-emitted as that FFI call: the same
kernel, grid, aliases and zeroed outputs; only the calling convention changes.

Measured on one H200 with jax 0.11.2 (BENCHMARKS.md, runs 54-55): bit-identical results, but the
FFI route is slower, not faster as launches inside a CUDA graph would be (a chain of 48 fusion +
fan-in pairs: 11.4-12.0 against 9.4-10.6 us a pair, also with `--xla_gpu_enable_command_buffer=
+CUSTOM_CALL`; UMoE-base 122.7 against 119.2 ms a step): this XLA does not graph the FFI call, and
the handler costs more per launch. So the route is off by default; it is here for the jaxlib / XLA
versions that do graph it (bench/triton_launch.py times both).

The route is chosen when a kernel is traced: `UMOE_TRITON_FFI=1` in the environment, or
`set_ffi_route(True)`.
"""
from __future__ import annotations

import logging
import os

import jax

_log = logging.getLogger(__name__)

FFI_TARGET = "triton_kernel_call_ffi"
# The custom-call target a launch carries through jax-triton's primitive when it is to take the FFI
# route: jax-triton passes the name through untouched, the lowering below looks for it.
FFI_ROUTE_MARK = "umoe_triton_kernel_call_via_ffi"
_LEGACY_TARGET = "triton_kernel_call"
ENV_VAR = "UMOE_TRITON_FFI"

_route_override: bool | None = None
_installed = False


def set_ffi_route(enabled: bool | None) -> None:
  """Forces the route for launches traced from now on (None: back to the environment variable)."""
  global _route_override
  _route_override = enabled


def ffi_route() -> bool:
  """Whether launches traced now take the FFI route (and it is installed: a GPU jaxlib with the
  handler, jax-triton importable)."""
  wanted = _route_override if _route_override is not None else (
      os.environ.get(ENV_VAR, "0").strip().lower() in ("1", "true", "yes", "on"))
  return bool(wanted) and install()


def launch_kwargs() -> dict:
  """Extra keyword arguments for `jax_triton.triton_call` that pick the route."""
  return {"custom_call_target_name": FFI_ROUTE_MARK} if ffi_route() else {}


def lower_as_ffi(legacy_rule, ctx, *args, input_output_aliases=(), **params):
  """Lowers one launch with `legacy_rule` (which emits an API-version-2 custom call whose string
  `backend_config` is the launch proto) and replaces that op by a typed-FFI custom call of
  FFI_TARGET with the proto as its `opaque` attribute, the same operands, results, layouts and
  input/output aliases. Returns the new op's results."""
  results = legacy_rule(ctx, *args, input_output_aliases=input_output_aliases, **params)
  flat = list(results)
  if not flat:
    raise ValueError("a Triton launch without results cannot be re-emitted as an FFI call")
  legacy = flat[0].owner
  opaque = legacy.attributes["backend_config"]
  rule = jax.ffi.ffi_lowering(FFI_TARGET, backend_config={"opaque": opaque},
                              operand_output_aliases=dict(input_output_aliases))
  new = rule(ctx, *args)
  legacy.erase()  # (its results have no uses yet: they were never returned)
  return new


def _handler_registered() -> bool:
  try:
    from jax._src.lib import gpu_triton
    cuda_triton = getattr(gpu_triton, "_cuda_triton", None)
    return cuda_triton is not None and FFI_TARGET in cuda_triton.registrations()
  except Exception:  # noqa: BLE001  (an older or CPU-only jaxlib: no FFI route)
    return False


def install() -> bool:
  """Registers the CUDA lowering of jax-triton's primitive that serves both routes (once). False
  where the route cannot exist here (no jax-triton, no FFI handler in this jaxlib)."""
  global _installed
  if _installed:
    return True
  try:
    from jax._src.interpreters import mlir
    from jax_triton import triton_lib
  except Exception as e:  # noqa: BLE001
    _log.debug("Triton FFI route unavailable: %r", e)
    return False
  if not _handler_registered():
    _log.warning("%s is set but this jaxlib registers no %s handler: Triton kernels keep jax-triton's "
                 "custom call", ENV_VAR, FFI_TARGET)
    return False
  legacy_rule = lambda ctx, *a, **p: triton_lib.triton_kernel_call_lowering(  # noqa: E731
      triton_lib.get_cuda_backend, ctx, *a, **p)

  def rule(ctx, *args, custom_call_target_name, **params):
    if custom_call_target_name != FFI_ROUTE_MARK:
      return legacy_rule(ctx, *args, custom_call_target_name=custom_call_target_name, **params)
    return lower_as_ffi(legacy_rule, ctx, *args, custom_call_target_name=_LEGACY_TARGET, **params)

  mlir.register_lowering(triton_lib.triton_kernel_call_p, rule, platform="cuda")
  _installed = True
  return True
