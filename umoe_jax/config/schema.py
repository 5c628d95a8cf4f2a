"""The model configuration's frozen dataclasses (`ModelConfig` and its sections) and their helpers.

Every field is documented where it is declared; `model_config` (`umoe_jax.config.parsing`) builds
them from a ConfigDict and validates them (`umoe_jax.config.checks`).
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Optional

from umoe_jax import kinds

ACTIVATIONS = ("silu", "gelu", "relu", "none")
ROPE_LAYOUTS = ("interleaved", "half")
DTYPES = ("float32", "bfloat16", "float16")
PRECISIONS = ("bf16", "fp8")   # train.precision, carried as ModelConfig.matmul_precision


class ConfigError(ValueError):
  """A configuration key or value is wrong; the message names both."""


def require(cond: bool, message: str) -> None:
  """Raises ConfigError(message) unless `cond`."""
  if not cond:
    raise ConfigError(message)


def choices(table) -> str:
  """The names of a table, sorted, for "valid: ..." messages."""
  return ", ".join(sorted(table))


@dataclasses.dataclass(frozen=True)
class RouterConfig:
  """How tokens pick experts (see `umoe_jax.model.routers`)."""
  # The router family: topk_softmax, topk_sigmoid, xmoe, hash, smoe_dropout, stablemoe,
  # similarity_aware, attention_aware or aoe (`umoe_jax.kinds.ROUTER_KINDS`); change it to compare routers.
  kind: str = "topk_softmax"
  renormalize: bool = False           # divide the top-k gates by their sum, so they add up to 1
                                      # (the official UMoE code does not)
  balance_loss: str = "seq_aux"       # load-balancing loss: "seq_aux" (DeepSeek's, per sequence),
                                      # "switch" (per batch) or "none"
  balance_coef: float = 0.001         # weight of the balance loss in the objective; raise it when
                                      # a few experts take most tokens
  share_att_ffn: bool = False         # the FFN reuses the attention router's weights (with its own
                                      # top-k and loss): fewer router parameters, an ablation
  xmoe_dim: int = 16                  # routing dimension d_r of X-MoE's low-rank cosine scores
  xmoe_temperature: float = 0.3       # X-MoE's temperature tau_0: of the balance loss, and the
                                      # gating temperature's (initial) value
  xmoe_learn_temperature: bool = True  # learn X-MoE's gating temperature (as its paper); False keeps
                                      # it fixed (as torchscale and LibMoE)
  hash_seed: int = 42                 # seed of the hash router's fixed token id -> experts map
  smoe_dropout_k_start: int = 1       # SMoE-Dropout: active experts at step 0 (at most the
                                      # sub-layer's top_k)
  smoe_dropout_steps: int = 10000     # SMoE-Dropout: steps over which k grows linearly to the
                                      # sub-layer's top_k; set it to the run's length as its paper
  stablemoe_stage2_step: int = 6000   # StableMoE: the step where stage 2 starts and routing freezes
                                      # to the distilled router (paper: 6000 of 60000)
  stablemoe_distill_dim: int = 50     # StableMoE: width of the distilled token-embedding router
  stablemoe_distill_coef: float = 0.3  # StableMoE: weight of the stage-1 distillation loss
  stablemoe_vocab_size: Optional[int] = None  # StableMoE: rows of its token table; None =
                                      # model.vocab_size
  similarity_temperature: Optional[float] = None  # similarity mixing: tau of softmax_j(u_i . u_j / tau)
                                      # over earlier tokens; None = sqrt(d_model)
  attention_temperature: float = 1.0  # attention mixing: sigma, the mixing weights are the chosen
                                      # head's attention A^(1/sigma), renormalised
  aoe_dim: Optional[int] = None       # Autonomy-of-Experts: rank r of each expert's factorised
                                      # first projection, whose norm is its score; None = d_model // 3
  mixing: str = "none"                # mix a router's distributions before it picks (Mutual-Inform
                                      # SMoE): "similarity" (similar earlier tokens), "attention" (the
                                      # tokens the block's MHA attends to) or "none"; no cached decoding
  selection: str = "top_k"            # how picks are made: "top_k"; "top_p" (experts until their
                                      # probabilities pass top_p, at most top_k); "expert_choice" (each
                                      # expert takes its best tokens; FFN only, sees future tokens, so a
                                      # baseline that cannot decode)
  top_p: float = 0.6                  # top_p selection: the probability mass P to cover
  entropy_coef: float = 0.0           # weight of a routing-entropy loss; top_p needs it > 0 (AoE: 1e-4)
                                      # so the distributions sharpen
  expert_choice_capacity: Optional[float] = None  # expert_choice: capacity factor c, each expert takes
                                      # c * tokens / E tokens; None = the sub-layer's top_k
  expert_choice_slots: Optional[int] = None  # expert_choice: slots kept per token (its best picks);
                                      # None = E, all of them
  z_loss_coef: float = 0.0            # weight of ST-MoE's router z-loss mean(logsumexp(logits)^2),
                                      # which keeps logits small and training stable (typical: 1e-3)
  jitter_eps: float = 0.0             # Switch's multiplicative jitter: the router input times
                                      # U(1 - eps, 1 + eps), in training only (typical: 0.01)
  bias_update_rate: float = 0.0       # DeepSeek-V3's aux-loss-free balancing: a per-expert selection
                                      # bias moved by rate * sign(mean load - load) each step (paper:
                                      # 1e-3); 0 = off
  logits_dtype: str = "float32"       # operands of the router matmul x W_r: "float32" as the official
                                      # router, or "bfloat16" (float32 accumulation), a little faster
  topk_backend: str = "auto"          # the top-k ids: "xla" (lax.top_k), "triton" (a one-pass GPU
                                      # kernel, the same ids) or "auto" (triton on one GPU, else xla)

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
  n_experts: int = 0                  # E, the routed experts per layer; 0 = no routed experts
  d_expert: int = 0                   # F, each expert's hidden width (also the always-on experts'
                                      # unit width)
  activation: str = "silu"            # the experts' activation: silu, gelu, relu or none (the
                                      # paper's ablation without one)
  gated: bool = False                 # gated experts act(x W_gate) * (x W_up) W_down (SwiGLU with
                                      # silu) for routed and always-on experts and the dense FFN
  share_pool: bool = True             # attention and FFN of a layer route into the same experts
                                      # (UMoE); False gives each its own pool
  share_across_layers: bool = False   # one routed pool for all layers (the official share_layer)
  share_always_on: bool = False       # the FFN reuses the attention's always-on expert
  fuse_activation: bool = True        # non-gated silu / relu pools take their activation's derivative
                                      # inside the last grouped matmul's backward, saving a pass and
                                      # memory; False runs the plain path (for comparison)
  fuse_weight_rows: bool = False      # for memory (a lower peak), not speed: the last
                                      # matmul's weight gradient reads gate-scaled rows that the input
                                      # gradient's kernel writes, not an XLA pass (Triton backend only)

@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Attention sub-layer. `kind` names an entry of `ATTENTIONS`."""
  kind: str = "mha"                   # the attention variant: mha, premix (UMoE's pre-mixing),
                                      # postmix (expert first, then mix), moa or switchhead
  n_heads: int = 4                    # mha and switchhead: attention heads
  head_dim: int = 64                  # query / key head width d_k (RoPE rotates all of it)
  v_head_dim: int = 64                # mha and switchhead: value head width
  top_k: int = 3                      # premix, postmix, moa, switchhead: routed experts (heads) per
                                      # token, k_att; raise it to move compute into attention
  n_shared_experts: int = 1           # premix, postmix, moa: always-on experts (premix: one expert of
                                      # width n_shared_experts * d_expert); 0 = none (original MoA)
  q_lora_rank: Optional[int] = 16     # premix: rank r of each routed expert's query; None = a full
                                      # per-expert query matrix (an ablation)
  q_lora_norm: bool = True            # premix: RMSNorm on the rank-r query code, as the official code;
                                      # False is the paper's Eq. 11
  latent_dim: Optional[int] = None    # premix: MLA-style values, a latent of this width is cached and
                                      # mixed, then projected back to d_model; a smaller KV cache
  n_experts: int = 0                  # moa: expert heads; switchhead: experts per head (for V and for O)
  core: str = "auto"                  # the scores / causal softmax / mix: "xla", "cudnn" or "triton"
                                      # (fused GPU kernels), "splash" (TPU) or "auto" (the fused kernel
                                      # on one GPU, else xla)
  core_backward: str = "auto"         # the triton core's backward: "recompute" (least memory),
                                      # "stored_pairs" (keep P and dS, less work), "auto"
                                      # (the tile table's choice)
  # The routers of this sub-layer: any `model.router` key but share_att_ffn; None inherits it.
  router: RouterOverrides = dataclasses.field(default_factory=RouterOverrides)


@dataclasses.dataclass(frozen=True)
class FFNConfig:
  """FFN sub-layer: a dense MLP or a routed MoE (into the layer's pool)."""
  kind: str = "dense"                 # "dense" MLP, "moe" (routed into the layer's expert pool) or
                                      # "none" (no FFN: all experts go to attention)
  d_ff: int = 0                       # the dense MLP's hidden width
  top_k: int = 2                      # moe: routed experts per token, k_ffn
  n_shared_experts: int = 1           # moe: always-on experts, one expert of width
                                      # n_shared_experts * d_expert; 0 = none
  # moe: this sub-layer's router, any `model.router` key but share_att_ffn; None inherits it.
  router: RouterOverrides = dataclasses.field(default_factory=RouterOverrides)

@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only LM."""
  vocab_size: int = 32000             # embedding and LM-head rows; at least the tokenizer's size
  d_model: int = 768                  # hidden width D
  n_layers: int = 12                  # decoder blocks
  max_seq_len: int = 1024             # the longest sequence the model takes (train.seq_len and
                                      # generation stay within it)
  norm_eps: float = 1e-6              # RMSNorm epsilon
  rope_theta: float = 10000.0         # RoPE base; raise it for longer contexts
  rope_layout: str = "interleaved"    # RoPE pairs: "interleaved" (DeepSeek, the official code) or
                                      # "half" (GPT-NeoX / Llama); checkpoints expect their own
  init_std: float = 0.02              # standard deviation of the normal weight init
  param_dtype: str = "float32"        # parameters and optimizer state
  compute_dtype: str = "bfloat16"     # activations and matmuls; float32 for exact comparisons
  gmm_backend: str = "auto"           # grouped-matmul backend of the experts: xla, masked, triton,
                                      # mosaic, megablox, or "auto" (the fastest the platform has)
  # Run the decoder blocks as one lax.scan over their stacked parameters: XLA compiles one block
  # instead of n_layers, for a copy of the parameters each step. For deep models and quick CPU runs,
  # where compile time dominates; checkpoints load either way.
  scan_layers: bool = False
  attention: AttentionConfig = dataclasses.field(default_factory=AttentionConfig)
  ffn: FFNConfig = dataclasses.field(default_factory=FFNConfig)
  moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)
  router: RouterConfig = dataclasses.field(default_factory=RouterConfig)
  # The matmuls' operand precision, one of PRECISIONS: train.precision, set when a training run
  # builds its model (`umoe_jax.train.precision`). Not a model.* key: checkpoints hold float32
  # parameters either way, and evaluation, decoding and export build the model without FP8.
  matmul_precision: str = dataclasses.field(default="bf16", metadata={"set_from": "train.precision"})

  def router_for(self, sublayer: str) -> RouterConfig:
    """The router config of sub-layer "attention" or "ffn": `model.router` with the keys its own
    section (`model.<sublayer>.router`) sets, derived defaults filled in (`resolve_router`)."""
    if sublayer not in SUBLAYERS:
      raise ValueError(f"sublayer={sublayer!r}; valid: {', '.join(SUBLAYERS)}")
    return resolve_router(dataclasses.replace(self.router, **overrides(getattr(self, sublayer).router)),
                          self)

  def router_key(self, sublayer: str, key: str) -> str:
    """Where `router_for(sublayer).<key>` comes from: "model.<sublayer>.router.<key>" if that
    section sets it, else "model.router.<key>" (for error messages)."""
    own = key in overrides(getattr(self, sublayer).router)
    return f"model.{sublayer}.router.{key}" if own else f"model.router.{key}"

  @property
  def routed_sublayers(self) -> tuple[str, ...]:
    """The sub-layers with routers: "attention" (an attention kind with routers), "ffn" (an MoE FFN)."""
    att = kinds.ATTENTION_KINDS.get(self.attention.kind)
    return (("attention",) if att and att.has_routers else ()) + (("ffn",) if self.ffn_uses_experts else ())

  @property
  def fp8(self) -> bool:
    """FP8 operands in the expert grouped matmuls, the dense FFN and the always-on experts
    (train.precision; the attention modules' own projections stay in the compute dtype)."""
    return self.matmul_precision == "fp8"

  @property
  def attention_uses_experts(self) -> bool:
    kind = kinds.ATTENTION_KINDS.get(self.attention.kind)
    return bool(kind and kind.uses_expert_pool)

  @property
  def ffn_uses_experts(self) -> bool:
    return self.ffn.kind == "moe"


SUBLAYERS = ("attention", "ffn")


def config_fields(cls) -> list[dataclasses.Field]:
  """The fields of a config dataclass that are config keys: all but those another key sets
  (metadata "set_from", e.g. `ModelConfig.matmul_precision`)."""
  return [f for f in dataclasses.fields(cls) if "set_from" not in f.metadata]


def router_mixing(r: RouterConfig) -> str:
  """The mixing a router applies: its kind's (similarity_aware, attention_aware) or `mixing`."""
  implied = kinds.ROUTER_KINDS[r.kind].mixing if r.kind in kinds.ROUTER_KINDS else "none"
  return implied if implied != "none" else r.mixing


def overrides(section) -> dict:
  """The keys a sub-layer's router section sets (its non-None values)."""
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

