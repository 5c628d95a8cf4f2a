"""GPU checks of every kernel backend of `umoe_jax.ops.gmm` against a float32 reference.

Skipped without a GPU. On a GPU the tests run for every backend this machine must have
(`gpu_backends.expected_backends()`: triton, and mosaic on Hopper; `UMOE_GPU_BACKENDS` overrides),
and a test of a backend that is missing fails naming it and why. Every check draws random bf16 inputs
(never zeros) from seeds fixed by the test's name and case, so a failure reproduces in a new process
and under `-k`; poisons nothing it does not overwrite, and compares with ||out - ref|| / ||ref|| < 1e-2
(plus exact zeros in padding rows).
"""
from __future__ import annotations

import dataclasses
import zlib

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import gpu_backends
import gpu_tiers
from umoe_jax.ops import gmm as G

G.register_builtin_kernels()

pytestmark = pytest.mark.skipif(not gpu_backends.on_gpu(), reason="needs a GPU")

# Without a GPU every backend is listed, so that the tests collect (and skip, saying why).
QUICK = pytest.mark.gpu_quick   # the quick tier: `pytest -m gpu_quick tests/gpu`

BACKENDS = (gpu_backends.expected_backends() if gpu_backends.on_gpu()
            else list(gpu_backends.KERNEL_BACKENDS))


def _require(backend):
  """The backend's raw ops; fails the test (naming the backend and the cause) if it is missing."""
  reason = gpu_backends.missing_reason(backend)
  if reason:
    pytest.fail(f"kernel backend {backend!r} is expected on this machine but missing: {reason} "
                f"(UMOE_GPU_BACKENDS={','.join(gpu_backends.expected_backends())!r})")
  return G.BACKENDS.get(backend)


def _seed(*tag) -> int:
  """A seed fixed by `tag` (a test's name and case): the same in every process (unlike hash())."""
  return zlib.crc32(repr(tag).encode())


def _key(*tag):
  return jax.random.key(_seed(*tag))


def _ref_gmm(x, w, gs, transpose_rhs=False):
  x = np.asarray(x, np.float32); w = np.asarray(w, np.float32); gs = np.asarray(gs)
  out_dim = w.shape[1] if transpose_rhs else w.shape[2]
  out = np.zeros((x.shape[0], out_dim), np.float32)
  s = 0
  for g, n in enumerate(gs):
    wg = w[g].T if transpose_rhs else w[g]
    out[s:s + n] = x[s:s + n] @ wg
    s += n
  return out


def _ref_tgmm(a, b, gs):
  a = np.asarray(a, np.float32); b = np.asarray(b, np.float32)
  out = np.zeros((len(gs), a.shape[1], b.shape[1]), np.float32)
  s = 0
  for g, n in enumerate(np.asarray(gs)):
    out[g] = a[s:s + n].T @ b[s:s + n]
    s += n
  return out


def _rel(out, ref):
  out = np.asarray(out, np.float32)
  assert np.all(np.isfinite(out)), "non-finite output"
  den = np.linalg.norm(ref)
  return np.linalg.norm(out - ref) / (den if den > 0 else 1.0)


def _inputs(m, k, n, gs, tag):
  k1, k2, k3 = jax.random.split(_key(*tag), 3)
  x = jax.random.normal(k1, (m, k), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(k2, (len(gs), k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
  dy = jax.random.normal(k3, (m, n), jnp.float32).astype(jnp.bfloat16)
  return x, w, dy, jnp.asarray(np.asarray(gs, np.int32))


def _random_sizes(rng, m_used, g, empty=0):
  p = rng.dirichlet(np.ones(g) * 2.0)
  gs = np.floor(p * m_used).astype(np.int64)
  if empty:
    gs[rng.choice(g, empty, replace=False)] = 0
  gs[int(np.argmax(gs))] += m_used - gs.sum()
  return gs.astype(np.int32)


CASES = {
    # name: (M, K, N, group_sizes)
    "aligned": (512, 128, 256, [128, 128, 128, 128]),
    "ragged": (1000, 192, 192, "rand:1000:8"),
    "empty_groups": (700, 256, 128, [0, 300, 0, 0, 5, 395, 0, 0]),
    "tiny_groups": (97, 64, 64, [1, 2, 3, 0, 7, 84]),
    "padding_rows": (1024, 128, 192, "rand:700:6"),   # rows 700.. are padding -> zeros
    "m_not_tile_multiple": (1337, 256, 512, "rand:1337:5"),
    "skewed_90pct": (4096, 256, 768, "skew:4096:16"),
    "base_like": (8192, 768, 192, "rand:8192:128"),
    "down_like": (8192, 192, 768, "rand:8000:128"),
}


def _sizes(spec, rng):
  if not isinstance(spec, str):
    return np.asarray(spec, np.int32)
  kind, used, g = spec.split(":")
  used, g = int(used), int(g)
  if kind == "rand":
    return _random_sizes(rng, used, g, empty=g // 8)
  gs = np.full(g, (used // 10) // (g - 1), np.int64)  # 90% of rows to expert 3
  gs[3] = 0
  gs[3] = used - gs.sum()
  return gs.astype(np.int32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", [pytest.param(c, marks=QUICK) if c == "ragged" else c
                                  for c in sorted(CASES)])
def test_raw_ops(backend, case):
  be = _require(backend)
  m, k, n, spec = CASES[case]
  gs = _sizes(spec, np.random.default_rng(_seed("sizes", case)))
  x, w, dy, gsj = _inputs(m, k, n, gs, ("raw_ops", case))
  used = int(gs.sum())

  out = jax.jit(lambda a, b, c: be.gmm(a, b, c, transpose_rhs=False, out_dtype=jnp.bfloat16))(x, w, gsj)
  ref = _ref_gmm(x, w, gs)
  assert _rel(out, ref) < 1e-2
  assert np.all(np.asarray(out[used:], np.float32) == 0), "padding rows must be zero"

  dx = jax.jit(lambda a, b, c: be.gmm(a, b, c, transpose_rhs=True, out_dtype=jnp.bfloat16))(dy, w, gsj)
  assert _rel(dx, _ref_gmm(dy, w, gs, transpose_rhs=True)) < 1e-2
  assert np.all(np.asarray(dx[used:], np.float32) == 0)

  dw = jax.jit(lambda a, b, c: be.tgmm(a, b, c, num_groups=len(gs), out_dtype=jnp.float32))(x, dy, gsj)
  ref_dw = _ref_tgmm(x, dy, gs)
  assert _rel(dw, ref_dw) < 1e-2
  for gi in np.nonzero(gs == 0)[0]:
    assert np.all(np.asarray(dw[gi]) == 0), "empty group must give a zero weight gradient"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", [pytest.param("ragged", marks=QUICK), "padding_rows", "skewed_90pct",
                                  "empty_groups"])
def test_gradients_match_reference(backend, case):
  _require(backend)
  m, k, n, spec = CASES[case]
  gs = _sizes(spec, np.random.default_rng(_seed("sizes", case)))
  x, w, dy, gsj = _inputs(m, k, n, gs, ("gradients", case))

  def loss(fn):
    return lambda a, b: jnp.sum(fn(a, b).astype(jnp.float32) * dy.astype(jnp.float32))

  ours = jax.jit(jax.grad(loss(lambda a, b: G.gmm(a, b, gsj, backend=backend)), argnums=(0, 1)))(x, w)
  ref_fn = lambda a, b: G.gmm(a.astype(jnp.float32), b.astype(jnp.float32), gsj, backend="xla")
  ref = jax.jit(jax.grad(loss(ref_fn), argnums=(0, 1)))(x, w)
  for o, r in zip(ours, ref):
    assert _rel(o, np.asarray(r)) < 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_transpose_rhs_api_gradients(backend):
  _require(backend)
  m, k, n, spec = CASES["ragged"]
  gs = _sizes(spec, np.random.default_rng(3))
  x, w, dy, gsj = _inputs(m, n, k, gs, ("transpose_rhs",))  # lhs [M, N], w [G, K, N]^T -> [M, K]
  dyk = jax.random.normal(_key("transpose_rhs", "cotangent"), (m, k)).astype(jnp.bfloat16)

  def loss(be):
    def f(a, b):
      prec = jnp.float32 if be == "xla" else None
      if prec:
        a, b = a.astype(prec), b.astype(prec)
      y = G.gmm(a, b, gsj, backend=be, transpose_rhs=True)
      return jnp.sum(y.astype(jnp.float32) * dyk.astype(jnp.float32))
    return f
  w_t = jnp.swapaxes(w, 1, 2)  # [G, N, K] -> as [G, K', N'] with K'=n, N'=k
  ours = jax.jit(jax.grad(loss(backend), argnums=(0, 1)))(x, w_t)
  ref = jax.jit(jax.grad(loss("xla"), argnums=(0, 1)))(x, w_t)
  for o, r in zip(ours, ref):
    assert _rel(o, np.asarray(r)) < 1e-2


@QUICK
def test_auto_picks_the_fastest_expected_kernel_on_gpu():
  if not BACKENDS:
    pytest.skip("no kernel backend expected here (UMOE_GPU_BACKENDS is empty)")
  for backend in BACKENDS:
    _require(backend)
  from umoe_jax.ops import gmm_backends as GB
  assert G.resolve_backend("auto", "gpu") == max(BACKENDS, key=GB.AUTO_PRIORITY.get)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("per_slot,routing", gpu_tiers.product(
    (False, "fused_silu"), [False, True],
    ["random", "skewed_90pct", "masked", "fused_silu", "fused_relu", "rows_fused_silu", "rows_masked"]))
def test_fused_dispatch_matches_float32_reference(backend, per_slot, routing):
  """gather_gmm + gmm_combine (the dispatch fused into the kernels: row gathers, per-row gate
  scaling) against the unfused float32 XLA layer: values and the gradients of x, gates, w_up, w_down.
  "masked": half the slots carry no pick (gate 0, `make_plan(..., slot_mask)`: the kernels' zero
  tail) against the reference running every slot; the gates' gradient compared where they pick.
  "fused_<act>": random routing with the activation inside the last matmul
  (`gmm_combine(activation=...)`, `moe.fuse_activation`) against the reference applying it.
  "rows_<routing>": that routing with the weight gradient's gate-scaled rows written by the
  input-gradient matmul's epilogue (`gmm_combine(fuse_weight_rows=True)`)."""
  from umoe_jax.ops import dispatch as D
  from umoe_jax.ops import fused_dispatch as FD
  _require(backend)
  weight_rows = routing.startswith("rows_")
  # (the weight-rows cases at UMoE-base's expert width: the dgrad's 192 = 128 + 64 split tile)
  n, k, e, d, f = 1000, 6, 16, 192, 192 if weight_rows else 256
  rng = np.random.default_rng(_seed("fused_ids", per_slot, routing))
  routing = routing[len("rows_"):] if weight_rows else routing
  act_name = routing[len("fused_"):] if routing.startswith("fused_") else None
  act = {"silu": jax.nn.silu, "relu": jax.nn.relu}[act_name or "relu"]
  if routing in ("random", "masked") or act_name:
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(n)])
  else:  # 90% of the tokens put all their slots on experts 0..k-1
    ids = np.stack([np.arange(k) if rng.random() < 0.9 else rng.choice(e, k, replace=False)
                    for _ in range(n)])
  ids = jnp.asarray(ids, jnp.int32)
  k1, k2, k3, k4, k5 = jax.random.split(_key("fused", per_slot, routing), 5)
  x = jax.random.normal(k1, (n, k, d) if per_slot else (n, d), jnp.float32).astype(jnp.bfloat16)
  w1 = (jax.random.normal(k2, (e, d, f)) / np.sqrt(d)).astype(jnp.bfloat16)
  w2 = (jax.random.normal(k3, (e, f, d)) / np.sqrt(f)).astype(jnp.bfloat16)
  gates = jax.nn.softmax(jax.random.normal(k4, (n, k)), -1)
  cot = jax.random.normal(k5, (n, d), jnp.float32)
  mask = None
  if routing == "masked":
    mask = jnp.asarray(rng.random((n, k)) < 0.5).at[:, 0].set(True)
    gates = jnp.where(mask, gates, 0.0)

  def fused(x, g, a, b):
    plan = D.make_plan(ids, e, mask)
    up = FD.gather_gmm(x, a, plan, k, backend=backend)
    if act_name:
      return FD.gmm_combine(up, b, plan, g, backend=backend, activation=act_name,
                            fuse_weight_rows=weight_rows)
    return FD.gmm_combine(act(up), b, plan, g, backend=backend, fuse_weight_rows=weight_rows)

  def reference(x, g, a, b):
    plan = D.make_plan(ids, e)
    f32 = lambda t: t.astype(jnp.float32)
    fn = lambda r, gs: G.gmm(act(G.gmm(r, f32(a), gs, backend="xla")), f32(b), gs, backend="xla")
    return D.apply_experts(f32(x), plan, g, fn)

  out = jax.jit(fused)(x, gates, w1, w2)
  assert _rel(out, np.asarray(jax.jit(reference)(x, gates, w1, w2))) < 1e-2
  loss = lambda fn: lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * cot)
  got = jax.jit(jax.grad(loss(fused), argnums=(0, 1, 2, 3)))(x, gates, w1, w2)
  want = jax.jit(jax.grad(loss(reference), argnums=(0, 1, 2, 3)))(x, gates, w1, w2)
  if mask is not None:   # a masked slot's gate has no expert output to differentiate
    got = (got[0], jnp.where(mask, got[1], 0.0), *got[2:])
    want = (want[0], jnp.where(mask, want[1], 0.0), *want[2:])
  for name, o, r in zip(("x", "gates", "w_up", "w_down"), got, want):
    assert _rel(o, np.asarray(r, np.float32)) < 1e-2, name


@pytest.mark.parametrize("persistent", [1, 2])
def test_triton_persistent_grid(persistent):
  """The persistent (flattened-loop) Triton gmm: every row written once, padding rows zero."""
  if "triton" not in BACKENDS:
    pytest.skip("triton is not expected here (UMOE_GPU_BACKENDS)")
  _require("triton")
  from kernels.gmm import triton_gmm, tuning
  m, k, n = 3001, 256, 192
  gs = np.array([0, 700, 1, 0, 1200, 333, 0, 600], np.int32)  # 2834 rows used, 167 padding
  x, w, _, gsj = _inputs(m, k, n, gs, ("persistent", persistent))
  cfg = tuning.TileConfig(128, 192, 64, 8, 3, persistent=persistent)
  out = np.asarray(jax.jit(lambda a, b, g: triton_gmm.triton_gmm(a, b, g, config=cfg))(x, w, gsj),
                   np.float32)
  ref = _ref_gmm(x, w, gs)
  assert _rel(out, ref) < 1e-2
  assert np.all(out[gs.sum():] == 0), "padding rows must be zero"


@pytest.mark.parametrize("cfg", [(192, 128, 64, 4, 4), (192, 128, 64, 8, 4), (192, 64, 64, 4, 4)])
def test_triton_tgmm_split_row_tiles(cfg):
  """The weight gradient with its output tile's rows in two pieces (192 = 128 + 64: all of a
  192-wide expert's rows in one tile), plain, with gathered rows and the gate scale as
  gmm_combine's backward calls it; empty groups zero."""
  if "triton" not in BACKENDS:
    pytest.skip("triton is not expected here (UMOE_GPU_BACKENDS)")
  _require("triton")
  from kernels.gmm import triton_gmm, tuning
  cfg = tuning.TileConfig(*cfg)
  m, k, n = 3001, 192, 768
  gs = np.array([0, 700, 1, 0, 1200, 333, 0, 600], np.int32)   # 2834 rows used
  x, _, dy, gsj = _inputs(m, k, n, gs, ("split-row tgmm", cfg))
  rng = np.random.default_rng(_seed("split-row tgmm index", cfg))
  idx = jnp.asarray(rng.permutation(m).astype(np.int32))
  scale = jnp.asarray(rng.uniform(0.1, 1.0, m).astype(np.float32))
  plain = jax.jit(lambda a, b, g: triton_gmm.triton_tgmm(
      a, b, g, num_groups=len(gs), out_dtype=jnp.float32, config=cfg))(x, dy, gsj)
  assert _rel(np.asarray(plain), _ref_tgmm(x, dy, gs)) < 1e-2
  fused = jax.jit(lambda a, b, g, i, sc: triton_gmm.triton_tgmm(
      a, b, g, num_groups=len(gs), out_dtype=jnp.float32, config=cfg, rhs_index=i,
      lhs_scale=sc))(x, dy, gsj, idx, scale)
  a_rows = (np.asarray(x, np.float32) * np.asarray(scale)[:, None]).astype(jnp.bfloat16)
  ref = _ref_tgmm(a_rows, np.asarray(dy)[np.asarray(idx)], gs)
  assert _rel(np.asarray(fused), ref) < 1e-2
  for out in (plain, fused):
    assert np.all(np.asarray(out)[gs == 0] == 0), "empty groups must be zero"


def _epilogue_tiles():
  """The tiles the Triton backend's tuning table gives the input-gradient call with the row dot
  (gmm_combine's backward: gmm_t, gathered or not), each (kc, no, cfg) once."""
  from kernels.gmm import tuning
  seen = {}
  for key, cfg in tuning.TABLE.items():
    if key[0] == "triton" and key[1].split("+")[0] == "gmm_t":
      seen.setdefault((key[2], key[3], cfg), f"{key[1]}|{key[2]}|{key[3]}" + (
          f"|{key[4]}" if len(key) > 4 else ""))
  return sorted(seen.items(), key=lambda item: item[1])


EPILOGUE_TILES = _epilogue_tiles()


@pytest.mark.parametrize("epilogue", ["z_after", "z_early", "xla"])
@pytest.mark.parametrize("shape_cfg", [c for c, _ in EPILOGUE_TILES],
                         ids=[name for _, name in EPILOGUE_TILES])
def test_tabled_dgrad_epilogue_tiles(shape_cfg, epilogue):
  """Each tabled tile of the dgrad with the silu epilogue (`moe.fuse_activation`: gathered output
  gradient, row dot with act(z), output times act'(z) and the gate scale), at its table shape
  against numpy in float32: a tile may split the output width (the row dot then sums partial dots
  over column tiles), which the smaller tests' tiles do not; with z's tile loaded after the
  contraction, before it (`TileConfig.prefetch_row_dot`), or the epilogue in XLA after the plain
  kernel (`TileConfig.xla_epilogue`)."""
  if "triton" not in BACKENDS:
    pytest.skip("triton is not expected here (UMOE_GPU_BACKENDS)")
  _require("triton")
  from kernels.gmm import triton_gmm
  kc, no, cfg = shape_cfg          # out [M, no] = dout[idx] [M, kc] @ w[g].T, w[g]: [no, kc]
  cfg = dataclasses.replace(cfg, prefetch_row_dot=epilogue == "z_early",
                            xla_epilogue=epilogue == "xla")
  m, g = 6000, 16
  rng = np.random.default_rng(_seed("epilogue", kc, no, cfg))
  gs = _random_sizes(rng, m - 37, g, empty=2)      # 37 padding rows: the zero tail
  k1, k2, k3, k4 = jax.random.split(_key("epilogue", kc, no, cfg), 4)
  src = jax.random.normal(k1, (m // 2, kc), jnp.float32).astype(jnp.bfloat16)
  idx = jnp.asarray(rng.integers(0, m // 2, m), jnp.int32)
  w = (jax.random.normal(k2, (g, no, kc), jnp.float32) / np.sqrt(kc)).astype(jnp.bfloat16)
  z = (2 * jax.random.normal(k3, (m, no), jnp.float32)).astype(jnp.bfloat16)
  scale = jax.random.uniform(k4, (m,), jnp.float32, 0.1, 1.0)
  out, dots = jax.jit(lambda *a: triton_gmm.triton_gmm(
      *a[:3], transpose_rhs=True, lhs_index=a[3], row_scale=a[4], row_dot=a[5], epi_act="silu",
      config=cfg))(src, w, jnp.asarray(gs), idx, scale, z)
  u = _ref_gmm(np.asarray(src, np.float32)[np.asarray(idx)], w, gs, transpose_rhs=True)
  zf = np.asarray(z, np.float32)
  sig = 1.0 / (1.0 + np.exp(-zf))
  used = int(gs.sum())
  assert _rel(np.asarray(dots)[:used], (u * zf * sig).sum(-1)[:used]) < 1e-2
  want = u * sig * (1 + zf * (1 - sig)) * np.asarray(scale)[:, None]
  assert _rel(np.asarray(out)[:used], want[:used]) < 1e-2
  assert np.all(np.asarray(out, np.float32)[used:] == 0), "padding rows must be zero"


def test_silu_epilogue_sigmoid_error_bound():
  """The silu epilogue's sigmoid (tanh.approx, `triton_gmm._sigmoid`) elementwise over
  pre-activations across [-16, 16], the product u = 1 exactly (rows of ones times an identity
  weight) and a float32 output, so what is compared is the epilogue alone: out = act'(z) * scale
  against float64 within tol * (1 + |z|), |d act' / d sigmoid| <= 1 + |z| times the sigmoid's
  error, tol = 1e-5 (the sigmoid is within 3.9e-6 on an H200); the row dots sum(silu(z)) within
  tol * sum(1 + |z|). (tests/test_kernel_resources.py checks tanh.approx is in the PTX.)"""
  if "triton" not in BACKENDS:
    pytest.skip("triton is not expected here (UMOE_GPU_BACKENDS)")
  _require("triton")
  from kernels.gmm import triton_gmm
  m, width, g = 2048, 64, 2
  gs = jnp.asarray([1000, m - 1000], jnp.int32)
  z = jnp.linspace(-16.0, 16.0, m * width, dtype=jnp.float32).reshape(m, width)
  z = jax.random.permutation(_key("sigmoid", True), z.reshape(-1)).reshape(m, width)
  z = z.astype(jnp.bfloat16)       # the pre-activations arrive in bf16; the epilogue works in f32
  scale = jax.random.uniform(_key("sigmoid_scale", True), (m,), jnp.float32, 0.5, 1.0)
  ones = jnp.ones((m, width), jnp.bfloat16)
  eye = jnp.broadcast_to(jnp.eye(width, dtype=jnp.bfloat16), (g, width, width))

  out, dots = jax.jit(lambda *a: triton_gmm.triton_gmm(
      *a[:3], transpose_rhs=True, out_dtype=jnp.float32, row_scale=a[3], row_dot=a[4],
      epi_act="silu"))(ones, eye, gs, scale, z)
  zf = np.asarray(z, np.float64)
  sig = 1.0 / (1.0 + np.exp(-zf))
  bound = 1e-5 * (1.0 + np.abs(zf))
  err = np.abs(np.asarray(out, np.float64) / np.asarray(scale)[:, None] - sig * (1 + zf * (1 - sig)))
  assert np.all(err <= bound), (float(err.max()), float(zf.reshape(-1)[err.argmax()]))
  dot_err = np.abs(np.asarray(dots, np.float64) - (zf * sig).sum(-1))
  assert np.all(dot_err <= bound.sum(-1)), float(dot_err.max())


def _tabled_tiles():
  """Every distinct (op, kc, no, tile) of the Triton backend's tuning table, gathered or not."""
  from kernels.gmm import tuning
  seen = {}
  for key, cfg in tuning.TABLE.items():
    if key[0] == "triton":
      seen.setdefault((key[1], key[2], key[3], cfg), "|".join(str(p) for p in key[1:]))
  return sorted(seen.items(), key=lambda item: item[1])


TABLED_TILES = _tabled_tiles()


@pytest.mark.parametrize("row", [r for r, _ in TABLED_TILES],
                         ids=[name for _, name in TABLED_TILES])
def test_tabled_tiles(row):
  """Each tile of the Triton tuning table at its row's widths (kc, no), without an epilogue (as the
  forward, the plain input gradients and the weight gradients run them), against numpy in float32:
  the sweeps that tabled them time a tile, they do not check its values. '+gather' rows read the
  operand rows through an index (tgmm: either operand's), as fused_dispatch calls them."""
  if "triton" not in BACKENDS:
    pytest.skip("triton is not expected here (UMOE_GPU_BACKENDS)")
  _require("triton")
  from kernels.gmm import triton_gmm
  op, kc, no, cfg = row
  plain, gathered = op.split("+")[0], op.endswith("+gather")
  m, g = 5000, 16
  rng = np.random.default_rng(_seed("tabled", row))
  gs = _random_sizes(rng, m - 29, g, empty=2)      # 29 padding rows
  used = int(gs.sum())
  k1, k2 = jax.random.split(_key("tabled", row))
  n_src = m // 2 if gathered else m
  idx = jnp.asarray(rng.integers(0, n_src, m), jnp.int32) if gathered else None
  take = (lambda a: np.asarray(a, np.float32)[np.asarray(idx)]) if gathered else (
      lambda a: np.asarray(a, np.float32))
  if plain == "tgmm":   # out[g] = lhs[rows of g].T @ rhs[rows of g]: [G, kc, no]
    # gathered: through each operand's index in turn (the trainer gathers x for the first
    # matmul's weight gradient, the output gradient for the last's)
    for side in ("lhs", "rhs") if gathered else ("none",):
      lhs = jax.random.normal(k1, (n_src if side == "lhs" else m, kc), jnp.float32)
      rhs = jax.random.normal(k2, (n_src if side == "rhs" else m, no), jnp.float32)
      lhs, rhs = lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16)
      index = dict(lhs_index=idx) if side == "lhs" else dict(rhs_index=idx) if side == "rhs" else {}
      out = jax.jit(lambda a, b, s, ix: triton_gmm.triton_tgmm(
          a, b, s, num_groups=g, config=cfg, **ix))(lhs, rhs, jnp.asarray(gs), index)
      a_rows = take(lhs) if side == "lhs" else np.asarray(lhs, np.float32)
      b_rows = take(rhs) if side == "rhs" else np.asarray(rhs, np.float32)
      assert _rel(out, _ref_tgmm(a_rows[:used], b_rows[:used], gs)) < 1e-2, side
    return
  transpose = plain == "gmm_t"   # gmm: w[g] [kc, no]; gmm_t: w[g] [no, kc], used transposed
  lhs = jax.random.normal(k1, (n_src, kc), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(k2, (g,) + ((no, kc) if transpose else (kc, no)), jnp.float32)
       / np.sqrt(kc)).astype(jnp.bfloat16)
  out = jax.jit(lambda a, b, s, i: triton_gmm.triton_gmm(
      a, b, s, transpose_rhs=transpose, lhs_index=i, config=cfg))(lhs, w, jnp.asarray(gs), idx)
  ref = _ref_gmm(take(lhs), w, gs, transpose_rhs=transpose)
  assert _rel(np.asarray(out)[:used], ref[:used]) < 1e-2
  assert np.all(np.asarray(out, np.float32)[used:] == 0), "padding rows must be zero"


@pytest.mark.parametrize("activation", [None, "silu"])
def test_xla_epilogue_row_dots_stay_out_of_the_router_scatter(activation):
  """The XLA row-dot epilogue (`umoe_jax.ops.epilogue`, the gate gradient dgate = <u, act(z)>):
  in the compiled backward through a top-k router (gates taken from the softmax, whose gradient
  XLA scatter-adds), no fusion that scatters also reduces an [M, F] array: fused there, the F-wide
  dot runs once per scattered value. The gates' gradient is checked too."""
  from umoe_jax.ops import dispatch as D
  from umoe_jax.ops import fused_dispatch as FD
  import re
  n, k, e, f, d = 2048, 4, 16, 176, 256      # F = 176: a width nothing else in the program has
  k1, k2, k3, k4 = jax.random.split(_key("epilogue_fusion", activation), 4)
  logits = jax.random.normal(k1, (n, e), jnp.float32)
  ids = jax.lax.top_k(logits, k)[1]
  h = jax.random.normal(k2, (n * k, f), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(k3, (e, f, d)) / np.sqrt(f)).astype(jnp.bfloat16)
  cot = jax.random.normal(k4, (n, d), jnp.float32)
  plan = D.make_plan(ids, e)
  act = (lambda t: t) if activation is None else jax.nn.silu

  def loss(logits_, backend):
    gates = jnp.take_along_axis(jax.nn.softmax(logits_, -1), ids, axis=1)
    if backend == "xla":
      y = FD.gmm_combine(h, w, plan, gates, backend="xla", activation=activation)
    else:   # float32 reference: apply the experts row by row in expert order, unsort, weight
      rows = G.gmm(act(h.astype(jnp.float32)), w.astype(jnp.float32), plan.group_sizes,
                   backend="xla")
      y = jnp.einsum("nkd,nk->nd", rows[plan.inverse].reshape(n, k, d), gates)
    return jnp.sum(y.astype(jnp.float32) * cot)

  grad = jax.jit(jax.grad(loss), static_argnums=1)
  text = grad.lower(logits, "xla").compile().as_text()
  bad = [c.splitlines()[0][:120] for c in text.split("\n\n")
         if "scatter(" in c and re.search(rf"reduce\(f32\[\d+,{f}\]", c)]
  assert not bad, bad
  assert _rel(grad(logits, "xla"), np.asarray(grad(logits, "ref"))) < 1e-2
