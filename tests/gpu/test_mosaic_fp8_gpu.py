"""GPU checks of the FP8 grouped matmul in Pallas Mosaic GPU (kernels/gmm/mosaic_fp8_gmm.py; CPU
interpreter runs: tests/test_mosaic_fp8.py): what only the hardware shows, the two wgmma accumulators
in flight at once and the waits between them, in a tile of each shape and residency, both layouts, at
UMoE-large's and UMoE-base's expert shapes (its 192-wide contraction padded to whole chunks), against
a float64 loop over the dequantised operands; NaN and inf inputs; and `fp8_gmm(..., backend="mosaic")`'s
values and gradients. Skipped without a Hopper GPU. Timing: bench/gmm.py --precision=bf16,fp8 --backends=triton,mosaic.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.gmm import mosaic_fp8_gmm as mf
from test_fp8_gpu import NORM_BOUND, REL_BOUND, SPREAD
from test_fp8_triton import _compare, _loop_gmm, _operand
from umoe_jax.ops import fp8

pytestmark = pytest.mark.skipif(not mf.available(), reason="needs a Hopper GPU (sm_90) and the Pallas "
                                                            "Mosaic GPU API")

SHAPES = {  # M, contraction, output width, groups (Dirichlet-skewed, one empty, rows past them)
    "large-up": (6000, 2048, 512, 16),
    "large-down": (6000, 512, 2048, 16),
    "base-up": (6000, 768, 192, 32),
    "base-down": (6000, 192, 768, 32),   # the contraction padded to whole chunks
    # three chunks (the last step's second past the contraction: TMA's zero fill, its weight scale
    # read clamped), M not a multiple of 8 (padded); and fewer rows than a tile
    "odd": (6001, 384, 256, 8),
    "small": (40, 512, 128, 4),
}


def _group_sizes(m, g, seed):
  rng = np.random.default_rng(seed)
  past = min(29, m // 4)   # rows past the groups
  gs = np.floor(rng.dirichlet(np.full(g, 2.0)) * (m - past)).astype(np.int32)
  gs[min(3, g - 2)] = 0
  gs[-1] += m - past - gs.sum()
  return gs


def _raw(shape, transpose, tile, special=False):
  m, kc, no, g = SHAPES[shape]
  gs = _group_sizes(m, g, seed=kc + no)
  rng = np.random.default_rng(kc * 3 + no + transpose + special)
  lhs = _operand(rng, (m, kc), (0, 1), SPREAD)
  rhs = _operand(rng, (g, no, kc) if transpose else (g, kc, no), (1, 2), SPREAD)
  rows = int(gs.sum())
  if special:
    busy = int(np.argmax(gs))
    r0 = int(gs[:busy].sum())
    lhs[rows:] = np.nan                    # never read into a row of the groups
    lhs[r0 + 1] = 0.0
    lhs[r0 + 2, 3] = np.nan
    lhs[r0 + 4, -1] = np.inf
    rhs[busy, :128, :128] = 0.0
    rhs[busy, 5, 130] = np.inf
  lq, ls = fp8.quantize_tiles(jnp.asarray(lhs), axis=1)
  rq, rs = fp8.quantize_blocks(jnp.asarray(rhs))
  got = jax.jit(lambda *a: mf.mosaic_fp8_gmm(*a, transpose_rhs=transpose, out_dtype=jnp.float32,
                                             tile=tile))(lq, ls, rq, rs, jnp.asarray(gs))
  got = np.asarray(got)
  assert np.all(got[rows:] == 0), f"{shape}: rows past the groups are zero"
  dl = np.asarray(fp8.dequantize_tiles(lq, ls, axis=1))
  dr = np.asarray(fp8.dequantize_blocks(rq, rs))
  return (got[:rows], _loop_gmm(dl, dr, gs, transpose)[:rows],
          _loop_gmm(np.abs(dl), np.abs(dr), gs, transpose)[:rows])


# One tile of each shape and residency, and the default without the overlap (a compile each: the
# whole candidate list would take minutes); a float32 output, so two programs an SM only with two
# stages.
TILES = (mf.DEFAULT, mf.Fp8Tile(128, 64, 3, 1), mf.Fp8Tile(64, 64, 2, 2),
         mf.Fp8Tile(64, 128, 3, 1, overlap=False))


def _tiles_for(shape):
  _, kc, no, _ = SHAPES[shape]
  return [t for t in TILES if mf.supported(kc, no, t)]


@pytest.mark.parametrize("transpose", [False, True], ids=["gmm", "gmm_t"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_tile_matches_float64_loop(shape, transpose):
  tiles = _tiles_for(shape)
  assert tiles, shape
  for tile in tiles:
    got, want, bound = _raw(shape, transpose, tile)
    _compare(got, want, bound, None, f"{shape} {tile}", rel=REL_BOUND)
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel <= NORM_BOUND, (shape, tile, rel)


@pytest.mark.parametrize("transpose", [False, True], ids=["gmm", "gmm_t"])
def test_zero_and_nonfinite_pieces(transpose):
  got, want, bound = _raw("large-down", transpose, mf.DEFAULT, special=True)
  assert not np.all(np.isfinite(want))
  _compare(got, want, bound, None, "special", rel=REL_BOUND)


@pytest.mark.gpu_quick
def test_fp8_gmm_through_the_mosaic_backend_matches_triton():
  """Values and gradients of fp8_gmm(backend="mosaic") (its bf16 weight gradient by the Mosaic
  tgmm) against backend="triton": the same quantised operands, products equal up to the order of
  the float32 promotion."""
  from umoe_jax.ops.fp8_gmm import fp8_gmm
  m, kc, no, g = SHAPES["large-up"]
  gs = jnp.asarray(_group_sizes(m, g, seed=7))
  rng = np.random.default_rng(11)
  x = jnp.asarray(_operand(rng, (m, kc), (0,), 1.0), jnp.bfloat16)
  w = jnp.asarray(_operand(rng, (g, kc, no), (0,), 1.0), jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((m, no)), jnp.bfloat16)

  def run(backend):
    y, pull = jax.vjp(lambda a, b: fp8_gmm(a, b, gs, backend=backend), x, w)
    return (y, *pull(dy))

  for a, b in zip(jax.jit(lambda: run("mosaic"))(), jax.jit(lambda: run("triton"))()):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.linalg.norm(a - b) <= 2e-2 * np.linalg.norm(b)
