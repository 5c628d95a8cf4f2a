"""Registers, spills and shared memory of the Triton kernels on Hopper, compiled on any machine.

Triton compiles a kernel for a GPU target without a GPU (its bundled ptxas does the last step), so
this script builds the project's kernels for sm_90a (H100 / H200) at given tiles and reports what
ptxas reports: registers per thread, bytes of register spill stores / loads, the stack frame and the
shared memory the kernel asks for. A kernel that does not compile fails here the same way as on the
GPU, and one that spills is a tile candidate to avoid (spills go through local memory: L1 at best).
No timing: speed comes from bench/attention_core.py and bench/gmm.py on a GPU.

  python3 bench/kernel_resources.py [--kernels=attention,gmm,router] [--shape=base|large] [--out DIR]

Attention kernels (kernels/attention/triton_attention.py) run at the shape's (T, H, dk, D) with the default
tiles and bench/attention_core.py's CANDIDATES; grouped-matmul kernels (kernels/gmm/triton_gmm.py) with
the tuned tiles kernels/gmm/tuning.py looks up for the UMoE expert calls (the epilogue variants that
gmm_combine's backward uses included). The table goes to stdout and to $OUT/kernel_resources.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

ARCH_CAPABILITY = 90   # H100 / H200: Triton targets sm_90a for it
SHAPES = {"base": dict(t=1024, h=4, dk=192, d=768, m=32 * 1024, k=15, k_att=3, f=192, e=128),
          "large": dict(t=1024, h=4, dk=512, d=2048, m=16 * 1024, k=10, k_att=3, f=512, e=64)}


def _ptxas() -> str:
  import triton
  path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
  if not os.path.exists(path):
    raise FileNotFoundError(f"no ptxas in this Triton install ({path})")
  return path


def compile_resources(kernel, pointer_types: dict, constexprs: dict, *, num_warps: int,
                      num_stages: int, aligned_pointers: bool = True) -> dict:
  """Compiles `kernel` (a @triton.jit function) for sm_90a and returns {"registers", "spill_stores",
  "spill_loads", "stack", "shared", "async_copies", "wgmma", "mma_sync", "tanh_approx"} (bytes but
  registers; async_copies: the PTX's cp.async instructions, none when the operand loads are not
  pipelined; wgmma / mma_sync: its Hopper warpgroup MMAs and its Ampere-style warp MMAs, the latter
  where a dot did not lower to wgmma; tanh_approx: its tanh.approx.f32 instructions, the fast
  sigmoid of the gmm epilogue, kernels/triton_gmm._sigmoid). `pointer_types`: the
  pointer and scalar parameters' Triton types ("*bf16", "*fp32", "*i32", "i32"); `constexprs`: every
  other parameter's value (parameters left out take their defaults).

  `aligned_pointers` (default): every pointer parameter is declared 16-byte aligned, as jax-triton
  declares the buffers it passes (`triton_call` specialises each array argument to divisibility 16).
  Without it the compiler can prove no alignment, so it emits scalar 16-bit loads and no cp.async
  pipeline: a different, spilling program from the one that runs."""
  import triton
  from triton.backends.compiler import GPUTarget
  from triton.compiler import ASTSource
  params = inspect.signature(kernel.fn).parameters
  signature, values = {}, {}
  for i, (name, p) in enumerate(params.items()):
    if name in pointer_types:
      signature[name] = pointer_types[name]
    elif name in constexprs or p.default is not inspect.Parameter.empty:
      signature[name] = "constexpr"
      values[(i,)] = constexprs.get(name, p.default)
    else:
      raise KeyError(f"{kernel.fn.__name__}: parameter {name!r} has no type or value")
  attrs = ({(i,): [["tt.divisibility", 16]] for i, name in enumerate(params)
            if pointer_types.get(name, "").startswith("*")} if aligned_pointers else {})
  compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=values,
                                      attrs=attrs),
                            target=GPUTarget("cuda", ARCH_CAPABILITY, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages))
  with tempfile.TemporaryDirectory() as tmp:
    ptx = os.path.join(tmp, "kernel.ptx")
    with open(ptx, "w") as f:
      f.write(compiled.asm["ptx"])
    out = subprocess.run([_ptxas(), "-v", f"--gpu-name=sm_{ARCH_CAPABILITY}a", ptx, "-o",
                          os.path.join(tmp, "kernel.cubin")], capture_output=True, text=True)
  report = out.stdout + out.stderr
  number = lambda pattern: int(re.search(pattern, report).group(1))
  in_ptx = lambda pattern: len(re.findall(pattern, compiled.asm["ptx"]))
  try:
    return dict(registers=number(r"Used (\d+) registers"),
                spill_stores=number(r"(\d+) bytes spill stores"),
                spill_loads=number(r"(\d+) bytes spill loads"),
                stack=number(r"(\d+) bytes stack frame"), shared=int(compiled.metadata.shared),
                async_copies=in_ptx(r"\bcp\.async\.c[ag]\b"), wgmma=in_ptx(r"\bwgmma\.mma_async\b"),
                mma_sync=in_ptx(r"\bmma\.sync\b"), tanh_approx=in_ptx(r"\btanh\.approx\.f32\b"))
  except AttributeError:
    raise RuntimeError(f"ptxas -v gave no resource line for {kernel.fn.__name__}:\n{report}") from None


# ----------------------------------------------------------------------------------------------
# The project's kernels: (name, kernel, pointer types, constexprs, warps, stages) per case.


def attention_cases(shape: dict):
  from attention_core import CANDIDATES
  from kernels.attention import tiles as at
  from kernels.attention import triton_attention as ta
  t, h, dk, d = shape["t"], shape["h"], shape["dk"], shape["d"]
  bf, f32 = "*bf16", "*fp32"
  common = dict(T=t, H=h, DK=dk, D=d, qk_scale=ta.LOG2E / math.sqrt(dk))
  scale = dict(sm_scale=1 / math.sqrt(dk))
  base = at.default_tiles(dk, d)
  stored_dq_ds, stored_ds, stored_dk_ds = at.stored_tiles(dk)
  tiles = lambda name, own: [own] * (own is not None) + [
      at.PassTiles(*c) for c in CANDIDATES.get(name, []) if own is None or c != dataclasses.astuple(own)]
  qkv = dict(q_ptr=bf, k_ptr=bf, lse_ptr=f32)
  for tl_ in tiles("fwd", base.fwd):
    meta = at.fwd_launch(t, h, dk, d, tl_)
    yield ("fwd", tl_, ta._fwd_kernel, dict(qkv, v_ptr=bf, o_ptr=bf), {**common, **_meta(meta)})
  for name, load_p in (("dx", False), ("dx_p", True)):
    for tl_ in tiles(name, base.dx_tiles(reads_p=load_p)):
      meta = at.dx_launch(t, h, dk, d, tl_)
      yield (name, tl_, ta._bwd_dx_kernel, dict(qkv, do_ptr=bf, p_ptr=bf, dx_ptr=bf),
             {**common, **_meta(meta), "LOAD_P": load_p})
  grads = dict(qkv, x_ptr=bf, do_ptr=bf, delta_ptr=f32)
  for tl_ in tiles("dk", base.dk):
    yield ("dk", tl_, ta._bwd_dk_kernel, dict(grads, dk_ptr=bf),
           {**common, **scale, **_meta(at.dk_launch(t, h, dk, d, tl_))})
  for tl_ in tiles("dq", base.dq):
    yield ("dq", tl_, ta._bwd_dq_kernel, dict(grads, dq_ptr=bf),
           {**common, **scale, **_meta(at.dq_launch(t, h, dk, d, tl_))})
  for tl_ in tiles("ds", stored_ds):
    yield ("ds", tl_, ta._bwd_ds_kernel, dict(grads, ds_ptr=bf, p_ptr=bf),
           {**common, **_meta(at.ds_launch(t, h, dk, d, tl_))})
  small = dict(T=t, H=h, DK=dk, **scale)
  for tl_ in tiles("dq_ds", stored_dq_ds):
    yield ("dq_ds", tl_, ta._bwd_dq_ds_kernel, dict(ds_ptr=bf, k_ptr=bf, dq_ptr=bf),
           {**small, **_meta(at.dq_ds_launch(t, h, dk, tl_))})
  for tl_ in tiles("dk_ds", stored_dk_ds):
    yield ("dk_ds", tl_, ta._bwd_dk_ds_kernel, dict(ds_ptr=bf, q_ptr=bf, dk_ptr=bf),
           {**small, **_meta(at.dk_ds_launch(t, h, dk, tl_))})


def gmm_cases(shape: dict):
  """The expert calls of a UMoE layer at the shape (FFN: m*k rows; attention: m*k_att rows)."""
  from kernels.gmm import triton_gmm as tg
  from kernels.gmm import tuning
  bf, f32, i32 = "*bf16", "*fp32", "*i32"
  d, f, g = shape["d"], shape["f"], shape["e"]
  for pool, rows in (("ffn", shape["m"] * shape["k"]), ("att", shape["m"] * shape["k_att"])):
    calls = [  # name, op, contraction, output width, transpose, gathered, dgrad epilogue
        ("up fwd (gathered)", "gmm+gather", d, f, False, True, None),
        ("down fwd", "gmm", f, d, False, False, None),
        ("down dgrad: row dot + act'", "gmm_t+gather", d, f, True, True, "act"),
        ("down dgrad: row dot + act', z early", "gmm_t+gather", d, f, True, True, "act+prefetch"),
        ("down dgrad: + weight rows", "gmm_t+gather", d, f, True, True, "act+rows"),
        ("up dgrad", "gmm_t", f, d, True, False, None)]
    for name, op, kc, no, transpose, gathered, epi in calls:
      cfg = tuning.lookup("triton", op, rows, kc, no, g)
      if epi == "act+prefetch":
        cfg = dataclasses.replace(cfg, prefetch_row_dot=True)
      if cfg.xla_epilogue:  # launched without the epilogue, writing float32 (triton_gmm)
        name, epi = f"{name} (epilogue in XLA)", None
      k, n = (no, kc) if transpose else (kc, no)
      launch = tg.gmm_launch(rows, kc, no, g, cfg)
      launch.pop("grid")
      warps, stages = launch.pop("num_warps"), launch.pop("num_stages")
      ptrs = dict(a_ptr=bf, b_ptr=bf, gs_ptr=i32, a_idx_ptr=i32, scale_ptr=f32, d_ptr=bf,
                  o_ptr=f32 if cfg.xla_epilogue else bf, rd_ptr=f32, ds_ptr=bf)
      consts = dict(M=rows, KC=kc, NO=no, G=g, s_bg=k * n, s_bk=1 if transpose else n,
                    s_bn=n if transpose else 1, A_INDEX=gathered, ROW_SCALE=epi is not None,
                    ROW_DOT=epi is not None, EPI_ACT=1 if epi else 0,
                    SCALED_D=epi == "act+rows", FAST_SIGMOID=True, **launch)
      yield (f"{pool} {name}", cfg, tg._gmm_kernel, ptrs, dict(consts, num_warps=warps,
                                                                num_stages=stages))
    for base_name, op, kk, nn, gathered in (("down wgrad (gathered dout)", "tgmm+gather", f, d, True),
                                            ("up wgrad (gathered x)", "tgmm+gather", d, f, True)):
      cfg = tuning.lookup("triton", op, rows, kk, nn, g)
      launch = tg.tgmm_launch(rows, kk, nn, g, cfg)
      launch.pop("grid")
      warps, stages = launch.pop("num_warps"), launch.pop("num_stages")
      yield (f"{pool} {base_name}", cfg, tg._tgmm_kernel,
             dict(a_ptr=bf, b_ptr=bf, gs_ptr=i32, a_idx_ptr=i32, b_idx_ptr=i32, a_scale_ptr=i32,
                  order_ptr=i32, o_ptr=bf),
             dict(M=rows, K=kk, N=nn, G=g, A_INDEX=gathered and "up" in base_name,
                  B_INDEX=gathered and "down" in base_name, A_SCALE=False, **launch,
                  num_warps=warps, num_stages=stages))


def router_cases(shape: dict):
  """The routers' kernel at the shape's FFN and attention top-k: the top-k ids
  (kernels/router/triton_topk.py)."""
  from kernels.router import triton_topk as tk
  e = shape["e"]
  for k in (shape["k"], shape["k_att"]):
    meta = tk.launch_params(shape["m"], e, k)
    meta.pop("grid")
    warps = meta.pop("num_warps")
    yield (f"top-k ids, k={k}", tk.TopKConfig(meta["BLOCK_ROWS"], warps), tk._topk_kernel,
           dict(x_ptr="*fp32", ids_ptr="*i32"), dict(N=shape["m"], **meta, num_warps=warps,
                                                     num_stages=1))


def _meta(launch: dict) -> dict:
  """A launch dict's kernel meta-parameters (grid0 dropped; warps / stages kept for the caller)."""
  return {k: v for k, v in launch.items() if k != "grid0"}


def survey(cases) -> list[dict]:
  rows = []
  for name, tiles, kernel, ptrs, consts in cases:
    consts = dict(consts)
    warps = consts.pop("num_warps", getattr(tiles, "num_warps", 4))
    stages = consts.pop("num_stages", getattr(tiles, "num_stages", 2))
    row = dict(kernel=name, tiles=list(dataclasses.astuple(tiles)), num_warps=warps,
               num_stages=stages)
    try:
      row.update(compile_resources(kernel, ptrs, consts, num_warps=warps, num_stages=stages))
    except Exception as e:  # noqa: BLE001  (a candidate that does not compile: reported, not fatal)
      row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    rows.append(row)
    print(_line(row), flush=True)
  return rows


def _line(row: dict) -> str:
  head = f"  {row['kernel']:44s} {str(tuple(row['tiles'])):40s} w{row['num_warps']} s{row['num_stages']}"
  if "error" in row:
    return f"{head}  FAILED {row['error'][:120]}"
  return (f"{head}  regs {row['registers']:3d}  spills {row['spill_stores']:5d} / "
          f"{row['spill_loads']:5d} B  stack {row['stack']:5d} B  shared {row['shared'] / 1024:6.1f} KB"
          f"  cp.async {row['async_copies']:3d}  wgmma {row['wgmma']:3d}  mma.sync {row['mma_sync']:4d}")


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--kernels", default="attention,gmm")
  ap.add_argument("--shape", default="base", choices=sorted(SHAPES))
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  args = ap.parse_args()
  shape = SHAPES[args.shape]
  results = {}
  for group in args.kernels.split(","):
    cases = {"attention": attention_cases, "gmm": gmm_cases, "router": router_cases}.get(group)
    if cases is None:
      raise SystemExit(f"--kernels: unknown {group!r}; valid: attention, gmm, router")
    print(f"{group} kernels, {args.shape} shape {shape}, sm_{ARCH_CAPABILITY}a:")
    results[group] = survey(cases(shape))
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "kernel_resources.json"), "w") as f:
    json.dump(dict(shape=args.shape, arch=f"sm_{ARCH_CAPABILITY}a", results=results), f, indent=1)


if __name__ == "__main__":
  main()
