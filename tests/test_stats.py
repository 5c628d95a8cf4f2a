"""umoe_jax.stats: parameter counts, MACs, KV-cache bytes against the paper and hand computations.

Only abstract models (shapes, no memory) are built; the whole module runs in well under a minute.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from umoe_jax import stats  # noqa: E402

import paper_counts  # noqa: E402  (hand counts of the paper's configs from their dimensions)


def load(name):
  return stats.load_config_file(os.path.join(ROOT, "configs", f"{name}.py"))


# Total parameters: the official configs (reference report §2.1/2.2), vocab 32,000.
PARAM_TARGETS = {
    "dense_base": 134.1e6, "ffn_moe_base": 535.2e6, "umoe_base": 540.5e6,
    "dense_large": 1087.5e6, "ffn_moe_large": 3808.5e6, "umoe_large": 3676.4e6,
}
# Forward MACs, 4 x 1024 tokens: base = the paper's Table 1 (as recomputed in the report, §2.4);
# large = the report's own computation (not in the paper).
MAC_TARGETS = {
    "dense_base": 525.9e9, "ffn_moe_base": 530.7e9, "umoe_base": 617.5e9,
    "dense_large": 4598e9, "ffn_moe_large": 4611e9, "umoe_large": 4754e9,
}


@pytest.mark.parametrize("name", sorted(PARAM_TARGETS))
def test_params_match_paper_and_analytic_breakdown(name):
  cfg = load(name)
  total = stats.total_params(cfg)                                   # counted on the real model
  assert total == paper_counts.hand_params(*name.rsplit("_", 1))   # by hand, exactly
  assert abs(total - PARAM_TARGETS[name]) <= 1e5, total             # the figure's printed 0.1M
  assert stats.param_mismatches(cfg) == {}                          # every component agrees
  assert stats.total_params(cfg, from_model=False) == total


@pytest.mark.parametrize("name", sorted(MAC_TARGETS))
def test_forward_macs_match_targets(name):
  macs = stats.forward_macs(load(name), batch=4, seq_len=1024)
  assert macs == paper_counts.hand_macs(*name.rsplit("_", 1))      # by hand, exactly
  printed = 1e8 if name.endswith("_base") else 1e9                  # the figures' last digit
  assert abs(macs - MAC_TARGETS[name]) <= printed, macs / 1e9
  assert stats.forward_flops(load(name), 4, 1024) == 2 * macs


def test_umoe_base_macs_by_hand():
  b, t, d, v, layers, e, f, dk, r, ka, kf = 4, 1024, 768, 32000, 12, 128, 192, 192, 16, 3, 15
  per_token = (2 * d * e                       # two routers
               + 3 * d * dk                    # key, shared query, residual query
               + ka * (d * r + r * dk)         # top-k routed low-rank queries only
               + (ka + 1) * 2 * d * f          # attention: routed + always-on experts
               + (kf + 1) * 2 * d * f)         # FFN: routed + always-on experts
  pairs = (ka + 1) * (dk + d)                  # 1 + k_att query heads: q.k^T over d_k, a.X over d
  expected = layers * (b * t * per_token + b * t * t * pairs) + b * t * d * v
  assert stats.forward_macs(load("umoe_base"), b, t) == expected
  # causal: only the T(T+1)/2 visible pairs
  causal = layers * (b * t * per_token + b * t * (t + 1) // 2 * pairs) + b * t * d * v
  assert stats.forward_macs(load("umoe_base"), b, t, causal=True) == causal


def test_train_flops_per_token_is_three_forwards():
  cfg = load("dense_base")
  fwd_per_token = stats.forward_macs(cfg, 1, 1024) / 1024
  assert stats.train_flops_per_token(cfg, 1024) == pytest.approx(6 * fwd_per_token)
  assert stats.train_flops_per_token(cfg, 1024, causal=True) < stats.train_flops_per_token(cfg, 1024)


def test_active_params_by_hand():
  d, layers, f = 768, 12, 192
  expert = 2 * d * f
  ffn_moe = load("ffn_moe_base")
  assert stats.active_params(ffn_moe) == stats.total_params(ffn_moe) - layers * (128 - 15) * expert
  umoe = load("umoe_base")
  query = d * 16 + 16 * 192                    # one routed low-rank query (W_a^i, W_b^i)
  inactive = layers * ((128 - (3 + 15)) * expert + (128 - 3) * query)
  assert stats.active_params(umoe) == stats.total_params(umoe) - inactive
  dense = load("dense_base")
  assert stats.active_params(dense) == stats.total_params(dense)
  emb = 2 * 32000 * d
  assert stats.active_params(umoe, non_embedding=True) == stats.active_params(umoe) - emb


def test_pool_shared_across_layers_counted_once():
  """moe.share_across_layers: the layers' routed experts are one pool, counted once in the total
  (the real model agrees, component by component); a token's active experts are those its layers
  can pick together, min(E, k * layers) of the pool."""
  expert, e, k = 2 * 768 * 192, 128, 15
  for layers in (4, 12):                       # 60 of 128 experts picked; then 180: all of them
    own = load("ffn_moe_base")
    own.model.n_layers = layers
    shared = load("ffn_moe_base")
    shared.model.n_layers = layers
    shared.model.moe.share_across_layers = True
    assert stats.param_mismatches(shared) == {}
    total = stats.total_params(own) - (layers - 1) * e * expert
    assert stats.total_params(shared) == stats.total_params(shared, from_model=False) == total
    assert stats.active_params(shared) == total - (e - min(e, k * layers)) * expert, layers


def test_kv_bytes_by_hand():
  umoe, dense = load("umoe_base"), load("dense_base")
  assert sum(stats.kv_cache_values_per_token(umoe).values()) == 192 + 768 == 960
  assert sum(stats.kv_cache_values_per_token(dense).values()) == 2 * 4 * 192 == 1536
  assert stats.kv_cache_bytes_per_token(umoe) == {"per_layer": 960 * 2, "total": 960 * 2 * 12}
  assert stats.kv_cache_bytes_per_token(dense, "float32") == {"per_layer": 1536 * 4,
                                                              "total": 1536 * 4 * 12}
  large = load("umoe_large")
  assert stats.kv_cache_bytes_per_token(large)["total"] == (512 + 2048) * 2 * 24


@pytest.mark.parametrize("name", ["dense_tiny", "ffn_moe_tiny", "umoe_tiny", "umoe_base"])
def test_kv_bytes_match_what_the_model_cache_allocates(name):
  import jax
  import jax.numpy as jnp
  from umoe_jax.config import model_config
  cfg = model_config(load(name).model)
  batch, slots = 2, 16
  try:
    from umoe_jax.model.cache import init_cache
  except ImportError:
    init_cache = None
  if init_cache is not None:
    # The decoding cache, shapes only: its bytes per token are what the statistics report.
    for dtype in ("bfloat16", "float32"):
      cache = jax.eval_shape(lambda: init_cache(cfg, batch, slots, dtype))
      allocated = sum(a.size * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(cache.layers))
      assert allocated == batch * slots * stats.kv_cache_bytes_per_token(cfg, dtype)["total"]
  else:
    # No cache API: what the model's projections produce per token and layer (mha: keys H*d_k and
    # values H*d_v; premix: one key d_k and the normed hidden state d as the value).
    from flax import nnx
    from umoe_jax.model import abstract_model
    att = abstract_model(cfg).layers[0].attention
    width = lambda lin: nnx.state(lin, nnx.Param)["kernel"].get_value().shape[-1]
    value = width(att.v_proj) if cfg.attention.kind == "mha" else cfg.d_model
    assert sum(stats.kv_cache_values_per_token(cfg).values()) == width(att.k_proj) + value


def test_unknown_attention_kind_names_the_fix():
  with pytest.raises(ValueError, match="ATTENTION_STATS.register"):
    stats.attention_stats("no_such_kind")


def test_table_mentions_the_figures():
  s = stats.model_stats(load("umoe_base"), batch=4, seq_len=1024, name="umoe_base")
  assert s["params"]["check"] == "ok" and s["kv_cache"]["check"] in ("ok", "skipped")
  table = stats.format_table(s)
  params, macs = paper_counts.hand_params("umoe", "base"), paper_counts.hand_macs("umoe", "base")
  for text in (f"{params / 1e6:.2f}M", f"{macs / 1e9:.2f}G", "960 values", "attention_routed", "ok"):
    assert text in table
  json.dumps(s)                                                   # JSON-ready


def _cli(*runs):
  """Runs `python -m umoe_jax.stats ARGS` for each ARGS concurrently; parsed JSON outputs."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  procs = [subprocess.Popen([sys.executable, "-m", "umoe_jax.stats", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for args in runs]
  outs = []
  for proc in procs:
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 0, stderr[-2000:]
    outs.append(json.loads(stdout))
  return outs


def test_cli_json_and_override():
  base, two = _cli(["--config=configs/umoe_tiny.py", "--json"],
                   ["--config=configs/umoe_tiny.py", "--config.model.n_layers=2", "--json",
                    "--batch=2", "--seq_len=128"])
  cfg = load("umoe_tiny")
  m = cfg.model  # the hand count of tests/paper_counts.py at this config's dimensions
  dims = dict(d=m.d_model, layers=m.n_layers, vocab=m.vocab_size, heads=m.attention.n_heads,
              dh=m.attention.head_dim, d_ff=m.ffn.d_ff, experts=m.moe.n_experts, de=m.moe.d_expert,
              k_ffn=m.ffn.top_k, k_att=m.attention.top_k, rank=m.attention.q_lora_rank)
  assert base["params"]["total"] == paper_counts.hand_params("umoe", dims)
  assert base["params"]["check"] == two["params"]["check"] == "ok"
  assert base["macs"]["forward"] == paper_counts.hand_macs("umoe", dims, 4, m.max_seq_len)
  assert two["overrides"] == {"model.n_layers": 2} and two["model"]["n_layers"] == 2

  # Everything outside the layers (embedding, LM head, final norm) stays; the layers halve.
  m = cfg.model
  outside = 2 * m.vocab_size * m.d_model + m.d_model
  layers = m.n_layers
  assert two["params"]["total"] - outside == (base["params"]["total"] - outside) * 2 // layers
  assert two["params"]["active"] - outside == (base["params"]["active"] - outside) * 2 // layers
  assert two["kv_cache"]["bytes_per_token"] == base["kv_cache"]["bytes_per_token"] * 2 // layers
  head = 2 * 128 * m.d_model * m.vocab_size
  per_layer_macs = stats.forward_macs(cfg, 2, 128) - head
  assert two["macs"]["forward"] - head == per_layer_macs * 2 // layers


def test_cli_bad_input_is_one_error_line(tmp_path):
  """Flags and configs the command cannot count: one "error:" line naming the flag or key and exit
  status 1, before any model is built (were a ZeroDivisionError, numpy's TypeError, a
  FileNotFoundError and a ConfigError traceback)."""
  def zoo_dir(name: str, file: str, text: str):
    """tmp_path/name holding one file."""
    (tmp_path / name).mkdir()
    (tmp_path / name / file).write_text(text)
    return tmp_path / name

  broken = zoo_dir("zoo", "x_tiny.py", "def get_config():\n  raise ValueError('bad scale')\n")
  # The zoo loads its configs with config_file's loader (was its own, naming no line): the messages
  # of --config= files, the file named as "zoo config PATH".
  syntax = zoo_dir("syntax_zoo", "s_tiny.py", "import ml_collections\n\ndef get_config(:\n  pass\n")
  no_return = zoo_dir("no_return_zoo", "n_base.py", "def get_config():\n  x = 1\n")
  no_get_config = zoo_dir("no_get_config_zoo", "g_large.py", "CONFIG = {}\n")
  empty = zoo_dir("empty", "notes_tiny.txt", "not a config")
  a_file = tmp_path / "zoo.py"
  a_file.write_text("")
  no_model = tmp_path / "data_only.py"  # e.g. another command's config
  no_model.write_text("import ml_collections\n\ndef get_config():\n  return "
                      "ml_collections.ConfigDict({'data': {'source': 'text'}})\n")
  bad_model = zoo_dir("bad_model", "y_tiny.py", "import ml_collections\n\ndef get_config():\n  "
                      "return ml_collections.ConfigDict({'model': {'d_model': -3}})\n")
  tiny = "--config=configs/umoe_tiny.py"
  max_seq_len = load("umoe_tiny").model.max_seq_len
  cases = {
      (tiny, "--batch=0"): "error: --batch=0 must be >= 1",
      (tiny, "--seq_len=0"): "error: --seq_len=0 must be >= 1",
      # Longer than the model runs (LM refuses it for every attention kind): was counted silently.
      (tiny, f"--seq_len={max_seq_len + 1}"): f"error: --seq_len={max_seq_len + 1} exceeds the "
                                              f"model's max_seq_len={max_seq_len}; lower --seq_len "
                                              "or raise --config.model.max_seq_len",
      (tiny, "--kv_dtype=float13"): "error: --kv_dtype='float13' is not a numeric dtype (e.g. "
                                    "bfloat16, float16, float32, int8, float8_e4m3fn)",
      # A numpy dtype but no number (was 0 bytes per value, the KV cache 0 B).
      (tiny, "--kv_dtype=str"): "error: --kv_dtype='str' is not a numeric dtype (e.g. bfloat16, "
                                "float16, float32, int8, float8_e4m3fn)",
      (tiny, "stray"): "error: unexpected arguments: stray",
      # Was "unknown key model.data (={...}); valid keys of model: ..." (read as a model section).
      (f"--config={no_model}",): f"error: --config={no_model} has no model section (config.model) "
                                 "and no model key such as d_model; its keys: data",
      # No zoo config there (was an empty table and exit status 0), a file (was "no such directory").
      ("--zoo", f"--zoo_dir={empty}"): f"error: --zoo_dir='{empty}' holds no zoo config: expected "
                                       "config files named *_tiny.py, *_base.py, *_large.py (like "
                                       "configs/umoe_tiny.py)",
      # An invalid model in a zoo config: the file is named (was "model.d_model=-3 must be ...").
      ("--zoo", f"--zoo_dir={bad_model}"): f"error: zoo config {bad_model / 'y_tiny.py'}: "
                                           "model.d_model=-3 must be positive",
      ("--zoo", f"--zoo_dir={a_file}"): f"error: --zoo_dir='{a_file}' is a file, not a directory "
                                        "of zoo configs",
      (tiny, "--config.model.d_model=-3"): "error: model.d_model=-3 must be positive",
      ("--zoo", f"--zoo_dir={tmp_path / 'none'}"): f"error: --zoo_dir='{tmp_path / 'none'}': no "
                                                   "such directory",
      ("--zoo", f"--zoo_dir={broken}"): f"error: zoo config {broken / 'x_tiny.py'} does not load "
                                        "(ValueError at line 2: bad scale)",
      ("--zoo", f"--zoo_dir={syntax}"): f"error: zoo config {syntax / 's_tiny.py'} does not load "
                                        "(SyntaxError at line 3: invalid syntax)",
      ("--zoo", f"--zoo_dir={no_return}"): f"error: zoo config {no_return / 'n_base.py'} does not "
                                           "load: its get_config() returned None, not a ConfigDict "
                                           "(a missing return?)",
      ("--zoo", f"--zoo_dir={no_get_config}"): f"error: zoo config {no_get_config / 'g_large.py'} "
                                               "defines no get_config() (a config file is Python "
                                               "whose get_config() returns its ConfigDict)",
  }
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  procs = {args: subprocess.Popen([sys.executable, "-m", "umoe_jax.stats", *args], cwd=ROOT,
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for args in cases}
  for args, proc in procs.items():
    stdout, stderr = proc.communicate(timeout=180)
    assert (proc.returncode, stdout, stderr.strip()) == (1, "", cases[args]), (args, stderr[-2000:])


def test_model_zoo_doc_is_current():
  with open(os.path.join(ROOT, "docs", "model_zoo.md")) as f:
    doc = f.read()
  assert stats.zoo_markdown(os.path.join(ROOT, "configs")) in doc, (
      "docs/model_zoo.md is stale: regenerate the table with `python -m umoe_jax.stats --zoo`")


@pytest.mark.parametrize("router", ["xmoe", "hash", "topk_sigmoid"])
@pytest.mark.parametrize("name", ["umoe_tiny", "ffn_moe_tiny", "moa_tiny", "switchhead_tiny"])
def test_router_kinds_counted(name, router):
  """Router parameters / MACs follow `router.kind` (X-MoE: D x d_r + E x d_r (+ tau); hash: none):
  the analytic count agrees with the model, component by component."""
  cfg = load(name)
  with cfg.unlocked():
    cfg.model.router.kind = router
  assert stats.param_mismatches(cfg) == {}
  assert stats.total_params(cfg, from_model=False) == stats.total_params(cfg)
  base = load(name)
  by_kind = stats.total_params(cfg) - stats.total_params(base)
  if router == "hash":
    assert by_kind < 0 and stats.forward_macs(cfg, 1, 8) < stats.forward_macs(base, 1, 8)
  if router == "topk_sigmoid":
    assert by_kind == 0


@pytest.mark.parametrize("router", ["smoe_dropout", "stablemoe", "similarity_aware", "attention_aware"])
@pytest.mark.parametrize("name", ["umoe_tiny", "ffn_moe_tiny", "switchhead_tiny"])
def test_related_work_router_kinds_counted(name, router):
  """Parameters agree with the model; by kind: SMoE-Dropout's fixed map and the mixing routers are
  a D x E map like top-k; StableMoE adds its token table and distilled centroids; the mixing over
  earlier tokens costs (D + E) (similarity) or E (attention) MACs per (query, key) pair per router."""
  cfg, base = load(name), load(name)
  with cfg.unlocked():
    cfg.model.router.kind = router
  if router == "attention_aware" and name != "ffn_moe_tiny":  # needs MHA's probabilities: refused
    with pytest.raises(ValueError, match="model.router.kind='attention_aware' with model.attention"):
      stats.total_params(cfg)
    return
  assert stats.param_mismatches(cfg) == {}
  assert stats.total_params(cfg, from_model=False) == stats.total_params(cfg)
  m = stats.as_model_config(cfg)
  experts = [e for _, _, e in stats._layer_routers(m)]
  n_routers = len(experts) * m.n_layers
  added = stats.total_params(cfg) - stats.total_params(base)
  if router == "stablemoe":
    if name != "switchhead_tiny":  # pool routers over moe.n_experts (E x D centroids replace D x E)
      assert added == n_routers * (m.vocab_size + m.moe.n_experts) * m.router.stablemoe_distill_dim
  else:
    assert added == 0
  b, t = 2, 16
  extra = (stats.forward_mac_breakdown(cfg, b, t)["routers"]
           - stats.forward_mac_breakdown(base, b, t)["routers"])
  pairs = b * t * t
  if router == "similarity_aware":
    assert extra == pairs * sum(m.d_model + e for e in experts) * m.n_layers
  elif router == "attention_aware":
    assert extra == pairs * m.moe.n_experts * m.n_layers
  elif router == "stablemoe":
    assert extra == b * t * sum(m.router.stablemoe_distill_dim * e
                                for e in experts) * m.n_layers
  else:
    assert extra == 0


@pytest.mark.parametrize("gated", [False, True])
def test_aoe_counted(gated):
  """AoE: every expert's first (activated) projection is D x r + r x d_e, no router weights; each
  token computes every expert's code (router MACs E D r) and reads all codes (active parameters)."""
  cfg, base = load("ffn_moe_tiny"), load("ffn_moe_tiny")
  for c in (cfg, base):
    with c.unlocked():
      c.model.moe.gated = gated
  with cfg.unlocked():
    cfg.model.router.kind = "aoe"
    cfg.model.router.aoe_dim = 5
  assert stats.param_mismatches(cfg) == {}
  m = stats.as_model_config(cfg)
  d, e, f, r, k = m.d_model, m.moe.n_experts, m.moe.d_expert, 5, m.ffn.top_k
  per_expert = d * r + r * f + (2 if gated else 1) * d * f
  layers = m.n_layers
  assert stats.total_params(cfg) - stats.total_params(base) == layers * (e * (per_expert - stats.mlp(m, f)) - d * e)
  assert stats.active_params(cfg) - stats.active_params(base) == layers * (
      k * (per_expert - stats.mlp(m, f)) + (e - k) * d * r - d * e)
  macs, base_macs = stats.forward_mac_breakdown(cfg, 1, 8), stats.forward_mac_breakdown(base, 1, 8)
  assert macs["routers"] == 8 * layers * e * d * r
  assert macs["experts"] - base_macs["experts"] == 8 * layers * k * (per_expert - stats.mlp(m, f))


def test_stats_resolve_a_model_config_like_the_model():
  """A ModelConfig handed in directly gets the derived defaults (router.aoe_dim None -> D // 3)."""
  import dataclasses
  m = stats.as_model_config(load("ffn_moe_tiny"))
  aoe = dataclasses.replace(m, router=dataclasses.replace(m.router, kind="aoe", aoe_dim=None))
  assert stats.as_model_config(aoe).router.aoe_dim == m.d_model // 3
  assert stats.total_params(aoe) == stats.total_params(
      dataclasses.replace(aoe, router=dataclasses.replace(aoe.router, aoe_dim=m.d_model // 3)))
