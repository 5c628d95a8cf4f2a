"""What the commands show a person (`umoe_jax.console`, `umoe_jax.generate`'s records): progress bars
only on a terminal's stderr, never in stdout; no "libtpu" line on a machine without a TPU; generate's
labelled records and its --jsonl objects."""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from umoe_jax import console


class FakeTerminal(io.StringIO):
  """A stream that says it is a terminal (isatty), keeping what is written."""

  def isatty(self) -> bool:
    return True


# ------------------------------------------------------------------------------------------------
# console.progress / note


def test_progress_is_off_for_a_stream_that_is_no_terminal():
  stream = io.StringIO()
  with console.progress(total=10, desc="work", unit="item", stream=stream) as bar:
    assert bar.disable
    bar.update(4)
    bar.set_postfix(loss=1.0)
  assert list(console.progress(range(3), stream=stream)) == [0, 1, 2]  # still iterates
  assert stream.getvalue() == ""


def test_progress_is_on_for_a_terminal_with_an_eta():
  stream = FakeTerminal()
  with console.progress(total=10, desc="work", unit="item", stream=stream) as bar:
    assert not bar.disable
    bar.update(4)
    bar.refresh()
    drawn = stream.getvalue()
  assert "work:" in drawn and "4/10" in drawn and "item/s" in drawn
  assert "<" in drawn  # [elapsed<remaining]: the ETA
  with console.progress(total=10, show=False, stream=FakeTerminal()) as bar:
    assert bar.disable  # a caller's own off switch (prepare(progress=False))


def test_progress_defaults_to_stderr_at_the_call(monkeypatch):
  monkeypatch.setattr(sys, "stderr", FakeTerminal())
  assert not console.progress(total=1).disable
  monkeypatch.setattr(sys, "stderr", io.StringIO())
  assert console.progress(total=1).disable


def test_is_terminal_of_odd_streams():
  closed = io.StringIO()
  closed.close()
  assert not console.is_terminal(closed)     # ValueError
  assert not console.is_terminal(object())   # no isatty
  assert console.is_terminal(FakeTerminal())


def test_note_writes_one_line():
  stream = io.StringIO()
  console.note("model: x (step 3)", stream)
  assert stream.getvalue() == "model: x (step 3)\n"


def test_a_commands_stdout_is_the_same_with_a_bar_on_stderr(tmp_path):
  """eval perplexity with stderr a terminal (a bar drawn there) prints the same stdout as with
  stderr a pipe, whose lines are unchanged too."""
  from umoe_jax.eval.cli import main
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("The quick brown fox jumps over the lazy dog.\n" * 40)
  argv = ["perplexity", "--config=configs/umoe_tiny.py", f"--data={corpus}", "--format=text",
          "--context=64", "--batch_size=2", "--max_tokens=1024"]
  runs = []
  for stderr in (io.StringIO(), FakeTerminal()):
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
      assert main(argv) == 0
    runs.append((stdout.getvalue(), stderr.getvalue()))
  (out_pipe, err_pipe), (out_tty, err_tty) = runs
  assert out_tty == out_pipe and "token_ppl" in out_pipe
  assert "\r" not in err_pipe and "token/s" not in err_pipe
  assert "perplexity:" in err_tty and "token/s" in err_tty   # the bar
  # What stays on the terminal (each line's text after its last carriage return: the bar vanishes
  # when done) is the pipe's lines, the timing aside.
  shown = lambda s: [l.rsplit("\r", 1)[-1].split(" in ")[0] for l in s.split("\n")]
  assert [l for l in shown(err_tty) if l.strip()] == [l for l in shown(err_pipe) if l]


def test_scorer_tells_progress_every_window_and_request_once():
  """The bars' counts: every window of a batch once it is scored, and a request once all of its
  windows are (a continuation longer than max_seq_len takes several), with the same results."""
  import numpy as np
  from flax import nnx

  from conftest import tiny_config
  from umoe_jax.eval.scoring import Scorer
  from umoe_jax.model import CausalLM
  scorer = Scorer(CausalLM(tiny_config("dense"), rngs=nnx.Rngs(0)), batch_size=2)  # max_seq_len 16
  requests = [([1, 2, 3], [4, 5]), ([7], list(range(1, 40))), ([9, 9], [3])]
  told: list[int] = []
  ll, greedy = scorer.loglikelihood(requests, progress=told.append)
  assert sum(told) == len(requests) and len(told) >= 3 and all(n >= 0 for n in told)
  plain_ll, plain_greedy = scorer.loglikelihood(requests)
  np.testing.assert_array_equal(ll, plain_ll)
  np.testing.assert_array_equal(greedy, plain_greedy)
  wins = [([1, 2, 3], [2, 3, 4], 2), ([5] * 16, [6] * 16, 16), ([1], [2], 1)] * 3
  seen: list[int] = []
  scorer.score_windows(wins, progress=seen.extend)
  assert sorted(seen) == list(range(len(wins)))


# ------------------------------------------------------------------------------------------------
# JAX's platform probe


def test_the_probe_filter_drops_only_the_info_line():
  console.quiet_platform_probe()
  console.quiet_platform_probe()  # idempotent
  logger = logging.getLogger("jax._src.xla_bridge")
  assert sum(isinstance(f, console._DropBackendProbe) for f in logger.filters) == 1

  def passes(level, msg):
    return logger.filter(logger.makeRecord(logger.name, level, __file__, 1, msg, (), None))

  assert not passes(logging.INFO, "Unable to initialize backend 'tpu': INTERNAL: Failed to open "
                                  "libtpu.so: libtpu.so: cannot open shared object file")
  assert passes(logging.WARNING, "A Google TPU may be present on this machine, but either a "
                                 "TPU-enabled jaxlib or libtpu is not installed.")
  assert passes(logging.INFO, "Initializing backend 'cpu'")


_TINY_COMMAND = """
from absl import app, logging
import jax
{wrap}
def main(argv):
  logging.info("devices: %s", jax.devices())
  return 0
{run}
"""


def _tiny_command_stderr(through_run_and_exit: bool) -> str:
  """stderr of an absl command at INFO verbosity (train.py's) that initialises JAX's backends, with
  JAX_PLATFORMS unset (as a user's shell has it): the platforms are probed."""
  code = _TINY_COMMAND.format(
      wrap="from umoe_jax import stdout_errors" if through_run_and_exit else "",
      run=("stdout_errors.run_and_exit(app.run, main)" if through_run_and_exit
           else "app.run(main)"))
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
  assert res.returncode == 0, res.stderr[-3000:]
  assert "devices: [" in res.stderr, res.stderr  # (absl's INFO lines do reach stderr)
  return res.stderr


def test_no_tpu_line_on_a_machine_without_one():
  bare = _tiny_command_stderr(through_run_and_exit=False)
  if "libtpu" not in bare:
    pytest.skip("JAX logs no libtpu probe line here (a TPU machine, or another jax)")
  err = _tiny_command_stderr(through_run_and_exit=True)
  assert not [l for l in err.splitlines() if "libtpu" in l or "TPU" in l or "'tpu'" in l], err


# ------------------------------------------------------------------------------------------------
# generate's output


def _record(**kw) -> dict:
  return dict(dict(prompt="Hi", continuation="", prompt_tokens=2, new_tokens=0, stop="eos",
                   max_new_tokens=8), **kw)


def test_generate_record_by_hand():
  from umoe_jax.generate import format_record
  assert format_record(0, 2, _record(continuation=" there,\nfriend.\n", new_tokens=15,
                                     stop="max_new_tokens", max_new_tokens=15)).split("\n") == [
      "=== prompt 1 of 2 ===",
      "prompt       | Hi",
      "continuation |  there,",
      "             | friend.",
      "             |",
      "(2 prompt tokens, 15 new tokens; stopped at --max_new_tokens=15)"]
  assert format_record(1, 2, _record(prompt="a\nb", prompt_tokens=1, continuation="x",
                                     new_tokens=1)).split("\n") == [
      "=== prompt 2 of 2 ===",
      "prompt       | a",
      "             | b",
      "continuation | x",
      "(1 prompt token, 1 new token; then EOS)"]


def test_generate_record_keeps_spaces():
  from umoe_jax.generate import format_record
  assert format_record(0, 1, _record(continuation="   \n x ")).split("\n")[2:4] == [
      "continuation |    ", "             |  x "]


def test_generate_record_escapes_control_characters():
  """A carriage return, ESC or a Unicode line separator would overwrite or split the record on a
  terminal: they show escaped; a tab stays."""
  from umoe_jax.generate import format_record
  lines = format_record(0, 1, _record(continuation="a\rb\x1b[31mc\u2028d\te")).split("\n")
  assert lines[2] == "continuation | a\\rb\\x1b[31mc\\u2028d\te"
  assert len(lines) == 4


def test_generate_jsonl(tmp_path):
  """--jsonl: one JSON object per prompt, the continuation as generate() makes it."""
  from flax import nnx

  import configs.common
  from conftest import random_module
  from umoe_jax.config import model_config
  from umoe_jax.data.tokenizer import ByteTokenizer
  from umoe_jax.interop.official import save_converted
  from umoe_jax.model import CausalLM
  from umoe_jax.model.decode import generate
  m = configs.common.model("umoe", "tiny")
  m.n_layers, m.compute_dtype, m.gmm_backend = 1, "float32", "xla"
  model = random_module(lambda: CausalLM(model_config(m), rngs=nnx.Rngs(0)), 7)
  ckpt = save_converted(model, m, str(tmp_path / "ckpt"))
  prompts, tok = ["Hello", "a\nb"], ByteTokenizer()
  out = generate(model, [tok.encode(p) for p in prompts], max_new_tokens=5, eos_id=tok.eos_id)
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  res = subprocess.run([sys.executable, "-m", "umoe_jax.generate", f"--checkpoint={ckpt}",
                        "--prompt=Hello", "--prompt=a\nb", "--max_new_tokens=5", "--jsonl"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert res.returncode == 0, res.stderr[-3000:]
  lines = res.stdout.splitlines()
  assert len(lines) == 2
  for prompt, ids, line in zip(prompts, out.sequences(), lines):
    eos = bool(ids) and ids[-1] == tok.eos_id
    ids = ids[:-1] if eos else ids
    assert json.loads(line) == dict(
        prompt=prompt, continuation=tok.decode(ids), prompt_tokens=len(prompt),
        new_tokens=len(ids), stop="eos" if eos else "max_new_tokens", checkpoint=ckpt, step=None,
        tokenizer="byte", max_new_tokens=5, temperature=0.0, top_p=1.0, seed=0)
