"""Training Medusa-1 heads (`medusa_heads.py`) by self-distillation: the target frozen, its own
greedy text as the data, only the heads' residual blocks trained.

The backbone never changes, so its final hidden states (after the final norm: what the LM head
reads) are computed once per sequence and cached; training then touches only the heads, a few
E x E blocks and a projection onto the frozen, shared LM head rows of the restricted vocabulary.

Row r of a cached sequence is the hidden state at the position that predicts its answer token r
(the prompt's last position for r = 0); head k (0-based) is trained on answer token r + k + 1,
i.e. the token k + 2 positions after the hidden state's own. The loss is Medusa-1's
sum_k 0.8**k CE_k, each head's cross-entropy over the heads' vocabulary, averaged over the rows
whose target exists (inside the sequence) and lies in that vocabulary.

Run as a module, it trains heads for SmolLM2-135M-Instruct on a CPU (the recipe of
`checkpoints/smollm2-135m-medusa`), in stages, each reading the files earlier ones wrote to
--work-dir:
  generate  the target's own greedy answers to the chat prompts of `chat_data.py`
            (--split train: the training data; --split eval: held-back answers to evaluate on)
  hidden    one pass of the frozen target over each (prompt + answer): the final hidden states
            (after the final norm, what the LM head reads) at the answer positions, cached
  train     heads on the cached hidden states (`MedusaTrainer`)
  eval      per-head top-1 / top-5 accuracy of saved heads on the held-back answers

    python -m jinfer.training.medusa_train generate --split train --max-tokens 256
    python -m jinfer.training.medusa_train generate --split eval --num-prompts 64 --max-tokens 192
    python -m jinfer.training.medusa_train hidden
    python -m jinfer.training.medusa_train train --steps 5000 --eval-every 500 \
      --out checkpoints/smollm2-135m-medusa
    python -m jinfer.training.medusa_train eval --heads checkpoints/smollm2-135m-medusa
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jinfer.config import ModelConfig
from jinfer.models import CausalLM
from jinfer.models.kernel_options import KernelOptions
from jinfer.engine.speculative.medusa_heads import (head_logits, init_heads, load_heads, save_heads,
                                                    top_candidates, with_rows)
from jinfer.loader import load_model
from jinfer.training.chat_data import eval_prompts, generate_answers, load_seqs, train_prompts
from jinfer.training.distill import _forward, draft_vocab
from jinfer.weights.builtin import cache_dir

RANKS = 10  # candidates per head the rank histogram covers
DECAY = 0.8  # Medusa-1's per-head loss weight: head k counts 0.8**k


@dataclasses.dataclass(frozen=True, kw_only=True)
class MedusaTrainConfig:
  num_heads: int = 4
  num_layers: int = 1
  batch_size: int = 256  # hidden-state rows per step
  learning_rate: float = 1e-3
  weight_decay: float = 0.0
  warmup_steps: int = 20
  steps: int = 1000


# -- data -------------------------------------------------------------------------------------
def answer_hidden(config: ModelConfig, params: dict, seqs: list[np.ndarray], starts: list[int],
                  bucket: int = 64, page_size: int = 16):
  """Yields, per sequence, the target's final hidden states [n, E] float32 at the positions
  starts - 1 .. len - 2 (those that predict the answer's n = len - starts tokens). The dense
  `reference` attention over a scratch paged cache, one sequence per call, padded at the end to
  a multiple of `bucket` (causal: the padding never reaches a real position; few compiles)."""
  model = CausalLM(config, KernelOptions(attention="reference"), dtype=jnp.float32)
  own = {k: v for k, v in params.items() if k != "embedding"}
  # Only the hidden states are used, so XLA drops the LM head from the compiled forward.
  fwd = jax.jit(functools.partial(_forward, model, page_size))
  for s, start in zip(seqs, starts):
    length = -(-len(s) // bucket) * bucket
    tokens = np.zeros((1, length), np.int32)  # [1, L]
    tokens[0, :len(s)] = s
    hidden = np.asarray(fwd(own, params["embedding"], jnp.asarray(tokens)))[0]  # [L, E]
    yield hidden[start - 1:len(s) - 1]


def head_targets(tokens: np.ndarray, offsets: np.ndarray, num_heads: int) -> np.ndarray:
  """Answer tokens [N] of sequences cut at `offsets` [S + 1] -> each row's target token per head
  [N, H] int32 (row r, head k: token r + k + 1 of the same answer), -1 past the answer's end."""
  n = len(tokens)
  seq_end = np.repeat(offsets[1:], np.diff(offsets))  # [N] where each row's sequence ends
  out = np.full((n, num_heads), -1, np.int32)
  for k in range(num_heads):
    src = np.arange(n) + k + 1
    ok = src < seq_end
    out[ok, k] = tokens[src[ok]]
  return out


def vocab_index(targets: np.ndarray, vocab: np.ndarray) -> np.ndarray:
  """Target token ids (-1: none) -> indices into `vocab`, -1 where none or not in it."""
  index = np.full(int(max(vocab.max(), targets.max())) + 1, -1, np.int32)
  index[vocab] = np.arange(len(vocab), dtype=np.int32)
  return np.where(targets >= 0, index[np.maximum(targets, 0)], -1).astype(np.int32)


# -- loss and metrics -------------------------------------------------------------------------
def head_nll(trained: dict, rows: jax.Array, h: jax.Array,
             target: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(summed negative log-likelihood [H] over the heads' vocabulary, live rows [H]). `trained`
  {"w", "b"}, rows [Vh, E] (the frozen LM head rows), h [B, E], target [B, H] indices into the
  vocabulary (-1: masked)."""
  logits = head_logits({**trained, "rows": jax.lax.stop_gradient(rows)}, h)  # [B, H, Vh]
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  picked = jnp.take_along_axis(logp, jnp.maximum(target, 0)[..., None], axis=-1)[..., 0]
  live = (target >= 0).astype(jnp.float32)  # [B, H]
  return -jnp.sum(live * picked, 0), jnp.sum(live, 0)


def head_losses(trained: dict, rows: jax.Array, h: jax.Array, target: jax.Array) -> jax.Array:
  """Per-head mean cross-entropy [H] (see `head_nll`)."""
  nll, live = head_nll(trained, rows, h, target)
  return nll / jnp.maximum(live, 1.0)


def medusa_loss(trained: dict, rows: jax.Array, h: jax.Array,
                target: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(sum_k 0.8**k CE_k, the per-head CE_k [H])."""
  ce = head_losses(trained, rows, h, target)
  return jnp.sum(DECAY ** jnp.arange(ce.shape[0]) * ce), ce


class MedusaTrainer:
  """AdamW over the heads' residual blocks; the target (its hidden states, LM head rows) frozen.
  The cached hidden states live on the device and each step gathers its batch there."""

  def __init__(self, cfg: MedusaTrainConfig, params: dict, embedding: jax.Array):
    self.cfg = cfg
    self.vocab = np.asarray(params["vocab"], np.int32)
    self.rows = jnp.asarray(embedding, jnp.float32)[jnp.asarray(self.vocab)]  # [Vh, E]
    # Copies: the step donates them.
    self.trained = {k: jnp.array(params[k], jnp.float32, copy=True) for k in ("w", "b")}
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, cfg.warmup_steps,
                                                  max(cfg.steps, cfg.warmup_steps + 1))
    self.optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                                 optax.adamw(schedule, weight_decay=cfg.weight_decay))
    self.opt_state = self.optimizer.init(self.trained)
    self._step = jax.jit(functools.partial(_train_step, self.optimizer), donate_argnums=(0, 1))
    self._nll = jax.jit(head_nll)
    self._ranks = jax.jit(_rank_hits)

  @property
  def params(self) -> dict:
    """The heads as `medusa_heads` takes them: {"w", "b", "vocab"}."""
    return {**jax.device_get(self.trained), "vocab": self.vocab}

  def step(self, hidden: jax.Array, target: jax.Array,
           idx: np.ndarray) -> tuple[float, np.ndarray]:
    """One step on rows `idx` of hidden [N, E] / target [N, H] (vocabulary indices): (loss,
    per-head CE [H])."""
    self.trained, self.opt_state, loss, ce = self._step(
        self.trained, self.opt_state, self.rows, hidden, target, jnp.asarray(idx, jnp.int32))
    return float(loss), np.asarray(ce)

  def loss(self, h: np.ndarray, target: np.ndarray, chunk: int = 2048) -> tuple[float, np.ndarray]:
    """(Medusa loss, per-head CE [H]) over all rows of h [N, E] / target [N, H], in chunks (the
    logits of every row at once would not fit)."""
    nll = live = 0
    for i in range(0, len(h), chunk):
      a, b = self._nll(self.trained, self.rows, jnp.asarray(h[i:i + chunk]),
                       jnp.asarray(target[i:i + chunk]))
      nll, live = nll + np.asarray(a, np.float64), live + np.asarray(b, np.float64)
    ce = nll / np.maximum(live, 1.0)
    return float(np.sum(DECAY ** np.arange(len(ce)) * ce)), ce

  def evaluate(self, hidden: np.ndarray, targets: np.ndarray, chunk: int = 1024) -> dict:
    """Accuracy on hidden [N, E] against target token ids [N, H] (-1: none); see `accuracy`."""
    params = {**self.trained, "rows": self.rows, "vocab": jnp.asarray(self.vocab)}
    return accuracy(lambda h: self._ranks(params, h), hidden, targets, chunk)


def _train_step(optimizer, trained, opt_state, rows, hidden, target, idx):
  h = hidden[idx].astype(jnp.float32)  # [B, E]
  (loss, ce), grads = jax.value_and_grad(medusa_loss, has_aux=True)(trained, rows, h, target[idx])
  updates, opt_state = optimizer.update(grads, opt_state, trained)
  return optax.apply_updates(trained, updates), opt_state, loss, ce


def _rank_hits(params: dict, h: jax.Array) -> jax.Array:
  return top_candidates(params, h.astype(jnp.float32), RANKS)  # [N, H, RANKS] token ids


def accuracy(candidates, hidden: np.ndarray, targets: np.ndarray, chunk: int = 1024) -> dict:
  """Per-head top-1, top-5 and rank_hits[h][i]: the fraction of rows where the true token is the
  head's i-th candidate (i < 10). `candidates(h [n, E]) -> [n, H, 10]` target token ids, best
  first; targets [N, H] token ids, -1 past the answer's end (not counted). A target outside the
  heads' vocabulary counts as a miss: that is what the engine would see."""
  hits = np.zeros((targets.shape[1], RANKS))
  for i in range(0, len(hidden), chunk):
    cand = np.asarray(candidates(jnp.asarray(hidden[i:i + chunk])))  # [n, H, 10]
    t = targets[i:i + chunk]
    hits += ((cand == t[..., None]) & (t[..., None] >= 0)).sum(0)
  total = np.maximum((targets >= 0).sum(0), 1)[:, None]  # [H, 1]
  rank = hits / total
  return {"top1": rank[:, 0].tolist(), "top5": rank[:, :5].sum(1).tolist(),
          "rank_hits": rank.tolist(), "positions": (targets >= 0).sum(0).tolist()}


# -- the pipeline (python -m jinfer.training.medusa_train STAGE) ------------------------------

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
  config, tparams, _ = load_model(TARGET, load_tokenizer=False)
  params, meta = load_heads(args.heads, config)
  params = with_rows(params, tparams["embedding"])
  hidden, tokens, offsets = _load_hidden(args, "eval")
  cand = jax.jit(lambda p, h: top_candidates(p, h, RANKS))
  acc = accuracy(lambda h: cand(params, h), hidden,
                 head_targets(tokens, offsets, params["w"].shape[0]))
  print(json.dumps({"heads": args.heads, "eval_tokens": int(len(tokens)), **acc}, indent=2))


def main():
  ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}",
      description="Train Medusa-1 heads for SmolLM2-135M-Instruct by self-distillation.")
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
