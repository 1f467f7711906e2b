"""JAX's persistent compilation cache under jinfer's cache directory, and counting what it serves.

A compiled step is keyed by the program and the compiler, so a second process with the same
model and engine options loads every step from disk instead of compiling it. The directory is
`$JINFER_COMPILATION_CACHE_DIR`, else `<jinfer cache dir>/xla`. A cache the user configured
(`jax_compilation_cache_dir`) is left as it is.
"""
from __future__ import annotations

import os

import jax

from jinfer.weights.builtin import cache_dir

_counts = {"hits": 0, "backend": 0}


def _on_event(event: str, **_):
  if event == "/jax/compilation_cache/cache_hits":
    _counts["hits"] += 1


def _on_duration(event: str, duration: float, **_):
  if event == "/jax/core/compile/backend_compile_duration":  # reported for a cache hit too
    _counts["backend"] += 1


jax.monitoring.register_event_listener(_on_event)
jax.monitoring.register_event_duration_secs_listener(_on_duration)


def enable() -> str:
  """Turn the cache on (process-wide, as JAX's setting is); returns its directory."""
  current = jax.config.jax_compilation_cache_dir
  if current:
    return current
  path = os.environ.get("JINFER_COMPILATION_CACHE_DIR") or os.path.join(cache_dir(), "xla")
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  # Every step is worth keeping: even the small buckets take seconds to compile on a CPU.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  return path


def cache_hits() -> int:
  """Compiled programs served from the persistent cache so far in this process."""
  return _counts["hits"]


def compiles() -> int:
  """Programs XLA compiled so far in this process (cache hits not counted)."""
  return _counts["backend"] - _counts["hits"]
