"""The Ray backends on a Ray cluster of several raylets on this machine (`ray.cluster_utils`):
a head that holds no CPU (nothing is placed there) and three nodes of one CPU each.

- Tensor parallelism 3 with one rank per node (STRICT_SPREAD) gives the single-device greedy
  tokens of the default SmolLM2; shutdown removes the placement group and the actors.
- A node removed during `LLM.generate` raises EngineDeadError within seconds, naming the rank
  and what Ray says of its actor, with every prompt's output so far.
- Two data-parallel replicas placed by Ray behind one frontend give the single-device tokens.
- A placement the cluster cannot hold fails start-up within startup_timeout_s, naming what is
  missing, and leaves no pending placement group.

Needs `ray` (the `ray` extra); `pytest -m ray` runs only these.
"""

from __future__ import annotations

import asyncio
import os
import time

import msgspec
import pytest

from core_engine.frontend import LLM
from core_engine.frontend.core_client import AsyncCoreClient, EngineDeadError
from core_engine.frontend.data_parallel_client import DataParallelCoreClient
from core_engine.proto import EngineCoreOutput, EngineCoreRequest, SamplingParams
from core_engine.proto.engine_config import EngineConfig
from core_engine.worker.null_worker import NULL_TOKEN_ID
from tests.helpers.engine_death import assert_cut_off_outputs, kill_once_generating
from tests.helpers.engine_helpers import generate_token_ids

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(300)]

NUM_NODES = 3
OBJECT_STORE_BYTES = 80 * 1024 * 1024  # Ray's floor; nothing large goes through it
OUTPUT_TIMEOUT_S = 120.0
# SmolLM2's tokens for "The capital of France is" and "def fibonacci(n):".
SMOLLM2_PROMPTS = [[504, 3575, 282, 4649, 314], [1604, 3987, 46477, 24, 94, 727]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SMOLLM2 = EngineConfig(
    model=None,
    device="cpu",
    dtype="float32",
    max_num_seqs=4,
    max_num_batched_tokens=64,
    max_model_len=256,
    num_gpu_blocks_override=64,
)


@pytest.fixture(scope="module")
def ray_cluster():
    """The cluster, with RAY_ADDRESS pointing every engine process at it and this process
    connected (to read placement groups and resources)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        # No dashboard: the tests read Ray's state through its API only.
        head_node_args={
            "num_cpus": 0,
            "object_store_memory": OBJECT_STORE_BYTES,
            "include_dashboard": False,
        },
    )
    for _ in range(NUM_NODES):
        add_node(cluster)
    previous_address = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = cluster.address
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        wait_for_free_cpus(NUM_NODES)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        if previous_address is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = previous_address


@pytest.fixture(scope="module")
def single_device_tokens() -> list[list[int]]:
    output = generate_token_ids(SMOLLM2_PROMPTS, SMOLLM2, sampling_params=GREEDY)
    return [result.token_ids for result in output.results]


def add_node(cluster) -> None:
    cluster.add_node(num_cpus=1, object_store_memory=OBJECT_STORE_BYTES)


def wait_for_free_cpus(num_cpus: int, timeout_s: float = 60.0) -> None:
    """Until the cluster has `num_cpus` CPUs free: every actor and placement group released."""
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("CPU", 0.0) != num_cpus:
        assert time.monotonic() < deadline, f"CPUs still held: {ray.available_resources()}"
        time.sleep(0.2)


def live_placement_groups() -> list[dict]:
    groups = ray.util.placement_group_table().values()
    return [group for group in groups if group["state"] != "REMOVED"]


def ray_config(**fields) -> EngineConfig:
    fields.setdefault("startup_timeout_s", 120.0)
    return msgspec.structs.replace(SMOLLM2, distributed_executor_backend="ray", **fields)


async def final_output(queue: asyncio.Queue) -> tuple[list[int], EngineCoreOutput]:
    token_ids: list[int] = []
    while True:
        item = await asyncio.wait_for(queue.get(), OUTPUT_TIMEOUT_S)
        if isinstance(item, Exception):
            raise item
        token_ids.extend(item.new_token_ids)
        if item.finished:
            return token_ids, item


async def generate(client, prompts: list[list[int]]) -> list[list[int]]:
    queues = [
        client.add_request(EngineCoreRequest(f"r{i}", prompt, GREEDY))
        for i, prompt in enumerate(prompts)
    ]
    return [(await final_output(queue))[0] for queue in queues]


def test_three_ranks_on_three_ray_nodes_decode_like_one_device(ray_cluster, single_device_tokens):
    """SmolLM2-135M (9 heads, 3 KV heads) split over 3 ranks, one per node: gloo runs between
    the actors, the steps on the core's TCP links."""
    config = ray_config(tensor_parallel_size=3, ray_placement_strategy="STRICT_SPREAD")

    async def scenario():
        client = AsyncCoreClient(config)
        try:
            await client.start()
            (group,) = live_placement_groups()
            assert group["strategy"] == "STRICT_SPREAD"
            assert len(set(group["bundles_to_node_id"].values())) == NUM_NODES
            return await generate(client, SMOLLM2_PROMPTS)
        finally:
            await client.shutdown()

    assert asyncio.run(scenario()) == single_device_tokens
    wait_for_free_cpus(NUM_NODES)
    assert live_placement_groups() == []


def test_two_data_parallel_replicas_placed_by_ray(ray_cluster, single_device_tokens):
    """Each replica's core runs in a Ray actor on its group's first bundle and connects to this
    frontend over TCP; the router spreads the two prompts over the two cores."""
    config = ray_config(data_parallel_size=2, data_parallel_backend="ray")

    async def scenario():
        client = DataParallelCoreClient(config)
        try:
            await client.start()
            assert client.core_pids == [None, None]  # not this process's children
            assert len(live_placement_groups()) == 2
            token_ids = await generate(client, SMOLLM2_PROMPTS)
            per_core = await client.get_stats_per_core()
            return token_ids, [stats.num_prompt_tokens for stats in per_core]
        finally:
            await client.shutdown()

    token_ids, prompt_tokens_per_core = asyncio.run(scenario())
    assert token_ids == single_device_tokens
    assert sorted(prompt_tokens_per_core) == sorted(len(p) for p in SMOLLM2_PROMPTS)
    wait_for_free_cpus(NUM_NODES)
    assert live_placement_groups() == []


def test_a_placement_the_cluster_cannot_hold_fails_naming_what_is_missing(ray_cluster):
    config = ray_config(
        model="null", tensor_parallel_size=4, ray_placement_strategy="STRICT_SPREAD"
    )
    config = msgspec.structs.replace(config, startup_timeout_s=3.0)

    async def scenario():
        client = AsyncCoreClient(config)
        started = time.monotonic()
        with pytest.raises(EngineDeadError) as error:
            await client.start()
        return str(error.value), time.monotonic() - started

    message, elapsed_s = asyncio.run(scenario())
    assert "Ray could not place 4 workers within 3 s: 4 bundles of 1 CPU (4 CPU in all)" in message
    assert "the cluster has 3 CPU: missing 1 CPU" in message
    assert elapsed_s < 60
    assert live_placement_groups() == []


def test_a_node_lost_during_llm_generate_raises_engine_dead_naming_the_rank(ray_cluster):
    """The node of rank 1 is removed (its raylet and processes killed) while `LLM.generate`
    runs 4 prompts: its link closes, and `generate` raises EngineDeadError within seconds, with
    the rank and Ray's account, carrying every prompt's tokens so far (a batch script never
    takes cut-off outputs for results)."""
    config = ray_config(
        model="null",
        tensor_parallel_size=3,
        ray_placement_strategy="STRICT_SPREAD",
        max_model_len=100_000,
        num_gpu_blocks_override=None,
    )
    prompts = [[10 + i] * 12 for i in range(4)]
    removed_at: list[float] = []

    def remove_rank_1_node() -> None:
        (group,) = live_placement_groups()
        rank1_node_id = group["bundles_to_node_id"][1]
        (node,) = [n for n in ray_cluster.worker_nodes if n.node_id == rank1_node_id]
        ray_cluster.remove_node(node, allow_graceful=False)
        removed_at.append(time.monotonic())

    try:
        with LLM(**msgspec.structs.asdict(config)) as llm:
            killer = kill_once_generating(llm, len(prompts), remove_rank_1_node)
            with pytest.raises(EngineDeadError) as dead:
                llm.generate(prompts, SamplingParams(max_tokens=90_000), use_tqdm=False)
            failed_after_s = time.monotonic() - removed_at[0]
            killer.join()
            assert killer.saw_generating
    finally:
        add_node(ray_cluster)
    assert failed_after_s < 10
    assert "engine core failed: worker rank 1 (at " in dead.value.reason
    assert "its Ray actor on node" in dead.value.reason
    assert_cut_off_outputs(dead.value, prompts, token_id=NULL_TOKEN_ID)
    wait_for_free_cpus(NUM_NODES)
    assert live_placement_groups() == []
