"""Importing checkpoints of the official PyTorch UMoE code (umoe_jax.interop.official).

Golden fixtures in tests/data/official/<name>/ were made by tools/make_official_fixtures.py with the
official modeling code (github.com/ysngki/UMoE, commit in PROVENANCE.json): tiny random float32 models
of the dense (small-GPT), FFN-MoE, UMoE and UMoE-Att configs in the default ("unsloth") expert weight
layout, UMoE-Att with its own MoE FFN, UMoE with full per-expert queries (q_lora_rank=None), and UMoE
in the "megatron" layout; each holds the official config.json, model.safetensors,
tokens.npy and the official logits.npy.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import struct
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from umoe_jax.interop import official  # noqa: E402

DATA = os.path.join(ROOT, "tests", "data", "official")
FIXTURES = ("dense", "ffn_moe", "umoe", "umoe_att", "umoe_att_moe_ffn", "umoe_full_q", "umoe_megatron",
            "moa", "switchhead", "umoe_mla")
TOL = 1e-4
EXPECTED_KINDS = {  # fixture -> (attention.kind, ffn.kind, expert layout named by its config.json)
    "dense": ("mha", "dense", "unsloth"),         # no grouped weights; the current code writes the flag
    "ffn_moe": ("mha", "moe", "unsloth"),
    "umoe": ("premix", "moe", "unsloth"),
    "umoe_att": ("premix", "dense", "unsloth"),
    "umoe_att_moe_ffn": ("premix", "moe", "unsloth"),   # its own GroupedMoE pool: moe.share_pool=False
    "umoe_full_q": ("premix", "moe", "unsloth"),        # q_lora_rank=None: per-expert q_proj
    "umoe_megatron": ("premix", "moe", "megatron"),
    "moa": ("moa", "dense", "unsloth"),                 # per-expert q / o as raw views whatever the flag
    "switchhead": ("switchhead", "dense", "unsloth"),   # per-head V / O GroupedMatrixMoE: raw views
    "umoe_mla": ("premix", "moe", "unsloth"),           # mla: latent_code / code2value
}


def fixture_dir(name: str) -> str:
  return os.path.join(DATA, name)


def rel_err(out, ref) -> float:
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


def logits_of(model, name: str) -> np.ndarray:
  tokens = np.load(os.path.join(fixture_dir(name), "tokens.npy"))
  logits, _ = model(jnp.asarray(tokens))
  return np.asarray(logits)


def official_logits(name: str) -> np.ndarray:
  return np.load(os.path.join(fixture_dir(name), "logits.npy"))


def flat_params(model_or_state) -> dict:
  state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state, nnx.Param)
  return {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}


_MODELS: dict = {}


def imported(name: str):
  if name not in _MODELS:
    _MODELS[name] = official.import_official(fixture_dir(name))
  return _MODELS[name]


def copy_fixture(name: str, dst, *, weights: bool = True) -> str:
  dst = str(dst)
  os.makedirs(dst, exist_ok=True)
  shutil.copy(os.path.join(fixture_dir(name), "config.json"), dst)
  if weights:
    shutil.copy(os.path.join(fixture_dir(name), "model.safetensors"), dst)
  return dst


def write_safetensors(path: str, tensors: dict, dtypes: dict | None = None) -> None:
  """A minimal safetensors writer (F32, or BF16 given as raw uint16 bits)."""
  header, blobs, offset = {}, [], 0
  for name, arr in tensors.items():
    dtype = (dtypes or {}).get(name, "F32")
    data = np.ascontiguousarray(arr).tobytes()
    header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
    blobs.append(data)
    offset += len(data)
  raw = json.dumps(header).encode()
  raw += b" " * (-len(raw) % 8)
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for b in blobs:
      f.write(b)


# ------------------------------------------------------------------------------------------------
# Logits


@pytest.mark.parametrize("name", FIXTURES)
def test_logits_match_official(name):
  model, cfg = imported(name)
  att, ffn, layout = EXPECTED_KINDS[name]
  assert (cfg.attention.kind, cfg.ffn.kind) == (att, ffn)
  assert official.expert_weight_layout(official.load_official_config(fixture_dir(name))) == layout
  assert cfg.compute_dtype == "float32"
  err = rel_err(logits_of(model, name), official_logits(name))
  print(f"{name}: max relative error {err:.2e}")
  assert err < TOL, f"{name}: relative error {err:.3e} >= {TOL}"


def test_config_mapping_of_moa_switchhead_mla():
  moa = official.config_from_official(official.load_official_config(fixture_dir("moa")))
  assert (moa.attention.kind, moa.attention.n_experts, moa.attention.top_k,
          moa.attention.n_shared_experts, moa.attention.v_head_dim) == ("moa", 8, 3, 1, 12)
  sh = official.config_from_official(official.load_official_config(fixture_dir("switchhead")))
  assert (sh.attention.kind, sh.attention.n_heads, sh.attention.n_experts, sh.attention.top_k) == (
      "switchhead", 4, 4, 2)
  mla = official.config_from_official(official.load_official_config(fixture_dir("umoe_mla")))
  assert mla.attention.kind == "premix" and mla.attention.latent_dim == 8 and mla.ffn.kind == "moe"
  cj = official.load_official_config(fixture_dir("moa"))
  with pytest.raises(official.OfficialConfigError, match="no_ffn_moe=False"):
    official.config_from_official(dict(cj, no_ffn_moe=False))


def test_config_mapping_umoe():
  cfg = official.config_from_official(official.load_official_config(fixture_dir("umoe")))
  assert cfg.d_model == 48 and cfg.n_layers == 2 and cfg.vocab_size == 128 and cfg.max_seq_len == 64
  assert cfg.attention.kind == "premix" and cfg.attention.top_k == 3 and cfg.attention.head_dim == 12
  assert cfg.attention.q_lora_rank == 4 and cfg.attention.n_shared_experts == 1
  assert cfg.ffn.kind == "moe" and cfg.ffn.top_k == 4 and cfg.ffn.n_shared_experts == 1
  assert cfg.moe.n_experts == 8 and cfg.moe.d_expert == 12 and cfg.moe.share_pool
  assert cfg.moe.activation == "silu" and cfg.rope_layout == "interleaved"
  assert not cfg.router.renormalize and cfg.router.balance_loss == "seq_aux"
  assert cfg.router.balance_coef == pytest.approx(0.001)


def test_config_scalar_fields_are_read_not_defaulted():
  """Fields whose fixture values equal our defaults (so the logits cannot tell) are read from
  config.json: RoPE base, norm epsilon, init std, context length, balance loss kind and weight."""
  dense = official.load_official_config(fixture_dir("dense"))
  cfg = official.config_from_official(dict(dense, rope_theta=500000.0, rms_norm_eps=1e-5,
                                           initializer_range=0.006, max_position_embeddings=96))
  assert (cfg.rope_theta, cfg.norm_eps, cfg.init_std, cfg.max_seq_len) == (500000.0, 1e-5, 0.006, 96)
  moe = official.load_official_config(fixture_dir("ffn_moe"))
  cfg = official.config_from_official(dict(moe, seq_aux=False, aux_loss_alpha=0.02))
  assert (cfg.router.balance_loss, cfg.router.balance_coef) == ("switch", 0.02)


def test_released_configs_map():
  """The paper's released config.json files (sizes as in model_libs/configs) are all convertible."""
  base = official.load_official_config(fixture_dir("umoe"))
  released = {  # (d, layers, heads, E, d_e, k_att, k_ffn, r) of small/1B UMoE
      "small-UMoE": dict(hidden_size=768, num_hidden_layers=12, n_routed_experts=128,
                         moe_intermediate_size=192, num_experts_per_tok=3, ffn_num_experts_per_tok=15,
                         q_lora_rank=16, qk_nope_head_dim=128, qk_rope_head_dim=64, vocab_size=32000,
                         max_position_embeddings=1024),
      "1B-UMoE": dict(hidden_size=2048, num_hidden_layers=24, n_routed_experts=64,
                      moe_intermediate_size=512, num_experts_per_tok=3, ffn_num_experts_per_tok=10,
                      q_lora_rank=36, qk_nope_head_dim=448, qk_rope_head_dim=64, vocab_size=32000,
                      max_position_embeddings=1024),
  }
  for values in released.values():
    cj = dict(base, **values)
    for key in ("use_unsloth_moe", "use_megatron_cutlass_group_gemm", "use_te_group_linear"):
      cj.pop(key)           # the released configs carry none of the backend flags
    cfg = official.config_from_official(cj)
    assert cfg.attention.head_dim == values["qk_nope_head_dim"] + values["qk_rope_head_dim"]
    assert cfg.ffn.top_k == values["ffn_num_experts_per_tok"]
    assert official.expert_weight_layout(cj) == "megatron"


def test_config_without_backend_flags_is_megatron_layout(tmp_path):
  """Configs of the code before the unsloth backend (no use_* keys) hold megatron-layout experts."""
  d = copy_fixture("umoe_megatron", tmp_path / "ckpt")
  with open(os.path.join(d, "config.json")) as f:
    cj = json.load(f)
  for key in ("use_unsloth_moe", "use_megatron_cutlass_group_gemm", "use_te_group_linear"):
    del cj[key]
  with open(os.path.join(d, "config.json"), "w") as f:
    json.dump(cj, f)
  assert official.expert_weight_layout(cj) == "megatron"
  model, _ = official.import_official(d)
  assert flat_params(model).keys() == flat_params(imported("umoe_megatron")[0]).keys()
  for key, value in flat_params(model).items():
    np.testing.assert_array_equal(value, flat_params(imported("umoe_megatron")[0])[key], err_msg=key)


def test_wrong_expert_layout_is_detected_by_logits():
  """The logits test is sensitive to the grouped-weight layout (guards the fixtures' power)."""
  d = fixture_dir("umoe")
  cfg = official.config_from_official(official.load_official_config(d))
  params = official.convert_state_dict(official.load_official_state_dict(d), cfg, expert_layout="megatron")
  model = official.model_from_state(cfg, params)
  assert rel_err(logits_of(model, "umoe"), official_logits("umoe")) > 0.1


# ------------------------------------------------------------------------------------------------
# Checkpoint formats


@pytest.mark.extras("torch")
def test_pytorch_bin_checkpoint(tmp_path):
  import torch
  sd = official.load_official_state_dict(fixture_dir("ffn_moe"))
  d = copy_fixture("ffn_moe", tmp_path / "ckpt", weights=False)
  torch.save({k: torch.from_numpy(np.array(v)) for k, v in sd.items()}, os.path.join(d, "pytorch_model.bin"))
  model, _ = official.import_official(d)
  ref = flat_params(imported("ffn_moe")[0])
  for key, value in flat_params(model).items():
    np.testing.assert_array_equal(value, ref[key], err_msg=key)


def test_pytorch_bin_without_torch_says_so(tmp_path, monkeypatch):
  path = tmp_path / "pytorch_model.bin"
  path.write_bytes(b"not read")
  monkeypatch.setitem(sys.modules, "torch", None)
  with pytest.raises(ImportError, match="needs PyTorch"):
    official.load_official_state_dict(str(path))


def test_sharded_bfloat16_safetensors(tmp_path):
  """Sharded checkpoints with an index, bfloat16 tensors (as the official bf16 runs save them)."""
  import ml_dtypes
  sd = official.load_official_state_dict(fixture_dir("umoe"))
  d = copy_fixture("umoe", tmp_path / "ckpt", weights=False)
  names = sorted(sd)
  shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
            "model-00002-of-00002.safetensors": names[len(names) // 2:]}
  bf16 = {k: np.asarray(v, np.float32).astype(ml_dtypes.bfloat16) for k, v in sd.items()}
  for shard, keys in shards.items():
    write_safetensors(os.path.join(d, shard), {k: bf16[k].view(np.uint16) for k in keys},
                      {k: "BF16" for k in keys})
  with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {}, "weight_map": {k: s for s, ks in shards.items() for k in ks}}, f)
  loaded = official.load_official_state_dict(d)
  assert loaded.keys() == sd.keys()
  for k in names:
    assert loaded[k].dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(loaded[k].astype(np.float32), bf16[k].astype(np.float32), err_msg=k)
  model, _ = official.import_official(d)
  # bf16-rounded weights: close to, not equal to, the float32 official logits.
  assert rel_err(logits_of(model, "umoe"), official_logits("umoe")) < 0.1


def test_no_checkpoint_found(tmp_path):
  with pytest.raises(FileNotFoundError, match="no official checkpoint"):
    official.load_official_state_dict(str(tmp_path))


# ------------------------------------------------------------------------------------------------
# Errors


def _umoe_inputs():
  d = fixture_dir("umoe")
  cfg = official.config_from_official(official.load_official_config(d))
  return dict(official.load_official_state_dict(d)), cfg


def test_missing_tensor_is_named():
  sd, cfg = _umoe_inputs()
  del sd["model.layers.1.self_attn.q_a_proj.weight"]
  with pytest.raises(official.StateDictError, match=r"missing 1 tensor.*model\.layers\.1\.self_attn\.q_a_proj\.weight"):
    official.convert_state_dict(sd, cfg)


def test_unexpected_tensor_is_named():
  sd, cfg = _umoe_inputs()
  sd["model.layers.0.self_attn.v_proj.weight"] = np.zeros((4, 4), np.float32)
  with pytest.raises(official.StateDictError, match=r"unexpected 1 tensor.*self_attn\.v_proj\.weight"):
    official.convert_state_dict(sd, cfg)


def test_misshaped_tensor_names_both_shapes():
  sd, cfg = _umoe_inputs()
  sd["model.layers.0.self_attn.vo_experts.linear_1.weight"] = np.zeros((95, 48), np.float32)
  with pytest.raises(official.StateDictError,
                     match=r"linear_1\.weight has shape \(95, 48\), expected \(96, 48\).*experts/w_up"):
    official.convert_state_dict(sd, cfg)


def test_state_dict_of_another_family_is_refused():
  sd = official.load_official_state_dict(fixture_dir("dense"))
  cfg = official.config_from_official(official.load_official_config(fixture_dir("umoe")))
  with pytest.raises(official.StateDictError, match="missing .*unexpected"):
    official.convert_state_dict(sd, cfg)


@pytest.mark.parametrize("field,value", [
    ("postmix_att_moe", True), ("share_layer", True), ("swiglue_mlp", True), ("use_te_group_linear", True),
    ("ffn_separate_router", False), ("res_query_lora", False), ("scoring_func", "sigmoid"),
    ("hidden_act", "gelu"), ("rope_scaling", {"type": "linear", "factor": 2.0}),
    ("topk_method", "group_limited_greedy"), ("model_type", "deepseek_v2"),
])
def test_unsupported_config_field_is_named(field, value):
  cj = official.load_official_config(fixture_dir("umoe"))
  cj[field] = value
  with pytest.raises(official.OfficialConfigError, match=re.escape(f"{field}={value!r}")):
    official.config_from_official(cj)


def test_unsupported_dense_options_are_named():
  cj = official.load_official_config(fixture_dir("dense"))
  with pytest.raises(official.OfficialConfigError, match="num_key_value_heads=2"):
    official.config_from_official(dict(cj, num_key_value_heads=2))
  with pytest.raises(official.OfficialConfigError, match="q_lora_rank=8"):
    official.config_from_official(dict(cj, q_lora_rank=8))
  cj = official.load_official_config(fixture_dir("ffn_moe"))
  with pytest.raises(official.OfficialConfigError, match="first_k_dense_replace=1"):
    official.config_from_official(dict(cj, first_k_dense_replace=1))


# ------------------------------------------------------------------------------------------------
# CLI


def test_cli_round_trip(tmp_path, capsys):
  out = tmp_path / "converted"
  assert official.main([f"--checkpoint={fixture_dir('umoe')}", f"--output={out}"]) == 0
  assert "expert layout unsloth" in capsys.readouterr().out
  with open(out / "config.json") as f:
    saved = json.load(f)
  assert saved["model"]["attention"]["kind"] == "premix"
  assert saved["source"]["expert_layout"] == "unsloth"
  assert saved["source"]["official_config"]["model_type"] == "PremixMoe_v2"
  model, cfg = official.load_converted(str(out))
  assert cfg.to_dict() == imported("umoe")[1].to_dict()
  ref = flat_params(imported("umoe")[0])
  restored = flat_params(model)
  assert restored.keys() == ref.keys()
  for key, value in restored.items():
    np.testing.assert_array_equal(value, ref[key], err_msg=key)
  # Orbax restores committed arrays; uncommitted copies reuse the eager-op caches of the tests above
  # (same values, so the same logits) instead of recompiling every op.
  nnx.update(model, jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), nnx.state(model, nnx.Param)))
  assert rel_err(logits_of(model, "umoe"), official_logits("umoe")) < TOL
  # A second conversion into the same place refuses to overwrite.
  assert official.main([f"--checkpoint={fixture_dir('umoe')}", f"--output={out}"]) == 2
  assert "exists" in capsys.readouterr().err


def test_cli_reports_unsupported_config(tmp_path, capsys):
  d = copy_fixture("umoe", tmp_path / "ckpt")
  with open(os.path.join(d, "config.json")) as f:
    cj = json.load(f)
  cj["share_layer"] = True
  with open(os.path.join(d, "config.json"), "w") as f:
    json.dump(cj, f)
  assert official.main([f"--checkpoint={d}", f"--output={tmp_path / 'out'}"]) == 2
  assert "share_layer=True" in capsys.readouterr().err


def test_a_json_that_is_no_shard_index_is_named(tmp_path, capsys):
  """--checkpoint=DIR/config.json (a JSON, but no shard index) and a broken index: the file named, the
  CLI's exit code 2 and no traceback."""
  d = copy_fixture("umoe", tmp_path / "ckpt")
  config_json = os.path.join(d, "config.json")
  with pytest.raises(official.StateDictError, match=r"config\.json: not a shard index"):
    official.load_official_state_dict(config_json)
  assert official.main([f"--checkpoint={config_json}", f"--output={tmp_path / 'out'}"]) == 2
  err = capsys.readouterr().err
  assert "config.json: not a shard index" in err and "Traceback" not in err
  broken = tmp_path / "model.safetensors.index.json"
  broken.write_text('{"weight_map": {"a": "x.safetensors",\n')
  # (its one line: json says line 2, after the file's last line end)
  with pytest.raises(official.StateDictError, match=r"index\.json: not a JSON shard index \(line 1:"):
    official.load_official_state_dict(str(broken))


def test_loading_with_a_tokenizer_larger_than_the_checkpoint_names_the_flag(tmp_path, capsys):
  """A converted checkpoint (vocab 128) loaded with the default byte tokenizer (257 ids): its
  vocabulary is fixed by the checkpoint, so the error names --tokenizer and both sizes (it advised
  `model.vocab_size >= 257`, which a checkpoint cannot take)."""
  from umoe_jax.load import LoadError, load_model_and_tokenizer
  out = tmp_path / "converted"
  assert official.main([f"--checkpoint={fixture_dir('umoe')}", f"--output={out}"]) == 0
  capsys.readouterr()
  with pytest.raises(LoadError) as error:
    load_model_and_tokenizer(str(out))
  assert str(error.value) == (
      f"tokenizer 'byte' has 257 tokens, but the model of checkpoint {out} has vocab_size 128 "
      "(fixed by its parameters): pass --tokenizer=<the tokenizer.json of that model> (at most 128 "
      "tokens)")
  assert "model.vocab_size" not in str(error.value)
