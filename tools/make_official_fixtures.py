"""Golden fixtures from the official PyTorch UMoE code (github.com/ysngki/UMoE) for tests/test_interop.py.

Builds tiny random official models (float32, eager attention, CPU) with the official
`model_libs/src_code/modeling_deepseek.py`, imported at run time from a checkout given by
`--official_repo` (nothing of it is copied into this repository), runs them on fixed random tokens
and writes, for each family,

    <out>/<name>/config.json        the official config, as `save_pretrained` writes it
    <out>/<name>/model.safetensors  the official state dict, as `save_pretrained` writes it
    <out>/<name>/tokens.npy         int32 [B, T]
    <out>/<name>/logits.npy         float32 [B, T, V], the official model's output

Families (each derived from a released config in `model_libs/configs/` with tiny sizes):

    dense          small-GPT                   VanillaAttention + dense MLP
    ffn_moe        small-vanilla-ffnMoE-1024   VanillaAttention + GroupedMoE FFN
    umoe           small-vanilla-UMoE-1024     PreMixMoEAttention sharing its experts with the FFN
    umoe_att       small-vanilla-UMoE-Att-1024 PreMixMoEAttention + dense MLP
    umoe_att_moe_ffn  umoe_att with no_ffn_moe=false: PreMixMoEAttention + its own GroupedMoE FFN
    umoe_full_q    umoe with q_lora_rank=null: full per-expert queries (`q_proj`, E*Dk x D)
    umoe_megatron  umoe with use_megatron_cutlass_group_gemm=true (the other expert weight layout,
                   the one of the code the paper's runs used, before commit 95284fd of 2025-07-25)
    moa            small-moa-1024              MoAMoEAttention (3 of 8 expert heads + 1 shared) + dense MLP
    switchhead     1B-switchhead-1024          SwitchHead (4 heads, top-2 of 4 V/O experts each) + dense MLP
    umoe_mla       small-mla-UMoE-1024         umoe with MLA-style latent values (latent_size 8)

Post-mixing has no fixture: the official UMoEDecoderLayer never builds its PostMixMoEAttention (with
postmix_att_moe it still runs PreMixMoEAttention), so the official code has no post-mixing model.

The official model needs CUDA-only kernels: `grouped_gemm` (fanshiqing/grouped_gemm: `ops.permute`,
`ops.unpermute`, `ops.gmm`, always used for permutation) and, by default (`use_unsloth_moe=True`),
`unsloth_moe.grouped_gemm`. The official code has no pure-PyTorch path that covers all layers (its
`pytorch_native_permute` branch gets `sorted_indices=None` from the FFN path of UMoE), so this script
replaces those kernels by the naive PyTorch loops below, written from the kernels' documented
semantics:

    permute(x [N, D], idx [N, K]) -> (x[sorted // K], row_id_map)  stable sort of the N*K (token, slot)
        pairs by expert; row_id_map[k * N + n] = row of (n, k) in the permuted order
    unpermute(y, row_id_map, probs=None)  out[n] = sum_k probs[n, k] * y[row_id_map[k * N + n]]
        (probs None: K = 1, N = rows of y)
    gg gmm(a, b [E, K, N], sizes, trans_b=False)  rows of group e times b[e] (b[e].T with trans_b)
    unsloth grouped_gemm(X, W [E, N, K], m_sizes, topk)  rows of group e times W[e].T

Run (needs torch, transformers 4.5x and safetensors; a virtualenv keeps them apart):

    python tools/make_official_fixtures.py --official_repo=/tmp/UMoE --out=tests/data/official
"""
from __future__ import annotations

import argparse
import copy
import importlib
import json
import math
import os
import shutil
import sys

import numpy as np

# Tiny shapes: d=48, 2 layers, vocab 128, 8 experts (all fixtures together stay well under 2 MB).
TINY = dict(
    hidden_size=48, num_hidden_layers=2, vocab_size=128, max_position_embeddings=64,
    num_attention_heads=4, num_key_value_heads=4, qk_nope_head_dim=6, qk_rope_head_dim=6,
    v_head_dim=12, intermediate_size=96, moe_intermediate_size=12, n_routed_experts=8,
    n_shared_experts=1, q_lora_rank=None,
)
FAMILIES = {
    # name: (released config, overrides)
    "dense": ("small-GPT", {}),
    "ffn_moe": ("small-vanilla-ffnMoE-1024", dict(num_experts_per_tok=3)),
    "umoe": ("small-vanilla-UMoE-1024", dict(num_experts_per_tok=3, ffn_num_experts_per_tok=4,
                                             q_lora_rank=4)),
    "umoe_att": ("small-vanilla-UMoE-Att-1024", dict(num_experts_per_tok=3, q_lora_rank=4)),
    "umoe_att_moe_ffn": ("small-vanilla-UMoE-Att-1024", dict(num_experts_per_tok=3, q_lora_rank=4,
                                                             no_ffn_moe=False)),
    "umoe_full_q": ("small-vanilla-UMoE-1024", dict(num_experts_per_tok=3, ffn_num_experts_per_tok=4)),
    "umoe_megatron": ("small-vanilla-UMoE-1024", dict(num_experts_per_tok=3, ffn_num_experts_per_tok=4,
                                                     q_lora_rank=4,
                                                     use_unsloth_moe=False,
                                                     use_megatron_cutlass_group_gemm=True)),
    "moa": ("small-moa-1024", dict(num_experts_per_tok=3)),
    "switchhead": ("1B-switchhead-1024", dict(num_experts_per_tok=2, n_shared_experts=0,
                                              n_routed_experts=4)),
    "umoe_mla": ("small-mla-UMoE-1024", dict(num_experts_per_tok=3, ffn_num_experts_per_tok=4,
                                             q_lora_rank=4, latent_size=8)),
}
BATCH, SEQ = 2, 24


# ------------------------------------------------------------------------------------------------
# Naive stand-ins for the CUDA kernels.


def _torch():
  import torch
  return torch


class NaiveGroupedGemmOps:
  """`grouped_gemm.ops` (fanshiqing/grouped_gemm v1.1.x) in plain PyTorch."""

  @staticmethod
  def permute(x, indices, num_out_tokens=None, max_token_num=0):
    torch = _torch()
    if indices.dim() == 1:
      indices = indices.view(-1, 1)
    n, k = indices.shape
    flat = indices.reshape(-1).long()
    order = torch.argsort(flat, stable=True)                       # permuted row -> n * K + k
    permuted = x.index_select(0, order // k)
    row_id_map = torch.empty(n * k, dtype=torch.int32)
    src = order
    row_id_map[(src % k) * n + src // k] = torch.arange(n * k, dtype=torch.int32)
    return permuted, row_id_map

  @staticmethod
  def unpermute(y, row_id_map, probs=None):
    torch = _torch()
    if probs is None:
      return y.index_select(0, row_id_map.long())
    n, k = probs.shape
    rows = row_id_map.long().view(k, n).t()                        # [N, K]
    gathered = y.index_select(0, rows.reshape(-1)).view(n, k, -1)
    return (gathered.float() * probs.float().unsqueeze(-1)).sum(dim=1).to(y.dtype)

  @staticmethod
  def gmm(a, b, batch_sizes, trans_b=False):
    torch = _torch()
    out, start = [], 0
    for e, size in enumerate(batch_sizes.tolist()):
      w = b[e].t() if trans_b else b[e]
      out.append(a[start:start + size] @ w)
      start += size
    return torch.cat(out, dim=0)


def naive_unsloth_grouped_gemm(X, W, m_sizes, topk, gather_indices=None, permute_x=False,
                               permute_y=False, topk_weights=None, fuse_mul_post=False, autotune=False,
                               **unused):
  """`unsloth_moe.grouped_gemm` without its fusions: W [E, N, K], rows of group e times W[e].T."""
  torch = _torch()
  assert not (permute_x or permute_y or fuse_mul_post), "fusions are not used by the official code"
  out, start = [], 0
  for e, size in enumerate(m_sizes.tolist()):
    out.append(X[start:start + size] @ W[e].t())
    start += size
  return torch.cat(out, dim=0)


def import_official(official_repo: str):
  """Imports `model_libs/src_code` of the checkout as a package and patches in the naive kernels."""
  src = os.path.join(official_repo, "model_libs", "src_code")
  if not os.path.isfile(os.path.join(src, "modeling_deepseek.py")):
    raise SystemExit(f"--official_repo={official_repo}: no model_libs/src_code/modeling_deepseek.py")
  sys.path.insert(0, os.path.join(official_repo, "model_libs"))
  modeling = importlib.import_module("src_code.modeling_deepseek")
  configuration = importlib.import_module("src_code.configuration_deepseek")
  moe_blocks = importlib.import_module("src_code.moe_blocks")
  for mod in (modeling, moe_blocks):
    mod.gg_ops = NaiveGroupedGemmOps
    mod.grouped_gemm = naive_unsloth_grouped_gemm
    mod.has_unsloth = True
  return modeling, configuration


# ------------------------------------------------------------------------------------------------


def make_config(configuration, official_repo: str, name: str):
  base_name, overrides = FAMILIES[name]
  with open(os.path.join(official_repo, "model_libs", "configs", base_name, "config.json")) as f:
    values = json.load(f)
  values.update(TINY)
  values.update(overrides)
  values.pop("auto_map", None)
  values.pop("architectures", None)
  values.pop("model_type", None)
  values["torch_dtype"] = "float32"
  cfg = configuration.DeepseekV2Config(**values)
  cfg._attn_implementation = "eager"
  return cfg


def randomize(model, seed: int) -> None:
  """Well-scaled random parameters: the real init (std 0.02) would make attention and routing
  near-uniform and hide mistakes. Matrices N(0, 1/fan_in) (per expert for grouped weights), embeddings
  N(0, 1), norm weights 1 + U(-0.5, 0.5), routers N(0, (2/sqrt(D))^2) (decisive top-k)."""
  torch = _torch()
  gen = torch.Generator().manual_seed(seed)
  cfg = model.config
  for name, p in model.named_parameters():
    shape = tuple(p.shape)
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
      new = 1.0 + (torch.rand(shape, generator=gen) - 0.5)
    elif name.endswith("embed_tokens.weight"):
      new = torch.randn(shape, generator=gen)
    elif name.endswith("gate.weight") or name.endswith("gate_ffn.weight"):
      new = torch.randn(shape, generator=gen) * 2.0 / math.sqrt(shape[1])
    else:
      fan_in = shape[1]
      if name.endswith(("linear_2.weight", "q_b_proj.weight")):
        fan_in = shape[1] // cfg.n_routed_experts                  # one expert's input width
      new = torch.randn(shape, generator=gen) / math.sqrt(fan_in)
    with torch.no_grad():
      p.copy_(new)


def top_k_margins(model, tokens):
  """Smallest gap between the k-th and (k+1)-th routing probability over every router call."""
  torch = _torch()
  gaps = []

  def hook(module, args, kwargs, output):
    hidden = args[0] if args else kwargs["hidden_states"]
    k = kwargs.get("topk", args[1] if len(args) > 1 else None)
    logits = hidden.reshape(-1, hidden.shape[-1]).float() @ module.weight.float().t()
    probs = logits.softmax(-1)
    top = probs.topk(k + 1, dim=-1).values if k < probs.shape[-1] else None
    if top is not None:
      gaps.append(float((top[:, k - 1] - top[:, k]).min()))

  handles = [m.register_forward_hook(hook, with_kwargs=True)
             for m in model.modules() if type(m).__name__ == "MoEGate"]
  with torch.no_grad():
    model(input_ids=tokens)
  for h in handles:
    h.remove()
  return min(gaps) if gaps else float("inf")


def make_fixture(modeling, configuration, official_repo: str, name: str, out_dir: str, seed: int):
  torch = _torch()
  torch.manual_seed(seed)
  cfg = make_config(configuration, official_repo, name)
  model = modeling.DeepseekV2ForCausalLM(cfg).float().eval()
  rng = np.random.default_rng(seed)
  for attempt in range(20):     # re-draw until no top-k decision is a near tie (robust golden logits)
    randomize(model, seed * 100 + attempt)
    tokens = rng.integers(0, cfg.vocab_size, size=(BATCH, SEQ)).astype(np.int32)
    margin = top_k_margins(model, torch.from_numpy(tokens).long())
    if margin > 1e-4:
      break
  else:
    raise RuntimeError(f"{name}: could not draw parameters without near-tied routing")
  with torch.no_grad():
    logits = model(input_ids=torch.from_numpy(tokens).long(), use_cache=False).logits
  target = os.path.join(out_dir, name)
  if os.path.isdir(target):
    shutil.rmtree(target)
  model.save_pretrained(target, safe_serialization=True)
  for extra in os.listdir(target):
    if extra not in ("config.json", "model.safetensors"):
      os.remove(os.path.join(target, extra))
  np.save(os.path.join(target, "tokens.npy"), tokens)
  np.save(os.path.join(target, "logits.npy"), logits.float().numpy())
  size = sum(os.path.getsize(os.path.join(target, f)) for f in os.listdir(target))
  print(f"{name:16s} layers={type(model.model.layers[0].self_attn).__name__:20s} "
        f"params={sum(p.numel() for p in model.parameters()):7d} min top-k margin={margin:.2e} "
        f"|logits|max={float(logits.abs().max()):.3f} bytes={size}")
  return size


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--official_repo", required=True,
                      help="checkout of github.com/ysngki/UMoE (outside this repository)")
  parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))), "tests", "data", "official"))
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--only", nargs="*", default=None, help="subset of: " + ", ".join(FAMILIES))
  parser.add_argument("--official_commit", default=None,
                      help="commit of the checkout (recorded in PROVENANCE.json; read from git if omitted)")
  args = parser.parse_args(argv)
  torch = _torch()
  torch.set_num_threads(1)
  modeling, configuration = import_official(os.path.abspath(args.official_repo))
  os.makedirs(args.out, exist_ok=True)
  total = 0
  for name in args.only or FAMILIES:       # the seed of a fixture depends on its name only
    seed = args.seed + list(FAMILIES).index(name)
    total += make_fixture(modeling, configuration, args.official_repo, name, args.out, seed)
  print(f"total bytes: {total}")
  commit = args.official_commit
  if commit is None:
    import subprocess
    try:
      commit = subprocess.run(["git", "-C", args.official_repo, "rev-parse", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
      commit = "unknown"
  import transformers
  with open(os.path.join(args.out, "PROVENANCE.json"), "w") as f:
    json.dump(dict(generator="tools/make_official_fixtures.py", official_repo="github.com/ysngki/UMoE",
                   official_commit=commit, torch=torch.__version__, transformers=transformers.__version__,
                   seed=args.seed, batch=BATCH, seq=SEQ, tiny=TINY,
                   families={k: v[0] for k, v in FAMILIES.items()}), f, indent=2)
    f.write("\n")


if __name__ == "__main__":
  main()
