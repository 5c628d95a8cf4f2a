"""The documentation stays true: docs/configuration.md is what its generator makes from the source and
names every key with its default, every command block of README.md runs on the tiny model, and every
relative link resolves.

README blocks run with `runs/` moved into a temporary directory, without their `pip install` (the
requirements are installed already), and train.py commands with the short-run flags the README
itself shows. A block after `<!-- needs: PATH -->` or `<!-- skip: REASON -->` is skipped with that
reason.
"""
from __future__ import annotations

import concurrent.futures
import glob
import os
import re
import subprocess

import pytest

from conftest import ROOT
from umoe_jax.config import comments, docs
from umoe_jax.finetune import config as finetune_config
from umoe_jax.train import config as train_config

README = os.path.join(ROOT, "README.md")


def _read(path: str) -> str:
  with open(path, encoding="utf-8") as f:
    return f.read()


# ------------------------------------------------------------------------------------------------
# docs/configuration.md


def test_configuration_page_is_current():
  assert _read(docs.PAGE) == docs.page(), f"docs/configuration.md is stale: run `{docs.COMMAND}`"


def test_check_fails_on_a_stale_page(tmp_path, monkeypatch, capsys):
  page = tmp_path / "configuration.md"
  monkeypatch.setattr(docs, "PAGE", str(page))
  assert docs.main(["docs"]) == 0 and docs.main(["docs", "--check"]) == 0
  page.write_text(page.read_text() + "edited\n")
  assert docs.main(["docs", "--check"]) == 1
  assert "stale" in capsys.readouterr().err


def _part_text(part: str) -> str:
  """The page's training part or its fine-tuning part (their keys share names: data.*, train.*)."""
  text = _read(docs.PAGE)
  cut = text.index("\n## Fine-tuning: ")
  return text[:cut] if part == "train" else text[cut:]


def test_every_key_is_on_the_page_with_its_default():
  keys = docs.keys()
  for key in keys:
    line = f"- `{docs.display_name(key)}` (default `{docs.fmt(key.default)}`): "
    assert line in _part_text(key.part), f"{key.part} key {key.name} is not on the page as {line!r}"
  # The keys are those the commands accept: every section the checks know, every key of each.
  sections = {k.name.partition(".")[0] for k in keys if k.part == "train"}
  assert sections == set(train_config.SECTIONS)
  tune = {k.name.partition(".")[0] for k in keys if k.part == "finetune"}
  assert tune == set(finetune_config.SECTIONS)
  names = {k.name for k in keys if k.part == "train"}
  for name, defaults in (("train", train_config.default_train_config()),
                         ("checkpoint", train_config.default_checkpoint_config()),
                         ("log", train_config.default_log_config())):
    assert {f"{name}.{k}" for k in defaults.keys()} <= names
  assert "model.router.kind" in names and "model.attention.router" in names


def test_page_has_no_timings():
  text = _read(docs.PAGE)
  for pattern in (r"\d ms\b", r"\bGB\b", r"BENCHMARKS", r"\brun \d", r"\bsession \d", r"not yet timed"):
    assert not re.search(pattern, text), pattern


def test_comments_are_read_in_both_layouts():
  source = '''
import dataclasses

@dataclasses.dataclass
class C:
  a: int = 1            # first line
                        # and its continuation
  # A block above b,
  # two lines long.
  b: int = 2
  c: int = 3            # last field, continued
                        # past the class's last statement


def f():
  return dict(
      x=1,              # x's comment
      # y's block
      y=[1,
         2],
  )


def g():
  c = object()
  c.top = ""            # a top-level key
  c.sec = dict(k=0,     # a keyword on the call's line
               j=1)     # j
'''
  assert comments.class_fields(source, "C") == {
      "a": "first line and its continuation", "b": "A block above b, two lines long.",
      "c": "last field, continued past the class's last statement"}
  assert comments.function_keys(source, "f") == {"x": "x's comment", "y": "y's block"}
  assert comments.function_keys(source, "g") == {
      "top": "a top-level key", "sec.k": "a keyword on the call's line", "sec.j": "j"}


def test_a_key_without_a_comment_is_an_error(monkeypatch):
  real = docs._source_docs
  monkeypatch.setattr(docs, "_source_docs", lambda: {
      k: ("" if k == ("train", "train.seed") else v) for k, v in real().items()})
  with pytest.raises(ValueError, match="'train.seed'.*no comment"):
    docs.keys()


# ------------------------------------------------------------------------------------------------
# Links


def _markdown_files() -> list[str]:
  return [README] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_resolve(path):
  text = re.sub(r"```.*?```", "", _read(path), flags=re.S)  # links inside code blocks are not links
  for target in re.findall(r"\]\(([^)\s]+)\)", text):
    if re.match(r"[a-z]+:", target) or target.startswith("#"):
      continue
    file = os.path.normpath(os.path.join(os.path.dirname(path), target.partition("#")[0]))
    assert os.path.exists(file), f"{os.path.relpath(path, ROOT)} links to {target}: no such file"


# ------------------------------------------------------------------------------------------------
# README command blocks


class Block:
  def __init__(self, index: int, marker: str, body: str):
    self.index, self.marker = index, marker
    lines = re.sub(r"\\\n\s*", " ", body).splitlines()
    self.commands = [l.strip() for l in lines if l.strip() and not l.strip().startswith("#")]

  def __repr__(self):
    return f"block{self.index}"


def readme_blocks() -> list[Block]:
  text = _read(README)
  found = re.finditer(r"(?:<!--\s*(needs|skip):\s*(.*?)\s*-->\s*\n)?```bash\n(.*?)```", text, re.S)
  return [Block(i, f"{m.group(1)}: {m.group(2)}" if m.group(1) else "", m.group(3))
          for i, m in enumerate(found)]


def short_run_flags() -> str:
  """The short-run flags the README gives for train.py (`--config.train.num_steps=N ...`)."""
  m = re.search(r"`(--config\.train\.num_steps=\d+[^`]*)`", _read(README))
  assert m, "README.md shows no short-run flags (`--config.train.num_steps=N ...`)"
  return m.group(1)


# The fine-tuning example at test size: fewer documents, one epoch, its files in the tmp dir.
FINETUNE_DATA = "data/linux_docs_cls"
SHORT_FINETUNE = {
    "python3 -m umoe_jax.finetune.linux_docs ": " --per_class=24",
    "python3 -m umoe_jax.finetune ": (" --config.train.epochs=1"
                                      " --config.data.train_path={d}/train.jsonl"
                                      " --config.data.test_path={d}/test.csv"),
}


def as_run(command: str, tmp: str) -> str:
  command = re.sub(r"^python3 -m pip install -r \S+ && ", "", command)
  command = re.sub(r"(?<![\w/.])runs/", f"{tmp}/runs/", command)
  command = command.replace(FINETUNE_DATA, f"{tmp}/{FINETUNE_DATA}")
  if re.match(r"python3 train\.py ", command):
    command += " " + short_run_flags()
  for prefix, flags in SHORT_FINETUNE.items():
    if command.startswith(prefix):
      command += flags.format(d=f"{tmp}/{FINETUNE_DATA}")
  return command


def _run(command: str) -> tuple[str, int, str]:
  out = subprocess.run(["bash", "-c", command], cwd=ROOT, capture_output=True, text=True, timeout=600)
  return command, out.returncode, out.stdout + out.stderr


QUICK_START = "python3 train.py --config=configs/umoe_tiny.py --workdir=runs/umoe_tiny"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  """The quick start's model, trained with the README's short-run flags; the tour reads it."""
  tmp = str(tmp_path_factory.mktemp("readme"))
  command, rc, output = _run(as_run(QUICK_START, tmp))
  assert rc == 0, f"{command}\n{output[-3000:]}"
  return tmp, output


def test_quick_start_is_a_readme_command():
  commands = [c for b in readme_blocks() for c in b.commands]
  assert any(c.endswith("&& " + QUICK_START) for c in commands), commands


@pytest.mark.slow
@pytest.mark.parametrize("block", readme_blocks(), ids=repr)
def test_readme_block_runs(block, request):
  if block.marker.startswith("skip:"):
    pytest.skip(block.marker)
  if block.marker.startswith("needs:"):   # a path beside or inside the repository
    path = block.marker.split(":", 1)[1].strip()
    if not os.path.exists(os.path.join(ROOT, path)):
      pytest.skip(f"{block.marker} (absent here)")
  tmp, quick_output = request.getfixturevalue("tiny_run")
  commands = [as_run(c, tmp) for c in block.commands]
  commands = [c for c in commands if c != as_run(QUICK_START, tmp)]  # the fixture ran it
  if not commands:
    assert "done: step" in quick_output
    return
  with concurrent.futures.ThreadPoolExecutor(2) as pool:  # the commands are independent
    results = list(pool.map(_run, commands))
  failed = [f"{c}\nexit {rc}:\n{out[-2000:]}" for c, rc, out in results if rc != 0]
  assert not failed, "\n\n".join(failed)
