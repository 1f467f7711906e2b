"""Tool calling and output constraints on the server: the tool-call parsers on known texts,
requests translated into StructuredOutputsParams, tools and tool messages through chat templates,
and a real server driven by the official `openai` client (a tiny random model in the quick tier,
the built-in SmolLM2 with jinfer's default tool prompt in the slow one). A required or named
call is constrained by its tools' schemas: it always parses, even from a random model.
"""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import ValidationError

from jinfer.cli import parser as cli_parser
from jinfer.engine.engine import LLMEngine
from jinfer.engine.engine_config import EngineConfig
from jinfer.sampling.params import StructuredOutputsParams
from jinfer.serving.options import ServerOptions
from jinfer.serving.protocol import (ChatCompletionChunk, ChatCompletionRequest, ChatStreamChoice,
                                     CompletionRequest, DeltaMessage)
from jinfer.serving.tool_parsers import (ConstrainedParser, ParsedCall, StreamingToolCalls,
                                         content_of, get_parser)
from jinfer.serving.tools import DEFAULT_TOOL_PROMPT, default_prompt_messages
from jinfer.serving.completions import _tool_deltas
from jinfer.tokenizer import Tokenizer
from tests.engine_fixtures import SMALL_POOL, SMOLLM2
from tests.live_server import live_server, post_json, wait_idle


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
# Arguments from a closed set: a constrained call on a random model is short and finite.
UNIT = {"type": "function", "function": {
    "name": "set_unit", "parameters": {
        "type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
        "additionalProperties": False}}}


# -- parsers --------------------------------------------------------------------------------
def _stream(parser, text: str, step: int = 1) -> tuple[str, list[ParsedCall]]:
  """The content and calls a stream sends, fed `step` characters at a time."""
  s, content, calls = StreamingToolCalls(parser), "", []
  for i in range(0, len(text), step):
    c, k = s.feed(text[i:i + step])
    content, calls = content + c, calls + k
  c, k = s.finish()
  return content + c, calls + k


HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
          '</tool_call>')


@pytest.mark.parametrize("name, text, content, calls", [
    ("hermes", HERMES, "Let me check.\n\n",
     [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]),
    # a call left unclosed at the end of the output still counts
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}', "", [("f", {})]),
    # malformed JSON, or no name: the block stays text
    ("hermes", 'a<tool_call>{"name": "f", "arguments": {</tool_call>b',
     'a<tool_call>{"name": "f", "arguments": {</tool_call>b', []),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "g"}</tool_call>',
     '<tool_call>{"arguments": {}}</tool_call>', [("g", {})]),
    ("hermes", "plain text with <tool_ but no call", "plain text with <tool_ but no call", []),
    ("hermes", '\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n\n', "\n\n\n",
     [("f", {})]),
    ("hermes", "  \n", "  \n", []),
    ("llama3_json", '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}',
     "", [("f", {"x": 1}), ("g", {})]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"x": "a b"}}', "",
     [("f", {"x": "a b"})]),
    ("llama3_json", 'The answer is {"name": "f"}', 'The answer is {"name": "f"}', []),
    ("llama3_json", '{"name": "f", "parameters": {"x": 1}', '{"name": "f", "parameters": {"x": 1}',
     []),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, '
                '{"name": "g", "arguments": {}}]', "Sure. ", [("f", {"x": 1}), ("g", {})]),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}', '[TOOL_CALLS][{"name": "f", '
                '"arguments": {"x": 1}', []),
])
def test_parsers_on_known_texts(name, text, content, calls):
  parser = get_parser(name)
  parsed = parser.parse(text, final=True)
  assert parsed.content == content
  assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls
  # A stream sends the message's content and the same calls, whatever the split.
  for step in (1, 3, len(text)):
    streamed_content, streamed_calls = _stream(parser, text, step)
    assert streamed_content == (content_of(parsed) or "") and streamed_calls == parsed.calls


def test_a_stream_sends_text_before_a_call_at_once_and_each_call_when_it_closes():
  s = StreamingToolCalls(get_parser("hermes"))
  assert s.feed("Let me check.<tool") == ("Let me check.", [])  # "<tool" may open a call
  assert s.feed('_call>{"name": "f", "arguments": {}}') == ("", [])
  assert s.feed("</tool_call>") == ("", [ParsedCall("f", "{}")])
  assert s.finish() == ("", [])
  s = StreamingToolCalls(get_parser("hermes"))
  assert s.feed("1 <tool") == ("1 ", [])
  assert s.feed("s > 0") == ("<tools > 0", [])  # it did not


def test_constrained_output_parses_as_one_call_or_an_array():
  p = ConstrainedParser()
  one = '{"name": "f", "arguments": {"a": 1}}'
  assert p.parse(one, True).calls == [ParsedCall("f", '{"a": 1}')]
  assert [c.name for c in p.parse('[{"name": "f", "arguments": {}}, {"name": "g", "arguments": '
                                  '{}}]', True).calls] == ["f", "g"]
  cut = '[{"name": "f", "argu'  # cut by max_tokens
  assert p.parse(cut, True).content == cut and not p.parse(cut, True).calls
  assert _stream(p, '{"name": "f", "arguments": {}}') == ("", [ParsedCall("f", "{}")])


def test_unknown_parser_names_are_refused():
  with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
    get_parser("nope")
  with pytest.raises(ValueError, match="tool_call_parser must be one of"):
    ServerOptions(tool_call_parser="nope")
  with pytest.raises(ValueError, match="needs tool_call_parser"):
    ServerOptions(enable_auto_tool_choice=True)
  args = cli_parser().parse_args(["serve", "--enable-auto-tool-choice",
                                  "--tool-call-parser", "llama3_json"])
  assert args.enable_auto_tool_choice and args.tool_call_parser == "llama3_json"


# -- request translation --------------------------------------------------------------------
def _chat(**fields) -> ChatCompletionRequest:
  return ChatCompletionRequest.model_validate_json(json.dumps(
      {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}))


def _completion(**fields) -> CompletionRequest:
  return CompletionRequest.model_validate_json(json.dumps({"model": "m", "prompt": "hi",
                                                           **fields}))


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize("fields, want", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA,
                                                                 "strict": True}}},
     StructuredOutputsParams(json=SCHEMA)),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputsParams(json=SCHEMA)),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}},
     StructuredOutputsParams(json=json.dumps(SCHEMA))),
    ({"structured_outputs": {"regex": "[0-9]+"}}, StructuredOutputsParams(regex="[0-9]+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}},
     StructuredOutputsParams(choice=["yes", "no"])),
    ({"structured_outputs": {"grammar": 'start: "a"+'}},
     StructuredOutputsParams(grammar='start: "a"+')),
    ({"structured_outputs": {"json_object": True}}, StructuredOutputsParams(json_object=True)),
])
def test_constraints_become_structured_outputs_params(fields, want):
  assert _chat(**fields).sampling_params().structured_outputs == want
  assert _completion(**fields).sampling_params().structured_outputs == want


def test_a_required_call_is_constrained_by_the_tools_schemas():
  def schema(**fields):
    return _chat(tools=[WEATHER, UNIT], **fields).sampling_params().structured_outputs.json

  call = {"name": "get_weather", "arguments": {"city": "Paris"}}
  other = {"name": "set_unit", "arguments": {"unit": "c"}}
  many = schema(tool_choice="required")
  jsonschema.validate([call, other], many)
  for bad in ([], [{"name": "nope", "arguments": {}}], [{"name": "set_unit",
                                                         "arguments": {"unit": "k"}}], call):
    with pytest.raises(jsonschema.ValidationError):
      jsonschema.validate(bad, many)
  one = schema(tool_choice="required", parallel_tool_calls=False)
  jsonschema.validate(call, one)
  named = schema(tool_choice={"type": "function", "function": {"name": "set_unit"}})
  jsonschema.validate(other, named)
  with pytest.raises(jsonschema.ValidationError):
    jsonschema.validate(call, named)
  for choice in ("auto", "none"):
    assert _chat(tools=[WEATHER], tool_choice=choice).sampling_params().structured_outputs is None


@pytest.mark.parametrize("fields, param, message", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", 'the function "nope", which is not among the tools'),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools", "tools[0].function.parameters must be a JSON schema of type object"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools",
     "tools[0].function.name must be"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "given twice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "cannot be combined with response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one of json, regex, choice, grammar, json_object; got regex, choice"),
    ({"structured_outputs": {}}, "structured_outputs", "got none"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice is empty"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs",
     "structured_outputs.json is not valid JSON"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "structured_outputs", "not both"),
])
def test_bad_constraints_and_tools_name_their_field(fields, param, message):
  req = _chat(**fields)
  with pytest.raises(ValueError) as e:
    req.sampling_params()
  assert req.field_of(e.value) == param and message in str(e.value)


def test_an_engine_refusal_of_a_constraint_names_the_field_it_came_from():
  from jinfer.errors import ParameterError
  refused = ParameterError("structured_outputs", "does not compile")
  assert _chat(response_format={"type": "json_object"}).field_of(refused) == "response_format"
  assert _chat(tools=[WEATHER], tool_choice="required").field_of(refused) == "tools"
  assert _completion(structured_outputs={"regex": "("}).field_of(refused) == "structured_outputs"


def test_wrong_shapes_are_refused_by_the_schema():
  for fields in ({"response_format": {"type": "xml"}}, {"tool_choice": "always"},
                 {"tool_choice": {"type": "function", "function": {}}},
                 {"tools": [{"type": "retrieval"}]}, {"structured_outputs": {"choice": "a"}}):
    with pytest.raises(ValidationError):
      _chat(**fields)


def test_tool_deltas_are_what_the_openai_client_reads():
  chunk = ChatCompletionChunk(id="c", created=0, model="m", choices=[ChatStreamChoice(
      index=0, delta=DeltaMessage(tool_calls=_tool_deltas([ParsedCall("f", '{"a": 1}')], 2)),
      finish_reason="tool_calls")])
  parsed = openai.types.chat.ChatCompletionChunk.model_validate_json(chunk.model_dump_json())
  (call,) = parsed.choices[0].delta.tool_calls
  assert call.index == 2 and call.id.startswith("call_") and call.type == "function"
  assert (call.function.name, call.function.arguments) == ("f", '{"a": 1}')
  assert parsed.choices[0].finish_reason == "tool_calls"


# -- chat templates -------------------------------------------------------------------------
# Qwen2.5's tool format, trimmed: tools into the system turn, calls as <tool_call> JSON, results
# as user turns in <tool_response> tags.
QWEN_STYLE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}{% continue %}{% endif %}
{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}{% for tc in message.tool_calls %}<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response id="{{ message.tool_call_id }}">
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


def _with_template(tok: Tokenizer, template: str) -> Tokenizer:
  return Tokenizer(tok._backend, special_tokens=tok._special_tokens,
                   eos_token_ids=tok.eos_token_ids, chat_template=template)


def _render(tok: Tokenizer, messages, **fields) -> str:
  """What the server renders for a chat request (`OpenAIServing._chat_prompt`'s text)."""
  from jinfer.serving.completions import OpenAIServing
  serving = OpenAIServing.__new__(OpenAIServing)
  serving.tokenizer = tok
  seen = {}
  serving._prompt_ids = lambda text, *a, **k: seen.setdefault("text", text)
  req = _chat(**fields) if messages is None else ChatCompletionRequest.model_validate_json(
      json.dumps({"model": "m", "messages": messages, **fields}))
  serving._chat_prompt(req, req.sampling_params())
  return seen["text"]


def test_tools_and_tool_messages_render_through_a_template_that_knows_tools(tiny_model):
  tok = _with_template(tiny_model[2], QWEN_STYLE)
  text = _render(tok, HISTORY, tools=[WEATHER])
  assert text == (
      "<|im_start|>system\n# Tools\n<tools>\n" + json.dumps(WEATHER) + "\n</tools><|im_end|>\n"
      "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
      "<|im_start|>assistant\n<tool_call>\n"
      '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<|im_end|>\n'
      '<|im_start|>user\n<tool_response id="call_1">\nsunny, 21 C\n</tool_response><|im_end|>\n'
      "<|im_start|>assistant\n")


def test_a_template_without_tools_gets_the_default_tool_prompt(tiny_model):
  tok = tiny_model[2]  # SmolLM2's template: no tool format
  assert "tools" not in tok.chat_template_variables
  text = _render(tok, [{"role": "system", "content": "Be brief."}] + HISTORY, tools=[WEATHER])
  prompt = DEFAULT_TOOL_PROMPT.format(tools=json.dumps(WEATHER))
  assert text == (
      f"<|im_start|>system\nBe brief.\n\n{prompt}<|im_end|>\n"
      "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
      '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
      '{"city": "Paris"}}\n</tool_call><|im_end|>\n'
      "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>\n"
      "<|im_start|>assistant\n")
  # Without a system message, the tool prompt is one; without tools, nothing is added.
  assert _render(tok, None, tools=[WEATHER]).startswith(f"<|im_start|>system\n{prompt}<|im_end|>")
  assert _render(tok, None) == tok.apply_chat_template([{"role": "user", "content": "hi"}])
  assert default_prompt_messages([{"role": "user", "content": "hi"}], None) == \
      [{"role": "user", "content": "hi"}]


# -- a real server on the tiny model (quick) -------------------------------------------------
# The tools as names only: the quick engine's context is 64 tokens.
COMPACT = """\
{%- if tools %}<|im_start|>system
tools: {% for t in tools %}{{ t.function.name }} {% endfor %}<|im_end|>
{% endif %}
{%- for m in messages %}<|im_start|>{{ 'user' if m.role == 'tool' else m.role }}
{% for tc in m.tool_calls or [] %}<tool_call>{{ tc.function.name }}</tool_call>{% endfor %}\
{{ m.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_model):
  config, params, tok = tiny_model
  # SMALL_POOL: its compiled steps are in the compilation cache.
  engine = LLMEngine.from_parts(config, params, _with_template(tok, COMPACT),
                                config=EngineConfig.of(**SMALL_POOL))
  with live_server(engine, MODEL, enable_auto_tool_choice=True,
                   tool_call_parser="hermes") as srv:
    yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
  return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


CHAT = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("fields, param, message", [
    ({"tools": [UNIT], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "which is not among the tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools", "of type object"),
    ({"response_format": {"type": "xml"}}, "response_format",
     "Invalid value for 'response_format.type'"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one of"),
])
def test_bad_requests_get_400_naming_the_field_and_queue_nothing(server, fields, param, message):
  steps = server.engine.num_steps
  status, body = post_json(f"{server.url}/v1/chat/completions", json.dumps(
      {"model": MODEL, "messages": CHAT, "max_tokens": 2, **fields}).encode())
  assert status == 400 and body["error"]["param"] == param
  assert message in body["error"]["message"]
  assert server.engine.num_steps == steps
  wait_idle(server.engine)


def test_tools_with_auto_answer_and_their_stream_agree(server, client):
  kw = dict(model=MODEL, messages=CHAT, tools=[UNIT], max_tokens=8, temperature=1, seed=5, n=2,
            extra_body={"ignore_eos": True})
  full = client.chat.completions.create(**kw)
  chunks = list(client.chat.completions.create(**kw, stream=True))
  for choice in full.choices:
    calls = choice.message.tool_calls or []
    assert choice.finish_reason == ("tool_calls" if calls else "length")
    assert choice.message.content is not None or calls
    mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
    assert "".join(d.delta.content or "" for d in mine) == (choice.message.content or "")
    streamed = [t for d in mine for t in d.delta.tool_calls or []]
    assert [(t.function.name, t.function.arguments) for t in streamed] == \
        [(t.function.name, t.function.arguments) for t in calls]
    assert mine[-1].finish_reason == choice.finish_reason


def test_tool_history_renders_and_runs(server, client):
  messages = [{"role": "user", "content": "Unit?"}, {"role": "assistant", "tool_calls": [
      {"id": "call_1", "type": "function",
       "function": {"name": "set_unit", "arguments": '{"unit": "c"}'}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]
  out = client.chat.completions.create(model=MODEL, messages=messages, tools=[UNIT],
                                       tool_choice="none", max_tokens=2)
  want = _render(server.engine.tokenizer, messages, tools=[UNIT])
  assert "<tool_call>set_unit</tool_call>" in want and "tools: set_unit" in want
  want_ids = server.engine.tokenizer.encode(want, add_special_tokens=False)
  assert out.usage.prompt_tokens == len(want_ids)
  assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason != "tool_calls"


def test_constrained_requests_run_streamed_and_not(client):
  fmt = {"type": "json_schema", "json_schema": {"name": "unit", "schema": UNIT["function"]
                                                ["parameters"]}}
  out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8,
                                       response_format=fmt)
  assert out.choices[0].finish_reason in ("stop", "length")
  stream = client.completions.create(model=MODEL, prompt="Yes or no?", max_tokens=3, stream=True,
                                     extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
  assert [c.choices[0].finish_reason for c in stream][-1] in ("stop", "length")


def test_choice_constraint_holds(client):
  out = client.completions.create(model=MODEL, prompt="Yes or no?", max_tokens=3, temperature=1,
                                  seed=1, extra_body={"structured_outputs": {"choice": ["yes",
                                                                                        "no"]}})
  assert out.choices[0].text in ("yes", "no")


def test_a_named_call_always_parses_streamed_and_not(client):
  kw = dict(model=MODEL, messages=CHAT, tools=[UNIT], max_tokens=40, temperature=1, seed=3,
            tool_choice={"type": "function", "function": {"name": "set_unit"}})
  (choice,) = client.chat.completions.create(**kw).choices
  assert choice.finish_reason == "tool_calls" and choice.message.content is None
  (call,) = choice.message.tool_calls
  assert call.id.startswith("call_") and call.function.name == "set_unit"
  jsonschema.validate(json.loads(call.function.arguments), UNIT["function"]["parameters"])
  chunks = list(client.chat.completions.create(**kw, stream=True))
  (streamed,) = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
  assert streamed.index == 0 and streamed.function.arguments == call.function.arguments
  assert chunks[-1].choices[0].finish_reason == "tool_calls"


# -- the built-in model (slow): the default tool prompt, the hermes parser -------------------
@pytest.fixture(scope="module")
def builtin_client(smollm2_gguf):
  engine = LLMEngine(smollm2_gguf, config=EngineConfig.of(**SMOLLM2))
  with live_server(engine, "smollm2-135m-instruct") as srv:
    yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.slow
def test_the_builtin_model_answers_tools_out_of_the_box(builtin_client):
  # No tool flags: the template has no tool format, so the default prompt and hermes apply.
  kw = dict(model="smollm2-135m-instruct", tools=[WEATHER], max_tokens=24, temperature=0,
            messages=[{"role": "user", "content": "What is the weather in Paris?"}])
  with_tools = builtin_client.chat.completions.create(**kw)
  without = builtin_client.chat.completions.create(**{**kw, "tools": openai.NOT_GIVEN})
  prompt = DEFAULT_TOOL_PROMPT.format(tools=json.dumps(WEATHER))
  assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens + len(prompt) // 8
  (choice,) = with_tools.choices
  assert choice.finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.slow
def test_required_calls_on_the_builtin_model_parse_and_validate(builtin_client):
  kw = dict(model="smollm2-135m-instruct", tools=[WEATHER, UNIT], tool_choice="required",
            max_tokens=128, temperature=0,
            messages=[{"role": "user", "content": "What is the weather in Paris?"}])
  (choice,) = builtin_client.chat.completions.create(**kw).choices
  assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
  schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, UNIT)}
  for call in choice.message.tool_calls:
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
  chunks = list(builtin_client.chat.completions.create(**kw, stream=True))
  streamed = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
  assert [(t.function.name, t.function.arguments) for t in streamed] == \
      [(t.function.name, t.function.arguments) for t in choice.message.tool_calls]
  assert [t.index for t in streamed] == list(range(len(streamed)))


def test_auto_on_a_template_with_tools_needs_the_flags(tiny_model):
  from jinfer.serving.completions import OpenAIServing
  from jinfer.serving.errors import BadRequest
  from jinfer.serving.tool_parsers import HermesParser, MistralParser

  def parser_of(template: str, **flags):
    serving = OpenAIServing.__new__(OpenAIServing)
    serving.tokenizer = _with_template(tiny_model[2], template)
    serving.enable_auto_tool_choice = flags.get("enable_auto_tool_choice", False)
    serving.tool_call_parser = flags.get("tool_call_parser")
    return lambda **fields: serving.tool_parser(_chat(**fields))

  native = parser_of(QWEN_STYLE)
  with pytest.raises(BadRequest, match="--enable-auto-tool-choice and --tool-call-parser") as e:
    native(tools=[WEATHER])
  assert e.value.param == "tool_choice"
  assert isinstance(native(tools=[WEATHER], tool_choice="required"), ConstrainedParser)
  assert native(tools=[WEATHER], tool_choice="none") is None and native() is None
  flagged = parser_of(QWEN_STYLE, enable_auto_tool_choice=True, tool_call_parser="mistral")
  assert isinstance(flagged(tools=[WEATHER]), MistralParser)
  # A template without a tool format gets the default prompt, hence hermes, whatever the flags.
  assert isinstance(parser_of(tiny_model[2].chat_template)(tools=[WEATHER]), HermesParser)
