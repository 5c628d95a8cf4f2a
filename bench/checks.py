"""How the bench scripts check a fast path against its reference before timing it."""
from __future__ import annotations

import numpy as np


def rel_err(got, want) -> float:
  """||got - want|| / ||want|| over all elements, in float64 (0-norm references count as 1e-30)."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
