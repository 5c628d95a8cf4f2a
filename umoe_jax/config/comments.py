"""The comments that document config keys, read from the source where each key is declared.

A key's documentation is the comment written with it, in one of the two layouts the config files use:

    kind: str = "topk_softmax"          # trailing comment, continued on
                                        # lines indented past the key
    # A block comment at the key's own indent, above it, for longer text.
    scan_layers: bool = False

The same holds for keywords of a `dict(...)` call (`train=dict(seed=0,  # ...)`) and for attribute
assignments (`c.init_from = ""  # ...`). Comments are read with `tokenize`, keys with `ast`, so the
source stays the single place a key is documented (`umoe_jax.config.docs` renders them).
"""
from __future__ import annotations

import ast
import dataclasses
import io
import tokenize


@dataclasses.dataclass(frozen=True)
class _Comment:
  line: int
  col: int
  text: str
  own_line: bool            # nothing but the comment on its line


@dataclasses.dataclass(frozen=True)
class _Entry:
  key: str
  first: int                # first and last line of the key's statement or keyword
  last: int
  col: int


def _comments(source: str) -> list[_Comment]:
  out = []
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type == tokenize.COMMENT:
      line, col = tok.start
      out.append(_Comment(line, col, tok.string.lstrip("#").strip(), not tok.line[:col].strip()))
  return out


def _docs(entries: list[_Entry], start: int, end: int, comments: list[_Comment]) -> dict[str, str]:
  """Each entry's text: block comments above it at its indent, the trailing comment, and the lines
  that continue it (indented past the key) up to the next entry or `end`. The scope (a class body,
  a call's arguments) opens on line `start`: a comment above that belongs to the scope itself."""
  out = {}
  for i, e in enumerate(entries):
    prev_last = entries[i - 1].last if i else start
    # A last entry's continuation may run past the scope's last statement (a class ends there).
    stop = entries[i + 1].first if i + 1 < len(entries) else 10**9
    above = [c for c in comments
             if prev_last < c.line < e.first and c.own_line and c.col <= e.col]
    block = []  # only the block that ends right above the key
    for c in reversed(above):
      if c.line != (block[0].line if block else e.first) - 1:
        break
      block.insert(0, c)
    trailing = [c for c in comments if e.first <= c.line <= e.last and not c.own_line]
    after = [c for c in comments if e.last < c.line < stop and c.own_line and c.col > e.col]
    if after and trailing:  # continuation lines follow the trailing comment without a gap
      run = [after[0]] if after[0].line == e.last + 1 else []
      for c in after[1:]:
        if run and c.line == run[-1].line + 1:
          run.append(c)
      after = run
    else:
      after = []
    out[e.key] = " ".join(c.text for c in block + trailing + after if c.text)
  return out


def class_fields(source: str, class_name: str) -> dict[str, str]:
  """{field: its comment} of a dataclass declared in `source`."""
  tree = ast.parse(source)
  (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name]
  entries = [_Entry(n.target.id, n.lineno, n.end_lineno, n.col_offset) for n in cls.body
             if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
  return _docs(entries, cls.lineno, cls.end_lineno, _comments(source))


def _dict_call(node: ast.AST):
  """The `dict(...)` call inside a value (`ConfigDict(dict(...))`, `dict(...)`), or None."""
  for n in ast.walk(node):
    if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "dict":
      return n
  return None


def function_keys(source: str, function: str) -> dict[str, str]:
  """{dotted key: its comment} of the config a function of `source` builds: the keywords of its
  `dict(...)` calls (the `return ConfigDict(dict(...))` form gives bare keys) and its attribute
  assignments `c.<name> = value` (a `dict(...)` value gives `<name>.<keyword>` keys)."""
  tree = ast.parse(source)
  (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function]
  comments = _comments(source)
  out: dict[str, str] = {}
  top: list[_Entry] = []
  for stmt in fn.body:
    if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Attribute):
      name, call = stmt.targets[0].attr, _dict_call(stmt.value)
      top.append(_Entry(name, stmt.lineno, stmt.end_lineno if call is None else stmt.lineno,
                        stmt.col_offset))
      if call is not None:
        out.update({f"{name}.{k}": v for k, v in _keywords(call, comments).items()})
    elif isinstance(stmt, ast.Return) and _dict_call(stmt.value) is not None:
      out.update(_keywords(_dict_call(stmt.value), comments))
  out.update({k: v for k, v in _docs(top, fn.lineno, fn.end_lineno, comments).items() if k not in
              {key.partition(".")[0] for key in out}})
  return out


def _keywords(call: ast.Call, comments: list[_Comment]) -> dict[str, str]:
  entries = [_Entry(k.arg, k.lineno, k.end_lineno, k.col_offset) for k in call.keywords]
  return _docs(entries, call.lineno, call.end_lineno, comments)
