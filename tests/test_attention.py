"""Attention sub-layers against float64 loops: causal attention, dense MHA, UMoE pre-mixing MoE."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import reference as R
from conftest import bf16_round, numpy_params, positions_for, random_module, rel_err, tiny_config
from umoe_jax.model.attention import ATTENTIONS, causal_attention
from umoe_jax.model.block import make_expert_pool

F32_BOUND = 1e-5     # float32 against float64: observed ~2e-7
BF16_BOUND = 2e-2    # bfloat16 compute against float64: observed ~6e-3
B, T = 2, 10


@nnx.jit
def _att_call(att, pool, x):
  return att(x, positions_for(x.shape[0], x.shape[1]), experts=pool)


_causal = jax.jit(causal_attention)


# ------------------------------------------------------------------------------------------------
# The attention primitive.


@pytest.mark.parametrize("hk", ["per_head", "single"])
@pytest.mark.parametrize("dtype,bound", [("float32", F32_BOUND), ("bfloat16", BF16_BOUND)])
def test_causal_attention(hk, dtype, bound):
  rng = np.random.default_rng(0)
  h, dk, dv = 3, 8, 12                   # value width differs from key width (pre-mixing: dv = D)
  n_k = h if hk == "per_head" else 1
  q = rng.standard_normal((B, T, h, dk)).astype(np.float32)
  k = rng.standard_normal((B, T, n_k, dk)).astype(np.float32)
  v = rng.standard_normal((B, T, n_k, dv)).astype(np.float32)
  pos = positions_for(B, T)
  out = _causal(*(jnp.asarray(a, dtype) for a in (q, k, v)), pos, pos)
  assert out.shape == (B, T, h, dv) and out.dtype == jnp.dtype(dtype)
  if dtype == "bfloat16":
    q, k, v = bf16_round(q), bf16_round(k), bf16_round(v)
  ref = np.stack([R.causal_attention(q[b], k[b], v[b]) for b in range(B)])
  assert rel_err(np.asarray(out, np.float32), ref) < bound
  # shifting every position by a constant changes nothing (only k_pos <= q_pos matters)
  out2 = _causal(*(jnp.asarray(a, dtype) for a in (q, k, v)), pos + 5, pos + 5)
  np.testing.assert_array_equal(np.asarray(out2, np.float32),
                                np.asarray(_causal(*(jnp.asarray(a, dtype) for a in (q, k, v)),
                                                   pos, pos), np.float32))


@pytest.mark.parametrize("n_k,dk,dv", [
    (3, 8, 8),      # one key/value head per query head (MHA)
    (1, 8, 8),      # one shared key/value head (MoA)
    (1, 8, 24),     # one key head, values 3 key-widths wide (pre-mixing)
])
def test_fused_attention_layout_matches_causal_attention(n_k, dk, dv):
  """The cuDNN layout of `fused_attention` (wide values cut into key-width chunks sharing the key
  head, grouped-query heads) gives causal_attention's values and gradients; run through
  jax.nn.dot_product_attention's XLA implementation, which takes the same layout on CPU."""
  from umoe_jax.model.attention.cores import fused_attention
  rng = np.random.default_rng(n_k * 100 + dv)
  h = 3
  q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
             for shape in ((B, T, h, dk), (B, T, n_k, dk), (B, T, n_k, dv)))
  pos = positions_for(B, T)
  fused = lambda q, k, v: fused_attention(q, k, v, implementation="xla")
  want = _causal(q, k, v, pos, pos)
  assert rel_err(fused(q, k, v), want) < F32_BOUND
  cot = jnp.asarray(rng.standard_normal(want.shape), jnp.float32)
  grads = lambda f: jax.grad(lambda *a: jnp.sum(f(*a) * cot), argnums=(0, 1, 2))(q, k, v)
  for name, a, b in zip("qkv", grads(fused), grads(lambda *a: causal_attention(*a, pos, pos))):
    assert rel_err(a, b) < F32_BOUND, name


def test_attention_core_choice():
  """core="cudnn" off GPU is the XLA computation; shapes the fused kernel cannot take (per-head
  wide values, values not a multiple of the key width, more keys than queries; for cuDNN also
  float32 operands and head sizes it has no kernel for) return None; an unknown core is refused
  by name."""
  from umoe_jax.model.attention.cores import fused_attention
  rng = np.random.default_rng(3)
  q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
             for shape in ((B, T, 2, 8), (B, T, 1, 8), (B, T, 1, 20)))
  pos = positions_for(B, T)
  if jax.default_backend() != "gpu":  # off GPU, core="cudnn" is the XLA form: the float64 loops'
    ref = np.stack([R.causal_attention(*(np.asarray(a)[b] for a in (q, k, v))) for b in range(B)])
    assert rel_err(causal_attention(q, k, v, pos, pos, core="cudnn"), ref) < F32_BOUND
  assert fused_attention(q, k, v, implementation="xla") is None                      # 20 % 8
  assert fused_attention(q, jnp.zeros((B, T, 2, 8)), jnp.zeros((B, T, 2, 16)),
                         implementation="xla") is None                               # per-head wide
  assert fused_attention(q, jnp.zeros((B, T + 2, 1, 8)), jnp.zeros((B, T + 2, 1, 8)),
                         implementation="xla") is None                               # S != T
  # cuDNN's flash kernels take half-precision operands and head sizes 8k <= 256 only
  assert fused_attention(q, k, k, implementation="cudnn") is None                    # float32
  q16, k16 = q.astype(jnp.bfloat16)[..., :6], k.astype(jnp.bfloat16)[..., :6]
  assert fused_attention(q16, k16, k16, implementation="cudnn") is None              # Dk = 6
  with pytest.raises(ValueError, match="'flash'"):
    causal_attention(q, k, v, pos, pos, core="flash")


def test_auto_core_ranks_the_fused_cores_on_one_gpu_only(monkeypatch):
  """core="auto" (the config default) tries, before XLA: on one GPU the Triton core for values wider
  than the keys then cuDNN, and cuDNN alone for the rest; nothing on several GPUs and off GPU (TPU:
  splash only by name). A named core tries itself and its fallbacks. Here on CPU it computes the
  XLA form; a fused kernel that raises under "auto" falls back to XLA (an explicit "cudnn" lets the
  error through)."""
  import dataclasses
  from configs import common as configs
  from umoe_jax.config import model_config
  from umoe_jax.model.attention import cores
  assert model_config(configs.model("umoe", "tiny")).attention.core == "auto"
  monkeypatch.setitem(cores.CORES._entries, "triton",
                      dataclasses.replace(cores.CORES.get("triton"), available=lambda: True))
  shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
  q, k = shape(B, T, 4, 192), shape(B, T, 1, 192)
  for backend, devices, dv, want in (("gpu", 1, 768, ["triton", "cudnn"]), ("gpu", 1, 192, ["cudnn"]),
                                     ("gpu", 2, 768, []), ("gpu", 8, 192, []),
                                     ("cpu", 1, 768, []), ("tpu", 1, 192, [])):
    monkeypatch.setattr(cores.jax, "default_backend", lambda b=backend: b)
    monkeypatch.setattr(cores.jax, "device_count", lambda d=devices: d)
    assert cores._candidates("auto", q, k, shape(B, T, 1, dv)) == want, (backend, devices, dv)
    for named, chain in (("triton", ["triton", "cudnn"]), ("cudnn", ["cudnn"]),
                         ("splash", ["splash"]), ("xla", [])):
      assert cores._candidates(named, q, k, shape(B, T, 1, dv)) == chain, named
  rng = np.random.default_rng(4)
  q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
             for shape in ((B, T, 2, 8), (B, T, 1, 8), (B, T, 1, 16)))
  pos = positions_for(B, T)
  want = causal_attention(q, k, v, pos, pos, core="xla")
  # a GPU whose fused kernel refuses the call: "auto" answers with XLA, "cudnn" raises
  monkeypatch.setattr(cores.jax, "device_count", lambda: 1)
  monkeypatch.setattr(cores.jax, "default_backend", lambda: "gpu")
  monkeypatch.setitem(cores.CORES._entries, "triton",
                      dataclasses.replace(cores.CORES.get("triton"), available=lambda: False))

  def refuse(*a, **kw):
    raise RuntimeError("no cuDNN here")

  monkeypatch.setattr(cores, "fused_attention", refuse)
  assert rel_err(causal_attention(q, k, v, pos, pos, core="auto"), want) < 1e-6
  with pytest.raises(RuntimeError, match="no cuDNN"):
    causal_attention(q, k, v, pos, pos, core="cudnn")


# ------------------------------------------------------------------------------------------------
# Dense multi-head attention.


def _mha(cfg, seed):
  return random_module(lambda: ATTENTIONS.get("mha")(cfg, rngs=nnx.Rngs(params=0)), seed)


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_mha_float32(layout):
  cfg = tiny_config("dense", rope_layout=layout)
  att = _mha(cfg, 1)
  x = np.random.default_rng(2).standard_normal((B, T, cfg.d_model)).astype(np.float32)
  y, routes = _att_call(att, None, jnp.asarray(x))
  assert routes == {}
  p = numpy_params(att)
  ref = np.stack([R.mha(x[b], p, cfg) for b in range(B)])
  assert rel_err(y, ref) < F32_BOUND


def test_mha_bfloat16():
  cfg = tiny_config("dense", compute_dtype="bfloat16")
  att = _mha(cfg, 3)
  x = np.random.default_rng(4).standard_normal((B, T, cfg.d_model)).astype(np.float32)
  y, _ = _att_call(att, None, jnp.asarray(x, jnp.bfloat16))
  assert y.dtype == jnp.bfloat16
  p = numpy_params(att)
  xb = bf16_round(x)
  ref = np.stack([R.mha(xb[b], p, cfg) for b in range(B)])
  assert rel_err(np.asarray(y, np.float32), ref) < BF16_BOUND


# ------------------------------------------------------------------------------------------------
# Pre-mixing attention MoE (UMoE).


def _premix_case(cfg, seed):
  att = random_module(lambda: ATTENTIONS.get("premix")(cfg, rngs=nnx.Rngs(params=0)), seed)
  pool = random_module(lambda: make_expert_pool(cfg, nnx.Rngs(params=0)), seed + 1)
  x = np.random.default_rng(seed + 2).standard_normal((B, T, cfg.d_model)).astype(np.float32)
  return att, pool, x


PREMIX_VARIANTS = {
    "official_interleaved": {},
    "official_half_rope": {"rope_layout": "half"},
    "full_rank_queries": {"attention.q_lora_rank": None},       # official q_lora_rank=None branch
    "no_lora_norm": {"attention.q_lora_norm": False},             # paper Eq. 11
    "no_shared": {"attention.n_shared_experts": 0},
    "shared2_renorm_k3": {"attention.n_shared_experts": 2, "router.renormalize": True,
                          "attention.top_k": 3},
    "masked_gmm_gelu": {"gmm_backend": "masked", "moe.activation": "gelu"},
}


@pytest.mark.parametrize("variant", list(PREMIX_VARIANTS))
def test_premix_float32(variant):
  cfg = tiny_config("umoe", **PREMIX_VARIANTS[variant])
  att, pool, x = _premix_case(cfg, 10)
  y, routes = _att_call(att, pool, jnp.asarray(x))
  route = routes["attention"]
  p, pp = numpy_params(att), numpy_params(pool)
  refs = [R.premix(x[b], p, pp, cfg) for b in range(B)]
  probs, ids, gates = (np.stack([r[1][j] for r in refs]) for j in range(3))
  np.testing.assert_array_equal(np.asarray(route.expert_ids), ids)
  assert rel_err(route.probs, probs) < 1e-6
  assert rel_err(route.gates, gates) < 1e-6
  np.testing.assert_allclose(float(route.balance_loss),
                             cfg.router.balance_coef * R.seq_aux_loss(probs, ids), rtol=1e-5)
  assert rel_err(y, np.stack([r[0] for r in refs])) < F32_BOUND


@pytest.mark.parametrize("layout", ["interleaved"])   # "half" is covered in float32
def test_premix_bfloat16(layout):
  cfg = tiny_config("umoe", compute_dtype="bfloat16", rope_layout=layout)
  att, pool, x = _premix_case(cfg, 20)
  y, routes = _att_call(att, pool, jnp.asarray(x, jnp.bfloat16))
  assert y.dtype == jnp.bfloat16
  ids = np.asarray(routes["attention"].expert_ids)
  p, pp = numpy_params(att), numpy_params(pool)
  xb = bf16_round(x)
  free = np.stack([R.premix(xb[b], p, pp, cfg)[1][1] for b in range(B)])
  agree = np.mean(free == ids)
  assert agree > 0.9, f"bf16 routing differs from float64 in {1 - agree:.0%} of the choices"
  forced = np.stack([R.premix(xb[b], p, pp, cfg, forced_ids=ids[b])[0] for b in range(B)])
  assert rel_err(np.asarray(y, np.float32), forced) < BF16_BOUND


def test_premix_expert_query_reaches_only_its_tokens():
  """Expert e's low-rank query weights change exactly the outputs of the tokens that routed to e
  (the oracle comparison checks that the mix of e's query goes to e; this checks locality)."""
  cfg = tiny_config("umoe")
  att, pool, x = _premix_case(cfg, 30)
  y0, routes = _att_call(att, pool, jnp.asarray(x))
  ids = np.asarray(routes["attention"].expert_ids)
  e = int(ids[0, 4, 1])                                # second choice of token 4 of sequence 0
  q_b = np.asarray(att.q_b[...]).copy()
  q_b[e] += 0.5
  att.q_b.set_value(jnp.asarray(q_b))
  y1, routes1 = _att_call(att, pool, jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(routes1["attention"].expert_ids), ids)
  changed = np.abs(np.asarray(y1 - y0)).max(-1) > 1e-6  # [B, T]
  uses_e = (ids == e).any(-1)
  # position 0 sees only itself: its attention weight is 1 whatever the query
  np.testing.assert_array_equal(changed[:, 1:], uses_e[:, 1:])
  assert not changed[:, 0].any()


@pytest.mark.parametrize("kind", ["mha", "premix"])
def test_attention_is_causal(kind):
  cfg = tiny_config("umoe" if kind == "premix" else "dense")
  if kind == "premix":
    att, pool, x = _premix_case(cfg, 40)
  else:
    att, pool = _mha(cfg, 40), None
    x = np.random.default_rng(41).standard_normal((B, T, cfg.d_model)).astype(np.float32)
  y0, _ = _att_call(att, pool, jnp.asarray(x))
  x2 = x.copy()
  x2[0, 6] += 1.0
  y1, _ = _att_call(att, pool, jnp.asarray(x2))
  d = np.abs(np.asarray(y1 - y0)).max(-1)
  assert np.all(d[0, :6] <= 1e-6), d[0]
  assert np.all(d[0, 6:] > 1e-4), d[0]
  assert np.all(d[1] == 0)


def test_premix_needs_a_pool():
  cfg = tiny_config("umoe")
  att, _, _ = _premix_case(cfg, 0)
  with pytest.raises(ValueError, match="expert pool"):
    att(jnp.zeros((1, 3, cfg.d_model)), positions_for(1, 3))


def test_premix_parameter_shapes():
  """One key head of d_k, a residual query, per-expert low-rank (W_a [E, D, r], W_b [E, r, d_k]),
  an RMSNorm of size r, a shared query head, and no value projection (values = hidden states)."""
  cfg = tiny_config("umoe")
  att = nnx.eval_shape(lambda: ATTENTIONS.get("premix")(cfg, rngs=nnx.Rngs(params=0)))
  d, dk, r, e = cfg.d_model, cfg.attention.head_dim, cfg.attention.q_lora_rank, cfg.moe.n_experts
  shapes = jax.tree.map(lambda a: tuple(a.shape), nnx.to_pure_dict(nnx.state(att, nnx.Param)))
  want = {
      "router": {"kernel": (d, e)},
      "k_proj": {"kernel": (d, dk)},
      "q_res_proj": {"kernel": (d, dk)},
      "q_a": (e, d, r),
      "q_a_norm": {"scale": (r,)},
      "q_b": (e, r, dk),
      "shared_q_proj": {"kernel": (d, dk)},
      "shared_expert": {"up": {"kernel": (d, cfg.moe.d_expert)},
                        "down": {"kernel": (cfg.moe.d_expert, d)}},
  }
  assert shapes == want
