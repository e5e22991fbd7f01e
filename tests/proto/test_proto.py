"""Wire messages: round trips, typed decoding, validation and size limits."""

from __future__ import annotations

import msgspec
import pytest

from core_engine.proto import (
    AbortRequests,
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    MessageDecodeError,
    MessageDecoder,
    MessageEncoder,
    ModelRunnerOutput,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
    SchedulerStats,
    TokenLogprobs,
    UtilityMethod,
    UtilityRequest,
    UtilityResponse,
)
from core_engine.proto.codec import MESSAGE_TYPES, TYPE_TO_CODE


def sample_messages():
    params = SamplingParams(temperature=0.7, top_k=5, stop=["\n"], logprobs=2, seed=3)
    return [
        EngineCoreRequest("r1", [1, 2, 3], params, eos_token_id=2, arrival_time=1.5),
        AbortRequests(["r1", "r2"]),
        EngineCoreOutputs(
            outputs=[
                EngineCoreOutput(
                    "r1",
                    [7],
                    FinishReason.STOP,
                    new_logprobs=[TokenLogprobs(-0.1, 1, [7, 8], [-0.1, -2.5])],
                    stop_reason=7,
                )
            ],
        ),
        UtilityResponse(7, stats=SchedulerStats(num_running_reqs=1, kv_cache_usage=0.5)),
        SchedulerOutput(
            scheduled_new_reqs=[NewRequestData("a", [1, 2], params, [[1, 2], [0, 3]], 0)],
            scheduled_cached_reqs=[CachedRequestData("b", 5, [[3], []], [9], True)],
            num_scheduled_tokens={"a": 2, "b": 1},
            total_num_scheduled_tokens=3,
            finished_req_ids=["c"],
        ),
        ModelRunnerOutput(req_ids=["a", "b"], sampled_token_ids=[[4], []]),
    ]


@pytest.mark.parametrize("message", sample_messages(), ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message):
    frames = MessageEncoder().encode(message)
    assert frames[0] == bytes([MESSAGE_TYPES.index(type(message))])
    assert MessageDecoder([type(message)]).decode(frames) == message


def test_decoder_rejects_types_not_accepted_on_its_socket():
    frames = MessageEncoder().encode(AbortRequests(["x"]))
    with pytest.raises(MessageDecodeError, match="not accepted on this socket"):
        MessageDecoder([EngineCoreRequest]).decode(frames)


@pytest.mark.parametrize(
    "frames",
    [[b"\x00", b"\xff\xfe garbage"], [b"\x00"], [b"\x00", msgspec.msgpack.encode([1, 2, 3])]],
)
def test_decoder_rejects_garbage_and_wrong_shapes(frames):
    with pytest.raises(MessageDecodeError):
        MessageDecoder([EngineCoreRequest]).decode(frames)


def test_decoder_enforces_the_frame_size_limit():
    frames = MessageEncoder().encode(AbortRequests(["x" * 200]))
    with pytest.raises(MessageDecodeError, match="exceeds the limit of 100"):
        MessageDecoder([AbortRequests], max_frame_bytes=100).decode(frames)


def test_invalid_sampling_params_off_the_wire_are_rejected_with_the_reason():
    payload = msgspec.msgpack.encode(["r", [1], {"top_p": 1.5}])
    with pytest.raises(MessageDecodeError, match=r"top_p must be in \(0, 1\], got 1.5"):
        MessageDecoder([EngineCoreRequest]).decode([b"\x00", payload])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be at least 1, got 0"),
        ({"temperature": -1.0}, "temperature must be >= 0"),
        ({"top_k": -5}, "top_k must be >= 0"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0"),
        ({"min_tokens": 5, "max_tokens": 2}, r"min_tokens \(5\) must not exceed max_tokens \(2\)"),
        ({"logprobs": 21}, r"logprobs must be in \[0, 20\], got 21"),
        ({"stop": [""]}, "stop strings must not be empty"),
    ],
)
def test_sampling_params_validation_names_value_and_limit(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": float("nan")}, "temperature must be >= 0 and finite, got nan"),
        ({"temperature": float("inf")}, "temperature must be >= 0 and finite, got inf"),
        ({"top_k": 2**63}, f"top_k must be at most {2**31 - 1}"),
        ({"seed": 2**64}, r"seed must be in \[-9223372036854775808, 9223372036854775807\]"),
        ({"seed": 2**63 - 2, "n": 3}, r"seed must be in \[.*, 9223372036854775805\]"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2.0, 2.0\], got 2.5"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty must be in"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be in \(0, 10.0\], got 0.0"),
        ({"logit_bias": {5: 101.0}}, "logit_bias maps token ids >= 0 to biases in"),
        ({"logit_bias": {-1: 1.0}}, "got -1: 1.0"),
    ],
)
def test_sampling_params_stay_inside_what_the_worker_and_the_wire_can_carry(kwargs, message):
    """Values the worker's int64 tensors or msgpack cannot hold would fail deep in a worker (and
    take the engine down); they are refused where the params are made."""
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
    SamplingParams(seed=-(2**63), n=1)
    SamplingParams(seed=2**63 - 3, n=3)


def test_stop_token_ids_are_checked_against_the_vocabulary():
    SamplingParams(stop_token_ids=[0, 99]).check_vocabulary(100)
    SamplingParams().check_vocabulary(1)
    with pytest.raises(
        ValueError, match="stop_token_ids must name token ids below the vocabulary size 100"
    ):
        SamplingParams(stop_token_ids=[5, 100]).check_vocabulary(100)
    with pytest.raises(ValueError, match="logit_bias must name token ids below the vocabulary"):
        SamplingParams(logit_bias={100: 1.0}).check_vocabulary(100)


def test_sampling_params_normalisation():
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(temperature=0.0).is_greedy


def test_finish_reason_prints_openai_names():
    assert [str(r) for r in FinishReason] == ["stop", "length", "abort", "error"]


def test_encoder_refuses_non_messages():
    with pytest.raises(TypeError, match="is not a wire message"):
        MessageEncoder().encode(SamplingParams())


def test_a_utility_call_is_one_of_the_core_s_methods_or_fails_to_decode():
    call = UtilityRequest(3, UtilityMethod.RESET_PREFIX_CACHE)
    frames = MessageEncoder().encode(call)
    decoded = MessageDecoder([UtilityRequest]).decode(frames)
    assert decoded.method is UtilityMethod.RESET_PREFIX_CACHE
    unknown = [TYPE_TO_CODE[UtilityRequest], msgspec.msgpack.encode([4, "drop_everything"])]
    with pytest.raises(MessageDecodeError, match="drop_everything|UtilityMethod|Invalid enum"):
        MessageDecoder([UtilityRequest]).decode(unknown)
