"""Offline throughput benchmark: a synthetic batch of requests, all submitted at t=0.

The workload is built the way `vllm bench`'s random dataset builds it: prompt lengths uniform in
[min, max] from a numpy seed, each prompt a run of consecutive token ids from a random offset,
output lengths fixed or (like its --random-range-ratio) uniform in [min, max] from the same seed,
EOS ignored, so every run does exactly the same work.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from jinfer.bench.machine import machine_info
from jinfer.engine.engine import LLMEngine
from jinfer.sampling.params import SamplingParams


@dataclasses.dataclass(frozen=True, kw_only=True)
class RandomWorkload:
  num_prompts: int = 64
  input_len_min: int = 32
  input_len_max: int = 512
  output_len: int = 128  # the longest output
  output_len_min: int | None = None  # None: every output is output_len long
  seed: int = 0

  def __post_init__(self):
    if self.num_prompts < 1 or self.output_len < 1:
      raise ValueError("num_prompts and output_len must be >= 1")
    if self.output_len_min is not None and not 1 <= self.output_len_min <= self.output_len:
      raise ValueError(f"need 1 <= output_len_min <= output_len, got "
                       f"{self.output_len_min}, {self.output_len}")
    if not 1 <= self.input_len_min <= self.input_len_max:
      raise ValueError(f"need 1 <= input_len_min <= input_len_max, got "
                       f"{self.input_len_min}, {self.input_len_max}")

  @property
  def max_len(self) -> int:
    """Longest prompt + output: the smallest max_model_len that fits every request."""
    return self.input_len_max + self.output_len

  def prompts(self, vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(self.seed)
    lens = rng.integers(self.input_len_min, self.input_len_max + 1, self.num_prompts)
    offsets = rng.integers(0, vocab_size, self.num_prompts)
    # The request index in the offset keeps prompts distinct even when offsets collide.
    return [((offsets[i] + i + np.arange(n)) % vocab_size).tolist() for i, n in enumerate(lens)]

  def output_lens(self) -> list[int]:
    if self.output_len_min is None:
      return [self.output_len] * self.num_prompts
    # A stream of its own, so prompts stay those of the fixed-length workload.
    rng = np.random.default_rng([self.seed, 1])
    return rng.integers(self.output_len_min, self.output_len + 1, self.num_prompts).tolist()

  def sampling_params(self) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            for n in self.output_lens()]


def _percentiles(xs: list[float]) -> dict[str, float | None]:
  if not xs:
    return {"mean": None, "p50": None, "p99": None}
  a = np.asarray(xs)
  return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
          "p99": float(np.percentile(a, 99))}


def run_offline(engine: LLMEngine, workload: RandomWorkload, *,
                prompts: list[list[int]] | None = None) -> dict:
  """Submit the whole workload at once, step the engine until it drains, and summarize.

  `prompts` overrides the generated token ids (to share one set across engines). The engine
  must be idle; its counters are read as differences, so an engine used before still reports
  this run only (except the prefix hit rate, which the engine keeps over its lifetime).
  """
  if engine.has_unfinished_requests():
    raise ValueError("run_offline needs an idle engine")
  if prompts is None:
    prompts = workload.prompts(engine.model_config.vocab_size)
  params = workload.sampling_params()
  for i, p in enumerate(prompts):  # nothing is queued unless every request can run
    try:
      engine.validate(p, params[i])
    except ValueError as e:
      raise ValueError(f"request {i}: {e}") from None
  before = engine.stats()
  usable_pages = engine.blocks.num_usable_pages

  t0 = time.monotonic()
  rids = [engine.add_request(f"bench-{i}", p, params[i], arrival_time=t0)
          for i, p in enumerate(prompts)]
  final = {}
  kv_util, pages_used, peak_pages = [], [], 0
  while engine.has_unfinished_requests():
    for out in engine.step():
      if out.finished:
        final[out.request_id] = out
    s = engine.stats()
    peak_pages = max(peak_pages, round(s.kv_pages_used * usable_pages))
    # Saturated: requests wait, or the batch holds max_num_seqs, so it is as full as allowed.
    if s.num_waiting or s.num_running >= engine.config.max_num_seqs:
      kv_util.append(s.kv_utilization)
      pages_used.append(s.kv_pages_used)
  wall = time.monotonic() - t0
  after = engine.stats()

  outs = [final[r] for r in rids if r in final]
  completed = [o for o in outs if o.error is None]
  in_tok = sum(len(p) for p in prompts)
  out_tok = sum(len(o.outputs[0].token_ids) for o in completed)
  ttft = [o.metrics.ttft for o in completed if o.metrics.ttft is not None]
  tpot = [o.metrics.tpot for o in completed if o.metrics.tpot is not None]
  cfg = engine.config
  return {
      "machine": machine_info(),
      "config": {
          "workload": dataclasses.asdict(workload),
          "engine": {k: getattr(cfg, k) for k in (
              "max_model_len", "page_size", "max_num_seqs", "max_num_batched_tokens",
              "max_prefill_seqs", "enable_prefix_caching", "continuous_batching")},
          "speculative_config": (cfg.speculative_config.to_dict()
                                 if cfg.speculative_config is not None else None),
          "num_pages": engine.blocks.num_pages,
          "kernels": dataclasses.asdict(engine.runner.model.kernels),
          "dtype": np.dtype(engine.runner.spec.dtype).name,
          "weight_bytes": after.weight_bytes,
          "kv_cache_bytes": after.kv_cache_bytes,
      },
      "num_requests": len(prompts),
      "completed": len(completed),
      "input_tokens": in_tok,
      "output_tokens": out_tok,
      "wall_s": wall,
      "warmup_s": engine.warmup_seconds,
      "requests_per_s": len(completed) / wall,
      "output_tokens_per_s": out_tok / wall,
      "total_tokens_per_s": (in_tok + out_tok) / wall,
      "ttft_s": _percentiles(ttft),
      "tpot_s": _percentiles(tpot),
      "kv_utilization_mean": float(np.mean(kv_util)) if kv_util else None,
      "kv_pages_used_mean": float(np.mean(pages_used)) if pages_used else None,
      "saturated_steps": len(kv_util),
      "peak_pages_used": peak_pages,
      "usable_pages": usable_pages,
      "num_preemptions": after.num_preemptions - before.num_preemptions,
      "prefix_hit_rate": after.prefix_hit_rate,
      "num_steps": after.num_steps - before.num_steps,
      "expert_load": (after.expert_load.since(before.expert_load).as_dict()
                      if after.expert_load is not None else None),
      "speculative_decoding": (after.spec.since(before.spec).summary() if after.spec is not None
                               else None),
  }
