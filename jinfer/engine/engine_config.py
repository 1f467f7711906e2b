"""Engine options: sizes of the page pool and of a step, and which kernels run."""
from __future__ import annotations

import dataclasses


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
  attention_backend: str | None = None  # None: by platform (reference on CPU, Pallas elsewhere)
  matmul_backend: str | None = None  # int8 matmul, likewise
  interpret: bool = False  # run Pallas kernels in interpret mode (CPU testing)
  quantization: str | None = None  # None, "int8" (W8A16) or "w8a8"; applied at load time
  # Requests may ask for prompt_logprobs: compiles a second step variant per bucket that
  # projects every row to logits, used only by steps that carry such a request.
  enable_prompt_logprobs: bool = False
  seed: int = 0  # seeds requests that bring none

  def __post_init__(self):
    for name in ("max_model_len", "page_size", "max_num_seqs", "max_num_batched_tokens",
                 "max_prefill_seqs"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    if self.max_num_batched_tokens & (self.max_num_batched_tokens - 1):
      raise ValueError("max_num_batched_tokens must be a power of two (it is the largest bucket)")

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
