"""Every package the code and the tests import is named by a requirements file, and every test that
needs one outside requirements-dev.txt says so (`@pytest.mark.extras`), so the README's test command
passes in a fresh venv made from requirements-dev.txt alone.

The imports are read with `ast` from every Python file of the project, imports inside functions too.
"""
from __future__ import annotations

import ast
import functools
import importlib.metadata as md
import os
import re
import subprocess
import sys
import textwrap

import pytest

import ci_checks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ("umoe_jax", "kernels", "configs", "bench", "tests", "tools", "train.py")

# Import names whose distribution is named otherwise (when the package is not installed here,
# packages_distributions() cannot say).
DISTRIBUTION = {"absl": "absl-py", "yaml": "pyyaml", "orbax": "orbax-checkpoint",
                "ml_collections": "ml-collections", "array_record": "array-record",
                "jax_triton": "jax-triton", "lm_eval": "lm-eval", "ml_dtypes": "ml-dtypes",
                "google": "google-cloud-storage"}


def _norm(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def _python_files():
  for src in SOURCES:
    path = os.path.join(ROOT, src)
    if os.path.isfile(path):
      yield path
    for d, dirs, files in os.walk(path):
      dirs[:] = [x for x in dirs if x not in ("__pycache__", "data", "fake_gcs_site")]
      yield from (os.path.join(d, f) for f in files if f.endswith(".py"))


@functools.lru_cache(None)
def _local_modules() -> frozenset:
  """Names the project itself provides: its packages and every module file (tests and bench scripts
  import each other by bare name)."""
  names = set()
  for path in _python_files():
    names.add(os.path.splitext(os.path.basename(path))[0])
    names.add(os.path.relpath(path, ROOT).split(os.sep)[0].removesuffix(".py"))
  return frozenset(names)


def imports_of(source: str) -> set[str]:
  """The top-level module names `source` imports (absolute imports, at any depth of the file)."""
  names = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      names.update(a.name.split(".")[0] for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names.add(node.module.split(".")[0])
  return names


@functools.lru_cache(None)
def third_party_imports() -> dict[str, list[str]]:
  """{module: [files importing it]} for every module neither in the standard library nor local."""
  found: dict[str, list[str]] = {}
  for path in _python_files():
    with open(path, encoding="utf-8") as f:
      for name in imports_of(f.read()):
        if name not in sys.stdlib_module_names and name not in _local_modules():
          found.setdefault(name, []).append(os.path.relpath(path, ROOT))
  return found


def required_names() -> set[str]:
  """The distributions named by any requirements*.txt (normalised)."""
  names = set()
  for f in os.listdir(ROOT):
    if re.fullmatch(r"requirements(-[a-z]+)?\.txt", f):
      for line in open(os.path.join(ROOT, f), encoding="utf-8"):
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
          names.add(_norm(re.split(r"[\[<>=!~; ]", line)[0]))
  return names


@functools.lru_cache(None)
def _installed() -> dict:
  return md.packages_distributions()


def distributions_of(module: str) -> list[str]:
  # a namespace package (google) may be installed by another distribution (protobuf) than ours
  installed = [_norm(d) for d in _installed().get(module, [])]
  return installed + [_norm(DISTRIBUTION[module])] if module in DISTRIBUTION else (
      installed or [_norm(module)])


def test_every_imported_package_is_named_by_a_requirements_file():
  required = required_names()
  unnamed = {m: files for m, files in third_party_imports().items()
             if not set(distributions_of(m)) & required}
  assert not unnamed, "imported but in no requirements file: " + "; ".join(
      f"{m} ({', '.join(sorted(files)[:3])})" for m, files in sorted(unnamed.items()))


def test_the_scan_sees_imports_inside_functions_and_skips_relative_ones():
  src = textwrap.dedent("""
      import os, numpy.linalg as la
      from jax import numpy
      from . import sibling
      def f():
        import torch
        from lm_eval.api import samplers
  """)
  assert imports_of(src) == {"os", "numpy", "jax", "torch", "lm_eval"}


def _requirements_dev_closure() -> set[str]:
  """Distributions requirements-dev.txt installs: what it names (following -r) and, for those
  installed here, what they require in turn."""
  names, files = set(), ["requirements-dev.txt"]
  while files:
    for line in open(os.path.join(ROOT, files.pop()), encoding="utf-8"):
      line = line.split("#")[0].strip()
      if line.startswith("-r "):
        files.append(line[3:].strip())
      elif line and not line.startswith("-"):
        names.add(_norm(re.split(r"[\[<>=!~; ]", line)[0]))
  todo = list(names)
  while todo:
    try:
      reqs = md.requires(todo.pop()) or []
    except md.PackageNotFoundError:
      continue
    for r in reqs:
      if "extra ==" not in r:
        dep = _norm(re.split(r"[\[<>=!~; (]", r)[0])
        if dep not in names:
          names.add(dep)
          todo.append(dep)
  return names


def _optional_uses(fn: ast.FunctionDef, optional: set[str]) -> set[str]:
  """The optional modules `fn` imports (at any depth) or asks `pytest.importorskip` for."""
  used = set()
  for node in ast.walk(fn):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      used |= imports_of(ast.unparse(node)) & optional
    elif (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("importorskip")
          and node.args and isinstance(node.args[0], ast.Constant)):
      used |= {node.args[0].value.split(".")[0]} & optional
  return used


def _declared(decorators) -> set[str]:
  """The top-level module names of `extras(...)` marks among `decorators` (or a pytestmark value)."""
  names = set()
  for d in decorators:
    for node in ast.walk(d):
      if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("mark.extras"):
        names |= {a.value.split(".")[0] for a in node.args if isinstance(a, ast.Constant)}
  return names


def test_tests_that_import_an_optional_package_declare_it():
  """A test module may import a package that requirements-dev.txt does not install only inside
  tests marked `@pytest.mark.extras(...)` naming it (on the test or the module's `pytestmark`), never
  at module level: otherwise the README's command fails in a fresh venv. (tests/gpu skips whole
  without a GPU.)"""
  base = _requirements_dev_closure()
  optional = {m for m in third_party_imports() if not set(distributions_of(m)) & base}
  assert {"torch", "triton", "lm_eval"} <= optional, optional   # the scan sees them
  undeclared = []
  for path in _python_files():
    rel = os.path.relpath(path, ROOT)
    if not rel.startswith("tests" + os.sep) or rel.startswith(os.path.join("tests", "gpu")):
      continue
    tree = ast.parse(open(path, encoding="utf-8").read())
    module_marks = _declared([n.value for n in tree.body if isinstance(n, ast.Assign)
                              and any(ast.unparse(t) == "pytestmark" for t in n.targets)])
    for node in tree.body:
      if isinstance(node, (ast.Import, ast.ImportFrom)) and imports_of(ast.unparse(node)) & optional:
        undeclared.append(f"{rel}:{node.lineno} imports {ast.unparse(node)} at module level")
      if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
        missing = _optional_uses(node, optional) - _declared(node.decorator_list) - module_marks
        if missing:
          undeclared.append(f"{rel}:{node.lineno} {node.name} imports {sorted(missing)} "
                            f"without @pytest.mark.extras naming it")
  assert not undeclared, "\n".join(undeclared)


def test_an_extras_test_skips_naming_the_module_and_fails_under_ci(tmp_path):
  """The marker's skip names the missing module and the file installing it; UMOE_CI=1 turns that
  skip into a failure, and a test whose modules import runs."""
  (tmp_path / "test_x.py").write_text(textwrap.dedent("""
      import pytest

      @pytest.mark.extras("no_such_module_umoe")
      def test_missing():
        pass

      @pytest.mark.extras("json")
      def test_present():
        pass
  """))
  (tmp_path / "conftest.py").write_text(
      f"import sys; sys.path.insert(0, {os.path.join(ROOT, 'tests')!r})\n"
      "from ci_checks import pytest_runtest_setup, pytest_runtest_makereport\n")
  ini = tmp_path / "pytest.ini"
  ini.write_text("[pytest]\nmarkers =\n  extras: optional modules\n")

  def run(ci):
    env = dict(os.environ, UMOE_CI="1" if ci else "0")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           "-c", str(ini), str(tmp_path)], capture_output=True, text=True, env=env,
                          cwd=tmp_path)
  plain, ci = run(False), run(True)
  assert plain.returncode == 0 and "1 passed, 1 skipped" in plain.stdout, plain.stdout
  assert "needs no_such_module_umoe (pip install -r requirements-extras.txt)" in plain.stdout
  assert ci.returncode == 1 and "1 passed, 1 error" in ci.stdout, ci.stdout   # an error at set-up
  assert "UMOE_CI=1" in ci.stdout and "no_such_module_umoe" in ci.stdout


def test_missing_names_the_first_module_that_does_not_import():
  assert ci_checks.missing(["json", "os.path"]) is None
  reason = ci_checks.missing(["json", "lm_eval_no_such.api"])
  assert reason.startswith("needs lm_eval_no_such.api (pip install -r requirements-extras.txt)")
  assert ci_checks.missing(["lm_eval.no_such_submodule"]).startswith(
      "needs lm_eval.no_such_submodule (pip install -r requirements-eval.txt)")


def test_ci_runs_the_readme_test_command_verbatim_then_the_extras():
  """.ci/run takes the README's test command from the README itself (so the two cannot drift),
  in a fresh venv, and then the marked tests under UMOE_CI=1."""
  readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
  ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()
  lines = [l for l in readme.splitlines() if l.startswith("python3 -m pip install -r requirements-dev.txt && ")]
  assert len(lines) == 1, lines
  assert "python3 -m venv" in ci and "requirements-extras.txt" in ci
  assert 'UMOE_CI=1' in ci and '-m "extras or ci_required"' in ci
  out = subprocess.run(["bash", os.path.join(ROOT, ".ci", "run"), "--print-test-command"],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
  assert out.returncode == 0 and out.stdout.strip() == lines[0], out.stdout + out.stderr
