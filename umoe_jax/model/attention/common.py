"""Pieces the attention variants share: their registry and the routed low-rank expert projection.
The causal softmax core they all call is `umoe_jax.model.attention.cores.causal_attention`."""
from __future__ import annotations

from umoe_jax.kinds import ATTENTIONS  # noqa: F401  (the variants' registry)


def projection_kw(cfg, rngs) -> dict:
  """The keyword arguments of an attention module's dense `Linear`s (query, key, value, output and
  latent projections). They keep the compute dtype under train.precision=fp8: their products make
  the attention logits and mixed values, where FP8's rounding moves the training loss (UMoE-base
  0.8% above bf16 by step 1,500 with them in FP8, below bf16 without; docs/training.md). The routed
  experts and the always-on expert (`MLP`) take FP8."""
  return dict(std=cfg.init_std, param_dtype=cfg.param_dtype, compute_dtype=cfg.compute_dtype,
              rngs=rngs, fp8=False)


# Routed low-rank expert projection (pre-mixing queries, post-mixing keys):
#   p_i(x) = x W_res + RMSNorm_r(x W_a^i) W_b^i,  or  x W^i  without a rank (W^i stored as W_b^i).


def low_rank_expert_params(cfg, *, rngs, linear_kw: dict):
  """(res_proj, a [E,D,r], a_norm, b [E,r,Dk]) for `attention.q_lora_rank` = r; without a rank
  (None): (None, None, None, b [E,D,Dk]). Created in this order, so RNG draws are stable."""
  from umoe_jax.model.layers import Linear, RMSNorm, make_param, normal_init
  from umoe_jax.parallel import rules as ax
  att, e, d, dk = cfg.attention, cfg.moe.n_experts, cfg.d_model, cfg.attention.head_dim
  init = normal_init(cfg.init_std)
  if att.q_lora_rank is None:
    return None, None, None, make_param(rngs, init, (e, d, dk), (ax.EXPERT, ax.EMBED, ax.HEAD_DIM),
                                        cfg.param_dtype)
  r = att.q_lora_rank
  res = Linear(d, dk, (ax.EMBED, ax.HEAD_DIM), **linear_kw)
  a = make_param(rngs, init, (e, d, r), (ax.EXPERT, ax.EMBED, ax.LORA), cfg.param_dtype)
  a_norm = (RMSNorm(r, eps=cfg.norm_eps, param_dtype=cfg.param_dtype, rngs=rngs)
            if att.q_lora_norm else None)
  b = make_param(rngs, init, (e, r, dk), (ax.EXPERT, ax.LORA, ax.HEAD_DIM), cfg.param_dtype)
  return res, a, a_norm, b


def low_rank_expert_apply(rows, group_sizes, a, a_norm, b, *, dtype, backend: str, fp8: bool = False,
                          plan=None, slots: int = 1):
  """rows [M, D] sorted by expert -> [M, Dk] (without the residual projection).

  With `plan` (from `make_plan(ids [N, K])`), `rows` are the token rows [N, D] themselves and
  `slots` = K: the first matmul reads them through the plan (`fused_dispatch.gather_gmm`), so the
  sorted [M, D] copy is never written. `fp8`: FP8 operands in the grouped matmuls (train.precision).
  """
  from umoe_jax.ops.fused_dispatch import gather_gmm
  from umoe_jax.ops.gmm import gmm

  def first(w):
    if plan is not None:
      return gather_gmm(rows, w.value.astype(dtype), plan, slots, backend=backend, fp8=fp8)
    return gmm(rows, w.value.astype(dtype), group_sizes, backend=backend, fp8=fp8)

  if a is None:
    return first(b)                                                                  # [M, Dk]
  code = first(a)                                                                    # [M, r]
  if a_norm is not None:
    code = a_norm(code)
  return gmm(code, b.value.astype(dtype), group_sizes, backend=backend, fp8=fp8)    # [M, Dk]
