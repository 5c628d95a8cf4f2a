"""Routing statistics on hand-built routing, the probe's collection from a model, and the figures.

The statistics are checked against figures worked out by hand in the comments (and, on random
routing, against plain Python set loops); the figures by their axes, titles and plotted data.
"""
from __future__ import annotations

import functools
import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from matplotlib import colors as mcolors

from conftest import random_module, tiny_config
from umoe_jax.analysis import probe, report, routing
from umoe_jax.plot import figures as plots
from umoe_jax.model.lm import CausalLM
from umoe_jax.output import write_json


# ------------------------------------------------------------------------------------------------
# Statistics on hand-built routing


def test_top1_change_and_jaccard_by_hand():
  a = np.array([[0, 1], [2, 3], [1, 0], [3, 2]])
  b = np.array([[0, 1], [3, 2], [1, 2], [0, 3]])
  # top-1: 0=0, 2!=3, 1=1, 3!=0 -> 2 of 4 changed.
  assert routing.top1_change(a, b) == 0.5
  # Jaccard per token: {0,1}={0,1}: 1; {2,3}={3,2}: 1; {0,1} vs {1,2}: 1/3; {2,3} vs {0,3}: 1/3.
  assert routing.mean_jaccard(a, b) == pytest.approx((1 + 1 + 1 / 3 + 1 / 3) / 4, abs=1e-12)
  assert routing.top1_change(a, a) == 0.0 and routing.mean_jaccard(a, a) == 1.0
  # top-1 routing: Jaccard is 1 - change exactly.
  assert routing.mean_jaccard(a[:, :1], b[:, :1]) == 1 - routing.top1_change(a, b)
  with pytest.raises(ValueError, match=r"\(4, 2\) and \(4, 1\)"):
    routing.mean_jaccard(a, b[:, :1])


def test_jaccard_and_overlap_match_set_loops():
  rng = np.random.default_rng(7)
  n, e = 300, 9
  pick = lambda k: np.stack([rng.permutation(e)[:k] for _ in range(n)])
  a, b, f = pick(3), pick(3), pick(5)
  jac = np.mean([len(set(x) & set(y)) / len(set(x) | set(y)) for x, y in zip(a, b)])
  assert routing.mean_jaccard(a, b) == pytest.approx(jac, rel=1e-12)
  got = routing.pick_overlap(a, f, e)
  assert got["overlap"] == pytest.approx(np.mean([len(set(x) & set(y)) / 3 for x, y in zip(a, f)]),
                                         rel=1e-12)
  assert got["top1_same"] == pytest.approx(np.mean([x[0] == y[0] for x, y in zip(a, f)]))
  assert got["overlap_chance_uniform"] == 5 / 9 and got["top1_same_chance_uniform"] == 1 / 9
  # Independent uniform picks land near the chance values.
  assert abs(got["overlap"] - 5 / 9) < 0.1


def test_empty_slots_are_no_picks():
  """Top-P / expert choice leave slots without a pick (NO_PICK = -1): they are not experts, not
  counted, and never match. Figures against plain set loops over the real picks."""
  x = routing.NO_PICK
  a = np.array([[0, 1, x], [2, x, x], [x, x, x], [3, 1, 0]])
  b = np.array([[0, x, x], [2, 3, x], [x, x, x], [1, x, x]])
  # top-1: 0=0, 2=2, none=none, 3!=1 -> 1 of 4 changed.
  assert routing.top1_change(a, b) == 0.25
  # Jaccard: {0,1} vs {0}: 1/2; {2} vs {2,3}: 1/2; {} vs {}: 1 (no change); {0,1,3} vs {1}: 1/3.
  assert routing.mean_jaccard(a, b) == pytest.approx((0.5 + 0.5 + 1 + 1 / 3) / 4, abs=1e-12)
  np.testing.assert_array_equal(routing.expert_counts(a, 4), [2, 2, 1, 1])
  with pytest.raises(ValueError, match=r"in \[0, 4\) or be -1"):
    routing.expert_counts(np.array([[0, -2]]), 4)
  # Shared pool: overlap over tokens with picks on both sides, |A & F| / min(|A|, |F|):
  # {0,1}&{0} = 1/1, {2}&{2,3} = 1/1, {0,1,3}&{1} = 1/1; top-1 same: 0=0, 2=2 (none=none is not a match).
  got = routing.pick_overlap(a, b, 4)
  assert got["overlap"] == 1.0 and got["top1_same"] == 0.5
  # Token-id consistency only over tokens that got an expert: id 5 -> experts 0 and 2 (row 2 has
  # none and is left out): its most frequent top-1 covers 1 of 2 -> 0.5 (1/3 if row 2 counted).
  summary = routing.router_summary(a[:3], None, np.array([5, 5, 5]), 4)
  assert (summary["token_consistency"], summary["token_ids_repeated"]) == (0.5, 1)
  rng = np.random.default_rng(3)
  n, e, k = 200, 7, 4
  def ragged():
    ids = np.full((n, k), x)
    for i in range(n):
      m = rng.integers(0, k + 1)
      ids[i, :m] = rng.permutation(e)[:m]
    return ids
  a, b = ragged(), ragged()
  sets = lambda ids: [set(r[r != x].tolist()) for r in ids]
  jac = np.mean([len(p & q) / len(p | q) if p | q else 1.0 for p, q in zip(sets(a), sets(b))])
  assert routing.mean_jaccard(a, b) == pytest.approx(jac, rel=1e-12)
  counts = np.zeros(e, int)
  for s_ in sets(a):
    for v in s_:
      counts[v] += 1
  np.testing.assert_array_equal(routing.expert_counts(a, e), counts)


def test_collect_reads_empty_top_p_slots_as_no_picks():
  """With top-P selection a token keeps 1..K slots; the probe reports the others as NO_PICK and
  its counts equal the model's own (slot-masked) expert counts."""
  cfg = tiny_config("umoe", n_layers=1, **{"router.selection": "top_p", "router.top_p": 0.3,
                                          "router.entropy_coef": 1e-4})
  model = random_module(lambda: CausalLM(cfg, rngs=nnx.Rngs(params=0)), seed=5)
  graphdef, params = nnx.split(model, nnx.Param)
  params = nnx.to_pure_dict(params)
  rows = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 16)).astype(np.int32)
  _, aux = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t, return_routes=True))(params, rows)
  fn = jax.jit(functools.partial(probe.route_outputs, graphdef=graphdef))
  got = probe.collect(fn, params, rows, n_tokens=32, batch_size=2)
  empty = 0
  for name, r in got.items():
    mask = np.asarray(aux["routes"][name].slot_mask).reshape(32, -1)
    np.testing.assert_array_equal(r.expert_ids == routing.NO_PICK, ~mask)
    empty += int((~mask).sum())
    np.testing.assert_array_equal(routing.expert_counts(r.expert_ids, r.n_experts),
                                  np.asarray(aux["routers"][name]["expert_counts"]))
  assert empty > 0  # the test routes some tokens to fewer than K experts


def test_entropy_by_hand():
  probs = np.array([[0.25, 0.25, 0.25, 0.25], [1.0, 0, 0, 0], [0.5, 0.5, 0, 0]])
  assert routing.entropy(probs) == pytest.approx((math.log(4) + 0 + math.log(2)) / 3, rel=1e-12)


def test_load_figures_by_hand():
  ids = np.array([[0, 1], [0, 2], [0, 1]])
  counts = routing.expert_counts(ids, 5)
  assert counts.tolist() == [3, 2, 1, 0, 0]
  s = routing.load_stats(counts)
  # mean 6/5 = 1.2: max/mean = 2.5; variance (1.8^2 + 0.8^2 + 0.2^2 + 1.2^2 + 1.2^2) / 5 = 1.36.
  assert s["load_max_mean"] == pytest.approx(2.5, rel=1e-12)
  assert s["load_cv"] == pytest.approx(math.sqrt(1.36) / 1.2, rel=1e-12)
  assert s["dead_experts"] == 2 and s["dead_expert_ids"] == [3, 4]
  with pytest.raises(ValueError, match=r"\[0, 2\)"):
    routing.expert_counts(ids, 2)


def test_token_consistency_by_hand():
  tokens = np.array([5, 5, 5, 7, 7, 9])
  top1 = np.array([0, 0, 1, 2, 2, 3])
  # id 5: expert 0 in 2 of 3; id 7: expert 2 in 2 of 2; id 9 occurs once (left out): 4 / 5.
  assert routing.token_consistency(tokens, top1) == (pytest.approx(0.8, rel=1e-12), 2)
  c, n = routing.token_consistency(np.array([1, 2, 3]), np.array([0, 0, 0]))
  assert math.isnan(c) and n == 0


def test_shared_pool_overlap_and_split_by_hand():
  att = np.array([[0], [1], [2]])
  ffn = np.array([[0, 1], [2, 3], [1, 2]])
  got = routing.pick_overlap(att, ffn, 4)
  # same top-1: 0=0, 1!=2, 2!=1 -> 1/3; |A & F| / min(1, 2): 1, 0, 1 -> 2/3; chance max(1, 2)/4 at
  # equal loads; at the measured ones (attention 1/3 each of 0..2, FFN 1/3, 2/3, 2/3, 1/3):
  # 1/9 + 2/9 + 2/9 = 5/9.
  assert got["top1_same"] == pytest.approx(1 / 3) and got["overlap"] == pytest.approx(2 / 3)
  assert got["overlap_chance_uniform"] == 0.5
  assert got["overlap_chance"] == pytest.approx(5 / 9, rel=1e-12)
  share = routing.attention_share([2, 0, 1, 0], [2, 1, 3, 0])
  assert share[:3].tolist() == [0.5, 0.0, 0.25] and math.isnan(share[3])
  summary = report.shared_pool_summary(probe.Routes(att, np.full((3, 4), 0.25)),
                                       probe.Routes(ffn, np.full((3, 4), 0.25)))
  # attention picks [1, 1, 1, 0], FFN picks [1, 2, 2, 1].
  assert summary["attention_share"][:3] == [0.5, 1 / 3, 1 / 3] and summary["attention_share"][3] == 0
  assert summary["attention_share_balanced"] == 1 / 3


def test_report_text_and_json(tmp_path):
  tokens = np.array([4, 4, 6, 6])
  r0 = {"layer_0/attention": probe.Routes(np.array([[0], [0], [1], [1]]), np.full((4, 2), 0.5)),
        "layer_0/ffn": probe.Routes(np.array([[0, 1], [1, 0], [1, 0], [0, 1]]), np.full((4, 2), 0.5))}
  r1 = {"layer_0/attention": probe.Routes(np.array([[1], [0], [1], [1]]), np.full((4, 2), 0.5)),
        "layer_0/ffn": r0["layer_0/ffn"]}
  ref = lambda step: type("Ref", (), {"path": f"ckpt/{step}", "step": step})()
  pairs = [(0, "layer_0/attention", "layer_0/ffn")]
  rep = {"probe": {"tokens": 4, "seq_len": 2, "seed": 0, "data": "hand", "tokenizer": "byte"},
         "routers": report.router_info(r0),
         "checkpoints": [report.checkpoint_entry("10", ref(10), r0, tokens, pairs),
                         report.checkpoint_entry("20", ref(20), r1, tokens, pairs)],
         "fluctuation": [report.fluctuation_entry("10", "20", *[{k: v.expert_ids for k, v in r.items()}
                                                              for r in (r0, r1)])]}
  assert rep["fluctuation"][0]["routers"]["layer_0/attention"] == {"top1_change": 0.25,
                                                                    "jaccard": 0.75}
  # Step 20: token id 4 went to experts 1 and 0 (consistency 1/2), id 6 to 1 twice: 3/4.
  assert rep["checkpoints"][1]["routers"]["layer_0/attention"]["token_consistency"] == 0.75
  text = report.format_report(rep)
  lines = text.splitlines()
  # One row per router and pair (attention: 1 of 4 top-1 picks changed; FFN unchanged), and
  # their mean; columns aligned under a header that names the pair's column.
  head = next(i for i, l in enumerate(lines) if l.split() == ["router", "ckpts", "top-1", "changed",
                                                               "top-k", "Jaccard"])
  assert [l.split() for l in lines[head + 2:head + 5]] == [
      ["layer_0/attention", "10->20", "0.250", "0.750"], ["layer_0/ffn", "10->20", "0.000", "1.000"],
      ["mean", "over", "routers", "10->20", "0.125", "0.875"]]
  assert len({len(l) for l in lines[head:head + 5]}) == 1  # right-aligned numbers: equal widths
  # The per-checkpoint table: a blank line between the checkpoints' blocks.
  first = next(i for i, l in enumerate(lines) if l.startswith("router") and "entropy" in l)
  assert [l.split()[1] if l else "" for l in lines[first + 2:first + 7]] == ["10", "10", "", "20", "20"]
  assert "0.250" in text and "0.750" in text and "ln E" in text and "Shared expert pool" in text
  path = tmp_path / "r.json"
  write_json(str(path), rep)
  back = json.loads(path.read_text())  # strict JSON: NaN written as null
  assert back["checkpoints"][0]["routers"]["layer_0/ffn"]["expert_counts"] == [4, 4]


def test_select_routers_and_pairs():
  names = ["layer_1/ffn", "layer_0/attention", "layer_0/ffn", "layer_1/attention"]
  assert probe.select_routers(names, []) == ["layer_0/attention", "layer_0/ffn",
                                             "layer_1/attention", "layer_1/ffn"]
  assert probe.select_routers(names, ["ffn"]) == ["layer_0/ffn", "layer_1/ffn"]
  assert probe.select_routers(names, ["layer_1/attention"]) == ["layer_1/attention"]
  with pytest.raises(ValueError, match=r"unknown router name 'fnn'.*attention, ffn"):
    probe.select_routers(names, ["fnn"])
  assert probe.shared_pool_pairs(tiny_config("umoe", n_layers=2), names) == [
      (0, "layer_0/attention", "layer_0/ffn"), (1, "layer_1/attention", "layer_1/ffn")]
  assert probe.shared_pool_pairs(tiny_config("umoe", **{"moe.share_pool": False}), names) == []
  assert probe.shared_pool_pairs(tiny_config("ffn_moe"), ["layer_0/ffn"]) == []


# ------------------------------------------------------------------------------------------------
# The probe reads the model's own routing


def test_collect_matches_the_models_routing():
  cfg = tiny_config("umoe", n_layers=2)
  model = random_module(lambda: CausalLM(cfg, rngs=nnx.Rngs(params=0)), seed=3)
  graphdef, params = nnx.split(model, nnx.Param)
  params = nnx.to_pure_dict(params)
  rng = np.random.default_rng(0)
  rows = rng.integers(0, cfg.vocab_size, (3, 16)).astype(np.int32)
  _, aux = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t, return_routes=True))(params, rows)
  fn = jax.jit(functools.partial(probe.route_outputs, graphdef=graphdef))
  n = 40  # fewer than the 48 tokens of the rows: the first 40, row by row
  got = probe.collect(fn, params, rows, n_tokens=n, batch_size=2)  # last batch padded
  assert sorted(got) == sorted(aux["routers"])
  for name, r in got.items():
    full = aux["routes"][name]
    np.testing.assert_array_equal(r.expert_ids, np.asarray(full.expert_ids).reshape(48, -1)[:n])
    np.testing.assert_allclose(r.probs, np.asarray(full.probs).reshape(48, -1)[:n], rtol=1e-5,
                               atol=1e-7)
    # The model's own per-router pick counts (over all 48 tokens) from the routing it used.
    all_counts = routing.expert_counts(np.asarray(full.expert_ids).reshape(48, -1), r.n_experts)
    np.testing.assert_array_equal(all_counts, np.asarray(aux["routers"][name]["expert_counts"]))
    assert r.expert_ids.shape == (n, cfg.attention.top_k if name.endswith("attention")
                                  else cfg.ffn.top_k)
  # Layer 0's attention router sees only the token embedding: routing is a function of the id.
  ids = np.tile(np.arange(8, dtype=np.int32), (2, 2))                          # [2, 16]
  two = probe.collect(fn, params, ids, n_tokens=32, batch_size=2)
  c, n_ids = routing.token_consistency(ids.reshape(-1), two["layer_0/attention"].expert_ids[:, 0])
  assert (c, n_ids) == (1.0, 8)
  assert routing.token_consistency(ids.reshape(-1), two["layer_1/ffn"].expert_ids[:, 0])[0] < 1.0


def test_batch_size_far_above_the_probe_pads_few_rows():
  """--batch_size=1024 for 3 probe windows: forwards of 4 rows, not 1024 (minutes of padding on a
  CPU, or out of memory), with the same routing."""
  cfg = tiny_config("umoe", n_layers=2)
  model = random_module(lambda: CausalLM(cfg, rngs=nnx.Rngs(params=0)), seed=3)
  graphdef, params = nnx.split(model, nnx.Param)
  params = nnx.to_pure_dict(params)
  rows = np.random.default_rng(1).integers(0, cfg.vocab_size, (3, 16)).astype(np.int32)
  fn = jax.jit(functools.partial(probe.route_outputs, graphdef=graphdef))
  shapes = []
  recording = lambda p, tokens: shapes.append(tokens.shape) or fn(p, tokens)  # noqa: E731
  big = probe.collect(recording, params, rows, n_tokens=40, batch_size=1024)
  assert shapes == [(4, 16)]
  small = probe.collect(fn, params, rows, n_tokens=40, batch_size=2)
  assert sorted(big) == sorted(small)
  for name, r in big.items():
    np.testing.assert_array_equal(r.expert_ids, small[name].expert_ids)
    np.testing.assert_allclose(r.probs, small[name].probs, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------------------------------
# Figures


def _png_ok(path) -> tuple[int, int]:
  from matplotlib import image
  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  arr = image.imread(path)
  assert arr.ndim == 3 and arr.shape[0] > 100 and arr.shape[1] > 100
  assert arr[..., :3].std() > 0.05  # not a blank picture
  return arr.shape[:2]


def test_load_heatmap_panels(tmp_path):
  counts = {"layer_0/attention": [3, 1, 0, 4], "layer_1/attention": [2, 2, 2, 2],
            "layer_0/ffn": [5, 5, 1, 1], "layer_1/ffn": [0, 6, 3, 3]}
  fig = plots.load_heatmap(counts, "title here")
  panels = [ax for ax in fig.axes if ax.get_title()]
  assert [ax.get_title() for ax in panels] == ["attention router", "FFN router"]
  assert fig.get_suptitle() == "title here"
  for ax in panels:
    assert ax.get_xlabel() == "expert id" and ax.get_ylabel() == "layer"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0", "1"]
  # Colour data = picks / mean picks: layer 0 attention mean 2 -> [1.5, 0.5, 0, 2].
  np.testing.assert_allclose(panels[0].images[0].get_array()[0], [1.5, 0.5, 0.0, 2.0])
  np.testing.assert_allclose(panels[1].images[0].get_array()[1], [0.0, 2.0, 1.0, 1.0])
  cbar = [ax for ax in fig.axes if ax not in panels][0]
  assert "1 = balanced" in cbar.get_ylabel() and "no pick" in cbar.get_ylabel()
  # Ticks at 0, 0.5 and 1 (the balanced centre, half the bar's length) and integers above, to vmax
  # = 2 here (the largest ratio, 2.0, sets no larger vmax than the minimum of 2).
  assert list(cbar.get_yticks()) == [0.0, 0.5, 1.0, 2.0]
  assert plots.load_ticks(7.99) == [0.0, 0.5, 1.0, 2.0, 4.0, 6.0]
  # Dead experts are marked (one x per unused expert) and cells carry their values.
  assert len(panels[0].collections[0].get_offsets()) == 1
  assert "1.50" in [t.get_text() for t in panels[0].texts]
  # A cell of a few picks is not written as 0.00 (that reads as never picked): 1 / mean 666.7.
  few = plots.load_heatmap({"layer_0/ffn": [1, 999, 1000]}).axes[0]
  assert [t.get_text() for t in few.texts] == ["<.01", "1.50", "1.50"]
  _png_ok(plots.save_png(fig, str(tmp_path / "heat.png")))


def test_fluctuation_and_share_figures(tmp_path):
  series = {"layer_0/attention": ([10, 20], [0.5, 0.1], [0.5, 0.9]),
            "layer_0/ffn": ([10, 20], [0.4, 0.2], [0.6, 0.7]),
            "mean over routers": ([10, 20], [0.45, 0.15], [0.55, 0.8])}
  fig = plots.fluctuation_figure(series, highlight="mean over routers")
  change, jac = fig.axes[:2]
  assert "top-1 expert changed" in change.get_title() and "Jaccard" in jac.get_ylabel()
  assert change.get_xlabel() == "training step" and change.get_ylabel() == "fraction of probe tokens"
  lines = {l.get_label(): l for l in change.get_lines()}
  assert set(lines) == set(series)
  np.testing.assert_allclose(lines["layer_0/ffn"].get_ydata(), [0.4, 0.2])
  assert lines["layer_0/ffn"].get_linestyle() == "--" and lines["mean over routers"].get_linewidth() > 2
  assert [t.get_text() for t in jac.get_legend().get_texts()] == list(series)
  assert [t.get_text() for t in change.get_xticklabels()] == ["10", "20"]  # the measured steps
  _png_ok(plots.save_png(fig, str(tmp_path / "fluct.png")))
  fig = plots.attention_share_heatmap({0: [0.5, 0.0, None], 1: [0.2, 0.9, 1.0]}, 1 / 3)
  ax = fig.axes[0]
  assert "attention picks / all picks" in ax.get_title()
  assert fig.axes[1].get_ylabel() == "attention share\n(grey = expert not picked)"
  png = plots.save_png(fig, str(tmp_path / "share.png"))
  _png_ok(png)
  # The unpicked cell (layer 0, expert 2) is grey, the one at the proportional share would be white.
  cmap = ax.images[0].get_cmap()
  assert mcolors.to_hex(cmap(np.ma.masked_invalid([np.nan]))[0]) == plots.NO_VALUE_COLOR
  assert mcolors.to_hex(cmap(0.5)) != plots.NO_VALUE_COLOR
  # 128 experts (UMoE-base): the figure keeps a readable width (it was 39 inches).
  wide = plots.attention_share_heatmap({0: [0.5] * 128, 1: [0.1] * 128}, 0.2)
  assert wide.get_size_inches()[0] <= 13.0 and wide.axes[1].get_ylabel() == "attention share"


def _write_metrics(path, records):
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "metrics.jsonl"), "w") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")


def test_plot_command_reads_runs(tmp_path, capsys):
  from umoe_jax.plot import runs as plot
  a, b = str(tmp_path / "run_a"), str(tmp_path / "run_b")
  _write_metrics(a, [{"step": 10, "train/lm_loss": 5.0, "train/perplexity": 148.4},
                     {"step": 10, "eval/loss": 5.2, "eval/perplexity": 181.3},
                     {"step": 20, "train/lm_loss": 4.0, "train/perplexity": 54.6},
                     {"step": 20, "train/lm_loss": 3.9, "train/perplexity": 49.4},   # resumed: wins
                     {"step": 20, "routing/layer_0/ffn/top1_change": 0.3,
                      "routing/layer_0/ffn/jaccard": 0.6, "routing/top1_change": 0.3,
                      "routing/jaccard": 0.6},
                     {"step": 30, "routing/layer_0/ffn/top1_change": 0.1,
                      "routing/layer_0/ffn/jaccard": 0.8, "routing/top1_change": 0.1,
                      "routing/jaccard": 0.8}])
  _write_metrics(b, [{"step": 5, "train/lm_loss": 6.0, "train/perplexity": 403.4}])
  m = plot.read_metrics(a)
  assert m["train/lm_loss"] == ([10, 20], [5.0, 3.9])
  assert plot.fluctuation_series(m) == {"layer_0/ffn": ([20, 30], [0.3, 0.1], [0.6, 0.8]),
                                        "mean over routers": ([20, 30], [0.3, 0.1], [0.6, 0.8])}
  fig = plots.loss_figure({"run_a": {k: m[k] for k in plot.CURVE_KEYS if k in m},
                           "run_b": {k: v for k, v in plot.read_metrics(b).items()}})
  loss_ax, ppl_ax = fig.axes[:2]
  assert loss_ax.get_title().startswith("LM loss") and ppl_ax.get_yscale() == "log"
  ys = [list(l.get_ydata()) for l in loss_ax.get_lines()]
  assert ys == [[5.0, 3.9], [5.2], [6.0]]  # run_a train, run_a eval, run_b train
  # run_b's one training interval is a marker (a line of one point draws nothing)
  assert [l.get_marker() for l in loss_ax.get_lines()] == ["None", "o", "s"]
  legend = [t.get_text() for t in ppl_ax.get_legend().get_texts()]
  assert legend[:2] == ["run_a", "run_b"] and "eval (held-out)" in legend
  plots.png_bytes(fig)  # draws: tick labels are set
  ppl_ticks = [t.get_text() for t in ppl_ax.get_yticklabels() + ppl_ax.get_yticklabels(minor=True)]
  assert "100" in ppl_ticks and not any("times" in t or "^" in t for t in ppl_ticks), ppl_ticks
  out = str(tmp_path / "plots")
  assert plot.main([a, b, "--out", out]) == 0
  written = capsys.readouterr().out.split()
  assert [os.path.basename(p) for p in written] == ["curves.png", "routing_fluctuation.png"]
  for p in written:
    _png_ok(p)


def test_plot_command_names_probe_size_and_interval(tmp_path, monkeypatch):
  """routing_fluctuation.png says the probe's size and the steps each point is compared with, as
  the run logged them (routing/probe_tokens, routing/previous_step)."""
  from umoe_jax.plot import runs as plot
  rec = lambda step, prev, tokens: {"step": step, "routing/layer_0/ffn/top1_change": 0.2,
                                    "routing/layer_0/ffn/jaccard": 0.7, "routing/top1_change": 0.2,
                                    "routing/jaccard": 0.7, "routing/previous_step": prev,
                                    "routing/probe_tokens": tokens}
  loss = lambda step: {"step": step, "train/lm_loss": 4.0, "train/perplexity": 54.6}
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  _write_metrics(a, [loss(10), rec(500, 250, 4096), rec(750, 500, 4096)])
  _write_metrics(b, [loss(10), rec(500, 400, 1024), rec(900, 500, 1024)])
  assert plot.probe_context(plot.read_metrics(a)) == ([4096], [250])
  assert plot.probe_context(plot.read_metrics(b)) == ([1024], [100, 400])
  figs = {}
  monkeypatch.setattr(plots, "save_png", lambda fig, path: figs.setdefault(os.path.basename(path), fig))
  plot.plot_runs([a], str(tmp_path / "one"))
  fig = figs.pop("routing_fluctuation.png")
  assert fig._suptitle.get_text() == "Routing fluctuation on the routing probe (4,096 tokens): a"
  assert fig.axes[0].get_title().endswith("since the evaluation 250 steps before")
  plot.plot_runs([a, b], str(tmp_path / "two"))
  fig = figs.pop("routing_fluctuation.png")
  assert fig.axes[0].get_title().endswith("since the previous evaluation (100-400 steps before)")
  assert [t.get_text() for t in fig.axes[1].get_legend().get_texts()] == [
      "a (4,096 tokens)", "b (1,024 tokens)"]


def test_relative_plot_against_a_baseline_run(tmp_path, capsys, monkeypatch):
  """--baseline: each other run's LM loss over the baseline's at the steps both logged, minus 1, in
  percent (training and held-out separately; a step one run lacks, or where the baseline's is 0, is
  left out), drawn in relative.png in each run's curves.png colour; a baseline that is not one of
  the runs, alone, or without a common step is refused naming it, before anything is written."""
  from umoe_jax.plot import runs as plot
  rng = np.random.default_rng(3)
  steps = [25, 50, 75, 100]
  base_train, base_eval = 3.0 + rng.random(4), {0: 11.0, 100: 3.5}
  other_train, other_eval = base_train * (1 + rng.normal(0, 0.01, 4)), {0: 11.05, 100: 3.4, 200: 3.3}
  a, b, c = (str(tmp_path / n) for n in ("bf16", "fp8", "other"))
  _write_metrics(a, [{"step": s, "train/lm_loss": v} for s, v in zip(steps, base_train)]
                 + [{"step": s, "eval/loss": v} for s, v in base_eval.items()]
                 + [{"step": 110, "train/lm_loss": 0.0}])
  _write_metrics(b, [{"step": s, "train/lm_loss": v} for s, v in zip(steps[:3] + [110], other_train)]
                 + [{"step": s, "eval/loss": v} for s, v in other_eval.items()])
  _write_metrics(c, [{"step": 999, "eval/loss": 1.0}])
  rel = plot.relative_series(plot.read_metrics(b), plot.read_metrics(a))
  assert rel["train/lm_loss"][0] == steps[:3]
  np.testing.assert_allclose(rel["train/lm_loss"][1], [100 * (o / t - 1) for o, t in zip(other_train[:3], base_train[:3])])
  assert rel["eval/loss"][0] == [0, 100]
  np.testing.assert_allclose(rel["eval/loss"][1], [100 * (11.05 / 11.0 - 1), 100 * (3.4 / 3.5 - 1)])
  figs = {}
  monkeypatch.setattr(plots, "save_png", lambda fig, path: figs.setdefault(os.path.basename(path), fig) and path)
  assert plot.plot_runs([a, b], str(tmp_path / "out"), "T", baseline=a)[-1].endswith("relative.png")
  fig = figs.pop("relative.png")
  assert fig._suptitle.get_text() == "T: LM loss relative to bf16"
  lines = [l for l in fig.axes[0].get_lines() if len(l.get_xdata()) > 1 and l.get_color() != "black"]
  assert [list(l.get_xdata()) for l in lines] == [steps[:3], [0, 100]]
  np.testing.assert_allclose(lines[1].get_ydata(), rel["eval/loss"][1])
  assert "relative.png" not in figs and plot.plot_runs([a, b], str(tmp_path / "o2")) == [str(tmp_path / "o2" / "curves.png")]
  # The baseline second: the other run keeps its curves.png colour (C0).
  plot.plot_runs([b, a], str(tmp_path / "o6"), baseline=a)
  fig = figs.pop("relative.png")
  assert {l.get_color() for l in fig.axes[0].get_lines() if l.get_color() != "black"} == {"C0"}
  assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()][0] == "fp8"
  for runs, baseline, words in (([a, b], c, "is not one of the runs"), ([a], a, "needs another run"),
                                ([a, c], a, "no step at which the baseline 'bf16'")):
    with pytest.raises(ValueError, match=words):
      plot.plot_runs(runs, str(tmp_path / "o3"), baseline=baseline)
    assert not os.path.exists(tmp_path / "o3")
  monkeypatch.undo()
  assert plot.main([a, b, "--out", str(tmp_path / "o4"), "--baseline", "bf16"]) == 0
  assert capsys.readouterr().out.split() == [str(tmp_path / "o4" / n) for n in ("curves.png", "relative.png")]
  assert plot.main([a, b, "--out", str(tmp_path / "o5"), "--baseline", "nope"]) == 2
  assert "--baseline='nope' is not one of the runs" in capsys.readouterr().err


def test_loss_figure_of_one_step():
  """A run with one record so far (the evaluation at step 0): the step axis shows that step, not
  fractional steps -0.045 .. 0.045 around it."""
  fig = plots.loss_figure({"run": {"eval/loss": ([0], [6.28]), "eval/perplexity": ([0], [533.0])}})
  plots.png_bytes(fig)
  for ax in fig.axes[:2]:
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0"]


def test_plot_command_bad_input(tmp_path, capsys):
  from umoe_jax.plot import runs as plot
  assert plot.main([str(tmp_path / "nowhere")]) == 2
  assert "no metrics.jsonl" in capsys.readouterr().err
  bad = tmp_path / "bad"
  bad.mkdir()
  (bad / "metrics.jsonl").write_text('{"step": 1, "train/loss": 2.0}\nnot json\n')
  with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a metrics record"):
    plot.read_metrics(str(bad))
  # A record cut short before its line end: its column on that line (was "line 2 column 1").
  (bad / "metrics.jsonl").write_text('{"step": 1, "train/loss": 2.0}\n{"step": 2,\n')
  with pytest.raises(ValueError, match=re.escape(
      "metrics.jsonl:2: not a metrics record (JSONDecodeError: Expecting property name enclosed "
      "in double quotes at column 12)")):
    plot.read_metrics(str(bad))
  # A run killed while writing its last line: that line is skipped (it failed the whole file).
  (bad / "metrics.jsonl").write_text('{"step": 1, "train/lm_loss": 2.0}\n{"step": 2, "train/lm_')
  assert plot.read_metrics(str(bad)) == {"train/lm_loss": ([1], [2.0])}
  assert "metrics.jsonl:2: skipped the last line, cut short" in capsys.readouterr().err
  # ... also when it was cut inside a multi-byte character (a UnicodeDecodeError naming no file);
  # a line of other bytes than UTF-8 before the end is named with its line.
  good = '{"step": 1, "train/lm_loss": 2.0}\n'.encode()
  (bad / "metrics.jsonl").write_bytes(good + '{"step": 2, "note": "\u00e9'.encode()[:-1])
  assert plot.read_metrics(str(bad)) == {"train/lm_loss": ([1], [2.0])}
  assert ("metrics.jsonl:2: skipped the last line, cut short (not UTF-8: unexpected end of data)"
          in capsys.readouterr().err)
  (bad / "metrics.jsonl").write_bytes(good + b'{"step": 2, "x\xff": 1}\n' + good)
  with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a metrics record \(UnicodeDecodeError"):
    plot.read_metrics(str(bad))
  # An output directory that cannot be made: one error line (was a traceback).
  (bad / "metrics.jsonl").write_bytes(good)
  assert plot.main([str(bad), "--out", str(bad / "metrics.jsonl" / "plots")]) == 2
  assert capsys.readouterr().err.splitlines()[-1] == (
      f"error: --out='{bad}/metrics.jsonl/plots': '{bad}/metrics.jsonl' is a file, not a directory")


def test_plot_command_labels_runs_apart(tmp_path, capsys):
  from umoe_jax.plot import runs as plot
  assert plot.run_labels(["runs/a/seed0", "runs/b/seed0/"]) == ["a/seed0", "b/seed0"]
  assert plot.run_labels(["runs/x", "other/y/metrics.jsonl"]) == ["x", "y"]
  assert plot.run_labels(["runs/x", "runs/x"]) == ["runs/x", "runs/x'"]
  a, b = str(tmp_path / "a" / "seed0"), str(tmp_path / "b" / "seed0")
  for run, loss in ((a, 5.0), (b, 4.0)):
    _write_metrics(run, [{"step": 10, "train/lm_loss": loss, "train/perplexity": math.exp(loss)}])
  out = str(tmp_path / "plots")
  assert plot.main([a, b, "--out", out]) == 0
  capsys.readouterr()
  from matplotlib import image
  assert image.imread(os.path.join(out, "curves.png")).shape[0] > 100
  fig = plots.loss_figure({label: plot.read_metrics(r) for r, label in
                           zip((a, b), plot.run_labels([a, b]))})
  assert [t.get_text() for t in fig.axes[1].get_legend().get_texts()][:2] == ["a/seed0", "b/seed0"]


def test_fluctuation_plot_of_steps_and_of_other_runs():
  from umoe_jax.analysis import cli
  fluct = lambda a, b, c: {"from": a, "to": b,
                           "routers": {"layer_0/ffn": {"top1_change": c, "jaccard": 1 - c}}}
  ck = lambda label, step: {"label": label, "step": step}
  # Steps of one run: against the step of the later checkpoint.
  rep = {"probe": {"tokens": 64}, "checkpoints": [ck("10", 10), ck("20", 20), ck("40", 40)],
         "fluctuation": [fluct("10", "20", 0.5), fluct("20", "40", 0.25)]}
  change = cli.fluctuation_plot(rep).axes[0]
  assert [t.get_text() for t in change.get_xticklabels()] == ["20", "40"]
  assert change.get_xlabel() == "training step of the later checkpoint"
  # Two runs at the same step (a@40 -> b@40 was drawn at x = 40 on top of a@20 -> a@40): one
  # position per compared pair, named.
  rep["checkpoints"] = [ck("a@20", 20), ck("a@40", 40), ck("b@40", 40)]
  rep["fluctuation"] = [fluct("a@20", "a@40", 0.5), fluct("a@40", "b@40", 0.75)]
  change = cli.fluctuation_plot(rep).axes[0]
  assert [t.get_text() for t in change.get_xticklabels()] == ["a@20 -> a@40", "a@40 -> b@40"]
  assert change.get_xlabel() == "checkpoints compared"
  lines = {l.get_label(): l for l in change.get_lines()}
  assert list(lines["layer_0/ffn"].get_xdata()) == [1, 2]
  np.testing.assert_allclose(lines["layer_0/ffn"].get_ydata(), [0.5, 0.75])
