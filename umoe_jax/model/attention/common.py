"""Pieces every attention variant uses: the registry and causal softmax attention."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from umoe_jax.kinds import ATTENTION_BACKWARDS, ATTENTION_CORES, ATTENTIONS  # noqa: F401  (registry, names)


# Routed low-rank expert projection (pre-mixing queries, post-mixing keys):
#   p_i(x) = x W_res + RMSNorm_r(x W_a^i) W_b^i,  or  x W^i  without a rank (W^i stored as W_b^i).


def low_rank_expert_params(cfg, *, rngs, linear_kw: dict):
  """(res_proj, a [E,D,r], a_norm, b [E,r,Dk]) for `attention.q_lora_rank` = r; without a rank
  (None): (None, None, None, b [E,D,Dk]). Created in this order, so RNG draws are stable."""
  from umoe_jax.model.layers import Linear, RMSNorm, make_param, normal_init
  from umoe_jax.parallel import rules as ax
  att, e, d, dk = cfg.attention, cfg.moe.n_experts, cfg.d_model, cfg.attention.head_dim
  init = normal_init(cfg.init_std)
  if att.q_lora_rank is None:
    return None, None, None, make_param(rngs, init, (e, d, dk), (ax.EXPERT, ax.EMBED, ax.HEAD_DIM),
                                        cfg.param_dtype)
  r = att.q_lora_rank
  res = Linear(d, dk, (ax.EMBED, ax.HEAD_DIM), **linear_kw)
  a = make_param(rngs, init, (e, d, r), (ax.EXPERT, ax.EMBED, ax.LORA), cfg.param_dtype)
  a_norm = (RMSNorm(r, eps=cfg.norm_eps, param_dtype=cfg.param_dtype, rngs=rngs)
            if att.q_lora_norm else None)
  b = make_param(rngs, init, (e, r, dk), (ax.EXPERT, ax.LORA, ax.HEAD_DIM), cfg.param_dtype)
  return res, a, a_norm, b


def low_rank_expert_apply(rows, group_sizes, a, a_norm, b, *, dtype, backend: str, plan=None,
                          slots: int = 1):
  """rows [M, D] sorted by expert -> [M, Dk] (without the residual projection).

  With `plan` (from `make_plan(ids [N, K])`), `rows` are the token rows [N, D] themselves and
  `slots` = K: the first matmul reads them through the plan (`fused_dispatch.gather_gmm`), so the
  sorted [M, D] copy is never written.
  """
  from umoe_jax.ops.fused_dispatch import gather_gmm
  from umoe_jax.ops.gmm import gmm

  def first(w):
    if plan is not None:
      return gather_gmm(rows, w.value.astype(dtype), plan, slots, backend=backend)
    return gmm(rows, w.value.astype(dtype), group_sizes, backend=backend)

  if a is None:
    return first(b)                                                                  # [M, Dk]
  code = first(a)                                                                    # [M, r]
  if a_norm is not None:
    code = a_norm(code)
  return gmm(code, b.value.astype(dtype), group_sizes, backend=backend)             # [M, Dk]


def triton_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, backward: str = "auto"):
  """Causal attention through the Triton kernel of one shared key head (kernels/triton_attention.py:
  pre-mixing's D-wide values in one pass, no per-chunk cuDNN calls), or None where it cannot run
  (no GPU / Triton, float32, several key heads, S != T, head dim > 512: the caller takes cuDNN,
  which is faster than the Triton core for a key head per query head: 0.74 against 1.19 ms forward
  + backward at dense-base's 4 heads of 192, 2026-12-05-h200-fwd_bwd_ms-1df5865b). `backward`:
  `model.attention.core_backward` (kernels/attention_tiles.with_backward).

  Args: q [B, T, H, Dk], k [B, T, 1, Dk], v [B, T, 1, Dv]. Returns [B, T, H, Dv] or None.
  """
  try:
    from kernels import triton_attention as kernel
  except Exception:  # noqa: BLE001  (no kernels package on the path: the caller falls back)
    return None
  if not kernel.supported(q, k, v):
    return None
  return kernel.premix_attention(q, k[:, :, 0], v[:, :, 0], backward=backward)


def fused_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, implementation: str = "cudnn"):
  """Causal softmax(q k^T / sqrt(Dk)) v (query t sees keys s <= t, S == T) through
  `jax.nn.dot_product_attention`, or None when its fused kernels cannot take these shapes.

  Values wider than the key (pre-mixing: Dv = D) with one key head are cut into Dv / Dk chunks of
  Dk columns that share the key: query head (chunk c, head h) of a grouped-query layout reads kv
  head c, and the chunks are put back together after. The scores are recomputed per chunk (Dk / Dv
  more FLOPs), which the fused kernel still beats materialising [B, H, T, S] float32 scores.
  (A general visibility mask is not passed: cuDNN then reads a [B, 1, T, S] bias and skips no
  masked tiles, which measures slower than the XLA form.)

  Args:
    q [B, T, H, Dk], k [B, T, Hk, Dk], v [B, T, Hk, Dv].
    implementation: "cudnn" (GPU) or "xla" (the same layout through XLA: tests on CPU).
  Returns:
    [B, T, H, Dv] in q's dtype, or None.
  """
  b, t, h, dk = q.shape
  hk, dv = k.shape[2], v.shape[-1]
  if implementation == "cudnn" and (q.dtype not in (jnp.bfloat16, jnp.float16) or dk > 256 or dk % 8):
    return None  # cuDNN's flash kernels: half-precision operands, head size a multiple of 8 up to 256
  attend = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                        implementation=implementation)
  if k.shape[1] != t:
    return None
  if dv == dk:
    return attend(q, k, v)
  if hk != 1 or dv % dk:
    return None
  c = dv // dk
  vv = v[:, :, 0].reshape(b, t, c, dk)
  kk = jnp.broadcast_to(k, (b, t, c, dk))
  qq = jnp.broadcast_to(q[:, :, None], (b, t, c, h, dk)).reshape(b, t, c * h, dk)
  out = attend(qq, kk, vv)                                                       # [B, T, C*H, Dk]
  return out.reshape(b, t, c, h, dk).transpose(0, 1, 3, 2, 4).reshape(b, t, h, dv)


# The fused core "auto" takes on one GPU for values wider than the keys (pre-mixing): on an H200
# "triton" takes UMoE-base 143.7 ms a step and 27.2 GB, "cudnn" 143.7 ms and 31.6 GB (the same
# time, less memory). Values as wide as the keys (MHA, MoA, SwitchHead) take cuDNN's own kernel:
# at MoA's shared key head (4 x 192 query heads) it takes 0.77 ms forward + backward against the
# Triton core's 0.96 (2026-12-05-h200-fwd_bwd_ms-fb25e6a1, 2026-12-05-h200-fwd_bwd_ms-b0730824).
AUTO_GPU_WIDE_VALUE_CORE = "triton"
# Whether "auto" takes those fused cores on several GPUs too (each device's own rows,
# `on_local_shards`). Off: `auto` takes a fused core only where a measurement shows it faster,
# and none covers several GPUs.
AUTO_FUSED_ON_SEVERAL_GPUS = False


def auto_core(head_dim: int, value_dim: int) -> str:
  """What `core="auto"` (the default) runs for keys of head_dim and values of value_dim: on one
  GPU AUTO_GPU_WIDE_VALUE_CORE when value_dim > head_dim, else "cudnn"; "xla" on several GPUs
  (unless AUTO_FUSED_ON_SEVERAL_GPUS) and off GPU (TPU: "splash" runs when asked for by name). On
  several GPUs the fused cores run when asked for by name ("triton", "cudnn": each device's own
  rows, `on_local_shards`)."""
  if jax.default_backend() == "gpu" and (jax.device_count() == 1 or AUTO_FUSED_ON_SEVERAL_GPUS):
    return AUTO_GPU_WIDE_VALUE_CORE if value_dim > head_dim else "cudnn"
  return "xla"


def on_local_shards(attend, q: jax.Array, k: jax.Array, v: jax.Array):
  """attend(q, k, v) on each device's own rows while a mesh of several devices is active
  (`parallel.use_mesh`), else on the arrays as they are: how the fused cores run on the data-,
  FSDP- and expert-parallel layouts (XLA does not partition the Triton and splash kernels' custom
  calls; jax partitions cuDNN's by batch and heads itself, and this gives it the same layout).

  The batch is split as the activations are (BATCH's mesh axes) and the query heads over HEADS'
  axes where they divide them (a shared key head, Hk = 1, stays whole on every head shard); the
  sequence and the widths stay whole, since a causal core needs every earlier key. A mesh axis that
  divides neither is replicated: its devices repeat the same work, and the backward sums the
  input gradients over it.

  Args:
    attend: (q, k, v) -> [B, T, H, Dv], or None where it cannot take the (local) shapes.
    q [B, T, H, Dk], k [B, T, Hk, Dk], v [B, T, Hk, Dv] with Hk == H or Hk == 1.
  Returns:
    attend's [B, T, H, Dv] (sharded like q), or None where attend declines the local shapes.
  """
  from jax.sharding import PartitionSpec as P
  from umoe_jax.parallel import rules as ax
  from umoe_jax.parallel import sharding
  ctx = sharding.current_context()
  if ctx is None or ctx.mesh.size == 1:
    return attend(q, k, v)
  mesh = ctx.mesh
  q_spec = sharding.spec_for_shape((ax.BATCH, None, ax.HEADS, None), q.shape, mesh, ctx.rules)
  kv_spec = P(q_spec[0], None, q_spec[2] if k.shape[2] == q.shape[2] else None, None)

  def shards(entry) -> int:  # devices one dimension is split over
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return math.prod(mesh.shape[a] for a in axes)

  def local(x, spec):  # the part of x one device holds
    return jax.ShapeDtypeStruct(tuple(d // shards(e) for d, e in zip(x.shape, spec)), x.dtype)

  if jax.eval_shape(attend, local(q, q_spec), local(k, kv_spec), local(v, kv_spec)) is None:
    return None
  # check_vma=False is required, not a convenience: the kernels' VJPs type dK / dV like k and v,
  # which do not vary over the head axes, so with the check on, shard_map would not sum a shared key
  # head's gradient over the head shards. With it off, the transpose sums every input's cotangent
  # over the mesh axes its spec leaves out.
  return sharding.shard_map(attend, mesh, (q_spec, kv_spec, kv_spec), q_spec, check_vma=False)(q, k, v)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array,
                     k_positions: jax.Array, *, return_probs: bool = False, core: str = "xla",
                     core_backward: str = "auto"):
  """softmax(q k^T / sqrt(Dk) + causal mask) v, softmax in float32.

  Args:
    q: [B, T, H, Dk].
    k: [B, S, Hk, Dk] with Hk == H or Hk == 1 (one key head shared by all query heads).
    v: [B, S, Hk, Dv] (Dv may differ from Dk: pre-mixing mixes whole hidden states).
    q_positions: [B, T], k_positions: [B, S]; query t sees key s iff 0 <= k_pos[s] <= q_pos[t]
      (a negative key position marks padding, an empty cache slot, or a key that is no entry:
      post-mixing's slots without a pick).
    return_probs: also return the attention probabilities [B, H, T, S] float32 (for routers that
      read them, `router.kind='attention_aware'`).
    core: `model.attention.core`: "auto" = `auto_core(Dk, Dv)`; "xla" materialises the float32 scores; "cudnn" runs cuDNN's fused
      causal kernel (`fused_attention`) on GPU when the queries attend to their own keys
      (`k_positions is q_positions`: no cache) and nobody asks for the probabilities, and the XLA
      form elsewhere (CPU, TPU, decoding, other shapes). "triton" runs the Triton kernel of one
      shared key head (`triton_attention`) in those cases, and "cudnn"'s choice for the shapes it
      does not take (several key heads, float32). "splash" runs the Pallas TPU splash kernel
      (`attention.splash`) under the same conditions on TPU (multi-head and one-key-head shapes,
      pre-mixing included), XLA elsewhere. The fused cores assume what the LM's own positions
      satisfy: they increase along the sequence and are >= 0, so the visibility below is causal.
    core_backward: `model.attention.core_backward`, the "triton" kernel's backward form.
  Returns:
    [B, T, H, Dv] in v's dtype (and the probabilities with `return_probs`).
  """
  if k.shape[2] not in (1, q.shape[2]):
    raise ValueError(f"key heads {k.shape[2]} must be 1 or equal query heads {q.shape[2]}")
  if core not in ATTENTION_CORES:
    raise ValueError(f"attention core {core!r}; valid: {', '.join(ATTENTION_CORES)}")
  if core_backward not in ATTENTION_BACKWARDS:
    raise ValueError(f"attention core backward {core_backward!r}; valid: "
                     f"{', '.join(ATTENTION_BACKWARDS)}")
  auto = core == "auto"
  core = auto_core(q.shape[-1], v.shape[-1]) if auto else core
  if core in ("cudnn", "triton") and not return_probs and k_positions is q_positions:
    out = None
    if core == "triton":
      out = on_local_shards(lambda q, k, v: triton_attention(q, k, v, backward=core_backward),
                            q, k, v)
    if out is None and jax.default_backend() == "gpu":
      try:
        out = on_local_shards(fused_attention, q, k, v)
      except Exception:  # noqa: BLE001  (a GPU or cuDNN the fused kernel refuses: "auto" takes XLA)
        if not auto:
          raise
    if out is not None:
      return out.astype(v.dtype)
  if core == "splash" and not return_probs and k_positions is q_positions:
    from umoe_jax.model.attention import splash  # Pallas TPU: on TPU or in its interpreter only
    from umoe_jax.ops import pallas_tpu
    out = splash.splash_attention(q, k, v) if pallas_tpu.runs_here() else None
    if out is not None:
      return out.astype(v.dtype)
  scale = 1.0 / math.sqrt(q.shape[-1])
  if k.shape[2] == 1:
    scores = jnp.einsum("bthd,bsd->bhts", q, k[:, :, 0], preferred_element_type=jnp.float32)
  else:
    scores = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32)
  scores = scores * scale
  k_pos = k_positions[:, None, None, :]
  visible = (k_pos >= 0) & (k_pos <= q_positions[:, None, :, None])              # [B, 1, T, S]
  scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
  probs32 = jax.nn.softmax(scores, axis=-1)                                      # [B, H, T, S]
  probs = probs32.astype(v.dtype)
  if v.shape[2] == 1:
    out = jnp.einsum("bhts,bsd->bthd", probs, v[:, :, 0])
  else:
    out = jnp.einsum("bhts,bshd->bthd", probs, v)
  return (out, probs32) if return_probs else out
