"""The Triton kernels of the pre-mixing attention core (kernels/attention/triton_attention.py, whose docstring
says what each computes and how the JAX side launches and composes them).

Grid axis 1 = batch in every kernel; q is [B, T*H, dk] (the H heads of a position are consecutive
rows), k [B, T, dk], values / dO [B, T, D] and [B, T*H, D]; softmax statistics in float32, base-2
exponentials (`LOG2E` folded into the score scale). Helpers (`_scores`, `_probs_t`, `_stored_t`, the
per-step bodies) are shared by the forward and the backward kernels, which is why they live together.

Key width: every [rows, dk] tile (q, k, dQ, dK) is held as two column pieces, [rows, DK1] and
[rows, DK2S] from column DK1 (`_rows_load`), and every product over dk is the sum of the pieces'
products (`_dot_t`, `_dot_acc`). DK2 = 0 is the one-piece layout: DK1 = dk padded to a power of two
(masked loads; the second piece is a unused [rows, 1] zero tile). DK1 + DK2 = dk splits a width of two
powers of two exactly (192 = 128 + 64; tiles.key_pieces), so no tensor-core work goes to
padding columns.
"""
from __future__ import annotations

from kernels.triton_base import HAVE_TRITON

if HAVE_TRITON:
  import triton
  import triton.language as tl

LOG2E = 1.4426950408889634

if HAVE_TRITON:

  @triton.jit
  def _rows_load(base, rows, ok, W: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr,
                 C2S: tl.constexpr, MASK: tl.constexpr):
    """Rows `rows` [R] of a row-major [*, W] array as two column pieces (module docstring): [R, C1]
    and [R, C2S] from column C1 (a zero tile when C2 == 0), columns past W zero; rows masked by ok
    [R] when MASK."""
    c1 = tl.arange(0, C1)
    ptrs = base + rows[:, None] * W
    if MASK:
      a = tl.load(ptrs + c1[None, :], mask=ok[:, None] & (c1 < W)[None, :], other=0.0)
    else:
      a = tl.load(ptrs + c1[None, :], mask=(c1 < W)[None, :], other=0.0)
    if C2 > 0:
      c2 = C1 + tl.arange(0, C2S)
      if MASK:
        b = tl.load(ptrs + c2[None, :], mask=ok[:, None] & (c2 < W)[None, :], other=0.0)
      else:
        b = tl.load(ptrs + c2[None, :], mask=(c2 < W)[None, :], other=0.0)
    else:
      b = tl.zeros((a.shape[0], C2S), a.dtype)
    return a, b

  @triton.jit
  def _rows_store(base, rows, ok, a, b, W: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr,
                  C2S: tl.constexpr):
    """`_rows_load`'s writer: the pieces a [R, C1] and b [R, C2S] into rows `rows` (ok [R]) of a
    row-major [*, W] array (columns past W left out)."""
    c1 = tl.arange(0, C1)
    ptrs = base + rows[:, None] * W
    tl.store(ptrs + c1[None, :], a, mask=ok[:, None] & (c1 < W)[None, :])
    if C2 > 0:
      c2 = C1 + tl.arange(0, C2S)
      tl.store(ptrs + c2[None, :], b, mask=ok[:, None] & (c2 < W)[None, :])

  @triton.jit
  def _dot_t(a1, a2, b1, b2, C2: tl.constexpr):
    """[R, S] float32 = a b^T for a [R, dk] and b [S, dk] held in their two key pieces."""
    s = tl.dot(a1, tl.trans(b1))
    if C2 > 0:
      s = tl.dot(a2, tl.trans(b2), s)
    return s

  @triton.jit
  def _dot_acc(x, b1, b2, acc1, acc2, C2: tl.constexpr):
    """(acc1 + x b1, acc2 + x b2): x [R, S] times b [S, dk] into the two key pieces' accumulators."""
    acc1 = tl.dot(x, b1, acc1)
    if C2 > 0:
      acc2 = tl.dot(x, b2, acc2)
    return acc1, acc2

  @triton.jit
  def _scores(q1, q2, k_base, keys, pos, T, DK: tl.constexpr, DK1: tl.constexpr,
              DK2: tl.constexpr, DK2S: tl.constexpr, qk_scale, MASK: tl.constexpr):
    """[BM, BN] base-2 scores of the row tile q (pieces q1, q2) against keys (masked past the
    diagonal and past T when MASK), and the key tile's pieces [BN, DK1], [BN, DK2S] (reused by
    the dQ pass)."""
    k1, k2 = _rows_load(k_base, keys, keys < T, DK, DK1, DK2, DK2S, MASK)
    s = _dot_t(q1, q2, k1, k2, DK2) * qk_scale
    if MASK:
      s = tl.where((keys[None, :] <= pos[:, None]) & (keys < T)[None, :], s, float("-inf"))
    return s, k1, k2

  @triton.jit
  def _fwd_step(q1, q2, k_base, v_base, s0, offs_n, d1, d2, pos, m_i, l_i, acc1, acc2, T,
                DK: tl.constexpr, DK1: tl.constexpr, DK2: tl.constexpr, DK2S: tl.constexpr,
                D: tl.constexpr, BD2: tl.constexpr, qk_scale, MASK: tl.constexpr):
    keys = s0 + offs_n
    s, _, _ = _scores(q1, q2, k_base, keys, pos, T, DK, DK1, DK2, DK2S, qk_scale, MASK)
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p = p.to(v_base.dtype.element_ty)
    key_ok = keys < T
    v1 = tl.load(v_base + keys[:, None] * D + d1[None, :], mask=key_ok[:, None] & (d1 < D)[None, :],
                 other=0.0)
    acc1 = tl.dot(p, v1, acc1 * alpha[:, None])
    if BD2 > 0:
      v2 = tl.load(v_base + keys[:, None] * D + d2[None, :],
                   mask=key_ok[:, None] & (d2 < D)[None, :], other=0.0)
      acc2 = tl.dot(p, v2, acc2 * alpha[:, None])
    return m_new, l_i, acc1, acc2

  @triton.jit
  def _fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, T: tl.constexpr, H: tl.constexpr,
                  DK: tl.constexpr, D: tl.constexpr, qk_scale: tl.constexpr, DK1: tl.constexpr,
                  DK2: tl.constexpr, DK2S: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  BD1: tl.constexpr, BD2: tl.constexpr, BD2S: tl.constexpr,
                  N_ROW_TILES: tl.constexpr, N_CHUNKS: tl.constexpr):
    # q [B, T*H, DK], k [B, T, DK], v [B, T, D] -> o [B, T*H, D], lse [B, T*H] (base 2).
    pid, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    TH: tl.constexpr = T * H
    tile = N_ROW_TILES - 1 - pid // N_CHUNKS  # the longest rows (most keys) first
    c = pid % N_CHUNKS
    r0 = tile * BM
    rows = r0 + tl.arange(0, BM)
    row_ok = rows < TH
    pos = rows // H
    offs_n = tl.arange(0, BN)
    d1 = c * (BD1 + BD2) + tl.arange(0, BD1)
    d2 = c * (BD1 + BD2) + BD1 + tl.arange(0, BD2S)
    q1, q2 = _rows_load(q_ptr + b * (TH * DK), rows, row_ok, DK, DK1, DK2, DK2S, True)
    k_base = k_ptr + b * (T * DK)
    v_base = v_ptr + b * (T * D)
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    acc1 = tl.zeros((BM, BD1), tl.float32)
    acc2 = tl.zeros((BM, BD2S), tl.float32)
    pos_min = r0 // H
    pos_end = tl.minimum((r0 + BM - 1) // H, T - 1) + 1  # keys [0, pos_end) are seen by some row
    n_full = (pos_min + 1) // BN  # tiles every row of the tile sees whole
    for j in range(0, n_full):
      m_i, l_i, acc1, acc2 = _fwd_step(q1, q2, k_base, v_base, j * BN, offs_n, d1, d2, pos,
                                       m_i, l_i, acc1, acc2, T, DK, DK1, DK2, DK2S, D, BD2,
                                       qk_scale, False)
    for j in range(n_full, tl.cdiv(pos_end, BN)):
      m_i, l_i, acc1, acc2 = _fwd_step(q1, q2, k_base, v_base, j * BN, offs_n, d1, d2, pos,
                                       m_i, l_i, acc1, acc2, T, DK, DK1, DK2, DK2S, D, BD2,
                                       qk_scale, True)
    inv = 1.0 / l_i
    o_rows = o_ptr + b * (TH * D) + rows[:, None] * D
    tl.store(o_rows + d1[None, :], (acc1 * inv[:, None]).to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (d1 < D)[None, :])
    if BD2 > 0:
      tl.store(o_rows + d2[None, :], (acc2 * inv[:, None]).to(o_ptr.dtype.element_ty),
               mask=row_ok[:, None] & (d2 < D)[None, :])
    if c == 0:
      tl.store(lse_ptr + b * TH + rows, m_i + tl.math.log2(l_i), mask=row_ok)

  @triton.jit
  def _probs_t(k1, k2, q_base, lse_base, rows, keys, TH, T, H: tl.constexpr, DK: tl.constexpr,
               DK1: tl.constexpr, DK2: tl.constexpr, DK2S: tl.constexpr, qk_scale,
               MASK: tl.constexpr):
    """Key-major passes: P^T [BN, BM] for the key tile (pieces k1, k2) and query rows, and the
    query tile's pieces [BM, DK1], [BM, DK2S]."""
    row_ok = rows < TH
    q1, q2 = _rows_load(q_base, rows, row_ok, DK, DK1, DK2, DK2S, MASK)
    if MASK:
      lse = tl.load(lse_base + rows, mask=row_ok, other=0.0)
    else:
      lse = tl.load(lse_base + rows)
    pt = tl.math.exp2(_dot_t(k1, k2, q1, q2, DK2) * qk_scale - lse[None, :])
    if MASK:
      pos = rows // H
      pt = tl.where((keys[:, None] <= pos[None, :]) & row_ok[None, :], pt, 0.0)
    return pt, q1, q2

  @triton.jit
  def _stored_t(base, rows, keys, TH, T, H: tl.constexpr, MASK: tl.constexpr):
    """A [BN keys, BM rows] tile of a key-major [T, T*H] array the dK pass stored (P^T or dS^T):
    zeros past the diagonal, past T and past T*H when MASK (the dK pass left those unwritten)."""
    key_ok = keys < T
    ptrs = base + keys.to(tl.int64)[:, None] * TH + rows[None, :]
    if MASK:
      ok = key_ok[:, None] & (rows < TH)[None, :] & (keys[:, None] <= (rows // H)[None, :])
    else:  # (rows past T*H: a reader's partial last row tile, which may run past the array's end)
      ok = key_ok[:, None] & (rows < TH)[None, :]
    return tl.load(ptrs, mask=ok, other=0.0)

  @triton.jit
  def _store_t(base, rows, keys, tile, TH, T):
    """`_stored_t`'s writer: a [BN keys, BM rows] tile into a key-major [T, T*H] array (the keys
    past T and rows past T*H left out)."""
    tl.store(base + keys.to(tl.int64)[:, None] * TH + rows[None, :], tile,
             mask=(keys < T)[:, None] & (rows < TH)[None, :])

  @triton.jit
  def _dx_step(k1, k2, q_base, lse_base, do_base, p_base, r, offs_m, keys, d1, d2, acc1, acc2,
               TH, T, H: tl.constexpr, DK: tl.constexpr, DK1: tl.constexpr, DK2: tl.constexpr,
               DK2S: tl.constexpr, D: tl.constexpr, BD2: tl.constexpr, qk_scale,
               MASK: tl.constexpr, LOAD_P: tl.constexpr):
    rows = r + offs_m
    if LOAD_P:
      pt = _stored_t(p_base, rows, keys, TH, T, H, MASK)
    else:
      pt, _, _ = _probs_t(k1, k2, q_base, lse_base, rows, keys, TH, T, H, DK, DK1, DK2, DK2S,
                          qk_scale, MASK)
      pt = pt.to(do_base.dtype.element_ty)
    row_ok = rows < TH
    do1 = tl.load(do_base + rows[:, None] * D + d1[None, :],
                  mask=row_ok[:, None] & (d1 < D)[None, :], other=0.0)
    acc1 = tl.dot(pt, do1, acc1)
    if BD2 > 0:
      do2 = tl.load(do_base + rows[:, None] * D + d2[None, :],
                    mask=row_ok[:, None] & (d2 < D)[None, :], other=0.0)
      acc2 = tl.dot(pt, do2, acc2)
    return acc1, acc2

  @triton.jit
  def _row_blocks(s0, TH, H: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Key-major passes over the rows that see key tile [s0, s0 + BN): rows from s0 * H on; the
    first `n_diag` BM-blocks straddle the diagonal (masked), then `n_full` whole unmasked blocks,
    then at most one partial block (masked) up to T * H."""
    r_start = s0 * H
    n_diag = tl.cdiv(tl.minimum(BN * H, TH - r_start), BM)
    r_full = r_start + n_diag * BM
    n_full = tl.maximum(TH - r_full, 0) // BM
    r_tail = r_full + n_full * BM
    return r_start, n_diag, r_full, n_full, r_tail

  @triton.jit
  def _key_tile(k_ptr, pid, b, T: tl.constexpr, DK: tl.constexpr, DK1: tl.constexpr,
                DK2: tl.constexpr, DK2S: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                BD1: tl.constexpr, BD2: tl.constexpr, BD2S: tl.constexpr, N_CHUNKS: tl.constexpr):
    """The key-major dX passes' program setup: program `pid` of grid axis 0 is (key tile, D chunk
    c), the first key tiles first (they see the most rows); b the sequence. Returns s0, c, keys
    [BN], key_ok, offs_m [BM], the chunk's column pieces d1 [BD1] and d2 [BD2S], and the key
    tile's pieces k1 [BN, DK1], k2 [BN, DK2S]."""
    s0 = (pid // N_CHUNKS) * BN
    c = pid % N_CHUNKS
    keys = s0 + tl.arange(0, BN)
    key_ok = keys < T
    offs_m = tl.arange(0, BM)
    d1 = c * (BD1 + BD2) + tl.arange(0, BD1)
    d2 = c * (BD1 + BD2) + BD1 + tl.arange(0, BD2S)
    k1, k2 = _rows_load(k_ptr + b * (T * DK), keys, key_ok, DK, DK1, DK2, DK2S, True)
    return s0, c, keys, key_ok, offs_m, d1, d2, k1, k2

  @triton.jit
  def _bwd_dx_kernel(q_ptr, k_ptr, do_ptr, lse_ptr, p_ptr, dx_ptr, T: tl.constexpr, H: tl.constexpr,
                     DK: tl.constexpr, D: tl.constexpr, qk_scale: tl.constexpr, DK1: tl.constexpr,
                     DK2: tl.constexpr, DK2S: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     BD1: tl.constexpr, BD2: tl.constexpr, BD2S: tl.constexpr,
                     N_CHUNKS: tl.constexpr, LOAD_P: tl.constexpr = False):
    # dX [B, T, D] = sum over rows of P^T dO (values = X: its whole gradient through the mix);
    # P^T recomputed from q, k and lse, or with LOAD_P read from the dK pass's key-major copy.
    pid, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    TH: tl.constexpr = T * H
    s0, c, keys, key_ok, offs_m, d1, d2, k1, k2 = _key_tile(
        k_ptr, pid, b, T, DK, DK1, DK2, DK2S, BM, BN, BD1, BD2, BD2S, N_CHUNKS)
    q_base, lse_base, do_base = q_ptr + b * (TH * DK), lse_ptr + b * TH, do_ptr + b * (TH * D)
    p_base = p_ptr + b * (T * TH)
    acc1 = tl.zeros((BN, BD1), tl.float32)
    acc2 = tl.zeros((BN, BD2S), tl.float32)
    r_start, n_diag, r_full, n_full, r_tail = _row_blocks(s0, TH, H, BM, BN)
    for i in range(0, n_diag):
      acc1, acc2 = _dx_step(k1, k2, q_base, lse_base, do_base, p_base, r_start + i * BM, offs_m,
                            keys, d1, d2, acc1, acc2, TH, T, H, DK, DK1, DK2, DK2S, D, BD2,
                            qk_scale, True, LOAD_P)
    for i in range(0, n_full):
      acc1, acc2 = _dx_step(k1, k2, q_base, lse_base, do_base, p_base, r_full + i * BM, offs_m,
                            keys, d1, d2, acc1, acc2, TH, T, H, DK, DK1, DK2, DK2S, D, BD2,
                            qk_scale, False, LOAD_P)
    for r in range(r_tail, TH, BM):
      acc1, acc2 = _dx_step(k1, k2, q_base, lse_base, do_base, p_base, r, offs_m, keys, d1, d2,
                            acc1, acc2, TH, T, H, DK, DK1, DK2, DK2S, D, BD2, qk_scale, True,
                            LOAD_P)
    dx_rows = dx_ptr + b * (T * D) + keys[:, None] * D
    tl.store(dx_rows + d1[None, :], acc1.to(dx_ptr.dtype.element_ty),
             mask=key_ok[:, None] & (d1 < D)[None, :])
    if BD2 > 0:
      tl.store(dx_rows + d2[None, :], acc2.to(dx_ptr.dtype.element_ty),
               mask=key_ok[:, None] & (d2 < D)[None, :])

  @triton.jit
  def _dp(a_base, a_rows, a_ok, b_base, b_rows, b_ok, D: tl.constexpr, BDK: tl.constexpr,
          M: tl.constexpr, N: tl.constexpr):
    """[M, N] float32 = a[a_rows, :D] @ b[b_rows, :D]^T, contracted in BDK-wide steps."""
    acc = tl.zeros((M, N), tl.float32)
    offs_d = tl.arange(0, BDK)
    a_ptrs = a_base + a_rows[:, None] * D + offs_d[None, :]
    b_ptrs = b_base + b_rows[:, None] * D + offs_d[None, :]
    for d0 in range(0, D, BDK):
      if D % BDK == 0:
        a = tl.load(a_ptrs, mask=a_ok[:, None], other=0.0)
        bb = tl.load(b_ptrs, mask=b_ok[:, None], other=0.0)
      else:
        d_ok = (d0 + offs_d) < D
        a = tl.load(a_ptrs, mask=a_ok[:, None] & d_ok[None, :], other=0.0)
        bb = tl.load(b_ptrs, mask=b_ok[:, None] & d_ok[None, :], other=0.0)
      acc = tl.dot(a, tl.trans(bb), acc)
      a_ptrs += BDK
      b_ptrs += BDK
    return acc

  @triton.jit
  def _dk_step(k1, k2, q_base, lse_base, delta_base, do_base, x_base, r, offs_m, keys, acc1, acc2,
               TH, T, H: tl.constexpr, DK: tl.constexpr, DK1: tl.constexpr, DK2: tl.constexpr,
               DK2S: tl.constexpr, D: tl.constexpr, BDK: tl.constexpr, BM: tl.constexpr,
               BN: tl.constexpr, qk_scale, MASK: tl.constexpr):
    rows = r + offs_m
    row_ok = rows < TH
    pt, q1, q2 = _probs_t(k1, k2, q_base, lse_base, rows, keys, TH, T, H, DK, DK1, DK2, DK2S,
                          qk_scale, MASK)
    delta = tl.load(delta_base + rows, mask=row_ok, other=0.0)
    dpt = _dp(x_base, keys, keys < T, do_base, rows, row_ok, D, BDK, BN, BM)    # [BN, BM]
    dst = (pt * (dpt - delta[None, :])).to(q1.dtype)
    return _dot_acc(dst, q1, q2, acc1, acc2, DK2)

  @triton.jit
  def _bwd_dk_kernel(q_ptr, k_ptr, x_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr,
                     T: tl.constexpr, H: tl.constexpr, DK: tl.constexpr, D: tl.constexpr,
                     qk_scale: tl.constexpr, sm_scale: tl.constexpr, DK1: tl.constexpr,
                     DK2: tl.constexpr, DK2S: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     BDK: tl.constexpr):
    # dK [B, T, DK].
    pid, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    TH: tl.constexpr = T * H
    s0 = pid * BN
    keys = s0 + tl.arange(0, BN)
    key_ok = keys < T
    offs_m = tl.arange(0, BM)
    k1, k2 = _rows_load(k_ptr + b * (T * DK), keys, key_ok, DK, DK1, DK2, DK2S, True)
    q_base, lse_base, delta_base = q_ptr + b * (TH * DK), lse_ptr + b * TH, delta_ptr + b * TH
    do_base, x_base = do_ptr + b * (TH * D), x_ptr + b * (T * D)
    acc1 = tl.zeros((BN, DK1), tl.float32)
    acc2 = tl.zeros((BN, DK2S), tl.float32)
    r_start, n_diag, r_full, n_full, r_tail = _row_blocks(s0, TH, H, BM, BN)
    for i in range(0, n_diag):
      acc1, acc2 = _dk_step(k1, k2, q_base, lse_base, delta_base, do_base, x_base,
                            r_start + i * BM, offs_m, keys, acc1, acc2, TH, T, H, DK, DK1, DK2,
                            DK2S, D, BDK, BM, BN, qk_scale, True)
    for i in range(0, n_full):
      acc1, acc2 = _dk_step(k1, k2, q_base, lse_base, delta_base, do_base, x_base,
                            r_full + i * BM, offs_m, keys, acc1, acc2, TH, T, H, DK, DK1, DK2,
                            DK2S, D, BDK, BM, BN, qk_scale, False)
    for r in range(r_tail, TH, BM):
      acc1, acc2 = _dk_step(k1, k2, q_base, lse_base, delta_base, do_base, x_base,
                            r, offs_m, keys, acc1, acc2, TH, T, H, DK, DK1, DK2, DK2S, D, BDK, BM,
                            BN, qk_scale, True)
    out_ty = dk_ptr.dtype.element_ty
    _rows_store(dk_ptr + b * (T * DK), keys, key_ok, (acc1 * sm_scale).to(out_ty),
                (acc2 * sm_scale).to(out_ty), DK, DK1, DK2, DK2S)

  @triton.jit
  def _dxdk_step(k1, k2, x1, x2, q_base, lse_base, delta_base, do_base, r, offs_m, keys, d1, d2,
                 first_chunk, acc1, acc2, acc_dk1, acc_dk2, TH, T, H: tl.constexpr,
                 DK: tl.constexpr, DK1: tl.constexpr, DK2: tl.constexpr, DK2S: tl.constexpr,
                 D: tl.constexpr, BD2: tl.constexpr, qk_scale, MASK: tl.constexpr):
    rows = r + offs_m
    row_ok = rows < TH
    pt, q1, q2 = _probs_t(k1, k2, q_base, lse_base, rows, keys, TH, T, H, DK, DK1, DK2, DK2S,
                          qk_scale, MASK)
    ptb = pt.to(do_base.dtype.element_ty)
    do1 = tl.load(do_base + rows[:, None] * D + d1[None, :],
                  mask=row_ok[:, None] & (d1 < D)[None, :], other=0.0)
    acc1 = tl.dot(ptb, do1, acc1)
    dpt = tl.dot(x1, tl.trans(do1))                  # this chunk's part of (dO X^T)^T [BN, BM]
    if BD2 > 0:
      do2 = tl.load(do_base + rows[:, None] * D + d2[None, :],
                    mask=row_ok[:, None] & (d2 < D)[None, :], other=0.0)
      acc2 = tl.dot(ptb, do2, acc2)
      dpt = tl.dot(x2, tl.trans(do2), dpt)
    delta = tl.load(delta_base + rows, mask=row_ok & first_chunk, other=0.0)
    acc_dk1, acc_dk2 = _dot_acc((pt * (dpt - delta[None, :])).to(q1.dtype), q1, q2, acc_dk1,
                                acc_dk2, DK2)
    return acc1, acc2, acc_dk1, acc_dk2

  @triton.jit
  def _bwd_dxdk_kernel(q_ptr, k_ptr, x_ptr, do_ptr, lse_ptr, delta_ptr, dx_ptr, dkp_ptr,
                       T: tl.constexpr, H: tl.constexpr, DK: tl.constexpr, D: tl.constexpr,
                       qk_scale: tl.constexpr, DK1: tl.constexpr, DK2: tl.constexpr,
                       DK2S: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD1: tl.constexpr,
                       BD2: tl.constexpr, BD2S: tl.constexpr, N_CHUNKS: tl.constexpr):
    # Program (key tile, D chunk c): dX[keys, chunk] as _bwd_dx_kernel, and chunk c's share of
    # dK / scale, sum_rows (P * (dO_c X_c^T - [c == 0] delta))^T q, into dkp [B, C, T, DK] float32
    # (dS is linear in dO X^T, so the chunks' shares add up to dS^T q).
    pid, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    TH: tl.constexpr = T * H
    s0, c, keys, key_ok, offs_m, d1, d2, k1, k2 = _key_tile(
        k_ptr, pid, b, T, DK, DK1, DK2, DK2S, BM, BN, BD1, BD2, BD2S, N_CHUNKS)
    x_rows = x_ptr + b * (T * D) + keys[:, None] * D
    x1 = tl.load(x_rows + d1[None, :], mask=key_ok[:, None] & (d1 < D)[None, :], other=0.0)
    if BD2 > 0:
      x2 = tl.load(x_rows + d2[None, :], mask=key_ok[:, None] & (d2 < D)[None, :], other=0.0)
    else:
      x2 = tl.zeros((BN, BD2S), x_ptr.dtype.element_ty)
    q_base, lse_base, delta_base = q_ptr + b * (TH * DK), lse_ptr + b * TH, delta_ptr + b * TH
    do_base = do_ptr + b * (TH * D)
    first_chunk = c == 0
    acc1 = tl.zeros((BN, BD1), tl.float32)
    acc2 = tl.zeros((BN, BD2S), tl.float32)
    acc_dk1 = tl.zeros((BN, DK1), tl.float32)
    acc_dk2 = tl.zeros((BN, DK2S), tl.float32)
    r_start, n_diag, r_full, n_full, r_tail = _row_blocks(s0, TH, H, BM, BN)
    for i in range(0, n_diag):
      acc1, acc2, acc_dk1, acc_dk2 = _dxdk_step(
          k1, k2, x1, x2, q_base, lse_base, delta_base, do_base, r_start + i * BM, offs_m, keys, d1,
          d2, first_chunk, acc1, acc2, acc_dk1, acc_dk2, TH, T, H, DK, DK1, DK2, DK2S, D, BD2,
          qk_scale, True)
    for i in range(0, n_full):
      acc1, acc2, acc_dk1, acc_dk2 = _dxdk_step(
          k1, k2, x1, x2, q_base, lse_base, delta_base, do_base, r_full + i * BM, offs_m, keys, d1,
          d2, first_chunk, acc1, acc2, acc_dk1, acc_dk2, TH, T, H, DK, DK1, DK2, DK2S, D, BD2,
          qk_scale, False)
    for r in range(r_tail, TH, BM):
      acc1, acc2, acc_dk1, acc_dk2 = _dxdk_step(
          k1, k2, x1, x2, q_base, lse_base, delta_base, do_base, r, offs_m, keys, d1, d2,
          first_chunk, acc1, acc2, acc_dk1, acc_dk2, TH, T, H, DK, DK1, DK2, DK2S, D, BD2,
          qk_scale, True)
    dx_rows = dx_ptr + b * (T * D) + keys[:, None] * D
    tl.store(dx_rows + d1[None, :], acc1.to(dx_ptr.dtype.element_ty),
             mask=key_ok[:, None] & (d1 < D)[None, :])
    if BD2 > 0:
      tl.store(dx_rows + d2[None, :], acc2.to(dx_ptr.dtype.element_ty),
               mask=key_ok[:, None] & (d2 < D)[None, :])
    _rows_store(dkp_ptr + (b * N_CHUNKS + c) * (T * DK), keys, key_ok, acc_dk1, acc_dk2, DK, DK1,
                DK2, DK2S)

  @triton.jit
  def _dq_step(q1, q2, k_base, x_base, do_base, s0, offs_n, rows, row_ok, pos, lse, delta, acc1,
               acc2, T, DK: tl.constexpr, DK1: tl.constexpr, DK2: tl.constexpr, DK2S: tl.constexpr,
               D: tl.constexpr, BDK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, qk_scale,
               MASK: tl.constexpr):
    keys = s0 + offs_n
    s, k1, k2 = _scores(q1, q2, k_base, keys, pos, T, DK, DK1, DK2, DK2S, qk_scale, MASK)
    p = tl.math.exp2(s - lse[:, None])  # masked scores are -inf: p = 0
    dp = _dp(do_base, rows, row_ok, x_base, keys, keys < T, D, BDK, BM, BN)       # [BM, BN]
    ds = p * (dp - delta[:, None])
    return _dot_acc(ds.to(k1.dtype), k1, k2, acc1, acc2, DK2)

  @triton.jit
  def _bwd_dq_kernel(q_ptr, k_ptr, x_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, T: tl.constexpr,
                     H: tl.constexpr, DK: tl.constexpr, D: tl.constexpr, qk_scale: tl.constexpr,
                     sm_scale: tl.constexpr, DK1: tl.constexpr, DK2: tl.constexpr,
                     DK2S: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BDK: tl.constexpr,
                     N_ROW_TILES: tl.constexpr):
    pid, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    TH: tl.constexpr = T * H
    r0 = (N_ROW_TILES - 1 - pid) * BM
    rows = r0 + tl.arange(0, BM)
    row_ok = rows < TH
    pos = rows // H
    offs_n = tl.arange(0, BN)
    q1, q2 = _rows_load(q_ptr + b * (TH * DK), rows, row_ok, DK, DK1, DK2, DK2S, True)
    lse = tl.load(lse_ptr + b * TH + rows, mask=row_ok, other=0.0)
    delta = tl.load(delta_ptr + b * TH + rows, mask=row_ok, other=0.0)
    k_base, x_base, do_base = k_ptr + b * (T * DK), x_ptr + b * (T * D), do_ptr + b * (TH * D)
    acc1 = tl.zeros((BM, DK1), tl.float32)
    acc2 = tl.zeros((BM, DK2S), tl.float32)
    pos_end = tl.minimum((r0 + BM - 1) // H, T - 1) + 1
    n_full = (r0 // H + 1) // BN
    for j in range(0, n_full):
      acc1, acc2 = _dq_step(q1, q2, k_base, x_base, do_base, j * BN, offs_n, rows, row_ok, pos, lse,
                            delta, acc1, acc2, T, DK, DK1, DK2, DK2S, D, BDK, BM, BN, qk_scale,
                            False)
    for j in range(n_full, tl.cdiv(pos_end, BN)):
      acc1, acc2 = _dq_step(q1, q2, k_base, x_base, do_base, j * BN, offs_n, rows, row_ok, pos, lse,
                            delta, acc1, acc2, T, DK, DK1, DK2, DK2S, D, BDK, BM, BN, qk_scale,
                            True)
    out_ty = dq_ptr.dtype.element_ty
    _rows_store(dq_ptr + b * (TH * DK), rows, row_ok, (acc1 * sm_scale).to(out_ty),
                (acc2 * sm_scale).to(out_ty), DK, DK1, DK2, DK2S)


  @triton.jit
  def _bwd_ds_kernel(q_ptr, k_ptr, x_ptr, do_ptr, lse_ptr, delta_ptr, ds_ptr, p_ptr,
                     T: tl.constexpr, H: tl.constexpr, DK: tl.constexpr, D: tl.constexpr,
                     qk_scale: tl.constexpr, DK1: tl.constexpr, DK2: tl.constexpr,
                     DK2S: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BDK: tl.constexpr,
                     N_KEY_TILES: tl.constexpr):
    # Program = (row tile, key tile): dS^T and P^T [BN, BM] of one causal tile pair into the
    # key-major [B, T, T*H] arrays (only the entries of keys s <= the row's position are written:
    # readers mask the others), no accumulation across tiles: a wide output tile with a D-deep
    # dO X^T contraction, where the dK pass's per-key-tile loop keeps its output tile small. Pairs
    # wholly past the diagonal exit at once.
    pid, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    TH: tl.constexpr = T * H
    r0 = (pid // N_KEY_TILES) * BM
    s0 = (pid % N_KEY_TILES) * BN
    if s0 <= tl.minimum((r0 + BM - 1) // H, T - 1):
      rows = r0 + tl.arange(0, BM)
      row_ok = rows < TH
      keys = s0 + tl.arange(0, BN)
      k1, k2 = _rows_load(k_ptr + b * (T * DK), keys, keys < T, DK, DK1, DK2, DK2S, True)
      # dO X^T first: P^T is not live across its D-deep loop (register pressure)
      dpt = _dp(x_ptr + b * (T * D), keys, keys < T, do_ptr + b * (TH * D), rows, row_ok, D, BDK,
                BN, BM)                                                                  # [BN, BM]
      pt, q1, _ = _probs_t(k1, k2, q_ptr + b * (TH * DK), lse_ptr + b * TH, rows, keys, TH, T, H,
                           DK, DK1, DK2, DK2S, qk_scale, True)
      delta = tl.load(delta_ptr + b * TH + rows, mask=row_ok, other=0.0)
      _store_t(ds_ptr + b * (T * TH), rows, keys, (pt * (dpt - delta[None, :])).to(q1.dtype), TH, T)
      _store_t(p_ptr + b * (T * TH), rows, keys, pt.to(q1.dtype), TH, T)

  @triton.jit
  def _dk_ds_step(ds_base, q_base, r, offs_m, keys, acc1, acc2, TH, T, H: tl.constexpr,
                  DK: tl.constexpr, DK1: tl.constexpr, DK2: tl.constexpr, DK2S: tl.constexpr,
                  MASK: tl.constexpr):
    rows = r + offs_m
    dst = _stored_t(ds_base, rows, keys, TH, T, H, MASK)                                # [BN, BM]
    q1, q2 = _rows_load(q_base, rows, rows < TH, DK, DK1, DK2, DK2S, True)
    return _dot_acc(dst, q1, q2, acc1, acc2, DK2)

  @triton.jit
  def _bwd_dk_ds_kernel(ds_ptr, q_ptr, dk_ptr, T: tl.constexpr, H: tl.constexpr, DK: tl.constexpr,
                        sm_scale: tl.constexpr, DK1: tl.constexpr, DK2: tl.constexpr,
                        DK2S: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    # dK[keys] = scale * sum_rows dS^T q from the stored dS^T (program = key tile).
    pid, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    TH: tl.constexpr = T * H
    s0 = pid * BN
    keys = s0 + tl.arange(0, BN)
    offs_m = tl.arange(0, BM)
    ds_base, q_base = ds_ptr + b * (T * TH), q_ptr + b * (TH * DK)
    acc1 = tl.zeros((BN, DK1), tl.float32)
    acc2 = tl.zeros((BN, DK2S), tl.float32)
    r_start, n_diag, r_full, n_full, r_tail = _row_blocks(s0, TH, H, BM, BN)
    for i in range(0, n_diag):
      acc1, acc2 = _dk_ds_step(ds_base, q_base, r_start + i * BM, offs_m, keys, acc1, acc2, TH, T,
                               H, DK, DK1, DK2, DK2S, True)
    for i in range(0, n_full):
      acc1, acc2 = _dk_ds_step(ds_base, q_base, r_full + i * BM, offs_m, keys, acc1, acc2, TH, T,
                               H, DK, DK1, DK2, DK2S, False)
    for r in range(r_tail, TH, BM):
      acc1, acc2 = _dk_ds_step(ds_base, q_base, r, offs_m, keys, acc1, acc2, TH, T, H, DK, DK1,
                               DK2, DK2S, True)
    out_ty = dk_ptr.dtype.element_ty
    _rows_store(dk_ptr + b * (T * DK), keys, keys < T, (acc1 * sm_scale).to(out_ty),
                (acc2 * sm_scale).to(out_ty), DK, DK1, DK2, DK2S)

  @triton.jit
  def _dq_ds_step(ds_base, k_base, rows, keys, acc1, acc2, TH, T, H: tl.constexpr,
                  DK: tl.constexpr, DK1: tl.constexpr, DK2: tl.constexpr, DK2S: tl.constexpr,
                  MASK: tl.constexpr):
    dst = _stored_t(ds_base, rows, keys, TH, T, H, MASK)                                # [BN, BM]
    k1, k2 = _rows_load(k_base, keys, keys < T, DK, DK1, DK2, DK2S, True)
    return _dot_acc(tl.trans(dst), k1, k2, acc1, acc2, DK2)

  @triton.jit
  def _bwd_dq_ds_kernel(ds_ptr, k_ptr, dq_ptr, T: tl.constexpr, H: tl.constexpr, DK: tl.constexpr,
                        sm_scale: tl.constexpr, DK1: tl.constexpr, DK2: tl.constexpr,
                        DK2S: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        N_ROW_TILES: tl.constexpr):
    # dQ[rows] = scale * sum_keys dS k, dS read from the dK pass's key-major dS^T [B, T, T*H]
    # (no scores, no dO X^T: a causal [BM, T] x [T, dk] product).
    pid, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    TH: tl.constexpr = T * H
    r0 = (N_ROW_TILES - 1 - pid) * BM
    rows = r0 + tl.arange(0, BM)
    offs_n = tl.arange(0, BN)
    ds_base, k_base = ds_ptr + b * (T * TH), k_ptr + b * (T * DK)
    acc1 = tl.zeros((BM, DK1), tl.float32)
    acc2 = tl.zeros((BM, DK2S), tl.float32)
    pos_end = tl.minimum((r0 + BM - 1) // H, T - 1) + 1
    n_full = (r0 // H + 1) // BN
    for j in range(0, n_full):  # key tiles every row of the tile sees whole
      acc1, acc2 = _dq_ds_step(ds_base, k_base, rows, j * BN + offs_n, acc1, acc2, TH, T, H, DK,
                               DK1, DK2, DK2S, False)
    for j in range(n_full, tl.cdiv(pos_end, BN)):
      acc1, acc2 = _dq_ds_step(ds_base, k_base, rows, j * BN + offs_n, acc1, acc2, TH, T, H, DK,
                               DK1, DK2, DK2S, True)
    out_ty = dq_ptr.dtype.element_ty
    _rows_store(dq_ptr + b * (TH * DK), rows, rows < TH, (acc1 * sm_scale).to(out_ty),
                (acc2 * sm_scale).to(out_ty), DK, DK1, DK2, DK2S)
