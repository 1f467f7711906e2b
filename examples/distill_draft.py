"""Distill a small draft model for SmolLM2-135M-Instruct (speculative decoding), on a CPU.

Stages, each reading the files earlier ones wrote to --work-dir:
  generate     the teacher's own greedy answers to the chat prompts of `chat_prompts.py`
               (--split train: the SeqKD data; --split eval: held-out answers to validate on)
  corpus       natural text from an installed package (the CPython documentation's pydoc
               topics), cut into sequences: the word-level KD arm's data
  soft-labels  the teacher's top-20 next-token log-probabilities at every position of a data set
               (prompt logprobs through jinfer itself): the word-level KD targets
  train        a draft of --layers of the teacher's layers, its embedding and head frozen and
               shared, over a vocabulary of the --draft-vocab-size most frequent training
               tokens; --method seqkd (the teacher's tokens) or kd (its top-20 distribution)
  accept       acceptance per position and tokens per step of a trained draft in the engine, on
               held-out chat prompts (greedy)

    python examples/distill_draft.py generate --split train
    python examples/distill_draft.py generate --split eval --num-prompts 64
    python examples/distill_draft.py corpus
    python examples/distill_draft.py soft-labels --data pydoc
    python examples/distill_draft.py train --method seqkd --data train --out DIR
    python examples/distill_draft.py train --method kd --data pydoc --out DIR
    python examples/distill_draft.py accept --draft DIR

`train` logs the loss and, every --eval-every steps, the validation agreement: how often the
draft's top token is the teacher's greedy next token on the held-out answers (the acceptance of
a first greedy draft, teacher-forced). Its checkpoint is the trained layers, final norm and
vocabulary in bf16, with `train_log.json` beside it.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from chat_prompts import eval_prompts, train_prompts  # noqa: E402
from teacher_answers import generate_answers, load_seqs, save_seqs  # noqa: E402

from jinfer.weights.builtin import cache_dir  # noqa: E402

log = logging.getLogger("distill")
TEACHER = "smollm2-135m-instruct"
TOP_N = 20  # teacher logprobs kept per position (the engine's MAX_LOGPROBS)


def _path(args, name: str) -> str:
  os.makedirs(args.work_dir, exist_ok=True)
  return os.path.join(args.work_dir, name)


def cmd_generate(args):
  """Greedy teacher answers, saved every chunk so an interrupted run resumes."""
  prompts = (train_prompts() if args.split == "train" else eval_prompts())[:args.num_prompts]
  generate_answers(TEACHER, prompts, _path(args, f"{args.split}.npz"), args.max_tokens,
                   args.chunk)


def cmd_corpus(args):
  """The pydoc topics of the CPython documentation, in sequences of --seq-len tokens."""
  import pydoc_data.topics
  from jinfer.tokenizer import Tokenizer
  from jinfer.weights.builtin import builtin_gguf_path
  tok = Tokenizer.from_gguf(builtin_gguf_path(TEACHER))
  seqs = []
  for name in sorted(pydoc_data.topics.topics):
    ids = tok.encode(pydoc_data.topics.topics[name], add_special_tokens=False)
    seqs += [np.asarray(ids[i:i + args.seq_len], np.int32)
             for i in range(0, len(ids) - 16, args.seq_len)]
  save_seqs(_path(args, "pydoc.npz"), seqs, [1] * len(seqs))
  log.info("%d sequences, %d tokens", len(seqs), sum(map(len, seqs)))


def cmd_soft_labels(args):
  """Top-20 teacher log-probabilities of the next token at every position of --data."""
  from jinfer import LLM, SamplingParams
  seqs, _ = load_seqs(_path(args, f"{args.data}.npz"))
  seqs = seqs[:args.num_seqs]  # the first ones: `train --method kd` trains on those
  llm = LLM(TEACHER, max_model_len=max(map(len, seqs)) + 16, max_num_seqs=16,
            enable_prompt_logprobs=True)
  ids, lps = [], []
  t0 = time.monotonic()
  for start in range(0, len(seqs), 64):
    outs = llm.generate([s.tolist() for s in seqs[start:start + 64]],
                        SamplingParams(max_tokens=1, prompt_logprobs=TOP_N), use_tqdm=False)
    for o in outs:
      for entry in o.prompt_logprobs[1:]:  # entry p: the distribution of token p given < p
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:TOP_N]
        ids.append([t for t, _ in top])
        lps.append([lp for _, lp in top])
    log.info("%d/%d sequences, %.0f s", start + len(outs), len(seqs), time.monotonic() - t0)
  np.savez(_path(args, f"{args.data}_soft.npz"), ids=np.asarray(ids, np.int32),
           logprobs=np.asarray(lps, np.float32))


def cmd_train(args):
  import jax
  from jinfer.training.distill import (DistillConfig, Trainer, draft_vocab, init_draft,
                                   sequence_targets)
  from jinfer.engine.speculative.draft_checkpoint import save_draft
  from jinfer.loader import load_model

  seqs, starts = load_seqs(_path(args, f"{args.data}.npz"))
  config, params, tok = load_model(TEACHER)
  # The vocabulary comes from the whole data set, whatever part of it is trained on.
  trained = np.concatenate([s[st:] for s, st in zip(seqs, starts)])
  vocab = draft_vocab(np.bincount(trained, minlength=config.vocab_size), args.draft_vocab_size,
                      always=tuple(tok.eos_token_ids))
  soft = None
  if args.method == "kd":
    d = np.load(_path(args, f"{args.data}_soft.npz"))
    ends = np.cumsum([len(s) - 1 for s in seqs])
    soft = list(zip(np.split(d["ids"], ends[:-1]), np.split(d["logprobs"], ends[:-1])))
    # Soft labels may cover only the first sequences (soft-labels --num-seqs).
    covered = int(np.searchsorted(ends, len(d["ids"]), side="right"))
    seqs, starts, soft = seqs[:covered], starts[:covered], soft[:covered]
    log.info("KD on the %d sequences with soft labels", covered)
  val_seqs, val_starts = load_seqs(_path(args, "eval.npz"))
  cover = np.isin(np.concatenate([s[st:] for s, st in zip(val_seqs, val_starts)]), vocab).mean()
  log.info("vocabulary %d: %.1f%% of held-out answer tokens", len(vocab), 100 * cover)
  layers = tuple(int(x) for x in args.layers.split(","))
  cfg = DistillConfig(layers=layers, draft_vocab_size=args.draft_vocab_size,
                      seq_len=args.seq_len, batch_size=args.batch_size,
                      learning_rate=args.learning_rate, steps=args.steps)
  dconf, own = init_draft(config, params, layers)
  trainer = Trainer(dconf, cfg, own, params["embedding"], vocab)
  val = sequence_targets(val_seqs, val_starts, vocab, cfg.seq_len)

  def validate() -> float:
    hit = total = 0
    for i in range(0, len(val_seqs), cfg.batch_size):
      h, n = trainer.agreement(*(a[i:i + cfg.batch_size] for a in val))
      hit, total = hit + h, total + n
    return hit / total

  rng = np.random.default_rng(0)
  history = {"step": [], "loss": [], "val_step": [], "val_agreement": [], "seconds": []}
  history["val_step"].append(0)
  history["val_agreement"].append(validate())
  log.info("step 0: validation agreement %.3f", history["val_agreement"][-1])
  t0 = time.monotonic()
  for step in range(1, cfg.steps + 1):
    pick = rng.choice(len(seqs), cfg.batch_size, replace=False)
    batch = sequence_targets([seqs[i] for i in pick], [starts[i] for i in pick], vocab,
                             cfg.seq_len, [soft[i] for i in pick] if soft else None)
    loss = trainer.step(*batch)
    history["step"].append(step)
    history["loss"].append(loss)
    history["seconds"].append(time.monotonic() - t0)
    if step % args.log_every == 0:
      log.info("step %d: loss %.4f (mean of the last %d: %.4f), %.0f s", step, loss,
               args.log_every, np.mean(history["loss"][-args.log_every:]),
               time.monotonic() - t0)
    if step % args.eval_every == 0 or step == cfg.steps:
      history["val_step"].append(step)
      history["val_agreement"].append(validate())
      log.info("step %d: validation agreement %.3f", step, history["val_agreement"][-1])
  meta = {"teacher": TEACHER, "teacher_layers": list(layers), "num_layers": len(layers),
          "draft_vocab_size": len(vocab), "method": args.method, "data": args.data,
          "steps": cfg.steps, "batch_size": cfg.batch_size, "seq_len": cfg.seq_len,
          "learning_rate": cfg.learning_rate, "train_seconds": history["seconds"][-1],
          **{k: getattr(config, k) for k in ("hidden_size", "vocab_size", "num_heads",
                                             "num_kv_heads", "head_dim")}}
  save_draft(args.out, {**jax.device_get(trainer.own), "vocab": vocab}, meta)
  with open(os.path.join(args.out, "train_log.json"), "w") as fh:
    json.dump({**meta, "vocab_coverage_of_eval_answers": float(cover), **history}, fh)
  log.info("saved %s", args.out)


def cmd_accept(args):
  """Greedy speculative decoding of held-out chat prompts with the draft: acceptance."""
  from jinfer import LLM, SamplingParams
  llm = LLM(TEACHER, max_model_len=512, max_num_seqs=args.batch_size, warmup=False,
            speculative_config={"method": "draft_model", "model": args.draft,
                                "num_speculative_tokens": args.k})
  prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                               add_generation_prompt=True, tokenize=True)
             for p in eval_prompts(args.num_prompts)]
  t0 = time.monotonic()
  llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens),
               use_tqdm=False)
  summary = {"k": args.k, "num_prompts": len(prompts), "max_tokens": args.max_tokens,
             "wall_s": time.monotonic() - t0, **llm.engine.stats().spec.summary()}
  print(json.dumps(summary, indent=2))
  with open(os.path.join(args.draft, f"accept_k{args.k}.json"), "w") as fh:
    json.dump(summary, fh, indent=2)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--work-dir", default=os.path.join(cache_dir(), "distill"))
  sub = ap.add_subparsers(dest="stage", required=True)
  p = sub.add_parser("generate", help=cmd_generate.__doc__)
  p.add_argument("--split", choices=("train", "eval"), default="train")
  p.add_argument("--num-prompts", type=int, default=None)
  p.add_argument("--max-tokens", type=int, default=256)
  p.add_argument("--chunk", type=int, default=128)
  p.set_defaults(fn=cmd_generate)
  p = sub.add_parser("corpus", help=cmd_corpus.__doc__)
  p.add_argument("--seq-len", type=int, default=320)
  p.set_defaults(fn=cmd_corpus)
  p = sub.add_parser("soft-labels", help=cmd_soft_labels.__doc__)
  p.add_argument("--data", default="pydoc", help="train, eval or pydoc")
  p.add_argument("--num-seqs", type=int, default=None, help="label only the first N sequences")
  p.set_defaults(fn=cmd_soft_labels)
  p = sub.add_parser("train", help="train a draft (see above)")
  p.add_argument("--method", choices=("seqkd", "kd"), required=True)
  p.add_argument("--data", default="train", help="train (teacher answers) or pydoc")
  p.add_argument("--layers", default="0,1,28,29", help="the teacher's layers to start from")
  p.add_argument("--draft-vocab-size", type=int, default=8192)
  p.add_argument("--seq-len", type=int, default=320)
  p.add_argument("--batch-size", type=int, default=4)
  p.add_argument("--learning-rate", type=float, default=3e-4)
  p.add_argument("--steps", type=int, default=1000)
  p.add_argument("--log-every", type=int, default=10)
  p.add_argument("--eval-every", type=int, default=100)
  p.add_argument("--out", required=True)
  p.set_defaults(fn=cmd_train)
  p = sub.add_parser("accept", help=cmd_accept.__doc__)
  p.add_argument("--draft", required=True)
  p.add_argument("--k", type=int, default=4)
  p.add_argument("--num-prompts", type=int, default=16)
  p.add_argument("--max-tokens", type=int, default=128)
  p.add_argument("--batch-size", type=int, default=16)
  p.set_defaults(fn=cmd_accept)
  args = ap.parse_args()
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", force=True)
  args.fn(args)


if __name__ == "__main__":
  main()
