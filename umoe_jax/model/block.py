"""One pre-norm decoder layer: h += Attention(norm(h)); h += FFN(norm(h)).

The block owns the layer's routed expert pool. With `moe.share_pool` (UMoE) the attention and the FFN
sub-layers route into the same `ExpertPool`; otherwise each MoE sub-layer gets its own pool. With
`moe.share_across_layers` the LM builds the pool(s) once and hands the same modules to every block.

Ablation switches wired here (both share modules, so their parameters exist and count once):
  router.share_att_ffn   the FFN router uses the attention router's weights (own top-k, own loss;
                         the two sub-layers' router configs must agree);
  moe.share_always_on    the FFN uses the attention's always-on expert.
With `ffn.kind="none"` the block has no FFN sub-layer (all experts to attention).
"""
from __future__ import annotations

import jax
from flax import nnx

from umoe_jax.config import ModelConfig, router_mixing
from umoe_jax.model.attention import ATTENTIONS
from umoe_jax.model.experts import AoEExpertPool, ExpertPool
from umoe_jax.model.ffn import DenseFFN, MoEFFN
from umoe_jax.model.layers import RMSNorm
from umoe_jax.model.routers import ROUTERS, fold_rng


def make_expert_pool(cfg: ModelConfig, rngs: nnx.Rngs, *,
                     ffn: bool = True) -> ExpertPool | AoEExpertPool:
  """A routed pool; `ffn`: the FFN routes into it (an AoE FFN router makes it an `AoEExpertPool`)."""
  kw = dict(activation=cfg.moe.activation, std=cfg.init_std, param_dtype=cfg.param_dtype,
            compute_dtype=cfg.compute_dtype, gmm_backend=cfg.gmm_backend, rngs=rngs, gated=cfg.moe.gated,
            fp8=cfg.fp8)
  router = cfg.router_for("ffn")
  if ffn and router.kind == "aoe":  # Autonomy-of-Experts: experts with low-rank codes that score them
    return AoEExpertPool(cfg.moe.n_experts, cfg.d_model, cfg.moe.d_expert, rank=router.aoe_dim, **kw)
  return ExpertPool(cfg.moe.n_experts, cfg.d_model, cfg.moe.d_expert,
                    fuse_activation=cfg.moe.fuse_activation,
                    fuse_weight_rows=cfg.moe.fuse_weight_rows, **kw)


def make_expert_pools(cfg: ModelConfig, rngs: nnx.Rngs):
  """(pool of the attention or the FFN, separate FFN pool or None) of one layer."""
  att_pool, ffn_pool = cfg.attention_uses_experts, cfg.ffn_uses_experts
  # A second pool only when both sub-layers route but must not share (an ablation).
  separate = att_pool and ffn_pool and not cfg.moe.share_pool
  experts = (make_expert_pool(cfg, rngs, ffn=ffn_pool and not separate)
             if (att_pool or ffn_pool) else None)
  ffn_experts = make_expert_pool(cfg, rngs, ffn=True) if separate else None
  return experts, ffn_experts


def _share_variables(src: nnx.Module, dst: nnx.Module) -> None:
  """Makes dst use src's parameters (same Variable objects: one set of weights, counted once)."""
  for name, value in list(vars(src).items()):
    if isinstance(value, nnx.Variable):
      setattr(dst, name, value)


class DecoderBlock(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, pools=None):
    """`pools`: (experts, ffn_experts) shared with other layers; None = this layer builds its own."""
    norm = dict(eps=cfg.norm_eps, param_dtype=cfg.param_dtype, rngs=rngs)
    self.attention_norm = RMSNorm(cfg.d_model, **norm)
    self.attention = ATTENTIONS.get(cfg.attention.kind)(cfg, rngs=rngs)
    if cfg.ffn.kind == "none":
      self.ffn_norm = self.ffn = None
    else:
      self.ffn_norm = RMSNorm(cfg.d_model, **norm)
      self.ffn = MoEFFN(cfg, rngs=rngs) if cfg.ffn_uses_experts else DenseFFN(cfg, rngs=rngs)
    if cfg.router.share_att_ffn:
      _share_variables(self.attention.router, self.ffn.router)
    if cfg.moe.share_always_on:
      self.ffn.shared_expert = nnx.data(self.attention.shared_expert)

    self.experts, self.ffn_experts = pools if pools is not None else make_expert_pools(cfg, rngs)
    # router mixing 'attention': the FFN router reads this layer's attention probabilities;
    # router.kind='aoe': it reads the FFN's expert pool (the experts score themselves).
    ffn_router = cfg.router_for("ffn")
    router_cls = ROUTERS.get(ffn_router.kind)
    self.ffn_reads_attention = cfg.ffn_uses_experts and router_mixing(ffn_router) == "attention"
    self.ffn_reads_pool = cfg.ffn_uses_experts and getattr(router_cls, "needs_expert_pool", False)

  def named_routers(self) -> dict[str, nnx.Module]:
    """{route name as in the routes the block returns: router module} of its sub-layers' routers
    (a sub-layer's own `named_routers()`, else its `router` under the name "attention" / "ffn")."""
    out = {}
    for default, sub in (("attention", self.attention), ("ffn", self.ffn)):
      if hasattr(sub, "named_routers"):
        out.update(sub.named_routers())
      elif getattr(sub, "router", None) is not None:
        out[default] = sub.router
    return out

  def __call__(self, h: jax.Array, positions: jax.Array, cache=None, route_context=None):
    """h [B, T, D] -> (h [B, T, D], {router_name: RouterOutput}) (+ the layer's updated cache).

    `route_context`: the extras every router of the layer receives (`routers.route_context`);
    the FFN's also gets "attention_probs" [B, H, T, S] or "expert_pool" when its router kind reads them.
    """
    extra = {"return_probs": True} if self.ffn_reads_attention else {}
    with jax.named_scope("attention"):
      a, att_routes, *rest = self.attention(self.attention_norm(h), positions, experts=self.experts,
                                            cache=cache, route_context=fold_rng(route_context, 0),
                                            **extra)
    ffn_context = fold_rng(route_context, 1)   # its own jitter noise
    if self.ffn_reads_attention:
      ffn_context = {**(ffn_context or {}), "attention_probs": rest.pop()}
    new_cache = rest
    h = h + a.astype(h.dtype)
    ffn_routes = {}
    if self.ffn is not None:
      ffn_pool = self.ffn_experts if self.ffn_experts is not None else self.experts
      if self.ffn_reads_pool:
        ffn_context = {**(ffn_context or {}), "expert_pool": ffn_pool}
      with jax.named_scope("ffn"):
        f, ffn_routes = self.ffn(self.ffn_norm(h), experts=ffn_pool, route_context=ffn_context)
      h = h + f.astype(h.dtype)
    routes = {**att_routes, **ffn_routes}
    return (h, routes) if cache is None else (h, routes, new_cache[0])
