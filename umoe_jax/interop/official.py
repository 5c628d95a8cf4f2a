"""Import checkpoints of the official PyTorch UMoE implementation (github.com/ysngki/UMoE).

The official code is a fork of Hugging Face DeepSeek-V2 (`model_type: "PremixMoe_v2"`,
`DeepseekV2ForCausalLM`, `model_libs/src_code/modeling_deepseek.py`). Its checkpoints are Hugging Face
directories: `config.json` plus `model.safetensors` (or shards `model-0000i-of-0000n.safetensors` with
`model.safetensors.index.json`, or `pytorch_model.bin`). This module turns one into a `CausalLM` of this
project whose logits equal the official model's (float32; tested to a relative error < 1e-4 on golden
fixtures made by `tools/make_official_fixtures.py`).

API
  config_from_official(config_json, *, compute_dtype="float32", gmm_backend="auto") -> ConfigDict
      the `model` section of our config; an official option this project cannot express raises
      `OfficialConfigError` naming the field and its value
  expert_weight_layout(config_json) -> "unsloth" | "megatron"  (see "Grouped weights" below)
  load_official_config(path) -> dict
  load_official_state_dict(path) -> {name: np.ndarray}   (a directory, a .safetensors / .bin file or an
      index .json; bfloat16 tensors come back as ml_dtypes.bfloat16)
  convert_state_dict(state_dict, model_cfg, *, expert_layout="unsloth") -> nnx.State of parameters
      (a missing, unexpected or mis-shaped tensor raises `StateDictError` naming it and the shapes)
  import_official(path, **config_kw) -> (CausalLM, ConfigDict)
  save_converted(model, model_cfg, output_dir, *, source=None) / load_converted(output_dir)
      -> (CausalLM, ConfigDict)

CLI
  python -m umoe_jax.interop.official --checkpoint=DIR --output=DIR [--compute_dtype=float32]

Saved layout (what `--output` / `save_converted` writes; `load_converted` reads it back)
  OUTPUT/config.json   {"model": <the `model` ConfigDict as JSON>,
                        "source": {"checkpoint": ..., "expert_layout": ..., "official_config": {...}}}
  OUTPUT/params/       an Orbax `StandardCheckpointer` checkpoint of `nnx.state(model, nnx.Param)`
                       (float32); restore it with `StandardCheckpointer().restore(path, abstract)` where
                       `abstract = nnx.state(abstract_model(model_config(cfg["model"])), nnx.Param)`.

Mapping (official name under `model.` -> ours; W is a torch Linear weight [out, in], ours [in, out])
  embed_tokens.weight [V, D]                   embed [V, D]
  lm_head.weight [V, D] (no `model.` prefix)   lm_head = W.T [D, V]          (untied)
  norm.weight                                  final_norm/scale
  layers.i.input_layernorm.weight              layers/i/attention_norm/scale
  layers.i.post_attention_layernorm.weight     layers/i/ffn_norm/scale
  dense attention (VanillaAttention: dense and FFN-MoE models)
    self_attn.q_proj.weight [H*Dk, D]          attention/q_proj/kernel = W.T
    self_attn.kv_proj.weight [H*(Dk+Dv), D]    per head h rows [h*(Dk+Dv), +Dk) -> attention/k_proj/kernel,
                                               the next Dv rows -> attention/v_proj/kernel (head-major)
    self_attn.o_proj.weight [D, H*Dv]          attention/o_proj/kernel = W.T
  pre-mixing attention (PreMixMoEAttention: UMoE, UMoE-Att); "vo" = self_attn.vo_experts
    self_attn.k_proj.weight [Dk, D]            attention/k_proj/kernel = W.T
    self_attn.shared_q_proj.weight [Dk, D]     attention/shared_q_proj/kernel = W.T
    self_attn.q_res_proj.weight [Dk, D]        attention/q_res_proj/kernel = W.T
    self_attn.q_a_proj.weight [E*r, D]         attention/q_a [E, D, r]     (grouped, see below)
    self_attn.q_a_layernorm.weight [r]         attention/q_a_norm/scale
    self_attn.q_b_proj.weight [Dk, E*r]        attention/q_b [E, r, Dk]    (grouped)
    self_attn.q_proj.weight [E*Dk, D]          attention/q_b [E, D, Dk] = raw view (q_lora_rank=None)
    vo.gate.weight [E, D]                      attention/router/kernel = W.T
    vo.linear_1.weight [E*F, D]                experts/w_up [E, D, F]     (grouped)
    vo.linear_2.weight [D, E*F]                experts/w_down [E, F, D]   (grouped)
    vo.shared_experts.{gate_proj,down_proj}    attention/shared_expert/{up,down}/kernel = W.T
    vo.gate_ffn.weight [E, D]                  ffn/router/kernel = W.T     (UMoE: FFN routes into vo)
    vo.ffn_shared_experts.{gate_proj,down_proj} ffn/shared_expert/{up,down}/kernel = W.T
    self_attn.latent_code.weight [L, D]        attention/latent_proj/kernel = W.T   (mla: MLA-style values)
    self_attn.code2value.weight [D, L]         attention/latent_up/kernel = W.T
  MoA attention (MoAMoEAttention, baseline_moa); per-expert matrices are raw views [E, in, out]
    self_attn.q_proj.weight [E*Dk, D]          attention/q_experts [E, D, Dk] = W.reshape
    self_attn.o_proj.weight [E*Dv, D]          attention/o_experts [E, Dv, D] = W.reshape
    self_attn.{k_proj,v_proj}.weight           attention/{k_proj,v_proj}/kernel = W.T (one shared head)
    self_attn.gate.weight [E, D]               attention/router/kernel = W.T
    self_attn.shared_q_proj / shared_experts   attention/shared_q_proj / shared_o_proj kernels = W.T
  SwitchHead attention (SwitchHead, baseline_switchhead): per head h a GroupedMatrixMoE for V and O
    self_attn.{q_proj,k_proj}.weight [H*Dk, D] attention/{q_proj,k_proj}/kernel = W.T (head-major)
    self_attn.v_experts.h.linear.weight [E*Dv, D]  attention/v_experts/w[h*E:(h+1)*E] = W.reshape(E, D, Dv)
    self_attn.o_experts.h.linear.weight [E*D, Dv]  attention/o_experts/w[h*E:(h+1)*E] = W.reshape(E, Dv, D)
    self_attn.{v,o}_experts.h.gate.weight      attention/{v,o}_experts/router/h/kernel = W.T
  Post-mixing (postmix_att_moe) is refused: the official decoder layer never builds its
  PostMixMoEAttention (premix_att_moe builds PreMixMoEAttention), so no official model has it.
  FFN of the dense / UMoE-Att models (VanillaMLP; `gate_proj` is its first, non-gated matrix)
    mlp.{gate_proj,down_proj}.weight           ffn/mlp/{up,down}/kernel = W.T
  FFN of the FFN-MoE model (GroupedMoE)
    mlp.gate.weight                            ffn/router/kernel = W.T
    mlp.linear_1.weight / mlp.linear_2.weight  experts/w_up / experts/w_down   (grouped)
    mlp.shared_experts.{gate_proj,down_proj}   ffn/shared_expert/{up,down}/kernel = W.T
  (With a pre-mixing attention and its own GroupedMoE FFN, `mlp.*` experts go to layers/i/ffn_experts.)

Grouped weights. The official code stores each expert group as one torch Linear and *reinterprets its
memory* per expert with `.view`, differently per grouped-GEMM backend (config flags):
  "unsloth"  (`use_unsloth_moe`, the default of the current code): W.view(E, out, in), expert e computes
             x @ W_e.T, so ours = W.reshape(E, out, in).transpose(0, 2, 1);
  "megatron" (`use_megatron_cutlass_group_gemm`, and the only backend of the code before commit 95284fd of
             2025-07-25, whose configs have none of the three `use_*` keys): W.view(E, in, out), expert e
             computes x @ W_e, so ours = W.reshape(E, in, out).
The per-expert full query `q_proj` (q_lora_rank=None) is always used as W.view(E, D, Dk) (megatron style).
Checkpoints written with the current code carry `use_unsloth_moe` explicitly in config.json (it is not a
base-config key, so `save_pretrained` keeps it); a config with none of the three keys is taken to be from
the earlier code. `use_te_group_linear` (TransformerEngine, per-expert `weight<i>` tensors) is not supported.

RoPE: the official code de-interleaves q and k (`view(d/2, 2).transpose`) and then rotates halves; that is
our "interleaved" layout up to one channel permutation applied to q and k alike, so attention scores are
identical and no weight is permuted (the logits test checks it).

Not carried over (training-only): dropout (`attention_dropout`, all released configs use 0). Routers,
balance losses (`aux_loss_alpha`, `seq_aux`) and `norm_topk_prob` map to `model.router`.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import struct
import sys
from typing import Any, Callable, Mapping, Optional

import numpy as np

from umoe_jax import storage
from umoe_jax.config import ConfigError, ModelConfig, model_config

OFFICIAL_MODEL_TYPE = "PremixMoe_v2"
EXPERT_LAYOUTS = ("unsloth", "megatron")


class OfficialConfigError(ConfigError):
  """An official config.json field has a value this project cannot reproduce; names field and value."""


class StateDictError(ValueError):
  """An official state dict does not fit the config: missing, unexpected or mis-shaped tensors."""


# ----------------------------------------------------------------------------------------------
# config.json -> our `model` ConfigDict

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


# ----------------------------------------------------------------------------------------------
# Reading checkpoints

_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64,
              "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def _st_dtype(name: str, path: str, tensor: str):
  if name == "BF16":
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)
  if name not in _ST_DTYPES:
    raise StateDictError(f"{path}: tensor {tensor} has unsupported dtype {name}")
  return np.dtype(_ST_DTYPES[name])


def read_safetensors(path: str) -> dict[str, np.ndarray]:
  """Tensors of one .safetensors file as (memory-mapped, read-only) numpy arrays; no torch needed."""
  with open(path, "rb") as f:
    head = f.read(8)
    n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
    try:
      if not 0 < n <= os.path.getsize(path) - 8:
        raise ValueError(f"header length {n}")
      header = json.loads(f.read(n))
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, a bad length
      raise StateDictError(f"{path} is not a safetensors file, or is truncated ({e})") from None
  mm = np.memmap(path, dtype=np.uint8, mode="r")
  out = {}
  for name, info in header.items():
    if name == "__metadata__":
      continue
    dtype = _st_dtype(info["dtype"], path, name)
    start, end = info["data_offsets"]
    buf = mm[8 + n + start: 8 + n + end]
    out[name] = buf.view(dtype).reshape(info["shape"])
  return out


def _torch_to_numpy(t) -> np.ndarray:
  import torch
  t = t.detach().cpu()
  if t.dtype == torch.bfloat16:
    import ml_dtypes
    return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
  return t.numpy()


def read_torch_bin(path: str) -> dict[str, np.ndarray]:
  """A `pytorch_model.bin` (torch.save of a state dict); needs torch."""
  try:
    import torch
  except ImportError as e:
    raise ImportError(f"reading {path} needs PyTorch (pip install torch); .safetensors checkpoints "
                      "do not") from e
  obj = torch.load(path, map_location="cpu", weights_only=True)
  for wrapper in ("module", "state_dict", "model"):
    if isinstance(obj, Mapping) and wrapper in obj and isinstance(obj[wrapper], Mapping):
      obj = obj[wrapper]
  if not isinstance(obj, Mapping):
    raise StateDictError(f"{path}: expected a state dict, got {type(obj).__name__}")
  return {k: _torch_to_numpy(v) for k, v in obj.items() if hasattr(v, "detach")}


def _read_index(path: str) -> dict[str, np.ndarray]:
  with open(path) as f:
    weight_map = json.load(f)["weight_map"]
  folder = os.path.dirname(path)
  out = {}
  for shard in sorted(set(weight_map.values())):
    out.update(_read_file(os.path.join(folder, shard)))
  missing = sorted(set(weight_map) - set(out))
  if missing:
    raise StateDictError(f"{path}: tensors listed in the index are absent from their shards: {missing[:5]}")
  return out


def _read_file(path: str) -> dict[str, np.ndarray]:
  if path.endswith(".safetensors"):
    return read_safetensors(path)
  if path.endswith(".json"):
    return _read_index(path)
  if path.endswith((".bin", ".pt", ".pth")):
    return read_torch_bin(path)
  raise StateDictError(f"{path}: unknown checkpoint file type (want .safetensors, .bin or an index .json)")


_DIR_CANDIDATES = ("model.safetensors.index.json", "model.safetensors",
                   "pytorch_model.bin.index.json", "pytorch_model.bin")


def load_official_state_dict(path: str) -> dict[str, np.ndarray]:
  """The official state dict {name: array} from a checkpoint directory or one file.

  A directory is searched for, in order: model.safetensors.index.json (+ shards), model.safetensors,
  pytorch_model.bin.index.json (+ shards), pytorch_model.bin; failing those, a single *.safetensors.
  `.bin` files need PyTorch (an ImportError says so). DeepSpeed's `module.` name prefix is stripped.
  """
  path = os.fspath(path)
  if os.path.isdir(path):
    for name in _DIR_CANDIDATES:
      if os.path.isfile(os.path.join(path, name)):
        sd = _read_file(os.path.join(path, name))
        break
    else:
      singles = sorted(glob.glob(os.path.join(path, "*.safetensors")))
      if len(singles) != 1:
        raise FileNotFoundError(f"{path}: no official checkpoint found (looked for "
                                f"{', '.join(_DIR_CANDIDATES)} or a single *.safetensors)")
      sd = read_safetensors(singles[0])
  elif os.path.isfile(path):
    sd = _read_file(path)
  else:
    raise FileNotFoundError(f"{path}: no such checkpoint file or directory")
  if sd and all(k.startswith("module.") for k in sd):
    sd = {k[len("module."):]: v for k, v in sd.items()}
  return sd


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
    raise OfficialConfigError(f"{path} is not valid JSON (line {e.lineno}, column {e.colno}: "
                              f"{e.msg})") from None
  except UnicodeDecodeError:
    raise OfficialConfigError(f"{path} is not a text (JSON) file") from None
  if not isinstance(config, dict):
    raise OfficialConfigError(f"{path} holds a JSON {type(config).__name__}, not an object of "
                              "config fields")
  return config


# ----------------------------------------------------------------------------------------------
# State dict -> our parameters

Transform = Callable[[np.ndarray], dict[tuple, np.ndarray]]


@dataclasses.dataclass
class _Spec:
  shape: tuple          # the official tensor's expected shape
  make: Transform       # official array -> {our path: array}


@dataclasses.dataclass
class _Part:
  """Block `index` of `count` along axis 0 of our parameter (one official tensor per block)."""
  index: int
  count: int
  value: np.ndarray


def _part(transform: Transform, index: int, count: int) -> Transform:
  return lambda w: {p: _Part(index, count, v) for p, v in transform(w).items()}


def _t(path: tuple) -> Transform:
  return lambda w: {path: np.swapaxes(w, 0, 1)}


def _same(path: tuple) -> Transform:
  return lambda w: {path: w}


def _grouped(path: tuple, e: int, d_in: int, d_out: int, layout: str) -> Transform:
  """A torch Linear holding E experts' matrices -> ours [E, d_in, d_out] (see module docstring)."""
  if layout == "unsloth":
    return lambda w: {path: np.reshape(w, (e, d_out, d_in)).transpose(0, 2, 1)}
  return lambda w: {path: np.reshape(w, (e, d_in, d_out))}


def _kv_split(k_path: tuple, v_path: tuple, h: int, dk: int, dv: int) -> Transform:
  def make(w):
    w = np.reshape(w, (h, dk + dv, -1))
    d = w.shape[-1]
    return {k_path: w[:, :dk].reshape(h * dk, d).T, v_path: w[:, dk:].reshape(h * dv, d).T}
  return make


def _mlp(specs: dict, official: str, ours: tuple, d: int, f: int) -> None:
  specs[f"{official}.gate_proj.weight"] = _Spec((f, d), _t(ours + ("up", "kernel")))
  specs[f"{official}.down_proj.weight"] = _Spec((d, f), _t(ours + ("down", "kernel")))


def _official_specs(cfg: ModelConfig, layout: str) -> tuple[dict[str, _Spec], list[str]]:
  """Every official tensor this config needs -> how it becomes ours; plus ignorable official names
  (parameters the official model holds but never uses with this config)."""
  if layout not in EXPERT_LAYOUTS:
    raise ValueError(f"expert_layout={layout!r}; valid: {', '.join(EXPERT_LAYOUTS)}")
  d, v = cfg.d_model, cfg.vocab_size
  att, ffn, moe = cfg.attention, cfg.ffn, cfg.moe
  e, f, dk = moe.n_experts, moe.d_expert, att.head_dim
  specs: dict[str, _Spec] = {
      "model.embed_tokens.weight": _Spec((v, d), _same(("embed",))),
      "model.norm.weight": _Spec((d,), _same(("final_norm", "scale"))),
      "lm_head.weight": _Spec((v, d), _t(("lm_head",))),
  }
  ignorable: list[str] = []
  premix = att.kind == "premix"
  for i in range(cfg.n_layers):
    o, us = f"model.layers.{i}", ("layers", i)
    specs[f"{o}.input_layernorm.weight"] = _Spec((d,), _same(us + ("attention_norm", "scale")))
    specs[f"{o}.post_attention_layernorm.weight"] = _Spec((d,), _same(us + ("ffn_norm", "scale")))
    a, ua = f"{o}.self_attn", us + ("attention",)
    if att.kind == "mha":
      h, dv = att.n_heads, att.v_head_dim
      specs[f"{a}.q_proj.weight"] = _Spec((h * dk, d), _t(ua + ("q_proj", "kernel")))
      specs[f"{a}.kv_proj.weight"] = _Spec(
          (h * (dk + dv), d), _kv_split(ua + ("k_proj", "kernel"), ua + ("v_proj", "kernel"), h, dk, dv))
      specs[f"{a}.o_proj.weight"] = _Spec((d, h * dv), _t(ua + ("o_proj", "kernel")))
    elif premix:
      vo = f"{a}.vo_experts"
      specs[f"{a}.k_proj.weight"] = _Spec((dk, d), _t(ua + ("k_proj", "kernel")))
      r = att.q_lora_rank
      if r is None:
        specs[f"{a}.q_proj.weight"] = _Spec((e * dk, d), _grouped(ua + ("q_b",), e, d, dk, "megatron"))
      else:
        specs[f"{a}.q_res_proj.weight"] = _Spec((dk, d), _t(ua + ("q_res_proj", "kernel")))
        specs[f"{a}.q_a_proj.weight"] = _Spec((e * r, d), _grouped(ua + ("q_a",), e, d, r, layout))
        specs[f"{a}.q_a_layernorm.weight"] = _Spec((r,), _same(ua + ("q_a_norm", "scale")))
        specs[f"{a}.q_b_proj.weight"] = _Spec((dk, e * r), _grouped(ua + ("q_b",), e, r, dk, layout))
      specs[f"{vo}.gate.weight"] = _Spec((e, d), _t(ua + ("router", "kernel")))
      specs[f"{vo}.linear_1.weight"] = _Spec((e * f, d), _grouped(us + ("experts", "w_up"), e, d, f, layout))
      specs[f"{vo}.linear_2.weight"] = _Spec((d, e * f), _grouped(us + ("experts", "w_down"), e, f, d, layout))
      shared_names = [f"{a}.shared_q_proj.weight", f"{vo}.shared_experts.gate_proj.weight",
                      f"{vo}.shared_experts.down_proj.weight"]
      if att.n_shared_experts:
        fs = f * att.n_shared_experts
        specs[shared_names[0]] = _Spec((dk, d), _t(ua + ("shared_q_proj", "kernel")))
        _mlp(specs, f"{vo}.shared_experts", ua + ("shared_expert",), d, fs)
      else:
        ignorable += shared_names
      if att.latent_dim is not None:   # official mla: latent_code [L, D], code2value [D, L]
        specs[f"{a}.latent_code.weight"] = _Spec((att.latent_dim, d), _t(ua + ("latent_proj", "kernel")))
        specs[f"{a}.code2value.weight"] = _Spec((d, att.latent_dim), _t(ua + ("latent_up", "kernel")))
    elif att.kind == "moa":         # MoAMoEAttention: per-expert q / o as raw [E, in, out] views
      ea, dv = att.n_experts, att.v_head_dim
      specs[f"{a}.q_proj.weight"] = _Spec((ea * dk, d), _grouped(ua + ("q_experts",), ea, d, dk, "megatron"))
      specs[f"{a}.o_proj.weight"] = _Spec((ea * dv, d), _grouped(ua + ("o_experts",), ea, dv, d, "megatron"))
      specs[f"{a}.k_proj.weight"] = _Spec((dk, d), _t(ua + ("k_proj", "kernel")))
      specs[f"{a}.v_proj.weight"] = _Spec((dv, d), _t(ua + ("v_proj", "kernel")))
      specs[f"{a}.gate.weight"] = _Spec((ea, d), _t(ua + ("router", "kernel")))
      if att.n_shared_experts:
        specs[f"{a}.shared_q_proj.weight"] = _Spec((dk, d), _t(ua + ("shared_q_proj", "kernel")))
        specs[f"{a}.shared_experts.weight"] = _Spec((d, dv), _t(ua + ("shared_o_proj", "kernel")))
    elif att.kind == "switchhead":  # SwitchHead: per head a GroupedMatrixMoE for V and one for O
      h, ea, dv = att.n_heads, att.n_experts, att.v_head_dim
      specs[f"{a}.q_proj.weight"] = _Spec((h * dk, d), _t(ua + ("q_proj", "kernel")))
      specs[f"{a}.k_proj.weight"] = _Spec((h * dk, d), _t(ua + ("k_proj", "kernel")))
      for which, d_in, d_out in (("v", d, dv), ("o", dv, d)):
        experts = ua + (f"{which}_experts",)
        for hi in range(h):
          m = f"{a}.{which}_experts.{hi}"
          specs[f"{m}.gate.weight"] = _Spec((ea, d), _t(experts + ("router", hi, "kernel")))
          grouped = _grouped(experts + ("w",), ea, d_in, d_out, "megatron")   # head hi: w[hi*E:]
          specs[f"{m}.linear.weight"] = _Spec((ea * d_out, d_in), _part(grouped, hi, h))
    else:
      raise StateDictError(f"model.attention.kind={att.kind!r} has no official counterpart")

    uf = us + ("ffn",)
    ffn_shared_names = [f"{a}.vo_experts.ffn_shared_experts.gate_proj.weight",
                        f"{a}.vo_experts.ffn_shared_experts.down_proj.weight"]
    if ffn.kind == "dense":
      _mlp(specs, f"{o}.mlp", uf + ("mlp",), d, ffn.d_ff)
      if premix:
        ignorable += ffn_shared_names
    elif ffn.kind == "moe" and premix and moe.share_pool:   # UMoE: the FFN lives in self_attn.vo_experts
      vo = f"{a}.vo_experts"
      specs[f"{vo}.gate_ffn.weight"] = _Spec((e, d), _t(uf + ("router", "kernel")))
      if ffn.n_shared_experts:
        _mlp(specs, f"{vo}.ffn_shared_experts", uf + ("shared_expert",), d, f * ffn.n_shared_experts)
      else:
        ignorable += ffn_shared_names
    elif ffn.kind == "moe":                                # GroupedMoE in `mlp`
      pool = us + (("experts",) if not premix else ("ffn_experts",))
      specs[f"{o}.mlp.gate.weight"] = _Spec((e, d), _t(uf + ("router", "kernel")))
      specs[f"{o}.mlp.linear_1.weight"] = _Spec((e * f, d), _grouped(pool + ("w_up",), e, d, f, layout))
      specs[f"{o}.mlp.linear_2.weight"] = _Spec((d, e * f), _grouped(pool + ("w_down",), e, f, d, layout))
      if ffn.n_shared_experts:
        _mlp(specs, f"{o}.mlp.shared_experts", uf + ("shared_expert",), d, f * ffn.n_shared_experts)
      if premix:
        ignorable += ffn_shared_names
    else:
      raise StateDictError(f"model.ffn.kind={ffn.kind!r} has no official counterpart")
  return specs, ignorable


def _is_buffer(name: str) -> bool:
  return name.endswith(("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached"))


def _path_str(path: tuple) -> str:
  return "/".join(str(p) for p in path)


def convert_state_dict(state_dict: Mapping[str, Any], model_cfg, *, expert_layout: str = "unsloth"):
  """Official state dict -> `nnx.State` of this project's parameters (float32 unless
  `model.param_dtype` says otherwise), ready for `nnx.update(model, state)` / `model_from_state`.

  Args:
    state_dict: {official name: array} (numpy, or anything `np.asarray` takes, e.g. CPU torch tensors).
    model_cfg: our `model` ConfigDict / ModelConfig (from `config_from_official`).
    expert_layout: "unsloth" or "megatron", how grouped expert weights are stored
      (`expert_weight_layout(config_json)`).
  Raises:
    StateDictError naming every missing / unexpected tensor, or the first mis-shaped one with both shapes.
  """
  from flax import nnx

  return nnx.state(_convert_to_model(state_dict, model_cfg, expert_layout), nnx.Param)


def _convert_to_model(state_dict: Mapping[str, Any], model_cfg, expert_layout: str):
  import jax.numpy as jnp
  from flax import nnx

  from umoe_jax.model import abstract_model

  cfg = model_config(model_cfg)
  specs, ignorable = _official_specs(cfg, expert_layout)
  names = set(state_dict)
  missing = sorted(set(specs) - names)
  unexpected = sorted(n for n in names - set(specs) - set(ignorable) if not _is_buffer(n))
  if missing or unexpected:
    parts = []
    if missing:
      parts.append(f"missing {len(missing)} tensor(s): {', '.join(missing[:8])}"
                   + (" ..." if len(missing) > 8 else ""))
    if unexpected:
      parts.append(f"unexpected {len(unexpected)} tensor(s): {', '.join(unexpected[:8])}"
                   + (" ..." if len(unexpected) > 8 else ""))
    raise StateDictError("official state dict does not match the config: " + "; ".join(parts))

  graphdef, state = nnx.split(abstract_model(cfg))
  target = {path: var for path, var in nnx.to_flat_state(state)}
  converted: dict[tuple, np.ndarray] = {}
  for name, spec in specs.items():
    w = state_dict[name]
    w = _torch_to_numpy(w) if hasattr(w, "detach") else np.asarray(w)
    if tuple(w.shape) != spec.shape:
      ours = ", ".join(_path_str(p) for p in spec.make(np.zeros(spec.shape, np.float32)))
      raise StateDictError(f"official tensor {name} has shape {tuple(w.shape)}, expected {spec.shape} "
                           f"(-> our {ours})")
    for path, value in spec.make(w).items():
      if isinstance(value, _Part):     # one block of a parameter stacked from several tensors
        converted.setdefault(path, [None] * value.count)[value.index] = value.value
      else:
        converted[path] = value
  for path, value in converted.items():
    if isinstance(value, list):
      converted[path] = np.concatenate(value, axis=0)

  extra = sorted(_path_str(p) for p in set(converted) - set(target))
  absent = sorted(_path_str(p) for p in set(target) - set(converted))
  if extra or absent:    # the model code and this converter disagree: a bug here, not in the checkpoint
    raise StateDictError(f"converter/model mismatch: produced but not in the model: {extra[:8]}; "
                         f"in the model but not produced: {absent[:8]}")
  for path, var in target.items():
    value, want = converted[path], var.get_value()
    if tuple(value.shape) != tuple(want.shape):
      raise StateDictError(f"converted {_path_str(path)} has shape {tuple(value.shape)}, the model "
                           f"wants {tuple(want.shape)}")
    var.set_value(jnp.asarray(np.asarray(value, dtype=np.float32), dtype=want.dtype))
  return nnx.merge(graphdef, state)


def model_from_state(model_cfg, params):
  """A CausalLM with these parameters (no random initialisation)."""
  from flax import nnx

  from umoe_jax.model import abstract_model

  graphdef, state = nnx.split(abstract_model(model_config(model_cfg)))
  nnx.replace_by_pure_dict(state, nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params)
  return nnx.merge(graphdef, state)


def import_official(path: str, **config_kw):
  """(CausalLM, model ConfigDict) from an official checkpoint directory (config.json + weights).

  `config_kw` go to `config_from_official` (compute_dtype, param_dtype, gmm_backend).
  """
  config_json = load_official_config(path)
  cfg = config_from_official(config_json, **config_kw)
  model = _convert_to_model(load_official_state_dict(path), cfg, expert_weight_layout(config_json))
  return model, cfg


# ----------------------------------------------------------------------------------------------
# Saving / restoring the converted model


def save_converted(model, model_cfg, output_dir: str, *, source: Optional[Mapping[str, Any]] = None) -> str:
  """Writes OUTPUT/config.json and OUTPUT/params (Orbax) as described in the module docstring."""
  import orbax.checkpoint as ocp
  from flax import nnx

  output_dir = storage.abspath(os.fspath(output_dir))  # a local path or a gs:// URL (Orbax)
  storage.makedirs(output_dir)
  params_dir = storage.join(output_dir, "params")
  if storage.exists(params_dir):
    raise FileExistsError(f"{params_dir} exists; choose an empty --output")
  cfg_dict = model_cfg.to_dict() if hasattr(model_cfg, "to_dict") else dataclasses.asdict(model_cfg)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(params_dir, nnx.state(model, nnx.Param))
  checkpointer.wait_until_finished()
  storage.write_text(storage.join(output_dir, "config.json"), json.dumps(
      {"model": cfg_dict, "source": dict(source or {})}, indent=2, sort_keys=True))
  return output_dir


def load_converted(output_dir: str, **model_overrides):
  """(CausalLM, model ConfigDict) from a directory written by `save_converted` / the CLI.

  `model_overrides` replace top-level model keys (e.g. compute_dtype="bfloat16") before building.
  """
  import ml_collections
  import orbax.checkpoint as ocp
  from flax import nnx

  from umoe_jax.model import abstract_model

  output_dir = storage.abspath(os.fspath(output_dir))
  cfg = ml_collections.ConfigDict(json.loads(storage.read_text(
      storage.join(output_dir, "config.json")))["model"])
  for key, value in model_overrides.items():
    cfg[key] = value
  graphdef, abstract = nnx.split(abstract_model(model_config(cfg)))
  restored = ocp.StandardCheckpointer().restore(storage.join(output_dir, "params"), abstract)
  return nnx.merge(graphdef, restored), cfg


# ----------------------------------------------------------------------------------------------
# CLI


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m umoe_jax.interop.official",
      description="Convert an official UMoE (PyTorch, Hugging Face style) checkpoint into this project's "
                  "parameters: OUTPUT/config.json + OUTPUT/params (Orbax).")
  parser.add_argument("--checkpoint", required=True, help="official checkpoint directory (config.json + "
                      "model.safetensors / shards / pytorch_model.bin)")
  parser.add_argument("--output", required=True, help="output directory (created; params/ must not exist)")
  parser.add_argument("--compute_dtype", default="float32", help="model.compute_dtype of the saved config")
  parser.add_argument("--gmm_backend", default="auto", help="model.gmm_backend of the saved config")
  args = parser.parse_args(argv)
  try:
    config_json = load_official_config(args.checkpoint)
    layout = expert_weight_layout(config_json)
    if storage.exists(storage.join(args.output, "params")):
      raise FileExistsError(f"{storage.join(args.output, 'params')} exists; choose an empty --output")
    model, cfg = import_official(args.checkpoint, compute_dtype=args.compute_dtype,
                                 gmm_backend=args.gmm_backend)
    out = save_converted(model, cfg, args.output, source=dict(
        checkpoint=os.path.abspath(args.checkpoint), expert_layout=layout, official_config=config_json))
  except (ConfigError, StateDictError, FileNotFoundError, FileExistsError, ImportError,
          storage.StorageError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  import jax
  from flax import nnx
  n = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))
  print(f"converted {args.checkpoint} ({n:,} parameters, {cfg.attention.kind} attention, "
        f"{cfg.ffn.kind} FFN, expert layout {layout}) -> {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
