"""Per-request sampling options, validated when made so bad values never reach the queue."""
from __future__ import annotations

import dataclasses

MAX_LOGPROBS = 20  # top-N logprobs are computed on device with this static N


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
  n: int = 1
  temperature: float = 1.0  # 0 means greedy
  top_p: float = 1.0
  top_k: int = -1  # -1 (or 0) disables
  min_p: float = 0.0
  repetition_penalty: float = 1.0
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  seed: int | None = None
  max_tokens: int | None = 16  # None: up to the context limit
  min_tokens: int = 0
  stop: tuple[str, ...] = ()
  stop_token_ids: tuple[int, ...] = ()
  include_stop_str_in_output: bool = False
  ignore_eos: bool = False
  logprobs: int | None = None  # top-N logprobs per generated token
  prompt_logprobs: int | None = None  # top-N logprobs per prompt token
  skip_special_tokens: bool = True

  def __post_init__(self):
    if isinstance(self.stop, str):
      object.__setattr__(self, "stop", (self.stop,))
    object.__setattr__(self, "stop", tuple(self.stop or ()))
    object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
    if self.top_k == 0:
      object.__setattr__(self, "top_k", -1)

    def check(ok: bool, msg: str):
      if not ok:
        raise ValueError(msg)

    check(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
    check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
    check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
    check(isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
          f"top_k must be -1 (disabled) or >= 1, got {self.top_k!r}")
    check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
    check(self.repetition_penalty > 0.0,
          f"repetition_penalty must be > 0, got {self.repetition_penalty}")
    check(-2.0 <= self.presence_penalty <= 2.0,
          f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
    check(-2.0 <= self.frequency_penalty <= 2.0,
          f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
    check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
          f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
    check(isinstance(self.min_tokens, int) and self.min_tokens >= 0,
          f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
    check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
          f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
    check(self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}")
    check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
    for name in ("logprobs", "prompt_logprobs"):
      v = getattr(self, name)
      check(v is None or (isinstance(v, int) and 0 <= v <= MAX_LOGPROBS),
            f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0
