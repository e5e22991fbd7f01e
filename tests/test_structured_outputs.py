"""Structured outputs: grammars built and refused by name, and the default model's constrained
output that parses and validates, alone, beside unconstrained requests, through a preemption."""

from __future__ import annotations

import json

import jsonschema
import pytest

from common.grammars import build_grammar
from common.model_files import resolve_model_path
from core.in_process_engine import run_requests
from core.request import Request
from frontend.structured_outputs import check_structured_outputs
from frontend.tokenizer import load_tokenizer
from proto import SamplingParams
from proto.engine_config import EngineConfig
from proto.sampling_params import StructuredOutputs
from tests.engine_helpers import in_process_engine

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PROMPTS = [
    "Describe a person as JSON:",
    "Here is a JSON record of a customer:",
    "Write one line about the sea.",
]


def test_exactly_one_constraint_per_request():
    with pytest.raises(ValueError, match="exactly one of json, json_object, regex, choice"):
        StructuredOutputs(regex="a", choice=["b"])
    with pytest.raises(ValueError, match=r"got none"):
        StructuredOutputs()
    with pytest.raises(ValueError, match="at least one string"):
        StructuredOutputs(choice=[])


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (StructuredOutputs(json='{"type": "nonsense"}'), 'invalid JSON schema: .*"nonsense"'),
        (StructuredOutputs(json="{not json"), "invalid JSON schema: .*Failed to parse JSON"),
        (StructuredOutputs(regex="(a"), "invalid regex: .*parenthesis"),
        (StructuredOutputs(grammar="root ::= "), "invalid EBNF grammar: .*EBNF parser error"),
    ],
)
def test_invalid_constraints_are_refused_with_the_reason(constraint, message):
    with pytest.raises(ValueError, match=message):
        check_structured_outputs(constraint)


def test_a_choice_accepts_any_characters_literally():
    grammar = str(build_grammar(choice=['say "hi"', "a|b", "new\nline"]))
    assert '"a|b"' in grammar and '"say \\"hi\\""' in grammar


@pytest.fixture(scope="module")
def engine():
    config = EngineConfig(device="cpu", max_model_len=512, max_num_batched_tokens=256)
    return in_process_engine(config)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_path(None))


def generate(engine, tokenizer, prompts, constraint, **params):
    params = SamplingParams(max_tokens=80, structured_outputs=constraint, **params)
    return engine.generate_text(prompts, tokenizer, params).results


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_parse_and_validate(engine, tokenizer, temperature):
    constraint = StructuredOutputs(json=json.dumps(PERSON))
    results = generate(engine, tokenizer, PROMPTS, constraint, temperature=temperature, seed=7)
    for result in results:
        assert result.finish_reason == "stop", result.text
        jsonschema.validate(json.loads(result.text), PERSON)


def test_choice_regex_and_json_object(engine, tokenizer):
    (choice,) = generate(
        engine, tokenizer, ["Is the sea wet?"], StructuredOutputs(choice=["yes", "no"])
    )
    assert choice.text in ("yes", "no")
    (phone,) = generate(engine, tokenizer, ["Call me at"], StructuredOutputs(regex=r"\d{3}-\d{4}"))
    assert len(phone.text) == 8 and phone.text[3] == "-" and phone.text.replace("-", "").isdigit()
    (obj,) = generate(
        engine, tokenizer, PROMPTS[:1], StructuredOutputs(json_object=True), temperature=0.0
    )
    assert obj.finish_reason == "stop" and isinstance(json.loads(obj.text), dict)


def test_constrained_and_unconstrained_requests_share_a_batch(engine, tokenizer):
    """Rows of one step are masked one by one: the free request is untouched (same tokens as
    alone), the constrained ones still validate."""
    free = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0.0,
        max_tokens=80,
        structured_outputs=StructuredOutputs(json=json.dumps(PERSON)),
    )
    alone = engine.generate([tokenizer.encode(PROMPTS[2])], free).results[0].token_ids
    requests = [
        make_request("json-a", tokenizer.encode(PROMPTS[0]), constrained),
        make_request("free", tokenizer.encode(PROMPTS[2]), free),
        make_request("json-b", tokenizer.encode(PROMPTS[1]), constrained),
    ]
    output = run_requests(engine.engine_core.scheduler, engine.executor, requests)
    by_id = {r.request_id: r for r in output.results}
    assert by_id["free"].token_ids == alone
    for request_id in ("json-a", "json-b"):
        jsonschema.validate(json.loads(tokenizer.decode(by_id[request_id].token_ids)), PERSON)


def test_a_preempted_constrained_request_resumes_its_grammar(tokenizer):
    """A KV pool too small for every request preempts some mid-output; the matcher keeps the
    tokens already accepted, and the output is still valid."""
    config = EngineConfig(
        device="cpu", max_model_len=128, max_num_batched_tokens=64, num_gpu_blocks_override=10
    )
    engine = in_process_engine(config)
    constraint = StructuredOutputs(json=json.dumps(PERSON))
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=constraint)
    preamble = "We keep records of people in a small database, one JSON object each. "
    output = engine.generate([tokenizer.encode(preamble * 3 + p) for p in PROMPTS], params)
    assert output.stats.num_preemptions > 0
    for result in output.results:
        jsonschema.validate(json.loads(tokenizer.decode(result.token_ids)), PERSON)


def test_a_constraint_that_does_not_compile_fails_its_request_not_the_engine(engine, tokenizer):
    """A raw client can send what the frontend would refuse: the worker reports it, the
    scheduler finishes that request with an error, the others complete."""
    bad = SamplingParams(max_tokens=5)
    bad.structured_outputs = StructuredOutputs(regex="(unclosed")  # built past the frontend
    good = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    requests = [
        make_request("bad", tokenizer.encode("Hi"), bad),
        make_request("good", tokenizer.encode("Hi"), good),
    ]
    output = run_requests(engine.engine_core.scheduler, engine.executor, requests)
    by_id = {r.request_id: r for r in output.results}
    assert by_id["bad"].finish_reason == "error"
    assert (by_id["good"].finish_reason, len(by_id["good"].token_ids)) == ("length", 5)


def make_request(request_id: str, prompt: list[int], params: SamplingParams) -> Request:
    return Request(request_id, prompt, params, eos_token_id=2, block_size=16)
