"""The Pallas Mosaic GPU interpreter for the CPU tests of kernels/gmm/mosaic_*.py: what the
interpreter of jax 0.10 lacks, taught through monkeypatch."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest


def mosaic_interpreter(monkeypatch, reads_past: str = "nan"):
  """Runs `plgpu.kernel` in the Mosaic GPU interpreter (returns a list that counts the kernels run).

  Strict: a read past the end of a buffer gives NaN (real TMA gives zeros), as does memory never
  written, so a kernel that uses padding rows or leaves output rows unwritten fails. `reads_past`
  "zero": zeros instead, for a kernel that relies on TMA's zero fill past the array (and then on
  nothing else being read unwritten); "raise": any read past an array raises (a case whose every TMA
  box lies inside its arrays). The interpreter of jax 0.10 lacks two things the kernels use, taught
  here: a wgmma operand read through a transpose (the transposed gmm's B tile, tgmm's A tile) is
  first copied, transposed, into scoped shared memory; `layout_cast` (a register-layout hint for the
  compiler) is the identity on values.
  """
  try:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
  except Exception as e:  # noqa: BLE001
    pytest.skip(f"no Mosaic GPU interpreter in this jax: {e!r}")
  from kernels.gmm import mosaic_gmm as mgpu_gmm
  if not mgpu_gmm.HAVE_MGPU:
    pytest.skip("this jax lacks the Pallas Mosaic GPU API the kernels use (kernels/gmm/mosaic_gmm.py)")
  params = InterpretGPUParams(
      out_of_bounds_reads="raise" if reads_past == "raise" else "uninitialized",
      uninitialized_memory="zero" if reads_past == "zero" else "nan")
  kernel, wgmma, launched = plgpu.kernel, plgpu.wgmma, []

  def interpreted(*args, **kw):
    launched.append(kw.get("out_type"))
    return kernel(*args, interpret=params, **kw)

  def wgmma_through_copies(acc, a, b, **kw):
    ops = [a, b]
    moved = [i for i, ref in enumerate(ops) if _transposed(ref)]

    def run(*copies):
      for i, copy in zip(moved, copies):
        copy[...] = _value(ops[i])
        ops[i] = copy
      wgmma(acc, *ops, **kw)

    pl.run_scoped(run, *[plgpu.SMEM(ops[i].shape, ops[i].dtype) for i in moved])

  monkeypatch.setattr(plgpu, "kernel", interpreted)
  monkeypatch.setattr(plgpu, "wgmma", wgmma_through_copies)
  monkeypatch.setattr(plgpu, "layout_cast", lambda x, layout: x)
  monkeypatch.setattr(mgpu_gmm, "_num_sms", lambda: 2)  # two persistent programs share the work
  return launched


def _transposed(ref) -> bool:
  """Whether a ref is read through a trailing transpose (which the interpreter cannot read)."""
  from jax._src.state.types import TransposeTransform
  t = getattr(ref, "transforms", ())
  return bool(t) and isinstance(t[-1], TransposeTransform)


def _value(ref):
  """A shared-memory ref's value, its trailing transpose applied to the value read without it."""
  if _transposed(ref):
    return jnp.transpose(dataclasses.replace(ref, transforms=ref.transforms[:-1])[...],
                         ref.transforms[-1].permutation)
  return ref[...]


def fp8_partials_on_smem(monkeypatch, module):
  """The FP8 kernel's partial accumulators (`module._partial / _take / _clear`) as float32 shared
  memory, the wgmma into one of them a float32 product: the interpreter has no accumulator store,
  and runs every wgmma at once anyway (so `_take`'s wait_n, the overlap itself, is not checked
  here). Call after `mosaic_interpreter`, whose wgmma the others still take."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  wgmma = plgpu.wgmma

  def partial(bm, bn):
    return plgpu.SMEM((bm, bn), jnp.float32)

  def product(acc, a, b, **kw):
    if _is_accumulator(acc):
      return wgmma(acc, a, b, **kw)
    a_, b_ = _value(a).astype(jnp.float32), _value(b).astype(jnp.float32)
    acc[...] = acc[...] + jnp.dot(a_, b_, precision=jax.lax.Precision.HIGHEST)

  monkeypatch.setattr(module, "_partial", partial)
  monkeypatch.setattr(module, "_take", lambda ref, wait_n: ref[...])
  monkeypatch.setattr(plgpu, "wgmma", product)


def _is_accumulator(ref) -> bool:
  from jax._src.pallas.mosaic_gpu import core as gpu_core
  aval = getattr(getattr(ref, "ref", ref), "aval", None)
  return isinstance(aval, gpu_core.WGMMAAbstractAccumulatorRef)
