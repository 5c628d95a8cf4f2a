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
  logits_dtype: str = "float32"       # x W_r's operands: "float32" (official MoEGate) or "bfloat16" (bf16
                                      # operands, float32 accumulation and softmax; umoe_jax.model.routers.matmul)
  topk_backend: str = "auto"          # top-k / top-P ids (umoe_jax.ops.topk): "xla" (lax.top_k, a sort
                                      # on GPU), "triton" (kernels/triton_topk.py on GPU; same ids) or
                                      # "auto" (triton on one device, xla on several)
  one_pass: bool = False              # softmax, top-k, gates and the balance statistics in one kernel pass over
                                      # the logits (umoe_jax.ops.router_pass; Triton on one GPU, the separate
                                      # ops elsewhere): softmax routers, top_k selection, no mixing. Off: it
                                      # lost in the step on an H200 (BENCHMARKS.md runs 81-82)


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
  fuse_activation: bool = True        # routed experts with a silu / relu activation, not gated:
                                      # its derivative taken in the last grouped matmul's backward
                                      # epilogue (fused_dispatch.gmm_combine(activation=)), d act(z)
                                      # never written (H200: -2.3 ms, -2.6 GB a UMoE-base step,
                                      # BENCHMARKS.md run 27); other pools: the plain path
  fuse_weight_rows: bool = False      # the last matmul's weight gradient reads gate * act(z) rows written by
                                      # its input-gradient matmul's epilogue, not by an XLA pass (Triton;
                                      # the same values; not yet timed on a GPU: off)


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
  core: str = "auto"                  # scores/softmax/mix: "xla", "cudnn"/"triton" (fused causal GPU kernels, no cache), "splash" (TPU),
                                      # "auto" (one GPU: the fused kernels; else xla; attention.common.auto_core)
  core_backward: str = "auto"         # the "triton" core's backward: "recompute" P and dS per pass, "stored" (the dK pass
                                      # stores them for dQ / dX), "stored_pairs" (a tile-pair pass stores them), "auto" (the tiles' own:
                                      # stored_pairs for heads <= 256 wide, else recompute)
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
  # Run the decoder blocks as one lax.scan over their stacked parameters (training and scoring; a
  # decode with a KV cache loops): one block to compile instead of n_layers, for one copy of the
  # blocks' parameters a step (a pool shared across layers: once per layer). The parameter layout
  # (and checkpoints) stay the same either way.
  scan_layers: bool = False
  attention: AttentionConfig = dataclasses.field(default_factory=AttentionConfig)
  ffn: FFNConfig = dataclasses.field(default_factory=FFNConfig)
  moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)
  router: RouterConfig = dataclasses.field(default_factory=RouterConfig)

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

