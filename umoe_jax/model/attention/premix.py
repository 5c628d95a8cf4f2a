"""Pre-mixing attention MoE (UMoE, arXiv 2505.07260): mix first, then apply FFN-like experts.

For every token t the router picks K experts; expert i gets its own query

    q_i = x W_q_res + RMSNorm_r(x W_a^i) W_b^i        (the RMSNorm is the official code's; Eq. 11 has none)

and one always-on query q_s = x W_q_shared. All queries attend over a single key head K = X W_k (RoPE
over all of d_k) and mix the normed layer input itself (values = X, no value projection):

    m_i = softmax(q_i K^T / sqrt(d_k)) X            [D]
    y   = sum_i g_i E_i(m_i) + E_shared(m_s)

The mixed vector of query i goes to the expert i whose query produced it, so the dispatch plan of the
router is computed once and used twice: for the routed low-rank queries and for the experts.
E_i are the routed experts of the layer's pool (shared with the FFN in UMoE).

MLA-style latent values (`attention.latent_dim` = L, the official `mla=True`, rebuttal): the mixed
values are a latent c = X W_latent [L] instead of X, and one shared map W_up [L, D] after mixing
restores the width: m_i = (softmax(q_i K^T / sqrt(d_k)) X W_latent) W_up. Decoding then caches
d_k + L values per token and layer instead of d_k + D.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from umoe_jax.config import ModelConfig
from umoe_jax.model import expert_routes
from umoe_jax.model.attention.common import (ATTENTIONS, low_rank_expert_apply,
                                             low_rank_expert_params, projection_kw)
from umoe_jax.model.attention.cores import causal_attention
from umoe_jax.model.attention.stats import PreMixStats
from umoe_jax.model.layers import MLP, Linear
from umoe_jax.model.rope import apply_rope
from umoe_jax.model.routers import call_router, make_router
from umoe_jax.ops import dispatch
from umoe_jax.parallel import expert_parallel
from umoe_jax.parallel import rules as ax


@ATTENTIONS.register("premix")
class PreMixAttention(nnx.Module):
  """UMoE attention: routed low-rank expert queries, one key head, values = hidden states."""

  stats = PreMixStats


  @classmethod
  def cache_shapes(cls, cfg: ModelConfig) -> dict:
    """One key head and the values: the hidden state [D], or its MLA latent [L]."""
    return {"k": (cfg.attention.head_dim,), "v": (cfg.attention.latent_dim or cfg.d_model,)}

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    att, moe = cfg.attention, cfg.moe
    self.cfg = cfg
    self.top_k, self.head_dim, self.n_experts = att.top_k, att.head_dim, moe.n_experts
    kw = projection_kw(cfg, rngs)
    d, dk = cfg.d_model, att.head_dim
    self.router = make_router(cfg.router_for("attention"), d, moe.n_experts, att.top_k,
                              param_dtype=cfg.param_dtype, rngs=rngs)
    self.k_proj = Linear(d, dk, (ax.EMBED, ax.HEAD_DIM), **kw)
    if att.latent_dim is not None:
      self.latent_proj = Linear(d, att.latent_dim, (ax.EMBED, ax.LORA), **kw)
      self.latent_up = Linear(att.latent_dim, d, (ax.LORA, ax.EMBED), **kw)
    else:
      self.latent_proj = self.latent_up = None
    self.shared_q_proj = Linear(d, dk, (ax.EMBED, ax.HEAD_DIM), **kw) if att.n_shared_experts else None
    # Routed queries; without a rank, full per-expert W_q^i [E, D, Dk] in q_b (official q_lora_rank=None).
    self.q_res_proj, self.q_a, self.q_a_norm, self.q_b = low_rank_expert_params(
        cfg, rngs=rngs, linear_kw=kw)
    self.shared_expert = (
        MLP(d, moe.d_expert * att.n_shared_experts, activation=moe.activation, gated=moe.gated,
            **{**kw, "fp8": cfg.fp8})
        if att.n_shared_experts else None)

  def _routed_queries(self, x_flat: jax.Array, plan: dispatch.DispatchPlan,
                      expert_ids: jax.Array, slot_mask=None) -> jax.Array:
    """x [N, D] -> per-slot expert queries [N, K, Dk] (without the residual query; zero at the
    slots outside slot_mask [N, K], whose mixed vectors get gate 0)."""
    if expert_parallel.is_active():  # under parallel.use_mesh: q_a / q_b split over the mesh
      return expert_routes.premix_queries(self, x_flat, expert_ids, slot_mask)
    dt = self.cfg.compute_dtype
    q = low_rank_expert_apply(x_flat.astype(dt), plan.group_sizes, self.q_a, self.q_a_norm,
                              self.q_b, dtype=dt, backend=self.cfg.gmm_backend, fp8=self.cfg.fp8,
                              plan=plan, slots=self.top_k)                        # [M, Dk]
    return dispatch.unpermute(q, plan).reshape(x_flat.shape[0], self.top_k, -1)

  def __call__(self, x: jax.Array, positions: jax.Array, *, experts=None, cache=None,
               route_context=None):
    """x [B, T, D] (normed layer input) -> (y [B, T, D], {"attention": RouterOutput}).

    With `cache` (a `LayerCache`) the new key and values are appended to it, the queries attend over
    the whole cache, and the updated cache is returned third.
    """
    if experts is None:
      raise ValueError("pre-mixing attention needs the layer's expert pool (experts=...)")
    b, t, d = x.shape
    n, k = b * t, self.top_k
    x = x.astype(self.cfg.compute_dtype)
    route = call_router(self.router, x, route_context)                            # ids/gates [B,T,K]
    ids, gates = route.expert_ids.reshape(n, k), route.gates.reshape(n, k)
    # Slots without a pick (top-P, SMoE-Dropout: gate 0) get no query rows and no expert rows.
    mask = None if route.slot_mask is None else route.slot_mask.reshape(n, k)
    plan = dispatch.make_plan(ids, self.n_experts, mask)

    with jax.named_scope("queries"):
      q = self._routed_queries(x.reshape(n, d), plan, ids, mask).reshape(b, t, k, -1)  # [B, T, K, Dk]
      if self.q_res_proj is not None:
        q = q + self.q_res_proj(x)[:, :, None, :]
      if self.shared_q_proj is not None:
        q = jnp.concatenate([self.shared_q_proj(x)[:, :, None, :], q], axis=2)    # [B, T, 1+K, Dk]
      rope = dict(theta=self.cfg.rope_theta, layout=self.cfg.rope_layout)
      q = apply_rope(q, positions, **rope)
      key = apply_rope(self.k_proj(x), positions, **rope)[:, :, None, :]          # [B, T, 1, Dk]

    with jax.named_scope("mix"):
      values = x if self.latent_proj is None else self.latent_proj(x)              # [B, T, D or L]
      k_pos = positions
      if cache is not None:
        cache = cache.append(k=key[:, :, 0], v=values)
        key, values = cache.arrays["k"][:, :, None, :], cache.arrays["v"]
        k_pos = cache.key_positions
      mixed = causal_attention(q, key, values[:, :, None, :], positions, k_pos,
                               core=self.cfg.attention.core,
                               core_backward=self.cfg.attention.core_backward)  # [B, T, 1+K, D|L]
      if self.latent_up is not None:
        mixed = self.latent_up(mixed)                                              # [B, T, 1+K, D]

    n_shared = 1 if self.shared_q_proj is not None else 0
    # The routed slots are read in place from [N, 1+K, D] (no copy of the K routed vectors).
    routed = experts.route(mixed.reshape(n, n_shared + k, d), ids, gates, plan, slot_mask=mask,
                           first_slot=n_shared)                                    # [N, D]
    y = routed.reshape(b, t, d)
    if self.shared_expert is not None:
      y = y + self.shared_expert(mixed[:, :, 0])
    return (y, {"attention": route}) if cache is None else (y, {"attention": route}, cache)
