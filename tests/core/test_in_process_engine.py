"""The in-process engine: the core's start-up handshake, eos rule and step loop, no IPC."""

from __future__ import annotations

import msgspec
import pytest

from core_engine.core.engine_core import start_engine_core
from core_engine.core.in_process_engine import InProcessEngine
from core_engine.proto import SamplingParams, WorkerReady
from core_engine.proto.engine_config import EngineConfig
from core_engine.proto.parameter_error import ParameterError
from core_engine.proto.sampling_params import StructuredOutputs, stop_on_eos
from core_engine.worker.local_executor import LocalExecutor
from core_engine.worker.null_worker import NULL_TOKEN_ID, NULL_VOCAB_SIZE

NULL_CONFIG = EngineConfig(model="null", max_model_len=256, num_gpu_blocks_override=64)


class RecordingExecutor:
    """Answers the handshake with fixed `WorkerReady`s and records what it was told."""

    def __init__(self, readies: list[WorkerReady]) -> None:
        self.readies = readies
        self.num_gpu_blocks: int | None = None

    def wait_until_ready(self) -> list[WorkerReady]:
        return self.readies

    def initialize_cache(self, num_gpu_blocks: int) -> None:
        self.num_gpu_blocks = num_gpu_blocks

    def execute_model(self, scheduler_output):
        raise AssertionError("no step expected")


def worker_ready(rank: int, **fields) -> WorkerReady:
    defaults = dict(
        rank=rank,
        num_gpu_blocks=100,
        max_model_len=2048,
        max_num_batched_tokens=1024,
        device="cpu",
        vocab_size=1000,
        block_size=16,
        max_num_seqs=256,
        eos_token_ids=[2, 5],
    )
    return WorkerReady(**{**defaults, **fields})


def test_handshake_takes_the_tightest_limits_of_config_and_workers():
    executor = RecordingExecutor(
        [
            worker_ready(0, num_gpu_blocks=90, max_model_len=1024),
            worker_ready(1, num_gpu_blocks=70, max_num_batched_tokens=512, max_num_seqs=8),
        ]
    )
    config = EngineConfig(model="null", max_model_len=4096, max_num_seqs=32)
    engine_core, ready = start_engine_core(config, executor)
    scheduler_config = engine_core.scheduler.config
    assert executor.num_gpu_blocks == 70 == ready.num_gpu_blocks
    assert (scheduler_config.max_model_len, ready.max_model_len) == (1024, 1024)
    assert scheduler_config.max_num_batched_tokens == ready.max_num_batched_tokens == 512
    assert scheduler_config.max_num_seqs == 8
    assert (ready.vocab_size, ready.eos_token_ids) == (1000, [2, 5])


def test_handshake_prefers_a_smaller_configured_limit_and_the_block_override():
    executor = RecordingExecutor([worker_ready(0)])
    config = EngineConfig(
        model="null", max_model_len=300, max_num_batched_tokens=64, num_gpu_blocks_override=20
    )
    engine_core, ready = start_engine_core(config, executor)
    assert (ready.max_model_len, ready.max_num_batched_tokens, ready.num_gpu_blocks) == (
        300,
        64,
        20,
    )
    assert executor.num_gpu_blocks == 20 == engine_core.scheduler.config.num_gpu_blocks


def test_handshake_refuses_a_worker_with_another_block_size():
    executor = RecordingExecutor([worker_ready(0), worker_ready(1, block_size=32)])
    with pytest.raises(ValueError, match="worker rank 1 has block_size=32, the engine 16"):
        start_engine_core(EngineConfig(model="null"), executor)
    assert executor.num_gpu_blocks is None


def test_generate_runs_each_workload_to_the_end_with_its_own_counters():
    engine = InProcessEngine(NULL_CONFIG, LocalExecutor(NULL_CONFIG))
    assert engine.ready.vocab_size == NULL_VOCAB_SIZE
    params = SamplingParams(max_tokens=5)
    prompts = [[1, 2, 3], list(range(40))]
    for _ in range(2):
        output = engine.generate(prompts, params)
        assert [r.token_ids for r in output.results] == [[NULL_TOKEN_ID] * 5] * 2
        assert [r.finish_reason for r in output.results] == ["length", "length"]
        assert output.stats.num_generation_tokens == 10
        assert output.stats.num_prompt_tokens == 43
        assert output.elapsed_s > 0
    assert engine.engine_core.scheduler.get_stats().num_generation_tokens == 20


def test_the_models_eos_ids_from_the_handshake_stop_requests():
    executor = LocalExecutor(NULL_CONFIG)
    executor.worker.eos_token_ids = [7, NULL_TOKEN_ID]  # the second id is what it samples
    engine = InProcessEngine(NULL_CONFIG, executor)
    assert engine.ready.eos_token_ids == [7, NULL_TOKEN_ID]
    (stopped,) = engine.generate([[1, 2]], SamplingParams(max_tokens=5)).results
    assert (stopped.token_ids, stopped.finish_reason) == ([NULL_TOKEN_ID], "stop")
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    (ignored,) = engine.generate([[1, 2]], params).results
    assert (len(ignored.token_ids), ignored.finish_reason) == (5, "length")


def test_prompt_ids_outside_the_models_vocabulary_are_refused():
    engine = InProcessEngine(NULL_CONFIG, LocalExecutor(NULL_CONFIG))
    outside = rf"outside the vocabulary \[0, {NULL_VOCAB_SIZE}\)"
    with pytest.raises(ParameterError, match=f"token id {NULL_VOCAB_SIZE} is {outside}"):
        engine.generate([[1, NULL_VOCAB_SIZE]], SamplingParams(max_tokens=1))
    with pytest.raises(ParameterError, match=f"token id -1 is {outside}"):
        engine.generate([[-1]], SamplingParams(max_tokens=1))
    assert not engine.engine_core.has_work


def test_local_executor_runs_one_worker_only():
    config = msgspec.structs.replace(NULL_CONFIG, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size=2: an in-process engine runs one"):
        LocalExecutor(config)


def test_eos_rule_first_id_is_eos_the_others_stop_unless_ignored():
    params = SamplingParams(stop_token_ids=[9, 5])
    eos, with_stops = stop_on_eos(params, [2, 5, 6])
    assert (eos, with_stops.stop_token_ids) == (2, [9, 5, 6])
    assert params.stop_token_ids == [9, 5]  # the caller's params are not changed
    eos, ignoring = stop_on_eos(SamplingParams(ignore_eos=True), [2, 5])
    assert (eos, ignoring.stop_token_ids) == (2, [])
    assert stop_on_eos(params, []) == (None, params)


def test_the_null_model_refuses_structured_outputs_instead_of_ignoring_them():
    engine = InProcessEngine(NULL_CONFIG, LocalExecutor(NULL_CONFIG))
    constraint = StructuredOutputs(choice=["yes", "no"])
    constrained = SamplingParams(max_tokens=3, structured_outputs=constraint)
    (result,) = engine.generate([[1, 2]], constrained).results
    assert (result.finish_reason, result.token_ids) == ("error", [])
    (free,) = engine.generate([[1, 2]], SamplingParams(max_tokens=3)).results
    assert free.finish_reason == "length"
