"""Where a compiled program's device time goes, by named scope, from a jax.profiler trace.

    rows, summary = profile_calls(compiled, run_once, calls=2)

traces `calls` runs of `run_once()` (which must run `compiled`, a `jax.stages.Compiled`, and wait
for it), reads the device's kernel events from the trace (their `hlo_op` names) and maps each op to
the `op_name` metadata of the compiled HLO, then sums the kernel time per scope key. A scope key is
the op's named scopes (`jax.named_scope`: the model sets layer_<i>, attention, ffn, router, plan,
expert_up, expert_down, mix, queries, loss, lm_head, optimizer, ...) with layer_<i> written layer_*,
and the autodiff pass: "fwd", "bwd" (a transpose) or "-" (outside autodiff, e.g. the optimizer).
Times are kernel times summed per call (kernels of different streams may overlap, so the sum can
exceed the wall time, which `summary` also gives). On GPU, XLA's command buffers (CUDA graphs)
hide which op a kernel belongs to: profile with `--xla_gpu_enable_command_buffer=` in XLA_FLAGS
(`bench/train_step.py --profile` sets it).

Used by `bench/train_step.py --profile`; the same tables read on CPU in tests/test_profile_table.py.

A trace taken with CUDA graphs on (`bench/train_step.py --trace_step=N`: the step as it runs) names
no ops, but its kernels keep their names; `kernel_name_rows` sums the device time per kernel name:

  python3 bench/profile_table.py TRACE_DIR [--against=OTHER_TRACE_DIR] [--calls=STEPS]
"""
from __future__ import annotations

import collections
import glob
import os
import re
import tempfile
import time
from typing import Callable, Iterable

# Wrappers jax writes around scope names in op_name: jvp(layer_3), transpose(jvp(ffn)), ...
_WRAPPER = re.compile(r"^(jvp|transpose|remat|checkpoint|vmap|custom_jvp_call|custom_vjp_call|"
                      r"rematted_computation|pjit|jit|shard_map|xmap|while|cond|body)\((.*)\)$")
_INSTRUCTION = re.compile(r'^\s+(ROOT\s+)?%?([\w.\-]+)\s*=\s')
_OP_NAME = re.compile(r'\bmetadata=\{[^}]*?op_name="([^"]*)"')
_CALLS = re.compile(r'\bcalls=%?([\w.\-]+)')
_OPERAND = re.compile(r'%([\w.\-]+)')
_COMPUTATION = re.compile(r'^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$')
_NUMBERED = re.compile(r"([._]\d+)+$")
_LAYER = re.compile(r"^(layer_\d+|layers)$")   # "layers": model.scan_layers' one scanned block
# Bare path parts that transforms add inside a scope (a scan's body, remat's recomputation), no scope.
_TRANSFORM_PARTS = {"while", "body", "cond", "closed_call", "checkpoint", "rematted_computation"}


def op_names(hlo_text: str) -> dict[str, str]:
  """{HLO instruction name: op_name} of an HLO module's text (`compiled.as_text()`): the
  instruction's own metadata, or for a fusion without any (XLA's copy / convert fusions) that of
  the computation it calls (its root's, else its first instruction's with one), else that of
  its first user with one (a layout copy feeding a dot), else of its first operand with one."""
  names, calls, computation_names = {}, {}, {}
  users, operands = collections.defaultdict(list), {}
  computation, root, first = None, None, None
  for line in hlo_text.splitlines():
    head = _COMPUTATION.match(line)
    if head and not line.startswith(" "):
      computation, root, first = head.group(1), None, None
      continue
    if line.startswith("}") and computation is not None:
      if root or first:
        computation_names[computation] = root or first
      computation = None
      continue
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    op = _OP_NAME.search(line)
    called = _CALLS.search(line)
    args = [a for a in _OPERAND.findall(line[m.end():]) if not called or a != called.group(1)]
    operands[m.group(2)] = args
    for a in args:
      users[a].append(m.group(2))
    if op:
      names[m.group(2)] = op.group(1)
      first = first or op.group(1)
      if m.group(1):
        root = op.group(1)
    elif called:
      calls[m.group(2)] = called.group(1)
  for instruction, computation in calls.items():
    if computation in computation_names:
      names[instruction] = computation_names[computation]
  for _ in range(4):  # chains of unnamed copies
    for instruction in operands:
      if instruction not in names:
        near = [n for n in users[instruction] + operands[instruction] if n in names]
        if near:
          names[instruction] = names[near[0]]
  return names


def scope_key(op_name: str) -> tuple[str, str, str]:
  """op_name -> (scope path with layer_<i> as layer_*, pass "fwd" | "bwd" | "-", primitive).
  `model.scan_layers`' scope "layers" is layer_* too, and the scan's and remat's own path parts
  ("while", "body", "checkpoint", ...) are dropped, so both forms give the same keys.

  "jit(train)/transpose(jvp(layer_3))/ffn/router/dot_general" -> ("layer_*/ffn/router", "bwd",
  "dot_general"). The first component (the jitted function) is dropped; so is the function name
  inside a jit(...) wrapper; jvp makes it "fwd" unless a transpose makes it "bwd".
  """
  parts = op_name.split("/")
  parts = parts[1:] if len(parts) > 1 else parts
  primitive = parts[-1] if parts else ""
  scopes, autodiff, transposed = [], False, False
  for part in parts[:-1]:
    inner, wrappers = part, []
    while True:
      m = _WRAPPER.match(inner)
      if not m:
        break
      wrappers.append(m.group(1))
      inner = m.group(2)
    transposed |= "transpose" in wrappers
    autodiff |= "jvp" in wrappers or "transpose" in wrappers
    if wrappers and wrappers[-1] in ("jit", "pjit", "shard_map"):
      continue  # a jitted function's own name, not a scope
    if inner in _TRANSFORM_PARTS and not wrappers:
      continue
    if inner and "->" not in inner:  # (an einsum's spec is no scope)
      scopes.append("layer_*" if _LAYER.match(inner) else inner)
  autodiff |= any(w in op_name for w in ("jvp(", "transpose("))
  phase = "bwd" if transposed else ("fwd" if autodiff else "-")
  return "/".join(scopes), phase, primitive


def kernel_events(trace_dir: str) -> list[tuple[str, str, float]]:
  """[(hlo_op, kernel or event name, duration ms)] of the trace under trace_dir: the events of the
  device planes (/device:*) that name an hlo_op; on a machine without a device plane (CPU) the host
  planes' (XLA:CPU runs its ops as thunks on host threads)."""
  from jax.profiler import ProfileData
  paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
  if not paths:
    raise FileNotFoundError(f"no *.xplane.pb under {trace_dir}: the trace did not write")
  device, host = [], []
  for path in paths:
    data = ProfileData.from_file(path)
    for plane in data.planes:
      target = device if plane.name.startswith("/device:") else host
      for line in plane.lines:
        for event in line.events:
          stats = dict(event.stats)
          op = stats.get("hlo_op")
          if op:
            target.append((str(op), event.name, event.duration_ns / 1e6))
  return device or host


def kernel_name_rows(trace_dir: str, calls: int = 1) -> list[dict]:
  """Device time per kernel name (numbered copies summed: one per layer), per call, largest first:
  [{kernel, ms, count, share}]. Reads every event of the device planes, so it covers a trace taken
  with CUDA graphs on (`bench/train_step.py --trace_step`), whose kernels name no hlo_op; on a
  machine without a device plane, the host events that name an hlo_op (as `kernel_events`)."""
  from jax.profiler import ProfileData
  paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
  if not paths:
    raise FileNotFoundError(f"no *.xplane.pb under {trace_dir}: the trace did not write")
  device, host = [], []
  for path in paths:
    for plane in ProfileData.from_file(path).planes:
      on_device = plane.name.startswith("/device:")
      for line in plane.lines:
        if on_device and line.name in _DERIVED_LINES:
          continue
        for event in line.events:
          if on_device:
            device.append((event.name, event.duration_ns / 1e6))
          elif dict(event.stats).get("hlo_op"):
            host.append((event.name, event.duration_ns / 1e6))
  totals, counts = collections.defaultdict(float), collections.Counter()
  for name, ms in device or host:
    key = _NUMBERED.sub("", name)
    totals[key] += ms
    counts[key] += 1
  grand = sum(totals.values()) or 1.0
  return [dict(kernel=k, ms=ms / calls, count=counts[k] // max(calls, 1), share=ms / grand)
          for k, ms in sorted(totals.items(), key=lambda kv: -kv[1])]


# Lines a profiler's tools derive from the kernels (the same time again), not kernels of their own.
_DERIVED_LINES = {"Steps", "XLA Modules", "XLA Ops", "Framework Ops", "Framework Name Scope",
                  "Source code", "XLA TraceMe"}


def trace_calls(run_once: Callable[[], object], calls: int, trace_dir: str | None = None) -> tuple[str, float]:
  """Runs run_once() `calls` times under jax.profiler; returns (trace dir, wall ms per call)."""
  import jax
  trace_dir = trace_dir or tempfile.mkdtemp(prefix="umoe-profile-")
  run_once()  # not traced: the first call of an executable can set things up
  jax.profiler.start_trace(trace_dir)
  t0 = time.perf_counter()
  try:
    for _ in range(calls):
      run_once()
  finally:
    wall_ms = 1e3 * (time.perf_counter() - t0) / calls
    jax.profiler.stop_trace()
  return trace_dir, wall_ms


# Kernels kept per scope in the rows (the console table prints the first two): enough to place the
# small kernels of a scope like the queries' backward (22 kernels a layer in UMoE-base).
TOP_OPS = 8


def scope_rows(events: Iterable[tuple[str, str, float]], names: dict[str, str],
               calls: int) -> list[dict]:
  """Kernel time per (scope path, pass), per call, largest first: [{scope, pass, ms, kernels,
  share, top_ops}] (share of all the calls' kernel time; top_ops: its `TOP_OPS` largest kernels
  as 'primitive:kernel name ms', numbered copies of a kernel (one per layer) summed)."""
  totals = collections.defaultdict(float)
  counts = collections.Counter()
  per_op = collections.defaultdict(lambda: collections.defaultdict(float))
  for op, kernel, ms in events:
    name = names.get(op)
    scope, phase, primitive = scope_key(name) if name else ("(no op_name)", "-", op)
    key = (scope or "(top level)", phase)
    totals[key] += ms
    counts[key] += 1
    per_op[key][f"{primitive}:{_NUMBERED.sub('', kernel)}"] += ms
  grand = sum(totals.values()) or 1.0
  rows = []
  for key, ms in sorted(totals.items(), key=lambda kv: -kv[1]):
    top = sorted(per_op[key].items(), key=lambda kv: -kv[1])[:TOP_OPS]
    rows.append(dict(scope=key[0], **{"pass": key[1]}, ms=ms / calls, kernels=counts[key] // calls,
                     share=ms / grand, top_ops=[f"{o} {t / calls:.3f}" for o, t in top]))
  return rows


def group_rows(rows: list[dict], depth: int) -> list[dict]:
  """The rows summed over scope paths cut to their first `depth` components (and the pass)."""
  totals, shares, kernels = collections.defaultdict(float), collections.defaultdict(float), \
      collections.Counter()
  for r in rows:
    key = ("/".join(r["scope"].split("/")[:depth]), r["pass"])
    totals[key] += r["ms"]
    shares[key] += r["share"]
    kernels[key] += r["kernels"]
  return [dict(scope=k[0], **{"pass": k[1]}, ms=ms, kernels=kernels[k], share=shares[k])
          for k, ms in sorted(totals.items(), key=lambda kv: -kv[1])]


def profile_calls(compiled, run_once: Callable[[], object], calls: int = 2,
                  trace_dir: str | None = None) -> tuple[list[dict], dict]:
  """(scope rows, summary {wall_ms, kernel_ms, kernels, unmatched_ms}) per call of run_once(),
  which runs `compiled` (its HLO text gives the op names)."""
  names = op_names(compiled.as_text())
  trace_dir, wall_ms = trace_calls(run_once, calls, trace_dir)
  events = kernel_events(trace_dir)
  rows = scope_rows(events, names, calls)
  unmatched = sum(r["ms"] for r in rows if r["scope"] == "(no op_name)")
  summary = dict(wall_ms=wall_ms, kernel_ms=sum(r["ms"] for r in rows),
                 kernels=len(events) // calls, unmatched_ms=unmatched)
  return rows, summary


def diff_rows(base: list[dict], other: list[dict], depth: int) -> list[dict]:
  """Where two profiles of one model differ (bf16 and fp8 steps, say): per scope path cut to
  `depth` components and pass, {scope, pass, base_ms, ms, delta_ms}, the largest |delta| first; a
  scope only one profile has counts 0 ms in the other."""
  a = {(r["scope"], r["pass"]): r["ms"] for r in group_rows(base, depth)}
  b = {(r["scope"], r["pass"]): r["ms"] for r in group_rows(other, depth)}
  rows = [dict(scope=k[0], **{"pass": k[1]}, base_ms=a.get(k, 0.0), ms=b.get(k, 0.0),
               delta_ms=b.get(k, 0.0) - a.get(k, 0.0)) for k in set(a) | set(b)]
  return sorted(rows, key=lambda r: (-abs(r["delta_ms"]), r["scope"], r["pass"]))


def format_diff(rows: list[dict], limit: int = 25, title: str = "", names=("base", "other"),
                kernels: bool = False) -> str:
  """A fixed-width table of `diff_rows`' first `limit` rows (`diff_kernels`' with `kernels`) and the
  totals over all of them."""
  lines = [title] if title else []
  lines.append(f"{names[0]:>9} {names[1]:>9} {'delta':>9}  " + ("kernel (ms a step)" if kernels
                                                                else "pass  scope (ms a step)"))
  for r in rows[:limit]:
    what = r["scope"][:110] if kernels else f"{r['pass']:4}  {r['scope']}"
    lines.append(f"{r['base_ms']:9.3f} {r['ms']:9.3f} {r['delta_ms']:+9.3f}  {what}")
  total = lambda k: sum(r[k] for r in rows)
  lines.append(f"{total('base_ms'):9.3f} {total('ms'):9.3f} {total('delta_ms'):+9.3f}  all")
  return "\n".join(lines)


def format_rows(rows: list[dict], limit: int = 30, title: str = "") -> str:
  """A fixed-width table of the first `limit` rows (with their largest kernels when the rows
  have them)."""
  lines = [title] if title else []
  lines.append(f"{'ms':>8} {'share':>6} {'kernels':>7}  pass  scope")
  for r in rows[:limit]:
    top = ("  [" + "; ".join(o[:60] for o in r["top_ops"][:2]) + "]") if r.get("top_ops") else ""
    lines.append(f"{r['ms']:8.3f} {100 * r['share']:5.1f}% {r['kernels']:7d}  {r['pass']:4}  "
                 f"{r['scope']}{top}")
  return "\n".join(lines)


def diff_kernels(base: list[dict], other: list[dict]) -> list[dict]:
  """`kernel_name_rows` of two traces paired by kernel name, in `diff_rows`' form (scope = the
  kernel's name, pass "-"), the largest |delta| first."""
  row = lambda r: dict(scope=r["kernel"], **{"pass": "-"}, ms=r["ms"], kernels=r["count"], share=r["share"])
  return diff_rows([row(r) for r in base], [row(r) for r in other], depth=1)


def main(argv=None) -> None:
  import argparse
  ap = argparse.ArgumentParser(description="Device time per kernel name of a jax.profiler trace "
                               "(e.g. bench/train_step.py --trace_step's), or where two differ.")
  ap.add_argument("trace_dir")
  ap.add_argument("--against", default="", help="a second trace: print where the first differs from it")
  ap.add_argument("--calls", type=int, default=1, help="steps each trace holds (times are per step)")
  ap.add_argument("--limit", type=int, default=30)
  args = ap.parse_args(argv)
  try:
    rows = kernel_name_rows(args.trace_dir, args.calls)
    base = kernel_name_rows(args.against, args.calls) if args.against else None
  except FileNotFoundError as e:
    ap.error(str(e))
  if base is None:
    lines = [f"{'ms':>8} {'share':>6} {'count':>6}  kernel"]
    lines += [f"{r['ms']:8.3f} {100 * r['share']:5.1f}% {r['count']:6d}  {r['kernel'][:110]}"
              for r in rows[:args.limit]]
    lines.append(f"{sum(r['ms'] for r in rows):8.3f} {100.0:5.1f}% {sum(r['count'] for r in rows):6d}  all")
    print("\n".join(lines))
  else:
    print(format_diff(diff_kernels(base, rows), args.limit, names=("against", "this"), kernels=True))


if __name__ == "__main__":
  main()
