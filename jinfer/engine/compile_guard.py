"""The recompile guard: XLA compiles on the serving path after startup, counted and reported.

Startup compiles the steps the engine runs (`step_compiler.py`); from then on, a compile on the
thread that runs steps means a shape nobody planned for, which stalls every request for seconds.
The guard counts XLA's backend compiles made on that thread once armed, loads from the
persistent compilation cache included (they take seconds too, and JAX reports them as the same
event); the background compiler's thread is not counted. The engine logs each offending step
with its shape and the compiled functions' names, reports the count in
`stats().compiles_after_startup` (and `/metrics`), and with `strict_compiles` raises
`CompileOnServingPath`, for tests and CI.
"""
from __future__ import annotations

import contextlib
import threading
import weakref

import jax

_COMPILE = "/jax/core/compile/backend_compile_duration"

_guards: "weakref.WeakSet[CompileGuard]" = weakref.WeakSet()


class CompileOnServingPath(RuntimeError):
  """Something compiled on the serving path after startup (`strict_compiles`)."""


class CompileGuard:
  def __init__(self):
    self.count = 0  # compiles on the armed thread since arming
    self.names: list[str] = []  # what they compiled, the latest last
    self._thread: int | None = None
    _guards.add(self)

  def arm(self) -> None:
    """Count from now on, on the calling thread (the one that runs steps)."""
    self._thread = threading.get_ident()

  @contextlib.contextmanager
  def suspended(self):
    """Not counting meanwhile: work asked for between steps (new weights cast and placed,
    weights back from host memory), which no request waits on, not a step's compile."""
    thread, self._thread = self._thread, None
    try:
      yield
    finally:
      self._thread = thread

  @property
  def armed(self) -> bool:
    return self._thread is not None

  def _seen(self, name: str) -> None:
    if self._thread == threading.get_ident():
      self.count += 1
      self.names = (self.names + [name])[-8:]


def _on_duration(event: str, duration: float, fun_name: str = "?", **_):
  if event == _COMPILE:
    for g in list(_guards):
      g._seen(fun_name)


jax.monitoring.register_event_duration_secs_listener(_on_duration)
