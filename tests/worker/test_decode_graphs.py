"""Decode steps through `DecodeGraphs`, on the CPU, with a capture that replays eagerly.

`EagerReplay` stands in for a CUDA graph: `capture` runs the forward once, on the static
buffers, and `replay` runs it again on whatever those buffers hold then, so everything around
the graph (which steps replay, the size picked, the inputs filled in place, the padding rows) runs
as on a GPU. The KV caches start as NaN: a padding row that wrote KV, or leaked into a real row,
would show up in the tokens or in the caches: the tokens must be the eager run's, and the caches
too, NaN exactly where it left NaN (values up to rounding: a padded batch's matmuls may sum in
another order).
"""

from __future__ import annotations

import pytest
import torch

from core_engine.core.in_process_engine import make_requests, run_requests
from core_engine.core.request import Request
from core_engine.core.sched.scheduler import Scheduler, SchedulerConfig
from core_engine.proto import SamplingParams
from core_engine.proto.engine_config import EngineConfig
from core_engine.worker.decode_graphs import (
    DecodeGraphs,
    default_capture_sizes,
    resolve_capture_sizes,
)
from core_engine.worker.model_runner import ModelRunner
from core_engine.worker.worker import Worker
from tests.helpers.tiny_causal_lm import MAX_MODEL_LEN, VOCAB, TinyCausalLM

CPU = torch.device("cpu")
BLOCK_SIZE = 4
NUM_BLOCKS = 128
MAX_NUM_SEQS = 8


class EagerReplay:
    """A `GraphCapture` whose graphs rerun the captured forward; records what happens."""

    def __init__(self) -> None:
        self.captured_sizes: list[int] = []
        self.replayed_sizes: list[int] = []

    def capture(self, forward):
        output = forward()
        self.captured_sizes.append(output.shape[0])
        return _EagerGraph(forward, output, self.replayed_sizes)


class _EagerGraph:
    def __init__(self, forward, output, replayed_sizes) -> None:
        self.forward, self.output, self.replayed_sizes = forward, output, replayed_sizes

    def replay(self) -> None:
        self.output.copy_(self.forward())
        self.replayed_sizes.append(self.output.shape[0])


@pytest.fixture(scope="module")
def model() -> TinyCausalLM:
    return TinyCausalLM()


def make_runner(model, capture=None, sizes=(1, 2, 4, 8)) -> ModelRunner:
    runner = ModelRunner(
        model,
        device=CPU,
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        max_num_reqs=MAX_NUM_SEQS,
        max_num_batched_tokens=32,
    )
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
    runner.initialize_kv_cache([torch.full(shape, float("nan")) for _ in range(model.num_layers)])
    if capture is not None:
        runner.capture_decode_graphs(sizes, capture)
    return runner


def staggered_requests(prompts: list[list[int]]) -> list[Request]:
    """Greedy requests of different lengths, so the decode batch grows and shrinks."""
    requests = []
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0.0, max_tokens=3 + 2 * i, ignore_eos=True)
        (request,) = make_requests([prompt], params, eos_token_ids=(), block_size=BLOCK_SIZE)
        request.request_id = f"r{i}"
        requests.append(request)
    return requests


def run(runner: ModelRunner, prompts: list[list[int]], budget: int = 32) -> list[list[int]]:
    config = SchedulerConfig(
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=budget,
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE,
        num_gpu_blocks=NUM_BLOCKS,
    )
    output = run_requests(Scheduler(config), runner, staggered_requests(prompts))
    return [result.token_ids for result in output.results]


def random_prompts(lengths, seed=3):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def test_default_sizes_are_vllms_shape_up_to_max_num_seqs():
    assert default_capture_sizes(256) == [1, 2, 4, *range(8, 257, 8)]
    assert default_capture_sizes(12) == [1, 2, 4, 8, 12]
    assert default_capture_sizes(5) == [1, 2, 4, 5]
    assert default_capture_sizes(2) == [1, 2]
    assert default_capture_sizes(1) == [1]


def test_requested_sizes_are_sorted_deduplicated_and_capped_at_max_num_seqs():
    assert resolve_capture_sizes([16, 2, 2, 300], max_num_seqs=256) == [2, 16]
    assert resolve_capture_sizes([], max_num_seqs=256) == []
    assert resolve_capture_sizes(None, max_num_seqs=4) == [1, 2, 4]


def test_graphs_are_captured_largest_first_and_steps_pad_to_the_next_size(model):
    capture = EagerReplay()
    runner = make_runner(model, capture, sizes=(1, 2, 4, 8))
    assert capture.captured_sizes == [8, 4, 2, 1]
    graphs = runner.decode_graphs
    assert [graphs.padded_size(n) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert graphs.can_run(num_reqs=3, num_tokens=3, max_query_len=1)
    assert not graphs.can_run(num_reqs=3, num_tokens=5, max_query_len=3)  # a prefill chunk
    assert not graphs.can_run(num_reqs=9, num_tokens=9, max_query_len=1)  # above the largest


def test_decode_steps_replay_graphs_and_give_the_eager_tokens_and_kv(model):
    prompts = random_prompts([5, 9, 2, 14, 7, 3])
    eager_runner = make_runner(model)
    eager = run(eager_runner, prompts)
    capture = EagerReplay()
    graph_runner = make_runner(model, capture)
    replayed_from = len(capture.replayed_sizes)  # capture may not replay
    with_graphs = run(graph_runner, prompts)

    assert with_graphs == eager
    assert eager == [model.dense_greedy(p, 3 + 2 * i) for i, p in enumerate(prompts)]
    replayed = capture.replayed_sizes[replayed_from:]
    # six requests decode together (padded to 8), then fewer as they finish (8, 4, 2, 1)
    assert set(replayed) == {8, 4, 2, 1}
    for eager_cache, graph_cache in zip(
        eager_runner.kv_caches, graph_runner.kv_caches, strict=True
    ):
        assert torch.equal(graph_cache.isnan(), eager_cache.isnan())
        torch.testing.assert_close(graph_cache, eager_cache, equal_nan=True)


def test_prefill_and_mixed_steps_run_eagerly(model):
    capture = EagerReplay()
    runner = make_runner(model, capture)
    replayed_before = len(capture.replayed_sizes)
    # a budget of 4 chunks the 14-token prompt over steps that also hold the others' decodes
    prompts = random_prompts([14, 2, 3], seed=4)
    tokens = run(runner, prompts, budget=4)
    assert tokens == [model.dense_greedy(p, 3 + 2 * i) for i, p in enumerate(prompts)]
    num_replays = len(capture.replayed_sizes) - replayed_before
    # 3 + 5 + 7 tokens, the first of each from its prefill step: at most 12 decode steps
    assert 0 < num_replays <= 12


def test_a_graph_larger_than_the_batch_rows_is_refused(model):
    runner = make_runner(model)
    with pytest.raises(ValueError, match="larger than max_num_reqs=8"):
        runner.capture_decode_graphs([16], EagerReplay())


def test_sizes_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        DecodeGraphs([0], device=CPU, block_tables=[], max_model_len=8)
    with pytest.raises(ValueError, match="cuda_graph_sizes must be positive batch sizes, got -2"):
        EngineConfig(cuda_graph_sizes=[4, -2])


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({}, [1, 2, 4, 8, 16, 24, 30]),
        ({"cuda_graph_sizes": [4, 64]}, [4]),
        ({"enforce_eager": True}, []),
        ({"enable_lora": True}, []),
        ({"max_num_batched_tokens": 20}, [1, 2, 4, 8, 16, 20]),  # no decode step is larger
    ],
)
def test_the_worker_captures_on_cuda_unless_eager_lora_or_no_kernels(
    monkeypatch, changes, expected
):
    from core_engine.worker import worker as worker_module

    config = EngineConfig(model="null", device="cpu", max_num_seqs=30, **changes)
    worker = Worker(config)
    assert worker.cuda_graph_sizes == []  # a CPU has no graphs
    worker.device = torch.device("cuda")
    monkeypatch.setattr(worker_module, "can_capture_cuda_graphs", lambda device: True)
    assert worker.cuda_graph_sizes == expected
    monkeypatch.setattr(worker_module, "can_capture_cuda_graphs", lambda device: False)
    assert worker.cuda_graph_sizes == []
