"""Config validation: the paper configs load; bad configs fail naming the key and the value."""
from __future__ import annotations

import dataclasses
import importlib
import os
import re
import subprocess
import sys

import ml_collections
import pytest

import paper_counts
from conftest import ROOT
import configs.common as common
from umoe_jax.config import ConfigError, ModelConfig, model_config, to_dict

FAMILIES = ("dense", "ffn_moe", "umoe")
SCALES = ("tiny", "base", "large")


def _config_modules():
  names = sorted(f[:-3] for f in os.listdir(os.path.join(ROOT, "configs"))
                 if f.endswith(".py") and f not in ("__init__.py", "common.py"))
  assert names, "no config files found"
  return names


@pytest.mark.parametrize("name", _config_modules())
def test_every_config_file_validates(name):
  cfg = importlib.import_module(f"configs.{name}").get_config()
  m = model_config(cfg.model)
  assert isinstance(m, ModelConfig)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("scale", SCALES)
def test_paper_families(family, scale):
  m = model_config(common.model(family, scale))
  # base / large: the official dimensions (umoe.md section 2, written out in tests/paper_counts.py);
  # tiny is the project's own choice, with no source but configs/common.py: kinds only.
  s = paper_counts.DIMS.get(scale)
  if s is not None:
    assert (m.d_model, m.n_layers, m.vocab_size) == (s["d"], s["layers"], s["vocab"])
  if family == "dense":
    assert (m.attention.kind, m.ffn.kind) == ("mha", "dense")
    assert s is None or m.ffn.d_ff == s["d_ff"]
  elif family == "ffn_moe":
    assert (m.attention.kind, m.ffn.kind) == ("mha", "moe")
    assert s is None or m.ffn.top_k == s["k_ffn"]
  else:
    assert (m.attention.kind, m.ffn.kind) == ("premix", "moe")
    assert s is None or (m.attention.top_k, m.ffn.top_k, m.attention.q_lora_rank) == (
        s["k_att"], s["k_ffn"], s["rank"])
    assert m.moe.share_pool
  # The official recipe (umoe.md section 2): silu non-gated experts, unnormalized top-k softmax
  # gates, DeepSeek sequence-wise balance loss with alpha 0.001, RoPE theta 1e4, eps 1e-6.
  assert (m.moe.activation, m.router.kind, m.router.renormalize) == ("silu", "topk_softmax", False)
  assert (m.router.balance_loss, m.router.balance_coef) == ("seq_aux", 0.001)
  assert (m.rope_theta, m.norm_eps, m.init_std) == (10000.0, 1e-6, 0.02)


def test_base_and_large_match_official_configs():
  # umoe.md section 2.1/2.2 tables.
  b = model_config(common.model("umoe", "base"))
  assert (b.moe.n_experts, b.moe.d_expert, b.attention.top_k, b.ffn.top_k, b.attention.q_lora_rank,
          b.attention.head_dim) == (128, 192, 3, 15, 16, 192)
  lg = model_config(common.model("umoe", "large"))
  assert (lg.moe.n_experts, lg.moe.d_expert, lg.attention.top_k, lg.ffn.top_k,
          lg.attention.q_lora_rank, lg.attention.head_dim) == (64, 512, 3, 10, 36, 512)
  f = model_config(common.model("ffn_moe", "large"))
  assert (f.moe.n_experts, f.moe.d_expert, f.ffn.top_k, f.attention.n_heads) == (64, 512, 10, 4)
  d = model_config(common.model("dense", "large"))
  assert (d.ffn.d_ff, d.attention.head_dim, d.attention.n_heads) == (5632, 512, 4)


def test_defaults_mirror_dataclasses():
  """Every ModelConfig field is a key of configs.common.model_defaults (so it can be overridden),
  but the ones another key sets (matmul_precision: train.precision)."""
  from umoe_jax.config.schema import config_fields
  fields = {k: v for k, v in to_dict(ModelConfig()).items()
            if k in {f.name for f in config_fields(ModelConfig)}}
  assert "matmul_precision" not in fields
  keys = common.model_defaults().to_dict()
  assert set(keys) == set(fields)
  for section, value in fields.items():
    if isinstance(value, dict):
      assert set(keys[section]) == set(value), section


def test_kernel_gmm_backends_validate_in_a_fresh_process():
  """A kernel backend named in the config ("triton", "mosaic": registered by importing kernels/) must
  validate even when nothing has imported kernels/ yet, as in a fresh training process."""
  from umoe_jax.ops import gmm as G
  G.register_builtin_kernels()
  names = [n for n in G.BACKENDS.names() if n not in ("xla", "masked")]
  if not names:
    pytest.skip("no kernel backend registers on this machine")
  code = ("import configs.common as c; from umoe_jax.config import model_config\n"
          f"for n in {names!r}:\n"
          "  m = c.model('umoe', 'tiny'); m.gmm_backend = n; model_config(m)\n")
  run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
  assert run.returncode == 0, run.stderr[-2000:]


def test_accepts_configdict_dict_and_dataclass():
  cd = common.model("umoe", "tiny")
  a = model_config(cd)
  b = model_config(cd.to_dict())
  c = model_config(a)
  assert a == b == c


# ------------------------------------------------------------------------------------------------
# Bad configs. Each case: (family, {dotted key: value}, key the message must name, value it must name).


def _bad(family, changes):
  m = common.model(family, "tiny").to_dict()
  for key, value in changes.items():
    node = m
    *parents, leaf = key.split(".")
    for name in parents:
      node = node[name]
    node[leaf] = value
  return m


BAD = [
    # unknown keys (top level and nested)
    ("umoe", {"attention.foo": 7}, "model.attention.foo", "7"),
    ("dense", {"n_layer": 3}, "model.n_layer", "3"),
    ("umoe", {"router.temperature": 0.5}, "model.router.temperature", "0.5"),
    # k larger than the number of experts
    ("umoe", {"attention.top_k": 17}, "model.attention.top_k", "17"),
    ("umoe", {"ffn.top_k": 40}, "model.ffn.top_k", "40"),
    ("ffn_moe", {"ffn.top_k": 17}, "model.ffn.top_k", "17"),
    # MoE without expert width / count
    ("umoe", {"moe.d_expert": 0}, "model.moe.d_expert", "0"),
    ("ffn_moe", {"moe.d_expert": 0}, "model.moe.d_expert", "0"),
    ("ffn_moe", {"moe.n_experts": 0}, "model.moe.n_experts", "0"),
    # unknown names
    ("dense", {"attention.kind": "flash"}, "model.attention.kind", "'flash'"),
    ("umoe", {"router.kind": "hashy"}, "model.router.kind", "'hashy'"),
    ("umoe", {"gmm_backend": "cutlass9"}, "model.gmm_backend", "'cutlass9'"),
    ("umoe", {"moe.activation": "swish2"}, "model.moe.activation", "'swish2'"),
    ("dense", {"moe.activation": "swish2"}, "model.moe.activation", "'swish2'"),  # dense FFN uses it
    ("dense", {"rope_layout": "neox"}, "model.rope_layout", "'neox'"),
    ("umoe", {"router.balance_loss": "zloss"}, "model.router.balance_loss", "'zloss'"),
    ("dense", {"ffn.kind": "sparse"}, "model.ffn.kind", "'sparse'"),
    ("dense", {"compute_dtype": "float8"}, "model.compute_dtype", "'float8'"),
    # head dim must be even (RoPE pairs) and positive
    ("dense", {"attention.head_dim": 33}, "model.attention.head_dim", "33"),
    ("umoe", {"attention.head_dim": 7}, "model.attention.head_dim", "7"),
    ("umoe", {"attention.head_dim": 0}, "model.attention.head_dim", "0"),
    # wrong types
    ("dense", {"d_model": "768"}, "model.d_model", "'768'"),
    ("umoe", {"attention.top_k": "3"}, "model.attention.top_k", "'3'"),
    ("umoe", {"moe.n_experts": 4.0}, "model.moe.n_experts", "4.0"),
    ("umoe", {"router.renormalize": "yes"}, "model.router.renormalize", "'yes'"),
    ("dense", {"n_layers": True}, "model.n_layers", "True"),
    ("dense", {"norm_eps": "1e-6"}, "model.norm_eps", "'1e-6'"),
    ("dense", {"attention": "mha"}, "model.attention", "'mha'"),
    # non-positive sizes
    ("dense", {"d_model": 0}, "model.d_model", "0"),
    ("dense", {"n_layers": -1}, "model.n_layers", "-1"),
    ("dense", {"vocab_size": 0}, "model.vocab_size", "0"),
    ("dense", {"max_seq_len": -5}, "model.max_seq_len", "-5"),
    ("dense", {"ffn.d_ff": 0}, "model.ffn.d_ff", "0"),
    ("dense", {"attention.n_heads": 0}, "model.attention.n_heads", "0"),
    ("dense", {"attention.v_head_dim": -2}, "model.attention.v_head_dim", "-2"),
    ("umoe", {"attention.top_k": 0}, "model.attention.top_k", "0"),
    ("umoe", {"ffn.top_k": 0}, "model.ffn.top_k", "0"),
    ("umoe", {"moe.n_experts": -4}, "model.moe.n_experts", "-4"),
    ("umoe", {"attention.q_lora_rank": 0}, "model.attention.q_lora_rank", "0"),
    ("umoe", {"attention.n_shared_experts": -1}, "model.attention.n_shared_experts", "-1"),
    ("umoe", {"ffn.n_shared_experts": -1}, "model.ffn.n_shared_experts", "-1"),
    ("dense", {"norm_eps": 0.0}, "model.norm_eps", "0.0"),
    ("umoe", {"router.balance_coef": -0.1}, "model.router.balance_coef", "-0.1"),
    ("umoe", {"router.kind": "xmoe", "router.xmoe_dim": 0}, "model.router.xmoe_dim", "0"),
    ("umoe", {"router.kind": "xmoe", "router.xmoe_temperature": 0.0}, "model.router.xmoe_temperature", "0.0"),
    ("umoe", {"router.kind": "xmoe", "router.xmoe_temperature": -0.3}, "model.router.xmoe_temperature", "-0.3"),
    ("umoe", {"router.kind": "xmoe", "router.xmoe_temperature": float("inf")},
     "model.router.xmoe_temperature", "inf"),
    ("umoe", {"router.xmoe_dim": 4.5}, "model.router.xmoe_dim", "4.5"),
    ("umoe", {"router.xmoe_learn_temperature": 1}, "model.router.xmoe_learn_temperature", "1"),
    ("umoe", {"router.kind": "hash", "router.hash_seed": -1}, "model.router.hash_seed", "-1"),
    ("umoe", {"router.kind": "hash", "router.hash_seed": 2 ** 32}, "model.router.hash_seed", "4294967296"),
    ("umoe", {"router.kind": "hash", "router.share_att_ffn": True}, "model.router.share_att_ffn", "True"),
    ("umoe", {"router.kind": "smoe_dropout", "router.smoe_dropout_k_start": 0},
     "model.router.smoe_dropout_k_start", "0"),
    ("umoe", {"router.smoe_dropout_k_start": 1.5}, "model.router.smoe_dropout_k_start", "1.5"),
    ("umoe", {"router.kind": "smoe_dropout", "router.smoe_dropout_steps": 0}, "model.router.smoe_dropout_steps", "0"),
    ("umoe", {"router.kind": "stablemoe", "router.stablemoe_stage2_step": -1},
     "model.router.stablemoe_stage2_step", "-1"),
    ("umoe", {"router.kind": "stablemoe", "router.stablemoe_distill_dim": 0}, "model.router.stablemoe_distill_dim", "0"),
    ("umoe", {"router.kind": "stablemoe", "router.stablemoe_distill_coef": -0.3},
     "model.router.stablemoe_distill_coef", "-0.3"),
    ("umoe", {"router.kind": "stablemoe", "router.stablemoe_vocab_size": 10}, "model.router.stablemoe_vocab_size", "10"),
    ("umoe", {"router.kind": "similarity_aware", "router.similarity_temperature": 0.0},
     "model.router.similarity_temperature", "0.0"),
    ("umoe", {"router.similarity_temperature": float("nan")}, "model.router.similarity_temperature", "nan"),
    ("ffn_moe", {"router.kind": "attention_aware", "router.attention_temperature": -1.0},
     "model.router.attention_temperature", "-1.0"),
    ("umoe", {"router.kind": "attention_aware"}, "model.attention.kind", "'premix'"),
    ("moa", {"router.kind": "attention_aware"}, "model.attention.kind", "'moa'"),
    ("dense", {"router.kind": "attention_aware"}, "model.ffn.kind", "'dense'"),
    ("ffn_moe", {"router.kind": "aoe", "router.aoe_dim": 0}, "model.router.aoe_dim", "0"),
    ("umoe", {"router.kind": "aoe"}, "model.attention.kind", "'premix'"),
    ("dense", {"router.kind": "aoe"}, "model.ffn.kind", "'dense'"),
    ("umoe", {"attention.core": "flash"}, "model.attention.core", "'flash'"),
    # per sub-layer routers: a bad value is named where it is set
    ("umoe", {"attention.router.kind": "nope"}, "model.attention.router.kind", "'nope'"),
    ("umoe", {"ffn.router.balance_coef": -1.0}, "model.ffn.router.balance_coef", "-1.0"),
    ("umoe", {"ffn.router.kind": "xmoe", "ffn.router.xmoe_dim": 0}, "model.ffn.router.xmoe_dim", "0"),
    ("umoe", {"attention.router.kind": "aoe", "ffn.router.kind": "aoe"}, "model.attention.router.kind",
     "'aoe'"),
    ("umoe", {"ffn.router.kind": "attention_aware"}, "model.attention.kind", "'premix'"),
    ("umoe", {"router.share_att_ffn": True, "ffn.router.kind": "xmoe"}, "model.ffn.router.kind", "'xmoe'"),
    ("umoe", {"router.kind": "hash", "router.share_att_ffn": True, "ffn.router.kind": "topk_softmax"},
     "model.router.share_att_ffn", "True"),
    ("ffn_moe", {"attention.router.kind": "xmoe"}, "model.attention.router.kind", "'xmoe'"),
    ("umoe_att", {"ffn.router.renormalize": True}, "model.ffn.router.renormalize", "True"),
    # z-loss, jitter, aux-loss-free bias balancing
    ("umoe", {"router.bias_update_rate": -0.001}, "model.router.bias_update_rate", "-0.001"),
    ("umoe", {"ffn.router.bias_update_rate": -1.0}, "model.ffn.router.bias_update_rate", "-1.0"),
    ("umoe", {"router.z_loss_coef": -1e-3}, "model.router.z_loss_coef", "-0.001"),
    ("umoe", {"ffn.router.jitter_eps": 1.5}, "model.ffn.router.jitter_eps", "1.5"),
    ("umoe", {"router.kind": "hash", "router.z_loss_coef": 1e-3}, "model.router.z_loss_coef", "0.001"),
    ("umoe", {"ffn.router.kind": "hash", "ffn.router.jitter_eps": 0.01}, "model.ffn.router.jitter_eps",
     "0.01"),
    ("umoe", {"router.kind": "stablemoe", "router.bias_update_rate": 1e-3},
     "model.router.bias_update_rate", "0.001"),
    ("umoe", {"router.share_att_ffn": True, "router.bias_update_rate": 1e-3}, "model.router.share_att_ffn",
     "True"),
    # mixing over any router with a distribution
    ("umoe", {"ffn.router.kind": "hash", "ffn.router.mixing": "similarity"}, "model.ffn.router.mixing",
     "'similarity'"),
    ("umoe", {"router.kind": "topk_sigmoid", "router.mixing": "similarity"}, "model.router.mixing",
     "'similarity'"),
    ("umoe", {"router.mixing": "graph"}, "model.router.mixing", "'graph'"),
    ("ffn_moe", {"ffn.router.kind": "similarity_aware", "ffn.router.mixing": "attention"},
     "model.ffn.router.mixing", "'attention'"),
    ("umoe", {"ffn.router.mixing": "attention"}, "model.attention.kind", "'premix'"),
    ("umoe", {"attention.router.mixing": "attention"}, "model.attention.router.mixing", "'attention'"),
    # top-P and expert choice
    ("ffn_moe", {"router.selection": "top_p"}, "model.router.entropy_coef", "0.0"),
    ("ffn_moe", {"router.selection": "top_p", "router.entropy_coef": 1e-4, "router.top_p": 1.5},
     "model.router.top_p", "1.5"),
    ("umoe", {"router.selection": "expert_choice"}, "model.router.selection", "'expert_choice'"),
    ("ffn_moe", {"router.selection": "greedy"}, "model.router.selection", "'greedy'"),
    ("ffn_moe", {"router.kind": "smoe_dropout", "router.selection": "top_p", "router.entropy_coef": 1e-4},
     "model.router.selection", "'top_p'"),
    ("ffn_moe", {"ffn.router.selection": "expert_choice", "ffn.router.bias_update_rate": 1e-3},
     "model.ffn.router.bias_update_rate", "0.001"),
    ("ffn_moe", {"ffn.router.selection": "expert_choice", "ffn.router.expert_choice_slots": 99},
     "model.ffn.router.expert_choice_slots", "99"),
    ("ffn_moe", {"router.selection": "expert_choice", "router.expert_choice_capacity": 0.0},
     "model.router.expert_choice_capacity", "0.0"),
    ("umoe", {"router.logits_dtype": "float16"}, "model.router.logits_dtype", "'float16'"),
]


@pytest.mark.parametrize("family,changes,key,value", BAD,
                         ids=[f"{f}:{','.join(c)}={list(c.values())[0]!r}" for f, c, _, _ in BAD])
def test_bad_config_names_key_and_value(family, changes, key, value):
  with pytest.raises(ConfigError) as info:
    model_config(_bad(family, changes))
  msg = str(info.value)
  # The key must appear as a whole dotted name (not as a prefix of a longer key).
  assert re.search(re.escape(key) + r"(?![\w.])", msg), f"{key!r} not named in: {msg}"
  assert value in msg, f"value {value!r} not named in: {msg}"


def test_bad_config_from_configdict():
  """Errors are the same for a ConfigDict (the command-line path) as for a plain dict."""
  cd = common.model("umoe", "tiny")
  cd.attention.top_k = 99
  with pytest.raises(ConfigError, match=r"model\.attention\.top_k=99"):
    model_config(cd)
  cd = common.model("umoe", "tiny")
  with cd.unlocked():
    cd.moe.bogus = 1
  with pytest.raises(ConfigError, match=r"model\.moe\.bogus"):
    model_config(cd)


# The trainer's `expert_parallel` section (checked by umoe_jax.train.config.validate).
@pytest.mark.parametrize("key, value, match", [
    ("exchange", "ring", r"expert_parallel\.exchange='ring' must be one of auto, all_to_all, "
                         r"all_gather"),
    ("exchange", "All_Gather", r"expert_parallel\.exchange='All_Gather'"),
    ("capacity_factor", 0.0, r"expert_parallel\.capacity_factor=0\.0 must be"),
    ("capacity_factor", -1.5, r"expert_parallel\.capacity_factor=-1\.5 must be"),
    ("bogus", 1, r"unknown key expert_parallel\.bogus \(=1\)"),
])
def test_bad_expert_parallel_names_key_and_value(key, value, match):
  from umoe_jax.train import config as train_config
  c = common.experiment("umoe", "tiny")
  c.expert_parallel[key] = value
  with pytest.raises(ConfigError, match=match):
    train_config.validate(c)


def test_expert_parallel_settings():
  from umoe_jax.parallel import expert_parallel, sharding
  from umoe_jax.train import config as train_config
  from umoe_jax.train import loop
  c = common.experiment("umoe", "tiny")
  assert loop.expert_parallel_settings(c) == (None, "auto")
  for exchange in ("auto", "all_to_all", "all_gather"):
    c.expert_parallel.exchange = exchange
    train_config.validate(c)
  c.expert_parallel.capacity_factor = 1.25
  assert loop.expert_parallel_settings(c) == (1.25, "all_gather")
  # A config saved before `exchange` existed still loads, as "auto".
  old = c.to_dict()
  del old["expert_parallel"]["exchange"]
  assert loop.expert_parallel_settings(old) == (1.25, "auto")
  train_config.check_expert_parallel(old["expert_parallel"])
  # chunks reaches the trainer's use_mesh (and is 1 in configs saved before it existed).
  assert loop.expert_chunks(c) == 1 and loop.expert_chunks(old) == 1
  c.expert_parallel.chunks = 3
  assert loop.expert_chunks(c) == 3
  # The library entry points reject a bad value too.
  with pytest.raises(ValueError, match=r"expert_exchange='ring'"):
    with sharding.use_mesh(None, expert_exchange="ring"):
      pass
  with pytest.raises(ValueError, match=r"exchange 'ring'"):
    expert_parallel.resolve_exchange("ring", 4, 2)
  # auto: all_gather when K >= EP; expert axis 1 is always the local path.
  assert [expert_parallel.resolve_exchange("auto", k, 4) for k in (3, 4, 15)] == [
      "all_to_all", "all_gather", "all_gather"]
  assert {expert_parallel.resolve_exchange(x, 15, 1) for x in sharding.EXPERT_EXCHANGES} == {"local"}


def test_config_is_frozen_and_error_is_value_error():
  m = model_config(common.model("dense", "tiny"))
  with pytest.raises(dataclasses.FrozenInstanceError):
    m.d_model = 3  # type: ignore[misc]
  assert issubclass(ConfigError, ValueError)
  assert isinstance(common.model("dense", "tiny"), ml_collections.ConfigDict)


def test_stablemoe_token_table_defaults_to_the_vocabulary():
  """router.stablemoe_vocab_size None is resolved to model.vocab_size (one row per token id)."""
  m = model_config(_bad("umoe", {"router.kind": "stablemoe"}))
  assert m.router.stablemoe_vocab_size == m.vocab_size
  m = model_config(_bad("umoe", {"router.kind": "stablemoe", "router.stablemoe_vocab_size": 50000}))
  assert m.router.stablemoe_vocab_size == 50000
  assert model_config(_bad("umoe", {})).router.stablemoe_vocab_size is None   # other kinds: untouched


def test_aoe_rank_defaults_to_a_third_of_the_width():
  m = model_config(_bad("ffn_moe", {"router.kind": "aoe"}))
  assert m.router.aoe_dim == m.d_model // 3
  assert model_config(_bad("ffn_moe", {"router.kind": "aoe", "router.aoe_dim": 7})).router.aoe_dim == 7


# ------------------------------------------------------------------------------------------------
# Imports run one way: validating a config never imports the model (nor flax); the kinds' tables in
# umoe_jax/kinds.py and the registered classes agree.


def test_config_validation_imports_no_model_in_a_fresh_process():
  code = ("import sys, configs.common as c; from umoe_jax.config import model_config\n"
          "for f in ('umoe', 'moa', 'switchhead', 'ffn_moe'): model_config(c.model(f, 'tiny'))\n"
          "bad = [m for m in sys.modules if m.startswith(('umoe_jax.model', 'umoe_jax.ops', 'flax', 'kernels'))]\n"
          "assert not bad, bad\n")
  run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
  assert run.returncode == 0, run.stderr[-2000:]


def test_kind_tables_match_the_registered_classes():
  from umoe_jax import kinds
  from umoe_jax.model.attention import ATTENTIONS
  from umoe_jax.model.routers import BALANCE_LOSSES, ROUTERS
  from umoe_jax.registry import Registry
  assert ROUTERS.names() == sorted(kinds.ROUTER_KINDS)
  assert ATTENTIONS.names() == sorted(kinds.ATTENTION_KINDS)
  assert sorted(BALANCE_LOSSES) == sorted(kinds.BALANCE_LOSS_NAMES)
  with pytest.raises(ValueError, match="umoe_jax/kinds.py"):
    ROUTERS.register("not_in_the_table")(object)
  assert Registry("free").register("anything")(int) is int   # a registry without a table takes any


# ------------------------------------------------------------------------------------------------
# Optional keys from the command line, through the real absl / ml_collections flag parsing.


def _parse_config_flags(*args):
  from absl import flags
  from ml_collections import config_flags
  argv = ["prog", f"--config={os.path.join(ROOT, 'configs', 'umoe_tiny.py')}", *args]
  fv = flags.FlagValues()
  holder = config_flags.DEFINE_config_file("config", None, "experiment", flag_values=fv,
                                           lock_config=True, sys_argv=argv)
  fv(argv)
  return holder.value


def test_every_optional_key_takes_none_and_a_value_from_the_command_line():
  from absl import flags
  base = _parse_config_flags()
  assert base.model.attention.q_lora_rank == 8                       # the family's own value
  cfg = _parse_config_flags("--config.model.attention.q_lora_rank=None",   # README's full query
                            "--config.model.attention.latent_dim=16",
                            "--config.expert_parallel.capacity_factor=1.5",
                            "--config.train.warmup_steps=None", "--config.data.num_epochs=null",
                            "--config.model.router.aoe_dim=None")
  m = model_config(cfg.model)
  assert m.attention.q_lora_rank is None and m.attention.latent_dim == 16
  assert cfg.expert_parallel.capacity_factor == 1.5 and cfg.train.warmup_steps is None
  assert cfg.data.num_epochs is None
  again = _parse_config_flags("--config.expert_parallel.capacity_factor=None",
                              "--config.model.attention.q_lora_rank=4")
  assert again.expert_parallel.capacity_factor is None and again.model.attention.q_lora_rank == 4
  # A value of the wrong type still fails in parsing, naming the flag and the value.
  with pytest.raises(flags.IllegalFlagValueError, match=r"q_lora_rank=abc"):
    _parse_config_flags("--config.model.attention.q_lora_rank=abc")
  # Every Optional field of the model config is such a field.
  def optional_paths(cls, prefix):
    import typing
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
      if dataclasses.is_dataclass(hints[f.name]):
        yield from optional_paths(hints[f.name], f"{prefix}{f.name}.")
      elif type(None) in typing.get_args(hints[f.name]):
        yield prefix + f.name
  paths = list(optional_paths(ModelConfig, "model."))
  assert "model.attention.q_lora_rank" in paths and len(paths) >= 5
  nones = _parse_config_flags(*[f"--config.{p}=None" for p in paths])
  for p in paths:
    node = nones
    for part in p.split("."):
      node = node[part]
    assert node is None, p


def test_sub_layer_routers_override_the_global_section():
  """model.attention.router / model.ffn.router keys override model.router for that sub-layer only;
  unset keys (None) inherit, derived defaults resolve per sub-layer; a global-only config is as before."""
  m = common.model("umoe", "tiny")
  m.router.balance_coef = 0.01
  m.ffn.router.kind, m.ffn.router.renormalize = "aoe", True
  m.attention.router.kind, m.attention.router.xmoe_dim = "xmoe", 4
  cfg = model_config(m)
  att, ffn = cfg.router_for("attention"), cfg.router_for("ffn")
  assert (att.kind, att.xmoe_dim, att.renormalize, att.balance_coef) == ("xmoe", 4, False, 0.01)
  assert (ffn.kind, ffn.renormalize, ffn.balance_coef, ffn.aoe_dim) == ("aoe", True, 0.01, 128 // 3)
  assert cfg.router.kind == "topk_softmax" and cfg.router.aoe_dim is None
  assert cfg.router_key("ffn", "kind") == "model.ffn.router.kind"
  assert cfg.router_key("ffn", "balance_coef") == "model.router.balance_coef"
  plain = model_config(common.model("umoe", "tiny"))
  assert plain.router_for("attention") == plain.router_for("ffn") == plain.router


def test_routers_that_cannot_decode_are_refused_when_the_cache_is_made():
  """Expert choice (it sees later tokens) and mixing (the cache keeps no routing inputs): a
  ConfigError naming the key from `check_cached_decoding`, which `init_cache` runs first."""
  from umoe_jax.config import check_cached_decoding
  for changes, key, value in [({"ffn.router.selection": "expert_choice"}, "model.ffn.router.selection",
                                "'expert_choice'"),
                               ({"ffn.router.mixing": "similarity"}, "model.ffn.router.mixing",
                                "'similarity'"),
                               ({"router.kind": "similarity_aware"}, "model.router.kind",
                                "'similarity_aware'")]:
    cfg = model_config(_bad("ffn_moe", changes))
    with pytest.raises(ConfigError, match=re.escape(f"{key}={value}") + ".*decod"):
      check_cached_decoding(cfg)
  check_cached_decoding(model_config(_bad("ffn_moe", {"ffn.router.selection": "top_p",
                                                      "ffn.router.entropy_coef": 1e-4})))
