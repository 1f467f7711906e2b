"""Tool-call parsers: the function calls a model wrote into its text, in the model's format.

Each parser splits a model's output into content (the text outside the calls) and calls, and
says where a call may begin so that a stream can send the text before it at once and hold the
rest. A call that does not parse (bad JSON, no name) stays in the content, as text: a client
sees what the model wrote rather than losing it. Names are vLLM's `--tool-call-parser` values.
"""
from __future__ import annotations

import dataclasses
import json
import secrets
from typing import Any


@dataclasses.dataclass(frozen=True)
class ParsedCall:
  name: str
  arguments: str  # a JSON object's text, as OpenAI sends it


@dataclasses.dataclass(frozen=True)
class Parsed:
  content: str  # the text outside the calls ("" when there is none)
  calls: list[ParsedCall]


def call_id() -> str:
  return f"call_{secrets.token_hex(12)}"


def _call(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ParsedCall | None:
  """A call from `{"name": ..., "arguments": {...}}`, or None when it is not one."""
  if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
    return None
  args = next((obj[k] for k in args_keys if k in obj), {})
  if isinstance(args, str):  # some models write the arguments as JSON text already
    try:
      args = json.loads(args)
    except ValueError:
      return None
  if not isinstance(args, dict):
    return None
  return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _partial_suffix(text: str, marker: str) -> int:
  """Where a prefix of `marker` that `text` ends with starts (len(text) if none): a stream
  holds that tail back until the next tokens say whether the marker is coming."""
  for k in range(min(len(marker) - 1, len(text)), 0, -1):
    if text.endswith(marker[:k]):
      return len(text) - k
  return len(text)


class ToolParser:
  name: str
  # Whether the format's markers are special tokens, which detokenizing must keep.
  needs_special_tokens: bool = False

  def call_start(self, text: str) -> int:
    """Where the first call may begin in a partial output (len(text) when nowhere yet): the
    text before it is content whatever comes next."""
    raise NotImplementedError

  def parse(self, text: str, final: bool) -> Parsed:
    """The content and the calls of `text`. Not `final`: only the calls already closed (the
    stream sends each when it closes); the content is then meaningless."""
    raise NotImplementedError


class HermesParser(ToolParser):
  """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, once per call: Hermes, Qwen2.5,
  Qwen3, and jinfer's default tool prompt. An unclosed last call counts at the end of the
  output (a model may stop right after its JSON)."""
  name = "hermes"
  OPEN, CLOSE = "<tool_call>", "</tool_call>"

  def call_start(self, text: str) -> int:
    i = text.find(self.OPEN)
    return i if i >= 0 else _partial_suffix(text, self.OPEN)

  def parse(self, text: str, final: bool) -> Parsed:
    content, calls, pos = [], [], 0
    while (start := text.find(self.OPEN, pos)) >= 0:
      content.append(text[pos:start])
      end = text.find(self.CLOSE, start)
      if end < 0 and not final:
        return Parsed("".join(content), calls)
      stop = len(text) if end < 0 else end + len(self.CLOSE)
      call = _call(_loads(text[start + len(self.OPEN):end if end >= 0 else len(text)]))
      if call is None:
        content.append(text[start:stop])
      else:
        calls.append(call)
      pos = stop
    content.append(text[pos:])
    return Parsed("".join(content), calls)


class MistralParser(ToolParser):
  """`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` after any content (Mistral's
  instruct models; `[TOOL_CALLS]` is a special token)."""
  name = "mistral"
  MARK = "[TOOL_CALLS]"
  needs_special_tokens = True

  def call_start(self, text: str) -> int:
    i = text.find(self.MARK)
    return i if i >= 0 else _partial_suffix(text, self.MARK)

  def parse(self, text: str, final: bool) -> Parsed:
    i = text.find(self.MARK)
    if i < 0:
      return Parsed(text, [])
    rest = text[i + len(self.MARK):]
    try:
      value, end = json.JSONDecoder().raw_decode(rest.lstrip())
    except ValueError:
      return Parsed(text, [])
    items = value if isinstance(value, list) else [value]
    calls = [_call(v) for v in items]
    if not items or None in calls:
      return Parsed(text, [])
    tail = rest.lstrip()[end:]
    return Parsed(text[:i] + tail, calls)


class Llama3JsonParser(ToolParser):
  """Llama 3.1+'s JSON tool calls: the whole output is `{"name": ..., "parameters": {...}}`
  (optionally after `<|python_tag|>`, several joined with `;`). Output that does not begin with
  one is content."""
  name = "llama3_json"
  TAG = "<|python_tag|>"

  def call_start(self, text: str) -> int:
    body = text.lstrip()
    if not body:
      return 0
    if body.startswith("{") or body.startswith(self.TAG) or self.TAG.startswith(body):
      return 0
    return len(text)

  def parse(self, text: str, final: bool) -> Parsed:
    body = text.lstrip()
    if body.startswith(self.TAG):
      body = body[len(self.TAG):].lstrip()
    if not body.startswith("{"):
      return Parsed(text, [])
    calls, pos, decoder = [], 0, json.JSONDecoder()
    while True:
      try:
        value, end = decoder.raw_decode(body, pos)
      except ValueError:
        break
      call = _call(value)
      if call is None:
        break
      calls.append(call)
      pos = end
      rest = body[pos:].lstrip()
      if not rest.startswith(";"):
        break
      pos = len(body) - len(rest) + 1
      while pos < len(body) and body[pos].isspace():
        pos += 1
    tail = body[pos:]
    if final and tail.strip() and not calls:
      return Parsed(text, [])
    # Once the calls stop, what follows is content (nothing, with a well-behaved model).
    return Parsed(tail if calls else text, calls)


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def get_parser(name: str) -> ToolParser:
  try:
    return PARSERS[name]()
  except KeyError:
    raise ValueError(f"unknown tool call parser {name!r}; one of: "
                     f"{', '.join(sorted(PARSERS))}") from None


def _loads(text: str) -> Any:
  try:
    return json.loads(text)
  except ValueError:
    return None


class ConstrainedParser(ToolParser):
  """The output a JSON-schema constraint forced into calls (`tool_choice` "required" or a named
  function): one `{"name", "arguments"}` object, or an array of them. No free text comes with
  it; output that still does not parse (cut by max_tokens) stays content."""
  name = "constrained"

  def call_start(self, text: str) -> int:
    return 0

  def parse(self, text: str, final: bool) -> Parsed:
    if not final:
      return Parsed("", [])
    value = _loads(text)
    items = value if isinstance(value, list) else [value]
    calls = [_call(v) for v in items]
    if not items or None in calls:
      return Parsed(text, [])
    return Parsed("", calls)


class StreamingToolCalls:
  """One choice's stream: feed each text delta, get (content to send now, calls closed since the
  last feed); `finish` gives what is left. The content sent plus what `finish` gives equals the
  non-streamed content (`content_of`), and the calls are the non-streamed calls, in order."""

  def __init__(self, parser: ToolParser):
    self.parser, self.text, self.sent, self.calls_sent = parser, "", 0, 0
    # Blank text is held until text follows: around calls alone, there is no content at all.
    self.blank, self.said = "", False

  def feed(self, delta: str) -> tuple[str, list[ParsedCall]]:
    self.text += delta
    # The text before the first place a call may begin is content whatever follows; a later
    # marker cannot begin before a held-back partial one, so `start` never moves back.
    start = max(self.parser.call_start(self.text), self.sent)
    content, self.sent = self._say(self.text[self.sent:start]), start
    calls = self.parser.parse(self.text, final=False).calls[self.calls_sent:]
    self.calls_sent += len(calls)
    return content, calls

  def finish(self) -> tuple[str, list[ParsedCall]]:
    parsed = self.parser.parse(self.text, final=True)
    # The final content begins with what was sent; the rest (trailing text, a call that did not
    # parse, a partial marker that stayed text) comes now.
    sent = self.text[:self.sent]
    rest = parsed.content[len(sent):] if parsed.content.startswith(sent) else parsed.content
    rest, self.blank = self.blank + rest, ""
    if not self.said and not rest.strip() and parsed.calls:
      rest = ""  # as content_of: calls with blank text only have no content
    return rest, parsed.calls[self.calls_sent:]

  def _say(self, text: str) -> str:
    if not (self.blank + text).strip():
      self.blank += text
      return ""
    text, self.blank, self.said = self.blank + text, "", True
    return text


def content_of(parsed: Parsed) -> str | None:
  """The message content of a parsed output: None when calls came with blank text only."""
  return parsed.content if parsed.content.strip() or not parsed.calls else None
