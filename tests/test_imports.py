"""Imports run one way: the module import graph of umoe_jax/ and kernels/ has no cycles.

The graph is read from the source with `ast`, without importing anything, so it sees every import at
any depth: module level, inside functions and methods, under `if`/`try`. A cycle through an import
inside a function still couples two modules both ways, so it counts the same as one at the top.

Edges:
  * `import a.b.c` and `from a.b import c` (c a submodule) lead to a.b.c;
  * `from a.b import name` (name not a submodule) leads to a.b, i.e. its `__init__`;
  * an import of a.b.c also runs the `__init__` of each package above it (a.b, a), so those count
    too, except the packages the importing module itself lives in: Python has already started them
    before the importer runs, and counting them would turn every package `__init__` that gathers its
    submodules into a false cycle;
  * relative imports are resolved against the importing module's package;
  * `importlib.import_module("a.b")` with a literal name counts as `import a.b`;
  * imports under `if __name__ == "__main__":` do not count (see `_walk_outside_main`).
Only modules of this repository are nodes; imports of other packages are ignored.
"""
from __future__ import annotations

import ast
import collections
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("umoe_jax", "kernels")

# What kernels/ may import from umoe_jax: leaf helpers only (the epilogue's activation forms, XLA's
# grouped matmuls, shard_map's varying types, the Pallas TPU probe), so the kernels stay below the
# library that chooses among them.
KERNEL_IMPORTS_FROM_UMOE = {"umoe_jax", "umoe_jax.ops", "umoe_jax.ops.epilogue", "umoe_jax.ops.ragged",
                            "umoe_jax.ops.varying", "umoe_jax.ops.pallas_tpu"}


def module_files(root: str = ROOT, packages=PACKAGES) -> dict[str, str]:
  """Dotted module name -> file path for every .py file under `packages`."""
  out = {}
  for pkg in packages:
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, pkg)):
      dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
      rel = os.path.relpath(dirpath, root).split(os.sep)
      for f in filenames:
        if not f.endswith(".py"):
          continue
        parts = rel if f == "__init__.py" else rel + [f[:-3]]
        out[".".join(parts)] = os.path.join(dirpath, f)
  return out


def _imported_names(tree: ast.AST, module: str, is_package: bool, modules) -> set[str]:
  """Dotted names of modules `module` imports anywhere in its source (before parent expansion)."""
  package = module if is_package else module.rpartition(".")[0]
  names = set()
  for node in _walk_outside_main(tree):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = package.split(".")
        base = base[:len(base) - (node.level - 1)]
        base = ".".join(base + ([node.module] if node.module else []))
      else:
        base = node.module
      for alias in node.names:
        # A submodule leads to itself (its package counts as a parent); any other name is read
        # from the package's `__init__`, which is then imported for its own sake.
        sub = f"{base}.{alias.name}"
        names.add(sub if sub in modules else base)
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and
          node.func.attr == "import_module" and node.args and
          isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
      names.add(node.args[0].value)
  return names


def _is_main_guard(node: ast.AST) -> bool:
  test = node.test if isinstance(node, ast.If) else None
  return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and
          test.left.id == "__name__" and len(test.comparators) == 1 and
          isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value == "__main__")


def _walk_outside_main(tree: ast.AST):
  """ast.walk, less the body of `if __name__ == "__main__":`. That body runs only when the file is
  the program, as the module `__main__` (a copy apart from the module the graph names), so its
  imports (`python -m umoe_jax.eval.harness` handing over to the eval CLI) close no circle."""
  todo = [tree]
  while todo:
    node = todo.pop()
    yield node
    if _is_main_guard(node):
      todo.extend(node.orelse)
      continue
    todo.extend(ast.iter_child_nodes(node))


def import_graph(root: str = ROOT, packages=PACKAGES) -> dict[str, set[str]]:
  """Module -> the repository modules it imports (see the module docstring for the rules)."""
  files = module_files(root, packages)
  graph = {}
  for module, path in files.items():
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read(), path)
    own = module.split(".")
    # The packages `module` lives in (itself too, when it is a package `__init__`).
    own_packages = {".".join(own[:i]) for i in range(1, len(own) + 1)}
    targets = set()
    for name in _imported_names(tree, module, path.endswith("__init__.py"), files):
      parts = name.split(".")
      for i in range(1, len(parts) + 1):
        target = ".".join(parts[:i])
        if target in files and (i == len(parts) or target not in own_packages):
          targets.add(target)
    targets.discard(module)
    graph[module] = targets
  return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """One shortest cycle through each module that is on a cycle, as [m0, m1, ..., m0], deduplicated.

  Strongly connected components (Tarjan) say which modules are on a cycle; a breadth-first search
  inside the component gives the shortest cycle through each of them, so the report names every
  module involved without listing the exponentially many cycles of a big component.
  """
  index, low, on_stack, stack, sccs = {}, {}, set(), [], []

  def strongconnect(v):
    # Iterative Tarjan: the import graph is small, but recursion depth should not depend on it.
    work = [(v, iter(sorted(graph.get(v, ()))))]
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    while work:
      node, children = work[-1]
      for w in children:
        if w not in index:
          index[w] = low[w] = len(index)
          stack.append(w)
          on_stack.add(w)
          work.append((w, iter(sorted(graph.get(w, ())))))
          break
        if w in on_stack:
          low[node] = min(low[node], index[w])
      else:
        work.pop()
        if work:
          low[work[-1][0]] = min(low[work[-1][0]], low[node])
        if low[node] == index[node]:
          scc = set()
          while True:
            w = stack.pop()
            on_stack.discard(w)
            scc.add(w)
            if w == node:
              break
          sccs.append(scc)

  for v in sorted(graph):
    if v not in index:
      strongconnect(v)

  cycles, seen = [], set()
  for scc in sccs:
    if len(scc) == 1:
      (v,) = scc
      if v in graph.get(v, ()):
        cycles.append([v, v])
      continue
    for start in sorted(scc):
      cycle = _chain_from(start, graph, scc)
      key = frozenset(zip(cycle, cycle[1:]))
      if key not in seen:
        seen.add(key)
        cycles.append(cycle)
  return cycles


def _chain_from(start: str, graph, scc) -> list[str]:
  """The shortest import chain start -> ... -> start inside one strongly connected component."""
  parent = {start: None}
  queue = collections.deque([start])
  while queue:
    node = queue.popleft()
    for w in sorted(graph.get(node, ())):
      if w == start:
        chain = [node]
        while parent[chain[-1]] is not None:
          chain.append(parent[chain[-1]])
        return chain[::-1] + [start]
      if w in scc and w not in parent:
        parent[w] = node
        queue.append(w)
  raise AssertionError(f"{start} is in a component but on no cycle")


def test_find_cycles_on_a_synthetic_graph():
  graph = {
      "a": {"b"}, "b": {"c"}, "c": {"a", "d"},  # a -> b -> c -> a
      "d": {"e"}, "e": set(),                    # a tail off the cycle, itself acyclic
      "f": {"g"}, "g": {"f"},                    # a two-module circle
      "h": {"h"},                                # a module importing itself
      "i": {"a"},                                # leads into a cycle but is not on one
  }
  cycles = find_cycles(graph)
  as_sets = sorted(sorted(set(c)) for c in cycles)
  assert as_sets == [["a", "b", "c"], ["f", "g"], ["h"]]
  for cycle in cycles:
    assert cycle[0] == cycle[-1]
    assert all(b in graph[a] for a, b in zip(cycle, cycle[1:]))
  assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_import_graph_resolves_relative_and_submodule_imports(tmp_path):
  pkg = tmp_path / "umoe_jax"
  (pkg / "sub").mkdir(parents=True)
  (pkg / "__init__.py").write_text("")
  (pkg / "sub" / "__init__.py").write_text("from . import leaf\n")
  (pkg / "sub" / "leaf.py").write_text("import json\n")
  (pkg / "sub" / "user.py").write_text(
      "from .leaf import x\n"
      "def f():\n"
      "  from umoe_jax import top\n")
  (pkg / "top.py").write_text("from umoe_jax.sub import user, CONST\n")
  graph = import_graph(str(tmp_path), ("umoe_jax",))
  assert graph["umoe_jax.sub"] == {"umoe_jax.sub.leaf"}
  assert graph["umoe_jax.sub.leaf"] == set()
  # The import inside f counts; umoe_jax.sub, the importer's own package, does not.
  assert graph["umoe_jax.sub.user"] == {"umoe_jax.sub.leaf", "umoe_jax.top"}
  # `CONST` is no submodule, so it leads to the package's __init__ (which user.py is not under).
  assert graph["umoe_jax.top"] == {"umoe_jax.sub", "umoe_jax.sub.user"}
  assert find_cycles(graph) == [["umoe_jax.sub.user", "umoe_jax.top", "umoe_jax.sub.user"]]


def test_no_import_cycles():
  cycles = find_cycles(import_graph())
  assert not cycles, "import cycles:\n" + "\n".join("  " + " -> ".join(c) for c in cycles)


def test_kernels_import_only_leaf_helpers_of_umoe_jax():
  graph = import_graph()
  for module, deps in graph.items():
    if module.split(".")[0] == "kernels":
      wrong = sorted(d for d in deps if d.split(".")[0] == "umoe_jax" and d not in KERNEL_IMPORTS_FROM_UMOE)
      assert not wrong, f"{module} imports {wrong}: kernels/ may use only {sorted(KERNEL_IMPORTS_FROM_UMOE)}"
  for helper in KERNEL_IMPORTS_FROM_UMOE:
    inside = sorted(d for d in graph[helper] if d not in ("umoe_jax", "umoe_jax.ops"))
    assert not inside, f"{helper} is no leaf: it imports {inside}"
