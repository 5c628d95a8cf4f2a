"""The decoder of an exported umoe-jax model in PyTorch (no transformers needed): umoe-jax's
`CausalLM` at inference, embed -> blocks (pre-norm attention + FFN, the layer's routed expert pool
shared by the two in UMoE) -> RMSNorm -> untied LM head, with parameter names and layouts equal to the
JAX model's (`layers.0.attention.q_proj.kernel` [in, out]); its logits equal the JAX model's in
float32. `modeling_umoe` wraps it for transformers.

Padding: a 0 in `attention_mask` marks a token that is never attended, and the positions count only
the real tokens (as umoe-jax's left-padded decoding). Routers that mix the routing of earlier tokens
(similarity / attention mixing) cannot decode from a cache (`Decoder.decodes` is False).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .umoe_attention import ATTENTIONS, Context
from .umoe_layers import EMPTY, MLP, AoEExpertPool, ExpertPool, RMSNorm, param
from .umoe_routers import Router


class UMoECache:
  """The decoding cache: per layer a dict of per-token tensors (axis 1), the key positions [B, S]."""

  is_compileable = False

  def __init__(self, n_layers: int):
    self.layers: list[dict] = [{} for _ in range(n_layers)]
    self.key_positions: Optional[torch.Tensor] = None

  def get_seq_length(self, layer_idx: int = 0) -> int:
    return 0 if self.key_positions is None else int(self.key_positions.shape[1])


def _pool(cfg: dict, for_ffn: bool):
  moe, router = cfg["moe"], cfg.get("ffn_router") or {}
  if for_ffn and router.get("kind") == "aoe":
    return AoEExpertPool(moe["n_experts"], cfg["d_model"], moe["d_expert"], router["aoe_dim"],
                         moe["activation"], moe["gated"])
  return ExpertPool(moe["n_experts"], cfg["d_model"], moe["d_expert"], moe["activation"], moe["gated"])


class MoEFFN(nn.Module):

  def __init__(self, cfg: dict):
    super().__init__()
    moe, ffn, att = cfg["moe"], cfg["ffn"], cfg["attention"]
    self.router = Router(cfg["ffn_router"], cfg["d_model"], moe["n_experts"], ffn["top_k"])
    # moe.share_always_on: the attention's always-on expert (a copy of its weights here)
    shared = att["n_shared_experts"] if moe["share_always_on"] else ffn["n_shared_experts"]
    self.shared_expert = (MLP(cfg["d_model"], moe["d_expert"] * shared, moe["activation"], moe["gated"])
                          if shared else None)

  def forward(self, x, token_ids, pool, attention_probs=None):
    b, t, d = x.shape
    ids, gates, mask = self.router(x, token_ids, attention_probs=attention_probs, expert_pool=pool)
    n = b * t
    y = pool.route(x.reshape(n, d), ids.reshape(n, -1), gates.reshape(n, -1),
                   None if mask is None else mask.reshape(n, -1)).reshape(b, t, d)
    return y if self.shared_expert is None else y + self.shared_expert(x)


class DenseFFN(nn.Module):

  def __init__(self, cfg: dict):
    super().__init__()
    self.mlp = MLP(cfg["d_model"], cfg["ffn"]["d_ff"], cfg["moe"]["activation"], cfg["moe"]["gated"])

  def forward(self, x, token_ids, pool, attention_probs=None):
    return self.mlp(x)


class DecoderBlock(nn.Module):

  def __init__(self, cfg: dict):
    super().__init__()
    d, eps = cfg["d_model"], cfg["norm_eps"]
    kind, ffn_kind = cfg["attention"]["kind"], cfg["ffn"]["kind"]
    self.attention_norm = RMSNorm(d, eps)
    self.attention = ATTENTIONS[kind](cfg)
    self.ffn_norm = RMSNorm(d, eps) if ffn_kind != "none" else None
    self.ffn = {"dense": DenseFFN, "moe": MoEFFN}[ffn_kind](cfg) if ffn_kind != "none" else None
    att_pool, ffn_pool = kind in ("premix", "postmix"), ffn_kind == "moe"
    separate = att_pool and ffn_pool and not cfg["moe"]["share_pool"]
    self.experts = _pool(cfg, ffn_pool and not separate) if (att_pool or ffn_pool) else None
    self.ffn_experts = _pool(cfg, True) if separate else None
    self.ffn_reads_attention = ffn_pool and self.ffn.router.mixing == "attention"

  def forward(self, h, positions, key_positions, token_ids, cache: Optional[dict]):
    ctx = Context(positions, key_positions, token_ids, cache, self.experts,
                  return_probs=self.ffn_reads_attention)
    a, probs = self.attention(self.attention_norm(h), ctx)
    h = h + a.to(h.dtype)
    if self.ffn is not None:
      pool = self.ffn_experts if self.ffn_experts is not None else self.experts
      h = h + self.ffn(self.ffn_norm(h), token_ids, pool, attention_probs=probs).to(h.dtype)
    return h


class Decoder(nn.Module):
  """input ids [B, T] -> float32 logits [B, T, V]; `cfg` is the exported config's `umoe` dict."""

  def __init__(self, cfg: dict):
    super().__init__()
    self.embed = param(cfg["vocab_size"], cfg["d_model"])
    self.layers = nn.ModuleList([DecoderBlock(cfg) for _ in range(cfg["n_layers"])])
    self.final_norm = RMSNorm(cfg["d_model"], cfg["norm_eps"])
    self.lm_head = param(cfg["d_model"], cfg["vocab_size"])
    routers = [m for m in self.modules() if isinstance(m, Router)]
    self.decodes = all(r.mixing == "none" for r in routers)   # mixing needs every earlier token

  def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
              cache: Optional[UMoECache] = None) -> torch.Tensor:
    """With a `cache` the tokens continue the cached ones (and are appended to it)."""
    b, t = input_ids.shape
    past = 0 if cache is None else cache.get_seq_length()
    if attention_mask is not None:
      real = attention_mask[:, -t:] > 0
      positions = (attention_mask.long().cumsum(-1) - 1)[:, -t:]
      positions = torch.where(real, positions, torch.full_like(positions, EMPTY))
    else:
      positions = (past + torch.arange(t, device=input_ids.device)).expand(b, t)
    key_positions = positions
    if cache is not None and cache.key_positions is not None:
      key_positions = torch.cat([cache.key_positions, positions], dim=1)
    h = self.embed[input_ids]
    for i, layer in enumerate(self.layers):
      h = layer(h, positions, key_positions, input_ids, None if cache is None else cache.layers[i])
    if cache is not None:
      cache.key_positions = key_positions
    return self.final_norm(h).float() @ self.lm_head.float()
