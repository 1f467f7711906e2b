"""Tool calling around the chat template: the JSON schema that forces a call when one is
required, and the default tool prompt for a model whose chat template has no tool format.

A template that reads `tools` gets them, and the messages' `tool_calls` and `tool_call_id`, as
transformers' `apply_chat_template` passes them. A template that does not (the built-in
SmolLM2's) would drop them silently and the model would never know it has tools; for those
jinfer writes the tools into the system message in the hermes format (`DEFAULT_TOOL_PROMPT`),
renders earlier calls and their results as text in the same format, and parses the answer with
the hermes parser.
"""
from __future__ import annotations

import json
from typing import Any

DEFAULT_TOOL_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def _arguments(text: str) -> Any:
  # Templates write arguments with `tojson`: they want the object, not its text (as vLLM passes).
  try:
    return json.loads(text)
  except ValueError:
    return text


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Messages for a template that knows tools: each call's arguments as an object."""
  out = []
  for m in messages:
    if m.get("tool_calls"):
      m = {**m, "tool_calls": [
          {**c, "function": {**c["function"], "arguments": _arguments(c["function"]["arguments"])}}
          for c in m["tool_calls"]]}
    out.append(m)
  return out


def default_prompt_messages(messages: list[dict[str, Any]],
                            tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
  """Messages for a template without a tool format, the tools and calls written as hermes text:
  the tool prompt at the end of the system message (one is added when there is none), each
  earlier call as `<tool_call>` lines after its message's content, each tool result as a user
  turn in `<tool_response>` tags (consecutive results in one turn, as Qwen's template does)."""
  out: list[dict[str, Any]] = []
  for m in messages:
    if m["role"] == "tool":
      response = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
      if out and out[-1].get("_tool_results"):
        out[-1]["content"] += "\n" + response
      else:
        out.append({"role": "user", "content": response, "_tool_results": True})
      continue
    if m.get("tool_calls"):
      calls = "\n".join(
          "<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                        "arguments": _arguments(c["function"]["arguments"])},
                                       ensure_ascii=False) + "\n</tool_call>"
          for c in m["tool_calls"])
      content = m.get("content") or ""
      m = {"role": m["role"], "content": f"{content}\n{calls}" if content else calls}
    out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")})
  for m in out:
    m.pop("_tool_results", None)
  if tools:
    prompt = DEFAULT_TOOL_PROMPT.format(
        tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    if out and out[0]["role"] == "system":
      out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{prompt}".lstrip()}
    else:
      out.insert(0, {"role": "system", "content": prompt})
  return out


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
  return {"type": "object",
          "properties": {"name": {"type": "string", "enum": [function["name"]]},
                         "arguments": function.get("parameters") or {"type": "object"}},
          "required": ["name", "arguments"], "additionalProperties": False}


def tool_call_schema(functions: list[dict[str, Any]], *, many: bool) -> dict[str, Any]:
  """The JSON schema of the output when a call is required: one `{"name", "arguments"}` object
  whose arguments follow that function's parameters, or (`many`) a non-empty array of them."""
  one = _call_schema(functions[0]) if len(functions) == 1 \
      else {"anyOf": [_call_schema(f) for f in functions]}
  return {"type": "array", "items": one, "minItems": 1} if many else one
