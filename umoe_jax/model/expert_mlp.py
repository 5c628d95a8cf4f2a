"""The routed experts' forward on raw arrays: the pools' dropless path (`ExpertPool`,
`AoEExpertPool` in `experts`) and each device's part of their expert-parallel routes
(`expert_routes`) run the same functions, so they live below both.
"""
from __future__ import annotations

import jax

from umoe_jax.model.layers import ACTIVATION_FNS
from umoe_jax.ops import dispatch
from umoe_jax.ops.epilogue import FUSABLE_ACTIVATIONS
from umoe_jax.ops.fp8_gmm import in_fp8
from umoe_jax.ops.fused_dispatch import gather_gmm, gmm_combine
from umoe_jax.ops.gmm import gmm


def slot_rows(x: jax.Array, first_slot: int, slots: int) -> jax.Array:
  """x [N, D] as it is, or the K slot rows x[:, first_slot:first_slot + K] of x [N, S, D]."""
  if x.ndim == 3 and (first_slot, x.shape[1]) != (0, slots):
    return x[:, first_slot:first_slot + slots]
  return x


def routed_mlp(x: jax.Array, plan: dispatch.DispatchPlan, gates: jax.Array, w_up: jax.Array,
               w_down: jax.Array, w_gate: jax.Array | None = None, *, activation: str,
               backend: str, first_slot: int = 0, fuse_activation: bool = False,
               fuse_weight_rows: bool = False, fp8: bool = False) -> jax.Array:
  """The pool's routed forward on raw arrays, dispatch fused into the first and last matmul:
  x [N, D] or [N, S, D] (slot k reads x[:, first_slot + k]), gates [N, K], w_up / w_gate
  [E, D, F], w_down [E, F, D] -> [N, D]. `fuse_activation` (`moe.fuse_activation`): a non-gated
  silu / relu pool hands its activation to the last matmul (`gmm_combine(activation=...)`), whose
  backward takes the derivative in a matmul epilogue; `fuse_weight_rows` (`moe.fuse_weight_rows`):
  see `gmm_combine`; `fp8`: FP8 operands in every grouped matmul (train.precision).
  (Also run per device by expert parallelism when the expert axis is 1.)"""
  k = gates.shape[1]
  fused = fuse_activation and w_gate is None and activation in FUSABLE_ACTIVATIONS
  quantized = None
  with jax.named_scope("expert_up"):
    # act(up) in FP8 tiles for the last matmul, from the first one's epilogue, where the last
    # matmul's forward takes FP8 operands
    if fused and fp8 and in_fp8(w_up.shape[-1]):
      up, quantized = gather_gmm(x, w_up, plan, k, backend=backend, first_slot=first_slot, fp8=fp8,
                                 quantize_out=activation)
    else:
      up = gather_gmm(x, w_up, plan, k, backend=backend, first_slot=first_slot, fp8=fp8)
  if fused:
    with jax.named_scope("expert_down"):
      return gmm_combine(up, w_down, plan, gates, backend=backend, activation=activation,
                         fuse_weight_rows=fuse_weight_rows, fp8=fp8, quantized=quantized)
  gate = None
  if w_gate is not None:
    with jax.named_scope("expert_gate"):
      gate = gather_gmm(x, w_gate, plan, k, backend=backend, first_slot=first_slot, fp8=fp8)
  with jax.named_scope("expert_down"):
    return gmm_combine(expert_hidden(up, gate, activation), w_down, plan, gates, backend=backend,
                       fuse_weight_rows=fuse_weight_rows, fp8=fp8)


def expert_hidden(up: jax.Array, gate: jax.Array | None, activation: str) -> jax.Array:
  """The experts' hidden rows [M, F]: act(up), or act(gate) * up for gated (SwiGLU-style) experts."""
  act = ACTIVATION_FNS[activation]
  return act(up) if gate is None else act(gate) * up


def _aoe_hidden(first: jax.Array, up: jax.Array | None, activation: str) -> jax.Array:
  """The hidden rows [M, F] from the factorised projection (and the gated pool's up rows)."""
  return expert_hidden(first, None, activation) if up is None else expert_hidden(up, first, activation)


def aoe_expert_rows(rows, group_sizes, w_a, w_b, w_up, w_down, *, activation: str, backend: str,
                    preferred_element_type=None, fp8: bool = False) -> jax.Array:
  """The AoE experts on rows [M, D] sorted by expert -> [M, D] (also each device's part of the
  expert-parallel forward; `preferred_element_type` for its partial sums)."""
  code = gmm(rows, w_a, group_sizes, backend=backend, fp8=fp8)                      # [M, r]
  first = gmm(code, w_b, group_sizes, backend=backend, fp8=fp8)                     # [M, F]
  up = None if w_up is None else gmm(rows, w_up, group_sizes, backend=backend, fp8=fp8)
  kw = {} if preferred_element_type is None else dict(preferred_element_type=preferred_element_type)
  return gmm(_aoe_hidden(first, up, activation), w_down, group_sizes, backend=backend, fp8=fp8, **kw)


def aoe_routed_mlp(x, plan: dispatch.DispatchPlan, gates, w_a, w_b, w_up, w_down, *,
                   activation: str, backend: str, fp8: bool = False) -> jax.Array:
  """The AoE pool's routed forward, dispatch fused into the first and last matmuls: x [N, D] or
  [N, K, D], gates [N, K] -> [N, D]."""
  k = gates.shape[1]
  with jax.named_scope("expert_code"):
    code = gather_gmm(x, w_a, plan, k, backend=backend, fp8=fp8)                     # [M, r]
  with jax.named_scope("expert_up"):
    first = gmm(code, w_b, plan.group_sizes, backend=backend, fp8=fp8)               # [M, F]
    up = None if w_up is None else gather_gmm(x, w_up, plan, k, backend=backend, fp8=fp8)
  with jax.named_scope("expert_down"):
    return gmm_combine(_aoe_hidden(first, up, activation), w_down, plan, gates, backend=backend,
                       fp8=fp8)
