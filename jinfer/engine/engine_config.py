"""Engine options, and every spec derived from them (scheduler, token buckets, KV cache, kernels)
in one place."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jinfer.config import ModelConfig
from jinfer.engine.scheduler import SchedulerConfig
from jinfer.engine.step_input import Buckets
from jinfer.models.kernel_options import KernelOptions
from pallas_kernels import KVCacheSpec, default_backend


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
  max_model_len: int = 2048  # prompt + output tokens per sequence (capped by the model's)
  page_size: int = 16
  num_pages: int | None = None  # default: room for max_num_seqs sequences of half max_model_len
  max_num_seqs: int = 64
  max_num_batched_tokens: int = 512  # token budget of one step; long prefills are chunked
  max_prefill_seqs: int = 8  # sequences with a prefill chunk in one step
  enable_prefix_caching: bool = True
  # False: static batches (a baseline for benchmarks) that wait for their longest member, each
  # sequence reserving max_model_len slots as an engine without paging must.
  continuous_batching: bool = True
  attention_backend: str | None = None  # None: by platform (xla on CPU, Pallas elsewhere)
  matmul_backend: str | None = None  # int8 matmul, likewise
  interpret: bool = False  # run Pallas kernels in interpret mode (CPU testing)
  quantization: str | None = None  # None, "int8" (W8A16) or "w8a8"; applied at load time
  # Run the layer stack under a scan (compiles in seconds) or unrolled (each matmul reads its
  # weights in place). None: by step size, see `unrolled_max_tokens`.
  scan_layers: bool | None = None
  # With scan_layers=None on the CPU: steps of at most this many tokens run unrolled, larger
  # ones scanned. 1: a single stream's decode steps, each unrolled bucket costing a compile of
  # every layer (~10x a scanned one).
  max_unrolled_tokens: int = 1
  # Requests may ask for prompt_logprobs: compiles a second step variant per bucket that
  # projects every row to logits, used only by steps that carry such a request.
  enable_prompt_logprobs: bool = False
  # Keep compiled steps on disk (JAX's persistent compilation cache, see compilation_cache.py),
  # so the next process with the same model and options compiles nothing.
  compilation_cache: bool = True
  seed: int = 0  # seeds requests that bring none

  def __post_init__(self):
    for name in ("max_model_len", "page_size", "max_num_seqs", "max_num_batched_tokens",
                 "max_prefill_seqs"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    if self.max_num_batched_tokens & (self.max_num_batched_tokens - 1):
      raise ValueError("max_num_batched_tokens must be a power of two (it is the largest bucket)")

  def for_model(self, model: ModelConfig) -> "EngineConfig":
    """This config with `max_model_len` capped by what the model supports."""
    return dataclasses.replace(self, max_model_len=min(self.max_model_len,
                                                       model.max_position_embeddings))

  @property
  def max_pages_per_seq(self) -> int:
    return -(-self.max_model_len // self.page_size)

  def resolved_num_pages(self) -> int:
    if self.num_pages is not None:
      if self.num_pages - 1 < self.max_pages_per_seq:
        raise ValueError(f"num_pages={self.num_pages} cannot hold one sequence of max_model_len="
                         f"{self.max_model_len} ({self.max_pages_per_seq} pages + the sink page)")
      return self.num_pages
    half = -(-self.max_model_len // 2 // self.page_size)
    return 1 + max(self.max_pages_per_seq, self.max_num_seqs * half)

  def unrolled_max_tokens(self) -> int:
    """Steps of at most this many tokens run the unrolled stack, larger ones the scanned one.

    By default, on the CPU, small decode steps run unrolled: a scanned layer copies its weights
    out of the stack before each matmul there (a dynamic slice feeds no dot in place), which
    dominates a step that reads every weight for a few rows; each unrolled bucket compiles ~10x
    slower, so only the smallest is by default. Prefill and large batches measure the same or better
    scanned. Elsewhere the scan reads its weights in place and runs everything.
    """
    if self.scan_layers is not None:
      return 0 if self.scan_layers else self.max_num_batched_tokens
    return self.max_unrolled_tokens if jax.default_backend() == "cpu" else 0

  def scheduler_config(self) -> SchedulerConfig:
    return SchedulerConfig(max_num_seqs=self.max_num_seqs,
                           max_num_batched_tokens=self.max_num_batched_tokens,
                           max_prefill_seqs=self.max_prefill_seqs,
                           max_pages_per_seq=self.max_pages_per_seq,
                           continuous_batching=self.continuous_batching)

  def buckets(self) -> Buckets:
    return Buckets(max_num_seqs=self.max_num_seqs,
                   max_num_batched_tokens=self.max_num_batched_tokens,
                   max_prefill_seqs=self.max_prefill_seqs,
                   max_pages_per_seq=self.max_pages_per_seq, max_model_len=self.max_model_len)

  def kv_spec(self, model: ModelConfig, dtype) -> KVCacheSpec:
    return KVCacheSpec(num_layers=model.num_layers, num_pages=self.resolved_num_pages(),
                       page_size=self.page_size, num_kv_heads=model.num_kv_heads,
                       head_dim=model.head_dim, dtype=dtype)

  def kernel_options(self) -> KernelOptions:
    return KernelOptions(attention=self.attention_backend or default_backend(),
                         matmul=self.matmul_backend or _default_matmul_backend(),
                         interpret=self.interpret, quantization=self.quantization)


def _default_matmul_backend() -> str:
  return {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(jax.default_backend(), "reference")


def default_dtype():
  """float32 on the CPU (XLA:CPU's bf16 matvec is ~15x slower), bfloat16 on accelerators."""
  return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
