"""SST-5: five-way sentiment of movie-review sentences (0 very negative .. 4 very positive).

The common JSON-lines release (e.g. SetFit/sst5): train.jsonl, validation.jsonl, test.jsonl with
{"text": ..., "label": 0-4, "label_text": "very negative" ...}. For the original PTB-tree files
(train.txt, "(3 (2 It) ...)"), write the root label and the sentence's words as such a JSONL first.

  python -m umoe_jax.finetune --config=configs/finetune/sst5.py --workdir=runs/sst5 \
      --config.init_from=runs/umoe_base --config.data.tokenizer=/data/llama2/tokenizer.json
"""
from umoe_jax.finetune.config import default_config


def get_config():
  c = default_config()
  c.data.train_path = "data/sst5/train.jsonl"
  c.data.dev_path = "data/sst5/validation.jsonl"
  c.data.test_path = "data/sst5/test.jsonl"
  c.data.text_field = "text"
  c.data.label_field = "label"
  c.data.max_len = 128
  c.train.epochs = 5
  c.train.batch_size = 32
  c.train.select_metric = "accuracy"
  return c
