"""Naive float64 numpy oracles of the model math, written as loops over tokens and experts.

These are independent re-derivations of the official UMoE code (see the project's reference notes,
umoe.md section 1.2), not ports of the JAX code:

  * RoPE is the official DeepSeek form: `q.view(..., d/2, 2).transpose(-1, -2).reshape(d)` (de-interleave)
    and then `q * cos + rotate_half(q) * sin` with `cos = cat(freqs, freqs)`. Its output channel order
    differs from the JAX "interleaved" layout by a fixed permutation applied to queries and keys alike,
    so every attention score is identical (the test of `rope.py` checks the permutation explicitly).
  * The router takes top-k greedily (argmax, remove, repeat), not by sorting.
  * Attention is one softmax per (token, head) over the visible keys s <= t.
  * Every routed expert is applied one (token, slot) at a time with that expert's own matrices.

Parameters come as the nested dict of `nnx.state(model, nnx.Param).to_pure_dict()` converted to float64
(layout: a `Linear` kernel is [in, out]; expert weights are [E, in, out]). Configs are the
`umoe_jax.config.ModelConfig` dataclasses (plain values only are read from them).

Everything here is pure numpy float64; nothing touches JAX.
"""
from __future__ import annotations

import math
from typing import Mapping, Optional

import numpy as np


def f64(x) -> np.ndarray:
  return np.asarray(x, dtype=np.float64)


def tree_f64(tree):
  """A nested dict of arrays -> the same nested dict of float64 numpy arrays."""
  if isinstance(tree, Mapping):
    return {k: tree_f64(v) for k, v in tree.items()}
  return f64(tree)


def rel_err(out, ref) -> float:
  """||out - ref|| / ||ref|| (Frobenius, in float64)."""
  out, ref = f64(out), f64(ref)
  assert out.shape == ref.shape, (out.shape, ref.shape)
  return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


# ------------------------------------------------------------------------------------------------
# Elementwise pieces.


def silu(z):
  return z / (1.0 + np.exp(-z))


def gelu_tanh(z):
  # jax.nn.gelu's default (approximate=True) form.
  return 0.5 * z * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z ** 3)))


ACT = {
    "silu": silu,
    "gelu": gelu_tanh,
    "relu": lambda z: np.maximum(z, 0.0),
    "none": lambda z: z,
}


def softmax(v: np.ndarray) -> np.ndarray:
  v = f64(v)
  e = np.exp(v - np.max(v))
  return e / np.sum(e)


def rms_norm_vec(v: np.ndarray, scale: np.ndarray, eps: float) -> np.ndarray:
  """One vector: v / sqrt(mean(v^2) + eps) * scale."""
  v = f64(v)
  ms = sum(float(c) * float(c) for c in v) / v.shape[0]
  return v / math.sqrt(ms + eps) * f64(scale)


def mlp_vec(v: np.ndarray, w_up: np.ndarray, w_down: np.ndarray, act: str) -> np.ndarray:
  """Non-gated two-matrix MLP of one vector: act(v W1) W2."""
  return ACT[act](f64(v) @ f64(w_up)) @ f64(w_down)


# ------------------------------------------------------------------------------------------------
# RoPE (the official code's DeepSeek form).


def rope_official(v: np.ndarray, pos: int, theta: float, layout: str) -> np.ndarray:
  """Rotates one head vector v [d] at integer position `pos`, the way the official code does.

  layout "interleaved": DeepSeek-V2 `apply_rotary_pos_emb`: de-interleave (view d/2 x 2, transpose),
  then rotate halves. The result is returned in the de-interleaved channel order (as the official
  code returns it).
  layout "half": GPT-NeoX / Llama: rotate halves of v as it is.
  """
  v = f64(v)
  d = v.shape[0]
  inv_freq = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))      # [d/2]
  freqs = pos * inv_freq
  emb = np.concatenate([freqs, freqs])
  cos, sin = np.cos(emb), np.sin(emb)
  if layout == "interleaved":
    v = v.reshape(d // 2, 2).T.reshape(d)
  elif layout != "half":
    raise ValueError(layout)
  rotated_half = np.concatenate([-v[d // 2:], v[: d // 2]])
  return v * cos + rotated_half * sin


def official_to_interleaved(v: np.ndarray) -> np.ndarray:
  """Maps the de-interleaved channel order of `rope_official(..., "interleaved")` back to pairs
  (v[2i], v[2i+1])."""
  d = v.shape[-1]
  out = np.empty_like(v)
  out[..., 0::2] = v[..., : d // 2]
  out[..., 1::2] = v[..., d // 2:]
  return out


# ------------------------------------------------------------------------------------------------
# Router and balance losses.


def route_token(x: np.ndarray, w_r: np.ndarray, k: int, renormalize: bool,
                forced_ids: Optional[np.ndarray] = None):
  """softmax(x W_r) over all E experts, greedy top-k; gates = chosen probabilities (optionally / sum).

  Returns (probs [E], ids [k] int, gates [k]). With `forced_ids`, those experts are used instead of the
  top-k (for bf16 comparisons, where a near-tie may legitimately flip); gates are still this oracle's
  probabilities of those experts.
  """
  x, w_r = f64(x), f64(w_r)
  n_experts = w_r.shape[1]
  logits = np.array([sum(x[i] * w_r[i, e] for i in range(x.shape[0])) for e in range(n_experts)])
  probs = softmax(logits)
  if forced_ids is None:
    remaining = list(range(n_experts))
    ids = []
    for _ in range(k):
      best = max(remaining, key=lambda e: probs[e])
      ids.append(best)
      remaining.remove(best)
    ids = np.array(ids, dtype=np.int64)
  else:
    ids = np.asarray(forced_ids, dtype=np.int64)
  gates = np.array([probs[e] for e in ids])
  if renormalize:
    gates = gates / gates.sum()
  return probs, ids, gates


def seq_aux_loss(probs: np.ndarray, ids: np.ndarray) -> float:
  """DeepSeek-V2 sequence-wise loss, unscaled: mean_b sum_e count[b,e]/(T K/E) * mean_t probs[b,t,e]."""
  b_, t_, e_ = probs.shape
  k_ = ids.shape[-1]
  total = 0.0
  for b in range(b_):
    counts = np.zeros(e_)
    for t in range(t_):
      for j in range(k_):
        counts[ids[b, t, j]] += 1
    ce = counts / (t_ * k_ / e_)
    mean_p = np.zeros(e_)
    for t in range(t_):
      mean_p += probs[b, t] / t_
    total += sum(ce[e] * mean_p[e] for e in range(e_))
  return total / b_


def switch_loss(probs: np.ndarray, ids: np.ndarray) -> float:
  """Switch Transformer loss over all tokens, unscaled: sum_e (E f_e) P_e."""
  e_ = probs.shape[-1]
  p = probs.reshape(-1, e_)
  flat_ids = ids.reshape(p.shape[0], -1)
  n, k_ = flat_ids.shape
  counts = np.zeros(e_)
  for row in flat_ids:
    for e in row:
      counts[e] += 1
  f = counts / (n * k_)
  big_p = p.sum(axis=0) / n
  return float(sum(e_ * f[e] * big_p[e] for e in range(e_)))


BALANCE = {"seq_aux": seq_aux_loss, "switch": switch_loss, "none": lambda probs, ids: 0.0}


# ------------------------------------------------------------------------------------------------
# Attention.


def _attend(q: np.ndarray, keys: list, values: np.ndarray, t: int) -> np.ndarray:
  """One query at position t over keys[0..t]: softmax(q.k_s / sqrt(d_k)) . values[s]."""
  dk = q.shape[0]
  scores = np.array([float(q @ keys[s]) / math.sqrt(dk) for s in range(t + 1)])
  a = softmax(scores)
  out = np.zeros(values.shape[1])
  for s in range(t + 1):
    out += a[s] * values[s]
  return out


def causal_attention(q, k, v):
  """q [T, H, Dk], k [S, Hk, Dk] (Hk = H or 1), v [S, Hk, Dv], positions = arange: -> [T, H, Dv]."""
  q, k, v = f64(q), f64(k), f64(v)
  t_, h_, _ = q.shape
  out = np.zeros((t_, h_, v.shape[-1]))
  for h in range(h_):
    hk = h if k.shape[1] > 1 else 0
    keys = [k[s, hk] for s in range(k.shape[0])]
    for t in range(t_):
      out[t, h] = _attend(q[t, h], keys, v[:, hk], t)
  return out


def mha(x: np.ndarray, p: Mapping, cfg) -> np.ndarray:
  """Dense multi-head attention of one sequence x [T, D] (already normed) -> [T, D]."""
  x = f64(x)
  att = cfg.attention
  h_, dk, dv = att.n_heads, att.head_dim, att.v_head_dim
  wq, wk, wv, wo = (p[n]["kernel"] for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
  t_ = x.shape[0]
  concat = np.zeros((t_, h_ * dv))
  for h in range(h_):
    qs = [rope_official(x[t] @ wq[:, h * dk:(h + 1) * dk], t, cfg.rope_theta, cfg.rope_layout)
          for t in range(t_)]
    ks = [rope_official(x[s] @ wk[:, h * dk:(h + 1) * dk], s, cfg.rope_theta, cfg.rope_layout)
          for s in range(t_)]
    vs = np.stack([x[s] @ wv[:, h * dv:(h + 1) * dv] for s in range(t_)])
    for t in range(t_):
      concat[t, h * dv:(h + 1) * dv] = _attend(qs[t], ks, vs, t)
  return concat @ wo


def premix(x: np.ndarray, p: Mapping, pool: Mapping, cfg, forced_ids=None):
  """UMoE pre-mixing attention MoE of one sequence x [T, D] (the normed layer input).

    q_{t,i} = x_t W_q_res + RMSNorm_r(x_t W_a^i) W_b^i    (or x_t W_q^i without a low rank)
    q_{t,s} = x_t W_q_shared
    K = rope(X W_k) (one head), values = X itself
    y_t = sum_{i in top-k} g_{t,i} E_i(m_{t,i}) + E_shared(m_{t,s}),  m = softmax(q K^T / sqrt(d_k)) X

  Returns (y [T, D], (probs [T, E], ids [T, K], gates [T, K])).
  """
  x = f64(x)
  att, moe = cfg.attention, cfg.moe
  t_ = x.shape[0]
  rope = lambda v, pos: rope_official(v, pos, cfg.rope_theta, cfg.rope_layout)
  keys = [rope(x[s] @ p["k_proj"]["kernel"], s) for s in range(t_)]
  probs_all, ids_all, gates_all = [], [], []
  y = np.zeros_like(x)
  for t in range(t_):
    probs, ids, gates = route_token(x[t], p["router"]["kernel"], att.top_k, cfg.router.renormalize,
                                    None if forced_ids is None else forced_ids[t])
    probs_all.append(probs), ids_all.append(ids), gates_all.append(gates)
    if att.n_shared_experts:
      m = _attend(rope(x[t] @ p["shared_q_proj"]["kernel"], t), keys, x, t)
      y[t] += mlp_vec(m, p["shared_expert"]["up"]["kernel"], p["shared_expert"]["down"]["kernel"],
                      moe.activation)
    for j in range(att.top_k):
      i = ids[j]
      if att.q_lora_rank is None:
        q = x[t] @ p["q_b"][i]
      else:
        code = x[t] @ p["q_a"][i]
        if att.q_lora_norm:
          code = rms_norm_vec(code, p["q_a_norm"]["scale"], cfg.norm_eps)
        q = x[t] @ p["q_res_proj"]["kernel"] + code @ p["q_b"][i]
      m = _attend(rope(q, t), keys, x, t)
      y[t] += gates[j] * mlp_vec(m, pool["w_up"][i], pool["w_down"][i], moe.activation)
  return y, (np.stack(probs_all), np.stack(ids_all), np.stack(gates_all))


# ------------------------------------------------------------------------------------------------
# FFN sub-layers.


def dense_ffn(x: np.ndarray, p: Mapping, cfg) -> np.ndarray:
  x = f64(x)
  return np.stack([mlp_vec(x[t], p["mlp"]["up"]["kernel"], p["mlp"]["down"]["kernel"],
                           cfg.moe.activation) for t in range(x.shape[0])])


def moe_ffn(x: np.ndarray, p: Mapping, pool: Mapping, cfg, forced_ids=None):
  """y_t = sum_{i in top-k} g_{t,i} E_i(x_t) + E_shared(x_t) for one sequence x [T, D] (normed).

  Returns (y [T, D], (probs, ids, gates)).
  """
  x = f64(x)
  ffn, moe = cfg.ffn, cfg.moe
  y = np.zeros_like(x)
  probs_all, ids_all, gates_all = [], [], []
  for t in range(x.shape[0]):
    probs, ids, gates = route_token(x[t], p["router"]["kernel"], ffn.top_k, cfg.router.renormalize,
                                    None if forced_ids is None else forced_ids[t])
    probs_all.append(probs), ids_all.append(ids), gates_all.append(gates)
    for j in range(ffn.top_k):
      y[t] += gates[j] * mlp_vec(x[t], pool["w_up"][ids[j]], pool["w_down"][ids[j]], moe.activation)
    if ffn.n_shared_experts:
      y[t] += mlp_vec(x[t], p["shared_expert"]["up"]["kernel"], p["shared_expert"]["down"]["kernel"],
                      moe.activation)
  return y, (np.stack(probs_all), np.stack(ids_all), np.stack(gates_all))


# ------------------------------------------------------------------------------------------------
# Decoder block and LM.


def block(h: np.ndarray, p: Mapping, cfg, forced: Optional[Mapping] = None):
  """One pre-norm layer of one sequence h [T, D]: h += Att(norm(h)); h += FFN(norm(h)).

  Returns (h [T, D], {"attention"|"ffn": (probs, ids, gates)} for each router of the layer).
  `forced` optionally maps those names to expert ids [T, K].
  """
  forced = forced or {}
  h = f64(h)
  t_ = h.shape[0]
  routes = {}
  xa = np.stack([rms_norm_vec(h[t], p["attention_norm"]["scale"], cfg.norm_eps) for t in range(t_)])
  if cfg.attention.kind == "mha":
    a = mha(xa, p["attention"], cfg)
  elif cfg.attention.kind == "premix":
    a, routes["attention"] = premix(xa, p["attention"], p["experts"], cfg, forced.get("attention"))
  else:
    raise NotImplementedError(cfg.attention.kind)
  h = h + a
  if cfg.ffn.kind == "none":   # every expert to attention: no FFN sub-layer
    return h, routes
  xf = np.stack([rms_norm_vec(h[t], p["ffn_norm"]["scale"], cfg.norm_eps) for t in range(t_)])
  if cfg.ffn.kind == "dense":
    f = dense_ffn(xf, p["ffn"], cfg)
  else:
    pool = p["experts"]
    if cfg.attention.kind == "premix" and not cfg.moe.share_pool:
      pool = p["ffn_experts"]
    f, routes["ffn"] = moe_ffn(xf, p["ffn"], pool, cfg, forced.get("ffn"))
  return h + f, routes


def causal_lm(tokens: np.ndarray, p: Mapping, cfg, forced: Optional[Mapping] = None):
  """Full forward pass, one sequence at a time: embed -> layers -> final RMSNorm -> untied head.

  Returns (logits [B, T, V], routes {"layer_i/name": (probs [B,T,E], ids [B,T,K], gates [B,T,K])},
  balance_loss = sum over routers of coef * loss).
  """
  forced = forced or {}
  tokens = np.asarray(tokens)
  b_, t_ = tokens.shape
  logits = np.zeros((b_, t_, cfg.vocab_size))
  per_seq = []
  for b in range(b_):
    h = np.stack([f64(p["embed"][tokens[b, t]]) for t in range(t_)])
    seq_routes = {}
    for i in range(cfg.n_layers):
      layer_forced = {name: forced[f"layer_{i}/{name}"][b] for name in ("attention", "ffn")
                      if f"layer_{i}/{name}" in forced}
      h, r = block(h, p["layers"][i], cfg, layer_forced)
      seq_routes.update({f"layer_{i}/{n}": v for n, v in r.items()})
    for t in range(t_):
      logits[b, t] = rms_norm_vec(h[t], p["final_norm"]["scale"], cfg.norm_eps) @ p["lm_head"]
    per_seq.append(seq_routes)
  routes = {name: tuple(np.stack([s[name][j] for s in per_seq]) for j in range(3))
            for name in per_seq[0]}
  loss = sum(cfg.router.balance_coef * BALANCE[cfg.router.balance_loss](pr, ids)
             for pr, ids, _ in routes.values())
  return logits, routes, float(loss)
