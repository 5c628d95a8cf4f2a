"""How the Triton kernels' launches reach XLA: jax-triton's custom call, or jaxlib's typed-FFI
Triton handler.

jax-triton (0.3.1) lowers `triton_call` to the legacy custom call "triton_kernel_call" (API version
2, the launch proto in `backend_config`), a calling convention XLA is retiring in favour of the
typed FFI. jaxlib registers the same launcher as the typed-FFI handler "triton_kernel_call_ffi"
(the one Pallas' Triton lowering emits), which reads the same compressed launch proto from the
attribute `opaque`. With the FFI route on, jax-triton lowers the launch as before (so it compiles
and caches the kernel exactly as it did) and its custom call is then re-emitted as that FFI call:
the same kernel, grid, aliases and zeroed outputs; only the calling convention changes.

The default stays jax-triton's custom call: on one H200 with jax 0.11.2 the FFI route gives
bit-identical results but costs ~1-2 us more a launch (UMoE-base 122.7 against 119.2 ms a step;
bench/triton_launch.py times both).

The route is chosen when a kernel is traced: `UMOE_TRITON_LAUNCH=custom_call|ffi` in the
environment (default custom_call), or `set_route(...)`.
"""
from __future__ import annotations

import logging
import os

import jax

_log = logging.getLogger(__name__)

FFI_TARGET = "triton_kernel_call_ffi"
# The FFI route keeps the kernels running where XLA takes no legacy (API version 2) custom calls.
ROUTES = ("custom_call", "ffi")
# The custom-call target a launch carries through jax-triton's primitive to take a route other than
# jax-triton's own: jax-triton passes the name through untouched, the lowering below looks for it.
ROUTE_MARKS = {"ffi": "umoe_triton_launch_via_ffi"}
_ROUTE_TARGETS = {"ffi": FFI_TARGET}
_LEGACY_TARGET = "triton_kernel_call"
ENV_VAR = "UMOE_TRITON_LAUNCH"

_route_override: str | None = None
_installed: bool | None = None   # None: not tried yet; then whether the routes exist here


def set_route(route: str | None) -> None:
  """Forces the route for launches traced from now on (None: back to the environment variable)."""
  global _route_override
  if route is not None and route not in ROUTES:
    raise ValueError(f"Triton launch route {route!r}; valid: {', '.join(ROUTES)}")
  _route_override = route


def requested_route() -> str:
  """The route asked for: set_route's, else $UMOE_TRITON_LAUNCH (empty: custom_call)."""
  if _route_override is not None:
    return _route_override
  value = os.environ.get(ENV_VAR, "").strip().lower() or "custom_call"
  if value not in ROUTES:
    raise ValueError(f"{ENV_VAR}={value!r}; valid: {', '.join(ROUTES)}")
  return value


def route() -> str:
  """The route launches traced now take: the requested one where it is installed (a GPU jaxlib
  with the FFI handler, jax-triton importable), else custom_call."""
  wanted = requested_route()
  return wanted if wanted == "custom_call" or install() else "custom_call"


def launch_kwargs() -> dict:
  """Extra keyword arguments for `jax_triton.triton_call` that pick the route."""
  chosen = route()
  return {} if chosen == "custom_call" else {"custom_call_target_name": ROUTE_MARKS[chosen]}


def lower_as_ffi(legacy_rule, ctx, *args, target: str = FFI_TARGET, input_output_aliases=(),
                 **params):
  """Lowers one launch with `legacy_rule` (which emits an API-version-2 custom call whose string
  `backend_config` is the launch proto) and replaces that op by a typed-FFI custom call of `target`
  with the proto as its `opaque` attribute, the same operands, results, layouts and input/output
  aliases. Returns the new op's results."""
  results = legacy_rule(ctx, *args, input_output_aliases=input_output_aliases, **params)
  flat = list(results)
  if not flat:
    raise ValueError("a Triton launch without results cannot be re-emitted as an FFI call")
  legacy = flat[0].owner
  opaque = legacy.attributes["backend_config"]
  rule = jax.ffi.ffi_lowering(target, backend_config={"opaque": opaque},
                              operand_output_aliases=dict(input_output_aliases))
  new = rule(ctx, *args)
  legacy.erase()  # (its results have no uses yet: they were never returned)
  return new


def _ffi_handler():
  """jaxlib's typed-FFI Triton handler (what its registrations hold for FFI_TARGET), or None."""
  try:
    from jax._src.lib import gpu_triton
    cuda_triton = getattr(gpu_triton, "_cuda_triton", None)
    return None if cuda_triton is None else cuda_triton.registrations().get(FFI_TARGET)
  except Exception:  # noqa: BLE001  (an older or CPU-only jaxlib: no FFI route)
    return None


def install() -> bool:
  """Registers the CUDA lowering of jax-triton's primitive that serves all routes, on the first
  call (later calls return its outcome: no second registration, no repeated
  warning per launch). False where the routes cannot exist here (no jax-triton, no FFI handler)."""
  global _installed
  if _installed is None:
    _installed = _install()
  return _installed


def _install() -> bool:
  try:
    from jax._src.interpreters import mlir
    from jax_triton import triton_lib
  except Exception as e:  # noqa: BLE001
    _log.debug("Triton FFI routes unavailable: %r", e)
    return False
  handler = _ffi_handler()
  if handler is None:
    _log.warning("%s asks for an FFI route but this jaxlib registers no %s handler: Triton kernels "
                 "keep jax-triton's custom call", ENV_VAR, FFI_TARGET)
    return False
  legacy_rule = lambda ctx, *a, **p: triton_lib.triton_kernel_call_lowering(  # noqa: E731
      triton_lib.get_cuda_backend, ctx, *a, **p)
  targets = {mark: _ROUTE_TARGETS[name] for name, mark in ROUTE_MARKS.items()}

  def rule(ctx, *args, custom_call_target_name, **params):
    if custom_call_target_name not in targets:
      return legacy_rule(ctx, *args, custom_call_target_name=custom_call_target_name, **params)
    return lower_as_ffi(legacy_rule, ctx, *args, target=targets[custom_call_target_name],
                        custom_call_target_name=_LEGACY_TARGET, **params)

  mlir.register_lowering(triton_lib.triton_kernel_call_p, rule, platform="cuda")
  return True
