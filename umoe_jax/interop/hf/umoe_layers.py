"""PyTorch building blocks of the exported umoe-jax model (inference only): norms, linear maps, MLPs,
expert pools, RoPE and the causal attention core.

Weights keep umoe-jax's layouts and names (a `Linear` holds `kernel` [in, out]; a pool `w_up`
[E, D, F]), so a parameter of the JAX model and its tensor here are the same array. Every function
computes what its JAX counterpart does (`umoe_jax/model/...`), in float32 where that one does.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

EMPTY = -1   # the key position of padding or of a slot without a pick: never attended

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": lambda x: F.gelu(x, approximate="tanh"),    # jax.nn.gelu's default
    "relu": F.relu,
    "none": lambda x: x,
}


def param(*shape: int) -> nn.Parameter:
  """An uninitialised parameter: every weight comes from the exported checkpoint."""
  return nn.Parameter(torch.empty(*shape))


class Linear(nn.Module):
  """y = x @ kernel, kernel [in, out]."""

  def __init__(self, d_in: int, d_out: int):
    super().__init__()
    self.kernel = param(d_in, d_out)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    return x @ self.kernel


class RMSNorm(nn.Module):
  """x / rms(x) * scale over the last axis, in float32."""

  def __init__(self, dim: int, eps: float):
    super().__init__()
    self.eps = eps
    self.scale = param(dim)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)
    return (y * self.scale.float()).to(x.dtype)


class MLP(nn.Module):
  """down(act(up(x))), or down(act(gate(x)) * up(x)) when gated."""

  def __init__(self, d_model: int, d_hidden: int, activation: str, gated: bool):
    super().__init__()
    self.act = ACTIVATIONS[activation]
    self.gate = Linear(d_model, d_hidden) if gated else None
    self.up = Linear(d_model, d_hidden)
    self.down = Linear(d_hidden, d_model)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    if self.gate is not None:
      return self.down(self.act(self.gate(x)) * self.up(x))
    return self.down(self.act(self.up(x)))


def slot_apply(fn: Callable[[int, torch.Tensor], torch.Tensor], x: torch.Tensor, ids: torch.Tensor,
               mask: Optional[torch.Tensor], d_out: int) -> torch.Tensor:
  """fn(e, rows) for every (token, slot) pick, grouped by expert e.

  Args: x [N, D] (every slot reads its token) or [N, K, D] (slot k reads x[:, k]); ids [N, K];
  mask [N, K] bool or None (slots without a pick get zeros). Returns [N, K, d_out].
  """
  n, k = ids.shape
  out = x.new_zeros(n, k, d_out)
  active = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask
  for e in torch.unique(ids[active]).tolist():
    rows, slots = torch.nonzero((ids == e) & active, as_tuple=True)
    inputs = x[rows] if x.dim() == 2 else x[rows, slots]
    out[rows, slots] = fn(e, inputs).to(out.dtype)
  return out


def combine(y: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
  """sum_k gates[:, k] * y[:, k] in float32: y [N, K, D], gates [N, K] -> [N, D] in y's dtype."""
  return (y.float() * gates.float()[..., None]).sum(1).to(y.dtype)


class ExpertPool(nn.Module):
  """E two-matrix experts: act(z @ w_up[e]) @ w_down[e] (gated: act(z @ w_gate[e]) * (z @ w_up[e]))."""

  def __init__(self, n_experts: int, d_model: int, d_expert: int, activation: str, gated: bool):
    super().__init__()
    self.act = ACTIVATIONS[activation]
    self.d_model = d_model
    self.w_up = param(n_experts, d_model, d_expert)
    self.w_down = param(n_experts, d_expert, d_model)
    self.w_gate = param(n_experts, d_model, d_expert) if gated else None

  def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
    up = rows @ self.w_up[e]
    hidden = self.act(up) if self.w_gate is None else self.act(rows @ self.w_gate[e]) * up
    return hidden @ self.w_down[e]

  def route(self, x, ids, gates, mask=None) -> torch.Tensor:
    """sum_k gates[n, k] E_{ids[n, k]}(x[n] or x[n, k]) -> [N, D]."""
    return combine(slot_apply(self.expert, x, ids, mask, self.d_model), gates)


class AoEExpertPool(ExpertPool):
  """Autonomy-of-Experts experts: the first projection factorised, (z @ w_a[e]) @ w_b[e]; the
  norms of the codes z @ w_a[e] score the experts (`codes`)."""

  def __init__(self, n_experts: int, d_model: int, d_expert: int, rank: int, activation: str,
               gated: bool):
    nn.Module.__init__(self)
    self.act = ACTIVATIONS[activation]
    self.d_model = d_model
    self.w_a = param(n_experts, d_model, rank)
    self.w_b = param(n_experts, rank, d_expert)
    self.w_up = param(n_experts, d_model, d_expert) if gated else None
    self.w_down = param(n_experts, d_expert, d_model)

  def codes(self, x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> [..., E, r] float32."""
    return torch.einsum("...d,edr->...er", x.float(), self.w_a.float())

  def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
    first = (rows @ self.w_a[e]) @ self.w_b[e]
    hidden = self.act(first) if self.w_up is None else self.act(first) * (rows @ self.w_up[e])
    return hidden @ self.w_down[e]


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float, layout: str) -> torch.Tensor:
  """Rotates x [B, T, H, Dh] (or [B, T, Dh]) by positions [B, T], in float32 (`umoe_jax.model.rope`)."""
  squeeze = x.dim() == 3
  if squeeze:
    x = x[:, :, None]
  dh = x.shape[-1]
  inv_freq = 1.0 / (theta ** (torch.arange(0, dh, 2, dtype=torch.float32) / dh))
  angles = positions.float()[..., None] * inv_freq                      # [B, T, Dh/2]
  cos, sin = torch.cos(angles)[:, :, None], torch.sin(angles)[:, :, None]
  x32 = x.float()
  if layout == "interleaved":
    a, b = x32[..., 0::2], x32[..., 1::2]
    out = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
  else:
    a, b = x32[..., : dh // 2], x32[..., dh // 2:]
    out = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
  out = out.to(x.dtype)
  return out[:, :, 0] if squeeze else out


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                     k_pos: torch.Tensor, return_probs: bool = False):
  """softmax(q k^T / sqrt(Dk) + mask) v with the softmax in float32; query t sees key s iff
  0 <= k_pos[s] <= q_pos[t]. q [B, T, H, Dk], k [B, S, Hk, Dk], v [B, S, Hk, Dv], Hk in (1, H).
  Returns [B, T, H, Dv] (and the probabilities [B, H, T, S] with return_probs)."""
  scale = 1.0 / math.sqrt(q.shape[-1])
  if k.shape[2] == 1:
    scores = torch.einsum("bthd,bsd->bhts", q.float(), k[:, :, 0].float())
  else:
    scores = torch.einsum("bthd,bshd->bhts", q.float(), k.float())
  scores = scores * scale
  kp = k_pos[:, None, None, :]
  visible = (kp >= 0) & (kp <= q_pos[:, None, :, None])
  scores = torch.where(visible, scores, torch.finfo(torch.float32).min)
  probs32 = torch.softmax(scores, dim=-1)
  probs = probs32.to(v.dtype)
  if v.shape[2] == 1:
    out = torch.einsum("bhts,bsd->bthd", probs, v[:, :, 0])
  else:
    out = torch.einsum("bhts,bshd->bthd", probs, v)
  return (out, probs32) if return_probs else out
