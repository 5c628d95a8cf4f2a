"""The routed expert pool: E two-matrix MLPs D -> F -> D applied to rows already sorted by expert.

This is the only model code that touches grouped matmuls; it never sorts anything itself (that is
`umoe_jax.ops.dispatch`), so attention and FFN sub-layers can share one pool and one dispatch code.
"""
from __future__ import annotations

import jax
from flax import nnx

from umoe_jax.model.layers import ACTIVATION_FNS, make_param, normal_init
from umoe_jax.ops import dispatch
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
    with jax.named_scope("expert_up"):
      h = gmm(rows.astype(dt), self.w_up.value.astype(dt), group_sizes, backend=self.gmm_backend)
    if self.w_gate is not None:
      with jax.named_scope("expert_gate"):
        g = gmm(rows.astype(dt), self.w_gate.value.astype(dt), group_sizes, backend=self.gmm_backend)
      h = ACTIVATION_FNS[self.activation](g) * h
    else:
      h = ACTIVATION_FNS[self.activation](h)
    with jax.named_scope("expert_down"):
      return gmm(h, self.w_down.value.astype(dt), group_sizes, backend=self.gmm_backend)

  def route(self, x: jax.Array, expert_ids: jax.Array, gates: jax.Array,
            plan: dispatch.DispatchPlan | None = None) -> jax.Array:
    """sum_k gates[n, k] * E_{ids[n, k]}(x[n] or x[n, k]).

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
    return dispatch.apply_experts(x, plan, gates, self)
