"""Where one decoder layer's training time goes, and what a flash-attention core would save.

For each config (default: umoe_base and dense_base, 32 x 1024 tokens, bf16 compute, f32 params):
  block      one DecoderBlock, forward and forward+backward (gradients of parameters and input);
  attention  its attention sub-layer alone (norm + attention, including the routed experts it calls);
  ffn        its FFN sub-layer alone (norm + FFN / MoE FFN); with a dense config in the same run,
             issue 15's target for each MoE FFN: fwd+bwd <= 1.3x its FLOPs at the dense FFN's rate.
And the attention core (scores, causal softmax, mix) at the config's shapes:
  xla        `causal_attention` (what the models run: scores materialised in float32);
  cudnn      the same call with `core="cudnn"` (`fused_attention`: cuDNN's fused kernel; pre-mixing's
             D-wide values cut into key-width chunks that share the key head);
  triton     `core="triton"` (kernels/attention/triton_attention.py; one shared key head: pre-mixing only).
The fused cores are checked against the XLA one (values and input gradients) before they are timed.
The block and sub-layers run the trainer's default core (`auto`) unless `--attention_core` names one.

  python3 bench/layer_breakdown.py [--configs=umoe_base,dense_base] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from checks import rel_err  # noqa: E402
from gmm import jax_ms, log  # noqa: E402  (bench/gmm.py: CUPTI kernel time)


def core_shapes(mcfg):
  att, d = mcfg.attention, mcfg.d_model
  if att.kind == "premix":
    heads = att.top_k + (1 if att.n_shared_experts else 0)
    return (heads, att.head_dim), (1, att.head_dim), (1, d)
  return (att.n_heads, att.head_dim), (att.n_heads, att.head_dim), (att.n_heads, att.v_head_dim)


def ffn_flops(mcfg, tokens: int) -> float:
  """Forward FLOPs of one FFN sub-layer over `tokens` tokens: its routed experts at the FFN's top_k,
  its always-on expert and its router (umoe_jax.stats' MAC counts, x 2)."""
  from umoe_jax import stats
  per_token = sum(stats.ffn_stats(mcfg.ffn.kind).token_macs(mcfg).values())
  if mcfg.ffn_uses_experts:
    aoe = mcfg.router_for("ffn").kind == "aoe"
    per_token += mcfg.ffn.top_k * stats.routed_expert(mcfg, aoe)[0]
  return 2.0 * per_token * tokens


def ffn_targets(results: dict) -> dict:
  """Issue 15's FFN target per MoE config of this run, against the dense config of the same run:
  allowed fwd+bwd ms = 1.3 x (its FFN FLOPs at the dense FFN's achieved FLOP rate)."""
  dense = [r for r in results.values() if not r["ffn_moe"] and r.get("ffn_fwd_bwd")]
  if not dense:
    return {}
  rate = 3 * dense[0]["ffn_flops"] / (dense[0]["ffn_fwd_bwd"] * 1e-3)   # FLOP/s, fwd+bwd = 3x fwd
  out = {}
  for name, r in results.items():
    if r["ffn_moe"] and r.get("ffn_fwd_bwd"):
      allowed = 1.3 * 3 * r["ffn_flops"] / rate * 1e3
      out[name] = dict(ffn_fwd_bwd_ms=r["ffn_fwd_bwd"], allowed_ms=allowed,
                       dense_ffn_tflops=rate / 1e12, ratio=r["ffn_fwd_bwd"] / allowed)
  return out


def time_fwd_bwd(fn, *args):
  """(forward ms, forward+backward ms) of fn(*args) -> array, gradients of every arg."""

  def loss(*a):  # a cotangent that is not all ones (sin of the output, held constant)
    out = fn(*a)
    return jnp.sum(out.astype(jnp.float32) * jax.lax.stop_gradient(jnp.sin(out.astype(jnp.float32))))

  fwd = jax_ms(jax.jit(fn), *args)
  fb = jax_ms(jax.jit(jax.grad(loss, argnums=tuple(range(len(args))))), *args)
  return fwd, fb


def breakdown(name, batch, seq_len, attention_core, core_backward="auto"):
  from umoe_jax import stats
  from umoe_jax.config import model_config
  from umoe_jax.model.attention.cores import causal_attention
  from umoe_jax.model.block import DecoderBlock
  from umoe_jax.model.routers import route_context

  config = stats.load_config_file(os.path.join(ROOT, "configs", f"{name}.py"))
  with config.unlocked():
    config.model.attention.core = attention_core
    config.model.attention.core_backward = core_backward
  mcfg = model_config(config.model)
  row = {}
  kh, kt = jax.random.split(jax.random.key(1))
  h = jax.random.normal(kh, (batch, seq_len, mcfg.d_model), jnp.float32).astype(mcfg.compute_dtype)
  tokens = jax.random.randint(kt, (batch, seq_len), 0, mcfg.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch, seq_len))
  ctx = route_context(tokens)
  block = DecoderBlock(mcfg, rngs=nnx.Rngs(params=0))
  graphdef, state = nnx.split(block)

  def whole(state, h):
    return nnx.merge(graphdef, state)(h, positions, route_context=ctx)[0]

  def attention(state, h):
    m = nnx.merge(graphdef, state)
    return m.attention(m.attention_norm(h), positions, experts=m.experts, route_context=ctx)[0]

  def ffn(state, h):
    m = nnx.merge(graphdef, state)
    pool = m.ffn_experts if m.ffn_experts is not None else m.experts
    return m.ffn(m.ffn_norm(h), experts=pool, route_context=ctx)[0]

  for part, fn in (("block", whole), ("attention", attention), ("ffn", ffn)):
    if part == "ffn" and block.ffn is None:
      continue
    row[f"{part}_fwd"], row[f"{part}_fwd_bwd"] = time_fwd_bwd(fn, state, h)

  (hq, dk), (hk, _), (hv, dv) = core_shapes(mcfg)
  kq, kk, kv = jax.random.split(jax.random.key(2), 3)
  dt = mcfg.compute_dtype
  q = jax.random.normal(kq, (batch, seq_len, hq, dk), jnp.float32).astype(dt)
  k = jax.random.normal(kk, (batch, seq_len, hk, dk), jnp.float32).astype(dt)
  v = jax.random.normal(kv, (batch, seq_len, hv, dv), jnp.float32).astype(dt)
  xla_core = lambda q, k, v: causal_attention(q, k, v, positions, positions)
  row["core_xla_fwd"], row["core_xla_fwd_bwd"] = time_fwd_bwd(xla_core, q, k, v)
  for fused in ("cudnn", "triton"):
    if fused == "triton" and hk != 1:
      continue  # the Triton kernel takes one shared key head (MHA shapes would be cuDNN's again)
    flash = lambda q, k, v, fused=fused: causal_attention(q, k, v, positions, positions, core=fused,
                                                          core_backward=core_backward)
    try:
      got, want = jax.jit(flash)(q, k, v), jax.jit(xla_core)(q, k, v)
      row[f"core_{fused}_err"] = rel_err(got, want)
      loss = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2), (0, 1, 2)))
      row[f"core_{fused}_grad_err"] = max(rel_err(a, b) for a, b in zip(loss(flash)(q, k, v),
                                                                    loss(xla_core)(q, k, v)))
      if row[f"core_{fused}_err"] < 2e-2 and row[f"core_{fused}_grad_err"] < 5e-2:
        row[f"core_{fused}_fwd"], row[f"core_{fused}_fwd_bwd"] = time_fwd_bwd(flash, q, k, v)
      else:
        log(f"  {name}: {fused} core disagrees with XLA: {row[f'core_{fused}_err']:.2e} / "
            f"{row[f'core_{fused}_grad_err']:.2e}; not timed")
    except Exception as e:  # noqa: BLE001
      log(f"  {name}: {fused} core failed: {repr(e)[:300]}")
  row["n_layers"] = mcfg.n_layers
  row["ffn_moe"] = bool(mcfg.ffn_uses_experts)
  row["ffn_flops"] = ffn_flops(mcfg, batch * seq_len)
  log(f"  {name}: " + ", ".join(f"{a} {b:.3g}" for a, b in row.items()))
  return row


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--configs", default="umoe_base,dense_base")
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--seq_len", type=int, default=1024)
  ap.add_argument("--attention_core", default="auto", choices=["auto", "xla", "cudnn", "triton"],
                  help="model.attention.core of the block and sub-layers (default: auto, what the "
                       "trainer runs: on one GPU triton for pre-mixing, cudnn for the rest)")
  ap.add_argument("--attention_tiles", default=None,
                  help="JSON of Triton attention tiles (bench/attention_core.py --sweep)")
  ap.add_argument("--core_backward", default="auto",
                  choices=["auto", "recompute", "stored_pairs"],
                  help="model.attention.core_backward: the Triton core's backward form")
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  args = ap.parse_args()
  from umoe_jax.ops import gmm as G
  G.register_builtin_kernels()
  if args.attention_tiles:
    from kernels.attention import tiles as attention_tiles
    attention_tiles.load_table(args.attention_tiles)
  log("device:", jax.devices()[0].device_kind)
  results = {}
  for name in args.configs.split(","):
    results[name] = breakdown(name, args.batch, args.seq_len, args.attention_core,
                              args.core_backward)
  targets = ffn_targets(results)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "layer_breakdown.json"), "w") as f:
    json.dump({**results, "ffn_targets": targets}, f, indent=1)
  log("\nms per layer (fwd / fwd+bwd); x layers = per step")
  log(f"{'config':12s} {'block':>14s} {'attention':>14s} {'ffn':>14s} {'core xla':>14s} {'core cudnn':>14s} "
      f"{'core triton':>14s}")
  for name, r in results.items():
    g = lambda k: r.get(k, float("nan"))
    cells = [f"{g(p + '_fwd'):6.2f}/{g(p + '_fwd_bwd'):6.2f}"
             for p in ("block", "attention", "ffn", "core_xla", "core_cudnn", "core_triton")]
    log(f"{name:12s} " + " ".join(f"{c:>14s}" for c in cells))
  for name, t in targets.items():
    log(f"{name}: MoE FFN sub-layer fwd+bwd {t['ffn_fwd_bwd_ms']:.2f} ms; target (1.3x its FLOPs at the "
        f"dense FFN's {t['dense_ffn_tflops']:.0f} TFLOP/s) {t['allowed_ms']:.2f} ms: "
        f"{'met' if t['ratio'] <= 1 else 'not met'} ({t['ratio']:.2f}x the target)")


if __name__ == "__main__":
  main()
