"""Typed, validated model configuration.

Config files (`configs/*.py`) are ml_collections ConfigDicts, convenient for command-line overrides.
Modules never read a ConfigDict: `model_config(cfg.model)` turns it into the frozen dataclasses
below once, rejecting unknown keys, wrong types and impossible combinations with an error that names
the key and the value (`ConfigError`).
"""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Mapping, Optional

from umoe_jax import kinds

ACTIVATIONS = ("silu", "gelu", "relu", "none")
ROPE_LAYOUTS = ("interleaved", "half")
DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
  """A configuration key or value is wrong; the message names both."""


@dataclasses.dataclass(frozen=True)
class RouterConfig:
  """How tokens pick experts (see `umoe_jax.model.routers`)."""
  kind: str = "topk_softmax"          # a name in ROUTERS
  renormalize: bool = False           # divide top-k gates by their sum (official UMoE: False)
  balance_loss: str = "seq_aux"       # "seq_aux" (DeepSeek, per sequence), "switch", or "none"
  balance_coef: float = 0.001
  share_att_ffn: bool = False         # the FFN reuses the attention router's weights (own top-k, own loss)
  xmoe_dim: int = 16                  # xmoe: routing dimension d_r (token projection, expert embeddings)
  xmoe_temperature: float = 0.3       # xmoe: tau_0 of the balance loss; the gating tau's (initial) value
  xmoe_learn_temperature: bool = True  # xmoe: learn the gating tau (paper); False = fixed (torchscale/LibMoE)
  hash_seed: int = 42                 # hash: seed of the fixed token-id -> experts map (ParlAI's 42)
  smoe_dropout_k_start: int = 1       # smoe_dropout: active experts at step 0 (capped at the sub-layer's top_k)
  smoe_dropout_steps: int = 10000     # smoe_dropout: steps over which k grows linearly to top_k (paper: all)
  stablemoe_stage2_step: int = 6000   # stablemoe: first step of stage 2 (routing frozen; paper 6000 of 60000)
  stablemoe_distill_dim: int = 50     # stablemoe: width of the distilled word-embedding router (paper 50)
  stablemoe_distill_coef: float = 0.3  # stablemoe: weight of the stage-1 distillation loss (paper 0.3)
  stablemoe_vocab_size: Optional[int] = None  # stablemoe: rows of its token table; None = model.vocab_size
  similarity_temperature: Optional[float] = None  # similarity_aware: tau of softmax_j(u_i.u_j / tau); None = sqrt(D)
  attention_temperature: float = 1.0  # attention_aware: sigma; the chosen head's A^(1/sigma), renormalised
  aoe_dim: Optional[int] = None       # aoe: rank r of the experts' factorised first projection; None = D // 3
  mixing: str = "none"                # Mutual-Inform SMoE over any router with a distribution: "similarity"
                                      # (similar earlier tokens) or "attention" (the block's MHA), causal
  selection: str = "top_k"            # "top_k", "top_p" (until the cumulative prob passes top_p, at most top_k
                                      # slots), "expert_choice" (each expert takes its top tokens; FFN only,
                                      # sees future tokens, no cached decoding)
  top_p: float = 0.6                  # top_p: the cumulative probability P (HMoE / AoE: 0.6)
  entropy_coef: float = 0.0           # weight of the routing-entropy loss mean_t H(probs); top_p needs it (AoE 1e-4)
  expert_choice_capacity: Optional[float] = None  # expert_choice: capacity factor c (C = c N / E tokens per
                                      # expert); None = the sub-layer's top_k (the AoE paper: 2)
  expert_choice_slots: Optional[int] = None  # expert_choice: slots per token (its best picks); None = E (all)
  z_loss_coef: float = 0.0            # ST-MoE router z-loss mean(logsumexp(logits)^2) weight (typical 1e-3)
  jitter_eps: float = 0.0             # Switch jitter: router input x * U(1-eps, 1+eps), training only (HF 0.01)
  bias_update_rate: float = 0.0       # DeepSeek-V3 aux-loss-free balancing: per-expert selection bias moved
                                      # by rate * sign(mean load - load) after each step (paper 1e-3); 0 = off


# The keys of a sub-layer's own router section (`model.attention.router`, `model.ffn.router`): every
# RouterConfig key but the layer-level `share_att_ffn`, each None = take `model.router`'s.
_LAYER_LEVEL_ROUTER_KEYS = ("share_att_ffn",)
RouterOverrides = dataclasses.make_dataclass(
    "RouterOverrides",
    [(f.name, Optional[hint], dataclasses.field(default=None))
     for f, hint in zip(dataclasses.fields(RouterConfig), typing.get_type_hints(RouterConfig).values())
     if f.name not in _LAYER_LEVEL_ROUTER_KEYS],
    frozen=True)
RouterOverrides.__module__ = __name__
RouterOverrides.__doc__ = (
    "A sub-layer's router keys over `model.router` (None = inherit; see `ModelConfig.router_for`).")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """The routed expert pool of a layer: E two-matrix MLPs D -> F -> D."""
  n_experts: int = 0                  # E; 0 = the layer has no routed experts
  d_expert: int = 0                   # F = d_e
  activation: str = "silu"
  gated: bool = False                 # gated MLPs act(x W_gate) * (x W_up) W_down (SwiGLU with silu) for
                                      # routed, always-on experts and the dense FFN
  share_pool: bool = True             # attention and FFN of a layer route into the same experts
  share_across_layers: bool = False   # one routed pool for all layers (official share_layer)
  share_always_on: bool = False       # the FFN reuses the attention's always-on expert


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Attention sub-layer. `kind` names an entry of `ATTENTIONS`."""
  kind: str = "mha"
  n_heads: int = 4                    # mha: heads
  head_dim: int = 64                  # query/key head dim d_k (RoPE over all of it)
  v_head_dim: int = 64                # mha: value head dim
  top_k: int = 3                      # premix: routed experts (query heads) per token, k_att
  n_shared_experts: int = 1           # premix: always-on expert of width n_shared * d_expert
  q_lora_rank: Optional[int] = 16     # premix: rank r of routed queries; None = full per-expert W_q
  q_lora_norm: bool = True            # premix: RMSNorm on the rank-r code (official code); False = Eq. 11
  latent_dim: Optional[int] = None    # premix: MLA-style values X W_latent (cache the latent), latent -> D after mixing
  n_experts: int = 0                  # moa: expert heads; switchhead: experts per head (V and O each)
  core: str = "xla"                   # scores/softmax/mix: "xla", "cudnn"/"triton" (fused causal GPU kernels, no cache), "splash" (TPU)
  router: RouterOverrides = dataclasses.field(default_factory=RouterOverrides)  # its routers' keys over model.router


@dataclasses.dataclass(frozen=True)
class FFNConfig:
  """FFN sub-layer: a dense MLP or a routed MoE (into the layer's pool)."""
  kind: str = "dense"                 # "dense", "moe", or "none" (no FFN sub-layer)
  d_ff: int = 0                       # dense hidden width
  top_k: int = 2                      # moe: k_ffn
  n_shared_experts: int = 1           # moe: always-on expert of width n_shared * d_expert
  router: RouterOverrides = dataclasses.field(default_factory=RouterOverrides)  # moe: its router's keys over model.router


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only LM."""
  vocab_size: int = 32000
  d_model: int = 768
  n_layers: int = 12
  max_seq_len: int = 1024
  norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_layout: str = "interleaved"    # DeepSeek's interleaved pairs; "half" = GPT-NeoX/Llama split
  init_std: float = 0.02
  param_dtype: str = "float32"
  compute_dtype: str = "bfloat16"
  gmm_backend: str = "auto"           # a name in umoe_jax.ops.gmm.BACKENDS or "auto"
  attention: AttentionConfig = dataclasses.field(default_factory=AttentionConfig)
  ffn: FFNConfig = dataclasses.field(default_factory=FFNConfig)
  moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)
  router: RouterConfig = dataclasses.field(default_factory=RouterConfig)

  def router_for(self, sublayer: str) -> RouterConfig:
    """The router config of sub-layer "attention" or "ffn": `model.router` with the keys its own
    section (`model.<sublayer>.router`) sets, derived defaults filled in (`resolve_router`)."""
    if sublayer not in SUBLAYERS:
      raise ValueError(f"sublayer={sublayer!r}; valid: {', '.join(SUBLAYERS)}")
    return resolve_router(dataclasses.replace(self.router, **_overrides(getattr(self, sublayer).router)),
                          self)

  def router_key(self, sublayer: str, key: str) -> str:
    """Where `router_for(sublayer).<key>` comes from: "model.<sublayer>.router.<key>" if that
    section sets it, else "model.router.<key>" (for error messages)."""
    own = key in _overrides(getattr(self, sublayer).router)
    return f"model.{sublayer}.router.{key}" if own else f"model.router.{key}"

  @property
  def routed_sublayers(self) -> tuple[str, ...]:
    """The sub-layers with routers: "attention" (an attention kind with routers), "ffn" (an MoE FFN)."""
    att = kinds.ATTENTION_KINDS.get(self.attention.kind)
    return (("attention",) if att and att.has_routers else ()) + (("ffn",) if self.ffn_uses_experts else ())

  @property
  def attention_uses_experts(self) -> bool:
    kind = kinds.ATTENTION_KINDS.get(self.attention.kind)
    return bool(kind and kind.uses_expert_pool)

  @property
  def ffn_uses_experts(self) -> bool:
    return self.ffn.kind == "moe"


SUBLAYERS = ("attention", "ffn")


def router_mixing(r: RouterConfig) -> str:
  """The mixing a router applies: its kind's (similarity_aware, attention_aware) or `mixing`."""
  implied = kinds.ROUTER_KINDS[r.kind].mixing if r.kind in kinds.ROUTER_KINDS else "none"
  return implied if implied != "none" else r.mixing


def _overrides(section) -> dict:
  return {k: v for k, v in dataclasses.asdict(section).items() if v is not None}


def resolve_router(r: RouterConfig, cfg: "ModelConfig") -> RouterConfig:
  """Fills a router's defaults that depend on the model (routers are built from the RouterConfig
  alone): `stablemoe_vocab_size` None -> vocab_size (kind 'stablemoe'), `aoe_dim` None ->
  d_model // 3 (kind 'aoe')."""
  if r.kind == "stablemoe" and r.stablemoe_vocab_size is None:
    r = dataclasses.replace(r, stablemoe_vocab_size=cfg.vocab_size)
  if r.kind == "aoe" and r.aoe_dim is None:
    r = dataclasses.replace(r, aoe_dim=max(1, cfg.d_model // 3))
  return r


# ----------------------------------------------------------------------------------------------
# ConfigDict -> dataclasses, with errors that name key and value.


def _to_plain(obj: Any) -> Any:
  if hasattr(obj, "to_dict"):
    return obj.to_dict()
  return obj


def _coerce(value: Any, annotation: Any, path: str) -> Any:
  origin = typing.get_origin(annotation)
  if origin in (typing.Union, types.UnionType):
    args = typing.get_args(annotation)
    if value is None and type(None) in args:
      return None
    (inner,) = [a for a in args if a is not type(None)]
    return _coerce(value, inner, path)
  if dataclasses.is_dataclass(annotation):
    return _build(annotation, value, path)
  if annotation is bool:
    if not isinstance(value, bool):
      raise ConfigError(f"{path}={value!r}: expected true/false")
    return value
  if annotation is int:
    if isinstance(value, bool) or not isinstance(value, int):
      raise ConfigError(f"{path}={value!r}: expected an integer")
    return value
  if annotation is float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ConfigError(f"{path}={value!r}: expected a number")
    return float(value)
  if annotation is str:
    if not isinstance(value, str):
      raise ConfigError(f"{path}={value!r}: expected a string")
    return value
  return value


def _build(cls, values: Any, path: str):
  values = _to_plain(values)
  if not isinstance(values, Mapping):
    raise ConfigError(f"{path}={values!r}: expected a mapping of {cls.__name__} fields")
  hints = typing.get_type_hints(cls)
  fields = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(values) - fields)
  if unknown:
    raise ConfigError(f"unknown key {path}.{unknown[0]} (={values[unknown[0]]!r}); "
                      f"valid keys of {path}: {', '.join(sorted(fields))}")
  kwargs = {k: _coerce(v, hints[k], f"{path}.{k}") for k, v in values.items()}
  return cls(**kwargs)


def _check(cond: bool, message: str) -> None:
  if not cond:
    raise ConfigError(message)


def _names(table) -> str:
  return ", ".join(sorted(table))


def validate(cfg: ModelConfig) -> ModelConfig:
  """Checks values and combinations; returns `cfg` unchanged when all is well. Names and traits of
  the pluggable kinds come from `umoe_jax.kinds` (nothing here imports the model)."""
  for key in ("vocab_size", "d_model", "n_layers", "max_seq_len"):
    _check(getattr(cfg, key) > 0, f"model.{key}={getattr(cfg, key)!r} must be positive")
  _check(cfg.rope_layout in ROPE_LAYOUTS,
         f"model.rope_layout={cfg.rope_layout!r}; valid: {', '.join(ROPE_LAYOUTS)}")
  for key in ("param_dtype", "compute_dtype"):
    _check(getattr(cfg, key) in DTYPES, f"model.{key}={getattr(cfg, key)!r}; valid: {', '.join(DTYPES)}")
  for key in ("norm_eps", "rope_theta", "init_std"):
    _check(getattr(cfg, key) > 0, f"model.{key}={getattr(cfg, key)!r} must be positive")
  _check(cfg.gmm_backend == "auto" or cfg.gmm_backend in kinds.GMM_BACKENDS,
         f"model.gmm_backend={cfg.gmm_backend!r}; valid: auto, {', '.join(kinds.GMM_BACKENDS)}")

  att, ffn, moe, router = cfg.attention, cfg.ffn, cfg.moe, cfg.router
  _check(att.kind in kinds.ATTENTION_KINDS,
         f"model.attention.kind={att.kind!r}; valid: {_names(kinds.ATTENTION_KINDS)}")
  _check(att.head_dim > 0 and att.head_dim % 2 == 0,
         f"model.attention.head_dim={att.head_dim!r} must be a positive even number (RoPE rotates pairs)")
  _check(att.core in kinds.ATTENTION_CORES,
         f"model.attention.core={att.core!r}; valid: {', '.join(kinds.ATTENTION_CORES)}")
  _ATTENTION_CHECKS[att.kind](cfg)

  _check(ffn.kind in kinds.FFN_KINDS, f"model.ffn.kind={ffn.kind!r}; valid: {', '.join(kinds.FFN_KINDS)}")
  if ffn.kind == "dense":
    _check(ffn.d_ff > 0, f"model.ffn.d_ff={ffn.d_ff!r} must be set (> 0) for a dense FFN")
  elif ffn.kind == "moe":
    _check(ffn.top_k >= 1, f"model.ffn.top_k={ffn.top_k!r} must be >= 1")
    _check(ffn.n_shared_experts >= 0, f"model.ffn.n_shared_experts={ffn.n_shared_experts!r} must be >= 0")

  # The activation also serves the dense FFN and always-on experts; routers also serve MoA/SwitchHead.
  _check(moe.activation in ACTIVATIONS,
         f"model.moe.activation={moe.activation!r}; valid: {', '.join(ACTIVATIONS)}")
  _validate_router(cfg)
  pool = cfg.attention_uses_experts or cfg.ffn_uses_experts
  if pool:
    _check(moe.n_experts > 0, f"model.moe.n_experts={moe.n_experts!r} must be set (> 0) for routed experts")
    _check(moe.d_expert > 0, f"model.moe.d_expert={moe.d_expert!r} must be set (> 0) for routed experts")
    if cfg.ffn_uses_experts:
      _check(ffn.top_k <= moe.n_experts,
             f"model.ffn.top_k={ffn.top_k} exceeds model.moe.n_experts={moe.n_experts}")
  both = cfg.attention_uses_experts and cfg.ffn_uses_experts
  _check(not moe.share_across_layers or pool,
         f"model.moe.share_across_layers={moe.share_across_layers!r} needs routed experts (a pool to share)")
  _check(not router.share_att_ffn or (both and moe.share_pool),
         f"model.router.share_att_ffn={router.share_att_ffn!r} needs an attention and an FFN that route "
         f"into one pool (attention.kind={att.kind!r}, ffn.kind={ffn.kind!r}, moe.share_pool={moe.share_pool!r})")
  if moe.share_always_on:
    _check(both and att.n_shared_experts > 0 and ffn.n_shared_experts == att.n_shared_experts,
           f"model.moe.share_always_on={moe.share_always_on!r} needs a pooled attention and MoE FFN with equal "
           f"always-on widths (attention.n_shared_experts={att.n_shared_experts!r}, "
           f"ffn.n_shared_experts={ffn.n_shared_experts!r}, attention.kind={att.kind!r}, ffn.kind={ffn.kind!r})")
  return cfg


# Per attention kind: its own checks (each raises ConfigError naming key and value).


def _check_heads(cfg: ModelConfig) -> None:
  """Multi-head variants: at least one head and a positive value head dim."""
  att = cfg.attention
  _check(att.n_heads >= 1, f"model.attention.n_heads={att.n_heads!r} must be >= 1")
  _check(att.v_head_dim >= 1, f"model.attention.v_head_dim={att.v_head_dim!r} must be >= 1")


def _check_own_experts(cfg: ModelConfig, what: str = "") -> None:
  """Variants with their own experts (`attention.n_experts`): 1 <= top_k <= n_experts."""
  att = cfg.attention
  _check(att.n_experts >= 1,
         f"model.attention.n_experts={att.n_experts!r} must be >= 1 for {att.kind}{what}")
  _check(1 <= att.top_k <= att.n_experts, f"model.attention.top_k={att.top_k!r} must be in [1, "
         f"attention.n_experts={att.n_experts}] for {att.kind}")


def _check_pool_routing(cfg: ModelConfig) -> None:
  """Variants routing into the layer's pool: top_k in [1, moe.n_experts], shared experts and the
  low-rank rank non-negative / positive."""
  att = cfg.attention
  _check(att.top_k >= 1, f"model.attention.top_k={att.top_k!r} must be >= 1")
  _check(not cfg.moe.n_experts or att.top_k <= cfg.moe.n_experts,
         f"model.attention.top_k={att.top_k} exceeds model.moe.n_experts={cfg.moe.n_experts}")
  _check(att.n_shared_experts >= 0,
         f"model.attention.n_shared_experts={att.n_shared_experts!r} must be >= 0")
  _check(att.q_lora_rank is None or att.q_lora_rank >= 1,
         f"model.attention.q_lora_rank={att.q_lora_rank!r} must be >= 1 or None")


def _check_premix(cfg: ModelConfig) -> None:
  _check_pool_routing(cfg)
  latent = cfg.attention.latent_dim
  _check(latent is None or latent >= 1, f"model.attention.latent_dim={latent!r} must be >= 1 or None")


def _check_postmix(cfg: ModelConfig) -> None:
  _check_pool_routing(cfg)
  latent = cfg.attention.latent_dim
  _check(latent is None, f"model.attention.latent_dim={latent!r}: MLA latent values exist only for "
         "attention.kind='premix'")


def _check_moa(cfg: ModelConfig) -> None:
  att = cfg.attention
  _check_own_experts(cfg)
  _check(att.n_shared_experts in (0, 1),
         f"model.attention.n_shared_experts={att.n_shared_experts!r}: moa has 0 or 1 always-on head")
  _check(att.v_head_dim >= 1, f"model.attention.v_head_dim={att.v_head_dim!r} must be >= 1")


def _check_switchhead(cfg: ModelConfig) -> None:
  _check_heads(cfg)
  _check_own_experts(cfg, " (experts per head)")


_ATTENTION_CHECKS = {"mha": _check_heads, "premix": _check_premix, "postmix": _check_postmix,
                     "moa": _check_moa, "switchhead": _check_switchhead}
assert set(_ATTENTION_CHECKS) == set(kinds.ATTENTION_KINDS), "a kind without config checks"


def _validate_router(cfg: ModelConfig) -> None:
  """`model.router`'s values, then every routed sub-layer's own router (`router_for`): its values,
  named where they are set, and what its kind can serve (`kinds.ROUTER_KINDS`)."""
  _check_router_values(cfg.router, cfg, lambda key: f"model.router.{key}")
  for sublayer in SUBLAYERS:
    own = _overrides(getattr(cfg, sublayer).router)
    if own and sublayer not in cfg.routed_sublayers:
      name = sorted(own)[0]
      what = f"attention.kind={cfg.attention.kind!r}" if sublayer == "attention" else f"ffn.kind={cfg.ffn.kind!r}"
      _check(False, f"model.{sublayer}.router.{name}={own[name]!r}: that sub-layer has no router "
             f"(model.{what})")
  for sublayer in cfg.routed_sublayers:
    _check_router_values(cfg.router_for(sublayer), cfg,
                         lambda key, s=sublayer: cfg.router_key(s, key))
    _check_router_placement(cfg, sublayer)
  kind = kinds.ROUTER_KINDS[cfg.router.kind]
  if not cfg.ffn_uses_experts and "attention" not in kind.sublayers:  # an FFN router, and no MoE FFN
    _check(False, f"model.router.kind={cfg.router.kind!r} with model.ffn.kind={cfg.ffn.kind!r}: it "
           "routes an MoE FFN (model.ffn.kind='moe')")
  if cfg.router.share_att_ffn and cfg.routed_sublayers == SUBLAYERS:
    att, ffn = cfg.router_for("attention"), cfg.router_for("ffn")
    _check(kinds.ROUTER_KINDS[att.kind].weights,
           f"model.router.share_att_ffn={cfg.router.share_att_ffn!r} with {cfg.router_key('attention', 'kind')}="
           f"{att.kind!r}: it has no weights to share")
    rate_key = cfg.router_key("attention", "bias_update_rate")
    _check(att.bias_update_rate == 0, f"model.router.share_att_ffn={cfg.router.share_att_ffn!r} with "
           f"{rate_key}={att.bias_update_rate!r}: one selection bias cannot follow two routers' loads")
    diff = sorted(k for k in _overrides(cfg.attention.router).keys() | _overrides(cfg.ffn.router).keys()
                  if getattr(att, k) != getattr(ffn, k))
    if diff:
      k = diff[0]
      _check(False, f"model.router.share_att_ffn={cfg.router.share_att_ffn!r} needs one router for "
             f"attention and FFN, but {cfg.router_key('attention', k)}={getattr(att, k)!r} and "
             f"{cfg.router_key('ffn', k)}={getattr(ffn, k)!r} differ")


def _check_router_placement(cfg: ModelConfig, sublayer: str) -> None:
  """What sub-layer `sublayer`'s router kind can serve there."""
  router, att = cfg.router_for(sublayer), cfg.attention
  kind = kinds.ROUTER_KINDS[router.kind]
  key = f"{cfg.router_key(sublayer, 'kind')}={router.kind!r}"
  if router.selection == "expert_choice":
    _check(sublayer == "ffn", f"{cfg.router_key(sublayer, 'selection')}='expert_choice' on the "
           "attention sub-layer: expert choice routes an MoE FFN (model.ffn.router.selection)")
    slots = router.expert_choice_slots
    _check(slots is None or slots <= cfg.moe.n_experts,
           f"{cfg.router_key(sublayer, 'expert_choice_slots')}={slots!r} exceeds model.moe.n_experts="
           f"{cfg.moe.n_experts}")
  if sublayer not in kind.sublayers:
    what = ("reads the block's attention probabilities, which exist only after the attention"
            if kind.mixing == "attention" else "scores the experts of an MoE FFN")
    _check(False, f"{key} with model.attention.kind={att.kind!r}: it {what}; route the attention "
           "with another kind (model.attention.router.kind) or use model.attention.kind='mha' (an FFN-MoE)")
  if router_mixing(router) == "attention":
    _check(sublayer == "ffn", f"{cfg.router_key(sublayer, 'mixing')}='attention' on the attention "
           "sub-layer: it reads the block's attention probabilities, which exist only after the "
           "attention; mix the FFN's router (model.ffn.router.mixing)")
    _check(kinds.ATTENTION_KINDS[att.kind].exposes_attention_probs,
           f"{key} with model.attention.kind={att.kind!r}: its attention does not expose its "
           "probabilities; use model.attention.kind='mha' (an FFN-MoE)")


def _check_router_values(router: RouterConfig, cfg: ModelConfig, key) -> None:
  """Values of one router config; `key(name)` is the dotted key to name in an error."""
  def check(name: str, ok: bool, rule: str) -> None:
    _check(ok, f"{key(name)}={getattr(router, name)!r}{'' if rule.startswith(';') else ' '}{rule}")

  finite_positive = lambda v: 0 < v < float("inf")
  check("kind", router.kind in kinds.ROUTER_KINDS, f"; valid: {_names(kinds.ROUTER_KINDS)}")
  check("balance_loss", router.balance_loss in kinds.BALANCE_LOSS_NAMES,
        f"; valid: {', '.join(kinds.BALANCE_LOSS_NAMES)}")
  check("balance_coef", router.balance_coef >= 0, "must be >= 0")
  check("xmoe_dim", router.xmoe_dim >= 1, "must be >= 1")
  check("xmoe_temperature", finite_positive(router.xmoe_temperature), "must be positive and finite")
  check("hash_seed", 0 <= router.hash_seed < 2 ** 32, "must be in [0, 2**32)")
  check("smoe_dropout_k_start", router.smoe_dropout_k_start >= 1, "must be >= 1")
  check("smoe_dropout_steps", router.smoe_dropout_steps >= 1, "must be >= 1")
  check("stablemoe_stage2_step", router.stablemoe_stage2_step >= 0, "must be >= 0")
  check("stablemoe_distill_dim", router.stablemoe_distill_dim >= 1, "must be >= 1")
  check("stablemoe_distill_coef", 0 <= router.stablemoe_distill_coef < float("inf"),
        "must be >= 0 and finite")
  check("stablemoe_vocab_size",
        router.stablemoe_vocab_size is None or router.stablemoe_vocab_size >= cfg.vocab_size,
        f"must be None or >= model.vocab_size={cfg.vocab_size} (one row per token id)")
  check("similarity_temperature",
        router.similarity_temperature is None or finite_positive(router.similarity_temperature),
        "must be None or positive and finite")
  check("attention_temperature", finite_positive(router.attention_temperature),
        "must be positive and finite")
  check("aoe_dim", router.aoe_dim is None or router.aoe_dim >= 1, "must be None or >= 1")
  check("z_loss_coef", 0 <= router.z_loss_coef < float("inf"), "must be >= 0 and finite")
  check("jitter_eps", 0 <= router.jitter_eps < 1, "must be in [0, 1)")
  check("bias_update_rate", 0 <= router.bias_update_rate < float("inf"), "must be >= 0 and finite")
  kind = kinds.ROUTER_KINDS.get(router.kind)
  check("mixing", router.mixing in kinds.MIXINGS, f"; valid: {', '.join(kinds.MIXINGS)}")
  check("selection", router.selection in kinds.SELECTIONS, f"; valid: {', '.join(kinds.SELECTIONS)}")
  check("top_p", 0 < router.top_p <= 1, "must be in (0, 1]")
  check("entropy_coef", 0 <= router.entropy_coef < float("inf"), "must be >= 0 and finite")
  check("entropy_coef", router.selection != "top_p" or router.entropy_coef > 0,
        f"with {key('selection')}='top_p': top-P needs the entropy loss (the AoE paper's 1e-4), else "
        "the scores flatten and every token takes all its slots")
  check("expert_choice_capacity", router.expert_choice_capacity is None
        or 0 < router.expert_choice_capacity < float("inf"), "must be None or positive and finite")
  check("expert_choice_slots", router.expert_choice_slots is None or router.expert_choice_slots >= 1,
        "must be None or >= 1")
  if kind is not None:
    check("mixing", kind.mixing == "none" or router.mixing in ("none", kind.mixing),
          f"conflicts with {key('kind')}={router.kind!r}, which mixes by {kind.mixing!r}")
    check("mixing", router.mixing == "none" or kind.distribution,
          f"needs a router with a distribution to mix; {key('kind')}={router.kind!r} has none")
    check("selection", router.selection in kind.selections,
          f"; valid for {key('kind')}={router.kind!r}: {', '.join(kind.selections)}")
    check("entropy_coef", kind.distribution or router.entropy_coef == 0,
          f"needs a router with a distribution; {key('kind')}={router.kind!r} has none")
    check("bias_update_rate", router.bias_update_rate == 0 or router.selection == "top_k",
          f"moves the top-k choice; {key('selection')}={router.selection!r} picks otherwise "
          "(expert choice is balanced by construction)")
    for name in ("z_loss_coef", "jitter_eps", "bias_update_rate"):
      check(name, kind.scores or getattr(router, name) == 0,
            f"needs a router with scores; {key('kind')}={router.kind!r} has none")
    check("bias_update_rate", kind.selection_bias or router.bias_update_rate == 0,
          f"does not apply to {key('kind')}={router.kind!r} (it picks experts its own way)")


def check_cached_decoding(cfg: ModelConfig) -> None:
  """Raises ConfigError, naming the key, if a router of `cfg` cannot route one new token per call
  with a KV cache: mixing over earlier tokens (the cache keeps no routing inputs) or expert
  choice (an expert's choice depends on the later tokens)."""
  for sublayer in cfg.routed_sublayers:
    router = cfg.router_for(sublayer)
    mixing = router_mixing(router)
    if mixing != "none":
      name = "mixing" if router.mixing != "none" else "kind"
      raise ConfigError(f"{cfg.router_key(sublayer, name)}={getattr(router, name)!r}: the {mixing} "
                        "mixing reads the routing of earlier tokens, which the KV cache does not "
                        "keep; cached decoding is not supported (run full forward passes)")
    if getattr(router, "selection", "top_k") == "expert_choice":
      raise ConfigError(f"{cfg.router_key(sublayer, 'selection')}='expert_choice': an expert picks "
                        "among all tokens of the batch, later ones included; a causal LM with it "
                        "cannot decode token by token")


def resolve(cfg: ModelConfig) -> ModelConfig:
  """Fills the defaults that depend on other keys in `model.router` (`resolve_router`); the
  sub-layers' routers resolve theirs in `ModelConfig.router_for`."""
  return dataclasses.replace(cfg, router=resolve_router(cfg.router, cfg))


def model_config(cfg: Any) -> ModelConfig:
  """Builds, resolves and validates a `ModelConfig` from a ConfigDict / mapping (`config.model`)."""
  if isinstance(cfg, ModelConfig):
    return validate(resolve(cfg))
  return validate(resolve(_build(ModelConfig, cfg, "model")))


def to_dict(cfg: ModelConfig) -> dict:
  return dataclasses.asdict(cfg)


def default_config_dict(cls=ModelConfig):
  """The dataclass defaults as an ml_collections ConfigDict (the one source of the model defaults).

  Optional fields (`Optional[int]` ...) become `config_fields.optional` fields, so that the command
  line can set them to a value or to None (`--config.model.attention.q_lora_rank=None`,
  `--config.model.attention.latent_dim=192`).
  """
  import ml_collections
  from umoe_jax.config_fields import optional

  hints = typing.get_type_hints(cls)
  out = {}
  for f in dataclasses.fields(cls):
    value = getattr(cls(), f.name)
    args = typing.get_args(hints[f.name])
    if dataclasses.is_dataclass(value):
      out[f.name] = default_config_dict(type(value))
    elif type(None) in args:
      (inner,) = [a for a in args if a is not type(None)]
      out[f.name] = optional(inner, value)
    else:
      out[f.name] = value
  return ml_collections.ConfigDict(out)
