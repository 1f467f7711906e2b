"""The draft distillation path on a tiny model: a few training steps lower the loss, the
checkpoint keeps only what was trained, and it loads into the engine beside its target (the
embedding shared, the vocabulary restricted) with greedy output unchanged."""
from __future__ import annotations

import os

import jax
import numpy as np
import pytest

from jinfer.sampling.params import SamplingParams
from jinfer.training.distill import (DistillConfig, Trainer, draft_vocab, init_draft,
                                     sequence_targets)
from jinfer.engine.speculative.draft_checkpoint import load_draft, save_draft
from tests.engine_fixtures import CompileCounter, make_engine


@pytest.mark.slow  # ~1 min: a few training steps, then an engine with the saved draft
def test_train_save_load_and_speculate(tiny_model, tmp_path):
  config, params, tok = tiny_model
  rng = np.random.default_rng(0)
  seqs = [rng.integers(3, 3000, rng.integers(20, 48)) for _ in range(4)]
  starts = [5] * 4
  counts = np.bincount(np.concatenate(seqs), minlength=config.vocab_size)
  vocab = draft_vocab(counts, 256, always=tok.eos_token_ids)
  assert vocab[0] == np.argmax(counts) and set(tok.eos_token_ids) <= set(vocab.tolist())
  cfg = DistillConfig(layers=(1,), draft_vocab_size=256, seq_len=48, batch_size=4,
                      learning_rate=3e-3, warmup_steps=1, steps=8)
  dconf, own = init_draft(config, params, cfg.layers)
  trainer = Trainer(dconf, cfg, own, params["embedding"], vocab)
  # SeqKD targets (the next token) and KD targets (a spread over three tokens) both train.
  hard = sequence_targets(seqs, starts, vocab, cfg.seq_len)
  top = [np.stack([s[1:], s[1:] + 1, s[1:] + 2], -1) for s in seqs]
  soft = [(t.astype(np.int32), np.log(np.tile([0.6, 0.3, 0.1], (len(t), 1))).astype(np.float32))
          for t in top]
  kd = sequence_targets(seqs, starts, vocab, cfg.seq_len, soft)
  assert np.allclose(kd[2].sum(-1)[kd[2].sum(-1) > 0], 1.0)
  before = trainer.loss(*hard)
  for _ in range(cfg.steps):
    trainer.step(*hard)
    trainer.step(*kd)
  assert trainer.loss(*hard) < before
  hit, total = trainer.agreement(*hard)
  assert 0 <= hit <= total == int((hard[2].sum(-1) > 0).sum())

  path = str(tmp_path / "draft")
  meta = {"teacher_layers": [1], "num_layers": 1, "draft_vocab_size": len(vocab),
          **{k: getattr(config, k) for k in ("hidden_size", "vocab_size", "num_heads",
                                             "num_kv_heads", "head_dim")}}
  save_draft(path, {**jax.device_get(trainer.own), "vocab": vocab}, meta)
  _, loaded, loaded_vocab = load_draft(path, config, params, np.float32)
  assert loaded["embedding"] is params["embedding"]  # shared, never stored
  np.testing.assert_array_equal(loaded_vocab, vocab)
  stored = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
  assert stored < params["embedding"].nbytes / 4

  greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
  kw = dict(max_model_len=96, page_size=8, max_num_seqs=4, max_num_batched_tokens=8)
  prompts = [s[:20].tolist() for s in seqs]
  run = lambda eng: [o.outputs[0].token_ids for o in eng.run_to_completion(
      [eng.add_request(None, p, greedy) for p in prompts]).values()]
  spec = make_engine(tiny_model, warmup="now", **kw, speculative_config={
      "method": "draft_model", "num_speculative_tokens": 2, "model": path})
  # The checkpoint's arrays join the engine's without a compile of their own after warmup
  # (orbax restores device-committed arrays, which jit keys apart from uncommitted ones).
  counter = CompileCounter()
  got = run(spec)
  assert counter.count == 0, f"{counter.count} compiles after warmup"
  assert sorted(got) == sorted(run(make_engine(tiny_model, warmup=False, **kw)))
  assert spec.stats().spec.num_draft_tokens > 0
