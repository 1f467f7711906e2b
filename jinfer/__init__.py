"""jinfer: a JAX/Pallas LLM inference library for TPU and GPU.

The names below load on first use: importing the package, or running one of its modules with
`python -m jinfer.<module>`, starts nothing, so a benchmark can still size JAX's CPU client
before the library's modules are imported.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
  from jinfer.engine.engine import LLMEngine
  from jinfer.engine.engine_config import EngineConfig
  from jinfer.engine.request import CompletionOutput, RequestOutput
  from jinfer.llm import LLM
  from jinfer.sampling.params import SamplingParams

_HOMES = {"LLM": "jinfer.llm", "LLMEngine": "jinfer.engine.engine",
          "EngineConfig": "jinfer.engine.engine_config", "SamplingParams": "jinfer.sampling.params",
          "RequestOutput": "jinfer.engine.request", "CompletionOutput": "jinfer.engine.request"}
__all__ = list(_HOMES)


def __getattr__(name: str):
  if name not in _HOMES:
    raise AttributeError(f"module 'jinfer' has no attribute {name!r}")
  value = getattr(importlib.import_module(_HOMES[name]), name)
  globals()[name] = value  # found directly from now on
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))
