"""Banking-77: intent of online-banking customer queries, 77 classes named like "card_arrival".

PolyAI's release (github.com/PolyAI-LDN/task-specific-datasets, banking_data/): train.csv and test.csv
with the header `text,category`. No dev file: 10% of train.csv is carved, per class.

  python -m umoe_jax.finetune --config=configs/finetune/banking77.py --workdir=runs/banking77 \
      --config.init_from=runs/umoe_base --config.data.tokenizer=/data/llama2/tokenizer.json
"""
from umoe_jax.finetune.config import default_config


def get_config():
  c = default_config()
  c.data.train_path = "data/banking77/train.csv"
  c.data.test_path = "data/banking77/test.csv"
  c.data.text_field = "text"
  c.data.label_field = "category"
  c.data.max_len = 96
  c.train.epochs = 10
  c.train.batch_size = 32
  c.train.head_learning_rate = 2e-3
  c.train.body_learning_rate = 5e-5
  c.train.select_metric = "macro_f1"
  return c
