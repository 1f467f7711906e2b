"""Compiling the engine's steps ahead of the serving path, the rest after serving has started.

A step is compiled per token bucket (with its prompt-logprobs variant and the proposer's
passes: `compile_bucket`; speculation's verify variant: `finish_bucket`). Startup compiles what
the first requests need, the smallest bucket (a single stream's decode) and one prefill bucket,
without their verify variants, and returns: the engine serves from then on, without speculating
until the background has compiled those (`finished`). A background thread compiles the other
buckets, the ones steps asked for most first (`want`), else smallest first. A step runs only in a ready bucket: the engine caps its
token budget at the largest ready one (a long prefill is chunked to it) and pads the rest to the
smallest ready bucket that holds it (`pick`). So nothing compiles on the serving path, while the
background compiles and after (`compile_guard.py` checks).

Compiling is ahead of time (`jit(...).lower(...).compile()`): it runs nothing and touches no
engine state, so it can overlap the steps; the compiled program lands in the jitted function's
own cache, where the step finds it. It is given the KV cache array as the step is (a shape
description would lower to another program: placement and commitment are part of the key),
which a running step may have donated meanwhile: lowering reads only its shape and placement.
"""
from __future__ import annotations

import atexit
import bisect
import collections
import logging
import threading
import time
import weakref
from typing import Callable, Sequence

log = logging.getLogger(__name__)

# The first prefill bucket: a chat turn's prompt fits in one step of it; longer prompts are
# chunked to it until a larger bucket is ready.
FIRST_PREFILL_BUCKET = 64


_started: "weakref.WeakSet[StepCompiler]" = weakref.WeakSet()


def _close_all():
  """At exit, let a background compile finish before anything is torn down: JAX's own exit
  handlers clear its caches and backends under a compile (a lowering then failed), and a thread
  stopped inside XLA's compiler can abort the process. Registered at the first start, after
  JAX's, so that it runs before them."""
  for c in list(_started):
    c.close()


class StepCompiler:
  def __init__(self, buckets: Sequence[int], compile_bucket: Callable[[int], float],
               finish_bucket: Callable[[int], float] | None = None):
    """`buckets`: every token bucket, ascending; `compile_bucket(t)`: compile bucket t's steps,
    returning seconds; `finish_bucket(t)`: the rest of them, which startup may leave to the
    background (a bucket compiled later gets both at once)."""
    self.buckets = list(buckets)
    self._compile, self._finish = compile_bucket, finish_bucket
    self.unfinished: list[int] = []  # ready buckets whose `finish_bucket` is still to run
    # Ascending; replaced, never changed in place, so the serving thread reads it unlocked.
    self.ready: list[int] = []
    self.seconds: dict[int, float] = {}
    self._demand: collections.Counter[int] = collections.Counter()
    self._lock = threading.Lock()
    self._stop = False
    self._thread: threading.Thread | None = None
    self.error: BaseException | None = None  # the background thread's, if it failed

  @property
  def startup_buckets(self) -> list[int]:
    first = next((t for t in self.buckets if t >= FIRST_PREFILL_BUCKET), self.buckets[-1])
    return sorted({self.buckets[0], first})

  @property
  def done(self) -> bool:
    return len(self.ready) == len(self.buckets) and self.finished

  @property
  def finished(self) -> bool:
    """Every ready bucket wholly compiled (speculation may verify)."""
    return not self.unfinished

  def compile(self, buckets: Sequence[int], finish: bool = True) -> None:
    """Compile these buckets now, on this thread (`finish`: their `finish_bucket` part too)."""
    for t in buckets:
      if t in self.unfinished and finish:
        self._finish_one(t)
      if t not in self.ready:
        seconds = self._compile(t)
        if self._finish is not None and finish:
          seconds += self._finish(t)
        elif self._finish is not None:
          self.unfinished = self.unfinished + [t]
        self._add(t, seconds)

  def _finish_one(self, t: int) -> None:
    seconds = self._finish(t)
    with self._lock:
      self.seconds[t] += seconds
      self.unfinished = [u for u in self.unfinished if u != t]

  def _add(self, t: int, seconds: float) -> None:
    with self._lock:
      self.seconds[t] = seconds
      self.ready = sorted(self.ready + [t])
      self._demand.pop(t, None)

  def start(self) -> None:
    """Finish the ready buckets, then compile those not ready yet, on a background thread."""
    if self.done or self._thread is not None:
      return
    self._thread = threading.Thread(target=self._run, name="jinfer-step-compiler", daemon=True)
    if not _started:
      atexit.unregister(_close_all)
      atexit.register(_close_all)
    _started.add(self)
    self._thread.start()

  def _next(self) -> int | None:
    with self._lock:
      todo = [t for t in self.buckets if t not in self.ready]
      if self._stop or not todo:
        return None
      return max(todo, key=lambda t: (self._demand[t], -t))

  def _run(self) -> None:
    t0 = time.monotonic()
    try:
      while self.unfinished and not self._stop:
        self._finish_one(self.unfinished[0])
      while (t := self._next()) is not None:
        self.compile([t])
    except BaseException as e:  # serving goes on in the ready buckets
      self.error = e
      log.exception("compiling in the background failed; steps keep to the ready buckets %s",
                    self.ready)
      return
    if self.done:
      log.info("all %d step buckets compiled (%.1f s in the background)", len(self.buckets),
               time.monotonic() - t0)

  def wait(self) -> None:
    """Until every bucket is compiled (compiling the rest here if no thread does)."""
    if self._thread is not None:
      self._thread.join()
    if self.error is not None:
      raise self.error
    self.compile(self.buckets)

  def join(self) -> None:
    """Until the background thread, if one runs, has compiled the rest."""
    if self._thread is not None:
      self._thread.join()

  def close(self) -> None:
    """Stop after the bucket being compiled (a compile cannot be interrupted)."""
    self._stop = True
    if self._thread is not None:
      self._thread.join()

  # -- the serving path ---------------------------------------------------------------------
  @property
  def largest(self) -> int:
    return self.ready[-1]

  def pick(self, num_tokens: int) -> int:
    """The smallest ready bucket of at least `num_tokens` (the scheduler kept within
    `largest`)."""
    ready = self.ready
    return ready[bisect.bisect_left(ready, num_tokens)]

  def want(self, num_tokens: int) -> None:
    """A step would have run in the bucket of `num_tokens` had it been ready."""
    t = self.buckets[bisect.bisect_left(self.buckets, min(num_tokens, self.buckets[-1]))]
    if t not in self.ready:
      with self._lock:
        self._demand[t] += 1
