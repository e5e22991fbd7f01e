"""The engine's own IPC cost: client -> engine core -> worker -> core -> client, null model.

The null worker returns one token per request and does no work, so what is measured is the
frontend client, the sockets, the engine core's loop and scheduler, and the core <-> worker
hop (a socketpair). The floor, measured in the same run: a raw ZeroMQ ping-pong with the same socket types
(ROUTER -> DEALER, PUSH -> PULL) and the same message sizes, against an echo process. Raw and
core measurements alternate (blocks of round trips, one burst each per repeat), so both see the
same machine.

- round trip: one request in flight at a time, p50/p90/p99 microseconds;
- throughput: a stream of small requests (8 prompt tokens, max_tokens=1) with a bounded number
  in flight (512 raw, 2048 through the engine: two full batches), requests/s, the median of
  `--repeats` streams. (Submitting tens of thousands at once would measure how the core copes
  with a backlog instead.)

Goals: core round trip within 3x of the raw round trip; at least 20,000 requests/s through the
core. The same figures through `AsyncEngineClient` (tokenizer, output processing) are reported
for reference.

    python -m benchmarks.micro.ipc [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

import zmq

from benchmarks.harness.common import (
    RESULTS_DIR,
    machine_info,
    markdown_table,
    percentiles,
    result_name,
    write_results,
)
from core_engine.frontend.async_engine_client import AsyncEngineClient
from core_engine.frontend.core_client import AsyncCoreClient
from core_engine.frontend.engine_client import new_event_loop
from core_engine.proto import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    MessageEncoder,
    SamplingParams,
)
from core_engine.proto.engine_config import EngineConfig

PROMPT_LEN = 8
NULL_TOKEN_ID = 42
THROUGHPUT_WINDOW = 512  # raw ping-pong: requests in flight (below ZeroMQ's default HWM of 1000)
CORE_WINDOW = 2048  # engine: requests in flight, two full batches of the default max_num_seqs
TARGET_ROUND_TRIP_RATIO = 3.0
TARGET_REQUESTS_PER_S = 20_000
STOP_FRAME = b"stop"
ROUND_TRIP_BLOCK = 100  # round trips per turn when raw and core alternate


def make_request(index: int) -> EngineCoreRequest:
    prompt = [(index + offset) % 200 + 1 for offset in range(PROMPT_LEN)]
    return EngineCoreRequest(
        request_id=f"r{index}",
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=1, temperature=0.0),
        arrival_time=time.time(),
    )


def message_frames() -> tuple[list[bytes], list[bytes]]:
    """The wire frames of one small request and of the core's answer to it."""
    encoder = MessageEncoder()
    request = encoder.encode(make_request(0))
    output = EngineCoreOutput("r0", [NULL_TOKEN_ID], FinishReason.LENGTH)
    reply = encoder.encode(EngineCoreOutputs(outputs=[output], timestamp=time.time()))
    return request, reply


# ---- the floor: raw ZeroMQ ping-pong --------------------------------------------------------


def echo_server(requests_address: str, outputs_address: str, reply: list[bytes]) -> None:
    """Answers every request frame set with `reply` on PUSH, until it receives STOP_FRAME."""
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(requests_address)
    push = context.socket(zmq.PUSH)
    push.connect(outputs_address)
    dealer.send(b"hello")
    while True:
        frames = dealer.recv_multipart()
        if frames[0] == STOP_FRAME:
            break
        push.send_multipart(reply)
    dealer.close(linger=0)
    push.close(linger=1000)
    context.term()


class RawPingPong:
    """The floor: a ROUTER/PULL pair here and an echo process (DEALER/PUSH) answering every
    request frame set with the reply frames. A context manager; one request at a time."""

    def __init__(self, request: list[bytes], reply: list[bytes]) -> None:
        self.request, self.reply = request, reply

    def __enter__(self) -> RawPingPong:
        self._folder = tempfile.TemporaryDirectory(prefix="bench-ipc-")
        requests_address = f"ipc://{self._folder.name}/req"
        outputs_address = f"ipc://{self._folder.name}/out"
        self._context = zmq.Context()
        self.router = self._context.socket(zmq.ROUTER)
        # As in the engine's client: block at the high-water mark instead of dropping. (The
        # sender sees the reader's progress only every HWM/2 messages, so even a window below
        # the HWM can hit it, and a dropped request would hang the measurement.)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.bind(requests_address)
        self.pull = self._context.socket(zmq.PULL)
        self.pull.bind(outputs_address)
        self._echo = multiprocessing.get_context("spawn").Process(
            target=echo_server,
            args=(requests_address, outputs_address, self.reply),
            daemon=True,
        )
        self._echo.start()
        self.routing_id, _ = self.router.recv_multipart()
        return self

    def __exit__(self, *exc_info) -> None:
        try:
            self.router.send_multipart([self.routing_id, STOP_FRAME])
        finally:
            self._echo.join(timeout=10)
            if self._echo.is_alive():
                self._echo.kill()
            self.router.close(linger=0)
            self.pull.close(linger=0)
            self._context.term()
            self._folder.cleanup()

    def round_trip(self) -> float:
        start = time.perf_counter()
        self.router.send_multipart([self.routing_id, *self.request])
        self.pull.recv_multipart()
        return time.perf_counter() - start

    def burst(self, num_requests: int) -> float:
        """Seconds to stream `num_requests` through the echo, THROUGHPUT_WINDOW in flight."""
        start = time.perf_counter()
        num_sent = num_received = 0
        while num_received < num_requests:
            while num_sent < num_requests and num_sent - num_received < THROUGHPUT_WINDOW:
                self.router.send_multipart([self.routing_id, *self.request])
                num_sent += 1
            self.pull.recv_multipart()
            num_received += 1
        return time.perf_counter() - start


# ---- the engine ------------------------------------------------------------------------------


async def measure_raw_and_core(
    config: EngineConfig,
    frames: tuple[list[bytes], list[bytes]],
    num_round_trips: int,
    num_throughput: int,
    num_repeats: int,
) -> tuple[dict, dict]:
    """The raw floor and `AsyncCoreClient` + a real engine core process with the null worker,
    measured in alternation (blocks of ROUND_TRIP_BLOCK round trips, then one burst each per
    repeat), so that both see the same machine: on a shared VM the latency of the same code
    drifts from one minute to the next."""
    client = AsyncCoreClient(config)
    await client.start()
    try:
        with RawPingPong(*frames) as raw:
            for _ in range(min(200, num_round_trips)):  # warm-up
                raw.round_trip()
            await _core_burst(client, 0, min(2000, num_throughput))
            raw_round_trips_s: list[float] = []
            core_round_trips_s: list[float] = []
            next_index = 10_000_000
            while len(core_round_trips_s) < num_round_trips:
                block = min(ROUND_TRIP_BLOCK, num_round_trips - len(core_round_trips_s))
                raw_round_trips_s += [raw.round_trip() for _ in range(block)]
                for _ in range(block):
                    core_round_trips_s.append(await _core_round_trip(client, next_index))
                    next_index += 1
            raw_bursts_s, core_bursts_s = [], []
            for repeat in range(num_repeats):
                raw_bursts_s.append(raw.burst(num_throughput))
                first_index = (20 + repeat) * 1_000_000
                core_bursts_s.append(await _core_burst(client, first_index, num_throughput))
    finally:
        await client.shutdown()
    return (
        summarize("raw ZeroMQ ping-pong (floor)", raw_round_trips_s, num_throughput, raw_bursts_s),
        summarize(
            "engine core (AsyncCoreClient)", core_round_trips_s, num_throughput, core_bursts_s
        ),
    )


async def _core_round_trip(client: AsyncCoreClient, index: int) -> float:
    request = make_request(index)
    start = time.perf_counter()
    output = await client.add_request(request).get()
    elapsed_s = time.perf_counter() - start
    _check_output(output)
    return elapsed_s


async def _core_burst(client: AsyncCoreClient, first_index: int, num_requests: int) -> float:
    """Streams `num_requests` through the core, CORE_WINDOW in flight (the null engine answers
    in order, so the oldest is awaited first); returns the seconds taken."""
    requests = [make_request(first_index + index) for index in range(num_requests)]
    start = time.perf_counter()
    in_flight: collections.deque = collections.deque()
    for request in requests:
        if len(in_flight) == CORE_WINDOW:
            _check_output(await in_flight.popleft().get())
        in_flight.append(client.add_request(request))
    while in_flight:
        _check_output(await in_flight.popleft().get())
    return time.perf_counter() - start


def _check_output(output: object) -> None:
    if not isinstance(output, EngineCoreOutput) or output.new_token_ids != [NULL_TOKEN_ID]:
        raise RuntimeError(f"unexpected answer from the null engine: {output!r}")


async def measure_frontend(
    config: EngineConfig, num_round_trips: int, num_throughput: int, num_repeats: int
) -> dict:
    """Through `AsyncEngineClient` (validation, output processing, detokenization)."""
    engine = AsyncEngineClient(config)
    await engine.start()
    params = SamplingParams(max_tokens=1, temperature=0.0)
    prompt = list(range(1, PROMPT_LEN + 1))

    async def one() -> None:
        async for output in engine.generate(prompt, params, stream=False):
            if output.outputs[0].token_ids != [NULL_TOKEN_ID]:
                raise RuntimeError(f"unexpected answer from the null engine: {output!r}")

    async def stream(num_requests: int) -> None:
        window = asyncio.Semaphore(CORE_WINDOW)

        async def limited() -> None:
            async with window:
                await one()

        await asyncio.gather(*(limited() for _ in range(num_requests)))

    try:
        await stream(min(1000, num_throughput))  # warm-up
        round_trips_s = []
        for _ in range(num_round_trips):
            start = time.perf_counter()
            await one()
            round_trips_s.append(time.perf_counter() - start)
        bursts_s = []
        for _ in range(num_repeats):
            start = time.perf_counter()
            await stream(num_throughput)
            bursts_s.append(time.perf_counter() - start)
    finally:
        await engine.shutdown()
    return summarize("full frontend (AsyncEngineClient)", round_trips_s, num_throughput, bursts_s)


def summarize(
    path: str, round_trips_s: list[float], num_requests: int, bursts_s: list[float]
) -> dict:
    """Round-trip percentiles; throughput from the median burst."""
    round_trip_us = {k: v * 1e6 for k, v in percentiles(round_trips_s).items()}
    elapsed_s = statistics.median(bursts_s)
    return {
        "path": path,
        "num_round_trips": len(round_trips_s),
        "round_trip_us": round_trip_us,
        "num_throughput_requests": num_requests,
        "bursts_s": bursts_s,
        "requests_per_s": num_requests / elapsed_s,
        "us_per_request": elapsed_s / num_requests * 1e6,
    }


# ---- main ------------------------------------------------------------------------------------


def run_loop(coroutine):
    loop = new_event_loop()
    try:
        return loop.run_until_complete(coroutine)
    finally:
        loop.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small run, well under a minute")
    parser.add_argument("--num-round-trips", type=int, default=2000)
    parser.add_argument("--num-requests", type=int, default=50_000)
    parser.add_argument("--repeats", type=int, default=3, help="throughput bursts (median)")
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    num_round_trips = 200 if args.quick else args.num_round_trips
    num_requests = 3000 if args.quick else args.num_requests
    num_repeats = 1 if args.quick else args.repeats
    machine = machine_info()
    config = EngineConfig(
        model="null",
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_seqs * PROMPT_LEN,
        max_model_len=64,
    )
    request_frames, reply_frames = message_frames()
    raw, core = run_loop(
        measure_raw_and_core(
            config, (request_frames, reply_frames), num_round_trips, num_requests, num_repeats
        )
    )
    frontend = run_loop(measure_frontend(config, num_round_trips, num_requests // 2, num_repeats))
    rows = [raw, core, frontend]
    for row in rows:
        print(
            f"{row['path']}: round trip p50 {row['round_trip_us']['p50']:.0f} us, "
            f"{row['requests_per_s']:.0f} requests/s",
            flush=True,
        )
    raw, core, frontend = rows
    round_trip_ratio = core["round_trip_us"]["p50"] / raw["round_trip_us"]["p50"]
    result = {
        "benchmark": "ipc",
        "quick": args.quick,
        "machine": machine,
        "config": {
            "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "prompt_len": PROMPT_LEN,
            "max_tokens": 1,
            "raw_window": THROUGHPUT_WINDOW,
            "engine_window": CORE_WINDOW,
        },
        "request_bytes": sum(len(frame) for frame in request_frames),
        "reply_bytes": sum(len(frame) for frame in reply_frames),
        "rows": rows,
        "core_round_trip_vs_raw": round_trip_ratio,
        "frontend_round_trip_vs_raw": frontend["round_trip_us"]["p50"]
        / raw["round_trip_us"]["p50"],
        "core_per_request_cost_vs_raw": core["us_per_request"] / raw["us_per_request"],
        "core_requests_per_s": core["requests_per_s"],
        "target_round_trip_ratio": TARGET_ROUND_TRIP_RATIO,
        "target_requests_per_s": TARGET_REQUESTS_PER_S,
        "meets_round_trip_target": round_trip_ratio <= TARGET_ROUND_TRIP_RATIO,
        "meets_throughput_target": core["requests_per_s"] >= TARGET_REQUESTS_PER_S,
    }
    write_results(result, render_markdown(result), args.output_dir, result_name("ipc", args.quick))
    print(
        f"core round trip vs raw: {round_trip_ratio:.2f}x (target <= {TARGET_ROUND_TRIP_RATIO}x); "
        f"core throughput {core['requests_per_s']:.0f} requests/s "
        f"(target >= {TARGET_REQUESTS_PER_S}); "
        f"per-request cost at saturation vs raw: {result['core_per_request_cost_vs_raw']:.1f}x"
    )


def render_markdown(result: dict) -> str:
    rows = [
        [
            row["path"],
            f"{row['round_trip_us']['p50']:.0f}",
            f"{row['round_trip_us']['p90']:.0f}",
            f"{row['round_trip_us']['p99']:.0f}",
            f"{row['requests_per_s']:,.0f}",
            f"{row['us_per_request']:.1f}",
        ]
        for row in result["rows"]
    ]
    table = markdown_table(
        ["path", "round trip p50 µs", "p90 µs", "p99 µs", "requests/s", "µs / request"], rows
    )
    return (
        f"### IPC: null model, {result['request_bytes']} B requests, "
        f"{result['reply_bytes']} B replies\n\n{table}\n\n"
        f"Core round trip / raw round trip (p50): **{result['core_round_trip_vs_raw']:.2f}x** "
        f"(target <= {result['target_round_trip_ratio']:.0f}x, "
        f"{'met' if result['meets_round_trip_target'] else 'missed'}); "
        f"core throughput **{result['core_requests_per_s']:,.0f} requests/s** "
        f"(target >= {result['target_requests_per_s']:,}, "
        f"{'met' if result['meets_throughput_target'] else 'missed'}); "
        f"per-request cost at saturation vs raw: {result['core_per_request_cost_vs_raw']:.1f}x."
    )


if __name__ == "__main__":
    main()
