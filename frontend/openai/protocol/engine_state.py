"""GET /engine/state: what the web page draws, about once a second."""

from __future__ import annotations

from pydantic import BaseModel

from core_engine.proto import KVBlockMap, KVBlockState, SchedulerStats


class KVBlockMapView(BaseModel):
    """One core's KV pool. `cells` holds one digit per cell, the `KVBlockState` value (0 free,
    1 cached and free, 2 in use, 3 shared, 4 reserved); cell i covers blocks
    `[i * blocks_per_cell, (i + 1) * blocks_per_cell)` and shows their busiest state.
    `num_blocks_by_state` counts blocks by state name."""

    num_blocks: int
    blocks_per_cell: int
    cells: str
    num_blocks_by_state: dict[str, int]

    @classmethod
    def of(cls, block_map: KVBlockMap) -> KVBlockMapView:
        return cls(
            num_blocks=block_map.num_blocks,
            blocks_per_cell=block_map.blocks_per_cell,
            cells=bytes(state + ord("0") for state in block_map.states).decode("ascii"),
            num_blocks_by_state={
                state.name.lower(): block_map.num_blocks_by_state[state] for state in KVBlockState
            },
        )


class EngineState(BaseModel):
    """The scheduler's gauges and cumulative counters (summed over data-parallel cores; KV
    usage averaged) and each core's block map. `time` is the server's Unix time in seconds;
    rates are the reader's to take from two answers' counters."""

    model: str
    time: float
    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    prefix_cache_hit_rate: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_prompt_tokens: int
    num_generation_tokens: int
    num_steps: int
    kv_block_maps: list[KVBlockMapView]

    @classmethod
    def of(
        cls, model: str, time_s: float, stats: SchedulerStats, block_maps: list[KVBlockMap]
    ) -> EngineState:
        return cls(
            model=model,
            time=time_s,
            num_running_reqs=stats.num_running_reqs,
            num_waiting_reqs=stats.num_waiting_reqs,
            kv_cache_usage=stats.kv_cache_usage,
            prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
            num_preemptions=stats.num_preemptions,
            num_prompt_tokens=stats.num_prompt_tokens,
            num_generation_tokens=stats.num_generation_tokens,
            num_steps=stats.num_steps,
            kv_block_maps=[KVBlockMapView.of(block_map) for block_map in block_maps],
        )
