"""`validate(cfg)`: values and combinations of a `ModelConfig`, each error naming key and value;
the checks per attention kind here, the routers' in `router_checks`. Names and traits of the
pluggable kinds come from `umoe_jax.kinds` (nothing here imports the model)."""
from __future__ import annotations

from umoe_jax import kinds
from umoe_jax.config.router_checks import validate_routers
from umoe_jax.config.schema import (ACTIVATIONS, DTYPES, PRECISIONS, ROPE_LAYOUTS, ModelConfig,
                                    choices, require)


def validate(cfg: ModelConfig) -> ModelConfig:
  """Checks values and combinations; returns `cfg` unchanged when all is well."""
  for key in ("vocab_size", "d_model", "n_layers", "max_seq_len"):
    require(getattr(cfg, key) > 0, f"model.{key}={getattr(cfg, key)!r} must be positive")
  require(cfg.rope_layout in ROPE_LAYOUTS,
          f"model.rope_layout={cfg.rope_layout!r}; valid: {', '.join(ROPE_LAYOUTS)}")
  for key in ("param_dtype", "compute_dtype"):
    require(getattr(cfg, key) in DTYPES, f"model.{key}={getattr(cfg, key)!r}; valid: {', '.join(DTYPES)}")
  for key in ("norm_eps", "rope_theta", "init_std"):
    require(getattr(cfg, key) > 0, f"model.{key}={getattr(cfg, key)!r} must be positive")
  require(cfg.matmul_precision in PRECISIONS,
          f"train.precision={cfg.matmul_precision!r}; valid: {', '.join(PRECISIONS)}")
  require(cfg.gmm_backend == "auto" or cfg.gmm_backend in kinds.GMM_BACKENDS,
          f"model.gmm_backend={cfg.gmm_backend!r}; valid: auto, {', '.join(kinds.GMM_BACKENDS)}")

  att, ffn, moe, router = cfg.attention, cfg.ffn, cfg.moe, cfg.router
  require(att.kind in kinds.ATTENTION_KINDS,
          f"model.attention.kind={att.kind!r}; valid: {choices(kinds.ATTENTION_KINDS)}")
  require(att.head_dim > 0 and att.head_dim % 2 == 0,
          f"model.attention.head_dim={att.head_dim!r} must be a positive even number (RoPE rotates pairs)")
  require(att.core in kinds.ATTENTION_CORES,
          f"model.attention.core={att.core!r}; valid: {', '.join(kinds.ATTENTION_CORES)}")
  require(att.core_backward in kinds.ATTENTION_BACKWARDS,
          f"model.attention.core_backward={att.core_backward!r}; valid: "
          f"{', '.join(kinds.ATTENTION_BACKWARDS)}")
  _ATTENTION_CHECKS[att.kind](cfg)

  require(ffn.kind in kinds.FFN_KINDS, f"model.ffn.kind={ffn.kind!r}; valid: {', '.join(kinds.FFN_KINDS)}")
  if ffn.kind == "dense":
    require(ffn.d_ff > 0, f"model.ffn.d_ff={ffn.d_ff!r} must be set (> 0) for a dense FFN")
  elif ffn.kind == "moe":
    require(ffn.top_k >= 1, f"model.ffn.top_k={ffn.top_k!r} must be >= 1")
    require(ffn.n_shared_experts >= 0, f"model.ffn.n_shared_experts={ffn.n_shared_experts!r} must be >= 0")

  # The activation also serves the dense FFN and always-on experts; routers also serve MoA/SwitchHead.
  require(moe.activation in ACTIVATIONS,
          f"model.moe.activation={moe.activation!r}; valid: {', '.join(ACTIVATIONS)}")
  validate_routers(cfg)
  pool = cfg.attention_uses_experts or cfg.ffn_uses_experts
  if pool:
    require(moe.n_experts > 0, f"model.moe.n_experts={moe.n_experts!r} must be set (> 0) for routed experts")
    require(moe.d_expert > 0, f"model.moe.d_expert={moe.d_expert!r} must be set (> 0) for routed experts")
    if cfg.ffn_uses_experts:
      require(ffn.top_k <= moe.n_experts,
              f"model.ffn.top_k={ffn.top_k} exceeds model.moe.n_experts={moe.n_experts}")
  both = cfg.attention_uses_experts and cfg.ffn_uses_experts
  require(not moe.share_across_layers or pool,
          f"model.moe.share_across_layers={moe.share_across_layers!r} needs routed experts (a pool to share)")
  require(not router.share_att_ffn or (both and moe.share_pool),
          f"model.router.share_att_ffn={router.share_att_ffn!r} needs an attention and an FFN that route "
          f"into one pool (attention.kind={att.kind!r}, ffn.kind={ffn.kind!r}, moe.share_pool={moe.share_pool!r})")
  if moe.share_always_on:
    require(both and att.n_shared_experts > 0 and ffn.n_shared_experts == att.n_shared_experts,
            f"model.moe.share_always_on={moe.share_always_on!r} needs a pooled attention and MoE FFN with equal "
            f"always-on widths (attention.n_shared_experts={att.n_shared_experts!r}, "
            f"ffn.n_shared_experts={ffn.n_shared_experts!r}, attention.kind={att.kind!r}, ffn.kind={ffn.kind!r})")
  return cfg


# Per attention kind: its own checks (each raises ConfigError naming key and value).


def _check_heads(cfg: ModelConfig) -> None:
  """Multi-head variants: at least one head and a positive value head dim."""
  att = cfg.attention
  require(att.n_heads >= 1, f"model.attention.n_heads={att.n_heads!r} must be >= 1")
  require(att.v_head_dim >= 1, f"model.attention.v_head_dim={att.v_head_dim!r} must be >= 1")


def _check_own_experts(cfg: ModelConfig, what: str = "") -> None:
  """Variants with their own experts (`attention.n_experts`): 1 <= top_k <= n_experts."""
  att = cfg.attention
  require(att.n_experts >= 1,
          f"model.attention.n_experts={att.n_experts!r} must be >= 1 for {att.kind}{what}")
  require(1 <= att.top_k <= att.n_experts, f"model.attention.top_k={att.top_k!r} must be in [1, "
          f"attention.n_experts={att.n_experts}] for {att.kind}")


def _check_pool_routing(cfg: ModelConfig) -> None:
  """Variants routing into the layer's pool: top_k in [1, moe.n_experts], shared experts and the
  low-rank rank non-negative / positive."""
  att = cfg.attention
  require(att.top_k >= 1, f"model.attention.top_k={att.top_k!r} must be >= 1")
  require(not cfg.moe.n_experts or att.top_k <= cfg.moe.n_experts,
          f"model.attention.top_k={att.top_k} exceeds model.moe.n_experts={cfg.moe.n_experts}")
  require(att.n_shared_experts >= 0,
          f"model.attention.n_shared_experts={att.n_shared_experts!r} must be >= 0")
  require(att.q_lora_rank is None or att.q_lora_rank >= 1,
          f"model.attention.q_lora_rank={att.q_lora_rank!r} must be >= 1 or None")


def _check_premix(cfg: ModelConfig) -> None:
  _check_pool_routing(cfg)
  latent = cfg.attention.latent_dim
  require(latent is None or latent >= 1, f"model.attention.latent_dim={latent!r} must be >= 1 or None")


def _check_postmix(cfg: ModelConfig) -> None:
  _check_pool_routing(cfg)
  latent = cfg.attention.latent_dim
  require(latent is None, f"model.attention.latent_dim={latent!r}: MLA latent values exist only for "
          "attention.kind='premix'")


def _check_moa(cfg: ModelConfig) -> None:
  att = cfg.attention
  _check_own_experts(cfg)
  require(att.n_shared_experts in (0, 1),
          f"model.attention.n_shared_experts={att.n_shared_experts!r}: moa has 0 or 1 always-on head")
  require(att.v_head_dim >= 1, f"model.attention.v_head_dim={att.v_head_dim!r} must be >= 1")


def _check_switchhead(cfg: ModelConfig) -> None:
  _check_heads(cfg)
  _check_own_experts(cfg, " (experts per head)")


_ATTENTION_CHECKS = {"mha": _check_heads, "premix": _check_premix, "postmix": _check_postmix,
                     "moa": _check_moa, "switchhead": _check_switchhead}
assert set(_ATTENTION_CHECKS) == set(kinds.ATTENTION_KINDS), "a kind without config checks"
