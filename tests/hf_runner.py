"""Runs exported Hugging Face directories with transformers, in a process of its own (tests/test_export_hf.py).

    python tests/hf_runner.py JOBS.json

JOBS.json: a list of {"dir": exported directory, "tokens": .npy [B, T] int, "logits": .npy to write,
"generate": optional {"prompts": [[ids]], "max_new_tokens": n, "out": .json to write}}. Each directory
loads with AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True) in float32 on the CPU.

A process of its own, started outside the repository: transformers 5 imports the `kernels`
distribution, which the repository's kernels/ package shadows wherever the repository root is on
sys.path; an exported directory needs nothing of this project, as on a user's machine.
"""
from __future__ import annotations

import json
import sys


def main(jobs_path: str) -> None:
  import numpy as np
  import torch
  from transformers import AutoModelForCausalLM

  torch.manual_seed(0)
  with open(jobs_path) as f:
    jobs = json.load(f)
  for job in jobs:
    model = AutoModelForCausalLM.from_pretrained(job["dir"], trust_remote_code=True,
                                                 dtype=torch.float32)
    with torch.no_grad():
      if job.get("tokens"):
        tokens = torch.from_numpy(np.load(job["tokens"])).long()
        np.save(job["logits"], model(tokens).logits.numpy())
      gen = job.get("generate")
      if gen:
        model.generation_config.eos_token_id = None   # as umoe_jax's generate without an EOS: all n tokens
        outs = []
        for prompt in gen["prompts"]:
          ids = torch.tensor([prompt])
          out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=gen["max_new_tokens"])
          outs.append(out[0, len(prompt):].tolist())
        with open(gen["out"], "w") as f:
          json.dump(outs, f)


if __name__ == "__main__":
  main(sys.argv[1])
