"""Official UMoE tensors -> this project's parameters: the name and shape of every tensor, and how
each becomes ours.

  convert_state_dict(state_dict, model_cfg, *, expert_layout="unsloth") -> nnx.State of parameters
      (a missing, unexpected or mis-shaped tensor raises `StateDictError` naming it and the shapes)
  convert_to_model(state_dict, model_cfg, expert_layout) -> CausalLM holding the converted parameters
  model_from_state(model_cfg, params) -> CausalLM with these parameters (no random initialisation)

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
(`official_config.expert_weight_layout` reads which one a checkpoint uses from its config.json.)

RoPE: the official code de-interleaves q and k (`view(d/2, 2).transpose`) and then rotates halves; that is
our "interleaved" layout up to one channel permutation applied to q and k alike, so attention scores are
identical and no weight is permuted (the logits test checks it).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import numpy as np

from umoe_jax.config import ModelConfig, model_config
from umoe_jax.interop.checkpoint_files import StateDictError, torch_to_numpy
from umoe_jax.interop.official_config import EXPERT_LAYOUTS

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

  return nnx.state(convert_to_model(state_dict, model_cfg, expert_layout), nnx.Param)


def convert_to_model(state_dict: Mapping[str, Any], model_cfg, expert_layout: str):
  """A CausalLM holding the converted parameters; arguments and errors as `convert_state_dict`."""
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
    w = torch_to_numpy(w) if hasattr(w, "detach") else np.asarray(w)
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
