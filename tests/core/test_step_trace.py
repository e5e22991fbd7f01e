"""The engine core's step trace (CORE_ENGINE_STEP_TRACE): one line per step, with the step's
token and request counts, written by a real engine core process."""

from __future__ import annotations

import asyncio
import io

import msgspec

from core_engine.core.step_trace import STEP_TRACE_ENV, StepRecord, StepTrace
from core_engine.frontend import AsyncEngineClient
from core_engine.proto import SamplingParams, SchedulerOutput
from core_engine.proto.engine_config import EngineConfig


def read_step_trace(path) -> list[StepRecord]:
    """The trace's lines, decoded as the benchmarks read them (JSON lines of StepRecord)."""
    lines = path.read_text().splitlines()
    return [msgspec.json.decode(line, type=StepRecord) for line in lines if line.strip()]


def test_a_record_counts_tokens_requests_and_decodes(tmp_path):
    buffer = io.StringIO()
    trace = StepTrace(buffer)
    output = SchedulerOutput(num_scheduled_tokens={"a": 1, "b": 7, "c": 1},
                             total_num_scheduled_tokens=9)  # fmt: skip
    trace.record(output, 10.0, 10.25)
    path = tmp_path / "trace.jsonl"
    path.write_text(buffer.getvalue())
    (record,) = read_step_trace(path)
    assert (record.num_tokens, record.num_reqs, record.num_decode_reqs) == (9, 3, 2)
    assert (record.sent_s, record.received_s) == (10.0, 10.25)


def test_the_engine_core_writes_one_line_per_step(tmp_path, monkeypatch):
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv(STEP_TRACE_ENV, str(path))
    config = EngineConfig(model="null", device="cpu", num_gpu_blocks_override=512,
                          max_num_batched_tokens=64)  # fmt: skip

    async def scenario():
        client = AsyncEngineClient(config)
        await client.start()
        try:
            params = SamplingParams(max_tokens=5, ignore_eos=True)
            prompts = [[7] * 100, [9] * 3]

            async def one(prompt):
                async for output in client.generate(prompt, params, stream=False):
                    return output

            await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await client.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), 120))
    records = read_step_trace(path)
    # 103 prompt tokens and 2 x 5 sampled ones, of which the last of each is never fed back.
    assert sum(r.num_tokens for r in records) == 103 + 2 * 4
    assert all(r.num_tokens <= 64 for r in records)
    assert all(r.received_s >= r.sent_s for r in records)
    assert all(b.sent_s >= a.received_s for a, b in zip(records, records[1:], strict=False))
    assert records[-1].num_decode_reqs == records[-1].num_reqs
