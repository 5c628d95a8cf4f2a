"""The causal attention core every variant calls, `causal_attention`, and the cores it can run
(`model.attention.core`), one registry like the gmm backends':

  xla     the scores materialised in float32 (`xla_attention`); anywhere, and the only core that
          returns the probabilities or attends over a cache
  cudnn   cuDNN's fused causal kernel through `jax.nn.dot_product_attention` (`fused_attention`);
          pre-mixing's wide values in key-width chunks
  triton  the Triton kernel of one shared key head, pre-mixing's D-wide values in one pass
          (kernels/attention/triton_attention.py); other head layouts fall back to cudnn
  splash  the Pallas TPU splash kernel (attention/splash.py); never taken by auto
  auto    the best-ranked core of the default platform (`Registry.ranked`) that takes the shapes:
          on one GPU triton for values wider than the keys and cudnn otherwise, XLA on several
          GPUs (no measurement shows a fused core faster there) and off GPU

A core asked for by name runs where it can and hands the rest to its `fallback` (ending in xla).
The fused cores assume what the LM's own positions satisfy: they increase along the sequence and
are >= 0, so the visibility is causal; they run only when the queries attend to their own keys
(training, prefill) and nobody asks for the probabilities.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from umoe_jax.kinds import ATTENTION_BACKWARDS, ATTENTION_CORES
from umoe_jax.model.attention import splash
from umoe_jax.model.attention.local_shards import on_local_shards
from umoe_jax.ops import pallas_tpu
from umoe_jax.registry import Registry


@dataclasses.dataclass(frozen=True)
class AttentionCore:
  """attend: `(q [B,T,H,Dk], k [B,T,Hk,Dk], v [B,T,Hk,Dv], *, backward) -> [B,T,H,Dv]`, or None for
  shapes (or a machine) it does not take. platforms / auto_priority / available: `Registry.ranked`.
  single_device: auto takes it only for programs on one device. auto_takes(q, k, v): the shapes
  auto gives it (where it measured faster). fallback: the core that runs what it declines.
  may_refuse: in auto, an error building it (a GPU or driver it does not support) falls through to
  the next core instead of failing the step."""
  attend: Callable[..., Optional[jax.Array]]
  platforms: tuple[str, ...]
  auto_priority: int = 0
  available: Callable[[], bool] = lambda: True
  single_device: bool = False
  auto_takes: Callable[..., bool] = lambda q, k, v: True
  fallback: Optional[str] = None
  may_refuse: bool = False


CORES: Registry[AttentionCore] = Registry("attention core", names=ATTENTION_CORES)


@functools.cache
def _triton_kernel():
  """kernels.attention.triton_attention, or None without the kernels package (a library-only install)."""
  try:
    from kernels.attention import triton_attention as kernel
  except Exception:  # noqa: BLE001  (the caller falls back)
    return None
  return kernel


def triton_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, backward: str = "auto"):
  """Causal attention through the Triton kernel of one shared key head (kernels/attention/triton_attention.py:
  pre-mixing's D-wide values in one pass, no per-chunk cuDNN calls), or None where it cannot run
  (no GPU / Triton, float32, several key heads, S != T, head dim > 512: the caller takes cuDNN,
  which is faster than the Triton core for a key head per query head: 0.74 against 1.19 ms forward
  + backward at dense-base's 4 heads of 192, 2026-12-05-h200-fwd_bwd_ms-1df5865b). `backward`:
  `model.attention.core_backward` (kernels/attention/tiles.with_backward).

  Args: q [B, T, H, Dk], k [B, T, 1, Dk], v [B, T, 1, Dv]. Returns [B, T, H, Dv] or None.
  """
  kernel = _triton_kernel()
  if kernel is None or not kernel.supported(q, k, v):
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


def xla_attention(q, k, v, q_positions, k_positions, *, return_probs: bool = False):
  """softmax(q k^T / sqrt(Dk) + mask) v with the scores in float32: query t sees key s iff
  0 <= k_positions[s] <= q_positions[t]. Returns [B, T, H, Dv] (and probs [B, H, T, S] float32)."""
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


CORES.register("xla")(AttentionCore(attend=lambda q, k, v, backward: None,
                                    platforms=("cpu", "gpu", "tpu"), auto_priority=0))
# cuDNN's fused kernel: at MoA's shared key head (4 x 192 query heads) 0.77 ms forward + backward
# against the Triton core's 0.96 (2026-12-05-h200-fwd_bwd_ms-fb25e6a1), so auto gives it the
# layouts whose values are as wide as the keys.
CORES.register("cudnn")(AttentionCore(
    attend=lambda q, k, v, backward: (on_local_shards(fused_attention, q, k, v)
                                      if jax.default_backend() == "gpu" else None),
    platforms=("gpu",), auto_priority=10, single_device=True, fallback="xla", may_refuse=True))
# The Triton core for values wider than the keys (pre-mixing): UMoE-base 143.7 ms a step and 27.2 GB
# on an H200 against cuDNN's chunks' 143.7 ms and 31.6 GB (2026-12-05-h200-fwd_bwd_ms-b0730824).
CORES.register("triton")(AttentionCore(
    attend=lambda q, k, v, backward: on_local_shards(
        lambda q, k, v: triton_attention(q, k, v, backward=backward), q, k, v),
    platforms=("gpu",), auto_priority=20,
    available=lambda: _triton_kernel() is not None and _triton_kernel().available(),
    single_device=True, auto_takes=lambda q, k, v: v.shape[-1] > q.shape[-1], fallback="cudnn"))
CORES.register("splash")(AttentionCore(
    attend=lambda q, k, v, backward: (splash.splash_attention(q, k, v)
                                      if pallas_tpu.runs_here() else None),
    platforms=("tpu",), auto_priority=-1, fallback="xla"))


def _candidates(core: str, q, k, v) -> list[str]:
  """The cores to try, in order, before XLA: the named one and its fallbacks, or auto's ranking."""
  if core != "auto":
    names = []
    while core is not None and core != "xla":
      names.append(core)
      core = CORES.get(core).fallback
    return names
  several = jax.device_count() > 1
  return [n for n in CORES.ranked(jax.default_backend()) if n != "xla"
          and not (several and CORES.get(n).single_device) and CORES.get(n).auto_takes(q, k, v)]


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
    core: `model.attention.core`: "auto" takes the best-ranked fused core that takes the shapes (module docstring); "xla" materialises the float32 scores; "cudnn" runs cuDNN's fused
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
  if not return_probs and k_positions is q_positions:
    for name in _candidates(core, q, k, v):
      entry = CORES.get(name)
      try:
        out = entry.attend(q, k, v, backward=core_backward)
      except Exception:  # noqa: BLE001  (auto: a kernel this GPU refuses; the next core runs)
        if core != "auto" or not entry.may_refuse:
          raise
        out = None
      if out is not None:
        return out.astype(v.dtype)
  return xla_attention(q, k, v, q_positions, k_positions, return_probs=return_probs)
