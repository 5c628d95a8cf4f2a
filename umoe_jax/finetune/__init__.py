"""Fine-tuning pretrained models for text classification (SST-2, SST-5, Banking-77 style).

    python -m umoe_jax.finetune --config=configs/finetune/<task>.py --workdir=DIR --config.init_from=RUN
    python -m umoe_jax.finetune predict --checkpoint=DIR --input=FILE --output=preds.jsonl

Modules, bottom up:
  config      the config sections and their check (`default_config`, `validate`)
  data        labelled files (JSONL / CSV / TSV / parquet), the label map, the dev carve-out, a run's
              splits, batches
  metrics     accuracy, macro-F1, confusion matrix, majority baseline
  model       SequenceClassifier: CausalLM.hidden_states -> pooling (last / mean) -> linear head
  predict     the fine-tuned checkpoint's layout, loading it, scoring files
  backbone    the pretrained start point (init_from): architecture, tokenizer, parameters
  optimizer   parameter groups (head / body / frozen) and the per-group AdamW
  step        the train step and its compiled program
  loop        the run (`run`): start or resume, epochs, dev selection, the final scoring
  linux_docs  a real classification set built from the linux-docs corpus (tests, README example)
"""
