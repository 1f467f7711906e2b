"""`jinfer plan`: does a model, with these engine options, fit and build on a target it may not
have (a TPU slice, an NVIDIA GPU)?

The engine's steps are built by the target's real compiler from shapes
(`jinfer/engine/compile_only.py`, devices from `jinfer/targets/`), so the answers are the
compiler's: which step buckets build, the bytes each needs per device, and whether they fit its
HBM at `gpu_memory_utilization`. Time figures are estimates and say from what: the compiler's
cost model where it has one (XLA:TPU, which counts nothing for Pallas kernels), otherwise bytes
over the target's published HBM bandwidth; never a measurement.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from jinfer.engine.compile_only import AbstractEngine, StepBuild
from jinfer.engine.engine_config import EngineConfig
from jinfer.engine.weight_quantization import default_quantization
from jinfer.errors import ParameterError
from jinfer.loader import load_model
from jinfer.parallel.sharding import valid_tensor_parallel_sizes
from jinfer.targets import Target, target as find_target

DECODE_BATCHES = (1, 8, 64)
ESTIMATE = "estimate"


@dataclasses.dataclass
class Plan:
  model: str
  target: Target
  engine: AbstractEngine
  steps: list[StepBuild]
  gpu_memory_utilization: float
  context_len: int  # the decode estimates' tokens of context per sequence

  # -- memory, per device ---------------------------------------------------------------------
  @property
  def usable_bytes(self) -> int:
    return int(self.target.hbm_bytes * self.gpu_memory_utilization)

  @property
  def max_temp_bytes(self) -> int:
    return max((s.temp_bytes for s in self.steps if s.built), default=0)

  @property
  def peak_bytes(self) -> int:
    """The compiler's figure for the step that needs most: params, pool, inputs, temporaries."""
    return max((s.peak_bytes for s in self.steps if s.built), default=0)

  @property
  def fits(self) -> bool:
    return all(s.built for s in self.steps) and self.peak_bytes <= self.usable_bytes

  @property
  def max_num_pages(self) -> int:
    """The largest pool (`num_pages`) beside the weights and the largest step's temporaries."""
    e = self.engine
    # Everything but the pool: from the compiler's peak where a step built (weights, inputs,
    # outputs, temporaries), else the weights.
    rest = self.peak_bytes - e.kv_cache_bytes if self.peak_bytes else e.weight_bytes
    # 1% kept back: the compiler pads the pool's arrays to its tiles, which page_bytes does
    # not count.
    free = int((self.usable_bytes - rest) * 0.99)
    cp = e.config.parallel.context_parallel_size
    return max(0, free // e.page_bytes * cp)

  def sequences_at(self, num_pages: int, tokens: int) -> int:
    """Sequences of `tokens` tokens a pool of `num_pages` holds (the sink page aside)."""
    c = self.engine.config
    need = c.kv_groups.page_need(tokens, c.cache.page_size, c.scheduler.max_num_batched_tokens)
    return max(0, (num_pages - 1) // need)

  # -- estimates ------------------------------------------------------------------------------
  def decode_estimates(self, batches: tuple[int, ...] = DECODE_BATCHES) -> list[dict]:
    """Decode steps of B sequences at `context_len` tokens each: the step reads every weight
    and each sequence's KV once, and reads and writes whatever its built step relayouts
    (`StepBuild.copy_bytes`, where the plan built that bucket), so its time is at least those
    bytes over the published HBM bandwidth, and at least 2 flops per weight per sequence over
    the published bf16 peak; the larger bound is the estimate. (XLA:TPU's cost model is not
    used: it counts a scanned layer body once, and nothing for Pallas kernels.) For MoE models
    every expert's weights count, an upper bound at small batches."""
    e, t = self.engine, self.target
    kv_token = e.page_bytes / e.config.cache.page_size  # one token's K/V, every layer, per device
    copies = {s.tokens: s.copy_bytes for s in self.steps
              if s.built and not (s.verify or s.prompt_logprobs)}
    out = []
    for b in batches:
      if b > e.config.scheduler.max_num_seqs:
        continue
      bucket = e.buckets.pick(b)
      moved = 2 * copies.get(bucket, 0)
      memory = (e.weight_bytes + b * self.context_len * kv_token + moved) / t.hbm_bandwidth
      compute = 2 * e.weight_elements * b / t.bf16_flops
      seconds = max(memory, compute)
      out.append({"batch": b, "bucket": bucket, "context_len": self.context_len,
                  "step_seconds": seconds, "tokens_per_second": b / seconds,
                  "bound": "memory" if memory >= compute else "compute",
                  "relayout_bytes_moved": moved,
                  "source": "bytes / published HBM bandwidth, flops / published bf16 peak",
                  "kind": ESTIMATE})
    return out

  def advice(self) -> list[str]:
    """What would make a plan that does not fit fit (empty when it fits)."""
    if self.fits:
      return []
    e, out = self.engine, []
    refused = [s for s in self.steps if not s.built]
    if refused and not any("HBM" in (s.error or "") for s in refused):
      return [f"{len(refused)} step(s) do not build (errors above): not a memory question"]
    c, pages = e.config, self.max_num_pages
    one_seq = self.sequences_at(pages, c.model.max_model_len)
    if one_seq >= 1:
      out.append(f"--num-pages {pages} (room for {one_seq} sequences of max_model_len="
                 f"{c.model.max_model_len}; the pool planned has {e.kv_spec.num_pages})")
    else:
      over = e.weight_bytes + self.max_temp_bytes - self.usable_bytes
      what = (f"the weights alone ({_gib(e.weight_bytes)}) exceed" if over > 0 else
              "the weights leave no room for one sequence of max_model_len in")
      out.append(f"{what} {self.gpu_memory_utilization:.0%} of {_gib(self.target.hbm_bytes)} "
                 f"per device")
      q = c.model.quantization
      if q is None:
        out.append("--quantization int8 (about half the weight bytes) or int4 (about a "
                   "quarter)")
      elif q in ("int8", "w8a8", "fp8"):
        out.append("--quantization int4 (about half of int8's weight bytes)")
      tp, n = c.parallel.tensor_parallel_size, self.target.num_devices
      more = [s for s in valid_tensor_parallel_sizes(e.model_config, n) if s > tp
              and s * c.parallel.context_parallel_size <= n]
      # The smallest that leaves the weights (split evenly) a fifth of the room for the rest.
      enough = [s for s in more if e.weight_bytes * tp / s < 0.8 * self.usable_bytes]
      if enough:
        out.append(f"--tensor-parallel-size {enough[0]} (valid on {self.target.name}: "
                   f"{', '.join(map(str, more))})")
      if c.cache.kv_cache_dtype == "auto":
        out.append("--kv-cache-dtype int8 (about half the KV bytes)")
      out.append(f"a smaller --max-model-len (now {c.model.max_model_len})")
    return out

  def to_json(self) -> dict[str, Any]:
    e, t = self.engine, self.target
    c = e.config
    return {
        "model": self.model,
        "target": {"name": t.name, "chip": t.chip, "devices": t.num_devices,
                   "hbm_bytes_per_device": t.hbm_bytes, "hbm_bandwidth": t.hbm_bandwidth,
                   "bf16_flops": t.bf16_flops, "source": "published figures"},
        "options": {"dtype": jnp.dtype(e.dtype).name,
                    "quantization": c.model.quantization,
                    "kv_cache_dtype": c.cache.kv_cache_dtype, "page_size": c.cache.page_size,
                    "max_model_len": c.model.max_model_len,
                    "max_num_seqs": c.scheduler.max_num_seqs,
                    "max_num_batched_tokens": c.scheduler.max_num_batched_tokens,
                    "tensor_parallel_size": c.parallel.tensor_parallel_size,
                    "context_parallel_size": c.parallel.context_parallel_size,
                    "enable_expert_parallel": c.parallel.enable_expert_parallel,
                    "gpu_memory_utilization": self.gpu_memory_utilization,
                    "attention_backend": c.attention_backend},
        "memory_per_device": {
            "weights": e.weight_bytes, "kv_pool": e.kv_cache_bytes,
            "kv_pool_pages": e.kv_spec.num_pages, "page_bytes": e.page_bytes,
            "max_step_temp": self.max_temp_bytes, "peak": self.peak_bytes,
            "usable": self.usable_bytes, "hbm": t.hbm_bytes, "fits": self.fits,
            "over_by": max(0, self.peak_bytes - self.usable_bytes),
            "source": "the compiler's memory analysis of each step"},
        "capacity": {"max_num_pages": self.max_num_pages,
                     "max_sequences_at_max_model_len":
                         self.sequences_at(self.max_num_pages, c.model.max_model_len)},
        "steps": [{"tokens": s.tokens, "variant": _variant(s), "built": s.built,
                   "error": s.error, "compile_seconds": round(s.seconds, 2),
                   "temp_bytes": s.temp_bytes, "peak_bytes": s.peak_bytes,
                   "collectives": s.collectives, "relayout_bytes": s.copy_bytes,
                   "compiler_cost": s.cost} for s in self.steps],
        "decode": self.decode_estimates(),
        "advice": self.advice(),
    }

  def report(self) -> str:
    """The plan as a person reads it."""
    e, t, c = self.engine, self.target, self.engine.config
    par = c.parallel
    lines = [f"{self.model} on {t.name} ({t.num_devices} x {t.chip}, "
             f"{_gib(t.hbm_bytes)} HBM and {t.hbm_bandwidth / 1e12:.2f} TB/s each, published)",
             f"  {e.model_config.num_layers} layers, dtype {jnp.dtype(e.dtype).name}, "
             f"quantization {c.model.quantization}, KV {c.cache.kv_cache_dtype}, page "
             f"{c.cache.page_size}, TP {par.tensor_parallel_size} CP "
             f"{par.context_parallel_size}, max_model_len {c.model.max_model_len}, "
             f"max_num_seqs {c.scheduler.max_num_seqs}",
             "memory per device (compiler's memory analysis):",
             f"  weights {_gib(e.weight_bytes)}, KV pool {_gib(e.kv_cache_bytes)} "
             f"({e.kv_spec.num_pages} pages of {e.page_bytes / 2**20:.2f} MiB), largest step "
             f"temporaries {_gib(self.max_temp_bytes)}; " + (
                 f"peak {_gib(self.peak_bytes)} of {_gib(self.usable_bytes)} usable "
                 f"({self.gpu_memory_utilization:.0%}): " + (
                     "FITS" if self.fits else "DOES NOT FIT" + (
                         f" (over by {_gib(self.peak_bytes - self.usable_bytes)})"
                         if self.peak_bytes > self.usable_bytes else ""))
                 if any(s.built for s in self.steps) else "no step built, so no peak"),
             f"  room for {self.max_num_pages} pages: "
             f"{self.sequences_at(self.max_num_pages, c.model.max_model_len)} sequences of "
             f"max_model_len",
             f"steps ({sum(s.built for s in self.steps)} of {len(self.steps)} built):"]
    for s in self.steps:
      head = f"  {s.tokens:>5} tokens {_variant(s):<8}"
      if s.built:
        coll = ", ".join(f"{n} {k}" for k, n in sorted(s.collectives.items()))
        lines.append(f"{head} built in {s.seconds:5.1f} s, temp {s.temp_bytes / 2**20:9.1f} MiB"
                     + (f", relayouts {s.copy_bytes / 2**20:.0f} MiB" if s.copy_bytes else "")
                     + (f", collectives: {coll}" if coll else ""))
      else:
        lines.append(f"{head} REFUSED: {s.error}")
    lines.append(f"decode estimates at {self.context_len} tokens of context (estimates, not "
                 f"measurements):")
    for d in self.decode_estimates():
      lines.append(f"  batch {d['batch']:>3}: {d['step_seconds'] * 1e3:8.2f} ms/step, "
                   f"{d['tokens_per_second']:9.1f} tok/s ({d['bound']}-bound; {d['source']}"
                   + (f"; {d['relayout_bytes_moved'] / 2**20:.0f} MiB of relayouts moved"
                      if d["relayout_bytes_moved"] else "") + ")")
    advice = self.advice()
    if advice:
      lines.append("to make it fit, any of:")
      lines += [f"  {a}" for a in advice]
    return "\n".join(lines)


def _variant(s: StepBuild) -> str:
  return "verify" if s.verify else "prompt_lp" if s.prompt_logprobs else "plain"


def _gib(n: float) -> str:
  return f"{n / 2**30:.2f} GiB"


def plan(model: str, target: str, *, config: EngineConfig | None = None, dtype=None,
         gpu_memory_utilization: float = 0.9, context_len: int | None = None,
         buckets: list[int] | None = None) -> Plan:
  """Plan `model` (a built-in name, an HF directory, a .gguf file, a config.json, or a shipped
  config's name such as "llama-3.1-70b") with `config` on `target` (see `jinfer.targets`).
  `buckets`: only these token buckets (default: every step the engine warms up);
  `context_len`: the decode estimates' context (default: half max_model_len)."""
  if not 0 < gpu_memory_utilization <= 1:
    raise ParameterError("gpu_memory_utilization", f"gpu_memory_utilization must be in (0, 1], "
                                                   f"got {gpu_memory_utilization}")
  t = find_target(target)
  config = default_quantization(config or EngineConfig(), model, t.platform)
  params = None
  if config.model.quantization == "gguf":  # the blocks' shapes come from the file
    model_config, params, _ = load_model(model, keep_gguf_quantized=True, load_tokenizer=False)
  else:
    model_config, _, _ = load_model(model, config_only=True, load_tokenizer=False)
  engine = AbstractEngine(model_config, config, t.devices(), t.platform, dtype, params)
  shapes = engine.shapes()
  if buckets is not None:
    unknown = sorted(set(buckets) - {s[0] for s in shapes})
    if unknown:
      raise ParameterError("buckets", f"no step bucket of {unknown} tokens; the engine's are "
                           f"{sorted({s[0] for s in shapes})}")
    shapes = [s for s in shapes if s[0] in buckets]
  steps = [engine.build(s) for s in shapes]
  ctx = context_len or max(1, engine.config.model.max_model_len // 2)
  return Plan(model, t, engine, steps, gpu_memory_utilization, ctx)

