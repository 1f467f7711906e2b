"""One sequence being generated, and what the engine reports about it."""
from __future__ import annotations

import dataclasses
import enum
import time

from jinfer.sampling.params import SamplingParams


class Status(enum.Enum):
  WAITING = "waiting"
  RUNNING = "running"
  FINISHED = "finished"


@dataclasses.dataclass
class RequestMetrics:
  arrival_time: float
  first_scheduled_time: float | None = None
  first_token_time: float | None = None
  last_token_time: float | None = None
  finished_time: float | None = None
  token_times: list[float] = dataclasses.field(default_factory=list)
  # Disaggregated serving, the last hand-over from the prefill to the decode side: when the
  # prefill side let the sequence go (after its first token), when its pages were on the decode
  # devices, when the decode side took it; and the K/V bytes copied (every hand-over).
  handoff_time: float | None = None
  transfer_done_time: float | None = None
  decode_start_time: float | None = None
  kv_transfer_bytes: int = 0

  def shifted(self, delta: float) -> "RequestMetrics":
    """These times on a clock `delta` seconds ahead (another host's)."""
    t = lambda v: None if v is None else v + delta
    return dataclasses.replace(
        self, arrival_time=self.arrival_time + delta,
        **{f: t(getattr(self, f)) for f in (
            "first_scheduled_time", "first_token_time", "last_token_time", "finished_time",
            "handoff_time", "transfer_done_time", "decode_start_time")},
        token_times=[v + delta for v in self.token_times])

  @property
  def queue_time(self) -> float | None:
    return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

  @property
  def ttft(self) -> float | None:
    return None if self.first_token_time is None else self.first_token_time - self.arrival_time

  @property
  def e2e(self) -> float | None:
    return None if self.finished_time is None else self.finished_time - self.arrival_time

  @property
  def tpot(self) -> float | None:
    """Mean time per output token after the first (vLLM's definition)."""
    n = len(self.token_times)
    if n < 2:
      return None
    return (self.token_times[-1] - self.token_times[0]) / (n - 1)

  @property
  def itl(self) -> list[float]:
    return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclasses.dataclass(eq=False)
class Sequence:
  """One sample of a request (a request with n > 1 has n of them, sharing prompt pages)."""
  seq_id: str
  group_id: str
  index: int  # which of the request's n samples
  prompt_token_ids: list[int]
  params: SamplingParams
  seed: int
  metrics: RequestMetrics
  output_token_ids: list[int] = dataclasses.field(default_factory=list)
  output_logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
  # One entry per prompt token (the first has no context: None), when asked for.
  prompt_logprobs: list[dict[int, float] | None] = dataclasses.field(default_factory=list)
  # Per KV group, the pages by position (-1: given back by a window group); empty while the
  # sequence holds none.
  pages: list[list[int]] = dataclasses.field(default_factory=list)
  # The prefix cache's hash chain over the sequence's full pages (its tokens only grow), and
  # how many of its pages were offered to the cache already.
  page_hashes: list[int] = dataclasses.field(default_factory=list)
  pages_offered: int = 0
  num_computed_tokens: int = 0
  num_cached_tokens: int = 0  # prompt tokens served by the prefix cache, first admission
  # Speculative decoding with a draft model: how many of the computed tokens the draft's KV cache
  # still lacks (1 after a step accepted every draft: the last draft was verified, never fed to
  # the draft). The draft catches up on them next step; 0 whenever num_computed_tokens resets.
  draft_lag: int = 0
  # Speculation's per-sequence state, of the proposer's own type (`Proposer.new_state`).
  spec_state: object = None
  status: Status = Status.WAITING
  finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
  stop_reason: int | str | None = None
  text: str = ""  # detokenized output, stop strings handled
  sent_text_len: int = 0  # how much of `text` has been reported
  sent_tokens: int = 0  # how many tokens have been reported
  detok: object = None  # IncrementalDetokenizer, made by the engine
  cache_salt: object = None
  # LoRA: the adapter's request (a LoRARequest; None: the base model), and the device slot it
  # holds while running (jinfer/engine/lora_slots.py).
  lora: object = None
  lora_slot: int | None = None
  # Under a structured-output constraint: its matcher (llguidance), advanced with each token
  # the sequence keeps; it masks the sequence's next token (jinfer/sampling/grammar.py).
  matcher: object = None
  # Siblings wait for the first sample's prompt so they hit its cached pages.
  wait_for: "Sequence | None" = None

  @property
  def token_ids(self) -> list[int]:
    return self.prompt_token_ids + self.output_token_ids

  @property
  def num_tokens(self) -> int:
    return len(self.prompt_token_ids) + len(self.output_token_ids)

  @property
  def finished(self) -> bool:
    return self.status is Status.FINISHED

  def mark_token_time(self, now: float | None = None):
    now = time.monotonic() if now is None else now
    if self.metrics.first_token_time is None:
      self.metrics.first_token_time = now
    self.metrics.token_times.append(now)
    self.metrics.last_token_time = now


@dataclasses.dataclass
class CompletionOutput:
  index: int
  text: str
  token_ids: list[int]
  finish_reason: str | None
  stop_reason: int | str | None = None
  logprobs: list[dict[int, float]] | None = None  # per token: {token_id: logprob}
  # What is new since the last report (streaming).
  delta_text: str = ""
  delta_token_ids: list[int] = dataclasses.field(default_factory=list)
  delta_logprobs: list[dict[int, float]] | None = None


@dataclasses.dataclass
class RequestOutput:
  request_id: str
  prompt: str | None
  prompt_token_ids: list[int]
  outputs: list[CompletionOutput]
  finished: bool
  metrics: RequestMetrics | None = None
  num_cached_tokens: int = 0
  prompt_logprobs: list[dict[int, float] | None] | None = None
  error: str | None = None
