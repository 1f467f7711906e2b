"""Data parallelism: several engines, each on its own devices with its own page pool and
scheduler, behind the one-engine interface, so `LLM` and the server drive them unchanged.

A request goes to the rank that has seen its prefix, unless that rank is too busy
(`PrefixRouter`). Ranks step concurrently (one thread each: a device step releases the GIL).
"""
from __future__ import annotations

import concurrent.futures
import itertools
import time

from jinfer.engine import weight_update
from jinfer.engine.disaggregated import DisaggregatedEngine
from jinfer.engine.engine import EngineStats, LLMEngine
from jinfer.engine.engine_config import EngineConfig
from jinfer.engine.front_end import FrontEnd, combined_stats
from jinfer.engine.prefix_router import PrefixRouter
from jinfer.engine.request import RequestOutput
from jinfer.parallel.mesh import data_parallel_devices
from jinfer.sampling.params import SamplingParams


class DataParallelEngine(FrontEnd):
  """`data_parallel_size` engines of `config`; see the module docstring."""

  def _check(self, config: EngineConfig) -> None:
    data_parallel_devices(config.parallel)  # enough devices?

  def _build(self, model_config, params, tokenizer, config: EngineConfig, dtype,
             warmup: bool | str):
    rank_config = config.replace(data_parallel_size=1)
    self.engines = [LLMEngine.from_parts(model_config, params, tokenizer, config=rank_config,
                                         dtype=dtype, warmup=False, devices=devices)
                    for devices in data_parallel_devices(config.parallel)]
    e0 = self.engines[0]
    self.model_config, self.tokenizer, self.config = e0.model_config, tokenizer, e0.config
    self.max_model_len = e0.max_model_len
    self.router = PrefixRouter.over(e0, config.scheduler.max_num_seqs)
    self._pool = concurrent.futures.ThreadPoolExecutor(len(self.engines),
                                                       thread_name_prefix="jinfer-dp")
    self._rank_of: dict[str, int] = {}  # request id -> rank, while unfinished
    self._ids = itertools.count()
    t0 = time.monotonic()
    if warmup:  # the ranks compile side by side, each its startup buckets then the rest
      rest = warmup if isinstance(warmup, str) else None
      list(self._pool.map(lambda e: e.warmup(rest), self.engines))
    self.warmup_seconds = time.monotonic() - t0

  # -- requests -----------------------------------------------------------------------------
  def tokenize(self, prompt: str | list[int]) -> list[int]:
    return self.engines[0].tokenize(prompt)

  def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
    self.engines[0].validate(prompt_token_ids, params)

  def route(self, prompt_token_ids: list[int], cache_salt: str | None = None) -> int:
    """The rank a request with this prompt goes to (and remember its prefix there)."""
    return self.router.route(prompt_token_ids, cache_salt,
                             [self.load(r) for r in range(len(self.engines))])

  def load(self, rank: int) -> int:
    """Sequences a rank holds, running or waiting."""
    s = self.engines[rank].scheduler
    return len(s.running) + len(s.waiting)

  def add_request(self, request_id: str | None, prompt: str | list[int],
                  params: SamplingParams | None = None, *, arrival_time: float | None = None,
                  cache_salt: str | None = None, lora_request=None) -> str:
    request_id = str(next(self._ids)) if request_id is None else str(request_id)
    if request_id in self._rank_of:
      raise ValueError(f"request id {request_id!r} is already in use")
    ids = self.tokenize(prompt)
    self.validate(ids, params or SamplingParams())
    # A rank's prefix cache holds one adapter's pages apart from another's: route by both.
    rank = self.route(ids, cache_salt if lora_request is None else
                      f"{cache_salt}:lora:{lora_request.lora_int_id}")
    self.engines[rank].add_request(request_id, prompt, params, arrival_time=arrival_time,
                                   cache_salt=cache_salt, lora_request=lora_request)
    self._rank_of[request_id] = rank
    return request_id

  def add_lora(self, lora_request) -> None:
    for e in self.engines:
      e.add_lora(lora_request)

  def update_lora(self, name_or_id, tensors) -> None:
    # The first rank's check refuses bad tensors before any rank is written: all hold one model.
    for e in self.engines:
      e.update_lora(name_or_id, tensors)

  def remove_lora(self, lora_int_id: int) -> bool:
    return any([e.remove_lora(lora_int_id) for e in self.engines])

  def list_loras(self) -> list:
    return self.engines[0].list_loras()

  def abort(self, request_id: str) -> bool:
    rank = self._rank_of.pop(str(request_id), None)
    return rank is not None and self.engines[rank].abort(request_id)

  def has_unfinished_requests(self) -> bool:
    return any(e.has_unfinished_requests() for e in self.engines)

  def close(self):
    for e in self.engines:
      e.close()

  def wait_until_compiled(self) -> None:
    for e in self.engines:
      e.wait_until_compiled()

  def running_request_ids(self) -> set[str]:
    return set().union(*(e.running_request_ids() for e in self.engines))

  # -- weights, pausing and sleeping: every rank alike (see LLMEngine) ----------------------
  def _quiet(self, what: str) -> None:
    for e in self.engines:  # every rank checked before any changes
      e._quiet(what)

  def update_weights(self, params: dict) -> None:
    self._quiet("update_weights")
    for e in self.engines:
      e.update_weights(params)

  def load_weights(self, named_arrays) -> None:
    e0 = self.engines[0]
    self.update_weights(weight_update.from_hf(e0.model_config, named_arrays, e0.dtype))

  def pause_generation(self) -> None:
    for e in self.engines:
      e.pause_generation()

  def resume_generation(self) -> None:
    for e in self.engines:
      e.resume_generation()

  @property
  def is_paused(self) -> bool:
    return self.engines[0].is_paused

  @property
  def is_sleeping(self) -> bool:
    return self.engines[0].is_sleeping

  def sleep(self, level: int = 1) -> None:
    if level > self.engines[0]._sleep_level:
      self._quiet("sleep")
    for e in self.engines:
      e.sleep(level)

  def wake_up(self) -> None:
    for e in self.engines:
      e.wake_up()

  # -- the loop -----------------------------------------------------------------------------
  def step(self) -> list[RequestOutput]:
    """One step of every rank that has work, concurrently."""
    busy = [e for e in self.engines if e.has_unfinished_requests()]
    outputs = [o for outs in self._pool.map(LLMEngine.step, busy) for o in outs]
    for o in outputs:
      if o.finished:
        self._rank_of.pop(o.request_id, None)
    return outputs

  def stats(self) -> EngineStats:
    """Counts summed over ranks; ratios are the ranks' mean; steps the busiest rank's."""
    return combined_stats([e.stats() for e in self.engines])


def create_engine(model: str, *, config: EngineConfig, dtype=None, warmup: bool | str = True,
                  skip_tokenizer_init: bool = False
                  ) -> LLMEngine | DataParallelEngine | DisaggregatedEngine:
  """One engine, the data-parallel front end when `data_parallel_size > 1`, or prefill and
  decode engines on separate devices with `kv_transfer_config`."""
  cls = (DisaggregatedEngine if config.kv_transfer is not None else
         DataParallelEngine if config.parallel.data_parallel_size > 1 else LLMEngine)
  return cls(model, dtype=dtype, config=config, warmup=warmup,
             skip_tokenizer_init=skip_tokenizer_init)
