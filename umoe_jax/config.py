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
  core: str = "xla"                   # scores/softmax/mix: "xla", "cudnn" or "triton" (fused causal kernels on GPU, no cache)


@dataclasses.dataclass(frozen=True)
class FFNConfig:
  """FFN sub-layer: a dense MLP or a routed MoE (into the layer's pool)."""
  kind: str = "dense"                 # "dense", "moe", or "none" (no FFN sub-layer)
  d_ff: int = 0                       # dense hidden width
  top_k: int = 2                      # moe: k_ffn
  n_shared_experts: int = 1           # moe: always-on expert of width n_shared * d_expert


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

  @property
  def attention_uses_experts(self) -> bool:
    from umoe_jax.model.attention import ATTENTIONS  # late: model imports config
    return getattr(ATTENTIONS.get(self.attention.kind), "uses_expert_pool", False)

  @property
  def ffn_uses_experts(self) -> bool:
    return self.ffn.kind == "moe"


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


def validate(cfg: ModelConfig) -> ModelConfig:
  """Checks values and combinations; returns `cfg` unchanged when all is well."""
  from umoe_jax.model.attention import ATTENTIONS
  from umoe_jax.model.attention.common import ATTENTION_CORES
  from umoe_jax.model.routers import BALANCE_LOSSES, ROUTERS
  from umoe_jax.ops.gmm import BACKENDS, register_builtin_kernels

  register_builtin_kernels()  # kernel backends ("triton", "mosaic") register on import of kernels/
  for key in ("vocab_size", "d_model", "n_layers", "max_seq_len"):
    _check(getattr(cfg, key) > 0, f"model.{key}={getattr(cfg, key)!r} must be positive")
  _check(cfg.rope_layout in ROPE_LAYOUTS,
         f"model.rope_layout={cfg.rope_layout!r}; valid: {', '.join(ROPE_LAYOUTS)}")
  for key in ("param_dtype", "compute_dtype"):
    _check(getattr(cfg, key) in DTYPES, f"model.{key}={getattr(cfg, key)!r}; valid: {', '.join(DTYPES)}")
  for key in ("norm_eps", "rope_theta", "init_std"):
    _check(getattr(cfg, key) > 0, f"model.{key}={getattr(cfg, key)!r} must be positive")
  _check(cfg.gmm_backend == "auto" or cfg.gmm_backend in BACKENDS,
         f"model.gmm_backend={cfg.gmm_backend!r}; valid: auto, {', '.join(BACKENDS.names())}")

  att, ffn, moe, router = cfg.attention, cfg.ffn, cfg.moe, cfg.router
  _check(att.kind in ATTENTIONS, f"model.attention.kind={att.kind!r}; valid: {', '.join(ATTENTIONS.names())}")
  _check(att.head_dim > 0 and att.head_dim % 2 == 0,
         f"model.attention.head_dim={att.head_dim!r} must be a positive even number (RoPE rotates pairs)")
  _check(att.core in ATTENTION_CORES,
         f"model.attention.core={att.core!r}; valid: {', '.join(ATTENTION_CORES)}")
  ATTENTIONS.get(att.kind).validate(cfg)

  _check(ffn.kind in ("dense", "moe", "none"), f"model.ffn.kind={ffn.kind!r}; valid: dense, moe, none")
  if ffn.kind == "dense":
    _check(ffn.d_ff > 0, f"model.ffn.d_ff={ffn.d_ff!r} must be set (> 0) for a dense FFN")
  elif ffn.kind == "moe":
    _check(ffn.top_k >= 1, f"model.ffn.top_k={ffn.top_k!r} must be >= 1")
    _check(ffn.n_shared_experts >= 0, f"model.ffn.n_shared_experts={ffn.n_shared_experts!r} must be >= 0")

  # The activation also serves the dense FFN and always-on experts; routers also serve MoA/SwitchHead.
  _check(moe.activation in ACTIVATIONS,
         f"model.moe.activation={moe.activation!r}; valid: {', '.join(ACTIVATIONS)}")
  _check(router.kind in ROUTERS, f"model.router.kind={router.kind!r}; valid: {', '.join(ROUTERS.names())}")
  _check(router.balance_loss in BALANCE_LOSSES,
         f"model.router.balance_loss={router.balance_loss!r}; valid: {', '.join(BALANCE_LOSSES)}")
  _check(router.balance_coef >= 0, f"model.router.balance_coef={router.balance_coef!r} must be >= 0")
  _check(router.xmoe_dim >= 1, f"model.router.xmoe_dim={router.xmoe_dim!r} must be >= 1")
  _check(0 < router.xmoe_temperature < float("inf"),
         f"model.router.xmoe_temperature={router.xmoe_temperature!r} must be positive and finite")
  _check(0 <= router.hash_seed < 2 ** 32,
         f"model.router.hash_seed={router.hash_seed!r} must be in [0, 2**32)")
  _check(router.smoe_dropout_k_start >= 1,
         f"model.router.smoe_dropout_k_start={router.smoe_dropout_k_start!r} must be >= 1")
  _check(router.smoe_dropout_steps >= 1,
         f"model.router.smoe_dropout_steps={router.smoe_dropout_steps!r} must be >= 1")
  _check(router.stablemoe_stage2_step >= 0,
         f"model.router.stablemoe_stage2_step={router.stablemoe_stage2_step!r} must be >= 0")
  _check(router.stablemoe_distill_dim >= 1,
         f"model.router.stablemoe_distill_dim={router.stablemoe_distill_dim!r} must be >= 1")
  _check(0 <= router.stablemoe_distill_coef < float("inf"),
         f"model.router.stablemoe_distill_coef={router.stablemoe_distill_coef!r} must be >= 0 and finite")
  _check(router.stablemoe_vocab_size is None or router.stablemoe_vocab_size >= cfg.vocab_size,
         f"model.router.stablemoe_vocab_size={router.stablemoe_vocab_size!r} must be None or >= "
         f"model.vocab_size={cfg.vocab_size} (one row per token id)")
  _check(router.similarity_temperature is None or 0 < router.similarity_temperature < float("inf"),
         f"model.router.similarity_temperature={router.similarity_temperature!r} must be None or "
         f"positive and finite")
  _check(0 < router.attention_temperature < float("inf"),
         f"model.router.attention_temperature={router.attention_temperature!r} must be positive and finite")
  _check(router.aoe_dim is None or router.aoe_dim >= 1,
         f"model.router.aoe_dim={router.aoe_dim!r} must be None or >= 1")
  router_validate = getattr(ROUTERS.get(router.kind), "validate", None)
  if router_validate is not None:
    router_validate(cfg)
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


def resolve(cfg: ModelConfig) -> ModelConfig:
  """Fills the defaults that depend on other keys (routers are built from the RouterConfig alone):
  `router.stablemoe_vocab_size` None -> vocab_size (kind 'stablemoe'), `router.aoe_dim` None ->
  d_model // 3 (kind 'aoe')."""
  r = cfg.router
  if r.kind == "stablemoe" and r.stablemoe_vocab_size is None:
    return dataclasses.replace(cfg, router=dataclasses.replace(r, stablemoe_vocab_size=cfg.vocab_size))
  if r.kind == "aoe" and r.aoe_dim is None:
    return dataclasses.replace(cfg, router=dataclasses.replace(r, aoe_dim=max(1, cfg.d_model // 3)))
  return cfg


def model_config(cfg: Any) -> ModelConfig:
  """Builds, resolves and validates a `ModelConfig` from a ConfigDict / mapping (`config.model`)."""
  if isinstance(cfg, ModelConfig):
    return validate(resolve(cfg))
  return validate(resolve(_build(ModelConfig, cfg, "model")))


def to_dict(cfg: ModelConfig) -> dict:
  return dataclasses.asdict(cfg)


def default_config_dict(cls=ModelConfig):
  """The dataclass defaults as an ml_collections ConfigDict (the one source of the model defaults).

  Optional fields whose default is None become typed placeholders, so that the command line can
  still set them (`--config.model.attention.latent_dim=192`).
  """
  import ml_collections
  from ml_collections import config_dict

  hints = typing.get_type_hints(cls)
  out = {}
  for f in dataclasses.fields(cls):
    value = getattr(cls(), f.name)
    if dataclasses.is_dataclass(value):
      out[f.name] = default_config_dict(type(value))
    elif value is None:
      (inner,) = [a for a in typing.get_args(hints[f.name]) if a is not type(None)]
      out[f.name] = config_dict.placeholder(inner)
    else:
      out[f.name] = value
  return ml_collections.ConfigDict(out)
