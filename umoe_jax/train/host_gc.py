"""Keeps Python's cyclic garbage collector out of the timed training steps.

Tracing and compiling a step leaves millions of long-lived Python objects (jaxprs, HLO modules, the
model's pytrees). CPython's oldest-generation collection walks all of them: on one H200 a collection
that fell inside FFN-MoE-base's fifth call stretched that step from 86 to 223 ms with the GPU idle
for the difference (a trace shows `PythonRefManager::CollectGarbage` then a 205 ms gap on the
host). Once the step is compiled, `FrozenHeap.freeze()` collects once and moves every live object
into the permanent generation (`gc.freeze`), so later collections walk only what the loop itself
allocates; leaving the `with` block gives them back to the collector (`gc.unfreeze`), so nothing
frozen outlives the loop (a test process that trains many times does not pile them up).

`gc.unfreeze` thaws the whole permanent generation, so a FrozenHeap takes no part where something
else froze the heap first (an outer FrozenHeap, a server that froze at start-up): it neither
freezes nor thaws then. Programs compiled after the freeze (the first evaluation's) stay collectable.
"""
from __future__ import annotations

import gc


class FrozenHeap:
  """`with FrozenHeap() as heap: ...; heap.freeze(); ...` (freeze at most once; idempotent)."""

  def __init__(self):
    self.frozen = False   # whether this one froze the heap (and so thaws it)

  def freeze(self) -> None:
    if self.frozen or gc.get_freeze_count() > 0:   # ours already, or someone else's to thaw
      return
    gc.collect()  # what is already garbage goes now, not into the permanent generation
    gc.freeze()
    self.frozen = True

  def release(self) -> None:
    if self.frozen:
      gc.unfreeze()
      self.frozen = False

  def __enter__(self) -> "FrozenHeap":
    return self

  def __exit__(self, *exc) -> None:
    self.release()
