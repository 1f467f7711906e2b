"""Engine options given as one object (`speculative_config`, `kv_transfer_config`): the config
dataclass itself, a dict of its fields, or JSON text of one (the CLI's flag)."""
from __future__ import annotations

import dataclasses
import json
from typing import Any, TypeVar

from jinfer.errors import ParameterError

T = TypeVar("T")


def parse_option(cls: type[T], value: Any, name: str, required: str) -> T:
  """A `cls` from `value`; bad JSON, a value that is not an object, an unknown key or a missing
  `required` one raise a ParameterError naming the option `name`."""
  def error(message: str) -> ParameterError:
    return ParameterError(name, f"{name}: {message}")

  if isinstance(value, cls):
    return value
  if isinstance(value, str):
    try:
      value = json.loads(value)
    except json.JSONDecodeError as e:
      raise error(f"not valid JSON: {e}") from None
  if not isinstance(value, dict):
    raise error(f"must be a dict (JSON object), got {type(value).__name__}")
  fields = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(value) - fields)
  if unknown:
    raise error(f"unknown key {unknown[0]!r}; known keys: {', '.join(sorted(fields))}")
  if required not in value:
    raise error(f"needs {required!r}")
  return cls(**value)
