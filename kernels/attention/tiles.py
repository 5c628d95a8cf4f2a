"""Tiles and launch geometry of the Triton pre-mixing attention kernels (kernels/attention/triton_attention.py).

Pure Python (tested on CPU). A kernel's tiles (`PassTiles`): bm query rows, bn keys, bd value
columns (the forward's and dX pass's D chunk, which may be two powers of two such as 256 + 128, or
the dK / dQ passes' step of the dO X^T contraction, one power of two), warps and pipeline stages.
`TABLE` holds the tiles a sweep measured best per (dk, D) (bench/attention_core.py --sweep).
"""
from __future__ import annotations

import dataclasses
import json

from kernels.triton_base import pow2_at_least, split_width


@dataclasses.dataclass(frozen=True)
class PassTiles:
  """One kernel's tiles: bm query rows, bn keys, bd value columns (a D chunk, or the D step of the
  dO X^T contraction), warps and software-pipeline stages."""
  bm: int
  bn: int
  bd: int
  num_warps: int = 4
  num_stages: int = 2


@dataclasses.dataclass(frozen=True)
class FlashTiles:
  """Tiles of each kernel. With `dxdk` set, the fused dX + dK pass replaces the dx and dk ones.
  With `ds` set (and `dk_ds`, `dq_ds`, `dx_p`: the stored-scores form), dS (the score gradients)
  and P come from a pass over the causal (row tile, key tile) pairs (tiles bm rows x bn keys, bd
  the D step of dO X^T) stored as [B, T, T*H] arrays; dK and dQ are the products of the stored dS
  with the queries (`dk_ds`: bm rows a step x bn keys) and the keys (`dq_ds`: bm rows x bn keys a
  step; bd unused), and the dX pass reads P (`dx_p`): no pass accumulates across tiles while
  contracting over D, and none recomputes the scores. The dk and dq tiles serve the recomputing
  passes that run where the stores do not fit. `dx_read`: the dX pass's tiles when it reads P
  (None: dx's); reading P, it holds no scores and takes tiles the recomputing pass could not (at
  dk 512, 64x64x256 needs 80 KB of shared memory reading P, 257 KB recomputing)."""
  fwd: PassTiles
  dx: PassTiles
  dk: PassTiles
  dq: PassTiles
  dxdk: PassTiles | None = None
  dq_ds: PassTiles | None = None
  dx_p: bool = False
  ds: PassTiles | None = None
  dk_ds: PassTiles | None = None
  dx_read: PassTiles | None = None

  def dx_tiles(self, reads_p: bool) -> PassTiles:
    """The dX pass's tiles: `dx_read` when it reads the stored P (and has tiles of its own)."""
    return self.dx_read if reads_p and self.dx_read is not None else self.dx

  def __post_init__(self):
    stored = (self.ds is not None, self.dk_ds is not None, self.dq_ds is not None, self.dx_p)
    if self.dxdk is not None and any(stored):
      raise ValueError("attention tiles: ds / dk_ds / dq_ds / dx_p make or read stored scores; the "
                       "fused dxdk pass does not store them (set one or the other)")
    if any(stored) and not all(stored):
      raise ValueError("attention tiles: ds (the stored-scores pass) comes with dk_ds, dq_ds and "
                       "dx_p, the passes that read what it stores (set all four or none)")


PASSES = ("fwd", "dx", "dk", "dq", "dxdk", "dq_ds", "ds", "dk_ds", "dx_read")


# (dk, D) -> tiles measured best on an H200 (bench/attention_core.py --sweep).
TABLE: dict[tuple[int, int], FlashTiles] = {}


# The backward forms `with_backward` names (`model.attention.core_backward`, umoe_jax.kinds).
BACKWARDS = ("auto", "recompute", "stored_pairs")
# Tiles the stored form takes where the tiles have none of their own, chosen among those ptxas
# compiles for sm_90a without register spills (bench/kernel_resources.py): for heads <= 256 wide
# the fastest of an H200 sweep at UMoE-base's shape (the pair pass 0.488 against 0.570 ms, dQ from
# the stored dS 0.100 against 0.138 for the tiles before), for wider ones at UMoE-large's (dk 512,
# D 2048). The readers keep [BM or BN, dk] float32 accumulators, so wide heads take half the rows.
NARROW_HEAD_MAX = 256   # the widest head (dk) the narrow heads' tiles, swept at dk 192, are for
STORED_DQ_DS = PassTiles(64, 64, 16, 4, 2)
STORED_PAIRS_DS = PassTiles(128, 128, 64, 8, 3)
STORED_PAIRS_DK_DS = PassTiles(64, 64, 16, 4, 2)
# Wide heads: dq_ds and the dX pass reading P as swept on an H200 at UMoE-large's shape (0.112
# against 0.216 ms, 0.340 against 0.591); ds and dk_ds the spill-free picks.
WIDE_STORED_DQ_DS = PassTiles(64, 64, 16, 8, 2)
WIDE_STORED_PAIRS_DS = PassTiles(64, 128, 64, 8, 2)
WIDE_STORED_PAIRS_DK_DS = PassTiles(64, 32, 16, 8, 2)
WIDE_STORED_DX_READ = PassTiles(64, 64, 256, 8, 2)


def stored_tiles(dk: int) -> tuple[PassTiles, PassTiles, PassTiles]:
  """The stored form's (dq_ds, ds, dk_ds) tiles for keys dk wide."""
  if dk <= NARROW_HEAD_MAX:
    return STORED_DQ_DS, STORED_PAIRS_DS, STORED_PAIRS_DK_DS
  return WIDE_STORED_DQ_DS, WIDE_STORED_PAIRS_DS, WIDE_STORED_PAIRS_DK_DS


def stored_dx_tiles(dk: int) -> PassTiles | None:
  """The dX pass's tiles when it reads P, for keys dk wide (None: the recomputing pass's serve)."""
  return None if dk <= NARROW_HEAD_MAX else WIDE_STORED_DX_READ


def with_backward(tiles: FlashTiles, backward: str, dk: int) -> FlashTiles:
  """`tiles` (for keys dk wide) with the backward form `backward`: "auto" leaves them as they are
  (the default tiles store by the pair pass; a swept TABLE entry says its own); "recompute" drops
  the stored form (least memory); "stored_pairs" stores dS and P in the tile-pair pass
  (`FlashTiles` says what each reads), keeping tiles of its own the tiles name, else
  `stored_tiles(dk)` / `stored_dx_tiles(dk)`."""
  if backward == "auto":
    return tiles
  if backward == "recompute":
    return dataclasses.replace(tiles, dq_ds=None, dx_p=False, ds=None, dk_ds=None, dx_read=None)
  if backward == "stored_pairs":
    dq_ds, ds, dk_ds = stored_tiles(dk)
    return dataclasses.replace(
        tiles, dxdk=None, dq_ds=tiles.dq_ds or dq_ds, dx_p=True, ds=tiles.ds or ds,
        dk_ds=tiles.dk_ds or dk_ds, dx_read=tiles.dx_read or stored_dx_tiles(dk))
  raise ValueError(f"attention core backward {backward!r}; valid: {', '.join(BACKWARDS)}")


def default_tiles(dk: int, d: int) -> FlashTiles:
  """TABLE's tiles for (dk, D), else a default by head size, both in the stored-scores pair form
  (`with_backward(..., "stored_pairs")`): on one H200 a UMoE-base step takes 124.7 ms with it
  against 142.5 ms when the passes recompute. For dk <= 256 the fastest of the H200 sweeps at
  UMoE-base's shape (dk 192, D 768). For wider heads the forward, dQ and dX tiles of a sweep at
  UMoE-large's shape (dk 512, D 2048), the rest tiles that fit: the core alone there takes 5.34 ms
  forward + backward in the pair form against 13.98 recomputing."""
  if (dk, d) in TABLE:
    return TABLE[(dk, d)]
  if dk <= NARROW_HEAD_MAX:
    recompute = FlashTiles(fwd=PassTiles(128, 64, 256, 8, 2), dx=PassTiles(32, 64, 256, 4, 3),
                           dk=PassTiles(64, 64, 256, 8, 2), dq=PassTiles(64, 64, 256, 8, 2))
  else:  # fwd as swept at UMoE-large's shape (1.189 against 2.646 ms for 64x32x256)
    recompute = FlashTiles(fwd=PassTiles(128, 32, 256, 8, 2), dx=PassTiles(64, 32, 256, 8, 2),
                           dk=PassTiles(64, 32, 64, 8, 2), dq=PassTiles(64, 32, 64, 8, 2))
  return with_backward(recompute, "stored_pairs", dk)


def tiles_to_json(tiles: FlashTiles) -> dict:
  out = {name: list(dataclasses.astuple(getattr(tiles, name))) for name in PASSES
         if getattr(tiles, name) is not None}
  return {**out, "dx_p": True} if tiles.dx_p else out


def tiles_from_json(obj: dict) -> FlashTiles:
  """{"fwd": [bm, bn, bd, warps, stages], "dx": ..., "dk": ..., "dq": ..., optional "dxdk", or
  "dq_ds" / "ds" / "dk_ds" lists and "dx_p": true / false (`FlashTiles` says which go together)}."""
  try:
    if set(obj) - set(PASSES) - {"dx_p"}:
      raise KeyError(sorted(set(obj) - set(PASSES) - {"dx_p"}))
    if not isinstance(obj.get("dx_p", False), bool):
      raise TypeError(f"dx_p={obj['dx_p']!r} is not true / false")
    return FlashTiles(**{name: PassTiles(*obj[name]) for name in PASSES if name in obj},
                      dx_p=obj.get("dx_p", False))
  except (KeyError, TypeError, ValueError) as e:
    raise ValueError(f"attention tiles {obj!r}: want fwd/dx/dk/dq (and optionally dxdk, dq_ds, ds, "
                     f"dk_ds) lists [bm, bn, bd, warps, stages] and an optional dx_p bool ({e})") from None


def load_table(path: str) -> None:
  """Adds {"dk,D": tiles_to_json(...)} entries of a JSON file (a sweep's result) to TABLE."""
  with open(path) as f:
    entries = json.load(f)
  for key, obj in entries.items():
    try:
      dk, d = (int(x) for x in key.split(","))
    except ValueError:
      raise ValueError(f"{path}: key {key!r} is not 'dk,D'") from None
    TABLE[(dk, d)] = tiles_from_json(obj)


# ----------------------------------------------------------------------------------------------
# Launch geometry.


# tl.dot on NVIDIA GPUs contracts at least 16 elements (bf16 / fp16), and the older Triton releases
# want M and N of 16 too; the Triton interpreter checks neither, so the bounds are checked here.
MIN_DOT = 16


def key_width(dk: int) -> int:
  """dk padded to a power of two >= MIN_DOT: the kernels' one-piece key width (masked loads)."""
  return max(MIN_DOT, pow2_at_least(dk))


def key_pieces(dk: int) -> dict:
  """The kernels' key-width constexprs {DK1, DK2, DK2S} (attention.triton_kernels' docstring): two
  exact pieces (dk = DK1 + DK2, each >= MIN_DOT) when dk is such a sum, else one padded piece
  (DK1 = key_width(dk), DK2 = 0, DK2S = 1). Two exact pieces (192 = 128 + 64) put a quarter less
  tensor-core work into every product over dk than one piece padded to 256: on one H200 the
  UMoE-base core is 3.8% faster forward + backward, the step 1.2%."""
  try:
    hi, lo = split_width(dk)
  except ValueError:  # not a sum of two powers of two: padded
    lo = 0
  if lo >= MIN_DOT:
    return dict(DK1=hi, DK2=lo, DK2S=lo)
  return dict(DK1=key_width(dk), DK2=0, DK2S=1)


def _check(tiles: PassTiles, pow2_bd: bool, contracts_bd: bool = False) -> None:
  """bm, bn: powers of two >= MIN_DOT (each is a dot's contraction in some pass); bd: one power of
  two (`pow2_bd`) or two; a bd the pass contracts over (`contracts_bd`) >= MIN_DOT per piece."""
  sizes = (tiles.bm, tiles.bn) + ((tiles.bd,) if pow2_bd else ())
  if any(n < 1 or n & (n - 1) for n in sizes):
    raise ValueError(f"attention tiles {tiles}: bm, bn{', bd' if pow2_bd else ''} must be powers of two")
  pieces = (tiles.bd,) if pow2_bd else tuple(p for p in split_width(tiles.bd) if p)
  if min(tiles.bm, tiles.bn) < MIN_DOT or (contracts_bd and min(pieces) < MIN_DOT):
    raise ValueError(f"attention tiles {tiles}: bm, bn{' and bd (each piece)' if contracts_bd else ''} "
                     f"must be >= {MIN_DOT} (a tl.dot contraction)")


def fwd_launch(t: int, h: int, dk: int, d: int, tiles: PassTiles) -> dict:
  _check(tiles, pow2_bd=False)
  bd1, bd2 = split_width(tiles.bd)
  n_row_tiles, n_chunks = -(-t * h // tiles.bm), -(-d // tiles.bd)
  return dict(grid0=n_row_tiles * n_chunks, **key_pieces(dk), BM=tiles.bm, BN=tiles.bn,
              BD1=bd1, BD2=bd2, BD2S=max(bd2, 1), N_ROW_TILES=n_row_tiles, N_CHUNKS=n_chunks,
              num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def dx_launch(t: int, h: int, dk: int, d: int, tiles: PassTiles, *, fused_dk: bool = False) -> dict:
  """The dX pass, or with `fused_dk` the fused dX + dK pass (it also contracts X_c dO_c^T over bd)."""
  _check(tiles, pow2_bd=False, contracts_bd=fused_dk)
  bd1, bd2 = split_width(tiles.bd)
  n_chunks = -(-d // tiles.bd)
  return dict(grid0=-(-t // tiles.bn) * n_chunks, **key_pieces(dk), BM=tiles.bm, BN=tiles.bn,
              BD1=bd1, BD2=bd2, BD2S=max(bd2, 1), N_CHUNKS=n_chunks, num_warps=tiles.num_warps,
              num_stages=tiles.num_stages)


def dk_launch(t: int, h: int, dk: int, d: int, tiles: PassTiles) -> dict:
  _check(tiles, pow2_bd=True, contracts_bd=True)  # bd: the D step of the dO X^T contraction
  return dict(grid0=-(-t // tiles.bn), **key_pieces(dk), BM=tiles.bm, BN=tiles.bn,
              BDK=tiles.bd, num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def ds_launch(t: int, h: int, dk: int, d: int, tiles: PassTiles) -> dict:
  """The stored-scores pass: a program per (row tile, key tile); bd the D step of dO X^T."""
  _check(tiles, pow2_bd=True, contracts_bd=True)
  n_key_tiles = -(-t // tiles.bn)
  return dict(grid0=-(-t * h // tiles.bm) * n_key_tiles, **key_pieces(dk), BM=tiles.bm,
              BN=tiles.bn, BDK=tiles.bd, N_KEY_TILES=n_key_tiles, num_warps=tiles.num_warps,
              num_stages=tiles.num_stages)


def dk_ds_launch(t: int, h: int, dk: int, tiles: PassTiles) -> dict:
  """dK from the stored dS: a program per bn keys, bm rows a step (bd unused)."""
  _check(dataclasses.replace(tiles, bd=MIN_DOT), pow2_bd=True)
  return dict(grid0=-(-t // tiles.bn), **key_pieces(dk), BM=tiles.bm, BN=tiles.bn,
              num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def dq_ds_launch(t: int, h: int, dk: int, tiles: PassTiles) -> dict:
  """dQ from the stored dS: a program per bm rows, bn keys a step (bd unused)."""
  _check(dataclasses.replace(tiles, bd=MIN_DOT), pow2_bd=True)
  n_row_tiles = -(-t * h // tiles.bm)
  return dict(grid0=n_row_tiles, **key_pieces(dk), BM=tiles.bm, BN=tiles.bn,
              N_ROW_TILES=n_row_tiles, num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def dq_launch(t: int, h: int, dk: int, d: int, tiles: PassTiles) -> dict:
  _check(tiles, pow2_bd=True, contracts_bd=True)
  n_row_tiles = -(-t * h // tiles.bm)
  return dict(grid0=n_row_tiles, **key_pieces(dk), BM=tiles.bm, BN=tiles.bn, BDK=tiles.bd,
              N_ROW_TILES=n_row_tiles, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
