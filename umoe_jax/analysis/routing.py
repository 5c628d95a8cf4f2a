"""Routing statistics of routers on a fixed probe set: pure numpy functions, no model.

Notation: N probe tokens, E experts a router picks from, K picks per token.
  expert_ids  [N, K] int; slot 0 is the router's first pick (its highest score: `jax.lax.top_k`
              order), called the token's top-1 expert. NO_PICK (-1) marks a slot without a pick
              (top-P and expert-choice selection, `RouterOutput.slot_mask`); a token's picks are
              then a prefix of its slots of any length 0..K (top-1 = NO_PICK: no expert at all)
  probs       [N, E] float, the routing distribution the picks were taken from
  token_ids   [N] int

Between two checkpoints a and b (same probe tokens):
  top1_change(a, b)    fraction of tokens whose top-1 expert differs
  mean_jaccard(a, b)   mean over tokens of |S_a & S_b| / |S_a | S_b|, S = the token's picks
                       (1 for a token with no pick at either checkpoint)
One checkpoint:
  entropy(probs)       mean over tokens of -sum_e p_e ln p_e, in nats (ln E = uniform routing)
  expert_counts        picks per expert [E] (N K in all when every slot holds a pick)
  load_stats           load max / mean, coefficient of variation (population std / mean) and the
                       experts that received no pick
  token_consistency    over the token ids that occur at least twice: the fraction of their
                       occurrences whose top-1 expert is that id's most frequent top-1 expert
                       (1 = routing is a function of the token id; ids seen once say nothing)
A pool shared by the attention and the FFN sub-layer of a layer (UMoE), with picks A [N, K_a] of
the attention router and F [N, K_f] of the FFN router:
  pick_overlap         top1_same: fraction of tokens with the same top-1 expert;
                       overlap: mean |A & F| / min(|A|, |F|) over tokens with picks on both sides;
                       each with its chance level under the measured expert loads (`chance_overlap`:
                       the value if each token's attention and FFN picks were drawn independently,
                       each as that router picks, e.g. sum_e p_a(e) p_f(e) for top-1) and under
                       equal loads (1/E; max(K_a, K_f) / E for independent uniform picks)
  attention_share      per expert, attention picks / (attention + FFN picks); K_a / (K_a + K_f)
                       when the expert serves both sub-layers in proportion to their picks
"""
from __future__ import annotations

from typing import Mapping, Optional

import numpy as np

NO_PICK = -1   # an expert_ids slot that holds no pick


def load_balance(counts: np.ndarray) -> tuple[float, float]:
  """(max / mean, std / mean) of per-expert counts [E]; (nan, nan) if no token was routed."""
  counts = np.asarray(counts, np.float64)
  mean = counts.mean()
  if mean <= 0:
    return float("nan"), float("nan")
  return float(counts.max() / mean), float(counts.std() / mean)


def _check_ids(a: np.ndarray, b: np.ndarray) -> None:
  if a.ndim != 2 or a.shape != b.shape:
    raise ValueError(f"expert_ids must both be [N, K] of one shape; got {a.shape} and {b.shape}")


def top1_change(ids_a: np.ndarray, ids_b: np.ndarray) -> float:
  """Fraction of the N tokens whose top-1 expert (slot 0; NO_PICK counts as a value) differs
  between [N, K] picks a and b."""
  ids_a, ids_b = np.asarray(ids_a), np.asarray(ids_b)
  _check_ids(ids_a, ids_b)
  return float(np.mean(ids_a[:, 0] != ids_b[:, 0]))


def pick_intersection(ids_a: np.ndarray, ids_b: np.ndarray) -> np.ndarray:
  """|S_a & S_b| per token [N] of picks [N, K_a] and [N, K_b] (each token's picks are distinct;
  NO_PICK slots match nothing)."""
  ids_a, ids_b = np.asarray(ids_a), np.asarray(ids_b)
  if ids_a.ndim != 2 or ids_b.ndim != 2 or len(ids_a) != len(ids_b):
    raise ValueError(f"expert_ids must be [N, K] with one N; got {ids_a.shape} and {ids_b.shape}")
  same = (ids_a[:, :, None] == ids_b[:, None, :]) & (ids_a[:, :, None] != NO_PICK)
  return np.sum(same, axis=(1, 2))


def pick_sizes(expert_ids: np.ndarray) -> np.ndarray:
  """|S| per token [N]: the slots of expert_ids [N, K] that hold a pick."""
  return np.sum(np.asarray(expert_ids) != NO_PICK, axis=1)


def mean_jaccard(ids_a: np.ndarray, ids_b: np.ndarray) -> float:
  """Mean over tokens of |S_a & S_b| / |S_a | S_b| of the [N, K] picks of two checkpoints."""
  ids_a, ids_b = np.asarray(ids_a), np.asarray(ids_b)
  _check_ids(ids_a, ids_b)
  inter = pick_intersection(ids_a, ids_b)
  union = pick_sizes(ids_a) + pick_sizes(ids_b) - inter
  return float(np.mean(np.where(union > 0, inter / np.maximum(union, 1), 1.0)))


def entropy(probs: np.ndarray) -> float:
  """Mean routing entropy in nats of probs [N, E] (0 ln 0 = 0)."""
  p = np.asarray(probs, np.float64)
  terms = np.where(p > 0, -p * np.log(np.where(p > 0, p, 1.0)), 0.0)
  return float(np.mean(np.sum(terms, axis=-1)))


def expert_counts(expert_ids: np.ndarray, n_experts: int) -> np.ndarray:
  """Picks per expert [E] (int64) of expert_ids [N, K] (NO_PICK slots not counted)."""
  ids = np.asarray(expert_ids).reshape(-1)
  ids = ids[ids != NO_PICK]
  if ids.size and (ids.min() < 0 or ids.max() >= n_experts):
    raise ValueError(f"expert ids must lie in [0, {n_experts}) or be {NO_PICK} (no pick); got "
                     f"{ids.min()}..{ids.max()}")
  return np.bincount(ids, minlength=n_experts).astype(np.int64)


def load_stats(counts: np.ndarray) -> dict:
  """{"load_max_mean", "load_cv", "dead_experts" (how many got no pick), "dead_expert_ids"}."""
  counts = np.asarray(counts)
  max_mean, cv = load_balance(counts)
  dead = np.flatnonzero(counts == 0)
  return {"load_max_mean": max_mean, "load_cv": cv, "dead_experts": int(dead.size),
          "dead_expert_ids": dead.tolist()}


def token_consistency(token_ids: np.ndarray, top1: np.ndarray) -> tuple[float, int]:
  """(consistency, number of token ids it is taken over) of token_ids [N] routed to top1 [N].

  Over ids occurring at least twice: sum_v max_e c[v, e] / sum_v n_v, with c[v, e] the occurrences
  of id v whose top-1 is e and n_v those of v. NaN (and 0 ids) if no id repeats.
  """
  token_ids, top1 = np.asarray(token_ids).reshape(-1), np.asarray(top1).reshape(-1)
  if token_ids.shape != top1.shape:
    raise ValueError(f"token_ids {token_ids.shape} and top-1 experts {top1.shape} must match")
  pairs, pair_counts = np.unique(np.stack([token_ids, top1], axis=1), axis=0, return_counts=True)
  # np.unique sorts the (id, expert) rows: the rows of one id are contiguous.
  starts = np.flatnonzero(np.r_[True, pairs[1:, 0] != pairs[:-1, 0]])
  per_id_max = np.maximum.reduceat(pair_counts, starts)
  per_id_total = np.add.reduceat(pair_counts, starts)
  repeated = per_id_total >= 2
  if not repeated.any():
    return float("nan"), 0
  return float(per_id_max[repeated].sum() / per_id_total[repeated].sum()), int(repeated.sum())


def chance_overlap(att_ids: np.ndarray, ffn_ids: np.ndarray, n_experts: int) -> dict:
  """{"top1_same", "overlap"} expected if each token's attention picks and FFN picks were
  independent, each router keeping its measured expert loads: the two figures of `pick_overlap`
  for a token whose attention picks are those of a random probe token and whose FFN picks are those
  of another, independently drawn one.

  Top-1, with p_a(e), p_f(e) the fractions of tokens whose top-1 expert is e:
      P(same top-1) = sum_e p_a(e) p_f(e)                    (1/E at equal loads)
  Top-k: E|A & F| = sum_e P(e in A) P(e in F) by linearity of expectation, whatever the joint law of
  a router's K picks, so with pi_a(e), pi_f(e) the fractions of tokens that picked e (the loads,
  summing to K_a and K_f):
      E[|A & F| / min(K_a, K_f)] = sum_e pi_a(e) pi_f(e) / min(K_a, K_f)
  (max(K_a, K_f) / E at equal loads pi = K / E). Where tokens have different numbers of picks
  (NO_PICK slots), tokens are grouped by their number of picks s, with w(s) the fraction of tokens
  having s picks and pi^s(e) the fraction of those that picked e:
      sum_{s_a, s_f > 0} w_a(s_a) w_f(s_f) sum_e pi_a^s_a(e) pi_f^s_f(e) / min(s_a, s_f)
      / (sum_{s_a > 0} w_a(s_a) sum_{s_f > 0} w_f(s_f))
  (the mean over token pairs with picks on both sides), NaN if no token has picks on both sides.
  """
  att_ids, ffn_ids = np.asarray(att_ids), np.asarray(ffn_ids)
  n = len(att_ids)
  top1 = lambda ids: expert_counts(ids[:, :1], n_experts) / n
  same = float(np.dot(top1(att_ids), top1(ffn_ids)))

  def by_size(ids):  # {s: (w(s), pi^s [E])} over the token sizes s > 0
    sizes = pick_sizes(ids)
    return {int(s): (float(np.mean(sizes == s)),
                     expert_counts(ids[sizes == s], n_experts) / np.sum(sizes == s))
            for s in np.unique(sizes) if s > 0}

  att, ffn = by_size(att_ids), by_size(ffn_ids)
  both = sum(w for w, _ in att.values()) * sum(w for w, _ in ffn.values())
  total = sum(w_a * w_f * float(np.dot(pi_a, pi_f)) / min(s_a, s_f)
              for s_a, (w_a, pi_a) in att.items() for s_f, (w_f, pi_f) in ffn.items())
  return {"top1_same": same, "overlap": total / both if both > 0 else float("nan")}


def pick_overlap(att_ids: np.ndarray, ffn_ids: np.ndarray, n_experts: int) -> dict:
  """Attention vs FFN picks [N, K_a], [N, K_f] of one shared pool of E experts (module docstring):
  {"top1_same", "overlap"}, their chance levels under the measured loads ("top1_same_chance",
  "overlap_chance": `chance_overlap`) and under equal loads ("..._chance_uniform")."""
  att_ids, ffn_ids = np.asarray(att_ids), np.asarray(ffn_ids)
  k_a, k_f = att_ids.shape[1], ffn_ids.shape[1]
  inter = pick_intersection(att_ids, ffn_ids)
  smaller = np.minimum(pick_sizes(att_ids), pick_sizes(ffn_ids))
  both = smaller > 0
  chance = chance_overlap(att_ids, ffn_ids, n_experts)
  return {"top1_same": float(np.mean((att_ids[:, 0] == ffn_ids[:, 0]) & (att_ids[:, 0] != NO_PICK))),
          "top1_same_chance": chance["top1_same"],
          "top1_same_chance_uniform": 1.0 / n_experts,
          "overlap": (float(np.mean(inter[both] / smaller[both])) if both.any() else float("nan")),
          "overlap_chance": chance["overlap"],
          "overlap_chance_uniform": max(k_a, k_f) / n_experts}


def attention_share(att_counts: np.ndarray, ffn_counts: np.ndarray) -> np.ndarray:
  """Per expert, attention picks / (attention + FFN picks) [E]; NaN for an expert neither used."""
  att, ffn = np.asarray(att_counts, np.float64), np.asarray(ffn_counts, np.float64)
  total = att + ffn
  return np.where(total > 0, att / np.where(total > 0, total, 1.0), np.nan)


def router_summary(expert_ids: np.ndarray, probs: Optional[np.ndarray],
                   token_ids: np.ndarray, n_experts: int) -> dict:
  """Every one-checkpoint figure of one router (entropy only with probs)."""
  counts = expert_counts(expert_ids, n_experts)
  top1 = np.asarray(expert_ids)[:, 0]
  picked = top1 != NO_PICK   # consistency over the tokens that got an expert
  consistency, n_ids = token_consistency(np.asarray(token_ids).reshape(-1)[picked], top1[picked])
  out = {"entropy": entropy(probs) if probs is not None else float("nan"),
         **load_stats(counts), "token_consistency": consistency, "token_ids_repeated": n_ids,
         "expert_counts": counts.tolist()}
  return out


def fluctuation(ids_a: Mapping[str, np.ndarray], ids_b: Mapping[str, np.ndarray]) -> dict:
  """{router: {"top1_change", "jaccard"}} between two checkpoints' picks {router: [N, K]}."""
  missing = sorted(set(ids_a) ^ set(ids_b))
  if missing:
    raise ValueError(f"the two checkpoints' routers differ: {', '.join(missing)}")
  return {name: {"top1_change": top1_change(ids_a[name], ids_b[name]),
                 "jaccard": mean_jaccard(ids_a[name], ids_b[name])} for name in ids_a}
