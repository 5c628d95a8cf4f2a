"""What word-level perplexity and the attack table divide by, through `python -m umoe_jax.eval
perplexity | attack` with a scorer that gives every token log p = -C (so each metric's denominator
can be read off it): the WikiText-2 test file counts the papers' 245,569 (241,211 words + 4,358
line ends, blank lines included), a hand-made file its counts by hand (CRLF and blank lines; a
.raw file says its count is its own), and the attack table shows the attacked NLL on the attacked
text's own counts and on the clean text's, each column labelled."""
from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import pytest

from conftest import ROOT
from umoe_jax.eval import cli

WIKITEXT = os.path.join(os.path.dirname(ROOT), "shared", "data", "wikitext-2")
CONFIG = f"{ROOT}/configs/dense_tiny.py"
C = 0.75          # nats per token under the constant scorer


class ConstantScorer:
  """Stands in for `scoring.Scorer`: every scored token gets log p = -C."""

  def __init__(self, model, batch_size=16):
    self.max_seq_len = model.cfg.max_seq_len

  def score_windows(self, wins, progress=None):
    if progress:
      progress(list(range(len(wins))))
    return np.array([-C * k for _, _, k in wins], np.float64), np.zeros(len(wins), bool)


def run_cli(capsys, monkeypatch, *argv):
  argv = [str(a) for a in argv]
  monkeypatch.setattr(cli, "Scorer", ConstantScorer)
  monkeypatch.setattr(sys, "argv", ["python -m umoe_jax.eval", *argv])
  code = cli.main(argv)
  out = capsys.readouterr()
  assert code == 0, out.err
  return out.out


def _perplexity(capsys, monkeypatch, tmp_path, path, *flags):
  table = run_cli(capsys, monkeypatch, "perplexity", f"--config={CONFIG}", f"--data={path}",
                  *flags, f"--json={tmp_path}/p.json")
  return table, json.loads((tmp_path / "p.json").read_text())["results"]


@pytest.mark.skipif(not os.path.isdir(WIKITEXT), reason=f"WikiText-2 not found at {WIKITEXT}")
def test_wikitext2_test_tokens_counts_the_papers_words(tmp_path, capsys, monkeypatch):
  path = os.path.join(WIKITEXT, "wiki.test.tokens")
  with open(path, encoding="utf-8") as f:
    text = f.read()
  table, res = _perplexity(capsys, monkeypatch, tmp_path, path)
  assert (res["words"], res["line_ends"]) == (245_569, 4_358)
  assert res["tokens"] == res["bytes"] == len(text.encode("utf-8"))     # byte tokenizer, all scored
  assert res["word_ppl"] == pytest.approx(math.exp(C * res["tokens"] / 245_569), rel=1e-12)
  assert res["token_ppl"] == pytest.approx(math.exp(C), rel=1e-12)
  assert ("words = 241,211 whitespace-separated words + 4,358 line ends (one <eos> per line, "
          "blank lines included)") in table.replace("\n", " ")
  assert "| words             | 245,569 " in table and "raw file" not in table


def test_hand_made_file_counts(tmp_path, capsys, monkeypatch):
  # 3 lines of words (3 + 6 + 1 = 10 words), 2 blank lines, one of them spaces only: 5 line ends
  text = " = T = \n \n a b , c @-@ d \n\n e \n"
  (tmp_path / "t.tokens").write_bytes(text.replace("\n", "\r\n").encode())   # CRLF read as "\n"
  table, res = _perplexity(capsys, monkeypatch, tmp_path, tmp_path / "t.tokens")
  assert (res["words"], res["line_ends"], res["tokens"], res["bytes"]) == (15, 5, len(text),
                                                                           len(text))
  assert res["word_ppl"] == pytest.approx(math.exp(C * len(text) / 15), rel=1e-12)
  assert res["bits_per_byte"] == pytest.approx(C / math.log(2), rel=1e-12)
  assert "words = 10 whitespace-separated words + 5 line ends" in table
  assert "raw file" not in table
  # The same text as a .raw file: the same count, said to be that file's own, not the papers'.
  (tmp_path / "t.raw").write_text(text)
  table, res = _perplexity(capsys, monkeypatch, tmp_path, tmp_path / "t.raw")
  assert (res["words"], res["line_ends"]) == (15, 5)
  assert "counted on the raw file t.raw" in res["words_counted"]
  assert "245,569" in res["words_counted"] and "not comparable" in table.replace("\n", " ")
  # Detokenized, the words are still those of the original text ("c @-@ d" is three).
  _, res = _perplexity(capsys, monkeypatch, tmp_path, tmp_path / "t.tokens", "--detokenize")
  assert (res["words"], res["line_ends"]) == (15, 5) and res["tokens"] < len(text)
  # A plain text file has no word count, and says nothing about one.
  (tmp_path / "t.txt").write_text(text)
  table, res = _perplexity(capsys, monkeypatch, tmp_path, tmp_path / "t.txt")
  assert "words" not in res and "word_ppl" not in res and "words =" not in table


def test_attack_table_denominators(tmp_path, capsys, monkeypatch):
  # Short words, long vocabulary words: substitutions lengthen the text (more tokens and bytes).
  words = ["a"] * 40 + ["extraordinarily", "incomprehensible"]
  text = " ".join(words[i % 3] if i % 7 else words[40 + i % 2] for i in range(60)) + " \n"
  (tmp_path / "a.tokens").write_text(text)
  table = run_cli(capsys, monkeypatch, "attack", f"--config={CONFIG}",
                  f"--data={tmp_path}/a.tokens", "--rate=0.5", "--attack_seed=2",
                  f"--json={tmp_path}/a.json")
  res = json.loads((tmp_path / "a.json").read_text())["results"]
  clean, hit, on_clean = res["clean"], res["attacked"], res["attacked_on_clean_counts"]
  assert clean["tokens"] == clean["bytes"] == len(text)
  assert hit["tokens"] == hit["bytes"] != clean["tokens"]         # the attack changed the length
  assert hit["nll"] == pytest.approx(C * hit["tokens"]) and clean["words"] == hit["words"] == 61
  # own counts: per token the attacked text looks exactly as good as the clean one (C nats)
  assert hit["token_ppl"] == pytest.approx(clean["token_ppl"]) == pytest.approx(math.exp(C))
  # clean counts: the attacked NLL over the clean text's tokens, bytes and words
  assert (on_clean["tokens"], on_clean["bytes"], on_clean["words"]) == (
      clean["tokens"], clean["bytes"], clean["words"])
  assert on_clean["token_ppl"] == pytest.approx(math.exp(hit["nll"] / clean["tokens"]), rel=1e-12)
  assert on_clean["bits_per_byte"] == pytest.approx(hit["nll"] / (math.log(2) * clean["bytes"]),
                                                    rel=1e-12)
  assert on_clean["word_ppl"] == pytest.approx(hit["word_ppl"], rel=1e-12)   # same word count
  assert on_clean["token_ppl"] > clean["token_ppl"]                         # worse, as it is
  header, _, *body = table.splitlines()
  assert [c.strip() for c in header.strip("|").split("|")] == [
      "metric", "clean", "attacked (own counts)", "attacked (clean counts)"]
  row = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]]
         for r in body if r.startswith("|")}
  assert row["tokens"] == [f"{clean['tokens']:,}", f"{hit['tokens']:,}", f"{clean['tokens']:,}"]
  assert row["bits_per_byte"][2] == f"{on_clean['bits_per_byte']:.4f}"
  assert f"({hit['tokens'] - clean['tokens']:+,} tokens" in table.replace("\n", " ")
