"""OpenAI completions and chat completions over the AsyncLLMEngine: requests become engine
requests, engine outputs become OpenAI responses or server-sent event streams."""
from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import AsyncIterator

from jinfer.engine.async_engine import (AsyncLLMEngine, EngineDeadError, RequestAbortedError,
                                        RequestFailedError, RequestStream)
from jinfer.engine.lora_slots import LoRARequest
from jinfer.engine.request import CompletionOutput, RequestOutput
from jinfer.sampling.params import SamplingParams
from jinfer.serving.adapters import ServedAdapters
from jinfer.serving.errors import BadRequest
from jinfer.serving.metrics import ServerMetrics
from jinfer.serving.protocol import (AssistantMessage, ChatChoice, ChatCompletionChunk,
                                     ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs,
                                     ChatStreamChoice, ChatTokenLogprob, CompletionChoice,
                                     CompletionLogprobs, CompletionRequest, CompletionResponse,
                                     DeltaFunctionCall, DeltaMessage, DeltaToolCall, ErrorInfo,
                                     ErrorResponse, FunctionCallOut, PromptTokensDetails,
                                     SamplingRequest, ToolCall, TopLogprob, Usage)
from jinfer.serving.tool_parsers import (ConstrainedParser, ParsedCall, StreamingToolCalls,
                                         ToolParser, call_id, content_of,
                                         get_parser)
from jinfer.serving.tools import default_prompt_messages, template_messages

_MIN_LOGPROB = -9999.0  # what OpenAI reports for tokens sampling could never pick (-inf)
DONE = "data: [DONE]\n\n"
# chat_template_kwargs that would clash with what the server itself passes the template.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "add_generation_prompt", "tokenize"})


def sse(obj) -> str:
  return f"data: {obj.model_dump_json()}\n\n"


def _finish(c: CompletionOutput, called: bool = False) -> str | None:
  # "abort" and "error" never reach a response: those end the stream with an error instead.
  if called and c.finish_reason == "stop":
    return "tool_calls"  # as OpenAI: the model stopped to have its calls run
  return c.finish_reason if c.finish_reason in ("stop", "length") else None


def _tool_calls(calls: list[ParsedCall]) -> list[ToolCall] | None:
  return [ToolCall(id=call_id(), function=FunctionCallOut(name=c.name, arguments=c.arguments))
          for c in calls] or None


def _tool_deltas(calls: list[ParsedCall], first: int) -> list[DeltaToolCall] | None:
  # Each call whole in one delta (index, id, type, name and all its arguments): OpenAI's clients
  # accumulate argument fragments, and one fragment is a valid split.
  return [DeltaToolCall(index=first + k, id=call_id(), type="function",
                        function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
          for k, c in enumerate(calls)] or None


def _usage(finals: list[RequestOutput]) -> Usage:
  prompt = sum(len(o.prompt_token_ids) for o in finals)
  completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
  return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
               prompt_tokens_details=PromptTokensDetails(
                   cached_tokens=sum(o.num_cached_tokens for o in finals)))


def stream_error(e: BaseException) -> ErrorResponse:
  """The error that ends a stream whose response has already begun."""
  if isinstance(e, (RequestAbortedError, EngineDeadError)):
    return ErrorResponse(error=ErrorInfo(message=str(e), type="server_error",
                                         code="request_aborted"))
  return ErrorResponse(error=ErrorInfo(message=str(e) or repr(e), type="server_error",
                                       code="internal_error"))


class OpenAIServing:

  def __init__(self, engine: AsyncLLMEngine, metrics: ServerMetrics, adapters: ServedAdapters,
               *, enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None):
    self.engine, self.metrics = engine, metrics
    self.adapters = adapters  # the `model` field -> its LoRA adapter (or the base model)
    self.tokenizer = engine.tokenizer
    self._token_text: dict[int, str] = {}
    self.enable_auto_tool_choice, self.tool_call_parser = enable_auto_tool_choice, tool_call_parser
    if tool_call_parser is not None:
      get_parser(tool_call_parser)  # an unknown name fails at startup, not per request

  @property
  def template_has_tools(self) -> bool:
    """Whether the chat template writes the tools itself; if not, jinfer's default tool prompt
    (hermes format) does."""
    return "tools" in self.tokenizer.chat_template_variables

  def tool_parser(self, req: ChatCompletionRequest) -> ToolParser | None:
    """The parser of this request's output: None when no call can come back."""
    mode = req.tool_mode
    if mode == "none":
      return None
    if mode in ("required", "named"):
      return ConstrainedParser()
    if not self.template_has_tools:
      return get_parser("hermes")  # the format of the default tool prompt
    if not (self.enable_auto_tool_choice and self.tool_call_parser):
      raise BadRequest('"auto" tool choice needs the server started with '
                       '--enable-auto-tool-choice and --tool-call-parser', param="tool_choice")
    return get_parser(self.tool_call_parser)

  # -- turning requests into engine requests ----------------------------------------------
  async def submit_completion(self, req: CompletionRequest,
                              request_id: str) -> list[RequestStream]:
    """Queue one engine request per prompt, all prepared and validated (on a worker thread)
    before any is queued."""
    params = req.sampling_params()
    prompts = await self.engine.prepare(self._completion_prompts, req, params)
    return self._submit(prompts, params, request_id, self.adapters.lookup(req.model))

  def _completion_prompts(self, req: CompletionRequest, params: SamplingParams) -> list[list[int]]:
    prompts = req.prompts()
    if len(prompts) > 1 and len(prompts) * params.n > self.engine.max_waiting:
      raise BadRequest(f"{len(prompts)} prompts x n={params.n} make more sequences than this "
                       f"server queues ({self.engine.max_waiting}): send them in smaller requests",
                       param="prompt")
    return [self._prompt_ids(p, params, req, "prompt", f"prompt {i}: " if len(prompts) > 1 else "")
            for i, p in enumerate(prompts)]

  async def submit_chat(self, req: ChatCompletionRequest, request_id: str) -> list[RequestStream]:
    params = req.sampling_params()
    parser = self.tool_parser(req)
    if parser is not None and parser.needs_special_tokens:
      params = dataclasses.replace(params, skip_special_tokens=False)
    ids = await self.engine.prepare(self._chat_prompt, req, params)
    return self._submit([ids], params, request_id, self.adapters.lookup(req.model))

  def _chat_prompt(self, req: ChatCompletionRequest, params: SamplingParams) -> list[int]:
    kwargs = req.chat_template_kwargs or {}
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
      raise BadRequest(f"chat_template_kwargs may not set {', '.join(reserved)}: the server "
                       f"sets {'it' if len(reserved) == 1 else 'them'}",
                       param="chat_template_kwargs")
    # Keys the template never reads are dropped, as vLLM does: they could only clash.
    usable = self.tokenizer.chat_template_variables
    if self.tokenizer.chat_template is None:
      raise BadRequest(f"{self.tokenizer.name or 'this model'} has no chat template: it is a base "
                       f"model that completes text; use /v1/completions", param="messages")
    messages = [m.for_template() for m in req.messages]
    tools = req.tools_for_template()
    if self.template_has_tools:
      messages = template_messages(messages)
      if tools is not None:
        kwargs = {**kwargs, "tools": tools}
    elif tools is not None or any(m.role == "tool" or m.tool_calls for m in req.messages):
      messages = default_prompt_messages(messages, tools)
    try:
      text = self.tokenizer.apply_chat_template(
          messages, add_generation_prompt=True,
          **{k: v for k, v in kwargs.items() if k in usable})
    except Exception as e:  # the template works for well-formed input: the request broke it
      raise BadRequest(f"the chat template could not render these messages: {e}",
                       param="messages") from None
    return self._prompt_ids(text, params, req, "messages", "", add_special_tokens=False)

  def _prompt_ids(self, prompt: str | list[int], params: SamplingParams, req: SamplingRequest,
                  field: str, where: str, add_special_tokens: bool = True) -> list[int]:
    """The token ids of a prompt the engine can run, or BadRequest naming the field at fault."""
    ids = None
    try:
      ids = self.engine.tokenize(prompt, add_special_tokens=add_special_tokens)
      self.engine.validate(ids, params)
      return ids
    except ValueError as e:
      msg = str(e)
      too_long = "max_model_len" in msg
      if too_long and ids is not None and len(ids) < self.engine.max_model_len:
        param = req.max_tokens_field  # the prompt fits; with the output asked for, it does not
      else:
        param = req.field_of(e) or field
      raise BadRequest(where + msg, param=param,
                       code="context_length_exceeded" if too_long else None) from None

  def _submit(self, prompts: list[list[int]], params: SamplingParams, request_id: str,
              lora: LoRARequest | None) -> list[RequestStream]:
    streams: list[RequestStream] = []
    try:
      for i, ids in enumerate(prompts):
        streams.append(self.engine.generate(ids, params, f"{request_id}-{i}", lora_request=lora))
    except BaseException:  # e.g. the queue filled up halfway: take back what went in
      for s in streams:
        s.close()
      raise
    return streams

  async def _merge(self, streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from every stream as they come. Leaving early aborts the rest."""
    tasks: dict[asyncio.Future, int] = {}

    def next_of(i: int):
      tasks[asyncio.ensure_future(anext(streams[i]))] = i

    try:
      for i in range(len(streams)):
        next_of(i)
      while tasks:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in done:
          i = tasks.pop(t)
          try:
            out = t.result()
          except StopAsyncIteration:
            continue
          except (RequestFailedError, RequestAbortedError) as e:
            self.metrics.observe_unfinished(
                "error" if isinstance(e, RequestFailedError) else "abort")
            raise
          if out.finished:
            self.metrics.observe_finished(out)
          else:
            next_of(i)
          yield i, out
    finally:
      for t in tasks:
        t.cancel()
      for s in streams:
        if not s.done:
          self.metrics.observe_unfinished("abort")
        s.close()

  # -- logprobs -----------------------------------------------------------------------------
  def _text(self, token_id: int) -> str:
    text = self._token_text.get(token_id)
    if text is None:
      text = self._token_text[token_id] = self.tokenizer.decode([token_id],
                                                                skip_special_tokens=False)
    return text

  def _completion_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]],
                           offset: int) -> CompletionLogprobs:
    """`offset`: where the first token starts in the choice's text."""
    out = CompletionLogprobs()
    for tid, entry in zip(token_ids, logprobs):
      text = self._text(tid)
      out.tokens.append(text)
      out.token_logprobs.append(max(entry[tid], _MIN_LOGPROB))
      # The sampled token first, then the top ones: up to logprobs + 1 entries, as OpenAI says.
      out.top_logprobs.append({self._text(t): max(lp, _MIN_LOGPROB) for t, lp in entry.items()})
      out.text_offset.append(offset)
      offset += len(text)
    return out

  def _top(self, token_id: int, logprob: float) -> TopLogprob:
    # A token that ends inside a UTF-8 character decodes to U+FFFD: its bytes are those of U+FFFD.
    text = self._text(token_id)
    return TopLogprob(token=text, logprob=max(logprob, _MIN_LOGPROB),
                      bytes=list(text.encode("utf-8")))

  def _chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]],
                     top_n: int) -> ChatLogprobs:
    content = []
    for tid, entry in zip(token_ids, logprobs):
      tops = sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]
      content.append(ChatTokenLogprob(**self._top(tid, entry[tid]).model_dump(),
                                      top_logprobs=[self._top(t, lp) for t, lp in tops]))
    return ChatLogprobs(content=content)

  # -- completions --------------------------------------------------------------------------
  async def completion(self, req: CompletionRequest, streams: list[RequestStream],
                       request_id: str) -> CompletionResponse:
    created = int(time.time())
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in self._merge(streams):
      if out.finished:
        finals[i] = out
    choices = []
    for i, out in enumerate(finals):
      for c in out.outputs:
        choices.append(CompletionChoice(
            index=i * req.n + c.index, text=c.text, finish_reason=_finish(c),
            stop_reason=c.stop_reason,
            logprobs=None if req.logprobs is None
            else self._completion_logprobs(c.token_ids, c.logprobs, 0)))
    return CompletionResponse(id=request_id, created=created, model=req.model,
                              choices=choices, usage=_usage(finals))

  async def completion_stream(self, req: CompletionRequest, streams: list[RequestStream],
                              request_id: str) -> AsyncIterator[str]:
    created = int(time.time())
    offsets: dict[int, int] = {}  # choice -> text offset of its next token
    closed: set[int] = set()  # choices whose finish was sent
    finals: list[RequestOutput] = []
    try:
      async for i, out in self._merge(streams):
        if out.finished:
          finals.append(out)
        for c in out.outputs:
          idx, finish = i * req.n + c.index, _finish(c)
          if idx in closed or not (c.delta_text or c.delta_token_ids or finish):
            continue
          if finish:
            closed.add(idx)
          logprobs = None
          if req.logprobs is not None:
            logprobs = self._completion_logprobs(c.delta_token_ids, c.delta_logprobs,
                                                 offsets.get(idx, 0))
            offsets[idx] = offsets.get(idx, 0) + sum(map(len, logprobs.tokens))
          yield sse(CompletionResponse(
              id=request_id, created=created, model=req.model,
              choices=[CompletionChoice(index=idx, text=c.delta_text, logprobs=logprobs,
                                        finish_reason=finish, stop_reason=c.stop_reason)]))
      if req.include_usage:
        yield sse(CompletionResponse(id=request_id, created=created, model=req.model,
                                     choices=[], usage=_usage(finals)))
    except (RequestFailedError, RequestAbortedError, EngineDeadError) as e:
      yield sse(stream_error(e))
    yield DONE

  # -- chat ---------------------------------------------------------------------------------
  async def chat(self, req: ChatCompletionRequest, streams: list[RequestStream],
                 request_id: str) -> ChatCompletionResponse:
    created = int(time.time())
    final = None
    async for _, out in self._merge(streams):
      final = out
    parser = self.tool_parser(req)
    choices = []
    for c in final.outputs:
      content, calls = c.text, []
      if parser is not None:
        parsed = parser.parse(c.text, final=True)
        calls = parsed.calls
        content = content_of(parsed)
      choices.append(ChatChoice(
          index=c.index, message=AssistantMessage(content=content, tool_calls=_tool_calls(calls)),
          finish_reason=_finish(c, bool(calls)), stop_reason=c.stop_reason,
          logprobs=self._chat_logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0)
          if req.logprobs else None))
    return ChatCompletionResponse(id=request_id, created=created, model=req.model,
                                  choices=choices, usage=_usage([final]))

  async def chat_stream(self, req: ChatCompletionRequest, streams: list[RequestStream],
                        request_id: str) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(choices: list[ChatStreamChoice], usage: Usage | None = None) -> str:
      return sse(ChatCompletionChunk(id=request_id, created=created, model=req.model,
                                     choices=choices, usage=usage))

    parser = self.tool_parser(req)
    # Per choice: the text held while a call may be in it, and how many calls went out.
    calls_of = {k: StreamingToolCalls(parser) for k in range(req.n)} if parser else {}
    sent_calls = dict.fromkeys(range(req.n), 0)
    try:
      # Each choice opens with the role, before any token exists (as OpenAI's stream does).
      for k in range(req.n):
        yield chunk([ChatStreamChoice(index=k, delta=DeltaMessage(role="assistant", content=""))])
      final = None
      closed: set[int] = set()  # choices whose finish was sent
      async for _, out in self._merge(streams):
        final = out
        for c in out.outputs:
          if c.index in closed:
            continue
          content, calls = c.delta_text, []
          if parser is not None:
            content, calls = calls_of[c.index].feed(c.delta_text)
            if c.finish_reason is not None:
              rest, more = calls_of[c.index].finish()
              content, calls = content + rest, calls + more
          first = sent_calls[c.index]
          sent_calls[c.index] += len(calls)
          finish = _finish(c, sent_calls[c.index] > 0)
          # A token that completes no character yet still carries its logprobs.
          if not (content or calls or finish or (req.logprobs and c.delta_token_ids)):
            continue
          if finish:
            closed.add(c.index)
          yield chunk([ChatStreamChoice(
              index=c.index, delta=DeltaMessage(content=content or None,
                                                tool_calls=_tool_deltas(calls, first)),
              finish_reason=finish, stop_reason=c.stop_reason,
              logprobs=self._chat_logprobs(c.delta_token_ids, c.delta_logprobs,
                                           req.top_logprobs or 0) if req.logprobs else None)])
      if req.include_usage:
        yield chunk([], _usage([final]))
    except (RequestFailedError, RequestAbortedError, EngineDeadError) as e:
      yield sse(stream_error(e))
    yield DONE
