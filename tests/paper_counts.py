"""Parameter and forward-MAC counts of the paper's Table 1 models, by hand from their dimensions.

Independent of umoe_jax.stats and of configs/: the dimensions below are those of the official configs
(../shared/reference/umoe.md, sections 2.1 and 2.2), and every count is written out weight by weight.
SwitchHead has no official base config; its experts per head (29 at base) are the project's choice
(configs/common.py explains it). MACs count as the paper does (umoe.md section 2.4): every linear map
including routers and the LM head, q.k^T and a.V over all T x T pairs, only the routed experts and
low-rank queries a token uses; norms, RoPE, softmax and activations count nothing.

`FIGURES` are the published numbers with the precision they are printed at (umoe.md: base parameters
and MACs in section 2.1 / 2.4, large parameters in 2.2, large MACs in 2.4 (the report's own), the
SwitchHead base parameters from Table 1 (section 3.1)).
"""
from __future__ import annotations

# d, layers, vocab, heads, head dim (q/k = v), dense FFN, pool experts, expert width, FFN top-k,
# attention top-k, low-rank query rank, attention-only experts (UMoE-Att, MoA), SwitchHead experts/head.
DIMS = {
    "base": dict(d=768, layers=12, vocab=32000, heads=4, dh=192, d_ff=3072, experts=128, de=192,
                 k_ffn=15, k_att=3, rank=16, att_experts=116, sh_experts=29),
    "large": dict(d=2048, layers=24, vocab=32000, heads=4, dh=512, d_ff=5632, experts=64, de=512,
                  k_ffn=10, k_att=3, rank=36, att_experts=57, sh_experts=15),
}

# (family, scale): ((parameters, printed unit), (forward MACs at 4 x 1024 tokens, printed unit) or None)
FIGURES = {
    ("dense", "base"): ((134.1e6, 1e5), (525.9e9, 1e8)),
    ("ffn_moe", "base"): ((535.2e6, 1e5), (530.7e9, 1e8)),
    ("moa", "base"): ((524.5e6, 1e5), (486.8e9, 1e8)),
    ("switchhead", "base"): ((533e6, 1e6), None),  # the paper's 542G needs other shapes (common.py)
    ("umoe_att", "base"): ((547.6e6, 1e5), (612.2e9, 1e8)),
    ("umoe", "base"): ((540.5e6, 1e5), (617.5e9, 1e8)),
    ("dense", "large"): ((1087.5e6, 1e5), (4598e9, 1e9)),
    ("ffn_moe", "large"): ((3808.5e6, 1e5), (4611e9, 1e9)),
    ("moa", "large"): ((3657.2e6, 1e5), (3991e9, 1e9)),
    ("switchhead", "large"): ((3911.9e6, 1e5), (4622e9, 1e9)),
    ("umoe_att", "large"): ((3808.4e6, 1e5), (4740e9, 1e9)),
    ("umoe", "large"): ((3676.4e6, 1e5), (4754e9, 1e9)),
}


def _mlp(d, width):
  """A two-matrix MLP d -> width -> d: weights = MACs per token."""
  return 2 * d * width


def _premix_attention(s, n_experts):
  """UMoE pre-mixing attention of one layer: key, residual and shared queries (d x dh each), per
  expert W_a (d x r) and W_b (r x dh), the RMSNorm of r, the router (d x E), the always-on expert."""
  d, dh, r = s["d"], s["dh"], s["rank"]
  return 3 * d * dh + n_experts * (d * r + r * dh) + r + d * n_experts + _mlp(d, s["de"])


def hand_params(family: str, scale) -> int:
  """Parameters of `family` at `scale` ("base", "large", or a dict of the DIMS keys)."""
  s = DIMS[scale] if isinstance(scale, str) else scale
  d, h, dh = s["d"], s["heads"], s["dh"]
  mha = 4 * d * h * dh                                      # q, k, v (d x H dh), o (H dh x d)
  dense_ffn = _mlp(d, s["d_ff"])
  if family == "dense":
    layer = mha + dense_ffn
  elif family == "ffn_moe":                                 # router, E experts, 1 always-on
    e = s["experts"]
    layer = mha + d * e + e * _mlp(d, s["de"]) + _mlp(d, s["de"])
  elif family == "moa":  # shared k, v heads; per expert head W_q, W_o; 1 always-on head; router
    e = s["att_experts"]
    layer = 2 * d * dh + (e + 1) * (d * dh + dh * d) + d * e + dense_ffn
  elif family == "switchhead":  # q, k; per head E value (d x dh), E output (dh x d) experts, 2 routers
    e = s["sh_experts"]
    layer = 2 * d * h * dh + h * e * (d * dh + dh * d) + 2 * h * d * e + dense_ffn
  elif family == "umoe_att":                                # the pool serves attention only
    e = s["att_experts"]
    layer = _premix_attention(s, e) + e * _mlp(d, s["de"]) + dense_ffn
  elif family == "umoe":              # one pool; the FFN adds its router and always-on expert
    e = s["experts"]
    layer = _premix_attention(s, e) + e * _mlp(d, s["de"]) + d * e + _mlp(d, s["de"])
  else:
    raise ValueError(family)
  norms = 2 * d                                             # attention and FFN RMSNorm scales
  return s["layers"] * (layer + norms) + 2 * s["vocab"] * d + d   # + embedding, LM head, final norm


def hand_macs(family: str, scale, batch: int = 4, seq_len: int = 1024) -> int:
  """Forward MACs of `family` at `scale` (as in `hand_params`) over batch x seq_len tokens."""
  s = DIMS[scale] if isinstance(scale, str) else scale
  d, h, dh = s["d"], s["heads"], s["dh"]
  mha = 4 * d * h * dh
  dense_ffn = _mlp(d, s["d_ff"])
  moe_ffn = d * s["experts"] + (s["k_ffn"] + 1) * _mlp(d, s["de"])   # router, k routed + always-on
  ka = s["k_att"]
  premix = (3 * d * dh + ka * (d * s["rank"] + s["rank"] * dh)   # only the k routed W_a, W_b
            + (ka + 1) * _mlp(d, s["de"]))                      # k routed + the always-on expert
  if family == "dense":
    token, pair = mha + dense_ffn, h * (dh + dh)
  elif family == "ffn_moe":
    token, pair = mha + moe_ffn, h * (dh + dh)
  elif family == "moa":                    # k routed heads + 1 always-on: W_q and W_o each
    token = 2 * d * dh + (ka + 1) * (d * dh + dh * d) + d * s["att_experts"] + dense_ffn
    pair = (ka + 1) * (dh + dh)
  elif family == "switchhead":             # top-1 value and output expert per head
    token = 2 * d * h * dh + h * (d * dh + dh * d) + 2 * h * d * s["sh_experts"] + dense_ffn
    pair = h * (dh + dh)
  elif family == "umoe_att":               # queries over d_k, mixing the hidden states (width d)
    token, pair = premix + d * s["att_experts"] + dense_ffn, (ka + 1) * (dh + d)
  elif family == "umoe":
    token, pair = premix + d * s["experts"] + moe_ffn, (ka + 1) * (dh + d)
  else:
    raise ValueError(family)
  n = batch * seq_len
  return s["layers"] * (n * token + batch * seq_len * seq_len * pair) + n * d * s["vocab"]
