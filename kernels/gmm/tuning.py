"""Per-shape tile sizes for the grouped-matmul kernels, measured offline (bench/gmm.py --sweep) on an H200.

Nothing is tuned at call time: `lookup` reads this table, keyed by (backend, op, contraction dim,
output dim), with M bucketed to a power of two when the table has an M-specific row; a shape not in
the table gets `default_config`, a safe choice for any shape.

Ops: "gmm" (lhs [M,K] @ w[g] [K,N]), "gmm_t" (lhs [M,N] @ w[g].T), "tgmm" (lhs[g].T @ rhs[g]).
An op may carry the suffix "+gather" (operand rows read through an index, `fused_dispatch`): rows
for it are looked up first and fall back to the plain op's rows (gathered rows from a token array
larger than L2 can want other tiles).

For gmm/gmm_t: kc = contraction dim, no = output dim. For tgmm: kc = K (rows of the output tile),
no = N (output cols); bm/bn then give the output tile and bk the rows accumulated per step.

Pallas TPU (backend "megablox", kernels/gmm/megablox_gmm.py) rows are keyed by TPU generation: backend
"megablox/<gen>" (`umoe_jax.ops.pallas_tpu.generation`: "v5e", "v5p", "v6e", ...), e.g.
("megablox/v6e", "gmm", 768, 192). bm / bk / bn are megablox's (tm, tk, tn) for gmm and gmm_t, and
(tk, tn) output tile + tm rows per step for tgmm, as above. The table holds no TPU row:
`default_config` gives each generation a starting tile sized to its scoped-VMEM default, and
`bench/gmm.py --sweep --sweep-backends=megablox` on a TPU prints measured rows for this table.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Optional


@dataclasses.dataclass(frozen=True)
class TileConfig:
  bm: int
  bn: int
  bk: int
  num_warps: int = 8
  num_stages: int = 3
  # Mosaic GPU only: pipeline depth and column-block grouping of the persistent schedule.
  grid_block_n: int = 1
  # Triton gmm / gmm_t: 0 = one program per tile; p = a persistent grid of p programs per SM
  # looping over the tiles (flattened loop: the next tile's loads overlap this tile's stores).
  persistent: int = 0
  warp_specialize: bool = False
  # Triton gmm with a row dot (gmm_combine's backward) only: load the epilogue's operand tile (the
  # pre-activations) before the contraction, its latency hidden behind the matmul.
  prefetch_row_dot: bool = False
  # Triton gmm with a row dot only: the kernel writes the plain float32 product (no epilogue
  # registers: a plain matmul's tile) and XLA applies the epilogue (umoe_jax.ops.epilogue).
  xla_epilogue: bool = False


# (backend, op, kc, no) or (backend, op, kc, no, m_bucket(M)) -> config: the fastest tiles of the
# H200 sweeps (bench/gmm.py --sweep), TFLOP/s at the bench shape in the comments (the Triton rows'
# figures at UMoE-base's FFN shape: 2026-11-29-h200-fwd_tflops-97a81b91 and the rows beside it).
_C = TileConfig
TABLE: dict[tuple, TileConfig] = {
    # (bm, bn, bk, num_warps, num_stages). Triton: bn may be two powers of two (192 = 128 + 64).
    ("triton", "gmm", 768, 192): _C(128, 192, 32, 8, 8),     # base-up 421, base-att 341
    # M-specific rows (key ends with tuning.m_bucket(M)): 256-row tiles halve the weight-tile
    # reloads per output row.
    ("triton", "gmm", 768, 192, 1 << 19): _C(256, 192, 64, 8, 4),  # base-up 461
    ("triton", "gmm", 768, 192, 1 << 17): _C(256, 192, 64, 8, 4),  # base-att 347
    ("triton", "gmm_t", 192, 768): _C(128, 128, 64, 4, 3),   # base-up dgrad 275, base-att 246
    # base-up dgrad as gather_gmm's backward calls it (rows in expert order, M ~ 2^19): the same
    # tile on a persistent grid of 2 programs an SM, 401 against 269.
    ("triton", "gmm_t", 192, 768, 1 << 19): _C(128, 128, 64, 4, 3, persistent=2),
    ("triton", "tgmm", 768, 192): _C(128, 192, 64, 8, 3),    # base-up wgrad 422
    ("triton", "gmm", 192, 768): _C(128, 128, 64, 4, 3, persistent=2),  # base-down 395
    ("triton", "gmm_t", 768, 192): _C(128, 192, 64, 8, 5),   # base-down dgrad 428
    ("triton", "tgmm", 192, 768): _C(64, 128, 64, 4, 4),     # base-down wgrad 401
    ("triton", "gmm", 2048, 512): _C(128, 256, 64, 8, 4, persistent=2),  # large-up 711
    ("triton", "gmm_t", 512, 2048): _C(128, 128, 64, 4, 3),  # large-up dgrad 497
    ("triton", "tgmm", 2048, 512): _C(128, 256, 64, 8, 3),   # large-up wgrad 729
    ("triton", "gmm", 512, 2048): _C(128, 256, 64, 8, 3, persistent=1),  # large-down 591
    ("triton", "gmm_t", 2048, 512): _C(128, 256, 64, 8, 3),  # large-down dgrad 667
    ("triton", "tgmm", 512, 2048): _C(128, 256, 64, 8, 3),   # large-down wgrad 708
    # The calls of umoe_jax.ops.fused_dispatch (rows gathered through the sort order; bench/gmm.py
    # --sweep-gathered): gathered vs the plain op's row at the same call. The tgmm rows are swept
    # in group order; the largest-groups-first order under skewed routing (triton_gmm.tile_order,
    # 2026-12-04-h200-ms-df61abc1) takes the two base rows to 433 and 389 TFLOP/s at
    # Dirichlet-skewed sizes, so a sweep with the order on may pick other tiles.
    ("triton", "tgmm+gather", 768, 192, 1 << 19): _C(128, 192, 64, 8, 5),   # base-up wgrad 342 (300)
    ("triton", "gmm+gather", 2048, 512, 1 << 18): _C(256, 128, 64, 8, 3),   # large-up 613 (478)
    ("triton", "gmm_t+gather", 2048, 512, 1 << 18): _C(128, 256, 64, 8, 4),  # large-down dgrad 552 (541)
    # base-down dgrad as gmm_combine's backward calls it (gathered dout, the silu epilogue: row dot
    # with act(z), times act'(z), gate scale): the epilogue's registers want narrow tiles (256-row
    # tiles: 72 TFLOP/s). Timed with that epilogue only; the same call without an activation
    # (moe.fuse_activation off) looks this row up too. With the epilogue's sigmoid from tanh.approx
    # (triton_gmm._sigmoid): 64x192x64 / 4 warps / 3 stages with z loaded before the contraction,
    # two programs an SM, 0.438 ms (331 TFLOP/s) against 0.456 for the 128x192x64 / 8 / 4 tile; at
    # the attention pool's 2^17 rows 0.105 against 0.123 for the plain op's row. ptxas reports
    # 108-128 B of spills a thread at these tiles with tanh.approx: timed faster regardless.
    ("triton", "gmm_t+gather", 768, 192, 1 << 19): _C(64, 192, 64, 4, 3, prefetch_row_dot=True),
    ("triton", "gmm_t+gather", 768, 192, 1 << 17): _C(64, 192, 64, 4, 3, prefetch_row_dot=True),
    # base-down wgrad as gmm_combine calls it (gate-scaled rows, gathered output gradient):
    ("triton", "tgmm+gather", 192, 768, 1 << 19): _C(64, 128, 64, 4, 5),    # 302 (4 stages: 289)
    ("triton", "tgmm+gather", 2048, 512, 1 << 18): _C(128, 256, 64, 8, 5),  # large-up wgrad 671 (525)
    # Mosaic GPU: num_stages = pipeline depth (max_concurrent_steps); num_warps unused.
    ("mosaic", "gmm", 768, 192): _C(128, 192, 64, num_stages=3),     # base-up 403, base-att 271
    ("mosaic", "gmm_t", 192, 768): _C(128, 192, 64, num_stages=3),   # base-up dgrad 258
    ("mosaic", "tgmm", 768, 192): _C(128, 64, 64, num_stages=4),     # base-up wgrad 338
    ("mosaic", "gmm", 192, 768): _C(128, 192, 64, num_stages=3),     # base-down 257
    ("mosaic", "gmm_t", 768, 192): _C(128, 192, 64, num_stages=3),   # base-down dgrad 403
    ("mosaic", "tgmm", 192, 768): _C(64, 128, 64, num_stages=4),     # base-down wgrad 289
    ("mosaic", "gmm", 2048, 512): _C(128, 128, 64, num_stages=6),    # large-up 648
    ("mosaic", "gmm_t", 512, 2048): _C(128, 128, 64, num_stages=4),  # large-up dgrad 444
    ("mosaic", "tgmm", 2048, 512): _C(128, 128, 64, num_stages=4),   # large-up wgrad 626
    ("mosaic", "gmm", 512, 2048): _C(128, 128, 64, num_stages=4),    # large-down 446
    ("mosaic", "gmm_t", 2048, 512): _C(128, 128, 64, num_stages=6),  # large-down dgrad 649
    ("mosaic", "tgmm", 512, 2048): _C(128, 128, 64, num_stages=4),   # large-down wgrad 503
}


def _width_ok(w: int) -> bool:
  hi = 1 << (w.bit_length() - 1)
  rest = w - hi
  return rest == 0 or (rest & (rest - 1)) == 0


# Pallas TPU starting tiles per generation, (gmm (bm, bk, bn), tgmm (bm, bn, bk)): double-buffered
# bf16 operand blocks + output blocks + a float32 accumulator under the default scoped VMEM (16 MiB
# on v4 / v5e / v5p, 32 MiB on v6e): gmm 512 x 1024 x 1024 takes ~10 MiB, tgmm 512 x 1024 out x 512
# rows ~9 MiB. Widths are multiples of 256 (v6e's MXU is 256 x 256; 128 x 128 before it).
MEGABLOX_DEFAULTS: dict[str, tuple[tuple[int, int, int], tuple[int, int, int]]] = {
    "v4": ((512, 512, 512), (512, 512, 512)),
    "v5e": ((512, 1024, 1024), (512, 1024, 512)),
    "v5p": ((512, 1024, 1024), (512, 1024, 512)),
    "v6e": ((512, 1024, 1024), (1024, 1024, 512)),
}


def default_config(backend: str, op: str, m: int, kc: int, no: int, g: int) -> TileConfig:
  """A sane tile for any shape: wide output tiles where the output width allows."""
  del m, g
  if backend.startswith("megablox"):
    gen = backend.partition("/")[2]
    mm, tg = MEGABLOX_DEFAULTS.get(gen, MEGABLOX_DEFAULTS["v5e"])
    bm, bx, by = tg if op == "tgmm" else mm
    return TileConfig(bm=bm, bk=bx, bn=by) if op != "tgmm" else TileConfig(bm=bm, bn=bx, bk=by)
  if backend == "triton":
    if op == "tgmm":
      bm = 128 if kc >= 128 else 64
      bn = no if no in (64, 128, 192, 256) else (128 if no >= 128 else 64)
      return TileConfig(bm=bm, bn=bn, bk=64, num_warps=8, num_stages=3)
    bn = no if no in (64, 128, 192, 256) else (256 if no % 256 == 0 else 128 if no >= 128 else 64)
    bk = 64
    return TileConfig(bm=128, bn=bn, bk=bk, num_warps=8, num_stages=3 if bn > 128 else 4)
  # mosaic: one warpgroup holds the (bm, bn) float32 accumulator, so bm * bn <= 128 * 128 * 1.5.
  if op == "tgmm":
    return TileConfig(bm=128 if kc % 128 == 0 else 64, bn=128 if no % 128 == 0 else 64, bk=64,
                      num_stages=4)
  if no % 256 == 0:
    return TileConfig(bm=64, bn=256, bk=64, num_stages=4)
  if no % 192 == 0:
    return TileConfig(bm=64, bn=192, bk=64, num_stages=4)
  return TileConfig(bm=128 if no % 128 == 0 else 64, bn=128 if no % 128 == 0 else 64, bk=64, num_stages=4)


# Shared memory a Hopper block may take (227 KB, the opt-in maximum; the Triton tiles here are
# tuned for Hopper, and an A100 block takes at most 163 KB). A Triton grouped matmul's
# software pipeline holds `num_stages` copies of both bf16 operand tiles (bench/kernel_resources.py
# reports exactly that for gmm / gmm_t); the persistent form stages its epilogue too (8-32 KB
# there). A candidate over the limit fails at launch, so the sweep does not spend time on it.
HOPPER_SHARED_BYTES = 227 * 1024


def triton_gmm_shared_bytes(cfg: TileConfig) -> int:
  """Shared memory of a Triton gmm / gmm_t launch at `cfg` (an upper estimate when persistent)."""
  per_stage = 2 * (cfg.bm * cfg.bk + cfg.bk * cfg.bn)
  return cfg.num_stages * per_stage + (32 * 1024 if cfg.persistent else 0)


def m_bucket(m: int) -> int:
  """Rows bucketed to the nearest power of two (the key of M-specific TABLE rows)."""
  return 1 << max(0, round(math.log2(max(int(m), 1))))


def lookup(backend: str, op: str, m: int, kc: int, no: int, g: int,
           table: Optional[dict] = None) -> TileConfig:
  table = TABLE if table is None else table
  cfg = None
  for key_op in dict.fromkeys((op, op.split("+")[0])):  # "gmm+gather" falls back to "gmm"
    cfg = cfg or table.get((backend, key_op, int(kc), int(no), m_bucket(m)))
    cfg = cfg or table.get((backend, key_op, int(kc), int(no)))
  if cfg is None:
    cfg = default_config(backend, op.split("+")[0], m, kc, no, g)
  if backend == "triton" and not _width_ok(cfg.bn):
    raise ValueError(f"triton tile width {cfg.bn} must be a power of two or a sum of two")
  if backend == "triton" and op.split("+")[0] == "tgmm" and not _width_ok(cfg.bm):
    raise ValueError(f"triton tgmm tile rows {cfg.bm} must be a power of two or a sum of two")
  return cfg


def candidates(backend: str, op: str, kc: int, no: int, m: int = 0) -> list[TileConfig]:
  """Tile configs the offline sweep (bench/gmm.py --sweep) tries for one (op, kc, no); the first is
  what `lookup` gives now."""
  plain = op.split("+")[0]
  out = [lookup(backend, op, m, kc, no, 0)]
  # tgmm runs one program a tile (`triton_gmm.tgmm_launch`): no persistent candidates for it.
  tiled_grid_only = plain == "tgmm"
  if backend == "triton" and op.endswith("+gather"):
    # Gathered rows arrive with more latency (one index load, rows scattered over HBM): deeper
    # pipelines of the current tile first.
    if plain == "gmm_t":  # gmm_combine's input gradient: its row-dot epilogue's operand early
      out.append(dataclasses.replace(out[0], prefetch_row_dot=not out[0].prefetch_row_dot,
                                     xla_epilogue=False))
      # ... or the epilogue left to XLA, the kernel on a plain matmul's tile of these widths (the
      # gathered forward's, the plain dgrad's): the epilogue's registers halve the tile's speed.
      for plain_op in ("gmm+gather", "gmm_t"):
        tile = lookup(backend, plain_op, m, kc, no, 0)
        out.append(dataclasses.replace(tile, xla_epilogue=True, prefetch_row_dot=False))
    for ns in (out[0].num_stages + 1, out[0].num_stages + 2):
      out.append(dataclasses.replace(out[0], num_stages=ns))
      if not tiled_grid_only:
        out.append(dataclasses.replace(out[0], num_stages=ns, persistent=1))
  if backend.startswith("megablox"):  # (tm, tk, tn) for gmm, (tk, tn, tm) for tgmm: 128-multiples
    for a, b, c in ((256, 512, 512), (512, 512, 1024), (512, 1024, 512), (1024, 1024, 1024),
                    (256, 1024, 1024), (1024, 512, 512)):
      out.append(TileConfig(bm=a, bn=b, bk=c) if plain == "tgmm" else TileConfig(bm=a, bk=b, bn=c))
  elif backend == "triton":
    if plain == "tgmm":
      widths = sorted({w for w in (64, 128, 192, 256) if w <= max(no, 64) and _width_ok(w)})
      for bm, bn, bk, nw, ns in ((128, 128, 64, 8, 3), (128, 128, 32, 4, 4), (64, 128, 64, 4, 4),
                                 (128, 256, 64, 8, 3), (128, 192, 64, 8, 3), (256, 128, 64, 8, 3)):
        if bn in widths or bn <= no:
          out.append(TileConfig(bm, bn, bk, nw, ns))
      # All of a 192-row output side in one tile (128 + 64 rows, two accumulators sharing each
      # step's rows of the other operand): in a torch + Triton probe of UMoE-base's down-projection
      # weight gradient 471 TFLOP/s against 382 for the tabled 64 x 128 tile in the same kernel
      # (401 in the library's); at the gathered call the step makes, no gain, so not tabled. (N a
      # multiple of the widest candidate's 128 columns.)
      if kc % 192 == 0 and no % 128 == 0:
        for bn, bk, nw, ns in ((128, 64, 4, 4), (128, 64, 8, 4), (128, 64, 4, 5), (64, 64, 4, 4)):
          out.append(TileConfig(192, bn, bk, nw, ns))
    else:
      base = out[0]
      # 64-row tiles that fit two programs on an SM (255 registers x 4 warps; 96 KB), so one
      # program's epilogue overlaps the other's matmul: what the short-contraction dgrad with the
      # activation epilogue (768 -> 192, 12 K steps a tile) lacks at one 8-warp program per SM.
      for bm, bn, bk, nw, ns in ((64, 192, 64, 4, 3), (64, 192, 32, 4, 6)):
        if no % bn == 0:
          out.append(TileConfig(bm, bn, bk, nw, ns))
          if op == "gmm_t+gather":
            out.append(TileConfig(bm, bn, bk, nw, ns, prefetch_row_dot=True))
      # With each column piece's epilogue stored before the next piece's, these compile for sm_90a
      # without spills at 768 -> 192 with the silu epilogue: the wide 8-warp tiles with z loaded
      # early, and a 128-row 8-warp tile at 128 registers, which leaves room for two programs an SM.
      if op == "gmm_t+gather" and no == 192:   # UMoE-base's expert width, where they were surveyed
        out += [TileConfig(128, 192, 64, 8, 4, prefetch_row_dot=True), TileConfig(128, 64, 64, 8, 3),
                TileConfig(128, 128, 64, 8, 4, prefetch_row_dot=True)]
      # Narrower K steps and 64-row tiles (a capped sweep tries these early).
      for bm, bn, bk, nw, ns in ((64, 192, 64, 8, 3), (128, 192, 32, 8, 4), (128, 128, 32, 8, 4),
                                 (64, 128, 32, 4, 4), (64, 64, 64, 4, 3)):
        if bn <= max(no, 64) and (no % bn == 0 or no < bn):
          out.append(TileConfig(bm, bn, bk, nw, ns))
      # Deeper 256-row tiles for the 768 -> 192 shapes (a capped sweep tries these early).
      for bm, bn, bk, nw, ns in ((256, 192, 64, 8, 4), (256, 192, 32, 8, 6)):
        if no % bn == 0:
          out.append(TileConfig(bm, bn, bk, nw, ns))
      # The tabled tile as a persistent grid (1 or 2 programs per SM, flattened loop so the next
      # tile's loads overlap this tile's stores; once with warp specialisation), and 256-row tiles,
      # which halve the weight-tile reloads per output row.
      for p, ws in ((1, False), (2, False), (1, True)):
        out.append(dataclasses.replace(base, persistent=p, warp_specialize=ws))
      for bm, bn, bk, nw, ns, p in ((256, 128, 64, 8, 3, 0), (256, 128, 64, 8, 3, 1),
                                    (128, 256, 64, 8, 3, 1), (128, 128, 64, 4, 3, 2),
                                    (128, 192, 64, 8, 4, 1), (256, 192, 64, 8, 3, 0)):
        if bn <= max(no, 64) and (no % bn == 0 or bn == 64 or no < bn):
          out.append(TileConfig(bm, bn, bk, nw, ns, persistent=p))
  else:
    if plain == "tgmm":
      for bm, bn, bk, ns in ((128, 128, 64, 4), (64, 128, 64, 4), (128, 64, 64, 4), (128, 128, 32, 6)):
        if kc % bm == 0 and no % bn == 0:
          out.append(TileConfig(bm, bn, bk, num_stages=ns))
    else:
      for bm, bn, ns in ((64, 256, 4), (128, 128, 4), (64, 192, 4), (128, 192, 3), (128, 128, 6)):
        if no % bn == 0:
          out.append(TileConfig(bm, bn, 64, num_stages=ns))
  seen, uniq = set(), []
  for i, c in enumerate(out):
    too_big = (backend == "triton" and plain != "tgmm"
               and triton_gmm_shared_bytes(c) > HOPPER_SHARED_BYTES)
    if c not in seen and (i == 0 or not too_big):
      seen.add(c)
      uniq.append(c)
  return uniq


# ----------------------------------------------------------------------------------------------
# Sweep results as files: bench/gmm.py writes the rows it found, bench/train_step.py (--gmm_tiles)
# loads them, so a sweep's tiles can be timed in the step before they are pasted into TABLE.
# One JSON object: {"backend|op|kc|no[|m_bucket]": {"bm": .., "bn": .., "bk": .., ...}}.


def _key_text(key: tuple) -> str:
  return "|".join(str(part) for part in key)


def rows_to_json(rows: dict) -> dict:
  """{TABLE key: TileConfig} -> the JSON object `load_table` reads."""
  return {_key_text(key): dataclasses.asdict(cfg) for key, cfg in rows.items()}


def load_table(path: str, table: Optional[dict] = None) -> dict:
  """Adds the rows of a JSON file (`rows_to_json`'s form) to TABLE (or `table`); returns them.
  A bad key or tile names the file and the entry."""
  table = TABLE if table is None else table
  try:
    with open(path) as f:
      entries = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f"gmm tiles file {path}: {e}") from None
  if not isinstance(entries, dict):
    raise ValueError(f"gmm tiles file {path}: expected a JSON object of rows, got {type(entries).__name__}")
  fields = {f.name for f in dataclasses.fields(TileConfig)}
  rows = {}
  for text, obj in entries.items():
    parts = text.split("|")
    try:
      if len(parts) not in (4, 5) or not parts[0] or not parts[1]:
        raise ValueError
      key = (parts[0], parts[1]) + tuple(int(p) for p in parts[2:])
    except ValueError:
      raise ValueError(f"gmm tiles file {path}: key {text!r} is not 'backend|op|kc|no[|m_bucket]'"
                       ) from None
    if (not isinstance(obj, dict) or not {"bm", "bn", "bk"} <= set(obj) or set(obj) - fields
        or not all(isinstance(v, int) for v in obj.values())):
      raise ValueError(f"gmm tiles file {path}: entry {text!r} must give bm, bn, bk (and optionally "
                       f"{', '.join(sorted(fields - {'bm', 'bn', 'bk'}))}) as integers, got {obj!r}")
    cfg = TileConfig(**obj)
    if key[0] == "triton" and not _width_ok(cfg.bn):
      raise ValueError(f"gmm tiles file {path}: entry {text!r}: triton tile width {cfg.bn} must be "
                       "a power of two or a sum of two")
    rows[key] = cfg
  table.update(rows)
  return rows
