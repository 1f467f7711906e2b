"""Medusa head training on a tiny random model: fresh heads are the target's own LM head, a few
AdamW steps lower the Medusa loss, the accuracy numbers mean what they say, and the trained heads
survive save/load; the committed SmolLM2 heads load against the real model."""
from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from jinfer.models import CausalLM
from jinfer.models.kernel_options import KernelOptions
from jinfer.training.distill import draft_vocab
from jinfer.engine.speculative.medusa_heads import (head_logits, init_heads, load_heads,
                                                   save_heads, with_rows)
from jinfer.training.medusa_train import (RANKS, MedusaTrainConfig, MedusaTrainer, accuracy,
                                          answer_hidden, head_targets, vocab_index)
from jinfer.weights.builtin import checkpoint_path
from pallas_kernels import AttentionMetadata

CHECKPOINT = checkpoint_path("smollm2-135m-medusa")


def _logits_and_hidden(config, params, tokens: np.ndarray):
  """The target's own logits [T, V] and final hidden states [T, E] for one sequence."""
  page = 16
  t = len(tokens)
  pages = -(-t // page)
  table = 1 + jnp.arange(pages, dtype=jnp.int32)[None]  # [1, P]; page 0: the sink
  pos = jnp.arange(t, dtype=jnp.int32)
  md = AttentionMetadata(slot_mapping=table[0, pos // page] * page + pos % page,
                         block_table=table, kv_lens=jnp.array([t], jnp.int32),
                         cu_q_lens=jnp.array([0, t], jnp.int32),
                         num_seqs=jnp.array([1], jnp.int32), max_q_len=t, max_prefill_seqs=1)
  c = config
  cache = jnp.zeros((c.num_layers, 1 + pages, 2, c.num_kv_heads, page, c.head_dim), jnp.float32)
  model = CausalLM(config, KernelOptions(attention="reference"), dtype=jnp.float32)
  logits, hidden, _ = model.apply({"params": params}, jnp.asarray(tokens), pos, cache, md,
                                  return_hidden=True)
  return np.asarray(logits), np.asarray(hidden)


def test_head_targets_shift():
  # Two answers [10 11 12] and [20 21]: row r, head k -> token r + k + 1 of the same answer.
  t = head_targets(np.array([10, 11, 12, 20, 21]), np.array([0, 3, 5]), 2)
  np.testing.assert_array_equal(t, [[11, 12], [12, -1], [-1, -1], [21, -1], [-1, -1]])
  np.testing.assert_array_equal(vocab_index(t, np.array([12, 21, 11])),
                                [[2, 0], [0, -1], [-1, -1], [1, -1], [-1, -1]])


def test_accuracy_counts_out_of_vocab_as_miss():
  # One head; candidates always [5, 6, 7, ...]. Targets: 5 (rank 0), 7 (rank 2), 99 (never a
  # candidate, e.g. outside the heads' vocabulary: a miss), -1 (past the end: not counted).
  targets = np.array([[5], [7], [99], [-1]], np.int32)
  cand = lambda h: jnp.broadcast_to(jnp.arange(5, 5 + RANKS)[None, None], (h.shape[0], 1, RANKS))
  acc = accuracy(cand, np.zeros((4, 8), np.float32), targets, chunk=3)
  assert acc["top1"] == [pytest.approx(1 / 3)] and acc["top5"] == [pytest.approx(2 / 3)]
  assert acc["rank_hits"][0][:3] == pytest.approx([1 / 3, 0, 1 / 3]) and acc["positions"] == [3]


def test_train_steps_identity_init_and_round_trip(tiny_model, tmp_path):
  config, params, tok = tiny_model
  rng = np.random.default_rng(0)
  # Answers from a few repeated phrases, so the tokens two or more ahead are learnable.
  phrases = [rng.integers(3, 400, 6) for _ in range(4)]
  seqs = [np.concatenate([rng.integers(3, 400, 5)]
                         + [phrases[j] for j in rng.integers(0, 4, 6)]) for _ in range(6)]
  starts = [5] * len(seqs)
  rows = list(answer_hidden(config, params, seqs, starts, bucket=32))
  hidden = np.concatenate(rows)  # [N, E]
  answers = [s[st:] for s, st in zip(seqs, starts)]
  tokens = np.concatenate(answers)
  offsets = np.cumsum([0] + [len(a) for a in answers])
  assert hidden.shape == (len(tokens), config.hidden_size)

  # The cached rows are the target's own final hidden states, and a fresh (zero) head is the
  # identity: every head's logits are the LM head's logits on h.
  logits, h_all = _logits_and_hidden(config, params, seqs[0])
  np.testing.assert_allclose(rows[0], h_all[starts[0] - 1:-1], rtol=1e-4, atol=1e-4)
  fresh = init_heads(3, config.hidden_size, 2)
  emb = params["embedding"]
  got = head_logits(fresh, jnp.asarray(rows[0]), lambda x: x @ emb.T)  # [n, 3, V]
  for k in range(3):
    np.testing.assert_allclose(got[:, k], logits[starts[0] - 1:-1], rtol=1e-4, atol=1e-3)
  vocab = draft_vocab(np.bincount(tokens, minlength=config.vocab_size), 128,
                      always=tuple(tok.eos_token_ids))
  restricted = head_logits(with_rows({**fresh, "vocab": vocab}, emb), jnp.asarray(rows[0]))
  np.testing.assert_allclose(restricted[:, 0], logits[starts[0] - 1:-1][:, vocab], rtol=1e-4,
                             atol=1e-3)

  cfg = MedusaTrainConfig(num_heads=3, num_layers=1, batch_size=32, learning_rate=1e-2,
                          warmup_steps=1, steps=30)
  trainer = MedusaTrainer(cfg, {**init_heads(3, config.hidden_size, 1), "vocab": vocab}, emb)
  token_targets = head_targets(tokens, offsets, cfg.num_heads)
  targets = vocab_index(token_targets, vocab)
  before, ce = trainer.loss(hidden, targets)
  assert before == pytest.approx(sum(0.8 ** k * c for k, c in enumerate(ce)), rel=1e-5)
  acc0 = trainer.evaluate(hidden, token_targets)
  usable = np.flatnonzero((targets >= 0).any(1))
  dev_h, dev_t = jnp.asarray(hidden), jnp.asarray(targets)
  for _ in range(cfg.steps):
    trainer.step(dev_h, dev_t, rng.choice(usable, cfg.batch_size))
  after, _ = trainer.loss(hidden, targets)
  assert after < 0.8 * before
  acc = trainer.evaluate(hidden, token_targets)
  for a in (acc0, acc):
    r = np.asarray(a["rank_hits"])  # [H, 10]
    assert r.shape == (3, RANKS) and (r >= 0).all() and (r.sum(1) <= 1 + 1e-9).all()
    np.testing.assert_allclose(a["top1"], r[:, 0])
    np.testing.assert_allclose(a["top5"], r[:, :5].sum(1))
  assert np.mean(acc["top5"]) > np.mean(acc0["top5"])

  path = str(tmp_path / "heads")
  trained = trainer.params
  save_heads(path, trained, {"hidden_size": config.hidden_size, "eval": acc})
  loaded, meta = load_heads(path, config)
  np.testing.assert_array_equal(loaded["vocab"], vocab)
  for k in ("w", "b"):
    np.testing.assert_allclose(loaded[k], trained[k], rtol=1e-2, atol=1e-3)  # stored as bf16
  assert meta["eval"]["top1"] == acc["top1"]
  h = jnp.asarray(hidden[:8])
  np.testing.assert_allclose(head_logits(with_rows(loaded, emb), h),
                             head_logits(with_rows(trained, emb), h), rtol=2e-2, atol=2e-2)


@pytest.mark.slow  # loads the real SmolLM2 weights
def test_committed_checkpoint_fits_smollm2():
  from jinfer.loader import load_model
  if not os.path.isdir(CHECKPOINT):
    pytest.skip("no committed Medusa checkpoint")
  config, params, _ = load_model("smollm2-135m-instruct", load_tokenizer=False)
  heads, meta = load_heads(CHECKPOINT, config)
  h, layers, e = meta["num_heads"], meta["num_layers"], config.hidden_size
  assert heads["w"].shape == (h, layers, e, e) and heads["b"].shape == (h, layers, e)
  assert heads["vocab"].shape == (meta["head_vocab_size"],)
  assert len(set(heads["vocab"].tolist())) == meta["head_vocab_size"]
  assert meta["target"] == "smollm2-135m-instruct"
  assert (meta["hidden_size"], meta["vocab_size"]) == (e, config.vocab_size)
  ev = meta["eval"]
  assert len(ev["top1"]) == len(ev["top5"]) == len(ev["rank_hits"]) == h
  assert all(0 < t1 <= t5 <= 1 for t1, t5 in zip(ev["top1"], ev["top5"]))
  with open(os.path.join(CHECKPOINT, "train_log.json")) as fh:
    curve = json.load(fh)["loss"]
  assert np.mean(curve[-10:]) < np.mean(curve[:10])
  out = head_logits(with_rows(heads, params["embedding"]), jnp.zeros((2, e)))
  assert out.shape == (2, h, meta["head_vocab_size"])
