"""Offline throughput: a synthetic batch of requests, all submitted at t=0.

The workload is built the way `vllm bench`'s random dataset builds it: prompt lengths uniform in
[min, max] from a numpy seed, each prompt a run of consecutive token ids from a random offset,
output lengths fixed or (like its --random-range-ratio) uniform in [min, max] from the same seed,
EOS ignored, so every run does exactly the same work. `run_offline` runs it on one engine: that
is `jinfer bench`.

Run as a module, it sets jinfer against its peers on one machine. The same workload (by default
64 requests, prompts of 32-512 tokens from numpy seed 0, 128 output tokens or with
--output-len-min lengths uniform in [min, 128]) runs on
  (a) jinfer with continuous batching,
  (b) the same engine configuration with continuous batching off (static batches),
  (c) HF transformers `generate` (torch CPU, float32, greedy) over left-padded static batches,
      each generating to its longest request's length (only requested tokens are counted),
  (d) llama.cpp on the same GGUF, one request at a time, when `llama_cpp` is importable (build:
      `CMAKE_ARGS="-DGGML_NATIVE=OFF" pip install llama-cpp-python`),
then jinfer's single-stream decode is set against the memory-bandwidth roofline (and llama.cpp's
beside it when present):
bytes read per token (weights + the KV cache read at the mean context) / streaming bandwidth
measured here, and the whole workload against a compute ceiling: its FLOPs at the f32 matmul
rate measured here. Prints one JSON object with the machine and the ratios.

    python -m jinfer.bench.offline [--num-prompts 8 --output-len 16 --skip-hf] [--out F]

Each engine compiles all its step shapes before its timed run. Setting JAX_COMPILATION_CACHE_DIR
lets engine (b) load engine (a)'s executables instead of compiling them again. On a shared CPU
the numbers move with the load, so the load average is recorded beside each phase.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jinfer.bench import llama_cpp_peer
from jinfer.bench.machine import machine_info
from jinfer.bench.report import emit
from jinfer.engine.engine import LLMEngine
from jinfer.engine.engine_config import EngineConfig
from jinfer.loader import DEFAULT_MODEL
from jinfer.sampling.params import SamplingParams
from jinfer.weights.builtin import builtin_gguf_path, is_builtin


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


def transfer_summary(metrics: list) -> dict | None:
  """Disaggregated serving: each request's time to first token split into queue (arrival to
  its prefill's start) and prefill (to its first token, sampled on the prefill side), then the
  hand-over (first token to the decode side taking the sequence: the pages' gather and copy,
  and any wait for a decode seat), the copy alone (hand-over to the pages on the decode
  devices), and the K/V bytes copied per request. None for a colocated engine."""
  m = [x for x in metrics if x.handoff_time is not None]
  if not m:
    return None
  return {
      "requests": len(m),
      "queue_s": _percentiles([x.first_scheduled_time - x.arrival_time for x in m]),
      "prefill_s": _percentiles([x.first_token_time - x.first_scheduled_time for x in m]),
      "handover_s": _percentiles([x.decode_start_time - x.handoff_time for x in m
                                  if x.decode_start_time is not None]),
      "copy_s": _percentiles([x.transfer_done_time - x.handoff_time for x in m
                              if x.transfer_done_time is not None]),
      "bytes_per_request": _percentiles([x.kv_transfer_bytes for x in m]),
  }


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
    if s.num_waiting or s.num_running >= engine.config.scheduler.max_num_seqs:
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
  options = engine.config.config.options()
  kv_transfer = getattr(engine, "kv_transfer", None)
  return {
      "machine": machine_info(),
      "config": {
          "workload": dataclasses.asdict(workload),
          "engine": {k: options[k] for k in (
              "max_model_len", "page_size", "max_num_seqs", "max_num_batched_tokens",
              "max_prefill_seqs", "enable_prefix_caching", "continuous_batching")},
          "speculative_config": (options["speculative_config"].to_dict()
                                 if options["speculative_config"] is not None else None),
          "kv_transfer_config": kv_transfer.to_dict() if kv_transfer is not None else None,
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
      "itl_s": _percentiles([x for o in completed for x in o.metrics.itl]),
      "kv_transfer": transfer_summary([o.metrics for o in completed]),
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


# -- jinfer against its peers (python -m jinfer.bench.offline) ------------------------------

def _load() -> float | None:
  return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def measure_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> dict:
  """Streaming read bandwidth: best of `repeats` full reductions of an array far beyond cache."""
  a = np.ones(nbytes // 4, np.float32)
  x = jnp.asarray(a)
  total = jax.jit(jnp.sum)
  total(x).block_until_ready()
  best = {"numpy": 0.0, "jax": 0.0}
  for _ in range(repeats):
    t0 = time.perf_counter()
    a.sum()
    best["numpy"] = max(best["numpy"], nbytes / (time.perf_counter() - t0))
    t0 = time.perf_counter()
    total(x).block_until_ready()
    best["jax"] = max(best["jax"], nbytes / (time.perf_counter() - t0))
  return {"numpy_gb_s": best["numpy"] / 1e9, "jax_gb_s": best["jax"] / 1e9,
          "gb_s": max(best.values()) / 1e9, "array_bytes": nbytes}


def compute_ceiling(cfg, prompt_lens: list[int], output_lens: list[int], rows: int = 512) -> dict:
  """Output tokens/s if every FLOP of the workload ran at the f32 matmul rate measured here.

  FLOPs: 2 per layer weight per token through the layers (prompt + outputs but the last), 2 per
  LM-head weight per generated token, 4 * heads * head_dim per causal (query, key) pair per
  layer. The rate is the best of five [rows, hidden] x [hidden, intermediate] matmuls.
  """
  e, f, hq, hkv, d = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                      cfg.head_dim)
  layer = 2 * e * hq * d + 2 * e * hkv * d + 3 * e * f  # q, o; k, v; gate, up, down
  flops = 0
  for p, o in zip(prompt_lens, output_lens):
    n = p + o - 1
    flops += cfg.num_layers * (2 * layer * n + 4 * hq * d * n * (n + 1) // 2)
    flops += 2 * e * cfg.vocab_size * o
  x, w = jnp.ones((rows, e), jnp.float32), jnp.ones((e, f), jnp.float32)
  mm = jax.jit(lambda x, w: x @ w)
  mm(x, w).block_until_ready()
  best = float("inf")
  for _ in range(5):
    t0 = time.perf_counter()
    mm(x, w).block_until_ready()
    best = min(best, time.perf_counter() - t0)
  rate = 2 * rows * e * f / best
  return {"workload_flops": flops, "matmul_gflop_s": rate / 1e9, "min_wall_s": flops / rate,
          "output_tokens_per_s": sum(output_lens) * rate / flops}


def single_stream(engine: LLMEngine, prompt_len: int, output_len: int, bandwidth_gb_s: float,
                  vocab_size: int) -> dict:
  """Decode tokens/s of one request alone, against bytes-per-token / bandwidth."""
  prompt = ((np.arange(prompt_len) * 7919) % vocab_size).tolist()
  params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
  rid = engine.add_request("single-stream", prompt, params)
  out = engine.run_to_completion([rid])[rid]
  times = out.metrics.token_times
  decode_tok_s = (len(times) - 1) / (times[-1] - times[0])
  stats = engine.stats()
  # The pool's bytes per token slot: every layer's K and V for one position.
  kv_bytes_per_token = stats.kv_cache_bytes / (engine.blocks.num_pages * engine.config.cache.page_size)
  mean_ctx = prompt_len + output_len / 2  # the context each decode step reads, on average
  bytes_per_token = stats.weight_bytes + mean_ctx * kv_bytes_per_token
  roofline = bandwidth_gb_s * 1e9 / bytes_per_token
  return {"prompt_len": prompt_len, "output_len": output_len, "decode_tokens_per_s": decode_tok_s,
          "weight_bytes": stats.weight_bytes, "kv_bytes_per_context_token": kv_bytes_per_token,
          "bytes_per_token": bytes_per_token, "roofline_tokens_per_s": roofline,
          "fraction_of_roofline": decode_tok_s / roofline}


def _hf_load(model: str):
  import torch
  import transformers
  path = builtin_gguf_path(model) if is_builtin(model) else model
  if path.endswith(".gguf"):
    folder, name = os.path.split(path)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                             dtype=torch.float32).eval()
  return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def run_hf(model: str, prompts: list[list[int]], output_lens: list[int], batch_size: int) -> dict:
  """HF `generate`, greedy, over left-padded static batches in request order."""
  import torch
  import transformers
  t0 = time.monotonic()
  hf = _hf_load(model)
  load_s = time.monotonic() - t0
  eos = hf.generation_config.eos_token_id
  pad = hf.config.pad_token_id
  if pad is None:  # padded positions are masked out, so any id serves
    pad = (eos[0] if isinstance(eos, list) else eos) or 0
  load_at_start = _load()
  t0 = time.monotonic()
  out_tok = 0
  for i in range(0, len(prompts), batch_size):
    batch = prompts[i:i + batch_size]
    n_out = max(output_lens[i:i + batch_size])  # a static batch runs to its longest member
    width = max(map(len, batch))
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, p in enumerate(batch):
      ids[row, width - len(p):] = torch.tensor(p)
      mask[row, width - len(p):] = 1
    with torch.inference_mode():
      gen = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_out,
                        min_new_tokens=n_out, do_sample=False, pad_token_id=pad)
    assert gen.shape[1] - width == n_out
    out_tok += sum(output_lens[i:i + batch_size])
  wall = time.monotonic() - t0
  in_tok = sum(map(len, prompts))
  return {"torch_version": torch.__version__, "transformers_version": transformers.__version__,
          "torch_threads": torch.get_num_threads(), "batch_size": batch_size, "load_s": load_s,
          "output_tokens": out_tok, "wall_s": wall, "requests_per_s": len(prompts) / wall,
          "output_tokens_per_s": out_tok / wall, "total_tokens_per_s": (in_tok + out_tok) / wall,
          "load_avg_1m": {"start": load_at_start, "end": _load()}}


def _jinfer_run(model: str, config: EngineConfig, workload: RandomWorkload,
                prompts: list[list[int]]) -> tuple[LLMEngine, dict]:
  engine = LLMEngine(model, config=config, warmup="now")  # nothing compiles beside the run
  load_at_start = _load()
  r = run_offline(engine, workload, prompts=prompts)
  r.pop("machine")  # described once at the top
  r["load_avg_1m"] = {"start": load_at_start, "end": _load()}
  return engine, r


def main():
  os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may reach a model hub
  os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
  ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}",
                              description=__doc__.split("\n")[0])
  ap.add_argument("--model", default=DEFAULT_MODEL)
  ap.add_argument("--num-prompts", type=int, default=64)
  ap.add_argument("--input-len-min", type=int, default=32)
  ap.add_argument("--input-len-max", type=int, default=512)
  ap.add_argument("--output-len", type=int, default=128)
  ap.add_argument("--output-len-min", type=int, default=None,
                  help="output lengths uniform in [this, --output-len] (default: all equal)")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--max-num-seqs", type=int, default=64)
  ap.add_argument("--max-num-batched-tokens", type=int, default=512)
  ap.add_argument("--hf-batch-size", type=int, default=16)
  ap.add_argument("--single-stream-prompt-len", type=int, default=128)
  ap.add_argument("--skip-hf", action="store_true")
  ap.add_argument("--skip-llama-cpp", action="store_true")
  ap.add_argument("--out", default=None, help="also write the JSON to this file")
  args = ap.parse_args()

  workload = RandomWorkload(num_prompts=args.num_prompts, input_len_min=args.input_len_min,
                            input_len_max=args.input_len_max, output_len=args.output_len,
                            output_len_min=args.output_len_min, seed=args.seed)
  config = EngineConfig.of(max_model_len=max(workload.max_len,
                                          args.single_stream_prompt_len + args.output_len),
                        max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens)
  report = {"machine": machine_info(), "model": args.model,
            "workload": dataclasses.asdict(workload)}
  report["memory_bandwidth"] = measure_bandwidth()

  engine, report["jinfer_continuous"] = _jinfer_run(args.model, config, workload, None)
  engine_vocab = engine.model_config.vocab_size
  prompts = workload.prompts(engine_vocab)
  output_lens = workload.output_lens()
  report["compute_ceiling"] = compute_ceiling(engine.model_config, list(map(len, prompts)),
                                              output_lens)
  report["jinfer_single_stream"] = single_stream(
      engine, args.single_stream_prompt_len, args.output_len,
      report["memory_bandwidth"]["gb_s"], engine.model_config.vocab_size)
  del engine
  gc.collect()  # one engine's KV cache at a time
  engine, report["jinfer_static"] = _jinfer_run(
      args.model, config.replace(continuous_batching=False), workload, prompts)
  del engine
  gc.collect()
  if not args.skip_hf:
    report["hf_transformers"] = run_hf(args.model, prompts, output_lens, args.hf_batch_size)

  gguf = builtin_gguf_path(args.model) if is_builtin(args.model) else args.model
  run_llama = llama_cpp_peer.available() and not args.skip_llama_cpp and gguf.endswith(".gguf")
  if run_llama:
    report["llama_cpp"] = llama_cpp_peer.offline(gguf, prompts, output_lens)
    report["llama_cpp"]["single_stream"] = llama_cpp_peer.single_stream(
        gguf, ((np.arange(args.single_stream_prompt_len) * 7919)
               % engine_vocab).tolist(), args.output_len)

  tput = lambda k: report[k]["output_tokens_per_s"]
  ratios = {"continuous_over_static": tput("jinfer_continuous") / tput("jinfer_static")}
  if not args.skip_hf:
    ratios["continuous_over_hf"] = tput("jinfer_continuous") / tput("hf_transformers")
    ratios["static_over_hf"] = tput("jinfer_static") / tput("hf_transformers")
  if run_llama:
    ratios["continuous_over_llama_cpp"] = tput("jinfer_continuous") / tput("llama_cpp")
  ratios["continuous_over_compute_ceiling"] = (tput("jinfer_continuous")
                                               / report["compute_ceiling"]["output_tokens_per_s"])
  ratios["single_stream_over_roofline"] = report["jinfer_single_stream"]["fraction_of_roofline"]
  report["ratios_output_tokens_per_s"] = ratios
  emit(report, args.out)


if __name__ == "__main__":
  main()
