"""Data parallelism end to end: two engine cores (null model) behind one frontend.

Repeated prefixes go to the core that holds them (the engine's prefix hit rate stays at the
single-core ideal), unrelated prompts spread over both cores, the cores hash with the
frontend's seed, a core's death fails every request on both cores and stops the other one, and
/metrics reports each core and the total.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Sequence

import httpx
import msgspec
import pytest

from core_engine.frontend.async_engine_client import AsyncEngineClient
from core_engine.frontend.core_client import EngineDeadError
from core_engine.frontend.data_parallel_client import DataParallelCoreClient
from core_engine.proto import SamplingParams, SchedulerStats
from core_engine.proto.engine_config import EngineConfig
from tests.helpers.server_process import ServerProcess, descendant_pids, is_alive, wait_until

BLOCK_SIZE = 16
VOCAB = 256  # the null model's
SHARED_PREFIX = [(7 * i + 3) % VOCAB for i in range(10 * BLOCK_SIZE)]  # 10 blocks


def make_config(data_parallel_size: int = 2) -> EngineConfig:
    return EngineConfig(
        model="null",
        device="cpu",
        data_parallel_size=data_parallel_size,
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=4096,
    )


async def complete(client: AsyncEngineClient, prompt: Sequence[int], max_tokens: int = 4):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    async for output in client.generate(list(prompt), params, stream=False):
        return output


def unrelated_prompt(seed: int, length: int = 5 * BLOCK_SIZE) -> list[int]:
    return [(seed * 31 + 17 * i) % VOCAB for i in range(length)]


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 120))


async def with_client(config: EngineConfig, body):
    client = AsyncEngineClient(config)
    await client.start()
    try:
        return await body(client)
    finally:
        await client.shutdown()


def prompt_tokens(stats: Sequence[SchedulerStats]) -> list[int]:
    return [s.num_prompt_tokens for s in stats]


def test_repeated_prefixes_go_to_one_core_near_the_single_core_hit_rate():
    """Prompts with one 160-token prefix and their own 5-token tails. One after another, all go
    to the core that computed the prefix and hit it there. Sixteen at once spread over both
    cores (the second core's queue is shorter than the prefix is long), each core computing the
    prefix at most once: one prefix short of one core's ideal, and in half the time."""
    prompts = [[*SHARED_PREFIX, *unrelated_prompt(n, 5)] for n in range(24)]

    async def body(client):
        for prompt in prompts[:8]:
            await complete(client, prompt)
        sequential = await client.get_stats_per_core()
        await asyncio.gather(*(complete(client, prompt) for prompt in prompts[8:]))
        return sequential, await client.get_stats_per_core()

    sequential, after_burst = run(with_client(make_config(), body))
    assert sorted(prompt_tokens(sequential))[0] == 0, sequential  # one core did it all
    assert sum(s.prefix_cache_hits for s in sequential) == 7 * len(SHARED_PREFIX)
    single_core_ideal = 23 * len(SHARED_PREFIX)  # every prompt but the first hits the prefix
    hits = sum(s.prefix_cache_hits for s in after_burst)
    assert single_core_ideal - len(SHARED_PREFIX) <= hits <= single_core_ideal, after_burst
    assert min(prompt_tokens(after_burst)) > 0, after_burst


def test_unrelated_prompts_spread_over_both_cores():
    async def body(client):
        await asyncio.gather(*(complete(client, unrelated_prompt(n)) for n in range(8)))
        for n in range(8, 12):  # one at a time: idle cores take turns
            await complete(client, unrelated_prompt(n))
        return await client.get_stats_per_core()

    per_core = run(with_client(make_config(), body))
    prompt_length = len(unrelated_prompt(0))
    assert prompt_tokens(per_core) == [6 * prompt_length, 6 * prompt_length], per_core
    assert all(s.prefix_cache_hits == 0 for s in per_core)


def test_cores_hash_with_the_frontends_seed():
    """The blocks each core reports as stored are exactly the ones the router computed for the
    prompts it sent there: the seed reached the cores."""

    async def body(client):
        core: DataParallelCoreClient = client._core
        reported: list[list[int]] = [[], []]
        apply_events = core.router.apply_events

        def record(rank, events):
            reported[rank].extend(events.stored)
            apply_events(rank, events)

        core.router.apply_events = record
        prompts = [unrelated_prompt(n, 3 * BLOCK_SIZE + 5) for n in range(4)]
        await asyncio.gather(*(complete(client, prompt) for prompt in prompts))
        return reported, [core.router.block_hashes(prompt) for prompt in prompts]

    reported, computed = run(with_client(make_config(), body))
    assert sorted(reported[0] + reported[1]) == sorted(h for hashes in computed for h in hashes)
    assert reported[0] and reported[1]


def test_a_core_killed_fails_every_request_and_stops_the_other_core():
    async def body(client):
        core: DataParallelCoreClient = client._core
        pids = core.core_pids
        params = SamplingParams(max_tokens=4000, ignore_eos=True)  # about 4,000 null steps
        streams = [client.generate(unrelated_prompt(n), params) for n in range(4)]
        started = [asyncio.Event() for _ in streams]

        async def drain(stream, first_output: asyncio.Event):
            async for _ in stream:
                first_output.set()

        tasks = [asyncio.create_task(drain(s, e)) for s, e in zip(streams, started, strict=True)]
        await asyncio.gather(*(event.wait() for event in started))
        assert not any(task.done() for task in tasks)  # both cores are serving
        start = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        failed_after_s = time.monotonic() - start
        assert client.is_dead
        with pytest.raises(EngineDeadError, match="engine core 1 of 2"):
            client.generate(unrelated_prompt(9), SamplingParams(max_tokens=2))
        return pids, results, failed_after_s

    pids, results, failed_after_s = run(with_client(make_config(), body))
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert all("engine core 1 of 2" in str(r) for r in results), results
    for error in results:  # each carries its request's tokens so far, on both cores
        (output,) = error.outputs
        (completion,) = output.outputs
        assert completion.finish_reason == "error" and len(completion.token_ids) >= 1
    assert failed_after_s < 10.0
    assert wait_until(lambda: not any(is_alive(pid) for pid in pids), 15.0)


def test_each_core_gets_its_rank_and_its_own_gpus():
    from core_engine.worker.worker_factory import device_rank

    client = DataParallelCoreClient(make_config(3))
    assert [core.config.data_parallel_rank for core in client.cores] == [0, 1, 2]
    config = msgspec.structs.replace(make_config(3), tensor_parallel_size=2, data_parallel_rank=2)
    assert [device_rank(config, rank) for rank in (0, 1)] == [4, 5]
    with pytest.raises(ValueError, match=r"data_parallel_rank must be in \[0, data_parallel_size"):
        EngineConfig(data_parallel_size=2, data_parallel_rank=2)


def test_attach_mode_cannot_be_data_parallel():
    with pytest.raises(ValueError, match="data_parallel_size=2 launches its own engine cores"):
        AsyncEngineClient(make_config(), "ipc:///tmp/some-core")


def test_metrics_report_each_core_and_the_total(tmp_path):
    server = ServerProcess(
        ["--model", "null", "--data-parallel-size", "2", "--num-gpu-blocks-override", "4096"],
        tmp_path / "core-serve.log",
    )
    try:
        server.wait_ready()
        engine_pids = descendant_pids(server.process.pid)
        for n in range(4):
            body = {"model": "null", "prompt": [unrelated_prompt(n)], "max_tokens": 2}
            response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
            assert response.status_code == 200, response.text
        text = httpx.get(f"{server.base_url}/metrics").text
        per_engine = {
            int(engine): float(value)
            for engine, value in re.findall(
                r'^core:prefix_cache_queries_by_engine_total\{engine="(\d)",[^}]*\} (\S+)$',
                text.replace('model_name="null",engine', "engine"),
                re.MULTILINE,
            )
        }
        total = re.search(r"^core:prefix_cache_queries_total\{[^}]*\} (\S+)$", text, re.M)
        assert set(per_engine) == {0, 1}, text
        assert per_engine[0] == per_engine[1] == 2 * len(unrelated_prompt(0))
        assert float(total.group(1)) == sum(per_engine.values())
    finally:
        assert server.stop() == 0
    assert wait_until(lambda: not any(is_alive(pid) for pid in engine_pids), 15.0)
