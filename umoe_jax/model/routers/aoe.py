"""Autonomy-of-Experts (Lv et al., ICML 2025): no router weights; the experts' own low-rank codes
score them. The scores need the pool's weights, which the block puts into the route context."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from umoe_jax.kinds import ROUTERS
from umoe_jax.model.routers.scoring import ScoreRouter
from umoe_jax.counting import linear


@ROUTERS.register("aoe")
class AoERouter(ScoreRouter):
  """AoE: p_e = |x A^e|_2, the norm of expert e's rank-r code (`AoEExpertPool.codes`, route context
  "expert_pool"); probs = softmax(p) over all E (float32), top-k of probs. The paper's gates, a
  softmax over the K chosen norms, are `router.renormalize=True`; the megablocks code's are False.
  Its balance loss (Eq. 6) is the Switch loss on softmax(p): `router.balance_loss='switch'`.
  No parameters: the codes' A^e belong to the pool (and learn through the gates and the experts).
  Serves an MoE FFN (`model.ffn.router.kind='aoe'`, or `model.router.kind` behind router-free
  attention); the block builds the pool the FFN routes into as an `AoEExpertPool` of rank
  `router.aoe_dim` (default d_model // 3, the paper's best). The logits (z-loss, jitter) are the norms.
  """

  needs_expert_pool = True

  def logits(self, x: jax.Array, *, expert_pool: Optional[nnx.Module] = None,
             **context) -> jax.Array:
    """x [B, T, D] -> the code norms |x A^e| [B, T, E] float32."""
    del context
    if expert_pool is None or not hasattr(expert_pool, "codes"):
      raise ValueError("router.kind='aoe' scores the experts by their own codes: call it with "
                       "expert_pool=<an AoEExpertPool> (the block adds the FFN's pool to the context)")
    codes = expert_pool.codes(x)                                                       # [B, T, E, r]
    # +tiny under the root: its gradient at an all-zero code (a zero input row) would be inf * 0.
    return jnp.sqrt(jnp.sum(jnp.square(codes), axis=-1) + 1e-12)

  @classmethod
  def param_count(cls, cfg, router, n_experts):
    return 0

  @classmethod
  def token_mac_count(cls, cfg, router, n_experts):
    """Every expert's code x A^e (D x r), the norms' input (the codes' weights are the pool's)."""
    return n_experts * linear(cfg.d_model, router.aoe_dim)


def matched_expert_width(d_model: int, d_expert: int, rank: int, gated: bool) -> int:
  """The AoE paper's parameter matching (Eq. 5): the expert width F' that gives an AoE expert
  (rank-r factorised activated projection) the parameters of the SMoE expert of width F it is
  compared with, rounded up (so AoE never has fewer):

    gated (SwiGLU, the paper):  3 D F = D r + r F' + 2 D F'   ->  F' = (3 D F - D r) / (r + 2 D)
    not gated:                  2 D F = D r + r F' + D F'     ->  F' = (2 D F - D r) / (r + D)

  E.g. D = 768, F = 3072, r = 256 (the paper's small models): 3840; D = 1280, F = 5120, r = 400
  (its 4B model): 6470. Use it as `model.moe.d_expert` of the AoE model.
  """
  if not 1 <= rank:
    raise ValueError(f"rank={rank!r} must be >= 1")
  n_mats = 3 if gated else 2
  num = n_mats * d_model * d_expert - d_model * rank
  den = rank + (n_mats - 1) * d_model
  if num <= 0:
    raise ValueError(f"rank={rank} leaves no room for an expert of the parameters of width "
                     f"{d_expert} (d_model={d_model}, gated={gated})")
  return -(-num // den)
