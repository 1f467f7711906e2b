"""AsyncLLMEngine: an LLMEngine driven by one background thread, consumed from asyncio.

The jitted step blocks for as long as the device works, so it cannot run on the event loop.
One thread owns the LLMEngine: it takes adds and aborts from a queue, steps while there is work,
sleeps on an event when idle, and hands each output to its request's asyncio queue through
`loop.call_soon_threadsafe`. Nothing else touches the LLMEngine's mutable state; validation
(which only reads the model's limits) runs on the caller's side so a bad request raises at the
call, before anything is queued.

Callers such as the HTTP server use only this class: `tokenizer`, `max_model_len`, `tokenize`,
`validate`, and `prepare`, which runs a request's tokenizing, chat-template rendering and
validation on worker threads, so that no request stalls the event loop that streams the others.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import threading
import time
from typing import AsyncIterator, Callable, TypeVar

from jinfer.engine.engine import EngineStats, LLMEngine
from jinfer.engine.request import RequestOutput
from jinfer.errors import ParameterError
from jinfer.sampling.params import SamplingParams
from jinfer.tokenizer import Tokenizer

log = logging.getLogger(__name__)
T = TypeVar("T")


class QueueFullError(RuntimeError):
  """Too many requests are already waiting to be scheduled."""


class EngineDeadError(RuntimeError):
  """The engine is shutting down or its loop died: it takes no requests."""


class RequestFailedError(RuntimeError):
  """The engine failed this request (the others go on)."""


class RequestAbortedError(RuntimeError):
  """The request was aborted by someone other than its consumer (`abort`, shutdown)."""


@dataclasses.dataclass(eq=False)
class _Sink:
  """Where one request's outputs go: an asyncio queue on the consumer's event loop."""
  loop: asyncio.AbstractEventLoop
  queue: asyncio.Queue
  num_seqs: int

  def put(self, item: RequestOutput | BaseException) -> bool:
    try:
      self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
      return True
    except RuntimeError:  # the consumer's loop is closed: nobody will read this
      return False


@dataclasses.dataclass
class _Add:
  request_id: str
  prompt_token_ids: list[int]
  params: SamplingParams
  arrival_time: float
  cache_salt: str | None
  sink: _Sink
  lora_request: object = None  # a LoRARequest, registered with the engine already


@dataclasses.dataclass
class _Abort:
  request_id: str
  error: BaseException | None  # delivered to the consumer, if it is still there
  done: tuple[asyncio.AbstractEventLoop, asyncio.Future] | None = None


class RequestStream:
  """The outputs of one request as they come. Closing it (or cancelling the task that iterates
  it, or dropping it) before the request finished aborts the request and frees its pages."""

  def __init__(self, engine: "AsyncLLMEngine", request_id: str, sink: _Sink):
    self.request_id = request_id
    self._engine, self._sink = engine, sink
    self._done = False

  def __aiter__(self) -> "RequestStream":
    return self

  @property
  def done(self) -> bool:
    """Finished, failed or closed: nothing more will come."""
    return self._done

  async def __anext__(self) -> RequestOutput:
    if self._done:
      raise StopAsyncIteration
    try:
      item = await self._sink.queue.get()
    except BaseException:  # cancelled: the consumer is gone
      self.close()
      raise
    if isinstance(item, BaseException):
      self._done = True
      raise item
    if item.finished:
      self._done = True
    return item

  async def aclose(self):
    self.close()

  def close(self):
    """Abort the request unless it already ended."""
    if not self._done:
      self._done = True
      self._engine._submit_abort(_Abort(self.request_id, None))

  def __del__(self):
    self.close()


class AsyncLLMEngine:
  """`max_waiting`: sequences queued but not yet scheduled beyond which `generate` raises
  QueueFullError (a request with n samples counts n)."""

  def __init__(self, engine: LLMEngine, *, max_waiting: int = 256):
    if max_waiting < 1:
      raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
    self.engine = engine
    self.max_waiting = max_waiting
    self._lock = threading.Lock()
    # Appended to without the lock for aborts: `RequestStream.__del__` may run in any thread,
    # the engine thread included while it holds the lock. Deque append/popleft are atomic.
    self._commands: collections.deque[_Add | _Abort] = collections.deque()
    self._ids = itertools.count()
    self._wake = threading.Event()
    self._sinks: dict[str, _Sink] = {}  # request id -> sink, for requests still in flight
    self._queued_seqs = 0  # sequences in `_commands` adds
    self._engine_waiting = 0  # the engine's waiting sequences, as of its last change
    self._stats = engine.stats()
    self._thread: threading.Thread | None = None
    self._stop: str | None = None  # None, "drain" or "abort"
    self._accepting = False
    self.error: BaseException | None = None  # what killed the loop, if anything
    self._workers = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="jinfer-prepare")

  # -- lifecycle ----------------------------------------------------------------------------
  def start(self):
    if self._thread is not None:
      raise RuntimeError("the engine loop is already started")
    self._accepting = True
    self._thread = threading.Thread(target=self._run, name="jinfer-engine", daemon=True)
    self._thread.start()

  @property
  def is_running(self) -> bool:
    return self._thread is not None and self._thread.is_alive() and self._accepting

  async def shutdown(self, drain: bool = True, timeout: float | None = None):
    """Stop taking requests; with `drain`, let those in flight finish (up to `timeout` seconds,
    then abort the rest), else abort them at once. Returns when the loop has exited."""
    self._accepting = False
    self._workers.shutdown(wait=False)
    if self._thread is None:
      return
    self._signal_stop("drain" if drain else "abort")
    await asyncio.to_thread(self._thread.join, timeout if drain else None)
    if self._thread.is_alive():
      self._signal_stop("abort")
      await asyncio.to_thread(self._thread.join)

  def _signal_stop(self, how: str):
    with self._lock:
      self._stop = how
    self._wake.set()

  # -- preparing requests -------------------------------------------------------------------
  @property
  def tokenizer(self) -> Tokenizer:
    return self.engine.tokenizer

  @property
  def max_model_len(self) -> int:
    return self.engine.max_model_len

  def tokenize(self, prompt: str | list[int], *, add_special_tokens: bool = True) -> list[int]:
    """A prompt's token ids. A text that could not fit `max_model_len` whatever it encodes to
    is refused from its size alone, without tokenizing it."""
    if not isinstance(prompt, str):
      return self.engine.tokenize(prompt)
    per_token = self.tokenizer.max_token_bytes
    size = len(prompt.encode("utf-8"))
    if per_token is not None and size > self.max_model_len * per_token:
      raise ParameterError("prompt", f"the prompt has {size} bytes, more than max_model_len "
                                     f"({self.max_model_len}) tokens can hold")
    return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

  def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
    """Raise ValueError for a request that can never run here."""
    self.engine.validate(prompt_token_ids, params)
    if params.n > self.max_waiting:
      raise ParameterError("n", f"n ({params.n}) exceeds this server's queue bound "
                                f"({self.max_waiting})")

  async def prepare(self, fn: Callable[..., T], *args) -> T:
    """`fn(*args)` on a worker thread: tokenizing a long prompt or rendering a chat template
    takes milliseconds to seconds, which the event loop must not wait out. Raises
    EngineDeadError after `shutdown`."""
    try:
      work = asyncio.get_running_loop().run_in_executor(self._workers, functools.partial(fn, *args))
    except RuntimeError:  # the workers were shut down
      raise EngineDeadError("the engine is not running") from None
    return await work

  # -- requests -----------------------------------------------------------------------------
  def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
               request_id: str | None = None, *, cache_salt: str | None = None,
               arrival_time: float | None = None, lora_request=None) -> RequestStream:
    """Queue a request; iterate the result for its outputs (each with the delta since the last).
    `lora_request`: its LoRA adapter (checked and loaded here unless `add_lora` did already).

    Raises ValueError for a request that cannot run, QueueFullError when `max_waiting` sequences
    already wait, EngineDeadError once shutting down; in each case nothing was queued.
    """
    params = params or SamplingParams()
    arrival_time = time.monotonic() if arrival_time is None else arrival_time
    ids = self.tokenize(prompt)
    self.validate(ids, params)
    if lora_request is not None:
      self.engine.add_lora(lora_request)
    loop = asyncio.get_running_loop()
    sink = _Sink(loop, asyncio.Queue(), params.n)
    with self._lock:
      if not self._accepting or self.error is not None:
        raise EngineDeadError("the engine is not running" if self.error is None
                              else f"the engine loop died: {self.error!r}")
      if request_id is None:
        request_id = f"req-{next(self._ids)}"
      if request_id in self._sinks:
        raise ValueError(f"request id {request_id!r} is already in use")
      if self._queued_seqs + self._engine_waiting + params.n > self.max_waiting:
        raise QueueFullError(f"{self.max_waiting} sequences are already waiting; retry later")
      self._sinks[request_id] = sink
      self._queued_seqs += params.n
      self._commands.append(_Add(request_id, ids, params, arrival_time, cache_salt, sink,
                                 lora_request))
    self._wake.set()
    return RequestStream(self, request_id, sink)

  async def abort(self, request_id: str):
    """Abort a request; its consumer gets RequestAbortedError. Returns once its pages are free."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    self._submit_abort(_Abort(request_id, RequestAbortedError(f"request {request_id} aborted"),
                              (loop, done)))
    if self._thread is not None and self._thread.is_alive():
      await done

  def _submit_abort(self, cmd: _Abort):
    self._commands.append(cmd)
    self._wake.set()

  def stats(self) -> EngineStats:
    """The engine's numbers as of its last step or change (a snapshot: safe from any thread)."""
    return self._stats

  # -- the engine thread --------------------------------------------------------------------
  def _run(self):
    try:
      while True:
        self._apply_commands()
        with self._lock:
          stop = self._stop
        if stop == "abort" or (stop == "drain" and not self._commands
                               and not self.engine.has_unfinished_requests()):
          break
        if not self.engine.has_unfinished_requests():
          self._wake.wait()
          # Cleared before the commands are read: a command queued after this wakes the next wait.
          self._wake.clear()
          continue
        self._step()
    except BaseException as e:  # a bug in the loop itself: fail everyone rather than hang them
      log.exception("the engine loop died")
      self.error = e
    finally:
      self._accepting = False
      self._abort_everything(self.error)

  def _apply_commands(self):
    deliveries: list[tuple[_Sink, RequestOutput | BaseException]] = []
    aborted: list[_Abort] = []
    with self._lock:
      while self._commands:
        cmd = self._commands.popleft()
        if isinstance(cmd, _Add):
          self._queued_seqs -= cmd.params.n
          try:
            self.engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params,
                                    arrival_time=cmd.arrival_time, cache_salt=cmd.cache_salt,
                                    lora_request=cmd.lora_request)
          except Exception as e:  # validated already; anything left is this request's alone
            deliveries.append((self._sinks.pop(cmd.request_id), RequestFailedError(str(e))))
        else:
          self._fail(cmd.request_id, cmd.error, deliveries)
          aborted.append(cmd)
      self._refresh_stats()
    self._deliver(deliveries)
    for cmd in aborted:
      _resolve(cmd)

  def _step(self):
    deliveries: list[tuple[_Sink, RequestOutput | BaseException]] = []
    try:
      outputs = self.engine.step()
    except Exception as e:
      # The whole step failed: fail the requests it ran, keep serving the rest.
      log.exception("engine step failed")
      with self._lock:
        for rid in self.engine.running_request_ids():
          self._fail(rid, RequestFailedError(f"engine step failed: {e!r}"), deliveries)
        self._refresh_stats()
      self._deliver(deliveries)
      return
    with self._lock:
      for out in outputs:
        if out.request_id not in self._sinks:
          continue
        if out.error is not None:  # its siblings, if any, stop too
          self._fail(out.request_id, RequestFailedError(out.error), deliveries)
        else:
          deliveries.append((self._sinks.pop(out.request_id) if out.finished
                             else self._sinks[out.request_id], out))
      self._refresh_stats()
    self._deliver(deliveries)

  def _fail(self, request_id: str, error: BaseException | None, deliveries: list):
    """Abort a request in the engine; its consumer, if still there, gets `error`."""
    self.engine.abort(request_id)
    sink = self._sinks.pop(request_id, None)
    if sink is not None and error is not None:
      deliveries.append((sink, error))

  def _deliver(self, deliveries: list[tuple[_Sink, RequestOutput | BaseException]]):
    # After the stats refresh: a consumer woken by its output must see the engine's new state.
    for sink, item in deliveries:
      if not sink.put(item) and isinstance(item, RequestOutput) and not item.finished:
        self._submit_abort(_Abort(item.request_id, None))

  def _refresh_stats(self):
    self._stats = self.engine.stats()
    self._engine_waiting = self._stats.num_waiting

  def _abort_everything(self, error: BaseException | None):
    deliveries: list[tuple[_Sink, RequestOutput | BaseException]] = []
    with self._lock:
      while self._commands:
        cmd = self._commands.popleft()
        if isinstance(cmd, _Abort):
          _resolve(cmd)
      self._queued_seqs = 0
      for rid in list(self._sinks):
        self._fail(rid, RequestAbortedError("the engine shut down") if error is None
                   else RequestFailedError(f"the engine loop died: {error!r}"), deliveries)
      self._refresh_stats()
    self._deliver(deliveries)


def _resolve(cmd: _Abort):
  """Wake whoever awaits this abort."""
  if cmd.done is None:
    return
  loop, fut = cmd.done
  try:
    loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(None))
  except RuntimeError:  # that loop is closed
    pass


async def collect(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
  """The final output of a stream."""
  last = None
  async for out in stream:
    last = out
  if last is None:
    raise RequestAbortedError("the request produced no output")
  return last
