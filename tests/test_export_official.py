"""`python -m umoe_jax.interop export --format=official`: exact round trips through the importer for
every variant it reads, the official layout of the fixtures, refusals naming the feature, and bad input.

Round trips: a random model of each tiny zoo config (and the importer's other variants) is exported,
imported back with `umoe_jax.interop.official` and compared parameter by parameter, bit for bit. The
golden fixtures of the official code (tests/data/official) go the other way: imported, exported, and
every tensor of the export equals the fixture's own tensor (so the names, shapes and element order
are those the official code reads, not only ones our importer accepts).
"""
from __future__ import annotations

import importlib
import json
import os

import ml_collections
import numpy as np
import pytest
from flax import nnx

from umoe_jax.interop import export as export_lib
from umoe_jax.interop import official
from umoe_jax.interop import official_export as oe
from umoe_jax.interop.__main__ import main as interop_main
from umoe_jax.model.lm import build_model

DATA = os.path.join(os.path.dirname(__file__), "data", "official")


def flat(model) -> dict:
  return {"/".join(map(str, p)): np.asarray(v.get_value())
          for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def zoo_model(name: str) -> ml_collections.ConfigDict:
  cfg = importlib.import_module(f"configs.{name}").get_config().model
  cfg.n_layers = 2   # the mapping is per layer: two layers show the layer index is kept
  return cfg


def variant(name: str) -> ml_collections.ConfigDict:
  """The importer's variants beyond the zoo's tiny configs."""
  if name.endswith("_tiny"):
    return zoo_model(name)
  base, change = {"umoe_mla": ("umoe_tiny", {"attention.latent_dim": 16}),
                  "umoe_full_q": ("umoe_tiny", {"attention.q_lora_rank": None}),
                  "umoe_no_act": ("umoe_tiny", {"moe.activation": "none"}),
                  "umoe_att_moe_ffn": ("umoe_tiny", {"moe.share_pool": False, "ffn.top_k": 2,
                                                     "attention.top_k": 2}),
                  "moa_no_shared": ("moa_tiny", {"attention.n_shared_experts": 0}),
                  "ffn_moe_renorm": ("ffn_moe_tiny", {"router.renormalize": True,
                                                      "router.balance_loss": "switch"})}[name]
  cfg = zoo_model(base)
  for key, value in change.items():
    section, field = key.split(".") if "." in key else (None, key)
    (cfg[section] if section else cfg)[field] = value
  return cfg


VARIANTS = ["dense_tiny", "ffn_moe_tiny", "umoe_tiny", "umoe_att_tiny", "moa_tiny", "switchhead_tiny",
            "umoe_mla", "umoe_full_q", "umoe_no_act", "umoe_att_moe_ffn", "moa_no_shared",
            "ffn_moe_renorm"]


@pytest.mark.parametrize("layout", ["unsloth", "megatron"])
@pytest.mark.parametrize("name", VARIANTS)
def test_round_trip_is_exact(name, layout):
  cfg = variant(name)
  model = build_model(cfg, seed=3)
  ours = flat(model)
  cj = oe.official_config_json(cfg, expert_layout=layout)
  assert official.expert_weight_layout(cj) == layout
  params = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  sd = oe.official_state_dict(params, cfg, expert_layout=layout)
  back_cfg = official.config_from_official(cj)
  back = flat(official.convert_to_model(sd, back_cfg, layout))
  assert back.keys() == ours.keys()
  for k in ours:
    assert np.array_equal(back[k], ours[k]), k
  assert oe._view(official.model_config(back_cfg)) == oe._view(official.model_config(cfg))


FIXTURES = ["dense", "ffn_moe", "umoe", "umoe_att", "umoe_att_moe_ffn", "umoe_full_q", "umoe_megatron",
            "moa", "switchhead", "umoe_mla"]


@pytest.mark.parametrize("name", FIXTURES)
def test_export_of_an_imported_fixture_is_the_fixture(name):
  """import(fixture) -> export: every tensor the model uses equals the fixture's, and the config
  agrees with the fixture's on every field the importer reads."""
  d = os.path.join(DATA, name)
  cj = official.load_official_config(d)
  layout = official.expert_weight_layout(cj)
  model, cfg = official.import_official(d)
  params = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  sd = oe.official_state_dict(params, cfg, expert_layout=layout)
  fixture = official.load_official_state_dict(d)
  assert set(sd) <= set(fixture)
  for k, v in sd.items():
    assert np.array_equal(v, np.asarray(fixture[k], np.float32)), k
  mine = oe.official_config_json(cfg, expert_layout=layout)
  for key in ("hidden_size", "num_hidden_layers", "vocab_size", "n_routed_experts", "moe_intermediate_size",
              "num_experts_per_tok", "q_lora_rank", "premix_att_moe", "share_att_ffn_moe", "baseline_moa",
              "baseline_switchhead", "mla", "latent_size", "v_head_dim", "num_attention_heads",
              "norm_topk_prob", "aux_loss_alpha", "seq_aux", "hidden_act"):
    if key in ("n_routed_experts", "moe_intermediate_size", "num_experts_per_tok", "q_lora_rank",
               "latent_size") and cj.get(key) is not None and mine.get(key) is None:
      continue   # set in the fixture but unused by its family (the dense fixture's experts)
    assert mine.get(key) == cj.get(key), key
  assert (mine["qk_nope_head_dim"] + mine["qk_rope_head_dim"]
          == cj["qk_nope_head_dim"] + cj["qk_rope_head_dim"])


@pytest.mark.parametrize("change, feature", [
    ({"attention.kind": "postmix"}, "model.attention.kind='postmix'"),
    ({"router.kind": "xmoe"}, "model.router.kind='xmoe'"),
    ({"router.kind": "hash"}, "model.router.kind='hash'"),
    ({"router.kind": "stablemoe"}, "model.router.kind='stablemoe'"),
    ({"router.kind": "similarity_aware"}, "model.router.kind='similarity_aware'"),
    ({"ffn.router.kind": "aoe"}, "model.ffn.router.kind"),
    ({"router.selection": "top_p", "router.entropy_coef": 1e-4}, "model.router.selection='top_p'"),
    ({"ffn.router.selection": "expert_choice"}, "model.ffn.router"),
    ({"router.bias_update_rate": 1e-3}, "model.router.bias_update_rate=0.001"),
    ({"ffn.router.renormalize": True}, "different routers"),
    ({"moe.gated": True}, "model.moe.gated=True"),
    ({"rope_layout": "half"}, "model.rope_layout='half'"),
    ({"attention.q_lora_norm": False}, "model.attention.q_lora_norm=False"),
])
def test_refused_features_are_named(change, feature):
  cfg = zoo_model("umoe_tiny")
  for key, value in change.items():
    *sections, field = key.split(".")
    target = cfg
    for s in sections:
      target = target[s]
    target[field] = value
  with pytest.raises(oe.OfficialExportError, match="official UMoE format") as e:
    oe.official_config_json(cfg)
  assert feature in str(e.value)


# ------------------------------------------------------------------------------------------------
# The command


def converted_checkpoint(tmp_path, name="umoe_tiny", *, data=None) -> str:
  """A converted checkpoint (config.json {"model", "data"?} + params/) of a random model."""
  cfg = zoo_model(name)
  model = build_model(cfg, seed=5)
  d = official.save_converted(model, cfg, str(tmp_path / "ckpt"))
  if data is not None:
    path = os.path.join(d, "config.json")
    with open(path) as f:
      saved = json.load(f)
    saved["data"] = data
    with open(path, "w") as f:
      json.dump(saved, f)
  return d


def workdir_checkpoint(tmp_path, steps=(1, 2), name="ffn_moe_tiny") -> tuple[str, dict]:
  """A training workdir with complete steps (params only) and its {step: flat params}."""
  from umoe_jax.train import checkpoint as ckpt_lib
  from configs import common
  exp = common.experiment(name.replace("_tiny", ""), "tiny")
  exp.model.n_layers = 2
  workdir = str(tmp_path / "run")
  ckpt_lib.write_config(workdir, exp)
  ck = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), keep=5, async_save=False)
  params = {}
  for s in steps:
    model = build_model(exp.model, seed=s)
    ck.save(s, {"params": nnx.to_pure_dict(nnx.state(model, nnx.Param))})
    params[s] = flat(model)
  ck.close()
  return workdir, params


def byte_level_tokenizer(path: str, vocab: int = 300) -> str:
  import tokenizers
  from tokenizers import models, pre_tokenizers
  tok = tokenizers.Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab - 1)} | {"</s>": vocab - 1},
                                              unk_token="w0"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.save(path)
  return path


def test_cli_exports_a_workdir_step(tmp_path, capsys):
  workdir, params = workdir_checkpoint(tmp_path)
  out = tmp_path / "official"
  assert interop_main(["export", f"--checkpoint={workdir}", "--step=1", f"--out={out}",
                       "--format=official"]) == 0
  line = capsys.readouterr().out
  assert "step 1" in line and str(out) in line and "byte tokenizer" in line
  assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
  model, _ = official.import_official(str(out))
  back = flat(model)
  assert all(np.array_equal(back[k], params[1][k]) for k in params[1])
  # the latest step without --step; a second export to the same directory needs --overwrite
  assert interop_main(["export", f"--checkpoint={workdir}", f"--out={out}", "--format=official"]) == 2
  assert "exists and is not empty; pass --overwrite" in capsys.readouterr().err
  assert interop_main(["export", f"--checkpoint={workdir}", f"--out={out}", "--format=official",
                       "--overwrite"]) == 0
  back = flat(official.import_official(str(out))[0])
  assert all(np.array_equal(back[k], params[2][k]) for k in params[2])
  assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []   # no temporary left


def test_bfloat16_weights_and_tokenizer_copied(tmp_path, capsys):
  tok = byte_level_tokenizer(str(tmp_path / "tokenizer.json"))
  d = converted_checkpoint(tmp_path, "dense_tiny", data={"tokenizer": tok, "eos_token": "</s>"})
  cfg_vocab = zoo_model("dense_tiny").vocab_size
  assert cfg_vocab >= 300
  out = tmp_path / "out"
  assert interop_main(["export", f"--checkpoint={d}", f"--out={out}", "--format=official",
                       "--dtype=bfloat16"]) == 0
  assert "tokenizer.json" in capsys.readouterr().out
  with open(out / "tokenizer.json") as f, open(tok) as g:
    assert f.read() == g.read()
  sd = official.load_official_state_dict(str(out))
  assert all(v.dtype.name == "bfloat16" for v in sd.values())
  with open(out / "config.json") as f:
    assert json.load(f)["torch_dtype"] == "bfloat16"
  import ml_dtypes
  model, _ = official.import_official(str(out))
  src = flat(official.load_converted(d)[0])
  back = flat(model)
  for k in src:   # bfloat16 rounding of our float32 parameters, read back exactly
    want = src[k].astype(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(back[k], want), k


def run_cli(args, capsys) -> tuple[int, str]:
  code = interop_main(["export", *args])
  err = capsys.readouterr().err.strip()
  return code, err


def test_bad_inputs_are_one_line(tmp_path, capsys):
  workdir, _ = workdir_checkpoint(tmp_path, steps=(1,))
  out = str(tmp_path / "o")
  # a refused feature: nothing is written
  cfg = zoo_model("umoe_tiny")
  cfg.router.kind = "xmoe"
  xmoe = official.save_converted(build_model(cfg), cfg, str(tmp_path / "xmoe"))
  code, err = run_cli([f"--checkpoint={xmoe}", f"--out={out}", "--format=official"], capsys)
  assert code == 2 and "model.router.kind='xmoe'" in err and not os.path.exists(out)
  # no config.json
  os.remove(os.path.join(xmoe, "config.json"))
  code, err = run_cli([f"--checkpoint={xmoe}", f"--out={out}", "--format=official"], capsys)
  assert code == 2 and "has no config.json" in err and err.count("\n") == 0
  # a step that does not exist, an incomplete step
  code, err = run_cli([f"--checkpoint={workdir}", "--step=7", f"--out={out}", "--format=official"], capsys)
  assert code == 2 and "--step=7" in err and "steps there: [1]" in err
  os.makedirs(os.path.join(workdir, "checkpoints", "9"))
  code, err = run_cli([f"--checkpoint={workdir}", "--step=9", f"--out={out}", "--format=official"], capsys)
  assert code == 2 and "checkpoint step 9 cannot be loaded" in err and err.count("\n") == 0
  # a tokenizer larger than the model's vocabulary
  big = byte_level_tokenizer(str(tmp_path / "big.json"), vocab=4000)
  d = converted_checkpoint(tmp_path, "dense_tiny", data={"tokenizer": big, "eos_token": "</s>"})
  code, err = run_cli([f"--checkpoint={d}", f"--out={out}", "--format=official"], capsys)
  assert code == 2 and "has 4000 tokens" in err and "vocab_size 512" in err
  # --out is a file; a non-empty --out
  (tmp_path / "file").write_text("x")
  code, err = run_cli([f"--checkpoint={workdir}", f"--out={tmp_path / 'file'}", "--format=official"],
                      capsys)
  assert code == 2 and "is a file" in err
  os.makedirs(out)
  (tmp_path / "o" / "keep").write_text("x")
  code, err = run_cli([f"--checkpoint={workdir}", f"--out={out}", "--format=official"], capsys)
  assert code == 2 and "pass --overwrite" in err and os.listdir(out) == ["keep"]
  assert interop_main(["nonsense"]) == 2
  assert "unknown command 'nonsense'" in capsys.readouterr().err


def test_failed_write_keeps_the_old_export(tmp_path, monkeypatch, capsys):
  d = converted_checkpoint(tmp_path, "dense_tiny")
  out = tmp_path / "out"
  os.makedirs(out)
  (out / "old").write_text("previous export")

  def fail(*a, **k):
    raise OSError(28, "No space left on device")
  monkeypatch.setattr(export_lib, "write_official", fail)
  code, err = run_cli([f"--checkpoint={d}", f"--out={out}", "--format=official", "--overwrite"], capsys)
  assert code == 2 and "No space left on device" in err
  assert os.listdir(out) == ["old"] and (out / "old").read_text() == "previous export"
  assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []


def finetuned_workdir(tmp_path) -> tuple[str, dict]:
  """A fine-tuning workdir (1 epoch of 5 steps on a 2-class task) over a converted UMoE backbone
  with the byte tokenizer; and the backbone's {name: parameter} before fine-tuning."""
  from umoe_jax.finetune import loop as ft_loop
  from umoe_jax.finetune.config import default_config
  start = converted_checkpoint(tmp_path, "umoe_tiny", data={"tokenizer": "byte"})
  train = tmp_path / "train.jsonl"
  train.write_text("".join(json.dumps({"text": f"{w} number {i}", "label": w}) + "\n"
                           for w in ("red", "blue") for i in range(10)))
  c = default_config()
  c.init_from = start
  c.data.update(train_path=str(train), max_len=32)
  c.train.update(epochs=1, batch_size=4)
  c.checkpoint.async_save = False
  c.log.update(progress=False, tensorboard=False)
  workdir = str(tmp_path / "ft")
  ft_loop.run(c, workdir)
  return workdir, flat(official.load_converted(start)[0])


def test_finetuned_workdir_exports_its_backbone(tmp_path, capsys):
  """A fine-tuning workdir exports its language-model backbone: the fine-tuned decoder (the
  parameters `finetune predict` scores with, best/<step>) and the pretrained LM head; the summary
  names the classification head left out. A step of checkpoints/ (training state) gives its parameters."""
  from umoe_jax.finetune.predict import load_finetuned
  workdir, pretrained = finetuned_workdir(tmp_path)
  classifier, _ = load_finetuned(workdir)
  tuned = flat(classifier.backbone)
  assert tuned.keys() == pretrained.keys()
  for k in ("embed", "layers/0/experts/w_up", "layers/1/attention/q_b"):   # fine-tuning moved them
    assert not np.array_equal(tuned[k], pretrained[k]), k
  assert np.array_equal(tuned["lm_head"], pretrained["lm_head"])          # frozen
  out = tmp_path / "official"
  assert interop_main(["export", f"--checkpoint={workdir}", f"--out={out}", "--format=official"]) == 0
  line = capsys.readouterr().out
  assert f"{workdir}/best/" in line and "the fine-tuned backbone" in line
  assert f"left out: the classification head (bias [2], kernel [{classifier.backbone.cfg.d_model}, 2])" in line
  back = flat(official.import_official(str(out))[0])
  assert back.keys() == tuned.keys()
  assert all(np.array_equal(back[k], tuned[k]) for k in tuned)
  # a training checkpoint (params + optimizer state) by --step, and a step directory as --checkpoint
  from umoe_jax.train.checkpoint_metadata import complete_steps
  [step] = complete_steps(os.path.join(workdir, "checkpoints"))[-1:]
  for args, where in (([f"--checkpoint={workdir}", f"--step={step}"], "best"),
                      ([f"--checkpoint={workdir}/checkpoints/{step}"], "checkpoints")):
    assert interop_main(["export", *args, f"--out={out}", "--format=official", "--overwrite"]) == 0
    assert f"{workdir}/{where}/{step} (step {step};" in capsys.readouterr().out
    back = flat(official.import_official(str(out))[0])
    assert all(np.array_equal(back[k], tuned[k]) for k in tuned)   # 1 epoch: best is the last step
  code, err = run_cli([f"--checkpoint={workdir}", "--step=99", f"--out={tmp_path / 'o'}",
                       "--format=official"], capsys)
  assert code == 2 and "--step=99" in err and f"best: [{step}]" in err and err.count("\n") == 0


def test_expert_parallel_checkpoint_is_gathered(tmp_path):
  """A run trained 2 steps on 8 devices with the experts split over them (expert=8: each device
  writes its own expert's rows) exports whole: from a process with the same 8 devices and from
  this one-device process alike, every expert in the file, the same bytes, and the parameters
  importing back bit for bit."""
  import subprocess
  import sys
  from umoe_jax import load
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=root,
             XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
  run = str(tmp_path / "run")
  for args in ([os.path.join(root, "tests", "parallel_scripts", "train_worker.py"), run, "2", "expert=8"],
               ["-m", "umoe_jax.interop", "export", f"--checkpoint={run}", f"--out={tmp_path / 'ep8'}",
                "--format=official"]):
    done = subprocess.run([sys.executable, *args], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
  assert "step 2" in done.stdout
  with open(os.path.join(run, "checkpoints", "2", "state", "_METADATA")) as f:
    saved = json.load(f)["tree_metadata"]
  [w_up] = [v for k, v in saved.items() if "'params'" in k and "'0', 'experts', 'w_up'" in k]
  assert w_up["value_metadata"]["write_shape"][0] == 1   # one expert of 8 per device's write
  assert interop_main(["export", f"--checkpoint={run}", f"--out={tmp_path / 'ep1'}",
                       "--format=official"]) == 0
  with open(tmp_path / "ep8" / "model.safetensors", "rb") as f, \
       open(tmp_path / "ep1" / "model.safetensors", "rb") as g:
    assert f.read() == g.read()
  ours = flat(load.load_model(run)[0])
  back = flat(official.import_official(str(tmp_path / "ep8"))[0])
  assert back["layers/0/experts/w_up"].shape[0] == 8
  assert back.keys() == ours.keys() and all(np.array_equal(back[k], ours[k]) for k in ours)


def test_more_bad_inputs(tmp_path, capsys, caplog):
  """A workdir whose config.json is gone, a tokenizer file that is gone, a workdir whose newest step
  a crash left incomplete (the latest complete step is exported, and the line says which)."""
  workdir, params = workdir_checkpoint(tmp_path, steps=(1, 2))
  out = str(tmp_path / "o")
  os.makedirs(os.path.join(workdir, "checkpoints", "3"))   # a save cut short
  assert interop_main(["export", f"--checkpoint={workdir}", f"--out={out}", "--format=official"]) == 0
  assert "checkpoints/2 (step 2)" in capsys.readouterr().out
  back = flat(official.import_official(out)[0])
  assert all(np.array_equal(back[k], params[2][k]) for k in params[2])
  assert "3" in caplog.text and "incomplete" in caplog.text
  tok = byte_level_tokenizer(str(tmp_path / "gone.json"))
  d = converted_checkpoint(tmp_path, "dense_tiny", data={"tokenizer": tok, "eos_token": "</s>"})
  os.remove(tok)
  code, err = run_cli([f"--checkpoint={d}", f"--out={tmp_path / 'o2'}", "--format=official"], capsys)
  assert code == 2 and err.count("\n") == 0 and tok in err, err
  os.remove(os.path.join(workdir, "config.json"))
  code, err = run_cli([f"--checkpoint={workdir}", f"--out={tmp_path / 'o3'}", "--format=official"],
                      capsys)
  assert code == 2 and err.count("\n") == 0 and "has no config.json" in err, err
  assert "--config" not in err   # load's advice: not a flag of export
  assert not os.path.exists(tmp_path / "o2") and not os.path.exists(tmp_path / "o3")
  assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []
