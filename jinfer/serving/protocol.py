"""The OpenAI API schema: request bodies (validated strictly) and the responses jinfer sends.

Requests are validated from the raw JSON in strict mode, so `"max_tokens": "5"` or
`"temperature": true` is an error, as it is for OpenAI's own API. Unknown fields are ignored.
Features that would change what a request means and that jinfer does not implement (tools,
JSON mode, logit_bias, echo, suffix, best_of) are refused rather than silently dropped.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

from jinfer.errors import ParameterError
from jinfer.sampling.params import MAX_LOGPROBS, SamplingParams


def _show(v: Any) -> str:
  """A JSON value for an error message, cut short."""
  text = json.dumps(v)
  return text if len(text) <= 40 else text[:37] + "..."


def _is_token_id(v: Any) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


class _Request(BaseModel):
  # Fields jinfer does not know are ignored, as vLLM does (the server logs their names).
  model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Request):
  include_usage: bool = False


class SamplingRequest(_Request):
  """Fields the two endpoints share, OpenAI's and vLLM's extensions."""
  model: str
  n: int = 1
  temperature: float | None = None  # OpenAI's default is 1
  top_p: float | None = None
  stop: str | list[str] | None = None
  seed: int | None = None
  presence_penalty: float | None = None
  frequency_penalty: float | None = None
  stream: bool = False
  stream_options: StreamOptions | None = None
  user: str | None = None
  logit_bias: dict[str, float] | None = None
  # vLLM's extensions
  top_k: int | None = None
  min_p: float | None = None
  repetition_penalty: float | None = None
  ignore_eos: bool = False
  min_tokens: int = 0
  stop_token_ids: list[int] | None = None
  include_stop_str_in_output: bool = False
  skip_special_tokens: bool = True

  @field_validator("stop", mode="before")
  @classmethod
  def _stop_strings(cls, v: Any) -> Any:
    # Said here: the union's own error would name a member type ("stop.str").
    if isinstance(v, list):
      bad = next((i for i, s in enumerate(v) if not isinstance(s, str)), None)
      if bad is not None:
        raise ValueError(f"stop strings must be strings; item {bad} is {_show(v[bad])}")
    elif v is not None and not isinstance(v, str):
      raise ValueError(f"must be a string or a list of strings, got {_show(v)}")
    return v

  @property
  def max_tokens_field(self) -> str:
    """The field the request gave its output limit in."""
    return "max_tokens"

  def field_of(self, error: ValueError) -> str | None:
    """The request field an error is about: the one a ParameterError (from SamplingParams, the
    engine or the checks here) names, spelled as this request spells it."""
    name = getattr(error, "param", None)
    if name == "max_tokens":
      return self.max_tokens_field
    return name if name in type(self).model_fields else None

  def _check_common(self):
    if self.stream_options is not None and not self.stream:
      raise ParameterError("stream_options", "stream_options is only allowed when stream is true")
    if self.logit_bias:
      raise ParameterError("logit_bias", "logit_bias is not supported")

  def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    # SamplingParams checks every range; its messages name the field.
    return SamplingParams(
        n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
        top_p=1.0 if self.top_p is None else self.top_p,
        top_k=-1 if self.top_k is None else self.top_k,
        min_p=self.min_p or 0.0,
        repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
        presence_penalty=self.presence_penalty or 0.0,
        frequency_penalty=self.frequency_penalty or 0.0, seed=self.seed, max_tokens=max_tokens,
        min_tokens=self.min_tokens, stop=self.stop or (),
        stop_token_ids=tuple(self.stop_token_ids or ()),
        include_stop_str_in_output=self.include_stop_str_in_output, ignore_eos=self.ignore_eos,
        logprobs=logprobs, skip_special_tokens=self.skip_special_tokens)

  @property
  def include_usage(self) -> bool:
    return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
  prompt: str | list[str] | list[int] | list[list[int]]
  max_tokens: int | None = 16
  logprobs: int | None = None
  echo: bool = False
  best_of: int | None = None
  suffix: str | None = None

  @field_validator("prompt", mode="before")
  @classmethod
  def _prompt_shape(cls, v: Any) -> Any:
    # Said here: the union's own error would name a member type ("prompt.str").
    if isinstance(v, str):
      return v
    if not isinstance(v, list):
      raise ValueError(f"must be a string, a list of strings, a list of token ids or a list of "
                       f"lists of token ids, got {_show(v)}")
    if v and isinstance(v[0], str):
      bad = next((i for i, p in enumerate(v) if not isinstance(p, str)), None)
      if bad is not None:
        raise ValueError(f"a list of prompts holds strings; item {bad} is {_show(v[bad])}")
    elif v and isinstance(v[0], list):
      for i, ids in enumerate(v):
        if not isinstance(ids, list):
          raise ValueError(f"a list of token-id prompts holds lists; item {i} is {_show(ids)}")
        bad = next((j for j, t in enumerate(ids) if not _is_token_id(t)), None)
        if bad is not None:
          raise ValueError(f"token ids are integers; item [{i}][{bad}] is {_show(ids[bad])}")
    else:
      bad = next((i for i, t in enumerate(v) if not _is_token_id(t)), None)
      if bad is not None:
        raise ValueError(f"token ids are integers; item {bad} is {_show(v[bad])}")
    return v

  def prompts(self) -> list[str | list[int]]:
    p = self.prompt
    if isinstance(p, str) or (p and isinstance(p[0], int)):
      return [p]
    if not p:
      raise ParameterError("prompt", "prompt is empty")
    return list(p)

  def sampling_params(self) -> SamplingParams:
    self._check_common()
    if self.echo:
      raise ParameterError("echo", "echo is not supported")
    if self.suffix:
      raise ParameterError("suffix", "suffix is not supported")
    if self.best_of is not None and self.best_of != self.n:
      raise ParameterError("best_of", "best_of is not supported (only best_of == n)")
    return self._sampling_params(self.max_tokens, self.logprobs)


class TextPart(_Request):
  type: Literal["text"]
  text: str


class ChatMessage(_Request):
  role: Literal["system", "developer", "user", "assistant", "tool"]
  content: str | list[TextPart] | None = None
  name: str | None = None

  @field_validator("content", mode="before")
  @classmethod
  def _text_only(cls, v: Any) -> Any:
    # Said here: the union's own error would name a member type ("content.str").
    if isinstance(v, list):
      for i, part in enumerate(v):
        if not isinstance(part, dict):
          raise ValueError(f"content parts are objects with a type; part {i} is {_show(part)}")
        if part.get("type") != "text":
          raise ValueError(f"only text content parts are supported; part {i} has type "
                           f"{_show(part.get('type'))}")
    elif v is not None and not isinstance(v, str):
      raise ValueError(f"must be a string or a list of text parts, got {_show(v)}")
    return v

  def for_template(self) -> dict[str, Any]:
    content = self.content
    if isinstance(content, list):
      content = "".join(p.text for p in content)
    # Chat templates predate the "developer" role; it is OpenAI's new name for "system".
    role = "system" if self.role == "developer" else self.role
    return {"role": role, "content": content or "", "name": self.name}


class ResponseFormat(_Request):
  type: str


class ChatCompletionRequest(SamplingRequest):
  messages: list[ChatMessage] = Field(min_length=1)
  max_tokens: int | None = None  # None: up to the context limit
  max_completion_tokens: int | None = None
  logprobs: bool = False
  top_logprobs: int | None = None
  tools: list[Any] | None = None
  response_format: ResponseFormat | None = None
  chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extension

  @property
  def max_tokens_field(self) -> str:
    return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

  def sampling_params(self) -> SamplingParams:
    self._check_common()
    if self.tools:
      raise ParameterError("tools", "tools are not supported")
    if self.response_format is not None and self.response_format.type != "text":
      raise ParameterError("response_format", f"response_format {self.response_format.type!r} is "
                                              f"not supported")
    if self.top_logprobs is not None:
      if not self.logprobs:
        raise ParameterError("top_logprobs", "top_logprobs requires logprobs to be true")
      if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
        raise ParameterError("top_logprobs", f"top_logprobs must be in [0, {MAX_LOGPROBS}], got "
                                             f"{self.top_logprobs}")
    max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None \
        else self.max_tokens
    return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)


# -- responses ------------------------------------------------------------------------------
class _Response(BaseModel):
  # -inf logprobs become -9999.0 where they are made; nothing else can be non-finite.
  model_config = ConfigDict(ser_json_inf_nan="null")


class ErrorInfo(_Response):
  message: str
  type: str
  param: str | None = None
  code: str | int | None = None


class ErrorResponse(_Response):
  error: ErrorInfo


class PromptTokensDetails(_Response):
  cached_tokens: int


class Usage(_Response):
  prompt_tokens: int
  completion_tokens: int
  total_tokens: int
  prompt_tokens_details: PromptTokensDetails | None = None


class ModelCard(_Response):
  id: str
  object: Literal["model"] = "model"
  created: int
  owned_by: str = "jinfer"
  max_model_len: int


class ModelList(_Response):
  object: Literal["list"] = "list"
  data: list[ModelCard]


class CompletionLogprobs(_Response):
  """The legacy completions shape: parallel lists, top tokens as {token: logprob}."""
  tokens: list[str] = []
  token_logprobs: list[float] = []
  top_logprobs: list[dict[str, float]] = []
  text_offset: list[int] = []


class CompletionChoice(_Response):
  index: int
  text: str
  logprobs: CompletionLogprobs | None = None
  finish_reason: Literal["stop", "length"] | None = None
  stop_reason: int | str | None = None  # vLLM's extension: the stop string or token that hit


class CompletionResponse(_Response):
  id: str
  object: Literal["text_completion"] = "text_completion"
  created: int
  model: str
  choices: list[CompletionChoice]
  usage: Usage | None = None
  system_fingerprint: str | None = None


class TopLogprob(_Response):
  token: str
  logprob: float
  bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
  top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
  content: list[ChatTokenLogprob] | None
  refusal: list[ChatTokenLogprob] | None = None


class AssistantMessage(_Response):
  role: Literal["assistant"] = "assistant"
  content: str
  refusal: str | None = None


class ChatChoice(_Response):
  index: int
  message: AssistantMessage
  logprobs: ChatLogprobs | None = None
  finish_reason: Literal["stop", "length"] | None = None
  stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
  id: str
  object: Literal["chat.completion"] = "chat.completion"
  created: int
  model: str
  choices: list[ChatChoice]
  usage: Usage
  system_fingerprint: str | None = None


class DeltaMessage(_Response):
  role: Literal["assistant"] | None = None
  content: str | None = None

  @model_serializer(mode="wrap")
  def _drop_unset(self, handler):
    # A delta carries only what changed: the last chunk of a choice has `"delta": {}`.
    return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(_Response):
  index: int
  delta: DeltaMessage
  logprobs: ChatLogprobs | None = None
  finish_reason: Literal["stop", "length"] | None = None
  stop_reason: int | str | None = None


class ChatCompletionChunk(_Response):
  id: str
  object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
  created: int
  model: str
  choices: list[ChatStreamChoice]
  usage: Usage | None = None
  system_fingerprint: str | None = None
