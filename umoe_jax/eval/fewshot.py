"""Few-shot prompts with lm-evaluation-harness conventions.

The prompt of item d with k examples e_1..e_k is

    description + e_1.example() + "\\n\\n" + ... + e_k.example() + "\\n\\n" + <d's context>

and each continuation is scored after it as in zero-shot (target delimiter " "; `Doc.example()` is
the item solved: query + " " + gold choice, gold option + " " + continuation, context + " " + word).

Examples are drawn per item, in item order, from one `random.Random(seed)` (seed 1234 by default,
lm-eval's `fewshot_random_seed`):
  * from a separate pool (another split): `rnd.sample(pool, k)`;
  * from the scored file itself: `rnd.sample(pool, k + 1)`, items equal to the scored one removed,
    the first k kept (if duplicates of it left fewer than k, k are drawn again from the pool without
    them);
  * sampler "first_n" (MMLU's dev split): the first k of the pool, always the same.
lm-eval draws the same way, so the same file, seed and k give the same prompts there.

    prefixes = fewshot_prefixes(docs, k=3)                        # same file, excluding each item
    prefixes = fewshot_prefixes(docs[:100], k=3, pool=docs, exclude_self=True)   # --limit=100
    prefixes = fewshot_prefixes(docs, k=5, pool=dev, sampler="first_n", description="...\\n\\n")
"""
from __future__ import annotations

import random
from typing import Optional, Sequence

from umoe_jax.eval.errors import EvalError
from umoe_jax.eval.tasks import Doc

FEWSHOT_DELIMITER = "\n\n"
DEFAULT_SEED = 1234
SAMPLERS = ("random", "first_n")


def draw_examples(docs: Sequence[Doc], k: int, *, pool: Optional[Sequence[Doc]] = None,
                  exclude_self: Optional[bool] = None, seed: int = DEFAULT_SEED,
                  sampler: str = "random", task: str = "task") -> list[list[Doc]]:
  """The k examples of every item of `docs` (see the module docstring).

  `pool` None means docs itself. `exclude_self` (default: pool is None) says the pool is the scored
  file (e.g. all of it while only the first --limit items are scored): items equal to the scored
  one are never its examples.

  EvalError when k is negative, the sampler unknown, or the pool has fewer than k examples (k + 1
  with the scored file as its own pool).
  """
  if sampler not in SAMPLERS:
    raise EvalError(f"{task}: unknown few-shot sampler {sampler!r}; valid: {', '.join(SAMPLERS)}")
  if k < 0:
    raise EvalError(f"{task}: num_fewshot={k} must be >= 0")
  if k == 0:
    return [[] for _ in docs]
  same = pool is None if exclude_self is None else exclude_self
  pool = list(docs if pool is None else pool)
  available = len(pool) - (1 if same else 0)
  if k > available:
    n = max(available, 0)
    where = "the other items of the file have" if same else "the few-shot pool has"
    raise EvalError(f"{task}: {k} shots requested but {where} only {n} "
                    f"example{'' if n == 1 else 's'}")
  if sampler == "first_n":
    return [([x for x in pool if x != d] if same else pool)[:k] for d in docs]
  rnd = random.Random(seed)
  out = []
  for d in docs:
    if not same:
      out.append(rnd.sample(pool, k))
      continue
    picked = [x for x in rnd.sample(pool, k + 1) if x != d][:k]
    if len(picked) < k:   # duplicates of d were drawn: draw again without any copy of it
      others = [x for x in pool if x != d]
      if len(others) < k:
        raise EvalError(f"{task}: {k} shots requested but only {len(others)} items differ from "
                        f"item {d!r:.80}")
      picked = rnd.sample(others, k)
    out.append(picked)
  return out


def render_prefix(examples: Sequence[Doc], description: str = "") -> str:
  """description + every example solved, each followed by the few-shot delimiter."""
  return description + "".join(e.example() + FEWSHOT_DELIMITER for e in examples)


def fewshot_prefixes(docs: Sequence[Doc], k: int, *, pool: Optional[Sequence[Doc]] = None,
                     exclude_self: Optional[bool] = None, seed: int = DEFAULT_SEED,
                     sampler: str = "random", description: str = "",
                     task: str = "task") -> list[str]:
  """The prompt prefix of every item (description + its k solved examples)."""
  return [render_prefix(ex, description)
          for ex in draw_examples(docs, k, pool=pool, exclude_self=exclude_self, seed=seed,
                                  sampler=sampler, task=task)]
