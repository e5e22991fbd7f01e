"""Times `build_kv_block_map` (what one GET /engine/state costs the engine core) on a large pool.

    python -m benchmarks.kv.block_map_overhead [--num-blocks 100000]

The pool is half in use, a quarter cached and free; the answer is cached by the frontend for
0.5 s, so the core pays this at most twice a second however many pages are open.
"""

from __future__ import annotations

import argparse
import time

from core_engine.core.kv_cache.block_pool import BlockPool
from core_engine.core.kv_cache.kv_block_map import build_kv_block_map
from core_engine.core.request import Request
from core_engine.proto import SamplingParams
from core_engine.proto.engine_messages import MAX_KV_BLOCK_MAP_CELLS

BLOCK_SIZE = 16


def busy_pool(num_blocks: int) -> BlockPool:
    pool = BlockPool(num_blocks)
    num_cached = num_blocks // 4
    tokens = list(range(num_cached * BLOCK_SIZE))
    request = Request("cached", tokens, SamplingParams(max_tokens=1), block_size=BLOCK_SIZE)
    cached = pool.get_new_blocks(num_cached)
    pool.cache_full_blocks(request, cached, 0, num_cached, BLOCK_SIZE)
    pool.get_new_blocks(num_blocks // 2)
    pool.free_blocks(cached)
    return pool


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-blocks", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    pool = busy_pool(args.num_blocks)
    timings_s = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        block_map = build_kv_block_map(pool, MAX_KV_BLOCK_MAP_CELLS)
        timings_s.append(time.perf_counter() - start)
    timings_s.sort()
    median_ms = timings_s[len(timings_s) // 2] * 1e3
    print(
        f"{args.num_blocks} blocks -> {len(block_map.states)} cells of "
        f"{block_map.blocks_per_cell}: median {median_ms:.1f} ms, min {timings_s[0] * 1e3:.1f} ms "
        f"per call; at 2 calls/s {median_ms * 2 / 10:.1f}% of a core"
    )


if __name__ == "__main__":
    main()
