"""`check_request_fits`: the one check of whether a request fits the engine, made where each
request is built (frontend, engine core, in-process engine); every refusal a ParameterError
carrying the field at fault."""

from __future__ import annotations

import pytest

from core_engine.proto import SamplingParams
from core_engine.proto.parameter_error import ParameterError
from core_engine.proto.request_fit import check_request_fits

VOCAB, MAX_MODEL_LEN = 100, 16


@pytest.mark.parametrize(
    ("prompt", "params", "param", "message"),
    [
        ([], SamplingParams(), "prompt", "the prompt must not be empty"),
        ([1, 100], SamplingParams(), "prompt", r"token id 100 is outside the vocabulary \[0, 100\)"),
        ([-1, 5], SamplingParams(), "prompt", r"token id -1 is outside the vocabulary"),
        ([1] * 16, SamplingParams(), "prompt", "the prompt is 16 tokens long, but this model's "
         "maximum context length is 16 tokens, which must leave room for at least one"),
        ([1] * 10, SamplingParams(max_tokens=7), "max_tokens", "max_tokens may be at most 6"),
        ([1], SamplingParams(max_tokens=1, stop_token_ids=[100]), "stop_token_ids",
         "below the vocabulary size 100, got 100"),
        ([1], SamplingParams(max_tokens=1, logit_bias={100: 1.0}), "logit_bias", "below the vocabulary size"),
    ],
)  # fmt: skip
def test_what_does_not_fit_is_refused_naming_the_field(prompt, params, param, message):
    with pytest.raises(ParameterError, match=message) as error:
        check_request_fits(prompt, params, VOCAB, MAX_MODEL_LEN)
    assert error.value.param == param


def test_what_fits_passes():
    check_request_fits([0, 99] + [1] * 13, SamplingParams(max_tokens=1), VOCAB, MAX_MODEL_LEN)
    check_request_fits([1] * 15, SamplingParams(max_tokens=None), VOCAB, MAX_MODEL_LEN)


def test_sampling_params_name_the_field_they_refuse():
    """Every check of SamplingParams raises ParameterError with its field: no caller parses
    the message for it."""
    for kwargs, param in (
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"logprobs": 99}, "logprobs"),
        ({"stop": [""]}, "stop"),
    ):
        with pytest.raises(ParameterError) as error:
            SamplingParams(**kwargs)
        assert error.value.param == param, kwargs
