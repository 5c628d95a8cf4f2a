"""Every command on a cloud URL without the store's client library (issue 47): one `storage error:`
line naming the URL, the install hint, exit status 1, no traceback. One handler reports them all
(umoe_jax/stdout_errors.py, run by every entry point); a command must read its paths through
umoe_jax/storage for a URL to reach it (an `os.path` check says "not found" instead).

Each case is a subprocess in which gcsfs, s3fs and google-cloud-storage cannot be imported (as in a
venv without requirements-cloud.txt, whatever this one has). Also here: a file given as init_from.
"""
from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

from test_cli_errors import cli, compile_cache, shared_dir, trained  # noqa: F401  (fixtures)
from test_cli_errors import ROOT

from umoe_jax.config import ConfigError

# Runs `python -c HIDDEN <script.py | module> args...` with the cloud clients unimportable.
_HIDDEN = ("import runpy, sys\n"
           "for name in ('gcsfs', 's3fs', 'google.cloud.storage'):\n"
           "  sys.modules[name] = None  # import raises ImportError\n"
           "target = sys.argv[1]\n"
           "sys.argv = sys.argv[1:]\n"
           "if target.endswith('.py'):\n"
           "  runpy.run_path(target, run_name='__main__')\n"
           "else:\n"
           "  runpy.run_module(target, run_name='__main__', alter_sys=True)\n")

FT = ["umoe_jax.finetune", "--config=configs/finetune/sst2.py", "--config.data.max_len=32"]
# (case id, argv with {ckpt} = a training workdir, {tmp} = a fresh local directory, the URL named)
CASES = [
    ("eval-perplexity-data", ["umoe_jax.eval", "perplexity", "--checkpoint={ckpt}",
                              "--data=s3://umoe-none/wiki.txt"], "s3://umoe-none/wiki.txt"),
    ("eval-perplexity-checkpoint", ["umoe_jax.eval", "perplexity", "--checkpoint=gs://umoe-none/run",
                                    "--data=README.md"], "gs://umoe-none/run"),
    ("eval-perplexity-json", ["umoe_jax.eval", "perplexity", "--checkpoint={ckpt}",
                              "--data=README.md", "--json=s3://umoe-none/out.json"],
     "s3://umoe-none"),
    ("eval-tasks-file", ["umoe_jax.eval", "tasks", "--checkpoint={ckpt}",
                         "--tasks=s3://umoe-none/q.jsonl:mc"], "s3://umoe-none/q.jsonl"),
    ("eval-tasks-spec", ["umoe_jax.eval", "tasks", "--checkpoint={ckpt}",
                         "--tasks=gs://umoe-none/tasks.yaml"], "gs://umoe-none/tasks.yaml"),
    ("eval-mmlu", ["umoe_jax.eval", "mmlu", "--checkpoint={ckpt}", "--data_dir=gs://umoe-none/mmlu"],
     "gs://umoe-none/mmlu/test"),
    ("eval-race", ["umoe_jax.eval", "race", "--checkpoint={ckpt}", "--data=s3://umoe-none/race"],
     "s3://umoe-none/race"),
    ("eval-attack", ["umoe_jax.eval", "attack", "--checkpoint={ckpt}", "--data=gs://umoe-none/w.txt"],
     "gs://umoe-none/w.txt"),
    ("generate-checkpoint", ["umoe_jax.generate", "--checkpoint=gs://umoe-none/run", "--prompt=hi"],
     "gs://umoe-none/run"),
    ("generate-tokenizer", ["umoe_jax.generate", "--checkpoint={ckpt}", "--prompt=hi",
                            "--tokenizer=s3://umoe-none/tokenizer.json"],
     "s3://umoe-none/tokenizer.json"),
    ("analysis-data", ["umoe_jax.analysis", "routing", "--checkpoints={ckpt}",
                       "--data=s3://umoe-none/probe.txt"], "s3://umoe-none/probe.txt"),
    ("analysis-checkpoint", ["umoe_jax.analysis", "routing", "--checkpoints=gs://umoe-none/run",
                             "--data=README.md"], "gs://umoe-none/run"),
    ("finetune-workdir", FT + ["--workdir=gs://umoe-none/ft", "--config.init_from={ckpt}"],
     "gs://umoe-none"),
    ("finetune-init-from", FT + ["--workdir={tmp}/ft", "--config.init_from=gs://umoe-none/run"],
     "gs://umoe-none/run"),
    ("finetune-train-path", FT + ["--workdir={tmp}/ft", "--config.init_from={ckpt}",
                                  "--config.data.train_path=s3://umoe-none/train.jsonl"],
     "s3://umoe-none/train.jsonl"),
    ("finetune-predict", ["umoe_jax.finetune", "predict", "--checkpoint=gs://umoe-none/ft",
                          "--input=README.md", "--output={tmp}/p.jsonl"],
     "gs://umoe-none/ft"),
    ("interop-export", ["umoe_jax.interop", "export", "--checkpoint=gs://umoe-none/run",
                        "--out={tmp}/out", "--format=official"], "gs://umoe-none/run"),
    ("interop-official", ["umoe_jax.interop.official", "--checkpoint=s3://umoe-none/official",
                          "--output={tmp}/out"], "s3://umoe-none/official"),
    ("prepare-input", ["umoe_jax.data.prepare", "--source=text", "--input=s3://umoe-none/t.txt",
                       "--output_dir={tmp}/tok"], "s3://umoe-none/t.txt"),
    ("prepare-output", ["umoe_jax.data.prepare", "--source=builtin", "--output_dir=gs://umoe-none/tok"],
     "gs://umoe-none"),
    ("train-workdir", ["train.py", "--config=configs/dense_tiny.py", "--workdir=gs://umoe-none/run"],
     "gs://umoe-none"),
    ("train-data", ["train.py", "--config=configs/dense_tiny.py", "--workdir={tmp}/run",
                    "--config.data.source=text", "--config.data.train_path=s3://umoe-none/t.txt"],
     "s3://umoe-none/t.txt"),
]


def _run_hidden(argv: list[str]) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("UMOE_DEBUG", None)
  return subprocess.run([sys.executable, "-c", _HIDDEN, *argv], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("argv, url", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_url_without_its_client_library_is_one_line_with_the_hint(trained, tmp_path, argv, url):
  argv = [a.format(ckpt=trained[0], tmp=tmp_path) for a in argv]
  proc = _run_hidden(argv)
  out = proc.stdout + proc.stderr
  assert proc.returncode == 1, out[-3000:]
  assert "Traceback" not in out, out[-3000:]
  lines = [l for l in proc.stderr.splitlines() if l.strip()]
  at = next((i for i, l in enumerate(lines) if l.startswith("storage error: ")), None)
  assert at is not None, out[-3000:]
  message, rest = lines[at], lines[at + 1:]
  assert f" {url}" in message and "client library for" in message and "is not installed" in message
  assert rest[0] == ("  hint: pip install -r requirements-cloud.txt (gcsfs, s3fs, huggingface_hub, "
                     "google-cloud-storage)"), out[-3000:]
  assert rest[1:] in ([], ["  (--debug shows the traceback)"]), out[-3000:]  # train.py's own
  assert not os.listdir(tmp_path), "a failed command left files behind"


@pytest.mark.parametrize("argv, expected", [
    (["umoe_jax.stats", "--zoo", "--zoo_dir=gs://umoe-none/configs"],
     "error: --zoo_dir='gs://umoe-none/configs': zoo configs are Python files, imported from a local "
     "directory (copy them here first)"),
    (["umoe_jax.stats", "--config=s3://umoe-none/c.py"],
     "error: --config=s3://umoe-none/c.py: a config file is Python, imported from a local path, not "
     "a URL: copy it here first"),
])
def test_stats_names_the_url_it_cannot_read(argv, expected):
  """stats reads only config files (Python modules, imported): a URL is refused in one line, not
  "--config=s3: no such file" (config_flags' FILE:arg split at the scheme's colon)."""
  proc = _run_hidden(argv)
  assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert proc.stderr.strip().splitlines()[-1] == expected


def test_a_storage_failure_that_caused_another_error_is_reported_by_the_handler(capsys,
                                                                               monkeypatch):
  """run_and_exit finds the StorageError behind the error that escapes a command (its cause),
  and shows the traceback instead under UMOE_DEBUG=1."""
  from umoe_jax import stdout_errors
  from umoe_jax.storage import StorageError

  def main():
    try:
      raise StorageError("reading gs://b/x failed (ReadTimeout)", "gs://b/x", "check the network")
    except StorageError as e:
      raise RuntimeError("while loading") from e

  monkeypatch.delenv("UMOE_DEBUG", raising=False)
  with pytest.raises(SystemExit) as e:
    stdout_errors.run_and_exit(main)
  assert e.value.code == 1
  assert capsys.readouterr().err.splitlines() == [
      "storage error: reading gs://b/x failed (ReadTimeout)", "  hint: check the network"]
  monkeypatch.setenv("UMOE_DEBUG", "1")
  with pytest.raises(RuntimeError, match="while loading"):
    stdout_errors.run_and_exit(main)


# ----------------------------------------------------------------------------------------------
# A file where a checkpoint directory belongs.


def test_init_from_a_file_says_it_is_a_file(tmp_path):
  from umoe_jax.finetune import backbone
  from umoe_jax.train import resume
  path = tmp_path / "params.safetensors"
  path.write_bytes(b"\0" * 8)
  with pytest.raises(ConfigError, match=r"checkpoint\.init_from='.*params\.safetensors' is a file, "
                     r"not a checkpoint directory"):
    resume.init_from_checkpoints(str(path))
  with pytest.raises(ConfigError, match=r"^init_from='.*params\.safetensors' is a file, not a "
                     r"checkpoint directory"):
    backbone.read_backbone(types.SimpleNamespace(init_from=str(path)))
  with pytest.raises(ConfigError, match=r"init_from='.*nothing': no such directory"):
    backbone.read_backbone(types.SimpleNamespace(init_from=str(tmp_path / "nothing")))
