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
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jinfer.config import ModelConfig
from jinfer.models import CausalLM
from jinfer.models.kernel_options import KernelOptions
from jinfer.engine.speculative.draft_checkpoint import draft_config
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
