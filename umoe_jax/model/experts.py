"""The routed expert pool: E two-matrix MLPs D -> F -> D applied to rows already sorted by expert.

This is the only model code that touches grouped matmuls; it never sorts anything itself (that is
`umoe_jax.ops.dispatch`), so attention and FFN sub-layers can share one pool and one dispatch code.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from umoe_jax.model.layers import ACTIVATION_FNS, make_param, normal_init
from umoe_jax.ops import dispatch
from umoe_jax.ops.fused_dispatch import gather_gmm, gmm_combine
from umoe_jax.ops.gmm import gmm
from umoe_jax.parallel import expert_parallel
from umoe_jax.parallel import rules as ax


class ExpertPool(nnx.Module):
  """w_up [E, D, F], w_down [E, F, D]; E_i(z) = act(z @ w_up[i]) @ w_down[i].

  With `gated` also w_gate [E, D, F]: E_i(z) = (act(z @ w_gate[i]) * (z @ w_up[i])) @ w_down[i]
  (SwiGLU for silu).
  """

  def __init__(self, n_experts: int, d_model: int, d_expert: int, *, activation: str, std: float,
               param_dtype, compute_dtype, gmm_backend: str, rngs: nnx.Rngs, gated: bool = False):
    self.n_experts = n_experts
    self.activation = activation
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
      up = gmm(rows, self.w_up.value.astype(dt), group_sizes, backend=self.gmm_backend)
    gate = None
    if self.w_gate is not None:
      with jax.named_scope("expert_gate"):
        gate = gmm(rows, self.w_gate.value.astype(dt), group_sizes, backend=self.gmm_backend)
    with jax.named_scope("expert_down"):
      return gmm(expert_hidden(up, gate, self.activation), self.w_down.value.astype(dt),
                 group_sizes, backend=self.gmm_backend)

  def route(self, x: jax.Array, expert_ids: jax.Array, gates: jax.Array,
            plan: dispatch.DispatchPlan | None = None) -> jax.Array:
    """sum_k gates[n, k] * E_{ids[n, k]}(x[n] or x[n, k]).

    The sort, un-sort and gate-weighted combine are fused into the first and last grouped matmuls
    (`umoe_jax.ops.fused_dispatch`): the same values and gradients as
    `dispatch.apply_experts(x, plan, gates, self)` without the permuted [N*K, D] copies.

    Args:
      x: [N, D] (every slot sees the token) or [N, K, D] (one input per slot, as in pre-mixing).
      expert_ids, gates: [N, K].
      plan: a precomputed dispatch plan for these expert ids (reused by pre-mixing attention).
    Returns:
      [N, D].
    """
    if expert_parallel.is_active():  # under parallel.use_mesh: experts split over the mesh
      return expert_parallel.route_pool(self, x, expert_ids, gates)
    plan = plan if plan is not None else dispatch.make_plan(expert_ids, self.n_experts)
    dt = self.compute_dtype
    return routed_mlp(x.astype(dt), plan, gates, self.w_up.value.astype(dt),
                      self.w_down.value.astype(dt),
                      None if self.w_gate is None else self.w_gate.value.astype(dt),
                      activation=self.activation, backend=self.gmm_backend)


def routed_mlp(x: jax.Array, plan: dispatch.DispatchPlan, gates: jax.Array, w_up: jax.Array,
               w_down: jax.Array, w_gate: jax.Array | None = None, *, activation: str,
               backend: str) -> jax.Array:
  """The pool's routed forward on raw arrays, dispatch fused into the first and last matmul:
  x [N, D] or [N, K, D], gates [N, K], w_up / w_gate [E, D, F], w_down [E, F, D] -> [N, D].
  (Also run per device by expert parallelism when the expert axis is 1.)"""
  k = gates.shape[1]
  with jax.named_scope("expert_up"):
    up = gather_gmm(x, w_up, plan, k, backend=backend)
  gate = None
  if w_gate is not None:
    with jax.named_scope("expert_gate"):
      gate = gather_gmm(x, w_gate, plan, k, backend=backend)
  with jax.named_scope("expert_down"):
    return gmm_combine(expert_hidden(up, gate, activation), w_down, plan, gates, backend=backend)


def expert_hidden(up: jax.Array, gate: jax.Array | None, activation: str) -> jax.Array:
  """The experts' hidden rows [M, F]: act(up), or act(gate) * up for gated (SwiGLU-style) experts."""
  act = ACTIVATION_FNS[activation]
  return act(up) if gate is None else act(gate) * up


class AoEExpertPool(nnx.Module):
  """Autonomy-of-Experts pool (Lv et al., ICML 2025): each expert's activated first projection is
  factorised through a rank r code, W^i = A^i B^i (A^i [D, r], B^i [r, F], nothing in between),
  and the code's norm |x A^i| is the expert's own routing score (`router.kind='aoe'` reads `codes`):

    not gated:  E_i(x) = act((x A^i) B^i) W_down^i                      w_a, w_b, w_down
    gated:      E_i(x) = (act((x A^i) B^i) * (x W_up^i)) W_down^i        + w_up (AoE's factorised W_g)

  The K chosen codes are recomputed by the first grouped matmul (K/E of the scoring cost) instead
  of gathered from the router's [N, E, r] scores. One device only (no multi-device mesh).
  """

  def __init__(self, n_experts: int, d_model: int, d_expert: int, *, rank: int, activation: str,
               std: float, param_dtype, compute_dtype, gmm_backend: str, rngs: nnx.Rngs,
               gated: bool = False):
    self.n_experts = n_experts
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

  def _hidden(self, first: jax.Array, up: jax.Array | None) -> jax.Array:
    """The hidden rows [M, F] from the factorised projection (and the gated pool's up rows)."""
    return expert_hidden(first, None, self.activation) if up is None else expert_hidden(
        up, first, self.activation)

  def __call__(self, rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """rows [M, D] sorted by expert, group_sizes [E] -> [M, D]."""
    dt, backend = self.compute_dtype, self.gmm_backend
    rows = rows.astype(dt)
    code = gmm(rows, self.w_a.value.astype(dt), group_sizes, backend=backend)         # [M, r]
    first = gmm(code, self.w_b.value.astype(dt), group_sizes, backend=backend)        # [M, F]
    up = (None if self.w_up is None
          else gmm(rows, self.w_up.value.astype(dt), group_sizes, backend=backend))
    return gmm(self._hidden(first, up), self.w_down.value.astype(dt), group_sizes, backend=backend)

  def route(self, x: jax.Array, expert_ids: jax.Array, gates: jax.Array,
            plan: dispatch.DispatchPlan | None = None) -> jax.Array:
    """sum_k gates[n, k] * E_{ids[n, k]}(x[n]); x [N, D], expert_ids / gates [N, K] -> [N, D]."""
    if expert_parallel.is_active():  # its routed path (expert_parallel.route_pool) knows w_up only
      raise NotImplementedError("router.kind='aoe' (AoEExpertPool) runs on one device only: the "
                                "multi-device routed path (parallel.expert_parallel) has no AoE pool")
    plan = plan if plan is not None else dispatch.make_plan(expert_ids, self.n_experts)
    dt, backend, k = self.compute_dtype, self.gmm_backend, gates.shape[1]
    x = x.astype(dt)
    with jax.named_scope("expert_code"):
      code = gather_gmm(x, self.w_a.value.astype(dt), plan, k, backend=backend)        # [M, r]
    with jax.named_scope("expert_up"):
      first = gmm(code, self.w_b.value.astype(dt), plan.group_sizes, backend=backend)  # [M, F]
      up = (None if self.w_up is None
            else gather_gmm(x, self.w_up.value.astype(dt), plan, k, backend=backend))
    with jax.named_scope("expert_down"):
      return gmm_combine(self._hidden(first, up), self.w_down.value.astype(dt), plan, gates,
                         backend=backend)
