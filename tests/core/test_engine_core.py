"""In-process tests of the engine core's pieces: EngineConfig, endpoints, NullWorker, EngineCore.

No processes here (see test_engine_processes.py): the NullWorker stands in for the executor,
which it can because it has the same `execute_model`.
"""

from __future__ import annotations

import argparse

import pytest
import zmq

from core_engine.core.engine_core import EngineCore, make_request
from core_engine.core.request import Request
from core_engine.core.sched.scheduler import Scheduler
from core_engine.core.sched.scheduler_config import SchedulerConfig
from core_engine.proto import (
    CachedRequestData,
    EngineCoreRequest,
    EngineReady,
    FinishReason,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)
from core_engine.proto.endpoints import (
    PRIVATE_IPC_DIR_PREFIX,
    frontend_endpoints,
    remove_dead_frontend_sockets,
)
from core_engine.proto.engine_config import EngineConfig
from core_engine.proto.parameter_error import ParameterError
from core_engine.worker.null_worker import NULL_TOKEN_ID, NULL_VOCAB_SIZE, NullWorker

VOCAB_SIZE = NULL_VOCAB_SIZE

BLOCK_SIZE = 4


def make_engine_core(num_gpu_blocks: int = 64, max_model_len: int = 64, **kwargs) -> EngineCore:
    config = SchedulerConfig(
        max_model_len=max_model_len, block_size=BLOCK_SIZE, num_gpu_blocks=num_gpu_blocks, **kwargs
    )
    worker = NullWorker(
        EngineConfig(model="null", block_size=BLOCK_SIZE, max_model_len=max_model_len)
    )
    return EngineCore(Scheduler(config), worker)


# What make_request checks a wire request against: the engines these tests build.
READY = EngineReady(
    64, BLOCK_SIZE, max_model_len=64, max_num_batched_tokens=64, vocab_size=VOCAB_SIZE
)


def make_core_request(request_id: str, num_prompt_tokens: int, **params) -> Request:
    wire = EngineCoreRequest(request_id, list(range(num_prompt_tokens)), SamplingParams(**params))
    return make_request(wire, READY)


def run_to_completion(engine_core: EngineCore, max_steps: int = 1000) -> dict[str, list]:
    """request id -> every EngineCoreOutput it got, stepping until the core is idle."""
    request_id_to_outputs: dict[str, list] = {}
    for _ in range(max_steps):
        outputs = engine_core.step()
        if outputs is None:
            return request_id_to_outputs
        for output in outputs.outputs:
            request_id_to_outputs.setdefault(output.request_id, []).append(output)
    raise AssertionError(f"the engine core was still busy after {max_steps} steps")


# ---- EngineConfig ----------------------------------------------------------------------------


def test_engine_config_defaults_are_valid_and_round_trip_through_b64():
    config = EngineConfig(model="null", max_num_seqs=8, num_gpu_blocks_override=100)
    assert EngineConfig.from_b64(config.to_b64()) == config
    assert EngineConfig().block_size == 16 and EngineConfig().policy == "fcfs"
    assert config.is_null_model and not EngineConfig().is_null_model


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("device", "tpu", "device must be one of"),
        ("dtype", "int8", "dtype must be auto (None) or one of"),
        ("block_size", 12, "block_size must be a power of two, got 12"),
        ("max_num_seqs", 0, "max_num_seqs must be at least 1, got 0"),
        ("max_num_batched_tokens", 0, "max_num_batched_tokens must be at least 1"),
        ("max_model_len", 0, "max_model_len must be at least 1"),
        ("gpu_memory_utilization", 1.5, "gpu_memory_utilization must be in (0, 1], got 1.5"),
        ("num_gpu_blocks_override", 1, "num_gpu_blocks_override must be at least 2"),
        ("tensor_parallel_size", 0, "tensor_parallel_size must be at least 1"),
        ("long_prefill_token_threshold", -1, "long_prefill_token_threshold must be >= 0"),
        ("policy", "lifo", "policy must be one of"),
        ("startup_timeout_s", 0.0, "startup_timeout_s must be positive"),
        ("max_frame_bytes", 10, "max_frame_bytes must be at least 4096, got 10"),
    ],
)
def test_engine_config_rejects_bad_values_naming_value_and_limit(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(**{field: value})


def test_engine_config_from_b64_rejects_garbage():
    with pytest.raises(ValueError, match="invalid encoded EngineConfig"):
        EngineConfig.from_b64("not base64!")


def test_engine_config_cli_flags_override_the_base_config():
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_arguments(parser)
    args = parser.parse_args(
        ["--max-num-seqs", "8", "--no-enable-prefix-caching", "--dtype", "none", "--seed", "7"]
    )
    base = EngineConfig(model="null", dtype="float32", max_num_seqs=4)
    config = EngineConfig.from_cli_args(args, base)
    assert config == EngineConfig(
        model="null", dtype=None, max_num_seqs=8, enable_prefix_caching=False, seed=7
    )
    with pytest.raises(ValueError, match="block_size must be a power of two, got 3"):
        EngineConfig.from_cli_args(parser.parse_args(["--block-size", "3"]))


# ---- frontend endpoints ----------------------------------------------------------------------


def test_frontend_endpoints_derive_two_sockets_from_one_address():
    assert frontend_endpoints("tcp://127.0.0.1:5555") == (
        "tcp://127.0.0.1:5555",
        "tcp://127.0.0.1:5556",
    )
    assert frontend_endpoints("ipc:///tmp/x/engine") == (
        "ipc:///tmp/x/engine-requests",
        "ipc:///tmp/x/engine-outputs",
    )
    for bad in ("http://localhost:1", "tcp://localhost", "tcp://:80", "tcp://h:65535"):
        with pytest.raises(ValueError, match="address"):
            frontend_endpoints(bad)


def test_an_ipc_path_too_long_for_a_unix_socket_is_refused_naming_the_limit(tmp_path):
    folder = "/tmp/" + "d" * 85  # 90 bytes + "/e-requests" = 101: fits
    assert frontend_endpoints(f"ipc://{folder}/e").requests == f"ipc://{folder}/e-requests"
    too_long = f"ipc://{folder}/engine-x"  # 90 + 18 = 108 bytes
    with pytest.raises(ValueError, match=r"is 108 bytes, and a unix socket path holds at most 107"):
        frontend_endpoints(too_long)
    # What the limit protects: zmq cannot bind the longer path.
    context = zmq.Context()
    try:
        with pytest.raises(zmq.ZMQError), context.socket(zmq.PULL) as sock:
            path = tmp_path / ("s" * (108 - len(str(tmp_path)) - 1))
            assert len(str(path)) == 108
            sock.bind(f"ipc://{path}")
    finally:
        context.term()


def _touch_frontend_sockets(folder) -> str:
    folder.mkdir()
    for name in ("engine-requests", "engine-outputs"):
        (folder / name).touch()
    return f"ipc://{folder}/engine"


def test_a_dead_frontends_sockets_and_private_folder_are_removed(tmp_path):
    private = tmp_path / f"{PRIVATE_IPC_DIR_PREFIX}abc"
    remove_dead_frontend_sockets(_touch_frontend_sockets(private))
    assert not private.exists()
    remove_dead_frontend_sockets(f"ipc://{private}/engine")  # already gone: no error
    remove_dead_frontend_sockets("tcp://127.0.0.1:5555")  # nothing on disk


def test_a_folder_the_frontend_did_not_make_or_that_holds_more_is_kept(tmp_path):
    chosen = tmp_path / "run"
    remove_dead_frontend_sockets(_touch_frontend_sockets(chosen))
    assert chosen.is_dir() and list(chosen.iterdir()) == []
    private = tmp_path / f"{PRIVATE_IPC_DIR_PREFIX}xyz"
    address = _touch_frontend_sockets(private)
    (private / "other").touch()
    remove_dead_frontend_sockets(address)
    assert [path.name for path in private.iterdir()] == ["other"]


# ---- NullWorker ------------------------------------------------------------------------------


def test_null_worker_samples_only_when_the_prompt_is_done_and_drops_finished_requests():
    worker = NullWorker(EngineConfig(model="null", block_size=BLOCK_SIZE))
    new_req = NewRequestData("a", [1, 2, 3, 4, 5, 6], SamplingParams(logprobs=2), [[1, 2]], 0)
    first = worker.execute_model(
        SchedulerOutput([new_req], [], {"a": 4}, total_num_scheduled_tokens=4)
    )
    assert first.req_ids == ["a"] and first.sampled_token_ids == [[]]
    assert first.logprobs is None
    second = worker.execute_model(
        SchedulerOutput([], [CachedRequestData("a", 4)], {"a": 2}, total_num_scheduled_tokens=2)
    )
    assert second.sampled_token_ids == [[NULL_TOKEN_ID]]
    assert second.logprobs[0][0].top_token_ids == [NULL_TOKEN_ID, NULL_TOKEN_ID + 1]
    assert second.logprobs[0][0].top_logprobs[0] == 0.0
    decode = CachedRequestData("a", 6, new_token_ids=[NULL_TOKEN_ID])
    third = worker.execute_model(SchedulerOutput([], [decode], {"a": 1}, 1))
    assert third.sampled_token_ids == [[NULL_TOKEN_ID]]
    worker.execute_model(SchedulerOutput(finished_req_ids=["a"]))
    assert worker.req_id_to_state == {}


@pytest.mark.parametrize(
    ("drafts", "expected_num_tokens"),
    [
        ([NULL_TOKEN_ID] * 3, 4),  # all accepted, plus the bonus token
        ([NULL_TOKEN_ID, 7, NULL_TOKEN_ID], 2),  # the run ends at the first other token
        ([7, NULL_TOKEN_ID], 1),
    ],
)
def test_null_worker_verifies_drafts_as_a_greedy_model_that_always_says_null(
    drafts, expected_num_tokens
):
    worker = NullWorker(EngineConfig(model="null", block_size=BLOCK_SIZE))
    new_req = NewRequestData("a", [1, 2, 3], SamplingParams(logprobs=1), [[1, 2]], 0)
    worker.execute_model(SchedulerOutput([new_req], [], {"a": 3}, total_num_scheduled_tokens=3))
    num_scheduled = 1 + len(drafts)
    verify = SchedulerOutput(
        [],
        [CachedRequestData("a", 3, new_token_ids=[NULL_TOKEN_ID])],
        {"a": num_scheduled},
        total_num_scheduled_tokens=num_scheduled,
        scheduled_spec_decode_tokens={"a": drafts},
    )
    output = worker.execute_model(verify)
    assert output.sampled_token_ids == [[NULL_TOKEN_ID] * expected_num_tokens]
    assert [entry.top_token_ids for entry in output.logprobs[0]] == [
        [NULL_TOKEN_ID]
    ] * expected_num_tokens


def test_null_worker_reports_enough_blocks_for_every_sequence_at_full_length():
    worker = NullWorker(
        EngineConfig(model="null", block_size=16, max_model_len=100, max_num_seqs=3)
    )
    assert worker.determine_num_available_blocks() == 3 * 7 + 1


def test_a_null_model_context_beyond_its_block_cap_is_a_clear_start_up_error():
    # It used to size a pool of 6e9 blocks and spend minutes building it.
    from tests.helpers.engine_helpers import in_process_engine

    config = EngineConfig(model="null", max_model_len=10**11)
    with pytest.raises(ValueError, match=r"cannot hold one request of max_model_len=100000000000"):
        in_process_engine(config)


# ---- EngineCore ------------------------------------------------------------------------------


def test_engine_core_runs_requests_to_their_length_limit():
    engine_core = make_engine_core()
    assert engine_core.add_request(make_core_request("a", 10, max_tokens=3)) is None
    assert engine_core.add_request(make_core_request("b", 5, max_tokens=1)) is None
    request_id_to_outputs = run_to_completion(engine_core)
    tokens_a = [t for output in request_id_to_outputs["a"] for t in output.new_token_ids]
    assert tokens_a == [NULL_TOKEN_ID] * 3
    assert request_id_to_outputs["a"][-1].finish_reason == FinishReason.LENGTH
    assert [o.finish_reason for o in request_id_to_outputs["b"]] == [FinishReason.LENGTH]
    assert engine_core.get_stats().kv_cache_usage == 0.0
    assert engine_core.unfinished_request_ids() == []


def test_make_request_refuses_what_does_not_fit_the_context_window_naming_the_field():
    """Checked once, where the core builds the request: a prompt that leaves no room for a
    generated token, or max_tokens past the window (the scheduler does not check again)."""
    with pytest.raises(ParameterError, match="the prompt is 64 tokens long") as error:
        make_core_request("long", 64)
    assert error.value.param == "prompt"
    with pytest.raises(ParameterError, match="max_tokens may be at most 54") as error:
        make_core_request("long", 10, max_tokens=55)
    assert error.value.param == "max_tokens"
    with pytest.raises(ParameterError, match="must not be empty") as error:
        make_core_request("empty", 0)
    assert error.value.param == "prompt"
    assert make_core_request("fits", 10, max_tokens=54).num_prompt_tokens == 10


def test_engine_core_rejects_a_duplicate_request_id():
    engine_core = make_engine_core()
    assert engine_core.add_request(make_core_request("a", 4)) is None
    error_output = engine_core.add_request(make_core_request("a", 4))
    assert (
        error_output.finish_reason == FinishReason.ERROR and "already in use" in error_output.error
    )


def test_engine_core_abort_frees_blocks_and_tells_the_worker():
    engine_core = make_engine_core()
    engine_core.add_request(make_core_request("a", 10, max_tokens=50))
    engine_core.step()
    assert engine_core.get_stats().kv_cache_usage > 0
    engine_core.abort_requests(["a", "unknown"])
    assert engine_core.get_stats().kv_cache_usage == 0.0
    # No step just to drop "a": the worker learns it with the next real step.
    assert not engine_core.has_work and engine_core.step() is None
    assert "a" in engine_core.executor.req_id_to_state
    engine_core.add_request(make_core_request("b", 4, max_tokens=1))
    engine_core.step()
    assert "a" not in engine_core.executor.req_id_to_state


def test_make_request_hashes_full_prompt_blocks_and_rejects_out_of_vocab_token_ids():
    request = make_core_request("a", 9)
    assert len(request.block_hashes) == 9 // BLOCK_SIZE
    wire = EngineCoreRequest("b", [5, -1], SamplingParams())
    with pytest.raises(ParameterError, match=r"prompt token id -1 is outside the vocabulary"):
        make_request(wire, READY)
    wire = EngineCoreRequest("c", [5, VOCAB_SIZE], SamplingParams())
    with pytest.raises(
        ParameterError,
        match=rf"token id {VOCAB_SIZE} is outside the vocabulary \[0, {VOCAB_SIZE}\)",
    ):
        make_request(wire, READY)


def test_make_request_rejects_stop_token_ids_the_model_cannot_produce():
    """With min_tokens the worker bans the stop ids by indexing its logits; an id past the
    vocabulary must be refused here, not crash the worker."""
    params = SamplingParams(min_tokens=1, stop_token_ids=[VOCAB_SIZE])
    wire = EngineCoreRequest("d", [5], params)
    with pytest.raises(
        ParameterError, match=f"below the vocabulary size {VOCAB_SIZE}, got {VOCAB_SIZE}"
    ) as error:
        make_request(wire, READY)
    assert error.value.param == "stop_token_ids"
