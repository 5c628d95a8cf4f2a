"""PyTorch attention sub-layers of the exported umoe-jax model (`umoe_jax/model/attention`): mha,
premix (UMoE), postmix, moa and switchhead, each with a decoding cache.

Every variant is called as `forward(x, ctx)` with x [B, T, D] (normed) and a `Context` (query and key
positions, the token ids, the layer's expert pool, the layer's cache dict or None) and returns
(y [B, T, D], attention probabilities [B, H, T, S] or None). A cache dict holds per-token tensors
along axis 1; `ctx.extend(name=new)` appends and returns the whole.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import nn

from .umoe_layers import (EMPTY, MLP, Linear, RMSNorm, apply_rope, causal_attention, combine, param,
                          slot_apply)
from .umoe_routers import Router


@dataclasses.dataclass
class Context:
  positions: torch.Tensor                 # [B, T] of the new tokens (EMPTY for padding)
  key_positions: torch.Tensor             # [B, S] of every key (cached + new)
  token_ids: torch.Tensor                 # [B, T]
  cache: Optional[dict] = None            # this layer's cached tensors, or None (no decoding)
  experts: Any = None                     # the layer's expert pool for this sub-layer
  return_probs: bool = False

  def extend(self, **new: torch.Tensor) -> dict:
    if self.cache is None:
      return new
    for name, value in new.items():
      old = self.cache.get(name)
      self.cache[name] = value if old is None else torch.cat([old, value], dim=1)
    return {name: self.cache[name] for name in new}


def _rope(cfg: dict, x, positions):
  return apply_rope(x, positions, cfg["rope_theta"], cfg["rope_layout"])


class MultiHeadAttention(nn.Module):

  def __init__(self, cfg: dict):
    super().__init__()
    att, d = cfg["attention"], cfg["d_model"]
    self.cfg, self.h, self.dk, self.dv = cfg, att["n_heads"], att["head_dim"], att["v_head_dim"]
    self.q_proj = Linear(d, self.h * self.dk)
    self.k_proj = Linear(d, self.h * self.dk)
    self.v_proj = Linear(d, self.h * self.dv)
    self.o_proj = Linear(self.h * self.dv, d)

  def forward(self, x, ctx: Context):
    b, t, _ = x.shape
    q = _rope(self.cfg, self.q_proj(x).reshape(b, t, self.h, self.dk), ctx.positions)
    k = _rope(self.cfg, self.k_proj(x).reshape(b, t, self.h, self.dk), ctx.positions)
    v = self.v_proj(x).reshape(b, t, self.h, self.dv)
    kv = ctx.extend(k=k, v=v)
    out = causal_attention(q, kv["k"], kv["v"], ctx.positions, ctx.key_positions,
                           return_probs=ctx.return_probs)
    o, probs = out if ctx.return_probs else (out, None)
    return self.o_proj(o.reshape(b, t, -1)), probs


def add_low_rank(module: nn.Module, cfg: dict, prefix: str) -> None:
  """Routed low-rank projections p_e(x) = RMSNorm_r(x a[e]) b[e] (without a rank: x b[e]), under
  umoe-jax's names: {prefix}_res_proj, {prefix}_a [E, D, r], {prefix}_a_norm, {prefix}_b [E, r, Dk]."""
  att, e, d, dk = cfg["attention"], cfg["moe"]["n_experts"], cfg["d_model"], cfg["attention"]["head_dim"]
  r = att["q_lora_rank"]
  if r is None:
    module.add_module(f"{prefix}_res_proj", None)
    module.register_parameter(f"{prefix}_a", None)
    module.add_module(f"{prefix}_a_norm", None)
    module.register_parameter(f"{prefix}_b", param(e, d, dk))
  else:
    module.add_module(f"{prefix}_res_proj", Linear(d, dk))
    module.register_parameter(f"{prefix}_a", param(e, d, r))
    module.add_module(f"{prefix}_a_norm", RMSNorm(r, cfg["norm_eps"]) if att["q_lora_norm"] else None)
    module.register_parameter(f"{prefix}_b", param(e, r, dk))


def low_rank_expert(module: nn.Module, prefix: str, e: int, rows: torch.Tensor) -> torch.Tensor:
  a, norm, b = (getattr(module, f"{prefix}_{n}") for n in ("a", "a_norm", "b"))
  if a is None:
    return rows @ b[e]
  code = rows @ a[e]
  return (code if norm is None else norm(code)) @ b[e]


class PreMixAttention(nn.Module):
  """UMoE: routed low-rank queries over one key head mix the hidden states, then the experts."""

  def __init__(self, cfg: dict):
    super().__init__()
    att, moe, d = cfg["attention"], cfg["moe"], cfg["d_model"]
    self.cfg, self.k = cfg, att["top_k"]
    self.router = Router(cfg["attention_router"], d, moe["n_experts"], att["top_k"])
    self.k_proj = Linear(d, att["head_dim"])
    latent = att["latent_dim"]
    self.latent_proj = Linear(d, latent) if latent is not None else None
    self.latent_up = Linear(latent, d) if latent is not None else None
    shared = att["n_shared_experts"]
    self.shared_q_proj = Linear(d, att["head_dim"]) if shared else None
    add_low_rank(self, cfg, "q")
    self.shared_expert = (MLP(d, moe["d_expert"] * shared, moe["activation"], moe["gated"])
                          if shared else None)

  def forward(self, x, ctx: Context):
    b, t, d = x.shape
    ids, gates, mask = self.router(x, ctx.token_ids, expert_pool=ctx.experts)
    n, dk = b * t, self.k_proj.kernel.shape[1]
    flat_ids, flat_mask = ids.reshape(n, -1), None if mask is None else mask.reshape(n, -1)
    q = slot_apply(lambda e, r: low_rank_expert(self, "q", e, r), x.reshape(n, d), flat_ids, flat_mask,
                   dk).reshape(b, t, self.k, -1)
    if self.q_res_proj is not None:
      q = q + self.q_res_proj(x)[:, :, None]
    if self.shared_q_proj is not None:
      q = torch.cat([self.shared_q_proj(x)[:, :, None], q], dim=2)
    q = _rope(self.cfg, q, ctx.positions)
    key = _rope(self.cfg, self.k_proj(x), ctx.positions)
    values = x if self.latent_proj is None else self.latent_proj(x)
    kv = ctx.extend(k=key, v=values)
    mixed = causal_attention(q, kv["k"][:, :, None], kv["v"][:, :, None], ctx.positions,
                             ctx.key_positions)                                 # [B, T, 1+K, D|L]
    if self.latent_up is not None:
      mixed = self.latent_up(mixed)
    n_shared = 1 if self.shared_q_proj is not None else 0
    routed = mixed[:, :, n_shared:].reshape(n, self.k, d)
    y = ctx.experts.route(routed, flat_ids, gates.reshape(n, -1), flat_mask).reshape(b, t, d)
    if self.shared_expert is not None:
      y = y + self.shared_expert(mixed[:, :, 0])
    return y, None


class PostMixAttention(nn.Module):
  """The post-mixing ablation: experts on every token (routed by it), then one query mixes all
  (token, expert) entries."""

  def __init__(self, cfg: dict):
    super().__init__()
    att, moe, d = cfg["attention"], cfg["moe"], cfg["d_model"]
    self.cfg, self.k = cfg, att["top_k"]
    self.router = Router(cfg["attention_router"], d, moe["n_experts"], att["top_k"])
    self.q_proj = Linear(d, att["head_dim"])
    shared = att["n_shared_experts"]
    self.shared_k_proj = Linear(d, att["head_dim"]) if shared else None
    add_low_rank(self, cfg, "k")
    self.shared_expert = (MLP(d, moe["d_expert"] * shared, moe["activation"], moe["gated"])
                          if shared else None)

  def forward(self, x, ctx: Context):
    b, t, d = x.shape
    n, dk = b * t, self.q_proj.kernel.shape[1]
    ids, gates, mask = self.router(x, ctx.token_ids, expert_pool=ctx.experts)
    flat_ids, flat_mask = ids.reshape(n, -1), None if mask is None else mask.reshape(n, -1)
    values = slot_apply(ctx.experts.expert, x.reshape(n, d), flat_ids, flat_mask, d)
    values = (values.float() * gates.reshape(n, -1, 1).float()).to(x.dtype).reshape(b, t, self.k, d)
    keys = slot_apply(lambda e, r: low_rank_expert(self, "k", e, r), x.reshape(n, d), flat_ids,
                      flat_mask, dk).reshape(b, t, self.k, -1)
    if self.k_res_proj is not None:
      keys = keys + self.k_res_proj(x)[:, :, None]
    entries = None if mask is None else mask
    if self.shared_expert is not None:
      values = torch.cat([self.shared_expert(x)[:, :, None], values], dim=2)
      keys = torch.cat([self.shared_k_proj(x)[:, :, None], keys], dim=2)
      if entries is not None:
        entries = torch.cat([torch.ones(b, t, 1, dtype=torch.bool), entries], dim=2)
    keys = _rope(self.cfg, keys, ctx.positions)
    q = _rope(self.cfg, self.q_proj(x), ctx.positions)[:, :, None]
    if entries is None and ctx.cache is not None and "slot_mask" in ctx.cache:
      entries = torch.ones(keys.shape[:3], dtype=torch.bool)
    new = dict(k=keys, v=values) if entries is None else dict(k=keys, v=values, slot_mask=entries)
    kv = ctx.extend(**new)
    keys, values, entries = kv["k"], kv["v"], kv.get("slot_mask")
    s, slots = keys.shape[1], keys.shape[2]
    entry_pos = torch.repeat_interleave(ctx.key_positions, slots, dim=1)
    if entries is not None:
      entry_pos = torch.where(entries.reshape(b, s * slots), entry_pos, EMPTY)
    y = causal_attention(q, keys.reshape(b, s * slots, 1, -1), values.reshape(b, s * slots, 1, d),
                         ctx.positions, entry_pos)[:, :, 0]
    return y, None


class MoAAttention(nn.Module):
  """Mixture of attention heads: per-expert q and o, one shared key and value head."""

  def __init__(self, cfg: dict):
    super().__init__()
    att, d = cfg["attention"], cfg["d_model"]
    e, dk, dv = att["n_experts"], att["head_dim"], att["v_head_dim"]
    self.cfg, self.k, self.dk, self.d = cfg, att["top_k"], dk, d
    self.router = Router(cfg["attention_router"], d, e, att["top_k"])
    self.q_experts = param(e, d, dk)
    self.o_experts = param(e, dv, d)
    self.k_proj = Linear(d, dk)
    self.v_proj = Linear(d, dv)
    shared = att["n_shared_experts"]
    self.shared_q_proj = Linear(d, dk) if shared else None
    self.shared_o_proj = Linear(dv, d) if shared else None

  def forward(self, x, ctx: Context):
    b, t, d = x.shape
    n = b * t
    ids, gates, mask = self.router(x, ctx.token_ids)
    flat_ids, flat_mask = ids.reshape(n, -1), None if mask is None else mask.reshape(n, -1)
    q = slot_apply(lambda e, r: r @ self.q_experts[e], x.reshape(n, d), flat_ids, flat_mask, self.dk)
    q = q.reshape(b, t, self.k, -1)
    if self.shared_q_proj is not None:
      q = torch.cat([self.shared_q_proj(x)[:, :, None], q], dim=2)
    q = _rope(self.cfg, q, ctx.positions)
    key = _rope(self.cfg, self.k_proj(x), ctx.positions)
    kv = ctx.extend(k=key, v=self.v_proj(x))
    o = causal_attention(q, kv["k"][:, :, None], kv["v"][:, :, None], ctx.positions, ctx.key_positions)
    n_shared = 1 if self.shared_q_proj is not None else 0
    routed = slot_apply(lambda e, r: r @ self.o_experts[e], o[:, :, n_shared:].reshape(n, self.k, -1),
                        flat_ids, flat_mask, d)
    y = combine(routed, gates.reshape(n, -1)).reshape(b, t, d)
    if self.shared_o_proj is not None:
      y = y + self.shared_o_proj(o[:, :, 0])
    return y, None


class HeadExperts(nn.Module):
  """SwitchHead's per-head projection MoEs: w [H*E, D_in, D_out], router[h] for head h."""

  def __init__(self, cfg: dict, d_in: int, d_out: int):
    super().__init__()
    att = cfg["attention"]
    self.h, self.e, self.k, self.d_out = att["n_heads"], att["n_experts"], att["top_k"], d_out
    self.router = nn.ModuleList([Router(cfg["attention_router"], cfg["d_model"], self.e, self.k)
                                 for _ in range(self.h)])
    self.w = param(self.h * self.e, d_in, d_out)

  def apply(self, x, token_ids, rows, per_head_input: bool) -> torch.Tensor:
    """Head h's picks (routed by x [B, T, D]) applied to rows [N, D_in] or [N, H, D_in] ->
    [N, H, D_out] (each head's gated sum over its picks)."""
    n = rows.shape[0]
    outs = []
    for h, router in enumerate(self.router):
      ids, gates, mask = router(x, token_ids)
      inputs = rows[:, h] if per_head_input else rows
      y = slot_apply(lambda e, r: r @ self.w[h * self.e + e], inputs, ids.reshape(n, -1),
                     None if mask is None else mask.reshape(n, -1), self.d_out)
      outs.append(combine(y, gates.reshape(n, -1)))
    return torch.stack(outs, dim=1)


class SwitchHeadAttention(nn.Module):

  def __init__(self, cfg: dict):
    super().__init__()
    att, d = cfg["attention"], cfg["d_model"]
    self.cfg, self.h, self.dk, self.dv = cfg, att["n_heads"], att["head_dim"], att["v_head_dim"]
    self.q_proj = Linear(d, self.h * self.dk)
    self.k_proj = Linear(d, self.h * self.dk)
    self.v_experts = HeadExperts(cfg, d, self.dv)
    self.o_experts = HeadExperts(cfg, self.dv, d)

  def forward(self, x, ctx: Context):
    b, t, d = x.shape
    n = b * t
    q = _rope(self.cfg, self.q_proj(x).reshape(b, t, self.h, self.dk), ctx.positions)
    k = _rope(self.cfg, self.k_proj(x).reshape(b, t, self.h, self.dk), ctx.positions)
    v = self.v_experts.apply(x, ctx.token_ids, x.reshape(n, d), per_head_input=False)
    kv = ctx.extend(k=k, v=v.reshape(b, t, self.h, self.dv))
    o = causal_attention(q, kv["k"], kv["v"], ctx.positions, ctx.key_positions)
    y = self.o_experts.apply(x, ctx.token_ids, o.reshape(n, self.h, -1), per_head_input=True)
    return y.sum(1).reshape(b, t, d), None


ATTENTIONS = {"mha": MultiHeadAttention, "premix": PreMixAttention, "postmix": PostMixAttention,
              "moa": MoAAttention, "switchhead": SwitchHeadAttention}
