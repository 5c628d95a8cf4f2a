"""Model statistics: parameters (total and active), forward MACs, FLOPs for MFU, KV-cache bytes.

Command line (run from the repository root)::

  python -m umoe_jax.stats --config=configs/umoe_base.py                  # readable table
  python -m umoe_jax.stats --config=configs/umoe_base.py --json           # one JSON object
  python -m umoe_jax.stats --config=configs/umoe_large.py --batch=4 --seq_len=1024 --causal
  python -m umoe_jax.stats --config=configs/umoe_base.py --config.model.n_layers=2
  python -m umoe_jax.stats --zoo                                          # markdown model zoo table

Library::

  from umoe_jax import stats
  stats.total_params(cfg); stats.active_params(cfg)
  stats.forward_macs(cfg, batch=4, seq_len=1024)          # the paper's "MACs" column
  stats.forward_flops(cfg, batch, seq_len)                # 2 x MACs
  stats.train_flops_per_token(cfg, seq_len)               # 3 x forward FLOPs per token (for MFU)
  stats.kv_cache_bytes_per_token(cfg, dtype="bfloat16")
  stats.model_stats(cfg, ...)                             # everything above as one JSON-ready dict

`cfg` is a `ModelConfig`, a `config.model` ConfigDict, or a whole experiment ConfigDict (its `.model`
is used).

Definitions
-----------
Total parameters
  Every parameter of the model, counted on the real model (`umoe_jax.model.abstract_model`, shapes
  only, no memory) and cross-checked, component by component, against the analytic count below.

Active parameters (per token)
  The parameters one token's forward pass reads, taking the largest value over routing decisions:
  every non-routed weight in full plus, for each routed weight set, the experts the token is sent
  to. Concretely:
  * routed experts: k of E per pool. In UMoE the attention (k_att picks) and the FFN (k_ffn picks)
    of a layer share one pool; a weight is counted once, so a layer's pool contributes
    min(E, k_att + k_ffn) experts (the two routers may pick the same expert, so this is an upper
    bound; it equals k_att + k_ffn, the per-pick count that the MACs use, whenever
    k_att + k_ffn <= E, as in every paper config);
  * routed low-rank expert queries (UMoE's W_a^i, W_b^i): k_att of E;
  * routers: in full (a token's logits use every column);
  * always-on (shared) experts, attention projections, norms, the LM head: in full;
  * the embedding table: in full, by the usual convention of MoE papers (Mixtral, DeepSeekMoE,
    OLMoE), although a token reads one row. `active_non_embedding` leaves out the embedding and
    the LM head.

Forward MACs (the paper's counting, Table 1 "MACs")
  Multiply-accumulates of the matrix products of one forward pass over B sequences of T tokens,
  as DeepSpeed's flops profiler counts the official "slow" modules (`tools/estimate_macs.py`,
  B=4, T=1024): every linear layer including the routers and the LM head; the attention products
  q.k^T and a.V over the full T x T matrix (the causal mask does not reduce the count); only the
  top-k routed low-rank queries of pre-mixing attention (the code dispatches them by expert).
  Element-wise work (norms, RoPE, softmax, activations, gating) and the embedding lookup count 0.
  `causal=True` counts only the T(T+1)/2 visible (query, key) pairs instead.

FLOPs
  `forward_flops` = 2 x forward MACs. `train_flops_per_token(cfg, seq_len)` = 3 x forward FLOPs
  per token (forward + backward w.r.t. activations + backward w.r.t. weights), with attention
  counted like the paper (full T x T, as in PaLM's 6N + 12LHQT MFU formula) unless `causal=True`,
  which halves (exactly: (T+1)/2T) the attention products. The trainer's MFU uses the default.

KV cache
  Values cached per token per layer, times the cache dtype's bytes: dense MHA caches keys and
  values, H (d_k + d_v); pre-mixing attention caches one key head and the normed hidden state
  (its values), d_k + d (d_k + latent with MLA-style values). The total per token is that times
  the number of layers. Cross-checked against the layout the model's decoding cache allocates
  (`cache_shapes` of the attention class, `umoe_jax.model.cache`) where the class declares one.

Adding an attention kind
------------------------
Statistics are looked up by `model.attention.kind` in `ATTENTION_STATS` (FFN kinds in `FFN_STATS`).
A new variant adds one class, here or in its own module (importing this module is cheap: it loads
the model lazily)::

  from umoe_jax.stats import AttentionStats, Count, linear

  class MoAStats(AttentionStats):       # then `stats = MoAStats` on the model class, or
                                        # `ATTENTION_STATS.register("moa")(MoAStats)`
    @classmethod
    def params(cls, cfg):            # per layer, by component; the layer's shared expert pool excluded
      ...
      return {"attention": Count(shared_k_v), "attention_routed": Count(total=E * per_expert,
              active=k * per_expert), "routers": Count(linear(d, E))}
    @classmethod
    def token_macs(cls, cfg):        # per token, independent of the sequence length
      return {"attention": ..., "attention_routed": k * per_expert_macs, "routers": linear(d, E)}
    @classmethod
    def pair_macs(cls, cfg):         # per (query token, visible key) pair
      return {"attention_scores": n_query_heads * d_k, "attention_mix": n_query_heads * d_v}
    @classmethod
    def kv_cache(cls, cfg):          # values cached per token per layer (optional: by default the
      return {"key": d_k, "value": d_v}  # sizes of the model class's `cache_shapes(cfg)`)

Override `pool_picks` if the variant runs tokens through the layer's routed expert pool (its
parameters and MACs are then counted once, at the layer, with the FFN's picks), and `pairs` if it
does not attend over all T x T pairs (sliding window, ...). Alternatively the model class can carry
the statistics itself as a class attribute `stats = MoAStats`. Component names are those of
`COMPONENTS` / `MAC_COMPONENTS`; the cross-check against the real model sorts a parameter into
"attention_routed" when it lives under the attention module and has an `expert` logical axis, into
"norms" when its logical axis is `norm`, and anything it cannot place into "other:<path>", which
shows up as a mismatch.

Block-level options (`moe.gated`, `moe.share_across_layers`, `moe.share_always_on`,
`router.share_att_ffn`, `attention.latent_dim`, `ffn.kind="none"`) are accounted for, and the
cross-check against the real model confirms each. All layers are assumed identical (a per-layer
schedule such as "first k layers dense" needs `layer_params` per layer).
"""
from __future__ import annotations

import dataclasses
import fnmatch
import functools
import importlib.util
import json
import math
import os
import sys
from typing import Any, Mapping, Optional, Sequence

from umoe_jax.config import ModelConfig, model_config, resolve, router_mixing
from umoe_jax.output import text_table
from umoe_jax.registry import Registry

# Parameter components, in table order.
COMPONENTS = ("embedding", "attention", "attention_routed", "routers", "experts", "shared_experts",
              "ffn", "norms", "lm_head")
# MAC components, in table order.
MAC_COMPONENTS = ("attention", "attention_routed", "attention_scores", "attention_mix", "routers",
                  "experts", "shared_experts", "ffn", "lm_head")
_DESCRIPTIONS = {
    "embedding": "token embedding table",
    "attention": "attention projections (q, k, v, o; UMoE: key, shared and residual queries)",
    "attention_routed": "per-expert attention weights (UMoE: low-rank expert queries)",
    "attention_scores": "q . k^T",
    "attention_mix": "a . V (UMoE: mixing the hidden states, width d)",
    "routers": "router logits",
    "experts": "routed expert pool",
    "shared_experts": "always-on experts",
    "ffn": "dense MLP",
    "norms": "RMSNorm scales",
    "lm_head": "output projection",
}


def linear(d_in: int, d_out: int) -> int:
  """Weights of a bias-free linear map, = its MACs per token."""
  return int(d_in) * int(d_out)


def _router_class(kind: str) -> type:
  from umoe_jax.model.routers import ROUTERS  # late: the router classes carry their counts
  return ROUTERS.get(kind)


def router_params(cfg: ModelConfig, n_experts: int, sublayer: str) -> int:
  """Parameters of one router of `sublayer` ("attention" / "ffn") over `n_experts` experts: its
  class's `param_count` (beside each router family in `umoe_jax.model.routers`; a D x E map unless
  the family says otherwise), for the sub-layer's router config (`ModelConfig.router_for`), plus
  the aux-loss-free balancing's selection bias [E] when `router.bias_update_rate` > 0."""
  router = cfg.router_for(sublayer)
  bias = n_experts if router.bias_update_rate > 0 else 0
  return _router_class(router.kind).param_count(cfg, router, n_experts) + bias


def router_macs(cfg: ModelConfig, n_experts: int, sublayer: str) -> int:
  """Forward MACs per token of one router of `sublayer` (`token_mac_count` of its class). The
  mixing over earlier tokens of similarity_aware / attention_aware depends on T: `router_pair_macs`."""
  router = cfg.router_for(sublayer)
  return _router_class(router.kind).token_mac_count(cfg, router, n_experts)


def routed_expert(cfg: ModelConfig, aoe: bool = False) -> tuple[int, int]:
  """(weights of one routed pool expert = its MACs per pick, the part every token reads whether
  picked or not). An MLP D -> d_e -> D; in an AoE pool (`aoe`: an FFN router of kind 'aoe') the
  activated projection is factorised through rank r, D x r + r x d_e, and every token computes
  every expert's D x r code (its score)."""
  f = cfg.moe.d_expert
  if not aoe:
    return mlp(cfg, f), 0
  r = cfg.router_for("ffn").aoe_dim
  return linear(cfg.d_model, r) + linear(r, f) + (2 if cfg.moe.gated else 1) * linear(cfg.d_model, f), \
      linear(cfg.d_model, r)


def router_pair_macs(cfg: ModelConfig) -> int:
  """Forward MACs per (query token, key token) pair of one layer's routers (`pair_mac_count` of
  their class: the mixing routers'; 0 for every other kind). The routers of a layer (with their own
  configs) are read off the model, when any of them mixes (the model is not built otherwise)."""
  if all(router_mixing(cfg.router_for(s)) == "none" for s in cfg.routed_sublayers):
    return 0
  return sum(cls.pair_mac_count(cfg, router, e) for cls, router, e in _layer_routers(cfg))


@functools.lru_cache(maxsize=64)
def _layer_routers(cfg: ModelConfig) -> tuple[tuple[type, Any, int], ...]:
  """(class, RouterConfig, E) of every router module of one decoder layer (the abstract model's
  first layer)."""
  from flax import nnx
  from umoe_jax.model import abstract_model
  from umoe_jax.model.routers import RouterStats
  layer = abstract_model(cfg).layers[0]
  return tuple((type(m), m.cfg, m.n_experts) for _, m in nnx.iter_graph(layer)
               if isinstance(m, RouterStats))


def mlp(cfg: ModelConfig, d_hidden: int) -> int:
  """Weights (= MACs per token) of one MLP D -> d_hidden -> D: 2 matrices, 3 when `moe.gated`."""
  return (3 if cfg.moe.gated else 2) * linear(cfg.d_model, d_hidden)


@dataclasses.dataclass(frozen=True)
class Count:
  """Parameters of one component: all of them, and those one token reads (see module docstring)."""
  total: int
  active: Optional[int] = None

  def __post_init__(self):
    if self.active is None:
      object.__setattr__(self, "active", self.total)

  def __add__(self, other: "Count") -> "Count":
    return Count(self.total + other.total, self.active + other.active)

  def __mul__(self, n: int) -> "Count":
    return Count(self.total * n, self.active * n)


def _merge(into: dict, items: Mapping[str, Any]) -> dict:
  for name, value in items.items():
    into[name] = into[name] + value if name in into else value
  return into


def _ordered(d: Mapping[str, Any], order: Sequence[str]) -> dict:
  """Known names in `order` first, unknown ones after; drops zeros."""
  names = [n for n in order if n in d] + sorted(n for n in d if n not in order)
  keep = lambda v: (v.total != 0 or v.active != 0) if isinstance(v, Count) else v != 0
  return {n: d[n] for n in names if keep(d[n])}


# ----------------------------------------------------------------------------------------------
# Per-kind statistics: attention variants and FFN kinds.


class AttentionStats:
  """Statistics of one attention kind, per layer; all class methods of a `ModelConfig`.

  Subclass, register with `@ATTENTION_STATS.register(kind)`, and fill in `params`, `token_macs`,
  `pair_macs`, `kv_cache` (see the module docstring).
  """

  @classmethod
  def params(cls, cfg: ModelConfig) -> dict[str, Count]:
    """Parameters the attention module owns, by component (not the layer's routed expert pool)."""
    raise NotImplementedError

  @classmethod
  def pool_picks(cls, cfg: ModelConfig) -> int:
    """Experts of the layer's routed pool one token's attention runs through (0: no pool)."""
    return 0

  @classmethod
  def token_macs(cls, cfg: ModelConfig) -> dict[str, int]:
    """Forward MACs per token that do not depend on the context (projections, routers, ...),
    excluding the pool experts (counted at the layer from `pool_picks`)."""
    raise NotImplementedError

  @classmethod
  def pair_macs(cls, cfg: ModelConfig) -> dict[str, int]:
    """Forward MACs per (query token, attended key) pair: q.k^T and a.V over all query heads."""
    raise NotImplementedError

  @classmethod
  def pairs(cls, cfg: ModelConfig, seq_len: int, causal: bool) -> int:
    """(query, key) pairs of one sequence: T*T like the paper, or T(T+1)/2 visible ones."""
    return seq_len * (seq_len + 1) // 2 if causal else seq_len * seq_len

  @classmethod
  def kv_cache(cls, cfg: ModelConfig) -> dict[str, int]:
    """Values cached per token per layer for decoding, by name. Default: the sizes of the model
    class's `cache_shapes(cfg)` (the decoding cache's layout, `umoe_jax.model.cache`)."""
    shapes = _model_cache_shapes(cfg)
    if shapes is None:
      raise NotImplementedError(f"{cls.__name__}.kv_cache: the model class of attention kind "
                                f"{cfg.attention.kind!r} declares no cache_shapes")
    return {name: math.prod(shape) for name, shape in shapes.items()}


def _model_cache_shapes(cfg: ModelConfig) -> Optional[dict]:
  """{name: per-token shape} the model's attention class caches, or None if it declares none."""
  from umoe_jax.model.attention import ATTENTIONS
  model_cls = ATTENTIONS.get(cfg.attention.kind)
  fn = getattr(model_cls, "cache_shapes", None)
  return None if fn is None else dict(fn(cfg))


class FFNStats:
  """Statistics of one FFN kind, per layer (same conventions as `AttentionStats`)."""

  @classmethod
  def params(cls, cfg: ModelConfig) -> dict[str, Count]:
    raise NotImplementedError

  @classmethod
  def pool_picks(cls, cfg: ModelConfig) -> int:
    return 0

  @classmethod
  def token_macs(cls, cfg: ModelConfig) -> dict[str, int]:
    raise NotImplementedError


def low_rank_expert_count(cfg: ModelConfig) -> tuple[int, int]:
  """(parameters of one routed low-rank query/key expert, of the rank-r code's RMSNorm): the
  projections of `attention.common.low_rank_expert_params` (pre- and post-mixing)."""
  a, d = cfg.attention, cfg.d_model
  if a.q_lora_rank is None:
    return linear(d, a.head_dim), 0
  return (linear(d, a.q_lora_rank) + linear(a.q_lora_rank, a.head_dim),
          a.q_lora_rank if a.q_lora_norm else 0)


ATTENTION_STATS: Registry[type] = Registry("attention statistics")
FFN_STATS: Registry[type] = Registry("ffn statistics")


@ATTENTION_STATS.register("mha")
class MHAStats(AttentionStats):
  """Dense multi-head attention: q, k [H, d_k], v [H, d_v], o [H d_v -> d]."""

  @classmethod
  def params(cls, cfg):
    a, d = cfg.attention, cfg.d_model
    return {"attention": Count(2 * linear(d, a.n_heads * a.head_dim) + linear(d, a.n_heads * a.v_head_dim)
                               + linear(a.n_heads * a.v_head_dim, d))}

  @classmethod
  def token_macs(cls, cfg):
    return {"attention": cls.params(cfg)["attention"].total}

  @classmethod
  def pair_macs(cls, cfg):
    a = cfg.attention
    return {"attention_scores": a.n_heads * a.head_dim, "attention_mix": a.n_heads * a.v_head_dim}

  @classmethod
  def kv_cache(cls, cfg):
    a = cfg.attention
    return {"key": a.n_heads * a.head_dim, "value": a.n_heads * a.v_head_dim}


@ATTENTION_STATS.register("premix")
class PreMixStats(AttentionStats):
  """UMoE pre-mixing attention: router, one key head, shared + residual queries, k_att routed
  low-rank queries, 1 + k_att query heads mixing the hidden states (width d), the always-on expert;
  the k_att routed experts are picks from the layer's pool.

  With `attention.latent_dim` = c (the official `mla` variant) the values are X W_latent (d -> c,
  cached) and each mixed vector goes back to d through W_code2value (c -> d) before its expert.
  """

  @classmethod
  def _n_queries(cls, cfg) -> int:
    return cfg.attention.top_k + (1 if cfg.attention.n_shared_experts else 0)

  @classmethod
  def _latent(cls, cfg) -> Optional[int]:
    return cfg.attention.latent_dim

  @classmethod
  def params(cls, cfg):
    a, d, e = cfg.attention, cfg.d_model, cfg.moe.n_experts
    dense = linear(d, a.head_dim)                                       # k_proj
    dense += linear(d, a.head_dim) if a.n_shared_experts else 0         # shared_q_proj
    dense += linear(d, a.head_dim) if a.q_lora_rank is not None else 0  # q_res_proj
    if cls._latent(cfg):
      dense += 2 * linear(d, cls._latent(cfg))                          # latent_code, code2value
    per_expert, lora_norm = low_rank_expert_count(cfg)
    return {"attention": Count(dense),
            "attention_routed": Count(e * per_expert, a.top_k * per_expert),
            "routers": Count(router_params(cfg, e, "attention")),
            "shared_experts": Count(mlp(cfg, cfg.moe.d_expert * a.n_shared_experts)),
            "norms": Count(lora_norm)}

  @classmethod
  def pool_picks(cls, cfg):
    return cfg.attention.top_k

  @classmethod
  def token_macs(cls, cfg):
    a, d = cfg.attention, cfg.d_model
    p = cls.params(cfg)
    proj = linear(d, a.head_dim) * (1 + bool(a.n_shared_experts) + (a.q_lora_rank is not None))
    if cls._latent(cfg):  # latent code of every token, code -> d for every mixed vector
      proj += linear(d, cls._latent(cfg)) * (1 + cls._n_queries(cfg))
    return {"attention": proj, "attention_routed": p["attention_routed"].active,
            "routers": router_macs(cfg, cfg.moe.n_experts, "attention"),
            "shared_experts": p["shared_experts"].total}

  @classmethod
  def pair_macs(cls, cfg):
    n = cls._n_queries(cfg)
    return {"attention_scores": n * cfg.attention.head_dim,
            "attention_mix": n * (cls._latent(cfg) or cfg.d_model)}

  @classmethod
  def kv_cache(cls, cfg):
    return {"key": cfg.attention.head_dim, "value": cls._latent(cfg) or cfg.d_model}


@FFN_STATS.register("dense")
class DenseFFNStats(FFNStats):

  @classmethod
  def params(cls, cfg):
    return {"ffn": Count(mlp(cfg, cfg.ffn.d_ff)), "norms": Count(cfg.d_model)}

  @classmethod
  def token_macs(cls, cfg):
    return {"ffn": mlp(cfg, cfg.ffn.d_ff)}


@FFN_STATS.register("moe")
class MoEFFNStats(FFNStats):
  """Router + k_ffn picks from the layer's pool + the always-on expert (width n_shared * d_e).

  `router.share_att_ffn` (reuse the attention router's weights) and `moe.share_always_on` (reuse
  the attention's always-on expert) remove those parameters, not their MACs (new inputs)."""

  @classmethod
  def _reuses(cls, cfg, flag_owner, flag) -> bool:
    return bool(getattr(flag_owner, flag, False)) and cfg.attention_uses_experts

  @classmethod
  def token_macs(cls, cfg):
    return {"routers": router_macs(cfg, cfg.moe.n_experts, "ffn"),
            "shared_experts": mlp(cfg, cfg.moe.d_expert * cfg.ffn.n_shared_experts)}

  @classmethod
  def params(cls, cfg):
    macs = cls.token_macs(cfg)
    return {"routers": Count(0 if cls._reuses(cfg, cfg.router, "share_att_ffn")
                             else router_params(cfg, cfg.moe.n_experts, "ffn")),
            "shared_experts": Count(0 if cls._reuses(cfg, cfg.moe, "share_always_on")
                                    else macs["shared_experts"]),
            "norms": Count(cfg.d_model)}

  @classmethod
  def pool_picks(cls, cfg):
    return cfg.ffn.top_k


@FFN_STATS.register("none")
class NoFFNStats(FFNStats):
  """No FFN sub-layer (and no FFN norm)."""

  @classmethod
  def params(cls, cfg):
    return {}

  @classmethod
  def token_macs(cls, cfg):
    return {}


def attention_stats(kind: str) -> type:
  """The statistics class of an attention kind: `ATTENTION_STATS[kind]`, else the model class's
  `stats` attribute."""
  if kind in ATTENTION_STATS:
    return ATTENTION_STATS.get(kind)
  from umoe_jax.model.attention import ATTENTIONS
  model_cls = ATTENTIONS.get(kind) if kind in ATTENTIONS else None
  stats = getattr(model_cls, "stats", None)
  if isinstance(stats, type) and issubclass(stats, AttentionStats):
    return stats
  raise ValueError(
      f"no statistics for attention kind {kind!r} (known: {', '.join(ATTENTION_STATS.names())}); "
      f"register an AttentionStats subclass with @ATTENTION_STATS.register({kind!r}) "
      "(see the docstring of umoe_jax/stats.py)")


def ffn_stats(kind: str) -> type:
  return FFN_STATS.get(kind)


# ----------------------------------------------------------------------------------------------
# Config handling.


def as_model_config(cfg: Any) -> ModelConfig:
  """ModelConfig | config.model ConfigDict | experiment ConfigDict (uses .model) -> ModelConfig."""
  if isinstance(cfg, ModelConfig):
    return resolve(cfg)  # fill the derived defaults (router.aoe_dim, ...) like the model does
  if isinstance(cfg, Mapping) or hasattr(cfg, "keys"):
    if "model" in cfg and "d_model" not in cfg:
      cfg = cfg["model"]
  return model_config(cfg)


def _pools(cfg: ModelConfig) -> list[tuple[int, bool]]:
  """Routed expert pools of one layer, as (picks per token it receives, whether it is an AoE pool:
  the FFN routes into it with kind 'aoe') (mirrors block.py)."""
  att_uses, ffn_uses = cfg.attention_uses_experts, cfg.ffn_uses_experts
  picks_att = attention_stats(cfg.attention.kind).pool_picks(cfg) if att_uses else 0
  picks_ffn = ffn_stats(cfg.ffn.kind).pool_picks(cfg) if ffn_uses else 0
  aoe = ffn_uses and cfg.router_for("ffn").kind == "aoe"
  if att_uses and ffn_uses and not cfg.moe.share_pool:
    return [(picks_att, False), (picks_ffn, aoe)]
  if att_uses or ffn_uses:
    return [(picks_att + picks_ffn, aoe)]
  return []


# ----------------------------------------------------------------------------------------------
# Parameters.


def _pool_params(cfg: ModelConfig) -> list[Count]:
  """The routed pools of the model with the distinct experts one token can touch in each."""
  e, out = cfg.moe.n_experts, []
  for picks, aoe in _pools(cfg):
    per_expert, scoring = routed_expert(cfg, aoe)
    # every token also reads the scoring part of the experts it does not pick (AoE's codes)
    active = lambda picked: picked * per_expert + (e - picked) * scoring
    if cfg.moe.share_across_layers:  # one pool, every layer picks from it
      out.append(Count(e * per_expert, active(min(e, picks * cfg.n_layers))))
    else:
      out.append(Count(e * per_expert, active(min(e, picks))) * cfg.n_layers)
  return out


def layer_params(cfg: Any) -> dict[str, Count]:
  """Analytic parameters of one decoder layer, by component, without the routed pools."""
  cfg = as_model_config(cfg)
  out: dict[str, Count] = {"norms": Count(cfg.d_model)}  # the attention norm; the FFN's has its own
  _merge(out, attention_stats(cfg.attention.kind).params(cfg))
  _merge(out, ffn_stats(cfg.ffn.kind).params(cfg))
  return _ordered(out, COMPONENTS)


def analytic_params(cfg: Any) -> dict[str, Count]:
  """Analytic parameters of the whole model, by component (zeros left out)."""
  cfg = as_model_config(cfg)
  v, d = cfg.vocab_size, cfg.d_model
  out = {"embedding": Count(v * d), "lm_head": Count(linear(d, v)), "norms": Count(d)}
  _merge(out, {name: c * cfg.n_layers for name, c in layer_params(cfg).items()})
  for pool in _pool_params(cfg):
    _merge(out, {"experts": pool})
  return _ordered(out, COMPONENTS)


def _component_of(path: Sequence[Any], axes: Sequence[Any]) -> str:
  names = [str(p) for p in path]
  axes = tuple(axes or ())
  if names[0] == "embed":
    return "embedding"
  if names[0] == "lm_head":
    return "lm_head"
  if "router" in names:  # before the norm test: X-MoE's temperature is tagged like a norm scale
    return "routers"
  if "norm" in axes:
    return "norms"
  if "shared_expert" in names:
    return "shared_experts"
  if "experts" in names or "ffn_experts" in names:
    return "experts"
  if names[0] == "layers" and len(names) > 2:
    module = names[2]
    if module == "attention":
      return "attention_routed" if "expert" in axes else "attention"
    if module == "ffn":
      return "ffn"
  return "other:" + "/".join(names)


@functools.lru_cache(maxsize=64)
def _model_params_cached(cfg: ModelConfig) -> tuple[tuple[str, int], ...]:
  from flax import nnx
  from umoe_jax.model import abstract_model
  state = nnx.state(abstract_model(cfg), nnx.Param)
  out: dict[str, int] = {}
  for path, var in nnx.to_flat_state(state):
    meta = var.get_metadata()
    axes = meta.get("out_sharding") or meta.get("sharding_names") or ()
    value = var.get_value() if hasattr(var, "get_value") else var.value
    size = 1
    for dim in value.shape:
      size *= int(dim)
    name = _component_of(path, axes)
    out[name] = out.get(name, 0) + size
  return tuple(_ordered(out, COMPONENTS).items())


def model_params(cfg: Any) -> dict[str, int]:
  """Parameters of the real model (abstract: shapes only), by component."""
  return dict(_model_params_cached(as_model_config(cfg)))


def param_mismatches(cfg: Any) -> dict[str, tuple[int, int]]:
  """Components where the real model and the analytic count differ: {name: (model, analytic)}."""
  real, analytic = model_params(cfg), analytic_params(cfg)
  names = set(real) | set(analytic)
  out = {}
  for n in names:
    r, a = real.get(n, 0), analytic[n].total if n in analytic else 0
    if r != a:
      out[n] = (r, a)
  return out


def total_params(cfg: Any, *, from_model: bool = True) -> int:
  """All parameters; counted on the real model unless `from_model=False` (analytic)."""
  if from_model:
    return sum(model_params(cfg).values())
  return sum(c.total for c in analytic_params(cfg).values())


def active_params(cfg: Any, *, non_embedding: bool = False) -> int:
  """Parameters one token's forward pass reads (see the module docstring for the definition)."""
  comps = analytic_params(cfg)
  skip = ("embedding", "lm_head") if non_embedding else ()
  return sum(c.active for n, c in comps.items() if n not in skip)


# ----------------------------------------------------------------------------------------------
# MACs and FLOPs.


def forward_mac_breakdown(cfg: Any, batch: int = 4, seq_len: int = 1024, *,
                          causal: bool = False) -> dict[str, int]:
  """Forward MACs of `batch` sequences of `seq_len` tokens, by component (module docstring)."""
  cfg = as_model_config(cfg)
  att, ffn = attention_stats(cfg.attention.kind), ffn_stats(cfg.ffn.kind)
  per_token: dict[str, int] = {}
  _merge(per_token, att.token_macs(cfg))
  _merge(per_token, ffn.token_macs(cfg))
  _merge(per_token, {"experts": sum(picks * routed_expert(cfg, aoe)[0] for picks, aoe in _pools(cfg))})
  tokens = batch * seq_len
  out = {name: macs * tokens * cfg.n_layers for name, macs in per_token.items()}
  pairs = batch * att.pairs(cfg, seq_len, causal)
  _merge(out, {name: macs * pairs * cfg.n_layers for name, macs in att.pair_macs(cfg).items()})
  _merge(out, {"routers": router_pair_macs(cfg) * pairs * cfg.n_layers})
  _merge(out, {"lm_head": linear(cfg.d_model, cfg.vocab_size) * tokens})
  return _ordered(out, MAC_COMPONENTS)


def forward_macs(cfg: Any, batch: int = 4, seq_len: int = 1024, *, causal: bool = False) -> int:
  """Forward MACs of `batch` x `seq_len` tokens, counted like the paper (full T x T attention)."""
  return sum(forward_mac_breakdown(cfg, batch, seq_len, causal=causal).values())


def forward_flops(cfg: Any, batch: int = 4, seq_len: int = 1024, *, causal: bool = False) -> int:
  """2 x forward MACs."""
  return 2 * forward_macs(cfg, batch, seq_len, causal=causal)


def train_flops_per_token(cfg: Any, seq_len: int, *, causal: bool = False) -> float:
  """Training FLOPs per token for MFU: 3 x forward FLOPs per token (forward, backward to inputs,
  backward to weights) for sequences of `seq_len`. Attention counted over the full T x T matrix
  like the paper (and PaLM's 6N + 12LHQT), or over the T(T+1)/2 visible pairs with `causal=True`."""
  return 3.0 * forward_flops(cfg, 1, seq_len, causal=causal) / seq_len


# ----------------------------------------------------------------------------------------------
# KV cache.


def _itemsize(dtype: Any) -> int:
  import jax.numpy as jnp
  return int(jnp.dtype(dtype).itemsize)


def kv_cache_values_per_token(cfg: Any) -> dict[str, int]:
  """Values cached per token per layer, by name (e.g. {"key": d_k, "value": d} for pre-mixing)."""
  cfg = as_model_config(cfg)
  return dict(attention_stats(cfg.attention.kind).kv_cache(cfg))


def model_kv_cache_values_per_token(cfg: Any) -> Optional[int]:
  """Values per token per layer of the model's own cache layout (`cache_shapes` of its attention
  class), or None where the class declares none: the cross-check of `kv_cache_values_per_token`."""
  shapes = _model_cache_shapes(as_model_config(cfg))
  return None if shapes is None else sum(math.prod(s) for s in shapes.values())


def kv_cache_bytes_per_token(cfg: Any, dtype: Any = "bfloat16") -> dict[str, int]:
  """KV-cache bytes of one token: {"per_layer": bytes in one layer, "total": all layers}."""
  cfg = as_model_config(cfg)
  per_layer = sum(kv_cache_values_per_token(cfg).values()) * _itemsize(dtype)
  return {"per_layer": per_layer, "total": per_layer * cfg.n_layers}


# ----------------------------------------------------------------------------------------------
# Everything at once, and how to show it.


def model_stats(cfg: Any, *, batch: int = 4, seq_len: Optional[int] = None, causal: bool = False,
                kv_dtype: str = "bfloat16", from_model: bool = True, name: str = "") -> dict:
  """All statistics of a model as a JSON-ready dict. `seq_len` defaults to `model.max_seq_len`."""
  cfg = as_model_config(cfg)
  seq_len = cfg.max_seq_len if seq_len is None else int(seq_len)
  comps = analytic_params(cfg)
  real = model_params(cfg) if from_model else None
  by_comp = {}
  for n in list(comps) + [n for n in (real or {}) if n not in comps]:
    c = comps.get(n, Count(0))
    by_comp[n] = {"total": c.total, "active": c.active,
                  "model": None if real is None else real.get(n, 0)}
  mismatches = ({} if real is None else
                {n: {"model": v["model"], "analytic": v["total"]}
                 for n, v in by_comp.items() if v["model"] != v["total"]})
  total_analytic = sum(c.total for c in comps.values())
  macs = forward_mac_breakdown(cfg, batch, seq_len, causal=causal)
  fwd = sum(macs.values())
  kv_values = kv_cache_values_per_token(cfg)
  kv = kv_cache_bytes_per_token(cfg, kv_dtype)
  kv_model = model_kv_cache_values_per_token(cfg) if from_model else None
  kv_check = ("skipped" if kv_model is None else
              "ok" if kv_model == sum(kv_values.values()) else "mismatch")
  emb = sum(comps[n].total for n in ("embedding", "lm_head") if n in comps)
  return {
      "name": name,
      "model": {
          "attention": cfg.attention.kind, "ffn": cfg.ffn.kind, "vocab_size": cfg.vocab_size,
          "d_model": cfg.d_model, "n_layers": cfg.n_layers, "max_seq_len": cfg.max_seq_len,
          "n_experts": cfg.moe.n_experts, "d_expert": cfg.moe.d_expert,
          "k_att": cfg.attention.top_k if cfg.attention_uses_experts else 0,
          "k_ffn": cfg.ffn.top_k if cfg.ffn_uses_experts else 0,
          "share_pool": cfg.moe.share_pool,
      },
      "params": {
          "total": sum(real.values()) if real is not None else total_analytic,
          "total_analytic": total_analytic,
          "total_non_embedding": total_analytic - emb,
          "active": active_params(cfg),
          "active_non_embedding": active_params(cfg, non_embedding=True),
          "by_component": by_comp,
          "check": "skipped" if real is None else ("ok" if not mismatches else "mismatch"),
          "mismatches": mismatches,
      },
      "macs": {
          "batch": batch, "seq_len": seq_len, "causal": causal,
          "forward": fwd, "forward_per_token": fwd / (batch * seq_len), "by_component": macs,
      },
      "flops": {
          "forward": 2 * fwd,
          "train_per_token": train_flops_per_token(cfg, seq_len, causal=causal),
      },
      "kv_cache": {
          "dtype": str(kv_dtype), "bytes_per_value": _itemsize(kv_dtype),
          "values_per_token_per_layer": kv_values,
          "bytes_per_token_per_layer": kv["per_layer"],
          "bytes_per_token": kv["total"],
          "bytes_per_sequence": kv["total"] * seq_len,
          "model_values_per_token_per_layer": kv_model,
          "check": kv_check,
      },
  }


def human(n: float, unit: str = "") -> str:
  """1234567 -> '1.23M' (decimal prefixes, as the paper's 'M' params and 'G' MACs)."""
  for div, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
    if abs(n) >= div:
      return f"{n / div:.2f}{prefix}{unit}"
  return f"{n:g}{unit}"


def human_bytes(n: float) -> str:
  for div, prefix in ((2 ** 30, "GiB"), (2 ** 20, "MiB"), (2 ** 10, "KiB")):
    if n >= div:
      return f"{n / div:.2f} {prefix}"
  return f"{int(n)} B"


def format_table(s: dict) -> str:
  """A readable plain-text report of `model_stats(...)`."""
  m, p, mac, fl, kv = s["model"], s["params"], s["macs"], s["flops"], s["kv_cache"]
  lines = []
  title = s["name"] or "model"
  desc = (f"attention={m['attention']}  ffn={m['ffn']}  d={m['d_model']}  layers={m['n_layers']}  "
          f"vocab={m['vocab_size']}")
  if m["n_experts"]:
    desc += (f"  experts E={m['n_experts']} x d_e={m['d_expert']}  k_att={m['k_att']}  "
             f"k_ffn={m['k_ffn']}{'  (one pool)' if m['share_pool'] and m['k_att'] and m['k_ffn'] else ''}")
  lines += [title, "  " + desc, ""]

  rows = [("Parameters", "total", "active", "exact", "model", "")]
  for n, c in p["by_component"].items():
    check = "" if c["model"] is None else ("ok" if c["model"] == c["total"] else "MISMATCH")
    rows.append(("  " + n, human(c["total"]), human(c["active"]), f"{c['total']:,}",
                 "" if c["model"] is None else f"{c['model']:,}", check))
  rows.append(("  total", human(p["total"]), human(p["active"]), f"{p['total_analytic']:,}",
               "" if p["check"] == "skipped" else f"{p['total']:,}", p["check"]))
  rows.append(("  non-embedding", human(p["total_non_embedding"]),
               human(p["active_non_embedding"]), "", "", ""))
  lines += text_table(rows) + [""]

  rule = "T(T+1)/2 visible pairs" if mac["causal"] else "full T x T attention, as the paper"
  rows = [(f"Forward MACs (B={mac['batch']}, T={mac['seq_len']}; {rule})", "MACs", "share")]
  for n, v in mac["by_component"].items():
    rows.append(("  " + n, human(v), f"{100 * v / mac['forward']:.1f}%"))
  rows.append(("  total", human(mac["forward"]), "100.0%"))
  rows.append(("  per token", human(mac["forward_per_token"]), ""))
  lines += text_table(rows) + [""]
  lines.append(f"Forward FLOPs (2 x MACs): {human(fl['forward'])}   "
               f"training FLOPs per token (3 x forward): {human(fl['train_per_token'])}")
  lines.append("")
  parts = " + ".join(f"{k} {v}" for k, v in kv["values_per_token_per_layer"].items())
  values = sum(kv["values_per_token_per_layer"].values())
  lines.append(f"KV cache ({kv['dtype']}, {kv['bytes_per_value']} B/value): per token per layer "
               f"{parts} = {values} values = {kv['bytes_per_token_per_layer']:,} B; "
               f"all {m['n_layers']} layers {kv['bytes_per_token']:,} B/token "
               f"({human_bytes(kv['bytes_per_token'])}); "
               f"{human_bytes(kv['bytes_per_sequence'])} per sequence of {mac['seq_len']}"
               + ("" if kv["check"] == "skipped" else f"; model cache layout: {kv['check']}"))
  lines.append("")
  used = [n for n in _DESCRIPTIONS if n in p["by_component"] or n in mac["by_component"]]
  width = max(len(n) for n in used)
  lines += ["Components:"] + [f"  {n.ljust(width)}  {_DESCRIPTIONS[n]}" for n in used]
  if kv["check"] == "mismatch":
    lines += ["", f"WARNING: the model's cache holds {kv['model_values_per_token_per_layer']} "
              f"values per token and layer, the analytic count {values}"]
  if p["check"] == "mismatch":
    lines += ["", "WARNING: the real model and the analytic count differ: "
              + json.dumps(p["mismatches"])]
  return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Model zoo.

ZOO_PATTERNS = ("*_tiny.py", "*_base.py", "*_large.py")


def load_config_file(path: str):
  """`get_config()` of a config file; its parent directory's parent goes on sys.path (for
  `from configs import common`)."""
  path = os.path.abspath(path)
  root = os.path.dirname(os.path.dirname(path))
  if root not in sys.path:
    sys.path.insert(0, root)
  package = os.path.basename(os.path.dirname(path))
  module_name = f"{package}.{os.path.splitext(os.path.basename(path))[0]}"
  spec = importlib.util.spec_from_file_location(module_name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def zoo_files(config_dir: str = "configs", patterns: Sequence[str] = ZOO_PATTERNS) -> list[str]:
  """Config files matching `patterns`, ordered by scale (pattern order), then name."""
  names = sorted(os.listdir(config_dir))
  out = []
  for pattern in patterns:
    out += [os.path.join(config_dir, n) for n in names if fnmatch.fnmatch(n, pattern)]
  return out


def zoo_rows(config_dir: str = "configs", patterns: Sequence[str] = ZOO_PATTERNS, *,
             batch: int = 4, kv_dtype: str = "bfloat16", from_model: bool = True) -> list[dict]:
  """`model_stats` of every zoo config at its `max_seq_len` (1024 for base/large = the paper's)."""
  rows = []
  for path in zoo_files(config_dir, patterns):
    name = os.path.relpath(path, os.path.dirname(os.path.abspath(config_dir)))
    rows.append(model_stats(load_config_file(path), batch=batch, kv_dtype=kv_dtype,
                            from_model=from_model, name=name))
  return rows


def _in_units(n: float, div: float, suffix: str) -> str:
  x = n / div
  return f"{x:,.1f}{suffix}" if x >= 10 else f"{x:.3f}{suffix}"


def zoo_markdown(config_dir: str = "configs", patterns: Sequence[str] = ZOO_PATTERNS, *,
                 batch: int = 4, kv_dtype: str = "bfloat16", from_model: bool = True) -> str:
  """The model zoo as a markdown table (what `python -m umoe_jax.stats --zoo` prints).

  Parameters in M (10^6), MACs in G (10^9) like the paper's Table 1; MACs of `batch` sequences of
  the model's `max_seq_len` tokens, counted like the paper (full T x T attention)."""
  lines = [
      "| config | attention / FFN | total params | active params | "
      f"forward MACs ({batch}×T) | T | train FLOPs/token | KV cache/token ({kv_dtype}) | "
      "KV values/token/layer |",
      "|---|---|--:|--:|--:|--:|--:|--:|--:|"]
  for s in zoo_rows(config_dir, patterns, batch=batch, kv_dtype=kv_dtype, from_model=from_model):
    m, p, kv = s["model"], s["params"], s["kv_cache"]
    if p["check"] == "mismatch":
      raise ValueError(f"{s['name']}: model and analytic parameter counts differ: {p['mismatches']}")
    if kv["check"] == "mismatch":
      raise ValueError(f"{s['name']}: model and analytic KV-cache sizes differ")
    values = " + ".join(str(v) for v in kv["values_per_token_per_layer"].values())
    lines.append(
        f"| `{s['name']}` | {m['attention']} / {m['ffn']} | {_in_units(p['total'], 1e6, 'M')} | "
        f"{_in_units(p['active'], 1e6, 'M')} | {_in_units(s['macs']['forward'], 1e9, 'G')} | "
        f"{s['macs']['seq_len']} | {_in_units(s['flops']['train_per_token'], 1e6, 'M')} | "
        f"{kv['bytes_per_token']:,} B | {values} |")
  return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Command line. Flags are defined only when run as a program, so importing this module (the
# trainer does, for MFU) never registers flags that could clash with the caller's.


def _define_flags():
  from absl import flags
  from ml_collections import config_flags
  config_flags.DEFINE_config_file("config", None, "Experiment config file (configs/*.py).",
                                  lock_config=True)
  flags.DEFINE_integer("batch", 4, "Sequences per forward pass for the MAC count.")
  flags.DEFINE_integer("seq_len", None, "Tokens per sequence (default: model.max_seq_len).")
  flags.DEFINE_bool("causal", False, "Count only the visible (causal) attention pairs.")
  flags.DEFINE_string("kv_dtype", "bfloat16", "KV-cache dtype.")
  flags.DEFINE_bool("json", False, "Print one JSON object instead of the table.")
  flags.DEFINE_bool("zoo", False, "Print the markdown model-zoo table of --zoo_dir and exit.")
  flags.DEFINE_string("zoo_dir", "configs", "Directory of zoo configs.")
  flags.DEFINE_bool("from_model", True, "Count parameters on the (abstract) model and cross-check "
                    "the analytic breakdown; off = analytic only.")
  # `--help` lists the key flags of the program's file (sys.argv[0]), not of this module.
  for flag in flags.FLAGS.get_key_flags_for_module(__name__):
    flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)
  return flags.FLAGS


def _main(argv):
  from absl import flags
  from ml_collections import config_flags
  if len(argv) > 1:
    raise SystemExit(f"unexpected arguments: {argv[1:]}")
  FLAGS = flags.FLAGS
  if FLAGS.zoo:
    print(zoo_markdown(FLAGS.zoo_dir, batch=FLAGS.batch, kv_dtype=FLAGS.kv_dtype))
    return 0
  if FLAGS.config is None:
    raise SystemExit("--config=configs/<model>.py is required (or --zoo)")
  name = config_flags.get_config_filename(FLAGS["config"])
  s = model_stats(FLAGS.config, batch=FLAGS.batch, seq_len=FLAGS.seq_len, causal=FLAGS.causal,
                  kv_dtype=FLAGS.kv_dtype, from_model=FLAGS.from_model, name=name)
  overrides = config_flags.get_override_values(FLAGS["config"])
  if overrides:
    s["overrides"] = overrides
  if FLAGS.json:
    print(json.dumps(s, indent=1, default=str))
  else:
    if overrides:
      s["name"] += "  " + " ".join(f"{k}={v}" for k, v in _flatten(overrides).items())
    print(format_table(s))
  return 1 if "mismatch" in (s["params"]["check"], s["kv_cache"]["check"]) else 0


def _flatten(d: Mapping, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    if isinstance(v, Mapping):
      out.update(_flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def run_cli(argv: Optional[Sequence[str]] = None) -> None:
  from absl import app

  from umoe_jax import config_file
  from umoe_jax.config import ConfigError
  try:
    config_file.check_argv(sys.argv if argv is None else argv)  # else config_flags' traceback
  except ConfigError as e:
    raise SystemExit(f"error: {e}") from None
  _define_flags()
  app.run(_main, argv=list(argv) if argv is not None else None)

