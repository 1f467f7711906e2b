"""Engine options, and every spec derived from them (scheduler, token buckets, KV cache, kernels)
in one place."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jinfer.config import ModelConfig
from jinfer.errors import ParameterError
from jinfer.engine.scheduler import SchedulerConfig
from jinfer.engine.step_input import Buckets
from jinfer.models.kernel_options import KernelOptions
from jinfer.parallel.mesh import ParallelConfig
from jinfer.engine.speculative.config import SpeculativeConfig
from pallas_kernels import KVCacheSpec, default_backend
from pallas_kernels.grouped_matmul import default_backend as default_grouped_matmul_backend


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
  max_model_len: int = 2048  # prompt + output tokens per sequence (capped by the model's)
  page_size: int = 16  # tokens per KV-cache page
  num_pages: int | None = None  # default: room for max_num_seqs sequences of half max_model_len
  max_num_seqs: int = 64  # sequences running at once
  max_num_batched_tokens: int = 512  # token budget of one step; long prefills are chunked
  max_prefill_seqs: int = 8  # sequences with a prefill chunk in one step
  enable_prefix_caching: bool = True  # reuse the KV pages of prompts' shared full pages
  # False: static batches (a baseline for benchmarks) that wait for their longest member, each
  # sequence reserving max_model_len slots as an engine without paging must.
  continuous_batching: bool = True
  attention_backend: str | None = None  # None: by platform (xla on CPU, Pallas elsewhere)
  matmul_backend: str | None = None  # int8 matmul, likewise
  grouped_matmul_backend: str | None = None  # MoE experts' grouped matmul, likewise
  interpret: bool = False  # run Pallas kernels in interpret mode (CPU testing)
  quantization: str | None = None  # None, "int8" (W8A16) or "w8a8"; applied at load time
  # Run the layer stack under a scan (compiles in seconds) or unrolled (each matmul reads its
  # weights in place). None: by step size, see `unrolled_max_tokens`.
  scan_layers: bool | None = None
  # With scan_layers=None on the CPU: steps of at most this many tokens run unrolled, larger
  # ones scanned, each unrolled bucket costing a compile of every layer (~10x a scanned one).
  # None: a single stream's steps, its verify step included when it speculates.
  max_unrolled_tokens: int | None = None
  # Requests may ask for prompt_logprobs: compiles a second step variant per bucket that
  # projects every row to logits, used only by steps that carry such a request.
  enable_prompt_logprobs: bool = False
  # Keep compiled steps on disk (JAX's persistent compilation cache, see compilation_cache.py),
  # so the next process with the same model and options compiles nothing.
  compilation_cache: bool = True
  seed: int = 0  # seeds requests that bring none
  tensor_parallel_size: int = 1  # split heads, MLP and vocabulary over this many devices
  # Spread each sequence's KV pages and each step's query rows over this many devices (ring
  # attention; a power of two).
  context_parallel_size: int = 1
  data_parallel_size: int = 1  # engines, each with its own page pool, behind one front end
  # MoE: whole experts per tensor-parallel device instead of each expert split over them.
  enable_expert_parallel: bool = False
  context_layout: str = "zigzag"  # how a step's rows lie over the context ranks, or "plain"
  # Speculative decoding (`SpeculativeConfig`, or its dict or JSON form); None: off.
  speculative_config: SpeculativeConfig | dict | str | None = None

  def __post_init__(self):
    if self.speculative_config is not None:
      object.__setattr__(self, "speculative_config",
                         SpeculativeConfig.parse(self.speculative_config))
    for name in ("max_model_len", "page_size", "max_num_seqs", "max_num_batched_tokens",
                 "max_prefill_seqs"):
      if getattr(self, name) < 1:
        raise ParameterError(name, f"{name} must be >= 1, got {getattr(self, name)}")
    if self.max_num_batched_tokens & (self.max_num_batched_tokens - 1):
      raise ParameterError("max_num_batched_tokens", "max_num_batched_tokens must be a power of "
                                                     "two (it is the largest bucket)")
    cp = self.parallel_config().context_parallel_size
    spec = self.speculative_config
    if cp > 1 and spec is not None and spec.tree() is not None:
      raise ParameterError("speculative_config", f"{spec.method} verifies a tree, which does not "
                           f"run with context parallelism yet: the ring attention takes no tree "
                           f"mask (use context_parallel_size=1)")
    if cp & (cp - 1):
      raise ParameterError("context_parallel_size",
                           f"context_parallel_size must be a power of two, got {cp}")
    if self.max_num_batched_tokens < 2 * cp:
      raise ParameterError("max_num_batched_tokens",
                           f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at "
                           f"least 2 x context_parallel_size ({cp}): each rank holds two chunks")

  def parallel_config(self) -> ParallelConfig:
    return ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                          context_parallel_size=self.context_parallel_size,
                          data_parallel_size=self.data_parallel_size,
                          enable_expert_parallel=self.enable_expert_parallel,
                          context_layout=self.context_layout)

  def for_model(self, model: ModelConfig) -> "EngineConfig":
    """This config with `max_model_len` capped by what the model supports."""
    return dataclasses.replace(self, max_model_len=min(self.max_model_len,
                                                       model.max_position_embeddings))

  @property
  def max_pages_per_seq(self) -> int:
    return -(-self.max_model_len // self.page_size)

  def resolved_num_pages(self) -> int:
    """Pages of one engine's pool (over all its context ranks: a multiple of their number)."""
    if self.num_pages is not None:
      if self.num_pages - 1 < self.max_pages_per_seq:
        raise ParameterError("num_pages", f"num_pages={self.num_pages} cannot hold one sequence "
                                          f"of max_model_len={self.max_model_len} "
                                          f"({self.max_pages_per_seq} pages + the sink page)")
      n = self.num_pages
    else:
      half = -(-self.max_model_len // 2 // self.page_size)
      n = 1 + max(self.max_pages_per_seq, self.max_num_seqs * half)
    cp = self.context_parallel_size
    return -(-n // cp) * cp

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
    if jax.default_backend() != "cpu":
      return 0
    if self.max_unrolled_tokens is not None:
      return self.max_unrolled_tokens
    return self.buckets().pick(1 + self.num_draft_rows)

  def scheduler_config(self) -> SchedulerConfig:
    return SchedulerConfig(max_num_seqs=self.max_num_seqs,
                           max_num_batched_tokens=self.max_num_batched_tokens,
                           max_prefill_seqs=self.max_prefill_seqs,
                           max_pages_per_seq=self.max_pages_per_seq,
                           continuous_batching=self.continuous_batching)

  def buckets(self) -> Buckets:
    cp = self.context_parallel_size
    return Buckets(max_num_seqs=self.max_num_seqs,
                   max_num_batched_tokens=self.max_num_batched_tokens,
                   max_prefill_seqs=self.max_prefill_seqs,
                   max_pages_per_seq=self.max_pages_per_seq, max_model_len=self.max_model_len,
                   # Single-stream decode runs a 1-token bucket; context parallelism needs
                   # every bucket a multiple of 2 x CP (each rank holds two chunks).
                   smallest_bucket=1 if cp == 1 else 2 * cp,
                   num_speculative_tokens=self.num_draft_rows,
                   tree=None if self.speculative_config is None else self.speculative_config.tree())

  @property
  def num_draft_rows(self) -> int:
    spec = self.speculative_config
    return 0 if spec is None else spec.num_draft_rows

  def kv_spec(self, model: ModelConfig, dtype) -> KVCacheSpec:
    return KVCacheSpec(num_layers=model.num_layers, num_pages=self.resolved_num_pages(),
                       page_size=self.page_size, num_kv_heads=model.num_kv_heads,
                       head_dim=model.head_dim, dtype=dtype)

  def kernel_options(self, mesh: Mesh | None = None) -> KernelOptions:
    matmul = self.matmul_backend or _default_matmul_backend()
    return KernelOptions(attention=self.attention_backend or default_backend(),
                         matmul=matmul, int8_transposed=matmul == "xla" and mesh is None,
                         dense=None if mesh is None else "reference",
                         grouped_matmul=(self.grouped_matmul_backend
                                         or default_grouped_matmul_backend()),
                         interpret=self.interpret, quantization=self.quantization, mesh=mesh,
                         context_layout=self.context_layout,
                         expert_parallel=self.enable_expert_parallel)


def _default_matmul_backend() -> str:
  return {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(jax.default_backend(), "xla")


def default_dtype():
  """float32 on the CPU (XLA:CPU's bf16 matvec is ~15x slower), bfloat16 on accelerators."""
  return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
