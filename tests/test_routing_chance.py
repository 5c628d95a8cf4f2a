"""The attention-vs-FFN overlap's chance level under the measured expert loads
(`routing.chance_overlap`), against an exact enumeration of independent token pairs, hand-built
loads and independent skewed picks."""
from __future__ import annotations

import math

import numpy as np
import pytest

from umoe_jax.analysis import routing

X = routing.NO_PICK


def pairs_reference(att, ffn):
  """The figures of `pick_overlap` over every pair (attention picks of token i, FFN picks of token
  j), i and j independent and uniform over the probe: plain set loops."""
  same, overlaps = [], []
  for a in att:
    for f in ffn:
      sa, sf = {int(e) for e in a if e != X}, {int(e) for e in f if e != X}
      same.append(a[0] != X and a[0] == f[0])
      if sa and sf:
        overlaps.append(len(sa & sf) / min(len(sa), len(sf)))
  return float(np.mean(same)), (float(np.mean(overlaps)) if overlaps else math.nan)


def skewed_picks(rng, n, e, k, weights):
  """n tokens' k distinct picks of e experts, drawn without replacement with `weights`."""
  return np.stack([rng.choice(e, size=k, replace=False, p=weights) for _ in range(n)])


def test_chance_equals_the_enumeration_of_independent_pairs():
  rng = np.random.default_rng(11)
  n, e = 60, 6
  att = skewed_picks(rng, n, e, 2, np.array([0.5, 0.2, 0.1, 0.1, 0.05, 0.05]))
  ffn = skewed_picks(rng, n, e, 3, np.array([0.05, 0.1, 0.1, 0.15, 0.3, 0.3]))
  got = routing.chance_overlap(att, ffn, e)
  same, overlap = pairs_reference(att, ffn)
  assert got["top1_same"] == pytest.approx(same, rel=1e-12)
  assert got["overlap"] == pytest.approx(overlap, rel=1e-12)
  # Pick counts of any length (top-P / expert choice leave NO_PICK slots), some tokens with none.
  sizes_a, sizes_f = rng.integers(0, 3, n), rng.integers(0, 4, n)
  att_v = np.where(np.arange(2) < sizes_a[:, None], att, X)
  ffn_v = np.where(np.arange(3) < sizes_f[:, None], ffn, X)
  got = routing.chance_overlap(att_v, ffn_v, e)
  same, overlap = pairs_reference(att_v, ffn_v)
  assert got["top1_same"] == pytest.approx(same, rel=1e-12)
  assert got["overlap"] == pytest.approx(overlap, rel=1e-12)


def test_chance_of_hand_built_loads():
  # Attention always picks expert 0; the FFN picks {0, 1} for half the tokens, {2, 3} for the rest.
  att = np.array([[0]] * 4)
  ffn = np.array([[0, 1], [2, 3], [0, 1], [3, 2]])
  got = routing.pick_overlap(att, ffn, 4)
  # P(same top-1) = p_a(0) p_f(0) = 1 * 1/2; E|A & F| / 1 = pi_a(0) pi_f(0) = 1/2.
  assert got["top1_same_chance"] == 0.5 and got["overlap_chance"] == 0.5
  assert got["top1_same_chance_uniform"] == 0.25 and got["overlap_chance_uniform"] == 0.5
  # The FFN always picks {0, 1} (top-1 0 for three tokens of four): overlap chance 1, not 2/4.
  ffn = np.array([[0, 1], [0, 1], [1, 0], [0, 1]])
  got = routing.pick_overlap(att, ffn, 4)
  assert got["overlap_chance"] == 1.0 and got["overlap"] == 1.0
  assert got["top1_same_chance"] == 0.75 and got["top1_same"] == 0.75
  # Equal loads give the uniform values: every expert in exactly K/E of the tokens.
  att = np.array([[0], [1], [2], [3]] * 3)
  ffn = np.array([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]] * 2)
  got = routing.pick_overlap(att, ffn, 4)
  assert got["top1_same_chance"] == pytest.approx(1 / 4, rel=1e-12)
  assert got["overlap_chance"] == pytest.approx(2 / 4, rel=1e-12)
  # One side picks nothing at all: no overlap to expect (and no top-1 to share).
  got = routing.chance_overlap(np.array([[X], [X]]), np.array([[1], [0]]), 2)
  assert math.isnan(got["overlap"]) and got["top1_same"] == 0.0


def test_independent_skewed_picks_land_on_the_load_aware_chance():
  """Picks drawn independently for attention and FFN from skewed loads: the measured overlap is the
  load-aware chance (within sampling error), far from the equal-load one."""
  rng = np.random.default_rng(3)
  n, e = 20000, 8
  w = np.array([0.4, 0.2, 0.12, 0.08, 0.08, 0.06, 0.04, 0.02])
  att = skewed_picks(rng, n, e, 2, w)
  ffn = skewed_picks(rng, n, e, 3, w)
  got = routing.pick_overlap(att, ffn, e)
  assert abs(got["overlap"] - got["overlap_chance"]) < 0.01
  assert abs(got["top1_same"] - got["top1_same_chance"]) < 0.01
  assert got["overlap_chance"] - got["overlap_chance_uniform"] > 0.1
  assert got["top1_same_chance"] - got["top1_same_chance_uniform"] > 0.1
