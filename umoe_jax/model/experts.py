"""The routed expert pool: E two-matrix MLPs D -> F -> D applied to rows already sorted by expert.

This is the only model code that touches grouped matmuls; it never sorts anything itself (that is
`umoe_jax.ops.dispatch`), so attention and FFN sub-layers can share one pool and one dispatch code.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from umoe_jax.model import expert_routes
# The forward on raw arrays lives in expert_mlp (expert_routes runs it per device); these names stay
# importable from here.
from umoe_jax.model.expert_mlp import (aoe_expert_rows, aoe_routed_mlp, expert_hidden,  # noqa: F401
                                       routed_mlp, slot_rows)
from umoe_jax.model.layers import make_param, normal_init
from umoe_jax.ops import dispatch
from umoe_jax.ops.gmm import gmm
from umoe_jax.parallel import expert_parallel
from umoe_jax.parallel import rules as ax


class ExpertPool(nnx.Module):
  """w_up [E, D, F], w_down [E, F, D]; E_i(z) = act(z @ w_up[i]) @ w_down[i].

  With `gated` also w_gate [E, D, F]: E_i(z) = (act(z @ w_gate[i]) * (z @ w_up[i])) @ w_down[i]
  (SwiGLU for silu). With `fp8` (train.precision=fp8) every grouped matmul takes FP8 operands.
  """

  def __init__(self, n_experts: int, d_model: int, d_expert: int, *, activation: str, std: float,
               param_dtype, compute_dtype, gmm_backend: str, rngs: nnx.Rngs, gated: bool = False,
               fuse_activation: bool = False, fuse_weight_rows: bool = False, fp8: bool = False):
    self.n_experts = n_experts
    self.fp8 = fp8
    self.activation = activation
    self.fuse_activation = fuse_activation
    self.fuse_weight_rows = fuse_weight_rows
    self.compute_dtype = compute_dtype
    self.gmm_backend = gmm_backend
    self.w_up = make_param(rngs, normal_init(std), (n_experts, d_model, d_expert),
                           (ax.EXPERT, ax.EMBED, ax.EXPERT_MLP), param_dtype)
    self.w_down = make_param(rngs, normal_init(std), (n_experts, d_expert, d_model),
                             (ax.EXPERT, ax.EXPERT_MLP, ax.EMBED), param_dtype)
    self.w_gate = (make_param(rngs, normal_init(std), (n_experts, d_model, d_expert),
                              (ax.EXPERT, ax.EMBED, ax.EXPERT_MLP), param_dtype) if gated else None)

  def __call__(self, rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """rows [M, D] sorted by expert, group_sizes [E] -> [M, D]."""
    dt = self.compute_dtype
    rows = rows.astype(dt)
    with jax.named_scope("expert_up"):
      up = gmm(rows, self.w_up.value.astype(dt), group_sizes, backend=self.gmm_backend, fp8=self.fp8)
    gate = None
    if self.w_gate is not None:
      with jax.named_scope("expert_gate"):
        gate = gmm(rows, self.w_gate.value.astype(dt), group_sizes, backend=self.gmm_backend,
                   fp8=self.fp8)
    with jax.named_scope("expert_down"):
      return gmm(expert_hidden(up, gate, self.activation), self.w_down.value.astype(dt),
                 group_sizes, backend=self.gmm_backend, fp8=self.fp8)

  def route(self, x: jax.Array, expert_ids: jax.Array, gates: jax.Array,
            plan: dispatch.DispatchPlan | None = None,
            slot_mask: jax.Array | None = None, first_slot: int = 0) -> jax.Array:
    """sum_k gates[n, k] * E_{ids[n, k]}(x[n] or x[n, first_slot + k]).

    The sort, un-sort and gate-weighted combine are fused into the first and last grouped matmuls
    (`umoe_jax.ops.fused_dispatch`): the same values and gradients as
    `dispatch.apply_experts(x, plan, gates, self)` without the permuted [N*K, D] copies.

    Args:
      x: [N, D] (every slot sees the token) or [N, S, D] (one input per slot, as in pre-mixing:
        slot k reads x[:, first_slot + k]; S >= first_slot + K, e.g. the mixed vectors of the
        always-on head and the K routed ones, read in place).
      expert_ids, gates: [N, K].
      plan: a precomputed dispatch plan for these expert ids (reused by pre-mixing attention;
        made with the same `slot_mask`).
      slot_mask: [N, K] bool, the slots that carry a pick (the router's; None = all). The others
        (gate 0) go through no expert: no grouped-matmul rows, no expert-parallel buffer room.
      first_slot: see x.
    Returns:
      [N, D].
    """
    if expert_parallel.is_active():  # under parallel.use_mesh: experts split over the mesh
      return expert_routes.route_pool(self, slot_rows(x, first_slot, gates.shape[1]), expert_ids,
                                      gates, slot_mask)
    plan = plan if plan is not None else dispatch.make_plan(expert_ids, self.n_experts, slot_mask)
    dt = self.compute_dtype
    return routed_mlp(x.astype(dt), plan, gates, self.w_up.value.astype(dt),
                      self.w_down.value.astype(dt),
                      None if self.w_gate is None else self.w_gate.value.astype(dt),
                      activation=self.activation, backend=self.gmm_backend, first_slot=first_slot,
                      fuse_activation=self.fuse_activation, fuse_weight_rows=self.fuse_weight_rows,
                      fp8=self.fp8)


class AoEExpertPool(nnx.Module):
  """Autonomy-of-Experts pool (Lv et al., ICML 2025): each expert's activated first projection is
  factorised through a rank r code, W^i = A^i B^i (A^i [D, r], B^i [r, F], nothing in between),
  and the code's norm |x A^i| is the expert's own routing score (`router.kind='aoe'` reads `codes`):

    not gated:  E_i(x) = act((x A^i) B^i) W_down^i                      w_a, w_b, w_down
    gated:      E_i(x) = (act((x A^i) B^i) * (x W_up^i)) W_down^i        + w_up (AoE's factorised W_g)

  The K chosen codes are recomputed by the first grouped matmul (K/E of the scoring cost) instead
  of gathered from the router's [N, E, r] scores. Under a mesh the experts split over the expert
  axes like `ExpertPool`'s (`expert_routes.route_aoe_pool`); the scores' einsum over all experts
  is partitioned by XLA.
  """

  def __init__(self, n_experts: int, d_model: int, d_expert: int, *, rank: int, activation: str,
               std: float, param_dtype, compute_dtype, gmm_backend: str, rngs: nnx.Rngs,
               gated: bool = False, fp8: bool = False):
    self.n_experts = n_experts
    self.fp8 = fp8
    self.activation = activation
    self.compute_dtype = compute_dtype
    self.gmm_backend = gmm_backend
    init = normal_init(std)
    self.w_a = make_param(rngs, init, (n_experts, d_model, rank), (ax.EXPERT, ax.EMBED, ax.LORA),
                          param_dtype)
    self.w_b = make_param(rngs, init, (n_experts, rank, d_expert), (ax.EXPERT, ax.LORA, ax.EXPERT_MLP),
                          param_dtype)
    self.w_up = (make_param(rngs, init, (n_experts, d_model, d_expert),
                            (ax.EXPERT, ax.EMBED, ax.EXPERT_MLP), param_dtype) if gated else None)
    self.w_down = make_param(rngs, init, (n_experts, d_expert, d_model),
                             (ax.EXPERT, ax.EXPERT_MLP, ax.EMBED), param_dtype)

  def codes(self, x: jax.Array) -> jax.Array:
    """x [..., D] -> every expert's code x A^i [..., E, r] in float32 (the routing scores' input)."""
    return jnp.einsum("...d,edr->...er", x.astype(jnp.float32), self.w_a.value.astype(jnp.float32))

  def weights(self) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array]:
    """(w_a, w_b, w_up or None, w_down) in the compute dtype."""
    dt = self.compute_dtype
    return (self.w_a.value.astype(dt), self.w_b.value.astype(dt),
            None if self.w_up is None else self.w_up.value.astype(dt), self.w_down.value.astype(dt))

  def __call__(self, rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """rows [M, D] sorted by expert, group_sizes [E] -> [M, D]."""
    return aoe_expert_rows(rows.astype(self.compute_dtype), group_sizes, *self.weights(),
                           activation=self.activation, backend=self.gmm_backend, fp8=self.fp8)

  def route(self, x: jax.Array, expert_ids: jax.Array, gates: jax.Array,
            plan: dispatch.DispatchPlan | None = None,
            slot_mask: jax.Array | None = None, first_slot: int = 0) -> jax.Array:
    """sum_k gates[n, k] * E_{ids[n, k]}(x[n] or x[n, first_slot + k]); x [N, D] or [N, S, D],
    expert_ids / gates [N, K] -> [N, D]; `plan`, `slot_mask`, `first_slot` as in
    `ExpertPool.route`."""
    x = slot_rows(x, first_slot, gates.shape[1])
    if expert_parallel.is_active():  # under parallel.use_mesh: experts split over the mesh
      return expert_routes.route_aoe_pool(self, x, expert_ids, gates, slot_mask)
    plan = plan if plan is not None else dispatch.make_plan(expert_ids, self.n_experts, slot_mask)
    return aoe_routed_mlp(x.astype(self.compute_dtype), plan, gates, *self.weights(),
                          activation=self.activation, backend=self.gmm_backend, fp8=self.fp8)
