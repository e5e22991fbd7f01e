"""The step path around the model waits for the device once per step: the copy of the sampled
token ids. Every other read of a tensor's values on the host (`.item()`, `.tolist()`, `bool()`,
`int()`, `float()`, `.numpy()`, `.cpu()`) would make a GPU worker's host wait for the device
mid-step; on the CPU they are counted through wrappers around those methods, outside the
model's own forward (whose attention backends are the kernels' business).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from core_engine.proto import NewRequestData, SamplingParams, SchedulerOutput
from core_engine.proto.worker_messages import CachedRequestData
from core_engine.worker.sample import rejection_sampler, sampler
from tests.helpers.tiny_causal_lm import TinyCausalLM
from tests.worker.test_model_runner import make_runner

HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu")


class HostReadCounter:
    """Counts host reads of tensor values while `counting`; `paused()` stops counting."""

    def __init__(self) -> None:
        self.reads: list[str] = []
        self.counting = True

    @contextlib.contextmanager
    def paused(self):
        self.counting = False
        try:
            yield
        finally:
            self.counting = True

    def wrap(self, name: str):
        original = getattr(torch.Tensor, name)

        def counted(tensor, *args, **kwargs):
            if self.counting:
                self.reads.append(name)
            return original(tensor, *args, **kwargs)

        return counted


@pytest.fixture
def counter(monkeypatch):
    counter = HostReadCounter()
    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, counter.wrap(name))
    return counter


def forward_not_counted(model: TinyCausalLM, counter: HostReadCounter) -> None:
    forward, compute_logits = model.forward, model.compute_logits

    def quiet_forward(*args, **kwargs):
        with counter.paused():
            return forward(*args, **kwargs)

    def quiet_logits(*args, **kwargs):
        with counter.paused():
            return compute_logits(*args, **kwargs)

    model.forward, model.compute_logits = quiet_forward, quiet_logits


def cpu_argmax_not_counted(monkeypatch, counter: HostReadCounter) -> None:
    """greedy_token_ids reads CPU logits through numpy, a device's through torch.argmax
    (test_greedy_token_ids_of_device_logits_read_nothing): its CPU route is not counted."""
    greedy = sampler.greedy_token_ids

    def quiet_greedy(logits):
        with counter.paused():
            return greedy(logits)

    for module in (sampler, rejection_sampler):
        monkeypatch.setattr(module, "greedy_token_ids", quiet_greedy)


def test_greedy_token_ids_of_device_logits_read_nothing(counter):
    logits = torch.empty(3, 50, device="meta")  # any device but the CPU takes torch's route
    assert sampler.greedy_token_ids(logits).shape == (3,)
    assert counter.reads == []


PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=8),
    SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=3, max_tokens=8),
    SamplingParams(temperature=1.0, min_p=0.1, max_tokens=8),
]


@pytest.mark.parametrize("num_requests", [1, 3])
def test_a_step_reads_the_device_once_the_sampled_ids(counter, monkeypatch, num_requests):
    model = TinyCausalLM()
    forward_not_counted(model, counter)
    cpu_argmax_not_counted(monkeypatch, counter)
    runner = make_runner(model, num_blocks=32)
    new_reqs = [
        # Two blocks of 4 slots each: the 5 prompt tokens and the 3 decoded ones.
        NewRequestData(f"r{i}", [1 + i, 2, 3, 4, 5], PARAMS[i], [[2 * i + 1, 2 * i + 2]], 0)
        for i in range(num_requests)
    ]
    step = SchedulerOutput(
        scheduled_new_reqs=new_reqs,
        num_scheduled_tokens={r.req_id: 5 for r in new_reqs},
        total_num_scheduled_tokens=5 * num_requests,
    )
    counter.reads.clear()
    output = runner.execute_model(step)
    assert counter.reads == ["tolist"], "a prefill step"
    for num_computed in (5, 6, 7):
        tokens = {r: ids for r, ids in zip(output.req_ids, output.sampled_token_ids, strict=True)}
        step = SchedulerOutput(
            scheduled_cached_reqs=[
                CachedRequestData(r.req_id, num_computed, new_token_ids=tokens[r.req_id])
                for r in new_reqs
            ],
            num_scheduled_tokens={r.req_id: 1 for r in new_reqs},
            total_num_scheduled_tokens=num_requests,
        )
        counter.reads.clear()
        output = runner.execute_model(step)
        assert counter.reads == ["tolist"], f"a decode step at {num_computed} tokens"
