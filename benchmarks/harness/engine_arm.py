"""`EngineArm`: one engine (its own core and worker processes) under one speculative config,
measured in closed-loop runs through `AsyncEngineClient`, streaming."""

from __future__ import annotations

import time

from benchmarks.harness.closed_loop import ClosedLoopRun, RequestTiming, run_closed_loop
from benchmarks.spec_decode.counts import SpecDecodeCounts
from benchmarks.spec_decode.workloads import DecodeWorkload
from core_engine.frontend import AsyncEngineClient
from core_engine.proto import SamplingParams
from core_engine.proto.engine_config import EngineConfig

WARM_UP_PROMPT = "Hello there, how are you today?"
WARM_UP_MAX_TOKENS = 8


class EngineArm:
    """An engine with `config` (its `speculative_config` None: the baseline).

    With `fresh_per_run` the engine is restarted before every run, so that state a drafter
    keeps across requests (suffix decoding's tree of earlier outputs) never holds the replies
    of an earlier run to the same prompts; within a run it learns as a fresh server would.
    Every run starts on an empty prefix cache.
    """

    def __init__(self, label: str, config: EngineConfig, fresh_per_run: bool = False) -> None:
        self.label = label
        self.config = config
        self.fresh_per_run = fresh_per_run
        self.client: AsyncEngineClient | None = None
        self.num_starts = 0

    async def start(self) -> None:
        """Starts the engine and runs one short request, so no run pays for first calls."""
        client = AsyncEngineClient(self.config)
        await client.start()
        self.client = client
        self.num_starts += 1
        params = SamplingParams(max_tokens=WARM_UP_MAX_TOKENS, temperature=0.0)
        async for _ in client.generate(WARM_UP_PROMPT, params):
            pass

    async def close(self) -> None:
        if self.client is not None:
            client, self.client = self.client, None
            await client.shutdown()

    async def run(
        self, workload: DecodeWorkload, num_prompts: int, concurrency: int
    ) -> tuple[ClosedLoopRun, SpecDecodeCounts]:
        """The first `num_prompts` prompts, `concurrency` in flight; greedy. Returns the run and
        the speculative decoding counts it added."""
        if self.fresh_per_run and self.num_starts > 0:
            await self.close()
            await self.start()
        client = self._started()
        if not await client.reset_prefix_cache():
            raise RuntimeError(f"{self.label}: the engine refused to reset its prefix cache")
        params = SamplingParams(
            max_tokens=workload.max_tokens, temperature=0.0, ignore_eos=workload.ignore_eos
        )
        before = SpecDecodeCounts.from_stats(await client.get_stats())

        async def send(index: int) -> RequestTiming:
            return await self._request(workload.prompt_token_ids[index], params)

        run = await run_closed_loop(send, num_prompts, concurrency)
        after = SpecDecodeCounts.from_stats(await client.get_stats())
        return run, after.minus(before)

    async def _request(self, prompt_token_ids: list[int], params: SamplingParams) -> RequestTiming:
        client = self._started()
        start_s = time.monotonic()
        first_token_s = None
        token_ids: list[int] = []
        async for delta in client.generate(prompt_token_ids, params):
            if delta.error is not None:
                raise RuntimeError(f"{self.label}: the engine failed a request: {delta.error}")
            new_token_ids = delta.outputs[0].token_ids
            if new_token_ids and first_token_s is None:
                first_token_s = time.monotonic()
            token_ids += new_token_ids
        return RequestTiming(start_s, first_token_s, time.monotonic(), token_ids)

    def _started(self) -> AsyncEngineClient:
        if self.client is None:
            raise RuntimeError(f"{self.label}: the engine is not started")
        return self.client
