"""Tasks beyond the built-in list: few-shot prompts against hand-built strings (and lm-eval's own
sampler when installed), task spec files and PATH:KIND entries, MMLU and RACE readers on few-line
fixtures in their public layouts, every task kind scored through `evaluate_spec` with a model of
hand-set logits, and the errors for bad task input."""
from __future__ import annotations

import json
import math
import os
import random
import re

import pytest

from test_eval import _bigram
from umoe_jax.data.tokenizer import ByteTokenizer
from umoe_jax.eval import fewshot, harness, mmlu, race, taskspec
from umoe_jax.eval import tasks as tasks_lib
from umoe_jax.eval.errors import EvalError
from umoe_jax.eval.scoring import Scorer

MC = [tasks_lib.MultipleChoice(f"Q{i}?", ("yes", "no", "maybe"), i % 3) for i in range(6)]


def _jsonl(path, records):
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
  return str(path)


# ------------------------------------------------------------------------------------------------
# Few-shot prompts


def test_fewshot_prompts_hand_built():
  docs = MC[:3]
  assert fewshot.fewshot_prefixes(docs, 0) == ["", "", ""]
  # first_n from a separate pool, with a description: always the first k, in order.
  pool = [tasks_lib.MultipleChoice("Is ice cold?", ("yes", "no"), 0),
          tasks_lib.MultipleChoice("Is fire cold?", ("yes", "no"), 1)]
  pre = fewshot.fewshot_prefixes(docs, 2, pool=pool, sampler="first_n", description="Quiz.\n\n")
  assert pre[0] == "Quiz.\n\nIs ice cold? yes\n\nIs fire cold? no\n\n"
  assert docs[0].requests(pre[0])[2] == ("Quiz.\n\nIs ice cold? yes\n\nIs fire cold? no\n\nQ0?",
                                         " maybe")
  # the same file: 2 of 3 items can only be the other two; their order is random.Random(1234)'s.
  rnd = random.Random(1234)
  for d, p in zip(docs, fewshot.fewshot_prefixes(docs, 2)):
    ex = [x for x in rnd.sample(docs, 3) if x != d]
    assert p == f"{ex[0].query} {ex[0].choices[ex[0].gold]}\n\n{ex[1].query} " \
                f"{ex[1].choices[ex[1].gold]}\n\n"
    assert d.query not in p
  schema = tasks_lib.Schema(("Ann won so Ann", "Ann won so Bo"), "smiled.", 1)
  lam = tasks_lib.LanguageModeling("the cat sat on the", "mat")
  assert (schema.example(), lam.example()) == ("Ann won so Bo smiled.", "the cat sat on the mat")
  with pytest.raises(EvalError, match="3 shots requested but the other items of the file have only 2"):
    fewshot.fewshot_prefixes(docs, 3)
  with pytest.raises(EvalError, match="few-shot pool has only 2"):
    fewshot.fewshot_prefixes(docs, 3, pool=pool)


@pytest.mark.extras("lm_eval.api.samplers")
def test_fewshot_draw_equals_lm_eval_sampler():
  from lm_eval.api import samplers
  docs = [tasks_lib.MultipleChoice(f"q{i}", ("a", "b"), i % 2) for i in range(9)]
  ours = fewshot.draw_examples(docs, 3, seed=1234)
  theirs = samplers.ContextSampler(docs, rnd=1234)
  assert ours == [list(theirs.sample(3, eval_doc=d)) for d in docs]
  pool = docs[:5]
  theirs = samplers.ContextSampler(pool, rnd=7)
  assert fewshot.draw_examples(docs, 2, pool=pool, seed=7) == [list(theirs.sample(2)) for _ in docs]


# ------------------------------------------------------------------------------------------------
# Task specs


def test_task_list_entries_and_spec_files(tmp_path):
  mc = _jsonl(tmp_path / "my_mc.jsonl", [{"query": "q", "choices": ["a", "b"], "gold": 0}])
  specs = taskspec.parse_task_list(f"piqa,{mc}:mc,mine={mc}:multiple_choice", str(tmp_path))
  assert [(s.name, s.kind, s.path) for s in specs] == [
      ("piqa", "multiple_choice", str(tmp_path / "piqa.jsonl")),
      ("my_mc", "multiple_choice", mc), ("mine", "multiple_choice", mc)]
  (tmp_path / "suite.yaml").write_text(
      "tasks:\n  - {name: a3, path: my_mc.jsonl, kind: cloze, num_fewshot: 3, fewshot_seed: 5}\n"
      "  - {path: sub/x.jsonl, kind: schema, limit: 7, description: 'Hi.'}\n")
  specs = taskspec.parse_task_list([str(tmp_path / "suite.yaml")])
  assert specs[0] == taskspec.TaskSpec(name="a3", kind="lm", path=mc, num_fewshot=3, fewshot_seed=5)
  assert (specs[1].name, specs[1].path, specs[1].limit, specs[1].description) == (
      "x", str(tmp_path / "sub" / "x.jsonl"), 7, "Hi.")
  (tmp_path / "one.json").write_text(json.dumps({"path": "my_mc.jsonl", "kind": "mmlu"}))
  assert taskspec.parse_task_list(str(tmp_path / "one.json"))[0].kind == "mmlu"


@pytest.mark.parametrize("content,message", [
    ("- {path: a.jsonl, kind: essay}", "task 0: unknown task kind 'essay'"),
    ("- {path: a.jsonl}", "task 0: missing key 'kind'"),
    ("- {path: a.jsonl, kind: mc, shots: 3}", r"unknown key\(s\) \['shots'\]"),
    ("- {path: a.jsonl, kind: mc, num_fewshot: -1}", "'num_fewshot' must be an integer >= 0"),
    ("tasks: [", "cannot parse task spec"),
    ("[]", "no tasks"),
    # Not strings: a name failed in the results table after every task was scored, a description
    # once scoring began, a split in os.path.join.
    ("- {name: 5, path: a.jsonl, kind: mc}", "task 0: 'name' must be a string, got 5"),
    ("- {path: a.jsonl, kind: mc, description: 3}", "task 0: 'description' must be a string, got 3"),
    ("- {path: data, kind: mmlu, split: 1}", "task 0: 'split' must be a string, got 1"),
    # ~user of no user: was "no such file" once scoring began, naming ~user under the spec's folder.
    ("- {path: ~umoe_no_such_user/a.jsonl, kind: mc}",
     "task 0: 'path': unknown user 'umoe_no_such_user' in '~umoe_no_such_user/a.jsonl'"),
])
def test_bad_spec_files(tmp_path, content, message):
  (tmp_path / "s.yaml").write_text(content)
  with pytest.raises(EvalError, match=message):
    taskspec.parse_task_list(str(tmp_path / "s.yaml"))


def test_json_cut_short_is_named_at_its_last_line(tmp_path):
  """A JSON spec / RACE file that ends inside its object: its last line and column, not json's
  "line N+1 column 1" (a line after the file's last)."""
  (tmp_path / "s.json").write_text('[{"path": "a.jsonl",\n  "kind": "mc",\n\n')
  with pytest.raises(EvalError, match=re.escape(
      "s.json: cannot parse task spec (Expecting property name enclosed in double quotes: line 2 "
      "column 16 (char 36))")):
    taskspec.parse_task_list(str(tmp_path / "s.json"))
  (tmp_path / "RACE").mkdir()
  (tmp_path / "RACE" / "1.txt").write_text('{"article": "x",\n "questions": ["q"],\n')
  with pytest.raises(tasks_lib.TaskFormatError, match=re.escape(
      "1.txt:2: invalid JSON (Expecting property name enclosed in double quotes at column 21)")):
    race.load_race(str(tmp_path / "RACE"))


def test_bad_task_entries(tmp_path):
  with pytest.raises(EvalError, match="unknown task 'nope'"):
    taskspec.parse_task_list("nope")
  with pytest.raises(EvalError, match="unknown task kind 'essay'"):
    taskspec.parse_task_list("x.jsonl:essay")
  with pytest.raises(EvalError, match=r"given twice"):
    taskspec.parse_task_list("piqa,piqa")
  # A task file without its kind: said so (it was "unknown task '<path>'").
  mc = _jsonl(tmp_path / "mine.jsonl", [{"query": "q", "choices": ["a", "b"], "gold": 0}])
  for entry in (mc, f"m={mc}"):
    with pytest.raises(EvalError, match=re.escape(f"--tasks entry {entry!r} is a file: give its "
                                                  f"kind, {entry}:KIND, with KIND one of "
                                                  "multiple_choice, schema, lm, race, mmlu")):
      taskspec.parse_task_list(entry)
  with pytest.raises(FileNotFoundError, match="task spec file not found"):
    taskspec.parse_task_list(str(tmp_path / "none.yaml"))
  # A directory where a file is read: said so (it was "not found", or "is a file").
  d = tmp_path / "items"
  d.mkdir()
  with pytest.raises(EvalError, match=re.escape(f"eval file {str(d)!r} is a directory: a "
                                                "multiple_choice task reads one JSON-lines file")):
    harness.prepare(taskspec.parse_task_list(f"{d}:mc")[0])
  with pytest.raises(EvalError, match=re.escape(f"--tasks entry {str(d)!r} is a directory: give its "
                                                f"kind, {d}:KIND, with KIND race or mmlu")):
    taskspec.parse_task_list(str(d))
  (tmp_path / "suite.yaml").mkdir()
  with pytest.raises(EvalError, match=re.escape(f"task spec file {str(tmp_path / 'suite.yaml')!r} "
                                                "is a directory")):
    taskspec.parse_task_list(str(tmp_path / "suite.yaml"))
  mc = _jsonl(tmp_path / "mc.jsonl", [{"query": "q", "choices": ["a", "b"], "gold": 0}])
  for limit in (0, -3):   # not "mc.jsonl: no records": the file is fine
    with pytest.raises(EvalError, match=f"task 'mc': limit={limit} must be >= 1"):
      harness.prepare(taskspec.TaskSpec("mc", "multiple_choice", mc), limit=limit)


def test_fewshot_seed_of_the_spec_wins_over_the_commands(tmp_path):
  """harness.prepare draws the examples with the spec's fewshot_seed when it has one, else with
  the command's --fewshot_seed: the prompts equal fewshot_prefixes' with that seed."""
  mc = _jsonl(tmp_path / "mc.jsonl", [{"query": f"Q{i}?", "choices": ["no", "yes"], "gold": i % 2}
                                      for i in range(12)])
  docs = tasks_lib.read_jsonl(mc, "multiple_choice")
  by_seed = {seed: fewshot.fewshot_prefixes(docs, 2, seed=seed) for seed in (5, 9)}
  assert by_seed[5] != by_seed[9]       # else the checks below could not tell the seeds apart
  spec = taskspec.TaskSpec("mc", "multiple_choice", mc, num_fewshot=2)
  assert harness.prepare(spec, fewshot_seed=9)[0].prefixes == by_seed[9]
  seeded = taskspec.TaskSpec("mc", "multiple_choice", mc, num_fewshot=2, fewshot_seed=5)
  assert harness.prepare(seeded, fewshot_seed=9)[0].prefixes == by_seed[5]


# ------------------------------------------------------------------------------------------------
# Every kind scored with hand-set logits


def test_each_kind_through_evaluate_spec(tmp_path):
  """The bigram model predicts "yes" after " " and " " after "a": choices "yes" win whatever the
  few-shot prompt before them, the schema option ending in "a" wins, and of the lm items only
  "yes" is greedy."""
  model = _bigram([(" ", "y"), ("y", "e"), ("e", "s"), ("a", " ")])
  scorer, tok = Scorer(model, batch_size=4), ByteTokenizer()
  mc = _jsonl(tmp_path / "mc.jsonl", [{"query": f"Q{i}?", "choices": ["no", "yes"], "gold": g}
                                      for i, g in enumerate([1, 1, 0, 1])])
  out = harness.evaluate_spec(scorer, tok, taskspec.TaskSpec("mc", "multiple_choice", mc,
                                                             num_fewshot=2))
  assert (out["mc"]["acc"], out["mc"]["n"], out["mc"]["num_fewshot"]) == (0.75, 4, 2)
  sc = _jsonl(tmp_path / "sc.jsonl", [{"context_options": ["b", "a"], "continuation": "yes",
                                       "gold": 1}])
  assert harness.evaluate_spec(scorer, tok, taskspec.TaskSpec("s", "schema", sc))["s"]["acc"] == 1.0
  lm = _jsonl(tmp_path / "lm.jsonl", [{"context": "pa", "continuation": "yes"},
                                      {"context": "pa", "continuation": "yo"}])
  out = harness.evaluate_spec(scorer, tok, taskspec.TaskSpec("l", "lm", lm))
  assert (out["l"]["acc"], out["l"]["n"]) == (0.5, 2)
  out = harness.evaluate_spec(scorer, tok, taskspec.TaskSpec("l", "lm", lm), limit=1)
  assert (out["l"]["acc"], out["l"]["n"]) == (1.0, 1)


# ------------------------------------------------------------------------------------------------
# MMLU


def _mmlu_fixture(root, subjects=(("abstract_algebra", "CCCA"), ("philosophy", "CB"),
                                  ("virology", "C"))):
  """data/{dev,test}/<subject>_<split>.csv rows: question, A, B, C, D, answer."""
  for split in ("dev", "test"):
    (root / split).mkdir(parents=True, exist_ok=True)
  for subject, answers in subjects:
    dev = "".join(f'"Dev {i}, of {subject}?",w,x,y,z,{"ABCDA"[i]}\n' for i in range(5))
    (root / "dev" / f"{subject}_dev.csv").write_text(dev)
    test = "".join(f'"Q{i}\n(two lines)",1,2,3,4,{a}\n' for i, a in enumerate(answers))
    (root / "test" / f"{subject}_test.csv").write_text(test)
  return str(root)


def test_mmlu_reader_and_prompt(tmp_path):
  data = _mmlu_fixture(tmp_path / "data")
  docs = mmlu.read_csv(os.path.join(data, "test", "abstract_algebra_test.csv"))
  assert docs[3] == tasks_lib.MultipleChoice("Q3\n(two lines)\nA. 1\nB. 2\nC. 3\nD. 4\nAnswer:",
                                             ("A", "B", "C", "D"), 0)
  dev = mmlu.read_csv(os.path.join(data, "dev", "philosophy_dev.csv"))
  pre = fewshot.fewshot_prefixes(docs[:1], 2, pool=dev, sampler="first_n",
                                 description=mmlu.description("abstract_algebra"))
  assert pre[0] == ("The following are multiple choice questions (with answers) about abstract "
                    "algebra.\n\nDev 0, of philosophy?\nA. w\nB. x\nC. y\nD. z\nAnswer: A\n\n"
                    "Dev 1, of philosophy?\nA. w\nB. x\nC. y\nD. z\nAnswer: B\n\n")
  assert len(mmlu.SUBJECTS) == 57
  assert {c: list(mmlu.SUBJECTS.values()).count(c) for c in mmlu.CATEGORIES} == {
      "stem": 19, "humanities": 13, "social_sciences": 12, "other": 13}


def test_mmlu_scores_per_subject_category_and_overall(tmp_path):
  """A model that always answers " C": per subject 3/4, 1/2, 1/1; STEM 3/4, humanities 1/2,
  other 1/1; overall 5/7 (weighted by items), subject mean (3/4 + 1/2 + 1) / 3."""
  data = _mmlu_fixture(tmp_path / "data")
  model = _bigram([(" ", "C")])
  out = harness.evaluate_spec(Scorer(model, batch_size=4), ByteTokenizer(),
                              taskspec.TaskSpec("mmlu", "mmlu", data))
  assert out["mmlu_abstract_algebra"]["acc"] == 0.75 and out["mmlu_philosophy"]["acc"] == 0.5
  assert (out["mmlu_stem"]["acc"], out["mmlu_humanities"]["acc"], out["mmlu_other"]["acc"]) == (
      0.75, 0.5, 1.0)
  assert "mmlu_social_sciences" not in out
  assert math.isclose(out["mmlu"]["acc"], 5 / 7) and out["mmlu"]["n"] == 7
  assert math.isclose(out["mmlu"]["subject_mean"], (0.75 + 0.5 + 1) / 3)
  assert math.isclose(out["mmlu"]["acc_stderr"], math.sqrt(5 / 7 * 2 / 7 / 6))
  assert out["mmlu"]["num_fewshot"] == 5
  with pytest.raises(EvalError, match=r"unknown MMLU subject\(s\) \['astrology'\]"):
    harness.evaluate_spec(Scorer(model), ByteTokenizer(),
                          taskspec.TaskSpec("mmlu", "mmlu", data, subjects=("astrology",)))
  with pytest.raises(EvalError, match="mmlu_virology: 6 shots requested but the few-shot pool "
                     "has only 5"):
    harness.evaluate_spec(Scorer(model), ByteTokenizer(),
                          taskspec.TaskSpec("mmlu", "mmlu", data, num_fewshot=6,
                                            subjects=("virology",)))


@pytest.mark.parametrize("row,message", [
    ("q,a,b,c,d\n", "expected 6 columns"),
    ("q,a,b,c,d,E\n", "answer must be one of A, B, C, D, got 'E'"),
])
def test_mmlu_malformed_rows(tmp_path, row, message):
  path = tmp_path / "x_test.csv"
  path.write_text('"multi\nline",a,b,c,d,A\n' + row)
  with pytest.raises(tasks_lib.TaskFormatError, match=f"x_test.csv:3: {message}"):
    mmlu.read_csv(str(path))


# ------------------------------------------------------------------------------------------------
# RACE


ARTICLE = {"article": "Tom has a red ball.", "id": "high1.txt",
           "questions": ["What colour is the ball?", "Tom's ball is  _  .", "Who has the ball?"],
           "options": [["red", "blue", "green", "pink"], ["big", "red", "old", "new"],
                       ["Ann", "Bo", "Tom", "Cy"]],
           "answers": ["A", "B", "C"]}


def test_race_item_as_lm_eval_builds_it(tmp_path):
  item = race.to_item(ARTICLE)
  assert item.query == ("Article: Tom has a red ball.\n\nQuestion: What colour is the ball?\n"
                        "Answer: red\nTom's ball is red\nWho has the ball?")
  assert (item.choices, item.gold) == (("Ann", "Bo", "Tom", "Cy"), 2)
  # public layout: one JSON file per article, natural order; and a .jsonl of articles
  d = tmp_path / "RACE" / "test" / "high"
  d.mkdir(parents=True)
  for n in (10, 2):
    (d / f"{n}.txt").write_text(json.dumps(dict(ARTICLE, article=f"Art {n}.")))
  assert [x.query.split("\n")[0] for x in race.load_race(str(tmp_path / "RACE"))] == [
      "Article: Art 2.", "Article: Art 10."]
  lines = _jsonl(tmp_path / "r.jsonl", [ARTICLE, dict(ARTICLE, answers=["A", "B"])])
  with pytest.raises(tasks_lib.TaskFormatError, match=r"r.jsonl:2: 3 questions, 3 option lists and "
                     "2 answers"):
    race.load_race(lines)
  assert len(race.load_race(lines, limit=1)) == 1
  (d / "3.txt").write_text('{"article": "x", ')
  with pytest.raises(tasks_lib.TaskFormatError, match=r"3.txt:1: invalid JSON"):
    race.load_race(str(d))
  model = _bigram([(" ", "T"), ("T", "o"), ("o", "m")])
  out = harness.evaluate_spec(Scorer(model, batch_size=4), ByteTokenizer(),
                              taskspec.TaskSpec("race", "race", lines, limit=1))
  assert out["race"]["acc"] == 1.0


def test_trailing_context_space_moves_to_the_continuation():
  """As lm-eval: "Answer: " + "B" is scored as "Answer:" + " B"; an empty context becomes EOS."""
  from umoe_jax.eval.scoring import encode_requests
  tok = ByteTokenizer()
  assert encode_requests(tok, [("Answer: ", "B"), ("", " x")]) == [
      (list(b"Answer:"), list(b" B")), ([tok.eos_id], list(b" x"))]
  assert encode_requests(tok, [("q", " a")], bos_id=7) == [([7] + list(b"q"), list(b" a"))]


def test_continuation_ids_are_the_tail_of_the_whole_encoding(tmp_path):
  """As lm-eval's Hugging Face models: a continuation's ids are those of context + continuation
  after the context's own. With a Llama-2-style tokenizer (a "▁" prepended to the text, spaces as
  "▁") " B" after "A:" is the one token "▁B", while " B" encoded alone is "▁", "▁B"."""
  from tokenizers import Tokenizer, models, normalizers

  from umoe_jax.data.tokenizer import HFTokenizer
  from umoe_jax.eval.scoring import encode_requests
  vocab = {"<unk>": 0, "</s>": 1, "▁": 2, "A": 3, "B": 4, ":": 5, "▁A": 6, "▁B": 7}
  hf = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "A"), ("▁", "B")], unk_token="<unk>"))
  hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
  hf.save(str(tmp_path / "tokenizer.json"))
  tok = HFTokenizer(str(tmp_path / "tokenizer.json"), eos_token="</s>")
  assert tok.encode(" B") == [2, 7] and tok.encode("A: B") == [6, 5, 7]
  assert encode_requests(tok, [("A: ", "B"), ("A:", " B")], bos_id=1) == [([1, 6, 5], [7])] * 2
