"""Which documentation subtree a linux-docs file belongs to (6 classes; a real set that ships with the
tests' data). Build the files first:

  python -m umoe_jax.finetune.linux_docs --output=data/linux_docs_cls
  python -m umoe_jax.finetune --config=configs/finetune/linux_docs.py --workdir=runs/linux_docs_cls \
      --config.init_from=runs/umoe_tiny

train.jsonl {"text", "label", "id"}, test.csv (text,label,id); the dev split is carved from train.
"""
from umoe_jax.finetune.config import default_config


def get_config():
  c = default_config()
  c.data.train_path = "data/linux_docs_cls/train.jsonl"
  c.data.test_path = "data/linux_docs_cls/test.csv"
  c.data.max_len = 128
  c.train.epochs = 4
  c.train.batch_size = 32
  c.train.head_learning_rate = 3e-3
  c.train.body_learning_rate = 1e-3   # a tiny model pretrained briefly: large steps help
  return c
