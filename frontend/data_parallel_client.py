"""`DataParallelCoreClient`: `data_parallel_size` engine cores behind one frontend.

It launches one `AsyncCoreClient` (core process, own workers) per data-parallel rank (this
process's children, or with `data_parallel_backend="ray"` placed by Ray through
`frontend.ray_core_launcher`), all with
one block hash seed (`PREFIX_HASH_SEED_ENV`), so the frontend computes the hashes the cores
cache and a `PrefixAwareRouter` sends each request to the core that holds its prefix, else to
the least loaded. It offers the single-core client's interface, so `AsyncEngineClient` works the
same over one core or several.

Contract: every request lives on one core, from `add_request` to its finish; aborts go to that
core. The engine is one unit: when any core dies, every core's requests fail with that reason and
the other cores are stopped (a supervisor restarts the whole engine, as for one core).
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass

import msgspec

from core_engine.common.block_hash import PREFIX_HASH_SEED_ENV, SEED_BYTES
from core_engine.frontend.core_client import AsyncCoreClient, EngineDeadError
from core_engine.frontend.prefix_router import PrefixAwareRouter
from core_engine.proto import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    KVBlockMap,
    SchedulerStats,
)
from core_engine.proto.engine_config import EngineConfig

logger = logging.getLogger(__name__)

# Hashes mirrored per core, in multiples of its KV blocks: room for the optimistic entries of
# prompts still in prefill on top of what the core can hold.
MIRROR_BLOCKS_FACTOR = 2


@dataclass(slots=True)
class _Placement:
    """Where a request runs and how much load it is counted for there."""

    core: int
    load_tokens: int


class DataParallelCoreClient:
    """A `CoreClient` over `config.data_parallel_size` launched cores."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.seed = os.urandom(SEED_BYTES)
        self.ray_launcher = None  # data_parallel_backend="ray": made, and the cores, in start()
        self.cores: list[AsyncCoreClient] = []
        if config.data_parallel_backend == "ray":
            from core_engine.frontend.ray_core_launcher import RayCoreLauncher

            self.ray_launcher = RayCoreLauncher(config)
        else:
            env = {**os.environ, PREFIX_HASH_SEED_ENV: self.seed.hex()}
            self.cores = [self._make_core(rank, env) for rank in range(config.data_parallel_size)]
        self.ready: EngineReady | None = None
        self.router: PrefixAwareRouter | None = None
        self.dead_reason: str | None = None
        self._died = asyncio.Event()
        self._request_id_to_placement: dict[str, _Placement] = {}
        self._watchers: list[asyncio.Task] = []

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    @property
    def core_pids(self) -> list[int | None]:
        return [core.core_pid for core in self.cores]

    def _make_core(self, rank: int, env: dict[str, str], launcher=None) -> AsyncCoreClient:
        size = self.config.data_parallel_size
        return AsyncCoreClient(
            msgspec.structs.replace(self.config, data_parallel_rank=rank),
            launcher.frontend_address() if launcher is not None else None,
            env=env,
            on_outputs=self._outputs_listener(rank),
            label=f"engine core {rank} of {size}",
            launcher=launcher.for_replica(rank) if launcher is not None else None,
        )

    # ---- start-up --------------------------------------------------------------------------

    async def start(self) -> None:
        """Starts every core at once; if one fails, stops them all and raises its error. With
        Ray, first reserves every replica's placement group (PlacementError if it cannot)."""
        if self.ray_launcher is not None:
            try:
                await asyncio.to_thread(self.ray_launcher.reserve)
            except BaseException:
                await asyncio.to_thread(self.ray_launcher.release)
                raise
            env = {PREFIX_HASH_SEED_ENV: self.seed.hex()}  # on top of the node's environment
            self.cores = [
                self._make_core(rank, env, self.ray_launcher)
                for rank in range(self.config.data_parallel_size)
            ]
        results = await asyncio.gather(
            *(core.start() for core in self.cores), return_exceptions=True
        )
        errors = [result for result in results if isinstance(result, BaseException)]
        if errors:
            await self.shutdown()
            raise errors[0]
        readies = [core.ready for core in self.cores]
        self.ready = readies[0]
        capacity = MIRROR_BLOCKS_FACTOR * min(ready.num_gpu_blocks for ready in readies)
        self.router = PrefixAwareRouter(len(self.cores), self.ready.block_size, self.seed, capacity)
        self._watchers = [
            asyncio.create_task(self._watch(rank), name=f"core-{rank}-watch")
            for rank in range(len(self.cores))
        ]
        logger.info("data parallel: %d engine cores ready", len(self.cores))

    async def _watch(self, rank: int) -> None:
        self._mark_dead(await self.cores[rank].wait_until_dead())

    def _mark_dead(self, reason: str) -> None:
        """The first death ends every core: their requests get EngineDeadError(reason)."""
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        self._died.set()
        for core in self.cores:
            core.mark_dead(reason)
        self._request_id_to_placement.clear()

    # ---- requests --------------------------------------------------------------------------

    def add_request(
        self, request: EngineCoreRequest
    ) -> asyncio.Queue[EngineCoreOutput | Exception]:
        """Routes the request to a core and sends it there (see `AsyncCoreClient`)."""
        self._raise_if_dead()
        if request.request_id in self._request_id_to_placement:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        lora = request.lora_request
        core = self.router.route(
            request.prompt_token_ids,
            request.sampling_params.cache_salt,
            lora.lora_name if lora is not None else None,
        )
        load_tokens = len(request.prompt_token_ids)
        try:
            output_queue = self.cores[core].add_request(request)
        except BaseException:
            self.router.finished(core, load_tokens)
            raise
        self._request_id_to_placement[request.request_id] = _Placement(core, load_tokens)
        return output_queue

    async def abort(self, request_ids: list[str], error: Exception | None = None) -> None:
        """Aborts each request on its core (see `AsyncCoreClient.abort`)."""
        rank_to_ids: dict[int, list[str]] = {}
        for request_id in request_ids:
            placement = self._request_id_to_placement.pop(request_id, None)
            if placement is not None:
                self.router.finished(placement.core, placement.load_tokens)
                rank_to_ids.setdefault(placement.core, []).append(request_id)
        await asyncio.gather(
            *(self.cores[rank].abort(ids, error) for rank, ids in rank_to_ids.items())
        )

    def _outputs_listener(self, rank: int):
        def listen(message: EngineCoreOutputs) -> None:
            if message.kv_events is not None and self.router is not None:
                self.router.apply_events(rank, message.kv_events)
            for output in message.outputs:
                self._count(output)

        return listen

    def _count(self, output: EngineCoreOutput) -> None:
        """Charges a request's new tokens to its core, and releases all of it at its end."""
        placement = self._request_id_to_placement.get(output.request_id)
        if placement is None:
            return
        placement.load_tokens += len(output.new_token_ids)
        self.router.generated(placement.core, len(output.new_token_ids))
        if output.finished:
            del self._request_id_to_placement[output.request_id]
            self.router.finished(placement.core, placement.load_tokens)

    # ---- engine-wide calls -----------------------------------------------------------------

    async def wait_until_dead(self) -> str:
        await self._died.wait()
        assert self.dead_reason is not None
        return self.dead_reason

    async def get_stats(self) -> SchedulerStats:
        """Every core's stats summed (KV cache usage: the mean, the cores being alike)."""
        return sum_stats(await self.get_stats_per_core())

    async def get_stats_per_core(self) -> list[SchedulerStats]:
        self._raise_if_dead()
        return list(await asyncio.gather(*(core.get_stats() for core in self.cores)))

    async def get_kv_block_maps(self) -> list[KVBlockMap]:
        self._raise_if_dead()
        per_core = await asyncio.gather(*(core.get_kv_block_maps() for core in self.cores))
        return [block_map for maps in per_core for block_map in maps]

    async def reset_prefix_cache(self) -> bool:
        """True if every core reset its prefix cache (each refuses while it runs requests)."""
        self._raise_if_dead()
        results = await asyncio.gather(*(core.reset_prefix_cache() for core in self.cores))
        for mirror, was_reset in zip(self.router.mirrors, results, strict=True):
            if was_reset:
                mirror.clear()
        return all(results)

    async def shutdown(self) -> None:
        """Stops every core (at once) and the death watchers. Idempotent."""
        for task in self._watchers:
            task.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        await asyncio.gather(*(core.shutdown() for core in self.cores))
        if self.ray_launcher is not None:
            await asyncio.to_thread(self.ray_launcher.release)
        if self.dead_reason is None:
            self.dead_reason = "the engine client was shut down"
            self._died.set()

    def _raise_if_dead(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self.ready is None:
            raise RuntimeError("DataParallelCoreClient.start() has not completed")


# SchedulerStats fields that list LoRA adapter names: merged across cores, not summed.
LORA_ADAPTER_STATS = ("running_lora_adapters", "waiting_lora_adapters")


def sum_stats(per_core: list[SchedulerStats]) -> SchedulerStats:
    """The engine's stats from its cores': counters and gauges summed (per-position counters
    position by position), KV usage averaged, the LoRA adapter names merged (each name once,
    in core order)."""
    per_pos = "spec_decode_num_accepted_tokens_per_pos"
    not_summed = (per_pos, *LORA_ADAPTER_STATS)
    fields = [name for name in SchedulerStats.__struct_fields__ if name not in not_summed]
    total: dict = {name: sum(getattr(stats, name) for stats in per_core) for name in fields}
    total["kv_cache_usage"] = total["kv_cache_usage"] / max(len(per_core), 1)
    per_pos_counts = (getattr(stats, per_pos) for stats in per_core)
    total[per_pos] = [sum(counts) for counts in zip(*per_pos_counts, strict=True)]
    for name in LORA_ADAPTER_STATS:
        names = (adapter for stats in per_core for adapter in getattr(stats, name))
        total[name] = list(dict.fromkeys(names))
    return SchedulerStats(**total)
