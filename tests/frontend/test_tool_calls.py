"""Tool calling: which plan a request gets, the grammar that forces a call, and the calls read
back from the model's text (its own hermes format, or the forced JSON)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from core_engine.common.model_files import resolve_model_path
from core_engine.frontend.openai.protocol.chat import ChatCompletionRequest
from core_engine.frontend.openai.tool_calls import ToolChoiceError, hermes_tool_calls, plan_tools
from core_engine.frontend.text.tokenizer import load_tokenizer
from core_engine.proto import SamplingParams
from core_engine.proto.engine_config import EngineConfig
from tests.helpers.engine_helpers import in_process_engine

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=MESSAGES, **fields)


def test_the_plan_follows_tool_choice():
    assert plan_tools(request(), None, False).mode == "none"
    assert plan_tools(request(tools=[WEATHER], tool_choice="none"), None, False).mode == "none"
    required = plan_tools(request(tools=[WEATHER, TIME], tool_choice="required"), None, False)
    assert required.mode == "required" and len(required.template_kwargs()["tools"]) == 2
    named = plan_tools(
        request(
            tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}
        ),
        None,
        False,
    )
    assert (named.mode, named.named) == ("named", "get_weather")
    assert plan_tools(request(tools=[WEATHER]), "hermes", True).mode == "auto"


@pytest.mark.parametrize(
    ("fields", "parser", "renders", "param", "message"),
    [
        (
            {"tools": [WEATHER]},
            None,
            True,
            "tool_choice",
            "needs the server started with --tool-call-parser",
        ),
        ({"tools": [WEATHER]}, "hermes", False, "tools", "chat template does not render tools"),
        ({"tool_choice": "required"}, None, False, "tool_choice", "needs tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            None,
            False,
            "tool_choice",
            "'nope', which is not among the tools",
        ),
    ],
)
def test_what_cannot_be_served_is_refused_by_field(fields, parser, renders, param, message):
    with pytest.raises(ToolChoiceError, match=message) as error:
        plan_tools(request(**fields), parser, renders)
    assert error.value.param == param


def test_forced_calls_are_read_back_from_the_constrained_json():
    named = plan_tools(
        request(
            tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}
        ),
        None,
        False,
    )
    assert json.loads(named.constraint().json) == WEATHER["function"]["parameters"]
    content, (call,) = named.extract('{"city": "Paris"}')
    assert content is None and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    required = plan_tools(
        request(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False),
        None,
        False,
    )
    schema = json.loads(required.constraint().json)
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    text = '[{"name": "get_time", "parameters": {}}]'
    jsonschema.validate(json.loads(text), schema)
    _, (call,) = required.extract(text)
    assert (call.function.name, call.function.arguments) == ("get_time", "{}")
    assert required.extract('[{"name": "get_ti')[1] == []  # cut short by max_tokens


def test_hermes_calls_are_parsed_and_the_rest_kept_as_content():
    text = (
        "Let me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        "<tool_call>not json</tool_call>"
    )
    content, calls = hermes_tool_calls(text)
    assert [c.function.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert content == "Let me check.\n<tool_call>not json</tool_call>"
    assert hermes_tool_calls("just words") == ("just words", [])
    assert hermes_tool_calls('<tool_call>{"name": "f", "arguments": "{}"}</tool_call>')[0] is None


@pytest.mark.slow
def test_a_required_call_from_the_default_model_validates():
    """The forcing grammar works on a real vocabulary: the model that knows nothing of tools
    still answers with a well-formed call of a listed tool."""
    tools_request = request(
        tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False
    )
    plan = plan_tools(tools_request, None, False)
    config = EngineConfig(device="cpu", max_model_len=512)
    engine = in_process_engine(config)
    tokenizer = load_tokenizer(resolve_model_path(None))
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=plan.constraint())
    (result,) = engine.generate_text(["Call a tool for Paris weather:"], tokenizer, params).results
    jsonschema.validate(json.loads(result.text), json.loads(plan.constraint().json))
    _, (call,) = plan.extract(result.text)
    assert call.function.name in ("get_weather", "get_time")
