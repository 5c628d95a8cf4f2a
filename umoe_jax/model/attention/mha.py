"""Dense multi-head attention (the dense and FFN-MoE baselines)."""
from __future__ import annotations

import jax
from flax import nnx

from umoe_jax.config import ModelConfig
from umoe_jax.model.attention.common import ATTENTIONS, projection_kw
from umoe_jax.model.attention.cores import causal_attention
from umoe_jax.model.attention.stats import MHAStats
from umoe_jax.model.layers import Linear
from umoe_jax.model.rope import apply_rope
from umoe_jax.parallel import rules as ax


class HeadsQK(nnx.Module):
  """What multi-head layouts share (MHA, SwitchHead): H heads of q, k [.., H, Dk] with RoPE over
  all of Dk, and a cache of k and v [.., H, Dv]. Subclasses add the value and output maps."""


  @classmethod
  def cache_shapes(cls, cfg: ModelConfig) -> dict:
    att = cfg.attention
    return {"k": (att.n_heads, att.head_dim), "v": (att.n_heads, att.v_head_dim)}

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    att = cfg.attention
    self.cfg = cfg
    self.n_heads, self.head_dim, self.v_head_dim = att.n_heads, att.head_dim, att.v_head_dim
    kw = projection_kw(cfg, rngs)
    self.q_proj = Linear(cfg.d_model, att.n_heads * att.head_dim, (ax.EMBED, ax.HEADS), **kw)
    self.k_proj = Linear(cfg.d_model, att.n_heads * att.head_dim, (ax.EMBED, ax.HEADS), **kw)

  def queries_keys(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [B, T, D] -> RoPE'd q, k [B, T, H, Dk]."""
    b, t, _ = x.shape
    rope = dict(theta=self.cfg.rope_theta, layout=self.cfg.rope_layout)
    q = apply_rope(self.q_proj(x).reshape(b, t, self.n_heads, self.head_dim), positions, **rope)
    k = apply_rope(self.k_proj(x).reshape(b, t, self.n_heads, self.head_dim), positions, **rope)
    return q, k


@ATTENTIONS.register("mha")
class MultiHeadAttention(HeadsQK):
  """H heads; q, k [.., H, Dk] with RoPE over all of Dk; v [.., H, Dv]; output projection H*Dv -> D."""

  stats = MHAStats

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    super().__init__(cfg, rngs=rngs)
    kw, h, dv = projection_kw(cfg, rngs), self.n_heads, self.v_head_dim
    self.v_proj = Linear(cfg.d_model, h * dv, (ax.EMBED, ax.HEADS), **kw)
    self.o_proj = Linear(h * dv, cfg.d_model, (ax.HEADS, ax.EMBED), **kw)

  def __call__(self, x: jax.Array, positions: jax.Array, *, experts=None, cache=None,
               route_context=None, return_probs: bool = False):
    """x [B, T, D] -> (y [B, T, D], {}) (+ the updated cache when `cache` is given)
    (+ last, with `return_probs`, the attention probabilities [B, H, T, S] float32)."""
    del experts, route_context  # no routers
    b, t, _ = x.shape
    q, k = self.queries_keys(x, positions)
    v = self.v_proj(x).reshape(b, t, self.n_heads, self.v_head_dim)
    k_pos = positions
    if cache is not None:
      cache = cache.append(k=k, v=v)
      k, v, k_pos = cache.arrays["k"], cache.arrays["v"], cache.key_positions
    o = causal_attention(q, k, v, positions, k_pos, return_probs=return_probs,
                         core=self.cfg.attention.core,
                         core_backward=self.cfg.attention.core_backward)        # [B, T, H, Dv]
    o, probs = o if return_probs else (o, None)
    y = self.o_proj(o.reshape(b, t, -1))
    out = (y, {}) if cache is None else (y, {}, cache)
    return out + (probs,) if return_probs else out
