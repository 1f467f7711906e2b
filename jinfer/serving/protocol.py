"""The OpenAI API schema: request bodies (validated strictly) and the responses jinfer sends.

Requests are validated from the raw JSON in strict mode, so `"max_tokens": "5"` or
`"temperature": true` is an error, as it is for OpenAI's own API. Unknown fields are ignored.
Features that would change what a request means and that jinfer does not implement
(logit_bias, echo, suffix, best_of) are refused rather than silently dropped. Constraints on the
output (OpenAI's `response_format`, vLLM's `structured_outputs`, a tool call that `tool_choice`
requires) become one `StructuredOutputsParams`.
"""
from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

from jinfer.errors import ParameterError
from jinfer.sampling.params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams
from jinfer.serving.tools import tool_call_schema


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


class StructuredOutputsRequest(_Request):
  """vLLM's `structured_outputs`: exactly one constraint."""
  # Aliased: a field named `json` would shadow pydantic's method.
  json_: dict[str, Any] | str | None = Field(None, alias="json")
  regex: str | None = None
  choice: list[str] | None = None
  grammar: str | None = None
  json_object: bool | None = None

  def params(self) -> StructuredOutputsParams:
    given = [k for k, v in (("json", self.json_), ("regex", self.regex), ("choice", self.choice),
                            ("grammar", self.grammar), ("json_object", self.json_object))
             if v is not None and v is not False]
    if len(given) != 1:
      raise ParameterError("structured_outputs", f"structured_outputs takes exactly one of json, "
                           f"regex, choice, grammar, json_object; got "
                           f"{', '.join(given) if given else 'none'}")
    if self.choice is not None and not self.choice:
      raise ParameterError("structured_outputs", "structured_outputs.choice is empty")
    if isinstance(self.json_, str):
      _schema_object("structured_outputs", "structured_outputs.json", self.json_)
    return StructuredOutputsParams(json=self.json_, regex=self.regex, choice=self.choice,
                                   grammar=self.grammar, json_object=bool(self.json_object))


def _schema_object(param: str, where: str, text: str) -> dict:
  try:
    schema = json.loads(text)
  except ValueError as e:
    raise ParameterError(param, f"{where} is not valid JSON: {e}") from None
  if not isinstance(schema, dict):
    raise ParameterError(param, f"{where} must be a JSON schema object, got {_show(schema)}")
  return schema


class JsonSchemaFormat(_Request):
  name: str
  description: str | None = None
  schema_: dict[str, Any] | None = Field(None, alias="schema")
  strict: bool | None = None


class ResponseFormat(_Request):
  type: Literal["text", "json_object", "json_schema"]
  json_schema: JsonSchemaFormat | None = None

  def params(self) -> StructuredOutputsParams | None:
    if self.type == "text":
      return None
    if self.type == "json_object":
      return StructuredOutputsParams(json_object=True)
    if self.json_schema is None:
      raise ParameterError("response_format", "response_format of type json_schema needs "
                                              "json_schema: {\"name\": ..., \"schema\": {...}}")
    if self.json_schema.schema_ is None:  # OpenAI's schema is optional: then any JSON object
      return StructuredOutputsParams(json_object=True)
    return StructuredOutputsParams(json=self.json_schema.schema_)


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
  response_format: ResponseFormat | None = None
  structured_outputs: StructuredOutputsRequest | None = None

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
    if name == "structured_outputs":  # a constraint the engine refused: where it came from
      return self.constraint_field
    return name if name in type(self).model_fields else None

  @property
  def constraint_field(self) -> str:
    """The field the request's output constraint came from."""
    if self.structured_outputs is not None:
      return "structured_outputs"
    return "response_format" if self.response_format is not None else "tools"

  def _structured_outputs(self) -> StructuredOutputsParams | None:
    if self.structured_outputs is not None and self.response_format is not None \
        and self.response_format.type != "text":
      raise ParameterError("structured_outputs", "give response_format or structured_outputs, "
                                                 "not both")
    if self.structured_outputs is not None:
      return self.structured_outputs.params()
    return None if self.response_format is None else self.response_format.params()

  def _check_common(self):
    if self.stream_options is not None and not self.stream:
      raise ParameterError("stream_options", "stream_options is only allowed when stream is true")
    if self.logit_bias:
      raise ParameterError("logit_bias", "logit_bias is not supported")

  def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                       structured_outputs: StructuredOutputsParams | None) -> SamplingParams:
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
        logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
        structured_outputs=structured_outputs)

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
    return self._sampling_params(self.max_tokens, self.logprobs, self._structured_outputs())


class TextPart(_Request):
  type: Literal["text"]
  text: str


class FunctionCall(_Request):
  name: str
  arguments: str  # a JSON object's text


class ToolCallMessage(_Request):
  """A call an assistant message made earlier in the conversation."""
  id: str
  type: Literal["function"] = "function"
  function: FunctionCall


class ChatMessage(_Request):
  role: Literal["system", "developer", "user", "assistant", "tool"]
  content: str | list[TextPart] | None = None
  name: str | None = None
  tool_calls: list[ToolCallMessage] | None = None  # an assistant's
  tool_call_id: str | None = None  # a tool result's: the call it answers

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
    return {"role": role, "content": content or "", "name": self.name,
            "tool_calls": None if self.tool_calls is None
            else [c.model_dump() for c in self.tool_calls],
            "tool_call_id": self.tool_call_id}


_FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


class FunctionDefinition(_Request):
  name: str
  description: str | None = None
  parameters: dict[str, Any] | None = None  # a JSON schema of type object; none: no arguments
  strict: bool | None = None


class Tool(_Request):
  type: Literal["function"]
  function: FunctionDefinition


class NamedFunction(_Request):
  name: str


class NamedToolChoice(_Request):
  type: Literal["function"]
  function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
  messages: list[ChatMessage] = Field(min_length=1)
  max_tokens: int | None = None  # None: up to the context limit
  max_completion_tokens: int | None = None
  logprobs: bool = False
  top_logprobs: int | None = None
  tools: list[Tool] | None = None
  tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
  parallel_tool_calls: bool | None = None
  chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extension

  @property
  def max_tokens_field(self) -> str:
    return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

  @field_validator("tool_choice", mode="before")
  @classmethod
  def _tool_choice_shape(cls, v: Any) -> Any:
    # Said here: the union's own error would name a member type.
    if isinstance(v, str) and v not in ("none", "auto", "required"):
      raise ValueError(f"must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", "
                       f"\"function\": {{\"name\": ...}}}}, got {_show(v)}")
    if v is not None and not isinstance(v, (str, dict)):
      raise ValueError(f"must be a string or an object naming a function, got {_show(v)}")
    if isinstance(v, dict) and (v.get("type") != "function" or not isinstance(
        v.get("function"), dict) or not isinstance(v["function"].get("name"), str)):
      raise ValueError(f"a named tool choice is {{\"type\": \"function\", \"function\": "
                       f"{{\"name\": ...}}}}, got {_show(v)}")
    return v

  @property
  def tool_mode(self) -> str:
    """"none", "auto", "required" or "named": what the request asks of the model."""
    if not self.tools:
      return "none"
    if self.tool_choice is None:
      return "auto"  # OpenAI's default when tools are given
    return "named" if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice

  def tools_for_template(self) -> list[dict[str, Any]] | None:
    return None if not self.tools else [t.model_dump(exclude_none=True) for t in self.tools]

  def _check_tools(self):
    names = set()
    for i, tool in enumerate(self.tools or ()):
      f = tool.function
      if not _FUNCTION_NAME.fullmatch(f.name):
        raise ParameterError("tools", f"tools[{i}].function.name must be 1 to 64 letters, digits, "
                                      f"underscores or dashes, got {_show(f.name)}")
      if f.name in names:
        raise ParameterError("tools", f"tools[{i}].function.name {f.name!r} is given twice")
      names.add(f.name)
      if f.parameters is not None and f.parameters.get("type") != "object":
        raise ParameterError("tools", f"tools[{i}].function.parameters must be a JSON schema of "
                                      f"type object, got type "
                                      f"{_show(f.parameters.get('type'))}")
    if isinstance(self.tool_choice, NamedToolChoice) and \
        self.tool_choice.function.name not in names:
      raise ParameterError("tool_choice", f"tool_choice names the function "
                           f"{_show(self.tool_choice.function.name)}, which is not among the "
                           f"tools" if names else "tool_choice names a function but no tools "
                                                  "are given")
    if self.tool_choice in ("auto", "required") and not self.tools:
      raise ParameterError("tool_choice", f"tool_choice {self.tool_choice!r} needs tools")

  def _tool_constraint(self) -> StructuredOutputsParams | None:
    """The schema that makes the output a call, when one is required."""
    mode = self.tool_mode
    if mode not in ("required", "named"):
      return None
    functions = [t.function.model_dump() for t in self.tools]
    if mode == "named":
      name = self.tool_choice.function.name
      functions = [f for f in functions if f["name"] == name]
    many = mode == "required" and self.parallel_tool_calls is not False
    return StructuredOutputsParams(json=tool_call_schema(functions, many=many))

  def sampling_params(self) -> SamplingParams:
    self._check_common()
    self._check_tools()
    constraint = self._structured_outputs()
    forced = self._tool_constraint()
    if forced is not None:
      if constraint is not None:
        raise ParameterError("tool_choice", f"tool_choice {_show(self.tool_choice)} constrains "
                             f"the output to a call: it cannot be combined with "
                             f"{self.constraint_field}")
      constraint = forced
    if self.top_logprobs is not None:
      if not self.logprobs:
        raise ParameterError("top_logprobs", "top_logprobs requires logprobs to be true")
      if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
        raise ParameterError("top_logprobs", f"top_logprobs must be in [0, {MAX_LOGPROBS}], got "
                                             f"{self.top_logprobs}")
    max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None \
        else self.max_tokens
    return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None,
                                 constraint)


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
  root: str | None = None  # an adapter's path (vLLM's field)
  parent: str | None = None  # an adapter's base model


class LoadLoRAAdapterRequest(BaseModel):
  """POST /v1/load_lora_adapter (vLLM's body)."""
  model_config = ConfigDict(extra="forbid", strict=True)
  lora_name: str = Field(min_length=1)
  lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
  """POST /v1/unload_lora_adapter (vLLM's body; its `lora_int_id` is accepted and unused)."""
  model_config = ConfigDict(extra="forbid", strict=True)
  lora_name: str = Field(min_length=1)
  lora_int_id: int | None = None


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


class FunctionCallOut(_Response):
  name: str
  arguments: str


class ToolCall(_Response):
  id: str
  type: Literal["function"] = "function"
  function: FunctionCallOut


class AssistantMessage(_Response):
  role: Literal["assistant"] = "assistant"
  content: str | None
  refusal: str | None = None
  tool_calls: list[ToolCall] | None = None


class DeltaFunctionCall(_Response):
  name: str | None = None
  arguments: str | None = None


class DeltaToolCall(_Response):
  index: int
  id: str | None = None
  type: Literal["function"] | None = None
  function: DeltaFunctionCall | None = None


class ChatChoice(_Response):
  index: int
  message: AssistantMessage
  logprobs: ChatLogprobs | None = None
  finish_reason: Literal["stop", "length", "tool_calls"] | None = None
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
  tool_calls: list[DeltaToolCall] | None = None

  @model_serializer(mode="wrap")
  def _drop_unset(self, handler):
    # A delta carries only what changed: the last chunk of a choice has `"delta": {}`.
    return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(_Response):
  index: int
  delta: DeltaMessage
  logprobs: ChatLogprobs | None = None
  finish_reason: Literal["stop", "length", "tool_calls"] | None = None
  stop_reason: int | str | None = None


class ChatCompletionChunk(_Response):
  id: str
  object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
  created: int
  model: str
  choices: list[ChatStreamChoice]
  usage: Usage | None = None
  system_fingerprint: str | None = None
