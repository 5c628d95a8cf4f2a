"""`python -m umoe_jax.interop export --format=hf`: the exported directory, loaded by transformers'
AutoModelForCausalLM (trust_remote_code), computes our model's function.

For every tiny zoo config, every router kind and the other switches of the model (post-mixing, gated
experts, shared pools and routers, MLA values, ...) a random model is exported and run by
tests/hf_runner.py in a process of its own (the repository's kernels/ package shadows a
distribution transformers imports; an exported directory needs nothing of this project). Its float32
CPU logits equal ours to 1e-5 (relative, max-norm) on a random and a real-text row, and its greedy
`generate()` of 32 tokens equals `umoe_jax.model.decode.generate` (what `python -m
umoe_jax.generate` runs; a plain argmax loop over full forward passes for the routers that cannot
decode from a cache). The routers' weights are scaled up so routing is peaked: at the random init
every expert is about equally likely, and top-P would keep every slot.
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from umoe_jax.data.tokenizer import ByteTokenizer
from umoe_jax.interop import official
from umoe_jax.interop.__main__ import main as interop_main
from umoe_jax.model import decode
from umoe_jax.model.lm import build_model

pytestmark = pytest.mark.extras("torch", "transformers")

RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_runner.py")
TEXT = "The quick brown fox jumps over the lazy dog; UMoE shares its experts."
NEW_TOKENS = 32

# name -> (zoo config, {dotted model key: value}); every router kind, every attention and FFN kind.
CASES = {
    "dense": ("dense_tiny", {}),
    "ffn_moe": ("ffn_moe_tiny", {}),
    "umoe": ("umoe_tiny", {}),
    "umoe_att": ("umoe_att_tiny", {}),
    "moa": ("moa_tiny", {}),
    "switchhead": ("switchhead_tiny", {}),
    "switchhead_sigmoid": ("switchhead_tiny", {"router.kind": "topk_sigmoid", "attention.top_k": 2}),
    "xmoe": ("umoe_tiny", {"router.kind": "xmoe"}),
    "hash": ("umoe_tiny", {"router.kind": "hash"}),
    "smoe_dropout": ("umoe_tiny", {"router.kind": "smoe_dropout", "router.renormalize": True}),
    "stablemoe": ("umoe_tiny", {"router.kind": "stablemoe"}),
    "similarity_aware": ("umoe_tiny", {"router.kind": "similarity_aware"}),
    "attention_aware": ("ffn_moe_tiny", {"router.kind": "attention_aware",
                                         "router.attention_temperature": 0.5}),
    "aoe_top_p": ("umoe_tiny", {"ffn.router.kind": "aoe", "ffn.router.selection": "top_p",
                                "ffn.router.entropy_coef": 1e-4, "moe.gated": True}),
    "top_p_bias": ("umoe_tiny", {"router.selection": "top_p", "router.entropy_coef": 1e-4,
                                 "attention.router.selection": "top_k",
                                 "attention.router.bias_update_rate": 1e-3}),
    "postmix_top_p": ("umoe_tiny", {"attention.kind": "postmix", "router.selection": "top_p",
                                    "router.entropy_coef": 1e-4}),
    "shared_everything": ("umoe_tiny", {"moe.share_across_layers": True, "moe.share_always_on": True,
                                        "router.share_att_ffn": True, "moe.activation": "gelu",
                                        "rope_layout": "half"}),
    "mla_full_q_no_ffn": ("umoe_tiny", {"attention.latent_dim": 16, "attention.q_lora_rank": None,
                                        "ffn.kind": "none", "moe.activation": "relu"}),
    "moa_mixed_xmoe": ("moa_tiny", {"router.kind": "xmoe", "router.mixing": "similarity"}),
}


def model_config(case: str):
  base, change = CASES[case]
  cfg = importlib.import_module(f"configs.{base}").get_config().model
  cfg.n_layers, cfg.compute_dtype = 2, "float32"
  for key, value in change.items():
    *sections, field = key.split(".")
    target = cfg
    for s in sections:
      target = target[s]
    target[field] = value
  return cfg


def peaked(model) -> None:
  """Router weights x 20 and random selection biases: decisive routes, slots top-P leaves empty."""
  rng = np.random.RandomState(1)
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    name = "/".join(map(str, path))
    value = np.asarray(var.get_value())
    if name.endswith("selection_bias"):
      var.set_value(jnp.asarray(rng.normal(0, 0.05, value.shape), jnp.float32))
    elif "router" in name and name.endswith(("kernel", "centroids", "proj")) or name.endswith("w_a"):
      var.set_value(jnp.asarray(value * 20.0))


# The cases whose greedy generation is compared too (each compiles a decoding program): every
# attention kind, a router of each family and the routers that cannot decode from a cache.
GENERATE = ("dense", "ffn_moe", "umoe", "umoe_att", "moa", "switchhead", "hash", "stablemoe",
            "similarity_aware", "attention_aware", "postmix_top_p", "shared_everything",
            "mla_full_q_no_ffn", "aoe_top_p")


def jitted(model):
  graphdef, state = nnx.split(model)
  forward = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens)[0])
  return lambda tokens: np.asarray(forward(state, jnp.asarray(tokens)))


def reference_greedy(model, forward, prompt: list[int]) -> list[int]:
  """umoe_jax's greedy decoding; where a router cannot decode from a cache, an argmax loop of full
  passes over a fixed-length buffer (causal: the tokens after position i do not change its logits)."""
  try:
    return decode.generate(model, [prompt], max_new_tokens=NEW_TOKENS).sequences()[0]
  except Exception as e:  # noqa: BLE001
    if "cached decoding is not supported" not in str(e):
      raise
  seq = np.zeros((1, len(prompt) + NEW_TOKENS), np.int32)
  seq[0, :len(prompt)] = prompt
  for i in range(len(prompt), seq.shape[1]):
    seq[0, i] = int(np.argmax(forward(seq)[0, i - 1]))
  return seq[0, len(prompt):].tolist()


def run_hf(jobs: list, tmp_path) -> None:
  path = tmp_path / "jobs.json"
  path.write_text(json.dumps(jobs))
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
  done = subprocess.run([sys.executable, RUNNER, str(path)], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-4000:]


def rel_err(out, ref) -> float:
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  """{case: (our logits, our greedy continuation, the runner's logits, its continuation)}."""
  tmp = tmp_path_factory.mktemp("hf")
  text = ByteTokenizer().encode(TEXT)[:40]
  tokens = np.stack([np.random.RandomState(0).randint(0, 512, len(text)), text]).astype(np.int32)
  np.save(tmp / "tokens.npy", tokens)
  jobs, ours = [], {}
  for case in CASES:
    cfg = model_config(case)
    model = build_model(cfg, seed=7)
    peaked(model)
    d = tmp / case
    ckpt = official.save_converted(model, cfg, str(d / "ckpt"))
    assert interop_main(["export", f"--checkpoint={ckpt}", f"--out={d / 'hf'}", "--format=hf"]) == 0
    forward = jitted(model)
    greedy = reference_greedy(model, forward, text[:6]) if case in GENERATE else None
    ours[case] = (forward(tokens), greedy)
    jobs.append({"dir": str(d / "hf"), "tokens": str(tmp / "tokens.npy"), "logits": str(d / "logits.npy")})
    if case in GENERATE:
      jobs[-1]["generate"] = {"prompts": [text[:6]], "max_new_tokens": NEW_TOKENS,
                              "out": str(d / "generated.json")}
  run_hf(jobs, tmp)
  return {case: (*ours[case], np.load(tmp / case / "logits.npy"),
                 json.loads((tmp / case / "generated.json").read_text())[0] if case in GENERATE else None)
          for case in CASES}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_ours(exported, case):
  ref, _, out, _ = exported[case]
  assert out.shape == ref.shape
  assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("case", GENERATE)
def test_greedy_generate_equals_ours(exported, case):
  _, ref, _, out = exported[case]
  assert len(ref) == NEW_TOKENS and out == ref


def test_routing_is_not_trivial(exported):
  """The cases differ from each other (a router kind that fell back to another would not)."""
  logits = {case: v[0] for case, v in exported.items()}
  for a, b in (("umoe", "xmoe"), ("umoe", "hash"), ("umoe", "stablemoe"), ("umoe", "similarity_aware"),
               ("umoe", "top_p_bias"), ("ffn_moe", "attention_aware"), ("switchhead", "switchhead_sigmoid")):
    assert rel_err(logits[a], logits[b]) > 1e-3, (a, b)


def test_directory_layout_and_byte_tokenizer(tmp_path, capsys):
  cfg = model_config("umoe")
  ckpt = official.save_converted(build_model(cfg), cfg, str(tmp_path / "ckpt"))
  out = tmp_path / "hf"
  assert interop_main(["export", f"--checkpoint={ckpt}", f"--out={out}", "--format=hf",
                       "--dtype=bfloat16"]) == 0
  assert "as hf (bfloat16" in capsys.readouterr().out
  names = set(os.listdir(out))
  assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
          "tokenizer_config.json", "modeling_umoe.py", "configuration_umoe.py"} <= names
  config = json.loads((out / "config.json").read_text())
  assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_umoe.UMoEForCausalLM"
  assert config["umoe"]["attention"]["kind"] == "premix" and config["eos_token_id"] == 256
  assert config["umoe"]["ffn_router"]["kind"] == "topk_softmax"
  sd = official.load_official_state_dict(str(out))
  assert all(v.dtype.name == "bfloat16" for v in sd.values())
  assert "model.layers.1.experts.w_up" in sd and "model.layers.0.attention.q_a" in sd
  import tokenizers
  tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
  text = bytes(range(1, 256)).decode("latin-1") + "héllo, wörld 🙂\n"
  assert tok.encode(text, add_special_tokens=False).ids == ByteTokenizer().encode(text)
  assert tok.decode(ByteTokenizer().encode(text)) == text and tok.token_to_id("<|endoftext|>") == 256


def test_expert_choice_is_refused(tmp_path, capsys):
  cfg = model_config("ffn_moe")
  cfg.router.selection = "expert_choice"
  ckpt = official.save_converted(build_model(cfg), cfg, str(tmp_path / "ckpt"))
  assert interop_main(["export", f"--checkpoint={ckpt}", f"--out={tmp_path / 'hf'}",
                       "--format=hf"]) == 2
  err = capsys.readouterr().err
  assert "model.router.selection='expert_choice'" in err and "causally" in err
  assert not os.path.exists(tmp_path / "hf")
  assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []   # its temporary removed


LOAD = ("import sys, torch; from transformers import AutoModelForCausalLM; "
        "m = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True, "
        "dtype=torch.float32); print(m(torch.tensor([[1, 2, 3]])).logits.shape)")


def test_from_pretrained_inside_the_repository_root(tmp_path):
  """Python started in the repository root has the root on sys.path, where kernels/ shadows the
  `kernels` distribution transformers imports: loading fails with one line saying so and how to
  avoid it; `python -P` (the current directory kept off sys.path) loads from the root. The
  exported code itself imports only torch, transformers and its own files."""
  import ast
  root = os.path.dirname(os.path.dirname(RUNNER))
  cfg = model_config("dense")
  ckpt = official.save_converted(build_model(cfg), cfg, str(tmp_path / "ckpt"))
  out = tmp_path / "hf"
  assert interop_main(["export", f"--checkpoint={ckpt}", f"--out={out}", "--format=hf"]) == 0
  for name in os.listdir(out):
    if name.endswith(".py"):
      for node in ast.walk(ast.parse((out / name).read_text())):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0):
          for mod in ([node.module] if isinstance(node, ast.ImportFrom) else
                      [a.name for a in node.names]):
            assert mod.split(".")[0] in ("__future__", "typing", "dataclasses", "math", "torch",
                                         "transformers"), (name, mod)
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
  env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1")
  inside = subprocess.run([sys.executable, "-c", LOAD, str(out)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
  assert inside.returncode != 0
  last = inside.stderr.strip().splitlines()[-1]
  assert last.startswith("ImportError: 'kernels' here is umoe-jax's own kernels/ package") and \
      "start Python with -P" in last, inside.stderr[-3000:]
  safe = subprocess.run([sys.executable, "-P", "-c", LOAD, str(out)], cwd=root, env=env,
                        capture_output=True, text=True, timeout=300)
  assert safe.returncode == 0 and "torch.Size([1, 3, 512])" in safe.stdout, safe.stderr[-3000:]
