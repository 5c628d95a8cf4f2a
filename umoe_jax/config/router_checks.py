"""The routers' config checks: `model.router`'s values, every routed sub-layer's own router
(`ModelConfig.router_for`) with its errors naming the key where it is set, what each router kind can
serve (`kinds.ROUTER_KINDS`), and `check_cached_decoding`."""
from __future__ import annotations

from umoe_jax import kinds
from umoe_jax.config.schema import (SUBLAYERS, ConfigError, ModelConfig, RouterConfig, choices,
                                    overrides, require, router_mixing)


def validate_routers(cfg: ModelConfig) -> None:
  """`model.router`'s values, then every routed sub-layer's own router (`router_for`): its values,
  named where they are set, and what its kind can serve (`kinds.ROUTER_KINDS`)."""
  _check_router_values(cfg.router, cfg, lambda key: f"model.router.{key}")
  for sublayer in SUBLAYERS:
    own = overrides(getattr(cfg, sublayer).router)
    if own and sublayer not in cfg.routed_sublayers:
      name = sorted(own)[0]
      what = f"attention.kind={cfg.attention.kind!r}" if sublayer == "attention" else f"ffn.kind={cfg.ffn.kind!r}"
      require(False, f"model.{sublayer}.router.{name}={own[name]!r}: that sub-layer has no router "
              f"(model.{what})")
  for sublayer in cfg.routed_sublayers:
    _check_router_values(cfg.router_for(sublayer), cfg,
                         lambda key, s=sublayer: cfg.router_key(s, key))
    _check_router_placement(cfg, sublayer)
  kind = kinds.ROUTER_KINDS[cfg.router.kind]
  if not cfg.ffn_uses_experts and "attention" not in kind.sublayers:  # an FFN router, and no MoE FFN
    require(False, f"model.router.kind={cfg.router.kind!r} with model.ffn.kind={cfg.ffn.kind!r}: it "
            "routes an MoE FFN (model.ffn.kind='moe')")
  if cfg.router.share_att_ffn and cfg.routed_sublayers == SUBLAYERS:
    att, ffn = cfg.router_for("attention"), cfg.router_for("ffn")
    require(kinds.ROUTER_KINDS[att.kind].weights,
            f"model.router.share_att_ffn={cfg.router.share_att_ffn!r} with {cfg.router_key('attention', 'kind')}="
            f"{att.kind!r}: it has no weights to share")
    rate_key = cfg.router_key("attention", "bias_update_rate")
    require(att.bias_update_rate == 0, f"model.router.share_att_ffn={cfg.router.share_att_ffn!r} with "
            f"{rate_key}={att.bias_update_rate!r}: one selection bias cannot follow two routers' loads")
    how = ("topk_backend",)  # how the router computes, not what: may differ
    diff = sorted(k for k in overrides(cfg.attention.router).keys() | overrides(cfg.ffn.router).keys()
                  if getattr(att, k) != getattr(ffn, k) and k not in how)
    if diff:
      k = diff[0]
      require(False, f"model.router.share_att_ffn={cfg.router.share_att_ffn!r} needs one router for "
              f"attention and FFN, but {cfg.router_key('attention', k)}={getattr(att, k)!r} and "
              f"{cfg.router_key('ffn', k)}={getattr(ffn, k)!r} differ")


def _check_router_placement(cfg: ModelConfig, sublayer: str) -> None:
  """What sub-layer `sublayer`'s router kind can serve there."""
  router, att = cfg.router_for(sublayer), cfg.attention
  kind = kinds.ROUTER_KINDS[router.kind]
  key = f"{cfg.router_key(sublayer, 'kind')}={router.kind!r}"
  if router.selection == "expert_choice":
    require(sublayer == "ffn", f"{cfg.router_key(sublayer, 'selection')}='expert_choice' on the "
            "attention sub-layer: expert choice routes an MoE FFN (model.ffn.router.selection)")
    slots = router.expert_choice_slots
    require(slots is None or slots <= cfg.moe.n_experts,
            f"{cfg.router_key(sublayer, 'expert_choice_slots')}={slots!r} exceeds model.moe.n_experts="
            f"{cfg.moe.n_experts}")
  if sublayer not in kind.sublayers:
    what = ("reads the block's attention probabilities, which exist only after the attention"
            if kind.mixing == "attention" else "scores the experts of an MoE FFN")
    require(False, f"{key} with model.attention.kind={att.kind!r}: it {what}; route the attention "
            "with another kind (model.attention.router.kind) or use model.attention.kind='mha' (an FFN-MoE)")
  if router_mixing(router) == "attention":
    require(sublayer == "ffn", f"{cfg.router_key(sublayer, 'mixing')}='attention' on the attention "
            "sub-layer: it reads the block's attention probabilities, which exist only after the "
            "attention; mix the FFN's router (model.ffn.router.mixing)")
    require(kinds.ATTENTION_KINDS[att.kind].exposes_attention_probs,
            f"{key} with model.attention.kind={att.kind!r}: its attention does not expose its "
            "probabilities; use model.attention.kind='mha' (an FFN-MoE)")


def _check_router_values(router: RouterConfig, cfg: ModelConfig, key) -> None:
  """Values of one router config; `key(name)` is the dotted key to name in an error."""
  def check(name: str, ok: bool, rule: str) -> None:
    require(ok, f"{key(name)}={getattr(router, name)!r}{'' if rule.startswith(';') else ' '}{rule}")

  finite_positive = lambda v: 0 < v < float("inf")
  check("kind", router.kind in kinds.ROUTER_KINDS, f"; valid: {choices(kinds.ROUTER_KINDS)}")
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
  check("logits_dtype", router.logits_dtype in kinds.ROUTER_LOGITS_DTYPES,
        f"; valid: {', '.join(kinds.ROUTER_LOGITS_DTYPES)}")
  check("topk_backend", router.topk_backend in kinds.TOPK_BACKENDS,
        f"; valid: {', '.join(kinds.TOPK_BACKENDS)}")
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

