"""The official UMoE `config.json` (a DeepSeek-V2 config, `model_type: "PremixMoe_v2"`) as this
project's `model` ConfigDict.

  load_official_config(path) -> dict              config.json of a checkpoint directory (or a .json path)
  config_from_official(config_json, *, compute_dtype="float32", gmm_backend="auto") -> ConfigDict
      an official option this project cannot express raises `OfficialConfigError` naming the field
      and its value
  expert_weight_layout(config_json) -> "unsloth" | "megatron"

Which layer the official code builds follows from its flags: `premix_att_moe` (+ `share_att_ffn_moe`:
UMoE) is pre-mixing attention, `baseline_moa` / `baseline_switchhead` the attention-MoE baselines,
otherwise dense attention with a dense or routed (`n_routed_experts`) FFN.

Expert weight layout: the grouped-GEMM backend flag decides how grouped expert tensors are stored
(`official_weights` says how each is read). `use_unsloth_moe` (the default of the current code) is
"unsloth", `use_megatron_cutlass_group_gemm` "megatron"; the code before commit 95284fd of 2025-07-25
had only the megatron backend and its configs have none of the three `use_*` keys. Checkpoints written
with the current code carry `use_unsloth_moe` explicitly (it is not a base-config key, so
`save_pretrained` keeps it). `use_te_group_linear` (TransformerEngine, per-expert `weight<i>` tensors)
is not supported.

Not carried over (training-only): dropout (`attention_dropout`, all released configs use 0). Routers,
balance losses (`aux_loss_alpha`, `seq_aux`) and `norm_topk_prob` map to `model.router`.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

from umoe_jax import json_errors
from umoe_jax.config import ConfigError, ModelConfig, model_config

OFFICIAL_MODEL_TYPE = "PremixMoe_v2"
EXPERT_LAYOUTS = ("unsloth", "megatron")


class OfficialConfigError(ConfigError):
  """An official config.json field has a value this project cannot reproduce; names field and value."""


# Boolean options of DeepseekV2Config (official) the converter rejects. The first group exists in this
# project's model (the key named) but its weights are not mapped by the converter yet; the second
# selects code paths this project does not have.
_MODEL_KEY_NOT_MAPPED = "the model has it ({}), but the converter does not map its weights yet"
_UNSUPPORTED_FLAGS = {
    "share_layer": _MODEL_KEY_NOT_MAPPED.format("model.moe.share_across_layers"),
    "swiglue_mlp": _MODEL_KEY_NOT_MAPPED.format("model.moe.gated"),
    # The official UMoEDecoderLayer never builds its PostMixMoEAttention: with premix_att_moe it
    # builds PreMixMoEAttention, whose expert module only gains key projections it never reads.
    "postmix_att_moe": ("the official decoder layer runs pre-mixing attention with it (its "
                        "PostMixMoEAttention class is never instantiated), so there is no official "
                        "post-mixing model to import; model.attention.kind='postmix' is ours"),
    "skip_shared_ffn": _MODEL_KEY_NOT_MAPPED.format("model.ffn.kind='none'"),
    "one_head_attention_moe": "OneHeadAttentionMoE",
    "mix_then_routing_unify": "MixThenRoutingMoE",
    "gpt_premix": "dense pre-mixing attention",
    "gpt_postmix": "dense post-mixing attention",
    "norm_after_mix": "RMSNorm after token mixing",
    "multi_share_expert": "several always-on experts with separate queries",
    "use_te_group_linear": "TransformerEngine GroupedLinear weights (per-expert weight<i> tensors)",
    "attention_bias": "biases in the attention projections",
    "tie_word_embeddings": "an LM head tied to the embedding",
}

_ACTIVATIONS = {"silu": "silu", "swish": "silu", "relu": "relu",
                "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu_fast": "gelu"}


def _unsupported(field: str, value: Any, why: str) -> OfficialConfigError:
  return OfficialConfigError(f"official config field {field}={value!r} is not supported: {why}")


def _get(cj: Mapping[str, Any], key: str, default: Any = None) -> Any:
  value = cj.get(key, default)
  return default if value is None and default is not None else value


def _need(cj: Mapping[str, Any], key: str) -> Any:
  if cj.get(key) is None:
    raise OfficialConfigError(f"official config field {key} is missing (or null) but required")
  return cj[key]


def expert_weight_layout(config_json: Mapping[str, Any]) -> str:
  """How the grouped expert weights of this checkpoint are laid out: "unsloth" or "megatron"."""
  flags = {k: config_json.get(k) for k in
           ("use_unsloth_moe", "use_megatron_cutlass_group_gemm", "use_te_group_linear")}
  if flags["use_te_group_linear"]:
    raise _unsupported("use_te_group_linear", True, _UNSUPPORTED_FLAGS["use_te_group_linear"])
  if all(v is None for v in flags.values()):
    return "megatron"          # code before the unsloth backend (2025-07-25): megatron grouped GEMM only
  on = [k for k, v in flags.items() if v]
  if len(on) != 1:
    raise OfficialConfigError(
        "official config must enable exactly one grouped-GEMM backend, got "
        + ", ".join(f"{k}={v!r}" for k, v in flags.items()))
  return "unsloth" if on[0] == "use_unsloth_moe" else "megatron"


def _activation(cj: Mapping[str, Any]) -> str:
  act = _get(cj, "hidden_act", "silu")
  if act not in _ACTIVATIONS:
    why = ("HF 'gelu' is the exact erf GELU; this project's gelu is the tanh approximation"
           if act == "gelu" else f"valid: {', '.join(sorted(_ACTIVATIONS))}")
    raise _unsupported("hidden_act", act, why)
  return _ACTIVATIONS[act]


def _family(cj: Mapping[str, Any]) -> str:
  """Which decoder layer the official UMoEDecoderLayer builds for this config."""
  premix = bool(cj.get("premix_att_moe"))
  if not premix and cj.get("baseline_moa"):
    return "moa"
  if not premix and cj.get("baseline_switchhead"):
    return "switchhead"
  if premix and cj.get("share_att_ffn_moe"):
    return "umoe"
  routed_ffn = cj.get("n_routed_experts") is not None and not cj.get("no_ffn_moe")
  if premix:
    return "umoe_att_moe_ffn" if routed_ffn else "umoe_att"
  return "ffn_moe" if routed_ffn else "dense"


def config_from_official(config_json: Mapping[str, Any] | str, *, compute_dtype: str = "float32",
                         param_dtype: str = "float32", gmm_backend: str = "auto"):
  """The `model` ConfigDict equivalent to an official `config.json` (a dict or a path to it).

  `compute_dtype` defaults to float32 (exact logits); use "bfloat16" to train as the official runs did.
  Raises `OfficialConfigError` for an option that has no equivalent here, naming field and value.
  """
  import ml_collections

  if isinstance(config_json, (str, os.PathLike)):
    config_json = load_official_config(config_json)
  cj = dict(config_json)
  model_type = cj.get("model_type")
  if model_type is not None and model_type != OFFICIAL_MODEL_TYPE:
    raise _unsupported("model_type", model_type, f"expected {OFFICIAL_MODEL_TYPE!r} (the official UMoE code)")
  for field, why in _UNSUPPORTED_FLAGS.items():
    if cj.get(field):
      raise _unsupported(field, cj[field], why)
  if cj.get("rope_scaling") is not None:
    raise _unsupported("rope_scaling", cj["rope_scaling"], "only unscaled RoPE is implemented")
  if _get(cj, "ep_size", 1) != 1:
    raise _unsupported("ep_size", cj["ep_size"], "the official code itself refuses ep_size > 1")

  family = _family(cj)
  d = _need(cj, "hidden_size")
  head_dim = _need(cj, "qk_nope_head_dim") + _need(cj, "qk_rope_head_dim")
  n_shared = _get(cj, "n_shared_experts", 0)
  activation = _activation(cj)
  eps = float(_get(cj, "rms_norm_eps", 1e-6))

  m = dataclasses.asdict(ModelConfig())
  m.pop("matmul_precision")  # train.precision's, not a model key
  m.update(vocab_size=_need(cj, "vocab_size"), d_model=d, n_layers=_need(cj, "num_hidden_layers"),
           max_seq_len=_get(cj, "max_position_embeddings", 2048), norm_eps=eps,
           rope_theta=float(_get(cj, "rope_theta", 10000.0)), rope_layout="interleaved",
           init_std=float(_get(cj, "initializer_range", 0.02)), param_dtype=param_dtype,
           compute_dtype=compute_dtype, gmm_backend=gmm_backend)
  att, ffn, moe, router = m["attention"], m["ffn"], m["moe"], m["router"]
  moe["activation"] = activation
  att.update(n_heads=_need(cj, "num_attention_heads"), head_dim=head_dim,
             v_head_dim=_get(cj, "v_head_dim", head_dim))

  routers = family != "dense"
  if routers:
    for field, ok, want in (("scoring_func", lambda v: v == "softmax", "'softmax'"),
                            ("topk_method", lambda v: v == "greedy", "'greedy'")):
      if not ok(cj.get(field)):
        raise _unsupported(field, cj.get(field), f"only {want} routing is implemented")
    if family not in ("moa", "switchhead"):   # those two own their experts (attention.n_experts)
      moe.update(n_experts=_need(cj, "n_routed_experts"), d_expert=_need(cj, "moe_intermediate_size"))
    renorm = bool(cj.get("norm_topk_prob", False))
    if not renorm and float(_get(cj, "routed_scaling_factor", 1.0)) != 1.0:
      raise _unsupported("routed_scaling_factor", cj["routed_scaling_factor"], "gates are not rescaled here")
    alpha = float(_get(cj, "aux_loss_alpha", 0.001))
    router.update(kind="topk_softmax", renormalize=renorm,
                  balance_loss="seq_aux" if _get(cj, "seq_aux", True) else "switch", balance_coef=alpha)

  if cj.get("no_act"):      # drops the activation of the pre-mixing experts (and their always-on MLPs)
    if family == "umoe":
      moe["activation"] = "none"
    elif family != "dense" and family != "ffn_moe":   # (no effect on dense / FFN-MoE models)
      raise _unsupported("no_act", True, "the pre-mixing experts would have no activation but the FFN would")

  if family in ("moa", "switchhead"):
    if not cj.get("no_ffn_moe"):
      raise _unsupported("no_ffn_moe", cj.get("no_ffn_moe"), f"{family} with a routed FFN "
                         "(the released baselines have a dense MLP)")
    k_att = _need(cj, "num_experts_per_tok")
    att.update(kind=family, n_experts=_need(cj, "n_routed_experts"), top_k=k_att)
    if family == "moa":   # the always-on head (the official code allows 0 or 1)
      att["n_shared_experts"] = n_shared
  elif family in ("dense", "ffn_moe"):
    att["kind"] = "mha"
    if cj.get("q_lora_rank") is not None:
      raise _unsupported("q_lora_rank", cj["q_lora_rank"],
                         "dense attention with a low-rank (q_a_proj/q_b_proj) query")
    kv = _get(cj, "num_key_value_heads", att["n_heads"])
    if kv != att["n_heads"]:
      raise _unsupported("num_key_value_heads", kv,
                         f"grouped-query attention (num_attention_heads={att['n_heads']})")
  else:
    k_att = _need(cj, "num_experts_per_tok")
    if k_att < 1:
      raise _unsupported("num_experts_per_tok", k_att, "pre-mixing attention without routed experts")
    r = cj.get("q_lora_rank")
    if r is not None and not cj.get("res_query_lora"):
      raise _unsupported("res_query_lora", cj.get("res_query_lora"),
                         "low-rank routed queries without the shared residual query W_q_res")
    if r is not None and eps != 1e-6:
      raise _unsupported("rms_norm_eps", eps,
                         "q_a_layernorm always uses eps 1e-6 in the official code; ours uses rms_norm_eps")
    att_shared = 0 if cj.get("disable_share_expert_for_att") else n_shared
    att.update(kind="premix", top_k=k_att, n_shared_experts=att_shared, q_lora_rank=r, q_lora_norm=True)
    if cj.get("mla"):     # values X W_latent_code (cached), code2value after mixing
      att["latent_dim"] = _need(cj, "latent_size")

  if family in ("dense", "moa", "switchhead"):
    ffn.update(kind="dense", d_ff=_need(cj, "intermediate_size"))
  elif family in ("ffn_moe", "umoe_att_moe_ffn"):
    first_dense, freq = _get(cj, "first_k_dense_replace", 0), _get(cj, "moe_layer_freq", 1)
    if first_dense != 0:
      raise _unsupported("first_k_dense_replace", first_dense, "every layer has the same FFN here")
    if freq != 1:
      raise _unsupported("moe_layer_freq", freq, "every layer has the same FFN here")
    ffn.update(kind="moe", top_k=_need(cj, "num_experts_per_tok"), n_shared_experts=n_shared)
    moe["share_pool"] = family == "ffn_moe"  # premix attention + its own GroupedMoE: two pools
  elif family == "umoe_att":
    ffn.update(kind="dense", d_ff=_need(cj, "intermediate_size"))
  else:  # umoe: the FFN routes into the attention's experts
    k_ffn = _get(cj, "ffn_num_experts_per_tok", 0)
    if k_ffn < 1:
      raise _unsupported("ffn_num_experts_per_tok", k_ffn, "a UMoE layer needs FFN experts")
    if not cj.get("ffn_separate_router"):
      raise _unsupported("ffn_separate_router", cj.get("ffn_separate_router"),
                         "the FFN reusing the attention router's weights")
    ffn_shared = 0 if cj.get("disable_share_expert_for_ffn") else n_shared
    if ffn_shared and not _get(cj, "seperate_share_expert_for_ffn", True):
      raise _unsupported("seperate_share_expert_for_ffn", False,
                         "an always-on expert tied between attention and FFN")
    ffn.update(kind="moe", top_k=k_ffn, n_shared_experts=ffn_shared)
    moe["share_pool"] = True
  if routers:
    tops = [att["top_k"]] if att["kind"] in ("premix", "moa", "switchhead") else []
    tops += [ffn["top_k"]] if ffn["kind"] == "moe" else []
    if router["renormalize"] and 1 in tops:
      raise _unsupported("norm_topk_prob", True, "the official code skips renormalisation when top-k is 1")

  cfg = ml_collections.ConfigDict(m)
  model_config(cfg)                                 # validates: raises ConfigError on an impossible value
  return cfg



def load_official_config(path: str) -> dict:
  """config.json of a checkpoint directory (or the path of a config .json file).

  A missing file, a file given instead of the directory, or a config.json that is not a JSON
  object raise errors naming the path and the problem."""
  path = os.fspath(path)
  if os.path.isdir(path):
    path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
      raise FileNotFoundError(f"{os.path.dirname(path)}: no config.json (an official checkpoint "
                              "directory holds config.json and model.safetensors or shards)")
  elif os.path.isfile(path) and not path.endswith(".json"):
    raise OfficialConfigError(f"{path} is a file; pass the official checkpoint directory that "
                              "holds it (config.json + model.safetensors / shards / "
                              "pytorch_model.bin)")
  elif not os.path.isfile(path):
    raise FileNotFoundError(f"{path}: no such checkpoint directory or config .json file")
  try:
    with open(path, encoding="utf-8") as f:
      config = json.load(f)
  except json.JSONDecodeError as e:
    line, column = json_errors.position(e)
    raise OfficialConfigError(f"{path} is not valid JSON (line {line}, column {column}: "
                              f"{e.msg})") from None
  except UnicodeDecodeError:
    raise OfficialConfigError(f"{path} is not a text (JSON) file") from None
  if not isinstance(config, dict):
    raise OfficialConfigError(f"{path} holds a JSON {type(config).__name__}, not an object of "
                              "config fields")
  if isinstance(config.get("model"), dict) and "hidden_size" not in config:
    # else "official config field hidden_size is missing", about a file that is not official
    raise OfficialConfigError(f"{path} is this library's config (a training workdir or a "
                              "converted checkpoint: its \"model\" section), not the official "
                              "code's: it needs no conversion; pass its directory as --checkpoint "
                              "(eval, generate) or checkpoint.init_from")
  return config

