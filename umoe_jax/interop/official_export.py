"""This project's model -> the official UMoE checkpoint layout (the inverse of `official`'s import).

  official_config_json(model_cfg, *, expert_layout="unsloth") -> dict     the official config.json
      (`OfficialExportError` naming the first feature the official code cannot express)
  official_state_dict(params, model_cfg, *, expert_layout="unsloth") -> {official name: array}

The importer is the definition of the layout: `official_config.config_from_official` reads the
config this module writes back into the same model config (checked on every export, so a field this
module forgets is refused, not silently changed), and the tensors are the importer's mapping table
(`official_weights._official_specs`) run backwards. Every entry of that table only moves elements
(transposes, reshapes, splits, blocks), so running it on the element indices of the official tensor
says where each of our elements goes: the inverse is exact, bit for bit, with no second table to
keep in step. Parameters the official model holds but never uses with a config (e.g. the FFN's
always-on expert inside a UMoE-Att layer) are not written; the official loader leaves them as it
initialises them.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from umoe_jax.config import ConfigError, ModelConfig, model_config
from umoe_jax.interop.official_config import OFFICIAL_MODEL_TYPE, config_from_official
from umoe_jax.interop.official_weights import _official_specs, _Part


class OfficialExportError(ConfigError):
  """The model has a feature the official UMoE code cannot express; the message names it."""


def _refuse(feature: str, value: Any, why: str) -> OfficialExportError:
  return OfficialExportError(f"cannot export to the official UMoE format: {feature}={value!r} "
                             f"({why})")


# Runtime choices of this project that do not change the function (compared neither way).
_RUNTIME = ("compute_dtype", "param_dtype", "gmm_backend", "matmul_precision", "scan_layers",
            "attention.core", "attention.core_backward", "moe.fuse_activation", "moe.fuse_weight_rows")
# Router keys that only shape training (losses and their schedules), given the router is top-k softmax.
_TRAINING_ONLY = ("balance_loss", "balance_coef", "z_loss_coef", "jitter_eps", "entropy_coef",
                  "logits_dtype", "topk_backend", "top_p", "expert_choice_capacity",
                  "expert_choice_slots", "xmoe_dim", "xmoe_temperature", "xmoe_learn_temperature",
                  "hash_seed", "smoe_dropout_k_start", "smoe_dropout_steps", "stablemoe_stage2_step",
                  "stablemoe_distill_dim", "stablemoe_distill_coef", "stablemoe_vocab_size",
                  "similarity_temperature", "attention_temperature", "aoe_dim")


def _family(cfg: ModelConfig) -> str:
  att, ffn = cfg.attention.kind, cfg.ffn.kind
  if att == "mha":
    return "ffn_moe" if ffn == "moe" else "dense"
  if att in ("moa", "switchhead"):
    return att
  if att == "premix":
    if ffn == "dense":
      return "umoe_att"
    return "umoe" if cfg.moe.share_pool else "umoe_att_moe_ffn"
  return att


def _check_features(cfg: ModelConfig) -> None:
  """Refusals with their reasons for the features the issue tracker names (the generic comparison
  in `official_config_json` catches anything else)."""
  if cfg.attention.kind == "postmix":
    raise _refuse("model.attention.kind", "postmix", "the official decoder layer never builds its "
                  "post-mixing attention")
  if cfg.ffn.kind == "none":
    raise _refuse("model.ffn.kind", "none", "the official importer refuses skip_shared_ffn")
  if cfg.moe.gated:
    raise _refuse("model.moe.gated", True, "the official swiglue_mlp weights are not mapped")
  if cfg.moe.share_across_layers:
    raise _refuse("model.moe.share_across_layers", True, "the official share_layer is not mapped")
  if cfg.rope_layout != "interleaved":
    raise _refuse("model.rope_layout", cfg.rope_layout, "the official code rotates interleaved pairs")
  routed = cfg.routed_sublayers
  routers = {s: cfg.router_for(s) for s in routed}
  for s, r in routers.items():
    key = lambda k: cfg.router_key(s, k)   # noqa: E731
    if r.kind != "topk_softmax":
      raise _refuse(key("kind"), r.kind, "the official code has only the top-k softmax router")
    if r.selection != "top_k":
      raise _refuse(key("selection"), r.selection, "the official code picks the top-k experts")
    if r.mixing != "none":
      raise _refuse(key("mixing"), r.mixing, "the official code does not mix routing over tokens")
    if r.bias_update_rate > 0:
      raise _refuse(key("bias_update_rate"), r.bias_update_rate,
                    "the official code has no aux-loss-free selection bias")
  if len(routed) == 2:
    att_r, ffn_r = (dataclasses.asdict(routers[s]) for s in ("attention", "ffn"))
    for k in ("kind", "selection", "mixing", "renormalize"):
      if att_r[k] != ffn_r[k]:
        raise OfficialExportError(
            f"cannot export to the official UMoE format: different routers for attention and FFN "
            f"({cfg.router_key('attention', k)}={att_r[k]!r}, {cfg.router_key('ffn', k)}="
            f"{ffn_r[k]!r}); the official code has one router for both sub-layers")
  if cfg.router.share_att_ffn:
    raise _refuse("model.router.share_att_ffn", True, "the official importer refuses a shared router")
  if cfg.moe.share_always_on:
    raise _refuse("model.moe.share_always_on", True,
                  "an always-on expert tied between attention and FFN is not mapped")


def _activation_fields(cfg: ModelConfig, family: str) -> dict:
  act = cfg.moe.activation
  if act == "none":
    if family != "umoe":
      raise _refuse("model.moe.activation", "none", "the official no_act drops the activation of "
                    "the pre-mixing experts of a UMoE layer only")
    return {"hidden_act": "silu", "no_act": True}
  return {"hidden_act": {"silu": "silu", "relu": "relu", "gelu": "gelu_pytorch_tanh"}[act],
          "no_act": False}


def _balance_fields(r) -> dict:
  coef = 0.0 if r.balance_loss == "none" else float(r.balance_coef)
  return {"aux_loss_alpha": coef, "seq_aux": r.balance_loss != "switch"}


def official_config_json(model_cfg, *, expert_layout: str = "unsloth") -> dict:
  """The official config.json of a model (module docstring); `expert_layout` "unsloth" (the current
  official default) or "megatron" selects the grouped-GEMM backend flag it names."""
  cfg = model_config(model_cfg)
  _check_features(cfg)
  family = _family(cfg)
  att, ffn, moe = cfg.attention, cfg.ffn, cfg.moe
  dk = att.head_dim
  cj: dict[str, Any] = {
      "architectures": ["DeepseekV2ForCausalLM"], "model_type": OFFICIAL_MODEL_TYPE,
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers,
      "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
      "rope_theta": cfg.rope_theta, "rope_scaling": None, "initializer_range": cfg.init_std,
      "num_attention_heads": att.n_heads, "num_key_value_heads": att.n_heads,
      "qk_nope_head_dim": dk - dk // 2, "qk_rope_head_dim": dk // 2, "v_head_dim": att.v_head_dim,
      "kv_lora_rank": 512, "q_lora_rank": None, "res_query_lora": False, "mla": False,
      "latent_size": None, "premix_att_moe": False, "share_att_ffn_moe": False,
      "baseline_moa": False, "baseline_switchhead": False, "no_ffn_moe": True,
      "ffn_separate_router": False, "ffn_num_experts_per_tok": 0, "n_routed_experts": None,
      "moe_intermediate_size": None, "num_experts_per_tok": None, "n_shared_experts": None,
      "intermediate_size": ffn.d_ff if ffn.kind == "dense" else max(ffn.d_ff, 1),
      "first_k_dense_replace": 0, "moe_layer_freq": 1, "scoring_func": "softmax",
      "topk_method": "greedy", "n_group": None, "topk_group": None, "routed_scaling_factor": 1.0,
      "norm_topk_prob": False, "aux_loss_alpha": 0.001, "seq_aux": True, "ep_size": 1,
      "disable_share_expert_for_att": False, "disable_share_expert_for_ffn": False,
      "seperate_share_expert_for_ffn": True, "attention_bias": False, "attention_dropout": 0.0,
      "tie_word_embeddings": False, "use_cache": True, "pretraining_tp": 1,
      "use_unsloth_moe": expert_layout == "unsloth",
      "use_megatron_cutlass_group_gemm": expert_layout == "megatron", "use_te_group_linear": False,
      **{flag: False for flag in ("share_layer", "swiglue_mlp", "postmix_att_moe", "skip_shared_ffn",
                                  "one_head_attention_moe", "mix_then_routing_unify", "gpt_premix",
                                  "gpt_postmix", "norm_after_mix", "multi_share_expert")},
      "torch_dtype": "float32",
  }
  cj.update(_activation_fields(cfg, family))
  if cfg.routed_sublayers:
    r = cfg.router_for(cfg.routed_sublayers[0])
    cj.update(_balance_fields(r), norm_topk_prob=bool(r.renormalize))
  if family in ("moa", "switchhead"):
    cj.update(n_routed_experts=att.n_experts, num_experts_per_tok=att.top_k,
              n_shared_experts=att.n_shared_experts if family == "moa" else 0,
              **{f"baseline_{family}": True})
  elif family == "ffn_moe":
    cj.update(n_routed_experts=moe.n_experts, moe_intermediate_size=moe.d_expert,
              num_experts_per_tok=ffn.top_k, n_shared_experts=ffn.n_shared_experts, no_ffn_moe=False)
  elif family.startswith("umoe"):
    cj.update(premix_att_moe=True, n_routed_experts=moe.n_experts, moe_intermediate_size=moe.d_expert,
              num_experts_per_tok=att.top_k, q_lora_rank=att.q_lora_rank,
              res_query_lora=att.q_lora_rank is not None)
    if att.latent_dim is not None:
      cj.update(mla=True, latent_size=att.latent_dim)
    if family == "umoe":
      shared = {att.n_shared_experts, ffn.n_shared_experts} - {0}
      cj.update(share_att_ffn_moe=True, ffn_separate_router=True, ffn_num_experts_per_tok=ffn.top_k,
                n_shared_experts=max(shared) if shared else 0,
                disable_share_expert_for_att=att.n_shared_experts == 0,
                disable_share_expert_for_ffn=ffn.n_shared_experts == 0)
    else:
      cj.update(n_shared_experts=att.n_shared_experts,
                disable_share_expert_for_att=att.n_shared_experts == 0)
      if family == "umoe_att_moe_ffn":
        if ffn.top_k != att.top_k or ffn.n_shared_experts != att.n_shared_experts:
          raise _refuse("model.ffn.top_k / model.ffn.n_shared_experts", (ffn.top_k, ffn.n_shared_experts),
                        "a pre-mixing layer with its own MoE FFN shares num_experts_per_tok and "
                        "n_shared_experts with the attention in the official code")
        cj.update(no_ffn_moe=False)
  _check_reads_back(cfg, cj)
  return cj


def _view(cfg: ModelConfig) -> dict[str, Any]:
  """The fields of a model config that determine its function, flattened ("attention.top_k")."""
  flat: dict[str, Any] = {}

  def walk(prefix, d):
    for k, v in d.items():
      if isinstance(v, dict):
        walk(f"{prefix}{k}.", v)
      else:
        flat[f"{prefix}{k}"] = v
  d = dataclasses.asdict(cfg)
  for s in ("attention", "ffn"):   # the resolved routers of the routed sub-layers, not the sections
    d[s].pop("router")
  d.pop("router")
  walk("", d)
  for s in cfg.routed_sublayers:
    walk(f"{s}.router.", {k: v for k, v in dataclasses.asdict(cfg.router_for(s)).items()
                          if k not in _TRAINING_ONLY})
  for k in _RUNTIME:
    flat.pop(k, None)
  att = cfg.attention.kind
  unused = {"mha": ("top_k", "n_shared_experts", "q_lora_rank", "q_lora_norm", "latent_dim", "n_experts"),
            "premix": ("n_heads", "v_head_dim", "n_experts"),
            "moa": ("n_heads", "q_lora_rank", "q_lora_norm", "latent_dim"),
            "switchhead": ("n_shared_experts", "q_lora_rank", "q_lora_norm", "latent_dim")}.get(att, ())
  for k in unused:
    flat.pop(f"attention.{k}")
  if att == "premix" and cfg.attention.q_lora_rank is None:
    flat.pop("attention.q_lora_norm")
  if cfg.ffn.kind != "dense":
    flat.pop("ffn.d_ff")
  if cfg.ffn.kind != "moe":
    for k in ("top_k", "n_shared_experts"):
      flat.pop(f"ffn.{k}")
  if not (cfg.attention_uses_experts and cfg.ffn_uses_experts):
    flat.pop("moe.share_pool")
  if not (cfg.attention_uses_experts or cfg.ffn_uses_experts):
    for k in ("n_experts", "d_expert"):
      flat.pop(f"moe.{k}")
  if att in ("mha", "moa", "switchhead") and cfg.ffn.kind == "dense" and "moe.d_expert" in flat:
    flat.pop("moe.d_expert")
  return flat


def _check_reads_back(cfg: ModelConfig, cj: dict) -> None:
  """The importer must read `cj` back as `cfg` on every field of `_view`; else the first field that
  differs is refused (the official code cannot express its value)."""
  try:
    back = model_config(config_from_official(cj))
  except ConfigError as e:
    raise OfficialExportError(f"cannot export to the official UMoE format: {e}") from None
  ours, theirs = _view(cfg), _view(back)
  for key in sorted(set(ours) | set(theirs)):
    if ours.get(key, "<absent>") != theirs.get(key, "<absent>"):
      raise _refuse(f"model.{key}", ours.get(key, "<absent>"),
                    f"the official code cannot express it: its config would read back as "
                    f"{theirs.get(key, '<absent>')!r}")


def official_state_dict(params: Mapping[tuple, np.ndarray], model_cfg, *,
                        expert_layout: str = "unsloth") -> dict[str, np.ndarray]:
  """{official tensor name: array} from our parameters {path tuple: array} (e.g. from
  `nnx.to_flat_state`), each in the dtype of the parameters it is made of. Raises
  OfficialExportError when the official tensors would leave one of our parameters out."""
  cfg = model_config(model_cfg)
  specs, _ = _official_specs(cfg, expert_layout)
  params = {tuple(p): np.asarray(v) for p, v in params.items()}
  used: set = set()
  out = {}
  for name, spec in specs.items():
    size = int(np.prod(spec.shape))
    flat = np.empty(size, dtype=None)
    covered = np.zeros(size, np.int32)
    dtype = None
    for path, where in spec.make(np.arange(size).reshape(spec.shape)).items():
      ours = params[path]
      if isinstance(where, _Part):        # block `index` of `count` along axis 0 of our parameter
        n = ours.shape[0] // where.count
        ours, where = ours[where.index * n:(where.index + 1) * n], where.value
      if tuple(ours.shape) != tuple(where.shape):
        raise ValueError(f"{name}: our {'/'.join(map(str, path))} has shape {ours.shape}, the "
                         f"mapping wants {where.shape}")
      if dtype is None:
        dtype = ours.dtype
        flat = np.empty(size, dtype)
      flat[where.ravel()] = ours.ravel()
      np.add.at(covered, where.ravel(), 1)
      used.add(path)
    if not np.all(covered == 1):
      raise ValueError(f"{name}: the mapping does not cover each element once")
    out[name] = flat.reshape(spec.shape)
  left = sorted("/".join(map(str, p)) for p in set(params) - used)
  if left:
    raise OfficialExportError(f"cannot export to the official UMoE format: parameters "
                              f"{', '.join(left[:6])} have no official tensor")
  return out
