"""Kernel-form probes for the grouped matmuls, in torch + Triton outside the library (GPU).

Each probe asks what a kernel form would buy before the library takes it on:

  gmm     out[rows of g] = a[rows of g] @ w[g]: operands loaded through TMA (Triton device-side tensor
          descriptors) or pointers, on a one-program-a-tile grid or a persistent flattened loop;
          group-aligned row tiles, a masked pointer store.
  tgmm    out[g] = a[rows of g].T @ b[rows of g]: TMA through per-group descriptors (the rows past the
          group come back as zeros from the TMA unit) or masked pointer loads; the output tile's rows
          in one piece or two (BK + BK2, e.g. all 192 rows of a 192-wide expert as 128 + 64).
  cublas  cuBLAS (torch) at the experts' own shapes, one dense matmul and 128 equal groups (bmm):
          the rate a grouped kernel could hope for at these widths.

Shapes are UMoE-base's FFN (M = 32 x 1024 x 15 rows, d = 768, h = 192, 128 Dirichlet-skewed groups);
times are `triton.testing.do_bench`'s (L2 flushed between repetitions), bf16, fresh random inputs,
every kernel checked against a float32 torch reference first.

  python3 bench/triton_probes.py [--probes=gmm,tgmm,cublas] [--out=DIR]

jax-triton 0.3.1 cannot launch a kernel that builds tensor descriptors (it passes no global scratch
buffer; jaxlib 0.11.2 could take one), which is why these run through torch. The kernels also run in
Triton's interpreter on a CPU (tests/test_triton_probes.py).
"""
from __future__ import annotations

import argparse
import json
import os

import gmm_common  # bench/gmm_common.py (this directory)

try:
  import triton
  import triton.language as tl
  HAVE_TRITON = True
except Exception:  # noqa: BLE001
  HAVE_TRITON = False

M, D, H, G = 32 * 1024 * 15, 768, 192, 128

if HAVE_TRITON:

  @triton.jit
  def gmm_kernel(a_ptr, w_ptr, o_ptr, starts_ptr, tiles_before_ptr, M, total_tiles,
                 G: tl.constexpr, GP: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr,
                 PERSISTENT: tl.constexpr, NUM_PROGS: tl.constexpr, STAGES: tl.constexpr):
    """a [M, K], w [G, K, N] -> o [M, N]; group g's row tiles start at its first row
    (tiles_before[g] tiles come before them; tiles_before[G] = all), N // BN column tiles each."""
    NT: tl.constexpr = N // BN
    gi = tl.arange(0, GP)
    tiles_before = tl.load(tiles_before_ptr + gi, mask=gi <= G, other=2 ** 30)
    if TMA:  # built once a program: the loads past a group's rows are discarded by the store's mask
      a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
      w_desc = tl.make_tensor_descriptor(w_ptr, shape=[G * K, N], strides=[N, 1],
                                         block_shape=[BK, BN])
    pid = tl.program_id(0)
    for t in tl.range(pid, total_tiles if PERSISTENT else pid + 1, NUM_PROGS, flatten=PERSISTENT,
                      num_stages=STAGES):
      mt = t // NT
      nt = t % NT
      g = tl.sum((tiles_before <= mt).to(tl.int32)) - 1
      row0 = tl.load(starts_ptr + g) + (mt - tl.load(tiles_before_ptr + g)) * BM
      row_end = tl.load(starts_ptr + g + 1)
      offs_m = row0 + tl.arange(0, BM)
      offs_n = nt * BN + tl.arange(0, BN)
      acc = tl.zeros((BM, BN), tl.float32)
      for k in tl.range(0, K, BK):
        if TMA:
          a = a_desc.load([row0, k])
          w = w_desc.load([g * K + k, nt * BN])
        else:
          offs_k = k + tl.arange(0, BK)
          a = tl.load(a_ptr + offs_m[:, None] * K + offs_k[None, :], mask=offs_m[:, None] < M,
                      other=0.0)
          w = tl.load(w_ptr + (g * K + offs_k)[:, None] * N + offs_n[None, :])
        acc = tl.dot(a, w, acc)
      tl.store(o_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(o_ptr.dtype.element_ty),
               mask=offs_m[:, None] < row_end)

  @triton.jit
  def tgmm_kernel(a_ptr, b_ptr, o_ptr, starts_ptr, K: tl.constexpr, N: tl.constexpr,
                  BM: tl.constexpr, BK: tl.constexpr, BK2: tl.constexpr, BN: tl.constexpr,
                  TMA: tl.constexpr, STAGES: tl.constexpr):
    """a [M, K], b [M, N] -> o [G, K, N]; one program per (group, K tile of BK + BK2 rows, N tile),
    BM rows of the group a step."""
    KW: tl.constexpr = BK + BK2
    KT: tl.constexpr = K // KW
    NT: tl.constexpr = N // BN
    pid = tl.program_id(0)
    g = pid // (KT * NT)
    k0 = ((pid % (KT * NT)) // NT) * KW
    n0 = (pid % NT) * BN
    start = tl.load(starts_ptr + g)
    end = tl.load(starts_ptr + g + 1)
    size = end - start
    acc = tl.zeros((BK, BN), tl.float32)
    acc2 = tl.zeros((BK2 if BK2 > 0 else 16, BN), tl.float32)
    if TMA:  # this group's rows only: the TMA unit fills the rows past its end with zeros
      rows = tl.maximum(size, 1)
      base_a = a_ptr + start.to(tl.int64) * K
      a_desc = tl.make_tensor_descriptor(base_a, shape=[rows, K], strides=[K, 1],
                                         block_shape=[BM, BK])
      b_desc = tl.make_tensor_descriptor(b_ptr + start.to(tl.int64) * N, shape=[rows, N],
                                         strides=[N, 1], block_shape=[BM, BN])
      if BK2 > 0:
        a2_desc = tl.make_tensor_descriptor(base_a, shape=[rows, K], strides=[K, 1],
                                            block_shape=[BM, BK2 if BK2 > 0 else 16])
      for m in tl.range(0, size, BM, num_stages=STAGES):
        b = b_desc.load([m, n0])
        acc = tl.dot(a_desc.load([m, k0]).T, b, acc)
        if BK2 > 0:
          acc2 = tl.dot(a2_desc.load([m, k0 + BK]).T, b, acc2)
    else:
      offs_n = n0 + tl.arange(0, BN)
      for m in tl.range(0, size, BM, num_stages=STAGES):
        r = start + m + tl.arange(0, BM)
        mask = (r < end)[:, None]
        r64 = r.to(tl.int64)[:, None]
        b = tl.load(b_ptr + r64 * N + offs_n[None, :], mask=mask, other=0.0)
        a = tl.load(a_ptr + r64 * K + (k0 + tl.arange(0, BK))[None, :], mask=mask, other=0.0)
        acc = tl.dot(a.T, b, acc)
        if BK2 > 0:
          a2 = tl.load(a_ptr + r64 * K + (k0 + BK + tl.arange(0, BK2 if BK2 > 0 else 16))[None, :],
                       mask=mask, other=0.0)
          acc2 = tl.dot(a2.T, b, acc2)
    out = o_ptr + g.to(tl.int64) * K * N + (n0 + tl.arange(0, BN))[None, :]
    tl.store(out + (k0 + tl.arange(0, BK))[:, None] * N, acc.to(o_ptr.dtype.element_ty))
    if BK2 > 0:
      tl.store(out + (k0 + BK + tl.arange(0, BK2 if BK2 > 0 else 16))[:, None] * N,
               acc2.to(o_ptr.dtype.element_ty))


def _starts(counts, device):
  """[0, c0, c0 + c1, ..., sum(counts)] as int32 on `device`: where each group's rows (or tiles)
  start, the total last."""
  import torch
  starts = torch.zeros(len(counts) + 1, dtype=torch.int32)
  starts[1:] = torch.cumsum(torch.as_tensor(counts), 0)
  return starts.to(device)


def gmm_call(a, w, sizes, *, bm, bn, bk, warps, stages, tma, persistent, num_sms):
  """A zero-argument launch of gmm_kernel writing and returning out [M, N]."""
  import torch
  g, k, n = w.shape
  m = a.shape[0]
  starts = _starts(sizes, a.device)
  tiles_before = _starts([-(-s // bm) for s in sizes], a.device)
  total = int(tiles_before[-1]) * (n // bn)
  out = torch.empty((m, n), dtype=a.dtype, device=a.device)
  grid = (min(total, num_sms),) if persistent else (total,)

  def call():
    gp = 1 << g.bit_length()   # a power of two > G: the kernel loads tiles_before[0..G] at once
    gmm_kernel[grid](a, w, out, starts, tiles_before, m, total, g, gp, k, n, bm, bn, bk, tma,
                     persistent, grid[0], stages, num_warps=warps, num_stages=stages)
    return out
  return call


def tgmm_call(a, b, sizes, *, bm, bk, bk2, bn, warps, stages, tma):
  """A zero-argument launch of tgmm_kernel writing and returning out [G, K, N]."""
  import torch
  k, n, g = a.shape[1], b.shape[1], len(sizes)
  starts = _starts(sizes, a.device)
  out = torch.empty((g, k, n), dtype=a.dtype, device=a.device)
  grid = (g * (k // (bk + bk2)) * (n // bn),)

  def call():
    tgmm_kernel[grid](a, b, out, starts, k, n, bm, bk, bk2, bn, tma, stages, num_warps=warps,
                      num_stages=stages)
    return out
  return call


def reference_gmm(a, w, sizes):
  import torch
  rows = torch.split(a.float(), sizes)
  return torch.cat([r @ w[i].float() for i, r in enumerate(rows)])


def reference_tgmm(a, b, sizes):
  import torch
  return torch.stack([x.T @ y for x, y in zip(torch.split(a.float(), sizes),
                                               torch.split(b.float(), sizes))])


def rel_err(got, want) -> float:
  """||got - want|| / ||want|| of torch tensors where they are (bench/checks.py's numpy form would
  copy ~1.5 GB to the host per candidate at these shapes)."""
  return float((got.float() - want).norm() / max(float(want.norm()), 1e-30))


MAX_REL_ERR = 1e-2   # bf16 inputs, float32 accumulation: a candidate above is wrong, not timed


GMM_TILES = ((128, 256, 64, 8, 3), (128, 128, 64, 8, 3), (128, 128, 64, 4, 3), (128, 256, 64, 8, 4),
             (64, 256, 64, 4, 3), (256, 128, 64, 8, 3))   # bm, bn, bk, warps, stages
TGMM_TILES = ((64, 64, 0, 256, 8, 4), (64, 64, 0, 128, 4, 4), (64, 128, 64, 128, 4, 4),
              (64, 128, 64, 128, 8, 4), (64, 128, 64, 128, 8, 5), (32, 128, 64, 128, 4, 5))
# (rows a step, BK, BK2, BN, warps, stages): the library's tabled 64-row tile, then all 192 rows.


def _time(rows, name, call, ref, flops):
  import triton.testing
  try:
    err = rel_err(call(), ref)
    if not err < MAX_REL_ERR:
      rows.append(dict(name=name, err=err, error=f"relative error {err:.1e} over {MAX_REL_ERR}"))
      print(f"{name:44s} WRONG: relative error {err:.1e}", flush=True)
      return
    ms = triton.testing.do_bench(call, warmup=10, rep=60)
    rows.append(dict(name=name, err=err, ms=ms, tflops=flops / ms / 1e9))
    print(f"{name:44s} err {err:.1e} {ms:7.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s", flush=True)
  except Exception as e:  # noqa: BLE001  (a tile over the shared memory: named, the rest go on)
    rows.append(dict(name=name, error=repr(e)[:300]))
    print(f"{name:44s} FAILED {repr(e)[:200]}", flush=True)


def probe_gmm(rows):
  """192 -> 768 forward (UMoE-base's down projection): TMA or pointer loads, grid or persistent."""
  import torch
  sizes = [int(s) for s in gmm_common.group_sizes(M, G)]  # bench/gmm.py's routing
  a = torch.randn(M, H, device="cuda").to(torch.bfloat16)
  w = (torch.randn(G, H, D, device="cuda") / H ** 0.5).to(torch.bfloat16)
  ref = reference_gmm(a, w, sizes)
  sms = torch.cuda.get_device_properties(0).multi_processor_count
  for tma in (0, 1):
    for persistent in (0, 1):
      for bm, bn, bk, warps, stages in GMM_TILES:
        name = (f"gmm {'tma' if tma else 'ptr'} {'persistent' if persistent else 'grid'} "
                f"{bm}x{bn}x{bk}/{warps}/{stages}")
        _time(rows, name, gmm_call(a, w, sizes, bm=bm, bn=bn, bk=bk, warps=warps, stages=stages,
                                   tma=tma, persistent=persistent, num_sms=sms),
              ref, 2 * M * H * D)


def probe_tgmm(rows):
  """The down projection's weight gradient h.T @ dY ([M, 192], [M, 768] -> [G, 192, 768])."""
  import torch
  sizes = [int(s) for s in gmm_common.group_sizes(M, G)]  # bench/gmm.py's routing
  a = torch.randn(M, H, device="cuda").to(torch.bfloat16)
  b = torch.randn(M, D, device="cuda").to(torch.bfloat16)
  ref = reference_tgmm(a, b, sizes)
  for tma in (1, 0):
    for bm, bk, bk2, bn, warps, stages in TGMM_TILES:
      name = f"tgmm {'tma' if tma else 'ptr'} {bk + bk2}x{bn} ({bm} rows)/{warps}/{stages}"
      _time(rows, name, tgmm_call(a, b, sizes, bm=bm, bk=bk, bk2=bk2, bn=bn, warps=warps,
                                  stages=stages, tma=tma), ref, 2 * M * H * D)


def probe_cublas(rows):
  """cuBLAS at the FFN experts' shapes: all rows as one matmul, and as 128 equal groups."""
  import torch
  import triton.testing
  bf = torch.bfloat16
  x_d, x_h = (torch.randn(M, n, device="cuda", dtype=bf) for n in (D, H))
  w_dh = torch.randn(D, H, device="cuda", dtype=bf) / D ** 0.5
  w_hd = torch.randn(H, D, device="cuda", dtype=bf) / H ** 0.5
  r = M // G
  b_d, b_h = x_d.view(G, r, D), x_h.view(G, r, H)
  wb_dh = torch.randn(G, D, H, device="cuda", dtype=bf) / D ** 0.5
  wb_hd = torch.randn(G, H, D, device="cuda", dtype=bf) / H ** 0.5
  t, f = 32 * 1024, 3072
  x_t, w_up = torch.randn(t, D, device="cuda", dtype=bf), torch.randn(D, f, device="cuda", dtype=bf)
  cases = (
      ("mm  [M,768]@[768,192] (up fwd, down dgrad)", lambda: x_d @ w_dh, 2 * M * D * H),
      ("mm  [M,192]@[192,768] (down fwd, up dgrad)", lambda: x_h @ w_hd, 2 * M * D * H),
      ("mm  [768,M]@[M,192] (up wgrad, one group)", lambda: x_d.T @ x_h, 2 * M * D * H),
      ("mm  [192,M]@[M,768] (down wgrad, one group)", lambda: x_h.T @ x_d, 2 * M * D * H),
      ("bmm 128 x [3840,768]@[768,192]", lambda: torch.bmm(b_d, wb_dh), 2 * M * D * H),
      ("bmm 128 x [3840,192]@[192,768]", lambda: torch.bmm(b_h, wb_hd), 2 * M * D * H),
      ("bmm 128 x [768,3840]@[3840,192] (wgrad)", lambda: torch.bmm(b_d.transpose(1, 2), b_h),
       2 * M * D * H),
      ("bmm 128 x [192,3840]@[3840,768] (wgrad)", lambda: torch.bmm(b_h.transpose(1, 2), b_d),
       2 * M * D * H),
      ("mm  [32k,768]@[768,3072] (dense FFN up)", lambda: x_t @ w_up, 2 * t * D * f),
  )
  for name, call, flops in cases:
    call()
    ms = triton.testing.do_bench(call, warmup=10, rep=60)
    rows.append(dict(name=name, ms=ms, tflops=flops / ms / 1e9))
    print(f"{name:44s} {ms:7.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s", flush=True)


PROBES = {"gmm": probe_gmm, "tgmm": probe_tgmm, "cublas": probe_cublas}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--probes", default="gmm,tgmm,cublas", help=f"of {', '.join(PROBES)}")
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  args = ap.parse_args(argv)
  names = [p for p in args.probes.split(",") if p]
  unknown = [p for p in names if p not in PROBES]
  if unknown:
    ap.error(f"--probes: unknown {', '.join(unknown)}; valid: {', '.join(PROBES)}")
  import torch
  if not (HAVE_TRITON and torch.cuda.is_available()):
    ap.error("needs a CUDA GPU with torch and Triton (the kernels' CPU check: "
             "tests/test_triton_probes.py)")
  # Where device-side tensor descriptors are written (Triton asks the launcher for the memory).
  triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
  torch.manual_seed(0)
  results = {}
  for name in names:
    results[name] = []
    PROBES[name](results[name])
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "triton_probes.json"), "w") as f:
    json.dump(results, f, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
