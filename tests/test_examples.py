"""Every script in examples/ runs as a user runs it: a subprocess from the repository root, here
on the tiny model directory with few tokens and steps compiled on first use; the speculative
example also on the real SmolLM2 with the shipped draft (slow tier)."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import pytest

from tests.live_server import http

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, HF_HUB_OFFLINE="1")


def run_example(name: str, *args: str, timeout: float = 600) -> str:
  """Run examples/`name` with `args`; its stdout."""
  proc = subprocess.run([sys.executable, os.path.join("examples", name), *args], cwd=ROOT,
                        env=ENV, capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return proc.stdout


def test_quickstart(tiny_model_dir):
  out = run_example("quickstart.py", "--model", tiny_model_dir, "--max-tokens", "4",
                    "--no-warmup")
  lines = out.splitlines()
  assert len(lines) == 3 and all("-> '" in l and "(4 tokens, length)" in l for l in lines), out


@pytest.mark.slow  # quick: test_quickstart and test_async_streaming run examples the same way
def test_offline_batch_is_reproducible(tiny_model_dir):
  out = run_example("offline_batch.py", "--model", tiny_model_dir, "--num-prompts", "6",
                    "--max-tokens", "4", "--no-warmup")
  assert out.startswith("6 prompts, ") and "tokens/s" in out, out
  # One line per sampling setting, two for the one with n=2.
  assert [len(re.findall(rf"^\[{s}\] ", out, re.M)) for s in ("greedy", "creative", "focused")] \
      == [1, 1, 2], out
  assert out.rstrip().endswith("second run, reversed order: the same tokens"), out


@pytest.mark.slow  # quick: test_quickstart runs an example the same way; streaming: test_async_engine
def test_async_streaming(tiny_model_dir):
  out = run_example("async_streaming.py", "--model", tiny_model_dir, "--max-tokens", "4",
                    "--no-warmup")
  for name in ("sea", "code", "story"):
    deltas = re.findall(rf"^\[{name}\] \+'(.*)'$", out, re.M)
    assert len(deltas) == 4, out  # one token per step, each streamed on its own
    final = re.search(rf"^{name}: '.*' -> '(.*)'$", out, re.M).group(1)
    assert "".join(deltas) == final, out
    assert f"[{name}] done: length" in out


def _check_speculative(out: str, methods: list[str]):
  assert out.startswith("plain: "), out
  for m in methods:
    assert re.search(rf"^{m}: \d+ tokens .*; the same tokens as plain decoding$", out, re.M), out
  assert "DIFFERENT" not in out
  accepted = [(int(a), int(p)) for a, p in re.findall(r"(\d+) of (\d+) proposed tokens", out)]
  assert len(accepted) == len(methods) and all(a <= p for a, p in accepted), out
  return accepted


@pytest.mark.slow  # ~20 s until the compilation cache holds the verify steps (~5 s after)
def test_speculative_ngram_on_a_tiny_model(tiny_model_dir):
  out = run_example("speculative.py", "--model", tiny_model_dir, "--methods", "ngram",
                    "--max-tokens", "16", "--no-warmup")
  _check_speculative(out, ["ngram"])


@pytest.mark.slow  # ~15 s until the compilation cache holds the server's warmup (~4 s after)
def test_serve(tiny_model_dir):
  with socket.create_server(("127.0.0.1", 0)) as s:
    port = s.getsockname()[1]
  proc = subprocess.Popen(
      [sys.executable, os.path.join("examples", "serve.py"), "--model", tiny_model_dir,
       "--port", str(port), "--served-model-name", "tiny", "--max-model-len", "64",
       "--max-num-seqs", "2", "--max-num-batched-tokens", "8"],
      cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 600
    while True:
      assert proc.poll() is None, proc.communicate()[1][-4000:]
      assert time.monotonic() < deadline, "the server did not come up"
      try:
        status, _, body = http(f"http://127.0.0.1:{port}/v1/models", timeout=5)
        break
      except OSError:  # not listening yet
        time.sleep(0.5)
    assert status == 200 and b'"tiny"' in body
  finally:
    proc.terminate()
    proc.communicate(timeout=120)


@pytest.mark.slow
def test_long_context(tiny_model_dir):
  out = run_example("long_context.py", "--model", tiny_model_dir, "--context-tokens", "60",
                    "--chunk", "16", "--kv-cache-dtype", "int8", "--max-tokens", "4")
  lines = out.splitlines()
  assert len(lines) == 3 and all("prompt tokens, first token after" in l for l in lines[:2]), out
  assert float(re.search(r"hit rate ([\d.]+)", lines[2]).group(1)) > 0, out


@pytest.mark.slow  # SmolLM2 with its two shipped adapters (~40 s on 2 cores)
def test_lora_serves_two_adapters_and_the_base_in_one_batch():
  out = run_example("lora.py", "--max-tokens", "12")
  lines = out.splitlines()
  assert [l.split("]")[0] for l in lines] == ["[base"] * 2 + ["[signoff"] * 2 + ["[allcaps"] * 2
  text = [l.split(" -> ", 1)[1] for l in lines]
  assert all(t.startswith("'Hello there") for t in text[2:4]), out  # the sign-off's opener
  # capitals (the adapter does it on 75% of held-out prompts: one of the two here)
  assert any(t.strip("'").upper() == t.strip("'") for t in text[4:]), out
  assert not any(t.startswith("'Hello there") for t in text[:2]), out


@pytest.mark.slow  # ~25 s on 2 cores: the engine's steps and the trainer's step compile
def test_online_learning_runs_rounds_on_a_tiny_model(tiny_model_dir):
  """Three rounds of generate, reward, train, update_lora: the trainer's teacher-forced
  logprobs equal the engine's rollout logprobs (float32) in every round."""
  out = run_example("online_learning.py", "--model", tiny_model_dir, "--rounds", "3",
                    "--prompts", "2", "--samples", "3", "--max-tokens", "6", "--target", "3")
  gaps = [float(g) for g in re.findall(r"logprob gap (\S+),", out)]
  assert len(gaps) == 3 and max(gaps) <= 1e-5, out
  assert re.search(r"^mean reward: first 1 rounds [\d.]+, last 1 rounds [\d.]+$", out, re.M), out
