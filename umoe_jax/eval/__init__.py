"""Evaluation. `python -m umoe_jax.eval <command>` (`cli`): tasks, mmlu, race, perplexity, attack,
speed, lm-eval. Modules, one idea each:

  scoring      batched, bucketed log-likelihood of token windows (`Scorer`)
  tasks        JSONL readers: multiple choice, schema, lm (cloze); the known task files
  jsonl        JSON-lines records with file:line errors (tasks, RACE, corpora)
  fewshot      k-shot prompts with lm-evaluation-harness's draw and delimiters
  taskspec     which tasks: names, PATH:KIND, YAML / JSON spec files
  harness      task metrics (acc, acc_norm, ppl) and `evaluate`
  samples      per-item records of task scoring (`--log_samples`)
  mmlu, race   readers of their public releases, lm-eval's prompts
  corpora      perplexity corpora (parquet, jsonl, text, WikiText) and WikiText word counts
  corpus_ppl   sliding-window perplexity: token, word, bits per byte
  attack       seeded word-swap attack of a text
  speed        inference speed: prefill latency, decoding tokens/s, KV-cache bytes, peak memory
  errors       `EvalError`: bad input, printed by the CLI as one line (model loading: `umoe_jax.load`)
  lm_eval_adapter  the `umoe_jax` model for lm-evaluation-harness (optional dependency)
  perplexity   validation loss inside a training run (used by the trainer)
"""
