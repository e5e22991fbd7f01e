"""Prefill/decode disaggregation against one instance: inter-token latency of decoding streams
while long prompts arrive.

The workload (`benchmarks/pd/workload.py`, seeded token ids, greedy, ignore_eos): a few
decode streams with short prompts and long outputs, all sent at the start, and long prompts
with short outputs sent on a fixed schedule while they run. On one instance every long prompt's
prefill shares steps with the decode streams and stalls them; disaggregated, the prompts are
computed on a prefill instance and the decode instance only pulls their KV. Each arm is reached
through one URL and measured on the same requests, one arm after the other:

- "one instance": one `core-serve` on every usable core (the engine's default threads);
- "disaggregated": a prefill `core-serve` (TcpConnector kv_producer) pinned to one core and a
  decode `core-serve` (kv_consumer) pinned to another (`taskset`, `OMP_NUM_THREADS=1`: each
  worker computes on its own core), with `core-pd-proxy` in front;
- "one instance, 1 core" (a cost reference; `--arms` leaves it out): one `core-serve` pinned to
  the first core with one thread.

Reported per arm: the decode streams' inter-token latency (p50/p90/p99/max: the stalls are in
the tail), TPOT and TTFT, the long prompts' TTFT, the total time, and the ratios against one
instance; the greedy texts of every arm are compared with one instance's and any mismatch is
reported. The benchmark client and the proxy are not pinned: they share the cores with the
servers (a server's HTTP frontend and engine core run on its worker's core). Run it on a quiet
machine: a worker with several threads slows down by far the most when other processes share
its cores, so each arm records the load average when it started.

    python -m benchmarks.pd.bench [--quick] [--arms one disaggregated single-core]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import re
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from benchmarks.harness.common import (
    StreamedCompletion,
    cpu_list_text,
    device_results_dir,
    engine_default_dtype,
    http_server,
    machine_info,
    result_name,
    stream_completion,
    usable_cpu_ids,
    write_results,
)
from benchmarks.pd.report import add_ratios, compare_texts, render_markdown
from benchmarks.pd.workload import (
    DECODE,
    FULL_SHAPE,
    LONG,
    QUICK_SHAPE,
    TimedRequest,
    WorkloadShape,
    build_workload,
    decode_stream_stats,
    long_prompt_stats,
    num_long_prompts_during_decode,
    warm_up_prompt,
)
from core_engine.common.model_files import resolve_model_path
from core_engine.common.ports import find_free_port

ONE = "one instance"
DISAGGREGATED = "disaggregated"
SINGLE_CORE = "one instance, 1 core"
ARM_NAMES = {"one": ONE, "disaggregated": DISAGGREGATED, "single-core": SINGLE_CORE}
REQUEST_TIMEOUT_S = 1800.0
BLOCK_SIZE = 16
THREADS_LINE = re.compile(r"worker rank 0: .* on cpu, \w+, (\d+) threads")


# ---- servers -----------------------------------------------------------------------------------


def server_env(num_threads: int | None) -> dict[str, str]:
    """This process's environment with OMP_NUM_THREADS set to `num_threads`, or removed (None:
    the engine's default, one thread per core the worker may run on)."""
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    if num_threads is not None:
        env["OMP_NUM_THREADS"] = str(num_threads)
    return env


@contextlib.contextmanager
def pinned_core_serve(
    engine_flags: Sequence[str], cpu_id: int | None, log_path: Path
) -> Iterator[str]:
    """`core-serve` on a free port, yielding its URL once healthy. With `cpu_id`, the server
    and every process it starts (engine core, worker) run on that CPU only, and the worker with
    one thread; without, on every usable CPU with the engine's default threads."""
    port = find_free_port()
    argv = [
        sys.executable, "-m", "core_engine.frontend.openai.cli",
        "--host", "127.0.0.1", "--port", str(port), "--disable-log-stats", *engine_flags,
    ]  # fmt: skip
    if cpu_id is not None:
        argv = ["taskset", "-c", str(cpu_id), *argv]
    env = server_env(None if cpu_id is None else 1)
    name = f"core-serve on CPU {cpu_id}" if cpu_id is not None else "core-serve"
    with http_server(argv, port, name, log_path, env=env, own_session=True) as url:
        yield url


@contextlib.contextmanager
def pd_proxy(prefill_url: str, decode_url: str, log_path: Path) -> Iterator[str]:
    port = find_free_port()
    argv = [
        sys.executable, "-m", "core_engine.frontend.openai.pd_proxy_cli",
        "--prefill", prefill_url, "--decode", decode_url,
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    with http_server(argv, port, "core-pd-proxy", log_path) as url:
        yield url


def tcp_connector_flags(role: str) -> list[str]:
    return ["--kv-transfer-config", json.dumps({"kv_connector": "TcpConnector", "kv_role": role})]


@contextlib.contextmanager
def arm_url(
    arm: str, engine_flags: Sequence[str], cpu_ids: Sequence[int], log_dir: Path
) -> Iterator[str]:
    """The one URL through which `arm` is measured, its servers running until the block exits."""
    if arm == ONE:
        with pinned_core_serve(engine_flags, None, log_dir / "one.log") as url:
            yield url
    elif arm == SINGLE_CORE:
        with pinned_core_serve(engine_flags, cpu_ids[0], log_dir / "single-core.log") as url:
            yield url
    elif arm == DISAGGREGATED:
        prefill_flags = [*engine_flags, *tcp_connector_flags("kv_producer")]
        decode_flags = [*engine_flags, *tcp_connector_flags("kv_consumer")]
        with contextlib.ExitStack() as stack:
            prefill, decode = enter_together(
                stack,
                [
                    pinned_core_serve(prefill_flags, cpu_ids[0], log_dir / "prefill.log"),
                    pinned_core_serve(decode_flags, cpu_ids[1], log_dir / "decode.log"),
                ],
            )
            yield stack.enter_context(pd_proxy(prefill, decode, log_dir / "proxy.log"))
    else:
        raise ValueError(f"unknown arm {arm!r}; known: {', '.join(ARM_NAMES.values())}")


def enter_together(stack: contextlib.ExitStack, managers: Sequence) -> list:
    """Enters every context manager at once, each in a thread of its own (starting a server is
    mostly waiting for it, and pinned servers load on different cores); returns their values.
    Each one entered is registered on `stack` for exit; the first failure is raised after all
    have been entered or failed."""
    with ThreadPoolExecutor(max_workers=len(managers)) as pool:
        futures = [pool.submit(manager.__enter__) for manager in managers]
    for manager, future in zip(managers, futures, strict=True):
        if future.exception() is None:
            stack.push(manager.__exit__)
    for future in futures:
        if future.exception() is not None:
            raise future.exception()
    return [future.result() for future in futures]


def worker_threads(log_dir: Path) -> dict[str, int]:
    """{server log name: its worker's thread count}, from the worker's start-up line."""
    threads = {}
    for log_path in sorted(log_dir.glob("*.log")):
        match = THREADS_LINE.search(log_path.read_text(errors="replace"))
        if match:
            threads[log_path.stem] = int(match.group(1))
    return threads


def placement(arm: str, cpu_ids: Sequence[int]) -> str:
    """Where the arm's processes run, in words, for the report."""
    if arm == ONE:
        return (
            f"core-serve (frontend, engine core, worker) on CPUs {cpu_list_text(cpu_ids)}, "
            "the engine's default threads"
        )
    if arm == SINGLE_CORE:
        return f"core-serve and all its processes on CPU {cpu_ids[0]}, 1 worker thread"
    return (
        f"prefill core-serve (kv_producer) and all its processes on CPU {cpu_ids[0]}, decode "
        f"core-serve (kv_consumer) on CPU {cpu_ids[1]}, 1 worker thread each; core-pd-proxy "
        "and the benchmark client not pinned (they share the cores)"
    )


# ---- one arm -----------------------------------------------------------------------------------


def completion_payload(prompt_token_ids: Sequence[int], max_tokens: int) -> dict:
    return {
        "prompt": list(prompt_token_ids),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }


async def run_workload(
    url: str, requests: Sequence[TimedRequest], warm_up: Sequence[int]
) -> tuple[list[StreamedCompletion], float]:
    """One warm-up request, then every request at its offset; the results in request order and
    the seconds from the first send to the last answer."""
    limits = httpx.Limits(max_connections=len(requests) + 1, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=REQUEST_TIMEOUT_S) as client:
        warm = await stream_completion(client, url, completion_payload(warm_up, 4))
        if warm.error is not None:
            raise RuntimeError(f"the warm-up request failed: {warm.error}")
        start_s = time.monotonic()

        async def send(request: TimedRequest) -> StreamedCompletion:
            await asyncio.sleep(max(0.0, start_s + request.offset_s - time.monotonic()))
            payload = completion_payload(request.prompt_token_ids, request.max_tokens)
            return await stream_completion(client, url, payload)

        results = await asyncio.gather(*(send(request) for request in requests))
    return list(results), max(result.end_s for result in results) - start_s


def summarize_arm(
    arm: str, requests: Sequence[TimedRequest], results: Sequence[StreamedCompletion], total_s
) -> dict:
    """What the report shows of one arm; the texts stay in for the comparison across arms."""
    decode = [r for q, r in zip(requests, results, strict=True) if q.kind == DECODE]
    long = [r for q, r in zip(requests, results, strict=True) if q.kind == LONG]
    errors = [result.error for result in results if result.error is not None]
    return {
        "arm": arm,
        "total_s": total_s,
        "decode": decode_stream_stats(decode),
        "long": long_prompt_stats(long),
        "num_long_prompts_during_decode": num_long_prompts_during_decode(decode, long),
        "num_errors": len(errors),
        "errors": errors[:5],
        "num_wrong_length": sum(
            r.error is None and r.num_output_tokens != q.max_tokens
            for q, r in zip(requests, results, strict=True)
        ),
        "decode_texts": [result.text for result in decode],
        "long_texts": [result.text for result in long],
    }


def measure_arm(
    arm: str, engine_flags: Sequence[str], cpu_ids: Sequence[int], requests, warm_up
) -> dict:
    print(f"--- {arm}", flush=True)
    load_average_1m = os.getloadavg()[0]  # other load on the cores skews one arm, not all
    with tempfile.TemporaryDirectory(prefix="bench-pd-") as folder:
        log_dir = Path(folder)
        with arm_url(arm, engine_flags, cpu_ids, log_dir) as url:
            results, total_s = asyncio.run(run_workload(url, requests, warm_up))
        row = summarize_arm(arm, requests, results, total_s)
        row["worker_threads"] = worker_threads(log_dir)
    row["placement"] = placement(arm, cpu_ids)
    row["load_average_1m_at_start"] = load_average_1m
    decode = row["decode"]
    print(
        f"decode ITL p50/p99/max {decode['itl_ms']['p50']:.0f}/{decode['itl_ms']['p99']:.0f}/"
        f"{decode['itl_ms']['max']:.0f} ms, TPOT {decode['tpot_ms']['mean']:.1f} ms, long TTFT "
        f"p50 {row['long']['ttft_ms']['p50']:.0f} ms, total {total_s:.1f} s, errors "
        f"{row['num_errors']}, workers' threads {row['worker_threads']}",
        flush=True,
    )
    return row


# ---- command line ------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small run, about a minute")
    parser.add_argument("--arms", nargs="+", choices=tuple(ARM_NAMES),
                        default=["one", "disaggregated", "single-core"],
                        help="which arms to measure, in this order; 'one' is the baseline "
                        "and always runs first")  # fmt: skip
    parser.add_argument("--model", default=None, help="core-serve's --model (default: its own)")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="every server's dtype (default: the engine's default)")  # fmt: skip
    parser.add_argument("--server-args", default="",
                        help="more core-serve flags for every server")  # fmt: skip
    parser.add_argument("--cpus", type=int, nargs=2, default=None, metavar=("PREFILL", "DECODE"),
                        help="the CPUs of the prefill and the decode instance "
                        "(default: the first two usable)")  # fmt: skip
    parser.add_argument("--long-interval-s", type=float, default=None,
                        help="seconds between long prompts (default: 2.5, --quick 0.5)")  # fmt: skip
    parser.add_argument("--decode-output-tokens", type=int, nargs=2, default=None,
                        metavar=("LOW", "HIGH"),
                        help="the decode streams' output lengths (default: 384 512, --quick "
                        "48 64); longer streams see more long prompts")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", type=Path, default=None,
                        help="default: benchmarks/results/<this CPU's SIMD flag>/")  # fmt: skip
    args = parser.parse_args(argv)
    usable = usable_cpu_ids()
    args.cpus = args.cpus or usable[:2]
    if len(args.cpus) < 2 or len(set(args.cpus)) < 2 or not set(args.cpus) <= set(usable):
        parser.error(
            f"the disaggregated arm needs two distinct usable CPUs; usable: "
            f"{cpu_list_text(usable)}, asked: {args.cpus}"
        )
    args.arms = [ONE] + [ARM_NAMES[name] for name in args.arms if name != "one"]
    try:
        args.shape = workload_shape(args)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def workload_shape(args: argparse.Namespace) -> WorkloadShape:
    """The --quick or full shape with the command line's overrides; ValueError names a bad one."""
    shape = QUICK_SHAPE if args.quick else FULL_SHAPE
    if args.long_interval_s is not None:
        shape = dataclasses.replace(shape, long_interval_s=args.long_interval_s)
    if args.decode_output_tokens is not None:
        shape = dataclasses.replace(shape, decode_output_tokens=tuple(args.decode_output_tokens))
    return shape


def engine_flags(
    args: argparse.Namespace, shape: WorkloadShape, requests: Sequence[TimedRequest], dtype: str
) -> list[str]:
    """Every server's flags: the same model, dtype and KV pool in every arm, the pool sized to
    hold every request of the workload at once (so no arm preempts) plus the warm-up."""
    max_model_len = shape.max_tokens_per_request + BLOCK_SIZE
    num_blocks = sum(
        -(-(len(request.prompt_token_ids) + request.max_tokens) // BLOCK_SIZE)
        for request in requests
    )
    num_blocks += 2 * max_model_len // BLOCK_SIZE + 2  # the warm-up, the null block
    flags = ["--device", "cpu", "--dtype", dtype, "--block-size", str(BLOCK_SIZE),
             "--max-model-len", str(max_model_len),
             "--num-gpu-blocks-override", str(num_blocks)]  # fmt: skip
    if args.model is not None:
        flags += ["--model", args.model]
    return flags + shlex.split(args.server_args)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shape = args.shape
    from core_engine.frontend.text.tokenizer import load_tokenizer

    encode = load_tokenizer(resolve_model_path(args.model)).encode
    requests = build_workload(shape, encode, args.seed)
    warm_up = warm_up_prompt(shape, encode)
    dtype = args.dtype or engine_default_dtype("cpu")
    flags = engine_flags(args, shape, requests, dtype)
    machine = machine_info()
    rows = [measure_arm(arm, flags, args.cpus, requests, warm_up) for arm in args.arms]
    compare_texts(rows)
    add_ratios(rows)
    result = {
        "benchmark": "pd_disaggregation",
        "quick": args.quick,
        "machine": machine,
        "dtype": dtype,
        "engine_flags": flags,
        "cpus": args.cpus,
        "seed": args.seed,
        "workload": {field: getattr(shape, field) for field in shape.__slots__},
        "num_prompt_tokens": sum(len(request.prompt_token_ids) for request in requests),
        "rows": rows,
        "total_errors": sum(row["num_errors"] + row["num_wrong_length"] for row in rows),
        "total_text_mismatches": sum(len(row["text_mismatches"]) for row in rows),
    }
    output_dir = args.output_dir or device_results_dir("cpu")
    name = result_name("pd_disaggregation", args.quick)
    print(write_results(result, render_markdown(result), output_dir, name))
    print(
        f"errors: {result['total_errors']} (must be 0); greedy text mismatches against one "
        f"instance: {result['total_text_mismatches']}"
    )
    return 1 if result["total_errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
