#!/bin/bash
# FP8 fidelity (issue 45, item 4): a family's base model trained in bf16 and in fp8 from one seed,
# STEPS steps of 16 x 1024 GPT-2 tokens of the linux-docs corpus, all runs side by side on one GPU
# (their step times are not comparable; their losses are). Each run's metrics.jsonl (and config)
# goes to OUT/<family>_<precision>/; the last lines compare the held-out losses, and
#   python3 -m umoe_jax.plot OUT/umoe_bf16 OUT/umoe_fp8 --baseline=OUT/umoe_bf16 --out=plots/fp8
# draws the curves and the fp8 run's loss relative to bf16's (the runs of docs/training.md are in
# bench/results/fp8_fidelity/).
#
#   tools/fp8_fidelity.sh "umoe ffn_moe" [STEPS=2000] [MEM_FRACTION=0.22]
#
# DATA (default ../shared/data) holds corpora/linux-docs/ and tokenizers/gpt2/tokenizer.json;
# OUT defaults to ./fp8_fidelity, the workdirs to RUNS (default /tmp/fp8_fidelity_runs); EXTRA adds
# flags to every run (e.g. EXTRA=--config.model.gmm_backend=triton for the FP8 kernel).
set -u
FAMILIES=$1; STEPS=${2:-2000}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${3:-0.22}
DATA=${DATA:-../shared/data}; OUT=${OUT:-fp8_fidelity}; RUNS=${RUNS:-/tmp/fp8_fidelity_runs}
for f in "$DATA/corpora/linux-docs/train-00000-of-00001.parquet" "$DATA/tokenizers/gpt2/tokenizer.json"; do
  [ -f "$f" ] || { echo "error: $f not found (set DATA to the shared data directory)" >&2; exit 1; }
done
mkdir -p "$OUT"
D="--config.data.source=parquet --config.data.train_path=$DATA/corpora/linux-docs/train-00000-of-00001.parquet
   --config.data.eval_path=$DATA/corpora/linux-docs/validation-00000-of-00001.parquet
   --config.data.tokenizer=$DATA/tokenizers/gpt2/tokenizer.json --config.model.vocab_size=50304
   --config.train.global_batch_size=16 --config.train.seq_len=1024 --config.train.grad_accum_steps=1
   --config.train.remat=none --config.train.num_steps=$STEPS --config.train.log_every=25
   --config.train.eval_every=250 --config.train.eval_batches=7 --config.checkpoint.every=100000
   --config.checkpoint.keep=1"
for FAMILY in $FAMILIES; do for P in bf16 fp8; do
  python3 train.py --config=configs/${FAMILY}_base.py --workdir=$RUNS/${FAMILY}_$P $D ${EXTRA:-} \
      --config.train.precision=$P > $OUT/${FAMILY}_$P.log 2>&1 &
done; done
wait
for FAMILY in $FAMILIES; do
  for P in bf16 fp8; do
    mkdir -p $OUT/${FAMILY}_$P && cp $RUNS/${FAMILY}_$P/metrics.jsonl $RUNS/${FAMILY}_$P/config.json $OUT/${FAMILY}_$P/
  done
  echo "== $FAMILY: held-out loss, bf16 and fp8"
  python3 - $OUT/${FAMILY}_bf16/metrics.jsonl $OUT/${FAMILY}_fp8/metrics.jsonl <<'PY'
import json, sys
ev = [{r["step"]: r["eval/loss"] for r in map(json.loads, open(p)) if "eval/loss" in r} for p in sys.argv[1:]]
for s in sorted(set(ev[0]) & set(ev[1])):
  print(f"step {s:5d}  bf16 {ev[0][s]:.4f}  fp8 {ev[1][s]:.4f}  fp8 / bf16 - 1 {ev[1][s] / ev[0][s] - 1:+.3%}")
PY
done
