"""Request models of the OpenAI server: every field either works or is refused by name."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from pydantic import ValidationError

from core_engine.frontend.openai.protocol.chat import CHAT_NOT_SUPPORTED, ChatCompletionRequest
from core_engine.frontend.openai.protocol.completions import CompletionRequest
from core_engine.frontend.openai.protocol.sampling_fields import IGNORED, NOT_SUPPORTED
from core_engine.proto.sampling_params import StructuredOutputs

REFUSED_VALUES = {
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "guided_whitespace_pattern": " ",
    "use_beam_search": True,
    "length_penalty": 0.5,
    "allowed_token_ids": [1, 2],
    "truncate_prompt_tokens": 10,
    "logits_processors": ["x"],
    "audio": {"voice": "a"},
    "prediction": {"type": "content"},
    "reasoning_effort": "high",
    "modalities": ["text", "audio"],
    "echo": True,
    "continue_final_message": True,
    "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"enable_thinking": True},
    "documents": [{"text": "a"}],
}
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"prompt": "hi"}


def test_every_refused_field_has_a_refused_value_here():
    assert set(REFUSED_VALUES) == set(NOT_SUPPORTED) | set(CHAT_NOT_SUPPORTED)


def test_tools_are_refused_on_the_completions_endpoint():
    with pytest.raises(ValidationError, match="tools is not supported"):
        CompletionRequest(**COMPLETION, tools=[{"type": "function", "function": {"name": "f"}}])
    with pytest.raises(ValidationError, match="tool_choice is not supported"):
        CompletionRequest(**COMPLETION, tool_choice="required")
    CompletionRequest(**COMPLETION, tools=[], tool_choice="none")


@pytest.mark.parametrize("field", sorted(REFUSED_VALUES))
def test_fields_not_implemented_are_refused_by_name_unless_neutral(field):
    with pytest.raises(ValidationError) as error:
        ChatCompletionRequest(**CHAT, **{field: REFUSED_VALUES[field]})
    (first,) = error.value.errors()
    assert first["loc"] == (field,)
    assert f"{field} is not supported by this server" in first["msg"]
    neutral = {**NOT_SUPPORTED, **CHAT_NOT_SUPPORTED}[field]
    for value in neutral:
        ChatCompletionRequest(**CHAT, **{field: value})


def test_completion_echo_works_and_the_chat_only_refusals_do_not_apply():
    assert CompletionRequest(**COMPLETION, echo=True).echo
    with pytest.raises(ValidationError, match="use_beam_search is not supported"):
        CompletionRequest(**COMPLETION, use_beam_search=True)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(
    ("fields", "expected", "source"),
    [
        ({"response_format": {"type": "text"}}, None, None),
        (
            {"response_format": {"type": "json_object"}},
            StructuredOutputs(json_object=True),
            "response_format",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            StructuredOutputs(json=json.dumps(SCHEMA)),
            "response_format",
        ),
        (
            {"structured_outputs": {"json": SCHEMA}},
            StructuredOutputs(json=json.dumps(SCHEMA)),
            "structured_outputs",
        ),
        (
            {"structured_outputs": {"regex": "a+"}},
            StructuredOutputs(regex="a+"),
            "structured_outputs",
        ),
        (
            {"guided_json": json.dumps(SCHEMA)},
            StructuredOutputs(json=json.dumps(SCHEMA)),
            "guided_json",
        ),
        ({"guided_choice": ["x", "y"]}, StructuredOutputs(choice=["x", "y"]), "guided_choice"),
        (
            {"guided_grammar": 'root ::= "a"'},
            StructuredOutputs(grammar='root ::= "a"'),
            "guided_grammar",
        ),
    ],
)
def test_every_way_to_ask_for_structured_outputs_maps_to_one_constraint(fields, expected, source):
    request = ChatCompletionRequest(**CHAT, **fields)
    assert request.structured_outputs_field() == (expected, source)
    assert request.to_sampling_params().structured_outputs == expected


def test_two_output_constraints_or_a_schema_without_its_type_are_refused():
    with pytest.raises(ValueError, match="guided_regex: give one output constraint, got"):
        CompletionRequest(
            **COMPLETION, response_format={"type": "json_object"}, guided_regex="a"
        ).to_sampling_params()
    with pytest.raises(ValidationError, match="json_schema exactly when type"):
        CompletionRequest(**COMPLETION, response_format={"type": "json_schema"})
    with pytest.raises(ValidationError, match="guided_decoding_backend"):
        CompletionRequest(**COMPLETION, guided_decoding_backend="outlines")


def test_unknown_fields_are_accepted_and_logged_once_and_the_ignored_ones_accepted(caplog):
    with caplog.at_level(logging.WARNING, logger="core_engine.frontend.openai.protocol.base"):
        CompletionRequest(**COMPLETION, some_new_field=0.5)
        CompletionRequest(**COMPLETION, some_new_field=0.7)
    logged = [r for r in caplog.records if "some_new_field" in r.getMessage()]
    assert len(logged) == 1 and "no effect" in logged[0].getMessage()
    ignored = {"user": "u", "metadata": {"a": "b"}, "store": False, "service_tier": "auto"}
    assert set(ignored) == set(IGNORED)
    CompletionRequest(**COMPLETION, **ignored)


def test_tool_calls_and_tool_messages_in_the_history_reach_the_template():
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    conversation = ChatCompletionRequest(messages=messages).conversation()
    assert conversation[1]["tool_calls"] == [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "weather", "arguments": {"city": "Oslo"}},
        }
    ]
    assert conversation[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


def test_new_sampling_fields_reach_sampling_params():
    params = CompletionRequest(
        **COMPLETION,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logit_bias={"5": 2.0},
        include_stop_str_in_output=True,
    ).to_sampling_params()
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)
    assert params.repetition_penalty == 1.2 and params.logit_bias == {5: 2.0}
    assert params.include_stop_str_in_output


def test_the_reference_table_names_every_request_field():
    """docs/serving.md's table is the user's list of what works: it must keep up with the
    models."""
    reference = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    table = reference[reference.index("## Request fields (OpenAI server)") :]
    table = table[: table.index("\n## ")]
    fields = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    missing = {
        name
        for name in fields
        if f"`{name}`" not in table and f"/`_{name.removeprefix('guided_')}`" not in table
    }
    assert missing == set()
