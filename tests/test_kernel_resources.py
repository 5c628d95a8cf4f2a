"""bench/kernel_resources.py: Triton kernels compiled for sm_90a on this (GPU-less) machine, with
ptxas's register / spill / shared-memory report; a tile the kernel cannot take fails to compile
here as it would on the GPU."""
from __future__ import annotations

import math
import os
import sys

import pytest

pytestmark = pytest.mark.extras("triton")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import kernel_resources as kr  # noqa: E402


def _dq_ds(bn, bm=32):
  from kernels.attention import triton_attention as ta
  t, h, dk = 64, 2, 32
  consts = dict(T=t, H=h, DK=dk, sm_scale=1 / math.sqrt(dk), DK1=32, DK2=0, DK2S=1, BM=bm, BN=bn,
                N_ROW_TILES=t * h // bm)
  return kr.compile_resources(ta._bwd_dq_ds_kernel, dict(ds_ptr="*bf16", k_ptr="*bf16",
                                                         dq_ptr="*bf16"), consts,
                              num_warps=4, num_stages=2)


def test_a_kernel_compiles_for_hopper_and_reports_its_resources():
  try:
    kr._ptxas()
  except FileNotFoundError as e:
    pytest.skip(str(e))
  res = _dq_ds(32)
  assert set(res) == {"registers", "spill_stores", "spill_loads", "stack", "shared", "async_copies",
                      "wgmma", "mma_sync", "tanh_approx"}
  assert res["tanh_approx"] == 0   # (an attention kernel: no fast sigmoid)
  assert 16 <= res["registers"] <= 255 and res["shared"] > 0
  # its dS @ K product: on 32-row tiles Ampere-style warp MMAs (a warpgroup MMA takes 64 rows), on
  # 64-row tiles Hopper's warpgroup MMA
  assert res["mma_sync"] > 0 and res["wgmma"] == 0, res
  wide = _dq_ds(32, bm=64)
  assert wide["wgmma"] > 0 and wide["mma_sync"] == 0, wide
  assert min(res["spill_stores"], res["spill_loads"], res["stack"]) >= 0
  with pytest.raises(Exception, match="power of 2"):   # BN = 24: no tl.arange of it, on any GPU
    _dq_ds(24)
  from kernels.attention import triton_attention as ta
  with pytest.raises(KeyError, match="'dq_ptr'"):      # a parameter without type or value
    kr.compile_resources(ta._bwd_dq_ds_kernel, dict(ds_ptr="*bf16", k_ptr="*bf16"), {},
                         num_warps=4, num_stages=2)


def test_pointers_are_declared_aligned_as_jax_triton_declares_them():
  """jax-triton specialises every array argument to 16-byte divisibility; compiled without that
  hint the same grouped matmul has no cp.async pipeline and spills, so the survey must compile
  with it."""
  try:
    kr._ptxas()
  except FileNotFoundError as e:
    pytest.skip(str(e))
  # (the attention's up dgrad: the plain one-program-a-tile grid; the FFN's is persistent, and a
  # persistent program's shared memory is not the pipeline estimate alone)
  name, tiles, kernel, ptrs, consts = next(c for c in kr.gmm_cases(kr.SHAPES["base"])
                                           if c[0] == "att up dgrad")
  consts = dict(consts)
  warps, stages = consts.pop("num_warps"), consts.pop("num_stages")
  aligned = kr.compile_resources(kernel, ptrs, consts, num_warps=warps, num_stages=stages)
  unaligned = kr.compile_resources(kernel, ptrs, consts, num_warps=warps, num_stages=stages,
                                   aligned_pointers=False)
  assert aligned["async_copies"] > 0 and aligned["spill_stores"] == 0, (name, aligned)
  assert unaligned["async_copies"] == 0 and unaligned["spill_stores"] > 0, (name, unaligned)
  # The pipelined program holds num_stages copies of both operand tiles: the estimate the tile
  # sweep uses to skip candidates that would not launch (kernels/gmm/tuning.py).
  from kernels.gmm import tuning
  assert not tiles.persistent
  assert aligned["shared"] == tuning.triton_gmm_shared_bytes(tiles), (tiles, aligned)


@pytest.mark.parametrize("group", ["attention", "gmm", "router"])
def test_the_survey_cases_match_the_kernels_signatures(group):
  """Every case of the survey names each kernel parameter (a kernel that gains one fails here, not
  on a GPU); the first case of each group compiles."""
  import inspect
  try:
    kr._ptxas()
  except FileNotFoundError as e:
    pytest.skip(str(e))
  cases = list({"attention": kr.attention_cases, "gmm": kr.gmm_cases,
                "router": kr.router_cases}[group](kr.SHAPES["base"]))
  assert len(cases) >= {"attention": 10, "gmm": 14, "router": 2}[group]
  for name, _, kernel, ptrs, consts in cases:
    params = inspect.signature(kernel.fn).parameters
    missing = [p for p, v in params.items() if p not in ptrs and p not in consts
               and v.default is inspect.Parameter.empty]
    assert not missing, (name, missing)
  assert kr.survey(cases[:1])[0].get("registers", 0) > 0, cases[0][0]


@pytest.mark.parametrize("shape", ["base", "large"])
def test_the_stored_forms_default_tiles_do_not_spill(shape):
  """The tiles the stored-scores backward takes by default (attention/tiles.stored_tiles: the
  readers of dS / P and the tile-pair pass) were chosen spill-free for sm_90a at each head width;
  a kernel change that makes them spill shows here before a GPU times it."""
  try:
    kr._ptxas()
  except FileNotFoundError as e:
    pytest.skip(str(e))
  from kernels.attention import tiles as at
  dims = kr.SHAPES[shape]
  defaults = dict(zip(("dq_ds", "ds", "dk_ds"), at.stored_tiles(dims["dk"])))
  cases = [c for c in kr.attention_cases(dims) if c[0] in defaults and c[1] == defaults[c[0]]]
  assert sorted(c[0] for c in cases) == sorted(defaults)
  for row in kr.survey(cases):
    assert "error" not in row and row["spill_stores"] == row["spill_loads"] == 0, row


def test_the_key_width_in_two_pieces_compiles_without_spills():
  """Keys in two exact pieces at UMoE-base's dk 192 (128 + 64, `attention/tiles.key_pieces`): the
  default tiles' kernels of the stored-pairs backward and the forward compile for sm_90a without
  spills."""
  try:
    kr._ptxas()
  except FileNotFoundError as e:
    pytest.skip(str(e))
  from kernels.attention import tiles as at
  dims = kr.SHAPES["base"]
  base = at.default_tiles(dims["dk"], dims["d"])
  defaults = {"fwd": base.fwd, "dq_ds": base.dq_ds, "ds": base.ds, "dk_ds": base.dk_ds}
  cases = [c for c in kr.attention_cases(dims) if defaults.get(c[0]) == c[1]]
  assert sorted(c[0] for c in cases) == sorted(defaults)
  assert all(c[4]["DK2"] == 64 for c in cases)
  for row in kr.survey(cases):
    assert "error" not in row and row["spill_stores"] == row["spill_loads"] == 0, row


def test_a_tile_with_the_xla_epilogue_is_surveyed_as_it_launches(monkeypatch):
  """A tabled dgrad tile with `TileConfig.xla_epilogue` is compiled as `triton_gmm` launches it:
  no row dot, scale or activation in the kernel, a float32 output (pure Python: no compiler)."""
  import dataclasses
  from kernels.gmm import tuning
  key = ("triton", "gmm_t+gather", 768, 192, 1 << 19)
  monkeypatch.setitem(tuning.TABLE, key, dataclasses.replace(tuning.TABLE[key], xla_epilogue=True))
  cases = {name: (ptrs, consts) for name, _, _, ptrs, consts in kr.gmm_cases(kr.SHAPES["base"])}
  ptrs, consts = cases["ffn down dgrad: row dot + act' (epilogue in XLA)"]
  assert not (consts["ROW_DOT"] or consts["ROW_SCALE"] or consts["SCALED_D"] or consts["EPI_ACT"])
  assert ptrs["o_ptr"] == "*fp32" and consts["A_INDEX"]
  ptrs, consts = cases["att down dgrad: row dot + act'"]     # (another row: the fused epilogue)
  assert consts["ROW_DOT"] and consts["EPI_ACT"] == 1 and ptrs["o_ptr"] == "*bf16"


def test_the_dgrad_epilogue_compiles_with_the_fast_sigmoid():
  """The down projection's input gradient with the silu epilogue, as `triton_gmm` launches it on a
  GPU (FAST_SIGMOID on), compiles for sm_90a with tanh.approx in its PTX (the inline PTX that
  Triton's interpreter cannot run is checked here, short of a GPU); with it off (the
  interpreter's form), none."""
  try:
    kr._ptxas()
  except FileNotFoundError as e:
    pytest.skip(str(e))
  name = "ffn down dgrad: row dot + act'"
  (case,) = [c for c in kr.gmm_cases(kr.SHAPES["base"]) if c[0] == name]
  assert case[4]["FAST_SIGMOID"] is True
  for fast in (True, False):
    (row,) = kr.survey([(*case[:4], dict(case[4], FAST_SIGMOID=fast))])
    assert "error" not in row, row
    assert (row["tanh_approx"] > 0) is fast, row
