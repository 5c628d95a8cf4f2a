"""CPU tests of the fused pre-mixing attention core (kernels/attention/triton_attention.py): launch geometry,
the core choice and its config validation, and the kernels themselves under the Triton interpreter
(TRITON_INTERPRET=1, in a subprocess), run through the real JAX entry (`premix_attention`, its
custom VJP) with every launch routed through `jax.pure_callback` into the interpreter. Values and
the gradients of q, k and x are compared with a float64 autodiff reference of the naive formula;
sequence lengths are not multiples of the tiles, head counts and widths not powers of two, D-chunks
of two pieces, a partial last chunk, the optional fused dX + dK pass, keys padded to a power of
two and keys in two exact pieces. The layer test runs the tiny UMoE pre-mixing attention (skewed
routing) with core="triton" against core="xla". GPU runs: tests/gpu/test_attention_gpu.py.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

from conftest import interpreter_loop_bounds, run_in_triton_interpreter
from kernels.attention import tiles as at
from kernels.attention import triton_attention as ta
from kernels.triton_base import split_width

CASES = [  # B, T, H, dk, D, (fwd, dx, dk, dq[, fused dxdk]) tiles as (bm, bn, bd)
    (2, 37, 3, 24, 80, ((16, 16, 48), (16, 16, 48), (16, 16, 32), (16, 16, 16))),
    (2, 37, 3, 24, 80, ((16, 16, 48), (16, 16, 48), (16, 16, 32), (16, 16, 16), (16, 16, 48))),
    (1, 50, 4, 32, 64, ((32, 16, 32), (32, 16, 64), (16, 32, 64), (32, 16, 64), (32, 16, 32))),
    (1, 21, 1, 16, 40, ((16, 32, 32), (16, 16, 24), (32, 16, 16), (16, 16, 32))),
    # values as wide as the keys (MoA's shared key / value head)
    (1, 40, 4, 32, 32, ((32, 16, 32), (32, 16, 32), (16, 32, 32), (32, 16, 32))),
]
# The stored-scores form (`FlashTiles.ds`, `dk_ds`, `dq_ds`, `dx_p`): B, T, H, dk, D, the four
# recomputing passes' tiles, dq_ds tiles, dx_p, ds tiles, dk_ds tiles: dS and P come from the pass
# over (row tile, key tile) pairs. The readers' key tiles differ from the pair pass's (wider and
# narrower), so they meet entries it left unwritten (NaN-poisoned) and must mask.
STORED_CASES = [
    (2, 33, 3, 24, 80, ((16, 16, 48), (16, 32, 48), (16, 16, 32), (16, 16, 16)), (16, 32, 16), True,
     (32, 16, 32), (16, 32, 16)),   # T = 2 * 16 + 1: a key tile of the last position alone
    (1, 50, 4, 32, 64, ((32, 16, 32), (32, 16, 64), (16, 32, 64), (32, 16, 64)), (32, 16, 16), True,
     (16, 32, 64), (32, 16, 16)),
    # A head over 256 wide (padded to 512) with the wide heads' stored tiles (`stored_tiles(512)`),
    # and the dX pass reading P on tiles of its own (`dx_read`, the 11th field)
    (1, 150, 2, 300, 96, ((16, 16, 32), (16, 16, 32), (16, 16, 32), (16, 16, 32)), (32, 64, 16), True,
     (64, 128, 64), (64, 32, 16), (32, 64, 64)),
    # H = 3 with many unmasked (full) row blocks in the dX and dK readers and key tiles in dQ's
    (1, 45, 3, 24, 80, ((16, 16, 48), (16, 16, 48), (32, 32, 32), (16, 16, 16)), (32, 16, 16), True,
     (16, 32, 32), (16, 16, 16)),
]


def test_launch_geometry_covers_every_row_key_and_column():
  for t, h, dk, d in ((1024, 4, 192, 768), (37, 3, 24, 80), (1024, 4, 512, 2048)):
    tiles = at.default_tiles(dk, d)
    f = at.fwd_launch(t, h, dk, d, tiles.fwd)
    assert f["N_ROW_TILES"] * f["BM"] >= t * h > (f["N_ROW_TILES"] - 1) * f["BM"]
    assert f["N_CHUNKS"] * (f["BD1"] + f["BD2"]) >= d > (f["N_CHUNKS"] - 1) * (f["BD1"] + f["BD2"])
    assert f["grid0"] == f["N_ROW_TILES"] * f["N_CHUNKS"] and f["DK1"] + f["DK2"] >= dk
    # 192 = 128 + 64 exactly; 24 = 16 + 8 (a piece under 16) and 512 stay one padded piece
    assert at.fwd_launch(t, h, dk, d, tiles.fwd)["DK2"] == (64 if dk == 192 else 0)
    x = at.dx_launch(t, h, dk, d, tiles.dx)
    assert x["grid0"] // x["N_CHUNKS"] * x["BN"] >= t
    assert at.dk_launch(t, h, dk, d, tiles.dk)["grid0"] * tiles.dk.bn >= t
    assert at.dq_launch(t, h, dk, d, tiles.dq)["grid0"] * tiles.dq.bm >= t * h
  with pytest.raises(ValueError):
    at.fwd_launch(64, 4, 64, 112, at.PassTiles(64, 64, 112))  # 112 = 64 + 48: no two-piece split
  with pytest.raises(ValueError, match="powers of two"):
    at.dk_launch(64, 4, 64, 112, at.PassTiles(64, 64, 48))    # the dO X^T step must be one piece
  with pytest.raises(ValueError, match="powers of two"):
    at.fwd_launch(64, 4, 64, 112, at.PassTiles(48, 64, 64))
  # tl.dot contracts >= 16 elements on the GPU (the interpreter does not check): a small head is
  # padded to 16 keys' width, and tiles with a contraction under 16 are refused up front.
  for launch in (at.fwd_launch, at.dx_launch, at.dk_launch, at.dq_launch):
    assert launch(37, 3, 8, 80, at.PassTiles(16, 16, 16))["DK1"] == 16
  with pytest.raises(ValueError, match=">= 16"):
    at.fwd_launch(64, 4, 64, 128, at.PassTiles(64, 8, 64))     # p V contracts over bn keys
  with pytest.raises(ValueError, match=">= 16"):
    at.dx_launch(64, 4, 64, 128, at.PassTiles(8, 64, 64))      # P^T dO contracts over bm rows
  with pytest.raises(ValueError, match=">= 16"):
    at.dq_launch(64, 4, 64, 128, at.PassTiles(64, 64, 8))      # dO X^T in bd-wide steps
  at.dx_launch(64, 4, 64, 80, at.PassTiles(16, 16, 24))        # dX: 16 + 8 columns are fine,
  with pytest.raises(ValueError, match=">= 16"):               # but the fused pass contracts them
    at.dx_launch(64, 4, 64, 80, at.PassTiles(16, 16, 24), fused_dk=True)


def test_stored_scores_tiles_round_trip_and_respect_the_memory_limit():
  """The stored-scores form's tiles (`ds`, `dk_ds`, `dq_ds`, `dx_p`) survive the tiles JSON, come
  all four or none, are refused beside the fused dxdk pass (which stores nothing), bad values name
  themselves, and the stores stop past STORED_BYTES_LIMIT (they grow with T^2)."""
  import dataclasses
  base = at.with_backward(at.default_tiles(192, 768), "recompute", 192)
  tiles = dataclasses.replace(base, dq_ds=at.PassTiles(64, 64, 16, 4, 2), dx_p=True,
                              ds=at.PassTiles(128, 64, 128, 8, 2), dk_ds=at.PassTiles(64, 64, 16))
  assert at.tiles_from_json(at.tiles_to_json(tiles)) == tiles
  assert at.tiles_from_json(at.tiles_to_json(base)) == base and "dx_p" not in at.tiles_to_json(base)
  with pytest.raises(ValueError, match="dxdk"):
    dataclasses.replace(tiles, dxdk=at.PassTiles(64, 32, 256, 4, 2))
  for missing in (dict(dk_ds=None), dict(dx_p=False), dict(dq_ds=None), dict(ds=None)):
    with pytest.raises(ValueError, match="comes with dk_ds, dq_ds and dx_p"):
      dataclasses.replace(tiles, **missing)
  assert at.ds_launch(1024, 4, 192, 768, tiles.ds)["grid0"] == 32 * 16
  assert at.dk_ds_launch(1024, 4, 192, tiles.dk_ds)["grid0"] == 16
  with pytest.raises(ValueError, match="dx_p='yes'"):
    at.tiles_from_json({**at.tiles_to_json(base), "dx_p": "yes"})
  with pytest.raises(ValueError, match="dq_s"):
    at.tiles_from_json({**at.tiles_to_json(base), "dq_s": [64, 64, 16, 4, 2]})
  with pytest.raises(ValueError, match="powers of two"):
    at.dq_ds_launch(1024, 4, 192, at.PassTiles(48, 64, 16))
  launch = at.dq_ds_launch(1024, 4, 192, at.PassTiles(64, 32, 7))   # bd is not used
  assert launch["grid0"] * 64 >= 4096 and (launch["DK1"], launch["DK2"]) == (128, 64)
  # UMoE-base's shape (B=32, T=1024, H=4, bf16): 2 x 268 MB, stored; 4x the length: not stored.
  assert ta.stores_scores(tiles, (32, 1024, 4, 192), 2)
  assert not ta.stores_scores(tiles, (32, 4096, 4, 192), 2)
  assert not ta.stores_scores(base, (32, 1024, 4, 192), 2)


def test_core_backward_forms():
  """`with_backward` sets exactly the fields each form reads, keeps tiles of the table's own, and
  names a bad form; the config key (`model.attention.core_backward`) takes the same names."""
  import dataclasses
  from umoe_jax import kinds
  assert kinds.ATTENTION_BACKWARDS == at.BACKWARDS
  # The default is the pair form at both widths (fastest on an H200), each with its own tiles.
  assert at.default_tiles(192, 768) == at.with_backward(at.default_tiles(192, 768), "stored_pairs", 192)
  assert at.default_tiles(512, 2048) == at.with_backward(at.default_tiles(512, 2048), "stored_pairs", 512)
  assert at.default_tiles(512, 2048).ds == at.WIDE_STORED_PAIRS_DS != at.default_tiles(192, 768).ds
  base = at.with_backward(at.default_tiles(192, 768), "recompute", 192)
  assert base.ds is None and at.with_backward(base, "auto", 192) == base
  pairs = at.with_backward(base, "stored_pairs", 192)
  assert (pairs.ds, pairs.dk_ds, pairs.dq_ds, pairs.dx_p) == (at.STORED_PAIRS_DS,
                                                              at.STORED_PAIRS_DK_DS,
                                                              at.STORED_DQ_DS, True)
  assert at.with_backward(pairs, "recompute", 192) == base and at.with_backward(pairs, "auto", 192) == pairs
  # Heads over 256 wide take their own stored tiles (half the readers' rows: dk-wide accumulators).
  wide = at.with_backward(at.default_tiles(512, 2048), "stored_pairs", 512)
  assert (wide.dq_ds, wide.ds, wide.dk_ds) == at.stored_tiles(512) != at.stored_tiles(256)
  assert wide.fwd == at.default_tiles(512, 2048).fwd and wide.dx_p
  # ... and a dX pass reading P on tiles of its own (the recomputing pass's stay for `recompute`).
  assert wide.dx_read == at.stored_dx_tiles(512) == at.WIDE_STORED_DX_READ != wide.dx
  assert wide.dx_tiles(reads_p=True) == wide.dx_read and wide.dx_tiles(reads_p=False) == wide.dx
  wide_recompute = at.with_backward(wide, "recompute", 512)
  assert wide_recompute.dx_read is None and wide_recompute.dx == wide.dx
  assert at.with_backward(wide_recompute, "stored_pairs", 512) == wide
  assert at.tiles_from_json(at.tiles_to_json(wide)) == wide
  assert at.stored_dx_tiles(192) is None and pairs.dx_read is None
  own = dataclasses.replace(pairs, dq_ds=at.PassTiles(128, 64, 16, 8, 2))
  assert at.with_backward(own, "stored_pairs", 192).dq_ds == own.dq_ds        # a swept tile is kept
  fused = dataclasses.replace(base, dxdk=at.PassTiles(64, 32, 256, 4, 2))
  assert at.with_backward(fused, "stored_pairs", 192).dxdk is None
  for bad in ("stash", "stored"):   # ("stored", the dK pass storing: removed, a config maps it)
    with pytest.raises(ValueError, match=f"'{bad}'"):
      at.with_backward(base, bad, 192)


def test_triton_core_declines_where_it_cannot_run():
  """Off GPU (this machine), in float32 or with several key heads the kernel is not used, and
  core="triton" gives the XLA values exactly; an unknown core is refused."""
  import jax.numpy as jnp
  from umoe_jax.model.attention.cores import causal_attention, triton_attention
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
             for s in ((2, 9, 3, 16), (2, 9, 1, 16), (2, 9, 1, 40)))
  pos = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
  assert not ta.available() and triton_attention(q, k, v) is None
  np.testing.assert_array_equal(np.asarray(causal_attention(q, k, v, pos, pos, core="triton"), np.float32),
                                np.asarray(causal_attention(q, k, v, pos, pos), np.float32))
  assert not ta.supported(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32))
  assert not ta.supported(q, jnp.zeros((2, 9, 3, 16), q.dtype), jnp.zeros((2, 9, 3, 40), q.dtype))
  assert not ta.supported(q, jnp.zeros((2, 11, 1, 16), q.dtype), jnp.zeros((2, 11, 1, 40), q.dtype))
  with pytest.raises(ValueError, match="premix_attention wants"):
    ta.premix_attention(q, k, v[:, :, 0])


def test_kernel_shape_limits():
  """The shapes the kernels take (whatever the machine): one key head of the queries' width, S == T,
  bf16 / fp16, dk <= 512, and T*H*D inside int32 (the kernels' in-sequence offsets)."""
  import jax
  import jax.numpy as jnp
  sds = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
  ok = lambda t, h, dk, d, **kw: ta.supported_shapes(sds(2, t, h, dk, **kw), sds(2, t, 1, dk, **kw),
                                                     sds(2, t, 1, d, **kw))
  assert ok(1024, 4, 192, 768) and ok(1024, 4, 512, 2048) and ok(37, 3, 8, 80)
  assert ok(1024, 4, 192, 768, dtype=jnp.float16) and not ok(1024, 4, 192, 768, dtype=jnp.float32)
  assert not ok(1024, 4, 576, 768)                         # a head wider than MAX_HEAD_DIM
  assert ok(2**17, 4, 128, 2**12 - 64) and not ok(2**17, 4, 128, 2**12)   # 2^31 offsets
  assert not ta.supported_shapes(sds(2, 9, 3, 16), sds(2, 9, 1, 32), sds(2, 9, 1, 40))


@pytest.mark.parametrize("key,good,bad", [("core", "triton", "Triton"),
                                          ("core_backward", "stored_pairs", "stored-pairs")])
def test_config_accepts_triton_core_and_names_a_bad_one(key, good, bad):
  from configs import common as configs
  from umoe_jax.config import ConfigError, model_config
  m = configs.model("umoe", "tiny")
  setattr(m.attention, key, good)
  assert getattr(model_config(m).attention, key) == good
  setattr(m.attention, key, bad)
  with pytest.raises(ConfigError, match=rf"model\.attention\.{key}='{bad}'.*{good}"):
    model_config(m)


# ----------------------------------------------------------------------------------------------
# Under the interpreter (a fresh process: TRITON_INTERPRET must be set before Triton is imported).


LAUNCHES = []       # the kernels launched, in order
LAUNCH_FLAGS = []   # their LOAD_P meta-parameter, where given
LAUNCH_META = []    # their meta-parameters and warps (the tiles each ran on)


# The Triton interpreter keeps the running grid in module state: launches from several device
# threads at once (a shard_map over virtual CPU devices) must take turns.
_INTERPRETER_LOCK = threading.Lock()


def _interpreter_launch(kernel, grid, args, out_shape, num_warps=None, num_stages=None, **meta):
  """`triton_attention._launch` through the interpreter: outputs poisoned with NaN first."""
  import jax
  from test_kernels import _NpTensor
  outs = list(out_shape) if isinstance(out_shape, (list, tuple)) else [out_shape]

  def host(*arrays):
    ins = [_NpTensor(np.asarray(a)) for a in arrays]
    res = [_NpTensor(np.full(o.shape, np.nan, o.dtype)) for o in outs]
    with _INTERPRETER_LOCK:
      kernel[grid](*ins, *res, **meta)
    return tuple(r.arr for r in res)

  LAUNCHES.append(kernel)
  LAUNCH_FLAGS.append({k: meta[k] for k in ("LOAD_P",) if k in meta})
  LAUNCH_META.append(dict(meta, num_warps=num_warps))
  got = jax.pure_callback(host, tuple(outs), *args)
  return list(got) if isinstance(out_shape, (list, tuple)) else got[0]


def _reference(q, k, v):
  """float64, the naive formula (materialised scores, mask, softmax)."""
  import jax
  import jax.numpy as jnp
  t, dk = q.shape[1], q.shape[-1]
  s = jnp.einsum("bthd,bsd->bhts", q, k) / np.sqrt(dk)
  s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
  return jnp.einsum("bhts,bsd->bthd", jax.nn.softmax(s, axis=-1), v)


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _interpreter_check():
  import jax
  jax.config.update("jax_enable_x64", True)
  import jax.numpy as jnp
  interpreter_loop_bounds()
  ta._launch = _interpreter_launch

  cases = [(*c, None, False, None, None) for c in CASES] + STORED_CASES
  opt = lambda x: None if x is None else at.PassTiles(*x)
  # The cases' heads are padded to a power of two (24, 300: not two powers of two >= 16 each); every
  # pass again on heads of two exact pieces (48 = 32 + 16, 320 = 256 + 64): the recomputing
  # passes, the fused dX + dK pass, the stored form, the wide head.
  split_dk = {24: 48, 32: 48, 16: 48, 300: 320}
  split_cases = [(*c[:3], split_dk[c[3]], *c[4:]) for c in (cases[0], cases[1], cases[2], cases[5],
                                                            cases[7])]
  for b, t, h, dk, d, tiles, dq_ds, dx_p, ds, dk_ds, *dx_read in cases + split_cases:
    split = dk in (48, 320)
    rng = np.random.default_rng(t * h)
    q, k, v = (rng.standard_normal(s) for s in ((b, t, h, dk), (b, t, dk), (b, t, d)))
    cot = rng.standard_normal((b, t, h, d))
    dx_read = opt(dx_read[0]) if dx_read else None
    flash = at.FlashTiles(*(at.PassTiles(*x) for x in tiles), dx_p=dx_p, dq_ds=opt(dq_ds),
                          ds=opt(ds), dk_ds=opt(dk_ds), dx_read=dx_read)
    f32 = [jnp.asarray(a, jnp.float32) for a in (q, k, v)]
    got = jax.jit(lambda *a: ta.premix_attention(*a, tiles=flash))(*f32)
    want = _reference(*map(jnp.asarray, (q, k, v)))
    case = (f"B={b} T={t} H={h} dk={dk} D={d} fused dxdk={len(tiles) > 4} dq_ds={dq_ds} "
            f"dx_p={dx_p} ds={ds} split={split}")
    n_launch = len(LAUNCHES)
    assert got.shape == (b, t, h, d) and got.dtype == jnp.float32, case
    assert np.isfinite(np.asarray(got)).all(), case
    assert _rel(got, want) < 1e-5, (case, _rel(got, want))
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(ta.premix_attention(*a, tiles=flash) * cot),
                             argnums=(0, 1, 2)))(*f32)
    want_g = jax.grad(lambda *a: jnp.sum(_reference(*a) * cot), argnums=(0, 1, 2))(
        *map(jnp.asarray, (q, k, v)))
    for name, g, w in zip(("dq", "dk", "dx"), grads, want_g):
      assert np.isfinite(np.asarray(g)).all(), (case, name)
      assert _rel(g, w) < 1e-5, (case, name, _rel(g, w))
    kernels = {kn.fn.__name__ if hasattr(kn, "fn") else str(kn) for kn in LAUNCHES[n_launch:]}
    assert ("_bwd_dq_ds_kernel" in kernels) == (dq_ds is not None), (case, kernels)
    assert ("_bwd_dq_kernel" in kernels) == (dq_ds is None), (case, kernels)
    assert ("_bwd_dk_kernel" in kernels) == (len(tiles) == 4 and ds is None), (case, kernels)
    assert ("_bwd_ds_kernel" in kernels) == ("_bwd_dk_ds_kernel" in kernels) == (ds is not None)
    flags = {kn.fn.__name__: f for kn, f in zip(LAUNCHES[n_launch:], LAUNCH_FLAGS[n_launch:])}
    if "_bwd_dx_kernel" in flags:  # (not with the fused dxdk pass)
      assert flags["_bwd_dx_kernel"]["LOAD_P"] == dx_p, (case, flags)  # P read, not recomputed
      meta = next(m for kn, m in zip(LAUNCHES[n_launch:], LAUNCH_META[n_launch:])
                  if kn.fn.__name__ == "_bwd_dx_kernel")
      want_tiles = flash.dx_tiles(reads_p=dx_p)
      assert (meta["BM"], meta["BN"], meta["num_warps"]) == (
          want_tiles.bm, want_tiles.bn, want_tiles.num_warps), (case, meta, want_tiles)
    pieces = {(m["DK1"], m["DK2"]) for m in LAUNCH_META[n_launch:] if "DK1" in m}
    assert pieces == ({split_width(dk)} if split else {(at.key_width(dk), 0)}), (case, pieces)

  # Past STORED_BYTES_LIMIT the stored form recomputes (same values, the three recompute passes).
  limit, ta.STORED_BYTES_LIMIT = ta.STORED_BYTES_LIMIT, 0
  b, t, h, dk, d, tiles, dq_ds, dx_p, ds, dk_ds = STORED_CASES[0][:10]
  flash = at.FlashTiles(*(at.PassTiles(*x) for x in tiles), dx_p=dx_p, dq_ds=opt(dq_ds),
                        ds=opt(ds), dk_ds=opt(dk_ds))
  rng = np.random.default_rng(1)
  q, k, v = (rng.standard_normal(s) for s in ((b, t, h, dk), (b, t, dk), (b, t, d)))
  cot = rng.standard_normal((b, t, h, d))
  n_launch = len(LAUNCHES)
  grads = jax.jit(jax.grad(lambda *a: jnp.sum(ta.premix_attention(*a, tiles=flash) * cot),
                           argnums=(0, 1, 2)))(*[jnp.asarray(a, jnp.float32) for a in (q, k, v)])
  want_g = jax.grad(lambda *a: jnp.sum(_reference(*a) * cot), argnums=(0, 1, 2))(
      *map(jnp.asarray, (q, k, v)))
  for name, g, w in zip(("dq", "dk", "dx"), grads, want_g):
    assert _rel(g, w) < 1e-5, ("over the limit", name, _rel(g, w))
  names = [kn.fn.__name__ for kn in LAUNCHES[n_launch:]]
  assert sorted(names) == sorted(["_fwd_kernel", "_bwd_dq_kernel", "_bwd_dk_kernel",
                                  "_bwd_dx_kernel"]), names
  assert not any(any(f.values()) for f in LAUNCH_FLAGS[n_launch:]), LAUNCH_FLAGS[n_launch:]
  ta.STORED_BYTES_LIMIT = limit

  # As many key heads as query heads (MHA, SwitchHead): the Triton core declines them, and
  # core="triton" runs cuDNN's (here, off GPU, XLA's) core, launching no kernel.
  from umoe_jax.model.attention import cores as att_common
  ta.available, ta.DTYPES = (lambda: True), (jnp.float32,)
  b, t, h, dk, dv = 2, 37, 3, 24, 40
  rng = np.random.default_rng(7)
  q, k, v = (rng.standard_normal(s) for s in ((b, t, h, dk), (b, t, h, dk), (b, t, h, dv)))

  def mha_reference(q, k, v):  # float64, every head over its own key head
    s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(dk)
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)

  f32 = [jnp.asarray(a, jnp.float32) for a in (q, k, v)]
  assert att_common.triton_attention(*f32) is None
  want = mha_reference(*map(jnp.asarray, (q, k, v)))
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  n_launch = len(LAUNCHES)
  out = jax.jit(lambda *a: att_common.causal_attention(*a, pos, pos, core="triton"))(*f32)
  assert len(LAUNCHES) == n_launch and _rel(out, want) < 1e-5, ("mha", _rel(out, want))

  # The layer: tiny UMoE pre-mixing attention with skewed routing (nearly every token's slots on
  # experts 0-2), core="triton" (the kernel, via the interpreter) against core="xla".
  from flax import nnx
  from configs import common as configs
  from umoe_jax.config import model_config
  from umoe_jax.model.block import DecoderBlock
  jax.config.update("jax_enable_x64", False)
  ta.available = lambda: True
  ta.DTYPES = (jnp.float32,)
  m = configs.model("umoe", "tiny")
  m.compute_dtype = "float32"
  bt = (2, 19)
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.standard_normal((*bt, m.d_model)) + 2.0, jnp.float32)  # a shared direction
  pos = jnp.broadcast_to(jnp.arange(bt[1], dtype=jnp.int32), bt)
  outs = {}
  for core, backward in (("xla", "auto"), ("triton", "auto"), ("triton", "recompute"),
                         ("triton", "stored_pairs")):
    m.attention.core, m.attention.core_backward = core, backward
    block = DecoderBlock(model_config(m), rngs=nnx.Rngs(params=0))
    for p in jax.tree.leaves(nnx.state(block.attention.router, nnx.Param),
                             is_leaf=lambda v: isinstance(v, nnx.Variable)):
      if p.value.shape == (m.d_model, m.moe.n_experts):  # the router's projection: favour 0-2
        p.value = p.value.at[:, :3].add(jnp.abs(p.value).max())
    graphdef, state = nnx.split(block)

    def loss(state, x):
      blk = nnx.merge(graphdef, state)
      y, routes = blk.attention(blk.attention_norm(x), pos, experts=blk.experts)
      return jnp.sum(y * jnp.cos(jnp.arange(y.size).reshape(y.shape))), routes["attention"]
    n = len(LAUNCHES)
    (val, route), (g_state, g_x) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        state, x)
    # fwd + the backward passes: dx, dk, dq / ds, dk_ds, dq_ds, dx
    launched = {kn.fn.__name__ for kn in LAUNCHES[n:]}
    pairs = {"_fwd_kernel", "_bwd_ds_kernel", "_bwd_dk_ds_kernel", "_bwd_dq_ds_kernel", "_bwd_dx_kernel"}
    want_launches = {"xla": set(), "auto": pairs,  # (the default tiles' form for heads <= 256)
                     "recompute": {"_fwd_kernel", "_bwd_dx_kernel", "_bwd_dk_kernel", "_bwd_dq_kernel"},
                     "stored_pairs": pairs}
    assert launched == want_launches["xla" if core == "xla" else backward], (core, backward, launched)
    assert float(jnp.mean(route.expert_ids < 3)) > 0.9, np.asarray(route.expert_ids)  # skewed
    outs[core, backward] = (val, g_x, jax.tree.leaves(g_state))
  v0, gx0, gs0 = outs["xla", "auto"]
  for key in [k for k in outs if k[0] == "triton"]:
    v1, gx1, gs1 = outs[key]
    assert abs(float(v1) - float(v0)) <= 1e-4 * abs(float(v0)) + 1e-4, (key, v0, v1)
    assert _rel(gx1, gx0) < 1e-4, (key, _rel(gx1, gx0))
    for a, w in zip(gs1, gs0):
      if np.linalg.norm(np.asarray(w)) > 0:
        assert _rel(a, w) < 1e-4, (key, _rel(a, w))
      else:  # e.g. experts no token reached: no gradient through the kernel either
        assert not np.any(np.asarray(a)), (key, np.abs(np.asarray(a)).max())
  print("TRITON_ATTENTION_INTERPRETER_OK")


@pytest.mark.extras("triton")
def test_kernels_in_interpreter_match_float64():
  run_in_triton_interpreter("test_triton_attention", "_interpreter_check",
                            "TRITON_ATTENTION_INTERPRETER_OK", timeout=400)
