"""`python -m jinfer.bench.long_context`: its needle prompts, and end to end, ring attention over
2 CPU devices (the kit's default) against one device.

The benchmark runs in a subprocess: it must size the CPU client (2 devices) before jax starts its
backends, and this process's jax may already have started them with one.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from jinfer.bench.long_context import CUE, NEEDLE, NeedleBuilder, filler_sentences
from jinfer.tokenizer import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_base_model_needle_prompts_are_the_haystack_then_the_cue():
  # A base model's tokenizer, of the plainest kind: one token per word or punctuation run, no
  # chat template. The builder's arithmetic does not depend on the vocabulary.
  sentences = filler_sentences()[:300]
  split = pre_tokenizers.Whitespace().pre_tokenize_str
  words = sorted({w for s in sentences + [NEEDLE.format(12345), CUE] for w, _ in split(s)})
  backend = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
  backend.pre_tokenizer = pre_tokenizers.Whitespace()
  tok = Tokenizer(backend, special_tokens=dict.fromkeys(("bos_token", "eos_token", "unk_token",
                                                         "pad_token")),
                  eos_token_ids=(), chat_template=None)
  builder = NeedleBuilder(tok, sentences)
  assert not builder.chat and builder.prefix == 0
  needle, cue = tok.encode(NEEDLE.format(12345)), tok.encode(CUE)
  for depth in (0.0, 0.5, 1.0):
    ids, at = builder.build(1000, depth, "12345")
    assert 990 <= len(ids) <= 1000
    assert ids[at:at + len(needle)] == needle, depth
    assert ids[-len(cue):] == cue  # the text ends on the cue the model completes
    assert abs(at / (len(ids) - len(cue)) - depth) < 0.05


@pytest.mark.slow
def test_long_context_quick(tmp_path):
  out, png = tmp_path / "lc.json", tmp_path / "lc.png"
  env = dict(os.environ, HF_HUB_OFFLINE="1")
  # Only the subprocess's own flag may decide the device count.
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run(
      # The instruct model: needles asked through its chat template.
      [sys.executable, "-m", "jinfer.bench.long_context", "--quick",
       "--model", "smollm2-135m-instruct",
       "--devices", "2", "--no-warmup", "--out", str(out), "--plot", str(png)],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
  assert proc.returncode == 0, proc.stderr[-4000:]
  result = json.loads(out.read_text())

  assert result["context_parallel_size"] == 2 and result["devices"] == 2
  assert result["context_layout"] == "zigzag"
  assert result["lengths"] == [256, 512] and result["cp_lengths"] == [256, 512]
  assert result["prompt_style"] == "chat template"
  assert result["machine"]["num_devices"] == 2
  for run in ("cp", "one_device"):
    needle = result[run]["needle"]
    assert set(needle["accuracy_by_length"]) == {"256", "512"}
    assert len(needle["trials"]) == 2 * len(result["depths"])
    assert all(t["prompt_tokens"] <= t["length"] for t in needle["trials"])
    assert 0.0 <= needle["accuracy"] <= 1.0
    ppl = result[run]["perplexity"]
    assert ppl["tokens"] == 512 and len(ppl["buckets"]) == 8
    assert all(1.0 < b["perplexity"] < 1e4 for b in ppl["buckets"])
  assert "engine_s" in result["cp"]["timings"] and result["total_s"] > 0

  # Ring attention reorders an exact computation: the CP run matches one device to rounding.
  diff = result["cp_vs_one_device"]
  assert diff["max_abs_logprob_diff"] <= 1e-4, diff
  assert diff["greedy_answers_identical"], diff

  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
