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
from jinfer.training.distill import _forward
from jinfer.engine.speculative.medusa_heads import head_logits, top_candidates

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
