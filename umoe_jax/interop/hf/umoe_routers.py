"""PyTorch routers of the exported umoe-jax model at inference (`umoe_jax/model/routers`).

A router maps x [B, T, D] (and the route context: token ids, the attention probabilities of the
block, the FFN's expert pool) to (ids [B, T, K], gates [B, T, K], slot mask [B, T, K] or None).
Inference is the end of training: SMoE-Dropout uses all K slots, StableMoE routes by its distilled
token table (stage 2). Expert choice is refused when the model is exported (it sees later tokens).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from .umoe_layers import param


def top_k_ids(scores: torch.Tensor, k: int) -> torch.Tensor:
  """The k largest of scores [..., E], ties to the lower index (as jax.lax.top_k)."""
  return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def biased_top_k(probs, k: int, renormalize: bool, bias: Optional[torch.Tensor]):
  ids = top_k_ids(probs if bias is None else probs + bias, k)
  gates = torch.gather(probs, -1, ids)
  if renormalize:
    gates = gates / gates.sum(-1, keepdim=True)
  return ids, gates


def top_p_select(probs, p: float, max_k: int, renormalize: bool):
  ids = top_k_ids(probs, max_k)
  top = torch.gather(probs, -1, ids)
  mask = (torch.cumsum(top, -1) - top) < p
  mask[..., 0] = True
  gates = torch.where(mask, top, torch.zeros_like(top))
  if renormalize:
    gates = gates / gates.sum(-1, keepdim=True)
  return ids, gates, mask


def causal_softmax(scores: torch.Tensor) -> torch.Tensor:
  t = scores.shape[-1]
  causal = torch.tril(torch.ones(t, t, dtype=torch.bool, device=scores.device))
  return torch.softmax(torch.where(causal, scores.float(), -math.inf), dim=-1)


def similarity_mix(g, x, temperature: float):
  u = x.float()
  s = causal_softmax(torch.einsum("btd,bsd->bts", u, u) / temperature)
  return torch.einsum("bts,bse->bte", s, g)


def attention_mix(g, attention_probs, sigma: float):
  a = attention_probs.float()                                                    # [B, H, T, S]
  log_a = torch.log(torch.where(a > 0, a, torch.ones_like(a)))
  row_entropy = -(a * log_a).sum(-1)                                              # [B, H, T]
  t = row_entropy.shape[-1]
  running = torch.cumsum(row_entropy, -1) / torch.arange(1, t + 1, dtype=torch.float32)
  head = torch.argmin(running, dim=1)                                             # [B, T]
  index = head[:, None, :, None].expand(-1, 1, -1, a.shape[-1])
  pick = lambda arr: torch.gather(arr, 1, index)[:, 0]                           # noqa: E731
  a_h = pick(a)
  if sigma != 1.0:
    a_h = torch.softmax(torch.where(a_h > 0, pick(log_a) / sigma, -math.inf), dim=-1)
  return torch.einsum("bts,bse->bte", a_h, g)


_FMIX_MASK = 0xFFFFFFFF


def _fmix32(h: torch.Tensor) -> torch.Tensor:
  """murmur3's 32-bit finaliser on uint32 values held in int64."""
  h = h ^ (h >> 16)
  h = (h * 0x85EBCA6B) & _FMIX_MASK
  h = h ^ (h >> 13)
  h = (h * 0xC2B2AE35) & _FMIX_MASK
  return h ^ (h >> 16)


def hash_expert_ids(token_ids: torch.Tensor, n_experts: int, k: int, seed: int) -> torch.Tensor:
  """The hash router's fixed map (`umoe_jax.model.routers.hashing.hash_expert_ids`)."""
  seed_mix = _fmix32(torch.tensor(seed & _FMIX_MASK, dtype=torch.int64))
  base = _fmix32((token_ids.long() * 0x9E3779B1 + seed_mix) & _FMIX_MASK)
  experts = (torch.arange(n_experts, dtype=torch.int64) * 0x27D4EB2F + 0x165667B1) & _FMIX_MASK
  scores = _fmix32(base[..., None] ^ experts) >> 1
  return top_k_ids(scores, k)


class Router(nn.Module):
  """One router of kind `cfg["kind"]`; `cfg` is the sub-layer's resolved router config (a dict)."""

  def __init__(self, cfg: dict, d_model: int, n_experts: int, top_k: int):
    super().__init__()
    self.cfg, self.kind, self.n_experts, self.top_k = cfg, cfg["kind"], n_experts, top_k
    kind = self.kind
    if kind in ("topk_softmax", "topk_sigmoid", "smoe_dropout", "similarity_aware", "attention_aware"):
      self.kernel = param(d_model, n_experts)
    elif kind == "xmoe":
      self.proj = param(d_model, cfg["xmoe_dim"])
      self.expert_embed = param(n_experts, cfg["xmoe_dim"])
      self.log_temperature = param(1) if cfg["xmoe_learn_temperature"] else None
    elif kind == "stablemoe":
      self.centroids = param(n_experts, d_model)
      self.token_embed = param(cfg["stablemoe_vocab_size"], cfg["stablemoe_distill_dim"])
      self.distill_centroids = param(n_experts, cfg["stablemoe_distill_dim"])
    elif kind not in ("hash", "aoe"):
      raise ValueError(f"router kind {kind!r} is not supported by this export")
    has_bias = cfg["bias_update_rate"] > 0 and kind not in ("hash", "stablemoe")
    self.selection_bias = param(n_experts) if has_bias else None

  @property
  def mixing(self) -> str:
    implied = {"similarity_aware": "similarity", "attention_aware": "attention"}.get(self.kind, "none")
    return implied if implied != "none" else self.cfg["mixing"]

  def logits(self, x: torch.Tensor, expert_pool=None) -> torch.Tensor:
    x32 = x.float()
    if self.kind == "xmoe":
      z = x32 @ self.proj.float()
      normalize = lambda v: v / torch.clamp(v.square().sum(-1, keepdim=True).sqrt(), min=1e-12)  # noqa: E731
      scores = normalize(z) @ normalize(self.expert_embed.float()).T
      tau = (torch.exp(self.log_temperature.float()[0]) if self.log_temperature is not None
             else torch.tensor(self.cfg["xmoe_temperature"], dtype=torch.float32))
      return scores / tau
    if self.kind == "aoe":
      return torch.sqrt(expert_pool.codes(x).square().sum(-1) + 1e-12)
    return x32 @ self.kernel.float()

  def forward(self, x: torch.Tensor, token_ids: torch.Tensor, attention_probs=None, expert_pool=None):
    cfg, k = self.cfg, self.top_k
    if self.kind == "hash":
      ids = hash_expert_ids(token_ids, self.n_experts, k, cfg["hash_seed"])
      return ids, torch.full(ids.shape, 1.0 / k, dtype=torch.float32), None
    if self.kind == "stablemoe":
      s = x.float() @ self.centroids.float().T
      d = self.token_embed.float()[token_ids] @ self.distill_centroids.float().T
      ids = top_k_ids(d, k)
      return ids, torch.sigmoid(torch.gather(s, -1, ids)), None
    bias = None if self.selection_bias is None else self.selection_bias.float()
    logits = self.logits(x, expert_pool)
    if self.kind == "topk_sigmoid":
      ids, gates = biased_top_k(torch.sigmoid(logits), k, cfg["renormalize"], bias)
      return ids, gates, None
    probs = torch.softmax(logits, dim=-1)
    if self.mixing == "similarity":
      probs = similarity_mix(probs, x, cfg["similarity_temperature"] or math.sqrt(x.shape[-1]))
    elif self.mixing == "attention":
      probs = attention_mix(probs, attention_probs, cfg["attention_temperature"])
    if cfg["selection"] == "top_p":
      return top_p_select(probs, cfg["top_p"], k, cfg["renormalize"])
    if cfg["selection"] != "top_k":
      raise ValueError(f"router selection {cfg['selection']!r} is not supported by this export")
    ids, gates = biased_top_k(probs, k, cfg["renormalize"], bias)
    return ids, gates, None
