"""The LM head + cross-entropy of the training step, forward + backward, in its forms.

Times `umoe_jax.ops.chunked_loss.chunked_token_nll` (the gradient of the nll sum with respect to
the hidden states and the head) at the trainer's shape, bf16, for each form asked: the fused head
(one chunk, the logits kept: `train.fused_loss_head`, the default) and the chunked head
(`train.loss_chunk_tokens`). First checks every form against the first (loss, dh, dw; relative
error) on fresh random inputs (never zeros), then reports the median wall time of `--iters` calls
after warm-ups. (A one-pass log-sum-exp, the forms "*_online" of ecc739e, is no faster on an H200:
docs/history/benchmarks-2026.md.) Each checked form is also a row of --results
(bench/results.py: default $OUT/rows.jsonl when $OUT is set, else bench/results/<device>.jsonl; none:
no rows), against the first form of the command.

  python bench/loss_head.py [--tokens=32768] [--d_model=768] [--vocab=32000] [--iters=20]
      [--forms=fused,chunked] [--chunk_tokens=4096] [--out=$OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."),
                os.path.dirname(os.path.abspath(__file__))]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import results  # noqa: E402  (bench/results.py)
import timing  # noqa: E402  (bench/timing.py)
from checks import rel_err  # noqa: E402
from umoe_jax.ops.chunked_loss import chunked_token_nll  # noqa: E402

FORMS = ("fused", "chunked")


def form_kwargs(form: str, tokens: int, chunk_tokens: int) -> dict:
  if form not in FORMS:
    raise ValueError(f"unknown form {form!r}; valid: {', '.join(FORMS)}")
  chunked = form == "chunked"
  return dict(chunk_tokens=chunk_tokens if chunked else tokens, keep_logits=not chunked)


def make_inputs(tokens: int, d_model: int, vocab: int, seed: int = 0):
  """h [N, D] bf16 of unit scale, w [D, V] bf16 giving logits of a few units, targets [N]."""
  k = jax.random.split(jax.random.key(seed), 3)
  h = jax.random.normal(k[0], (tokens, d_model), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(k[1], (d_model, vocab), jnp.float32) * (2.0 / d_model ** 0.5)
       ).astype(jnp.bfloat16)
  targets = jax.random.randint(k[2], (tokens,), 0, vocab)
  return h, w, targets


def loss_and_grads_fn(form: str, tokens: int, chunk_tokens: int):
  kw = form_kwargs(form, tokens, chunk_tokens)

  def f(h, w, targets):
    nll = lambda h, w: chunked_token_nll(h, w, targets, None, **kw)[0] / tokens
    return jax.value_and_grad(nll, argnums=(0, 1))(h, w)
  return jax.jit(f)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--tokens", type=int, default=32 * 1024)
  ap.add_argument("--d_model", type=int, default=768)
  ap.add_argument("--vocab", type=int, default=32000)
  ap.add_argument("--chunk_tokens", type=int, default=4096)
  ap.add_argument("--forms", default=",".join(FORMS))
  ap.add_argument("--iters", type=int, default=20)
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--out", default="")
  results.add_flag(ap)
  args = ap.parse_args(argv)
  forms = [f for f in args.forms.split(",") if f]
  for f in forms:
    form_kwargs(f, args.tokens, args.chunk_tokens)   # a bad name fails before any compile
  h, w, targets = make_inputs(args.tokens, args.d_model, args.vocab)
  rows, ref = [], None
  for form in forms:
    fn = loss_and_grads_fn(form, args.tokens, args.chunk_tokens)
    loss, (dh, dw) = fn(h, w, targets)
    jax.block_until_ready(dw)
    if ref is None:
      ref = (loss, dh, dw)
    errs = dict(loss=rel_err(loss, ref[0]), dh=rel_err(dh, ref[1]), dw=rel_err(dw, ref[2]))
    ok = all(np.isfinite(v) and v < 1e-2 for v in errs.values()) and bool(np.isfinite(loss))
    ms = timing.wall_ms(fn, h, w, targets, iters=args.iters, warmup=args.warmup)
    rows.append(dict(form=form, ms=ms, loss=float(loss),
                     errors_vs_first=errs, check=ok, tokens=args.tokens, d_model=args.d_model,
                     vocab=args.vocab, chunk_tokens=args.chunk_tokens,
                     device=jax.devices()[0].device_kind))
    print(f"{form:>16}: {rows[-1]['ms']:8.3f} ms  loss {float(loss):.6f}  rel. err vs {forms[0]}: "
          f"loss {errs['loss']:.1e} dh {errs['dh']:.1e} dw {errs['dw']:.1e}  {'ok' if ok else 'FAILED'}",
          flush=True)
    if ok:
      first = rows[0]
      results.record(args.results, f"loss_head:{args.tokens}x{args.d_model}x{args.vocab}", "ms",
                     rows[-1]["ms"], overrides={"form": form},
                     anchor=None if form == first["form"] else results.anchor(
                         f"{first['form']} head, same command", first["ms"], "ms", "bench/loss_head.py"),
                     extra={"chunk_tokens": args.chunk_tokens} if form == "chunked" else None)
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "loss_head.json"), "w") as f:
      json.dump(rows, f, indent=1)
  return 0 if all(r["check"] for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
