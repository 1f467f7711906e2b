"""Distilling a draft model from its target (the teacher): layer dropping, a frozen shared
embedding and head, a restricted vocabulary, and two losses.

The draft is a few of the teacher's own decoder layers plus its final norm, trained; the
embedding (also the tied LM head) stays the teacher's, frozen and shared, and the head scores
only the draft's vocabulary, the `draft_vocab_size` tokens most frequent in the training data
(FR-Spec / EAGLE-3: on a CPU the 49k-row head costs as much as a dozen layers).

Both losses are a cross-entropy against a sparse target distribution over the draft's vocabulary
at every position: word-level KD (Hinton et al.; Kim & Rush) puts the teacher's top-N next-token
probabilities there, which makes it a forward KL to the teacher; SeqKD (Kim & Rush) trains on
text the teacher generated itself, with its token as the only target.

The forward pass is `CausalLM` itself, with the dense `reference` attention (differentiable:
no loops) over a scratch paged cache with one run of pages per sequence, so the draft is trained
on exactly the function it will run.

Run as a module, it distills a draft for SmolLM2-135M-Instruct on a CPU (the recipe of
`checkpoints/smollm2-135m-draft`), in stages, each reading the files earlier ones wrote to
--work-dir:
  generate     the teacher's own greedy answers to the chat prompts of `chat_data.py`
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

    python -m jinfer.training.distill generate --split train
    python -m jinfer.training.distill generate --split eval --num-prompts 64
    python -m jinfer.training.distill corpus
    python -m jinfer.training.distill soft-labels --data pydoc
    python -m jinfer.training.distill train --method seqkd --data train --out DIR
    python -m jinfer.training.distill train --method kd --data pydoc --out DIR
    python -m jinfer.training.distill accept --draft DIR

`train` logs the loss and, every --eval-every steps, the validation agreement: how often the
draft's top token is the teacher's greedy next token on the held-out answers (the acceptance of
a first greedy draft, teacher-forced). Its checkpoint is the trained layers, final norm and
vocabulary in bf16, with `train_log.json` beside it.
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
from jinfer.engine.speculative.draft_checkpoint import draft_config, save_draft
from jinfer.loader import load_model
from jinfer.training.chat_data import (eval_prompts, generate_answers, load_seqs, save_seqs,
                                       train_prompts)
from jinfer.weights.builtin import cache_dir
from pallas_kernels import AttentionMetadata


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistillConfig:
  layers: tuple[int, ...]  # the teacher's layers the draft starts from, in order
  draft_vocab_size: int
  seq_len: int = 320  # tokens per training row (longer sequences are cut)
  batch_size: int = 4
  learning_rate: float = 3e-4
  warmup_steps: int = 20
  steps: int = 1000
  page_size: int = 16


def draft_vocab(counts: np.ndarray, size: int, always: tuple[int, ...] = ()) -> np.ndarray:
  """The `size` most frequent token ids (plus `always`, e.g. EOS), most frequent first."""
  order = [int(t) for t in np.argsort(-counts, kind="stable")]
  keep = list(dict.fromkeys(list(always) + order))[:size]
  return np.asarray(sorted(keep, key=lambda t: -counts[t]), np.int32)


def init_draft(teacher: ModelConfig, teacher_params: dict,
               layers: tuple[int, ...]) -> tuple[ModelConfig, dict]:
  """(draft config, its trainable params {"layers", "norm"}) copied from the teacher's."""
  idx = jnp.asarray(layers)
  own = {"layers": jax.tree.map(lambda a: a[idx], teacher_params["layers"]),
         "norm": teacher_params["norm"]}
  return draft_config(teacher, len(layers)), own


def _forward(model: CausalLM, page_size: int, own: dict, embedding: jax.Array,
             tokens: jax.Array) -> jax.Array:  # tokens [B, L] -> hidden [B, L, E]
  b, length = tokens.shape
  pages = length // page_size
  c = model.config
  table = 1 + jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)  # page 0: the sink
  pos = jnp.arange(length, dtype=jnp.int32)
  slots = (table[:, pos // page_size] * page_size + pos % page_size).reshape(-1)  # [B*L]
  md = AttentionMetadata(slot_mapping=slots, block_table=table,
                         kv_lens=jnp.full(b, length, jnp.int32),
                         cu_q_lens=jnp.arange(b + 1, dtype=jnp.int32) * length,
                         num_seqs=jnp.array([b], jnp.int32), max_q_len=length,
                         max_prefill_seqs=b)
  cache = jnp.zeros((c.num_layers, 1 + b * pages, 2, c.num_kv_heads, page_size, c.head_dim),
                    embedding.dtype)
  params = {"embedding": embedding, **own}
  _, hidden, _ = model.apply({"params": params}, tokens.reshape(-1), jnp.tile(pos, b), cache,
                             md, return_hidden=True)
  return hidden.reshape(b, length, -1)


def loss_fn(model: CausalLM, page_size: int, own: dict, embedding: jax.Array, head: jax.Array,
            tokens: jax.Array, target_ids: jax.Array, target_w: jax.Array) -> jax.Array:
  """Mean cross-entropy against the targets: ids [B, L, N] (indices into the draft's
  vocabulary) weighted by target_w [B, L, N] (0: no target; each position's weights sum to 1 or
  to 0)."""
  hidden = _forward(model, page_size, own, embedding, tokens)
  logp = jax.nn.log_softmax(hidden @ jax.lax.stop_gradient(head).T, axis=-1)  # [B, L, Vd]
  picked = jnp.take_along_axis(logp, target_ids, axis=-1)  # [B, L, N]
  return -jnp.sum(target_w * picked) / jnp.maximum(jnp.sum(target_w), 1.0)


class Trainer:
  """Adam over the draft's own params; the embedding and head stay the teacher's."""

  def __init__(self, config: ModelConfig, cfg: DistillConfig, own: dict, embedding: jax.Array,
               vocab: np.ndarray):
    self.cfg = cfg
    model = CausalLM(config, KernelOptions(attention="reference"), dtype=jnp.float32)
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, cfg.warmup_steps,
                                                  max(cfg.steps, cfg.warmup_steps + 1))
    self.optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule))
    # Copies: the step donates them, and `own` may share arrays with the teacher's params.
    self.own = jax.tree.map(lambda a: jnp.array(a, jnp.float32, copy=True), own)
    self.opt_state = self.optimizer.init(self.own)
    self.embedding = jnp.asarray(embedding, jnp.float32)
    self.head = self.embedding[jnp.asarray(vocab)]  # [Vd, E]
    self._loss = jax.jit(functools.partial(loss_fn, model, cfg.page_size))
    self._predict = jax.jit(lambda own, emb, head, tokens: jnp.argmax(
        _forward(model, cfg.page_size, own, emb, tokens) @ head.T, axis=-1))
    self._step = jax.jit(functools.partial(_train_step, model, cfg.page_size, self.optimizer),
                         donate_argnums=(0, 1))

  def step(self, tokens, target_ids, target_w) -> float:
    self.own, self.opt_state, loss = self._step(self.own, self.opt_state, self.embedding,
                                                self.head, tokens, target_ids, target_w)
    return float(loss)

  def loss(self, tokens, target_ids, target_w) -> float:
    return float(self._loss(self.own, self.embedding, self.head, tokens, target_ids, target_w))

  def agreement(self, tokens, target_ids, target_w) -> tuple[int, int]:
    """(positions where the draft's top token is the target's top token, positions): with
    SeqKD targets on the teacher's greedy text, how often a first draft would be accepted."""
    pred = np.asarray(self._predict(self.own, self.embedding, self.head, tokens))  # [B, L]
    top = np.take_along_axis(target_ids, np.argmax(target_w, -1)[..., None], -1)[..., 0]
    live = target_w.sum(-1) > 0
    return int(((pred == top) & live).sum()), int(live.sum())


def _train_step(model, page_size, optimizer, own, opt_state, embedding, head, tokens, target_ids,
                target_w):
  loss, grads = jax.value_and_grad(functools.partial(loss_fn, model, page_size))(
      own, embedding, head, tokens, target_ids, target_w)
  updates, opt_state = optimizer.update(grads, opt_state, own)
  return optax.apply_updates(own, updates), opt_state, loss


def sequence_targets(seqs: list[np.ndarray], starts: list[int], vocab: np.ndarray, seq_len: int,
                     soft: list[tuple[np.ndarray, np.ndarray]] | None = None):
  """Training rows from token sequences: (tokens [B, L], target ids [B, L, N], weights
  [B, L, N]). Position p is trained to predict token p+1, from position starts[i] - 1 on (the
  text the draft will propose; the prompt before it is context only).

  Without `soft` the target is the next token itself (SeqKD on teacher generations): N = 1.
  With `soft`, per sequence (ids [n, N], logprobs [n, N]) of the teacher's top-N next tokens at
  each position: word-level KD, the teacher's probabilities renormalized over those in the
  draft's vocabulary. Targets outside the vocabulary are dropped (the draft cannot propose them).
  """
  index = np.full(int(vocab.max()) + 1, -1, np.int64)
  index[vocab] = np.arange(len(vocab))
  lookup = lambda ids: np.where(ids < len(index), index[np.minimum(ids, len(index) - 1)], -1)
  n = 1 if soft is None else soft[0][0].shape[1]
  b = len(seqs)
  tokens = np.zeros((b, seq_len), np.int32)
  ids = np.zeros((b, seq_len, n), np.int32)
  w = np.zeros((b, seq_len, n), np.float32)
  for i, (s, start) in enumerate(zip(seqs, starts)):
    s = s[:seq_len + 1]
    tokens[i, :len(s) - 1] = s[:-1]
    lo = max(start - 1, 0)
    if soft is None:
      nxt = lookup(s[lo + 1:])
      ids[i, lo:len(s) - 1, 0] = np.maximum(nxt, 0)
      w[i, lo:len(s) - 1, 0] = nxt >= 0
    else:
      top, logp = soft[i][0][lo:len(s) - 1], soft[i][1][lo:len(s) - 1]
      d = lookup(top)
      p = np.where(d >= 0, np.exp(logp), 0.0)
      total = p.sum(-1, keepdims=True)
      ids[i, lo:lo + len(top)] = np.maximum(d, 0)
      w[i, lo:lo + len(top)] = np.where(total > 0, p / np.maximum(total, 1e-30), 0.0)
  return tokens, ids, w


# -- the pipeline (python -m jinfer.training.distill STAGE) -----------------------------------

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
  ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}",
      description="Distill a draft model for SmolLM2-135M-Instruct (speculative decoding).")
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
