"""The Triton launches' FFI route (kernels/triton_launch.py) on a machine without a GPU.

The rewrite is checked on a stand-in primitive whose CUDA lowering emits what jax-triton emits (an
API-version-2 custom call, the launch proto as a binary `backend_config`, input/output aliases),
lowered for CUDA here (no GPU is needed to lower): the op that comes out must be one typed-FFI call
of jaxlib's Triton handler carrying the very same bytes, operands, results and aliases. The GPU test
(tests/gpu/test_triton_launch_gpu.py) runs real kernels both ways.
"""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir

from kernels import triton_launch


def _blob(seed: int, n: int = 300) -> bytes:
  return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _stand_in(blob: bytes):
  """A primitive lowered for CUDA as jax-triton lowers a launch, routed through lower_as_ffi when
  its target name is the route's mark."""
  prim = jax.extend.core.Primitive(f"stand_in_triton_{id(blob)}")
  prim.multiple_results = True
  prim.def_abstract_eval(lambda *args, out_shapes, **_: [
      jax.core.ShapedArray(s.shape, s.dtype) for s in out_shapes])

  def legacy(ctx, *args, custom_call_target_name, out_shapes, input_output_aliases):
    del out_shapes
    return jax.ffi.ffi_lowering(custom_call_target_name, api_version=2, backend_config=blob,
                                operand_output_aliases=dict(input_output_aliases))(ctx, *args)

  def rule(ctx, *args, custom_call_target_name, **params):
    targets = {"umoe_mark_ffi": triton_launch.FFI_TARGET}
    if custom_call_target_name not in targets:
      return legacy(ctx, *args, custom_call_target_name=custom_call_target_name, **params)
    return triton_launch.lower_as_ffi(legacy, ctx, *args, target=targets[custom_call_target_name],
                                      custom_call_target_name="triton_kernel_call", **params)

  mlir.register_lowering(prim, rule, platform="cuda")
  return prim


def _lowered(prim, target: str):
  outs = (jax.ShapeDtypeStruct((16, 24), jnp.bfloat16), jax.ShapeDtypeStruct((5,), jnp.int32))

  def f(x, counts):
    y, c = prim.bind(x, counts, custom_call_target_name=target, out_shapes=outs,
                     input_output_aliases=((1, 1),))
    return y.astype(jnp.float32) * 2.0, c + 1

  x = jax.random.normal(jax.random.key(3), (16, 24), jnp.bfloat16)
  counts = jax.random.randint(jax.random.key(4), (5,), 0, 9)
  return jax.jit(f).trace(x, counts).lower(lowering_platforms=("cuda",))


def _custom_call_ops(lowered) -> list:
  """The custom-call ops of the lowered module's main function."""
  module = lowered.compiler_ir("stablehlo")
  ops = []
  for func in module.body.operations:
    for block in func.regions[0].blocks:
      ops += [op for op in block.operations if op.operation.name == "stablehlo.custom_call"]
  return ops


def _bytes(attr) -> bytes:
  return ir.StringAttr(attr).value_bytes


@pytest.mark.parametrize("mark,target", [("umoe_mark_ffi", triton_launch.FFI_TARGET)])
def test_ffi_route_reemits_the_launch_as_one_typed_ffi_call(mark, target):
  blob = _blob(11 + len(target))
  prim = _stand_in(blob)
  lowered = _lowered(prim, mark)
  ops = _custom_call_ops(lowered)
  assert len(ops) == 1, lowered.as_text()          # the legacy op was replaced, not kept beside it
  attrs = ops[0].operation.attributes
  assert ir.StringAttr(attrs["call_target_name"]).value == target
  assert _bytes(ir.DictAttr(attrs["mhlo.backend_config"])["opaque"]) == blob  # the proto, byte for byte
  assert _bytes(attrs["backend_config"]) == b""
  text = lowered.as_text()
  assert "operand_index = 1" in text and "output_tuple_indices = [1]" in text  # aliases kept
  assert [str(v.type) for v in ops[0].operation.operands] == ["tensor<16x24xbf16>", "tensor<5xi32>"]
  assert [str(v.type) for v in ops[0].operation.results] == ["tensor<16x24xbf16>", "tensor<5xi32>"]


def test_legacy_route_is_left_as_jax_triton_emits_it():
  blob = _blob(12)
  prim = _stand_in(blob)
  ops = _custom_call_ops(_lowered(prim, "triton_kernel_call"))
  assert len(ops) == 1
  attrs = ops[0].operation.attributes
  assert ir.StringAttr(attrs["call_target_name"]).value == "triton_kernel_call"
  assert "mhlo.backend_config" not in attrs
  assert ir.IntegerAttr(attrs["api_version"]).value == 2
  assert _bytes(attrs["backend_config"]) == blob


def test_route_switch_without_a_gpu_jaxlib(monkeypatch):
  # Here (no jax-triton, no CUDA jaxlib) the FFI route cannot be installed: launches keep
  # jax-triton's custom call whatever is asked for, and nothing fails; a bad name fails naming it.
  assert not triton_launch.install()
  for value in ("", "custom_call", "ffi", " FFI "):
    monkeypatch.setenv(triton_launch.ENV_VAR, value)
    assert triton_launch.requested_route() == (value.strip().lower() or "custom_call")
    assert triton_launch.route() == "custom_call"
    assert triton_launch.launch_kwargs() == {}
  monkeypatch.setenv(triton_launch.ENV_VAR, "graph")
  with pytest.raises(ValueError, match="UMOE_TRITON_LAUNCH='graph'"):
    triton_launch.route()
  triton_launch.set_route("ffi")
  try:
    assert triton_launch.requested_route() == "ffi"  # the override wins over the environment
  finally:
    triton_launch.set_route(None)
  with pytest.raises(ValueError, match="valid: custom_call, ffi$"):
    triton_launch.set_route("fast")


def test_lower_as_ffi_refuses_a_launch_without_results():
  class _Empty:
    pass

  with pytest.raises(ValueError, match="without results"):
    triton_launch.lower_as_ffi(lambda ctx, *a, **p: [], _Empty())


def test_bench_counts_triton_calls_inside_command_buffers():
  spec = importlib.util.spec_from_file_location(
      "bench_triton_launch", os.path.join(os.path.dirname(__file__), "..", "bench", "triton_launch.py"))
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  text = "\n".join([
      "HloModule jit_chain, entry_computation_layout={(bf16[8,4]{1,0})->f32[8,4]{1,0}}",
      "%command_buffer (p0: bf16[8,4]) -> bf16[8,4] {",
      '  %a = bf16[8,4]{1,0} custom-call(bf16[8,4]{1,0} %p0), custom_call_target="triton_kernel_call_ffi"',
      '  %b = bf16[8,4]{1,0} custom-call(bf16[8,4]{1,0} %a), custom_call_target="triton_kernel_call_ffi"',
      "}",
      "ENTRY %main.9 (x: bf16[8,4]) -> f32[8,4] {",
      "  %c = bf16[8,4]{1,0} call(bf16[8,4]{1,0} %x), to_apply=%command_buffer",
      '  %d = bf16[8,4]{1,0} custom-call(bf16[8,4]{1,0} %c), custom_call_target="triton_kernel_call"',
      "  ROOT %e = f32[8,4]{1,0} convert(bf16[8,4]{1,0} %d)",
      "}"])
  assert bench.hlo_launch_stats(text) == dict(triton_calls=3, triton_calls_in_command_buffers=2,
                                               command_buffer_calls=1)
