"""SST-2 (GLUE): binary sentiment of movie-review sentences.

GLUE's SST-2 folder: train.tsv and dev.tsv with a header `sentence<TAB>label` (label 0 = negative,
1 = positive), test.tsv `index<TAB>sentence` without labels. As usual the labelled GLUE dev set is
the test split here and a dev split is carved from train.tsv (5%).

  python -m umoe_jax.finetune --config=configs/finetune/sst2.py --workdir=runs/sst2 \
      --config.init_from=runs/umoe_base --config.data.tokenizer=/data/llama2/tokenizer.json
  python -m umoe_jax.finetune predict --checkpoint=runs/sst2 --input=glue_data/SST-2/test.tsv \
      --output=runs/sst2/test_predictions.csv
"""
from umoe_jax.finetune.config import default_config


def get_config():
  c = default_config()
  c.data.train_path = "glue_data/SST-2/train.tsv"
  c.data.test_path = "glue_data/SST-2/dev.tsv"
  c.data.text_field = "sentence"
  c.data.label_field = "label"
  c.data.dev_fraction = 0.05
  c.data.max_len = 128
  c.train.epochs = 3
  c.train.batch_size = 32
  c.train.head_learning_rate = 1e-3
  c.train.body_learning_rate = 3e-5
  return c
