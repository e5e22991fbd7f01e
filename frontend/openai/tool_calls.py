"""Tool calling on the chat endpoint, as vLLM does it.

- `tool_choice` "none", or no tools: plain chat; the template does not see the tools.
- a named function: the output is constrained to that function's parameters (its JSON schema),
  and the reply is one call of it whose arguments are the output (finish_reason "stop", as
  OpenAI answers a forced call).
- "required": the output is constrained to a JSON array of `{"name", "parameters"}` objects, at
  least one (at most one when `parallel_tool_calls` is false), each a call of a listed tool.
- "auto" (the default when tools are given): the model decides, writing calls in its own format,
  which the server's `--tool-call-parser` reads back (hermes: `<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`). It needs that flag and a chat template that renders the
  tools; without either the request is a 400 saying which.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from core_engine.frontend.openai.protocol.chat import ChatCompletionRequest
from core_engine.frontend.openai.protocol.tools import FunctionCall, ToolCall
from core_engine.proto.sampling_params import StructuredOutputs

TOOL_CALL_PARSERS = ("hermes",)
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class ToolChoiceError(ValueError):
    """A tool request this server cannot serve as asked; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one chat request uses its tools: `mode` is none, named, required or auto."""

    mode: str
    tools: tuple[dict[str, Any], ...] = ()
    named: str | None = None
    parallel: bool = True

    @property
    def calls_tools(self) -> bool:
        return self.mode != "none"

    def constraint(self) -> StructuredOutputs | None:
        """The output grammar that forces the call(s); None for none and auto."""
        if self.mode == "named":
            (tool,) = (t for t in self.tools if t["function"]["name"] == self.named)
            return StructuredOutputs(json=json.dumps(_parameters(tool)))
        if self.mode != "required":
            return None
        call_of = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool["function"]["name"]]},
                    "parameters": _parameters(tool),
                },
                "required": ["name", "parameters"],
            }
            for tool in self.tools
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": call_of}}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputs(json=json.dumps(schema))

    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template is given besides the messages: the tools, unless none."""
        return {"tools": list(self.tools)} if self.calls_tools else {}

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a finished reply's text."""
        if self.mode == "named":
            return None, [ToolCall(function=FunctionCall(name=self.named, arguments=text))]
        if self.mode == "required":
            return None, _required_calls(text)
        if self.mode == "auto":
            return hermes_tool_calls(text)
        return text, []


def plan_tools(
    request: ChatCompletionRequest, parser: str | None, template_renders_tools: bool
) -> ToolPlan:
    """The plan for `request`; ToolChoiceError naming the field it cannot serve."""
    tools = tuple(tool.model_dump(exclude_none=True) for tool in request.tools or ())
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    parallel = request.parallel_tool_calls is not False
    if choice == "none":
        return ToolPlan("none")
    if not tools:
        raise ToolChoiceError(f"tool_choice {_describe(choice)} needs tools", "tool_choice")
    if isinstance(choice, str) and choice in ("required", "auto"):
        if choice == "auto":
            _check_auto(parser, template_renders_tools)
        return ToolPlan(choice, tools, parallel=parallel)
    names = [tool["function"]["name"] for tool in tools]
    if choice.function.name not in names:
        raise ToolChoiceError(
            f"tool_choice names {choice.function.name!r}, which is not among the tools {names}",
            "tool_choice",
        )
    return ToolPlan("named", tools, named=choice.function.name, parallel=parallel)


def hermes_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """Calls written as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, and the text
    around them as content (None when nothing else is said). A block that is not such JSON stays
    in the content: the model's words are never dropped."""
    calls = []
    kept = []
    position = 0
    for match in _HERMES_CALL.finditer(text):
        call = _hermes_call(match.group(1))
        if call is None:
            continue
        kept.append(text[position : match.start()])
        position = match.end()
        calls.append(call)
    kept.append(text[position:])
    content = "".join(kept).strip()
    return (content or None), calls


def _hermes_call(body: str) -> ToolCall | None:
    try:
        payload = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return None
    arguments = payload.get("arguments", payload.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return ToolCall(function=FunctionCall(name=payload["name"], arguments=text))


def _required_calls(text: str) -> list[ToolCall]:
    """The calls of a "required" reply: its grammar makes it a JSON array of {name, parameters}
    unless max_tokens cut it short, in which case there are none to report."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return []
    return [
        ToolCall(function=FunctionCall(name=item["name"], arguments=json.dumps(item["parameters"])))
        for item in items
    ]


def _check_auto(parser: str | None, template_renders_tools: bool) -> None:
    if parser is None:
        raise ToolChoiceError(
            'tool_choice "auto" (the default with tools) needs the server started with '
            f"--tool-call-parser ({', '.join(TOOL_CALL_PARSERS)}); or ask for tool_choice "
            '"required" or a named function, which work with any model',
            "tool_choice",
        )
    if not template_renders_tools:
        raise ToolChoiceError(
            "this model's chat template does not render tools, so it cannot choose one itself; "
            'ask for tool_choice "required" or a named function',
            "tools",
        )


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def _describe(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else repr(choice.function.name)
