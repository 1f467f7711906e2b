"""Train Medusa-1 heads for SmolLM2-135M-Instruct by self-distillation, on a CPU.

Stages, each reading the files earlier ones wrote to --work-dir:
  generate  the target's own greedy answers to the chat prompts of `chat_prompts.py`
            (--split train: the training data; --split eval: held-back answers to evaluate on)
  hidden    one pass of the frozen target over each (prompt + answer): the final hidden states
            (after the final norm, what the LM head reads) at the answer positions, cached
  train     heads on the cached hidden states (`jinfer/training/medusa_train.py`)
  eval      per-head top-1 / top-5 accuracy of saved heads on the held-back answers

    python examples/train_medusa.py generate --split train --max-tokens 256
    python examples/train_medusa.py generate --split eval --num-prompts 64 --max-tokens 192
    python examples/train_medusa.py hidden
    python examples/train_medusa.py train --steps 5000 --eval-every 500 \
      --out checkpoints/smollm2-135m-medusa
    python examples/train_medusa.py eval --heads checkpoints/smollm2-135m-medusa
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
from teacher_answers import generate_answers, load_seqs  # noqa: E402

from jinfer.weights.builtin import cache_dir  # noqa: E402

log = logging.getLogger("medusa")
TARGET = "smollm2-135m-instruct"


def _path(args, name: str) -> str:
  os.makedirs(args.work_dir, exist_ok=True)
  return os.path.join(args.work_dir, name)


def cmd_generate(args):
  """Greedy target answers, saved every chunk so an interrupted run resumes."""
  prompts = (train_prompts() if args.split == "train" else eval_prompts())[:args.num_prompts]
  generate_answers(TARGET, prompts, _path(args, f"{args.split}.npz"), args.max_tokens,
                   args.chunk)


def _load_hidden(args, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(hidden [N, E] float32, answer tokens [N], sequence offsets [S + 1]) of a split."""
  d = np.load(_path(args, f"{split}_tokens.npz"))
  hidden = np.load(_path(args, f"{split}_hidden.npy")).astype(np.float32)
  return hidden, d["tokens"], d["offsets"]


def cmd_hidden(args):
  """The frozen target's final hidden states at every answer position, cached (float16)."""
  from jinfer.training.medusa_train import answer_hidden
  from jinfer.loader import load_model
  config, params, _ = load_model(TARGET, load_tokenizer=False)
  for split in args.splits.split(","):
    seqs, starts = load_seqs(_path(args, f"{split}.npz"))
    t0 = time.monotonic()
    rows = []
    for i, h in enumerate(answer_hidden(config, params, seqs, starts)):
      rows.append(h.astype(np.float16))
      if (i + 1) % 50 == 0:
        log.info("%s: %d/%d sequences, %.0f s", split, i + 1, len(seqs), time.monotonic() - t0)
    answers = [s[st:] for s, st in zip(seqs, starts)]
    np.save(_path(args, f"{split}_hidden.npy"), np.concatenate(rows))
    np.savez(_path(args, f"{split}_tokens.npz"), tokens=np.concatenate(answers).astype(np.int32),
             offsets=np.cumsum([0] + [len(a) for a in answers]))
    # The target's own head on the cached states must give back its greedy answer: a check that
    # rows and tokens line up (up to float16 storage and the engine's kernels).
    emb = np.asarray(params["embedding"], np.float32)
    probe = np.concatenate(rows[:16]).astype(np.float32)
    agree = float(np.mean(np.argmax(probe @ emb.T, -1) == np.concatenate(answers[:16])))
    log.info("%s: %d answer tokens in %.0f s; the LM head's top-1 on the cached states matches "
             "the answer %.4f of the time", split, sum(map(len, answers)),
             time.monotonic() - t0, agree)


def cmd_train(args):
  import jax
  import jax.numpy as jnp
  from jinfer.training.distill import draft_vocab
  from jinfer.engine.speculative.medusa_heads import init_heads, save_heads
  from jinfer.training.medusa_train import (MedusaTrainConfig, MedusaTrainer, head_targets,
                                        vocab_index)
  from jinfer.loader import load_model

  config, tparams, tok = load_model(TARGET)
  hidden, tokens, offsets = _load_hidden(args, "train")
  val_hidden, val_tokens, val_offsets = _load_hidden(args, "eval")
  vocab = draft_vocab(np.bincount(tokens, minlength=config.vocab_size), args.vocab_size,
                      always=tuple(tok.eos_token_ids))
  cover = float(np.isin(val_tokens, vocab).mean())
  log.info("%d train rows, %d eval rows; vocabulary %d: %.1f%% of held-back answer tokens",
           len(tokens), len(val_tokens), len(vocab), 100 * cover)
  cfg = MedusaTrainConfig(num_heads=args.num_heads, num_layers=args.num_layers,
                          batch_size=args.batch_size, learning_rate=args.learning_rate,
                          weight_decay=args.weight_decay, warmup_steps=args.warmup_steps,
                          steps=args.steps)
  heads = {**init_heads(cfg.num_heads, config.hidden_size, cfg.num_layers), "vocab": vocab}
  trainer = MedusaTrainer(cfg, heads, tparams["embedding"])
  targets = vocab_index(head_targets(tokens, offsets, cfg.num_heads), vocab)  # [N, H]
  # Rows none of whose heads has a target in the vocabulary teach nothing.
  usable = np.flatnonzero((targets >= 0).any(1))
  dev_hidden, dev_targets = jnp.asarray(hidden), jnp.asarray(targets)
  del hidden
  val_targets = head_targets(val_tokens, val_offsets, cfg.num_heads)  # token ids: full vocab
  val_vi = vocab_index(val_targets, vocab)

  # Every step's loss; the per-head CE as a mean over each --log-every window.
  history = {"step": [], "loss": [], "seconds": [], "log_step": [], "head_ce": [], "eval_step": [],
             "eval_loss": [], "eval_top1": [], "eval_top5": []}

  def evaluate(step: int) -> dict:
    acc = trainer.evaluate(val_hidden, val_targets)
    loss, _ = trainer.loss(val_hidden, val_vi)
    for k, v in (("eval_step", step), ("eval_loss", loss), ("eval_top1", acc["top1"]),
                 ("eval_top5", acc["top5"])):
      history[k].append(v)
    log.info("step %d: eval loss %.4f, top-1 %s, top-5 %s", step, loss,
             " ".join(f"{x:.3f}" for x in acc["top1"]), " ".join(f"{x:.3f}" for x in acc["top5"]))
    return acc

  evaluate(0)
  rng = np.random.default_rng(args.seed)
  t0 = time.monotonic()
  window = []
  for step in range(1, cfg.steps + 1):
    loss, ce = trainer.step(dev_hidden, dev_targets, rng.choice(usable, cfg.batch_size))
    history["step"].append(step)
    history["loss"].append(loss)
    history["seconds"].append(time.monotonic() - t0)
    window.append(ce)
    if step % args.log_every == 0:
      ce = np.mean(window, 0)
      window = []
      history["log_step"].append(step)
      history["head_ce"].append(ce.tolist())
      log.info("step %d: loss %.4f (mean of the last %d: %.4f), head CE %s, %.0f s", step, loss,
               args.log_every, np.mean(history["loss"][-args.log_every:]),
               " ".join(f"{x:.3f}" for x in ce), time.monotonic() - t0)
    if step % args.eval_every == 0 and step != cfg.steps:
      evaluate(step)
  # The checkpoint stores bf16: the final numbers are those of the heads as stored.
  trainer.trained = jax.tree.map(lambda a: a.astype(jnp.bfloat16).astype(jnp.float32),
                                 trainer.trained)
  acc = evaluate(cfg.steps)
  meta = {"target": TARGET, "hidden_size": config.hidden_size, "vocab_size": config.vocab_size,
          "num_heads": cfg.num_heads, "num_layers": cfg.num_layers, "head_vocab_size": len(vocab),
          "recipe": {k: v for k, v in vars(args).items() if k not in ("fn", "work_dir")},
          "eval": {k: acc[k] for k in ("top1", "top5", "rank_hits")},
          "train_tokens": int(len(tokens)), "eval_tokens": int(len(val_tokens)),
          "train_sequences": int(len(offsets) - 1), "eval_sequences": int(len(val_offsets) - 1),
          "vocab_coverage_of_eval_answers": cover,
          "final_loss": float(np.mean(history["loss"][-args.log_every:])),
          "train_seconds": history["seconds"][-1]}
  save_heads(args.out, jax.device_get(trainer.params), meta)
  with open(os.path.join(args.out, "train_log.json"), "w") as fh:
    json.dump({**meta, **history}, fh)
  log.info("saved %s", args.out)


def cmd_eval(args):
  """Per-head top-1 / top-5 (and rank histogram) of saved heads on the held-back answers."""
  import jax
  from jinfer.engine.speculative.medusa_heads import load_heads, top_candidates, with_rows
  from jinfer.training.medusa_train import RANKS, accuracy, head_targets
  from jinfer.loader import load_model
  config, tparams, _ = load_model(TARGET, load_tokenizer=False)
  params, meta = load_heads(args.heads, config)
  params = with_rows(params, tparams["embedding"])
  hidden, tokens, offsets = _load_hidden(args, "eval")
  cand = jax.jit(lambda p, h: top_candidates(p, h, RANKS))
  acc = accuracy(lambda h: cand(params, h), hidden,
                 head_targets(tokens, offsets, params["w"].shape[0]))
  print(json.dumps({"heads": args.heads, "eval_tokens": int(len(tokens)), **acc}, indent=2))


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--work-dir", default=os.path.join(cache_dir(), "medusa"))
  sub = ap.add_subparsers(dest="stage", required=True)
  p = sub.add_parser("generate", help=cmd_generate.__doc__)
  p.add_argument("--split", choices=("train", "eval"), default="train")
  p.add_argument("--num-prompts", type=int, default=None)
  p.add_argument("--max-tokens", type=int, default=192)
  p.add_argument("--chunk", type=int, default=128)
  p.set_defaults(fn=cmd_generate)
  p = sub.add_parser("hidden", help=cmd_hidden.__doc__)
  p.add_argument("--splits", default="train,eval")
  p.set_defaults(fn=cmd_hidden)
  p = sub.add_parser("train", help="train heads on the cached hidden states (see above)")
  p.add_argument("--num-heads", type=int, default=4)
  p.add_argument("--num-layers", type=int, default=1)
  p.add_argument("--vocab-size", type=int, default=8192, help="the heads' vocabulary (FR-Spec)")
  p.add_argument("--batch-size", type=int, default=256, help="hidden-state rows per step")
  p.add_argument("--learning-rate", type=float, default=1e-3)
  p.add_argument("--weight-decay", type=float, default=0.0)
  p.add_argument("--warmup-steps", type=int, default=20)
  p.add_argument("--steps", type=int, default=1000)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--log-every", type=int, default=50)
  p.add_argument("--eval-every", type=int, default=250)
  p.add_argument("--out", required=True)
  p.set_defaults(fn=cmd_train)
  p = sub.add_parser("eval", help=cmd_eval.__doc__)
  p.add_argument("--heads", required=True)
  p.set_defaults(fn=cmd_eval)
  args = ap.parse_args()
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", force=True)
  logging.getLogger("absl").setLevel(logging.WARNING)  # orbax narrates every save
  args.fn(args)


if __name__ == "__main__":
  main()
