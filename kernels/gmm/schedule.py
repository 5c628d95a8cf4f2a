"""Work lists for the row-ragged grouped matmuls, computed on device with a few jnp ops (pure, testable).

`row_block_items`: the rows [0, M) are cut into aligned blocks of `bm`; the segments are the G groups
plus one *tail* segment (rows past sum(group_sizes), whose output must be zero). One work item per
(block, segment) overlap, in row order:
  item_group[t]  segment id: 0..G-1 a group, G the zero tail, G+1 an unused slot
  item_block[t]  the aligned row block
  item_lo[t], item_hi[t]  the rows [lo, hi) of the block that belong to the segment (0, 0 when unused)
There are at most cdiv(M, bm) + G items (each of the G inner segment boundaries splits at most one
block), so the arrays have that static length. Each output row is written by exactly one item, and
blocks are read through TMA at aligned offsets (rows past M are zero-filled by the copy engine).

`group_row_blocks`: for the weight-gradient form, per group the first aligned block of `br` rows and
how many blocks cover [start, end).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def max_row_block_items(m: int, bm: int, g: int) -> int:
  return -(-m // bm) + g


def row_block_items(group_sizes, m: int, bm: int):
  gs = group_sizes.astype(jnp.int32)
  g = gs.shape[0]
  total = jnp.sum(gs)
  sizes = jnp.concatenate([gs, jnp.maximum(m - total, 0)[None]])           # G + 1 segments
  ends = jnp.minimum(jnp.cumsum(sizes), m)
  starts = jnp.minimum(ends - sizes, ends)
  nonempty = ends > starts
  first = starts // bm
  nblk = jnp.where(nonempty, (ends - 1) // bm - first + 1, 0)
  cum = jnp.cumsum(nblk)
  offs = cum - nblk
  n_items = max_row_block_items(m, bm, g)
  t = jnp.arange(n_items, dtype=jnp.int32)
  seg = jnp.searchsorted(cum, t, side="right").astype(jnp.int32)           # G + 1 => unused
  segc = jnp.minimum(seg, g)
  blk = first[segc] + t - offs[segc]
  base = blk * bm
  lo = jnp.maximum(starts[segc], base) - base
  hi = jnp.minimum(ends[segc], base + bm) - base
  valid = seg <= g
  return (jnp.where(valid, seg, g + 1), jnp.where(valid, blk, 0),
          jnp.where(valid, lo, 0), jnp.where(valid, hi, 0))


def row_block_items_numpy(group_sizes, m: int, bm: int):
  """Straightforward reference for `row_block_items` (loops), used by the CPU tests."""
  gs = [int(v) for v in np.asarray(group_sizes)]
  g = len(gs)
  sizes = gs + [max(m - sum(gs), 0)]
  items = []
  s = 0
  for seg, n in enumerate(sizes):
    e = min(s + n, m)
    r = s
    while r < e:
      blk = r // bm
      hi = min(e, (blk + 1) * bm)
      items.append((seg, blk, r - blk * bm, hi - blk * bm))
      r = hi
    s = e
  n_items = max_row_block_items(m, bm, g)
  assert len(items) <= n_items
  items += [(g + 1, 0, 0, 0)] * (n_items - len(items))
  return tuple(np.array(c, np.int32) for c in zip(*items))


def group_row_blocks(group_sizes, m: int, br: int):
  """Per group: (start, end, first aligned block of br rows, number of blocks covering [start, end))."""
  gs = group_sizes.astype(jnp.int32)
  ends = jnp.minimum(jnp.cumsum(gs), m)
  starts = jnp.minimum(ends - gs, ends)
  first = starts // br
  nblk = jnp.where(ends > starts, (ends - 1) // br - first + 1, 0)
  return starts, ends, first, nblk
