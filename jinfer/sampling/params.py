"""Per-request sampling options, validated when made so bad values never reach the queue.

Every field is checked against what the step can hold: the sampler's per-row arrays are int32,
uint32 and float32, so a value that fits Python but not its array (a `top_k` of 2**31, a
temperature that rounds to inf) is refused here rather than failing the step it would join.
"""
from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from jinfer.errors import ParameterError

MAX_LOGPROBS = 20  # top-N logprobs are computed on device with this static N
# Stop strings and ids are matched on the host after every token of every sequence: their
# number is bounded so that one request cannot slow down the steps it shares.
MAX_STOP = 64
_INT32_MAX = 2**31 - 1
_INT64 = (-2**63, 2**63 - 1)
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _show(v) -> str:
  """`v` for an error message, cut short: the value may be a client's megabyte."""
  r = repr(v)
  return r if len(r) <= 40 else r[:37] + "..."


def _int(name: str, v, lo: int, hi: int = _INT32_MAX) -> int:
  if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not lo <= v <= hi:
    raise ParameterError(name, f"{name} must be an integer in [{lo}, {hi}], got {_show(v)}")
  return int(v)


def _float32(name: str, v, lo: float, hi: float = _FLOAT32_MAX, *,
             above_lo: bool = False) -> float:
  """`v` as a float, checked as the float32 the device will see (so 1e300 is inf and 1e-50 is
  0): within [lo, hi], or (lo, hi] with `above_lo`."""
  if isinstance(v, bool) or not isinstance(v, numbers.Real):
    raise ParameterError(name, f"{name} must be a number, got {_show(v)}")
  try:
    value = float(v)
  except OverflowError:  # an integer beyond any float
    value = math.inf
  with np.errstate(over="ignore", under="ignore"):
    x = float(np.float32(value))
  if not (math.isfinite(x) and (lo < x if above_lo else lo <= x) and x <= hi):
    bound = f"> {lo}" if above_lo else f">= {lo}"
    bound = f"a finite float32 {bound}" if hi == _FLOAT32_MAX else f"{bound} and <= {hi}"
    rounded = f" ({x} as a float32)" if x != value and not math.isnan(value) else ""
    raise ParameterError(name, f"{name} must be {bound}, got {_show(v)}{rounded}")
  return value


def _bool(name: str, v) -> bool:
  if not isinstance(v, (bool, np.bool_)):
    raise ParameterError(name, f"{name} must be true or false, got {_show(v)}")
  return bool(v)


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:   # vLLM's names
  json: dict | str | None = None   # a JSON schema (dict, or its JSON text)
  regex: str | None = None
  choice: list[str] | None = None
  grammar: str | None = None       # a Lark grammar as llguidance reads it
  json_object: bool = False        # any JSON object


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
  structured_outputs: StructuredOutputsParams | None = None

  def __post_init__(self):
    fields = dict(
        n=_int("n", self.n, 1),
        temperature=_float32("temperature", self.temperature, 0.0),
        top_p=_float32("top_p", self.top_p, 0.0, 1.0, above_lo=True),
        top_k=max(_int("top_k", self.top_k, -1), 0) or -1,  # -1 and 0 disable
        min_p=_float32("min_p", self.min_p, 0.0, 1.0),
        repetition_penalty=_float32("repetition_penalty", self.repetition_penalty, 0.0,
                                    above_lo=True),
        presence_penalty=_float32("presence_penalty", self.presence_penalty, -2.0, 2.0),
        frequency_penalty=_float32("frequency_penalty", self.frequency_penalty, -2.0, 2.0),
        seed=None if self.seed is None else _int("seed", self.seed, *_INT64),
        max_tokens=None if self.max_tokens is None else _int("max_tokens", self.max_tokens, 1),
        min_tokens=_int("min_tokens", self.min_tokens, 0),
        stop=self._stop(),
        stop_token_ids=self._stop_token_ids(),
        include_stop_str_in_output=_bool("include_stop_str_in_output",
                                         self.include_stop_str_in_output),
        ignore_eos=_bool("ignore_eos", self.ignore_eos),
        logprobs=None if self.logprobs is None
        else _int("logprobs", self.logprobs, 0, MAX_LOGPROBS),
        prompt_logprobs=None if self.prompt_logprobs is None
        else _int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS),
        skip_special_tokens=_bool("skip_special_tokens", self.skip_special_tokens))
    if fields["max_tokens"] is not None and fields["min_tokens"] > fields["max_tokens"]:
      raise ParameterError("min_tokens", f"min_tokens ({self.min_tokens}) must be <= max_tokens "
                                         f"({self.max_tokens})")
    for name, value in fields.items():
      object.__setattr__(self, name, value)

  def _stop(self) -> tuple[str, ...]:
    stop = (self.stop,) if isinstance(self.stop, str) else self.stop
    if stop is None:
      return ()
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
      raise ParameterError("stop", f"stop must be a non-empty string or a list of them, got "
                                   f"{_show(self.stop)}")
    if len(stop) > MAX_STOP:
      raise ParameterError("stop", f"stop takes at most {MAX_STOP} strings, got {len(stop)}")
    return tuple(stop)

  def _stop_token_ids(self) -> tuple[int, ...]:
    ids = self.stop_token_ids
    if ids is None:
      return ()
    if not isinstance(ids, (list, tuple)):
      raise ParameterError("stop_token_ids",
                           f"stop_token_ids must be a list of token ids, got {_show(ids)}")
    if len(ids) > MAX_STOP:
      raise ParameterError("stop_token_ids",
                           f"stop_token_ids takes at most {MAX_STOP} ids, got {len(ids)}")
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)
           or not 0 <= t <= _INT32_MAX]
    if bad:
      raise ParameterError("stop_token_ids", f"stop_token_ids must be token ids in [0, "
                                             f"{_INT32_MAX}], got {_show(bad[0])}")
    return tuple(map(int, ids))

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0
