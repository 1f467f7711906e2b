"""Startup that serves before every step is compiled: the engine answers from the startup buckets
while the rest compile in the background, in the order the traffic asks for them, with the same
tokens as an engine that had everything compiled, and nothing ever compiles on the serving path;
the recompile guard counts, logs and (strict) refuses what does."""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import jax
import pytest

from jinfer.engine.compile_guard import CompileOnServingPath
from jinfer.engine.step_compiler import StepCompiler
from jinfer.sampling.params import SamplingParams
from tests.engine_fixtures import CompileCounter, make_engine, random_prompts, run_tokens

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# Buckets 1, 2, 4, 8, 16, 32; startup compiles 1 and 32 (the largest, short of 64). All
# scanned: compiles of seconds (the unrolled one-token step alone took ~7 s), and the
# scheduling is what is tested.
OPTIONS = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32, scan_layers=True)


@pytest.fixture(scope="module")
def prompts():
  return random_prompts(8, seed=3, lo=5, hi=200)  # the long ones take several 32-token chunks


def test_serves_from_the_startup_buckets_then_the_rest_as_they_compile(tiny_model, prompts):
  eng = make_engine(tiny_model, warmup=False, strict_compiles=True, **OPTIONS)
  c = eng.compiler
  # The background compiler starts when this test says, so the first requests are served with
  # the startup buckets only, deterministically.
  c.start = lambda: None
  eng.warmup()
  counter = CompileCounter()  # this thread: the serving path
  assert c.ready == c.startup_buckets == [1, 32]

  padded = run_tokens(eng, prompts, GREEDY)  # decode padded to 32
  assert c.ready == [1, 32]
  asked = dict(c._demand)
  assert asked and 1 not in asked and 32 not in asked  # padded steps asked for what they fit

  StepCompiler.start(c)  # served while the background compiles, then after
  meanwhile = run_tokens(eng, prompts[::-1], GREEDY)
  eng.wait_until_compiled()
  assert c.done and c.ready == c.buckets
  background = list(c.seconds)[2:]  # in the order they were compiled
  assert background[0] == max(asked, key=lambda t: (asked[t], -t)), (background, asked)
  want = run_tokens(eng, prompts, GREEDY)  # every bucket at hand
  assert padded == want and meanwhile == want[::-1]
  assert counter.count == 0 and eng.stats().compiles_after_startup == 0
  s = eng.stats()
  assert (s.buckets_compiled, s.buckets_total) == (6, 6)


@pytest.mark.slow  # quick: the test above counts the guard's zero under the same workload
def test_the_guard_counts_logs_and_in_strict_mode_refuses_a_compile_on_the_serving_path(
    tiny_model, prompts, caplog):
  for strict in (False, True):
    eng = make_engine(tiny_model, compile_in_background=False, strict_compiles=strict,
                      **OPTIONS)
    assert eng.compiler.done
    run_tokens(eng, prompts[:2], GREEDY)
    assert eng.stats().compiles_after_startup == 0
    jax.clear_caches()  # the compiled steps are gone: the next step must load them again
    eng.add_request(None, prompts[0], GREEDY)
    if strict:
      with pytest.raises(CompileOnServingPath, match="strict_compiles"):
        eng.step()
    else:
      with caplog.at_level(logging.WARNING, logger="jinfer.engine.engine"):
        eng.run_to_completion()
      assert "on the serving path after startup" in caplog.text
    assert eng.stats().compiles_after_startup > 0


@pytest.mark.parametrize("level", [None, "WARNING"])
def test_the_python_api_says_what_it_loads_and_how_long_it_took(tiny_model_dir, level):
  env = {**os.environ, "JINFER_CONFIGURE_LOGGING": "1"}  # as a user's process has it
  env.pop("JINFER_LOGGING_LEVEL", None)
  if level:
    env["JINFER_LOGGING_LEVEL"] = level
  code = f"from jinfer import LLM; LLM({tiny_model_dir!r}, warmup=False)"
  proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  said = [line for line in proc.stderr.splitlines() if line.startswith("jinfer: ")]
  if level:
    assert not said, said
  else:
    assert any(line.startswith("jinfer: loading ") for line in said), said
    assert re.search(r"^jinfer: \S+ ready in [\d.]+ s \(loading [\d.]+ s, compiling ",
                     proc.stderr, re.M), said


@pytest.mark.slow  # ~10 s of compiles; quick: the test above (background), test_spec_engine
def test_speculation_waits_for_its_verify_steps_and_keeps_the_tokens(tiny_model):
  """Startup leaves the verify steps to the background: the engine decodes plainly until they
  are compiled, then speculates, with the same greedy tokens throughout."""
  # Few buckets (1, 2, 4, 8), all scanned: compiles of seconds, not tens.
  options = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=8, scan_layers=True)
  prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 9, 10, 11, 9]]  # n-gram drafts find repeats
  want = run_tokens(make_engine(tiny_model, warmup=False, **options), prompts, GREEDY)
  eng = make_engine(tiny_model, warmup=False, strict_compiles=True, **options,
                    speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                        "prompt_lookup_min": 1})
  c = eng.compiler
  c.start = lambda: None  # the background waits for this test
  eng.warmup()
  assert c.ready == [1, 8] and not c.finished
  assert run_tokens(eng, prompts, GREEDY) == want
  assert eng.stats().spec.num_draft_tokens == 0  # no verify step compiled: no drafts
  StepCompiler.start(c)
  eng.wait_until_compiled()
  assert run_tokens(eng, prompts, GREEDY) == want
  assert eng.stats().spec.num_draft_tokens > 0
  assert eng.stats().compiles_after_startup == 0
