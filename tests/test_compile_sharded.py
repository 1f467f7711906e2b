"""Compile-only tier, sharded engine steps: tensor and expert parallelism over TPU slices and
eight H100s, built by the real compilers through `jinfer.plan` (see test_compile_engine.py for
depth and what is shallow)."""
from __future__ import annotations

import pytest

from jinfer.engine.compile_only import collectives, compile_lowered
from tests.compile_targets import built, plan_for as _plan, shallow as _shallow

pytestmark = [pytest.mark.slow, pytest.mark.compile_only]


def test_llama_70b_int8_tp8_v6e_8():
  """Full depth (80 layers at TP 8): int8 weights and the default pool fit each v6e of a v6e-8.
  The decode step's collectives are what row- and vocabulary-parallel layers imply: all-reduces
  (and the sampler's permutes), no all-gather or all-to-all, so no weight ever moves."""
  p = _plan("llama-3.1-70b", "v6e-8", [1], quantization="int8", tensor_parallel_size=8)
  built(p)
  assert p.fits, p.report()
  decode = p.steps[0]
  assert decode.collectives.get("all-reduce", 0) > 0
  assert set(decode.collectives) <= {"all-reduce", "collective-permute"}, decode.collectives


def test_mixtral_expert_parallel_v6e_8(tmp_path):
  """Mixtral-8x7B's experts whole on each device (EP over 8): decode and prefill build, the
  grouped matmul running per device under shard_map, and no collective moves a weight: the
  largest is an activation-sized all-reduce, below one expert's 117 MB projection."""
  p = _plan(_shallow(tmp_path, "mixtral-8x7b", 2), "v6e-8", [1, 512], tensor_parallel_size=8,
            enable_expert_parallel=True)
  built(p)
  for s in p.steps:
    text = compile_lowered(p.engine.lower((s.tokens, False, False))).as_text()
    largest = max(b for _, b in collectives(text))
    assert largest < 4096 * 14336 * 2, (s.tokens, largest)


def test_gemma3_27b_hybrid_kv_tp4_v6e_4(tmp_path):
  """Gemma-3-27B's hybrid KV cache (5 local layers of window 1024 to 1 global, their own KV
  groups and block tables) at TP 4: six layers build for decode and prefill."""
  p = _plan(_shallow(tmp_path, "gemma-3-27b", 6), "v6e-4", [1, 512], tensor_parallel_size=4,
            max_model_len=8192)
  built(p)
  assert set(p.engine.config.kv_groups.windows) == {1024, None}


def test_llama_70b_int8_tp8_h100_8(tmp_path):
  """Eight H100s in one topology: Llama-3.1-70B int8 at TP 8, two layers."""
  p = _plan(_shallow(tmp_path, "llama-3.1-70b", 2), "h100-8", [1], quantization="int8",
            tensor_parallel_size=8)
  built(p)
  assert set(p.steps[0].collectives) <= {"all-reduce", "collective-permute", "all-gather"}
