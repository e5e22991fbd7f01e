"""Where serving time goes: the same burst offline and under `vllm bench serve`, step by step.

    python -m benchmarks.serving.profile [--label NAME] [--env KEY=VALUE ...] [--quick]

Runs vLLM's client's saturation burst (64 prompts of 128 random token ids, 64 tokens each,
all at once) twice through the engine: offline (`LLM.generate` on 64 prompts of the same
shape, sampled at temperature 1 as the client's requests are: `vllm bench serve` sends no
temperature) and served (`core-serve` under `vllm bench serve`). Both engines write a step trace
(CORE_ENGINE_STEP_TRACE: when each step went to the worker and when its answer came), and
/proc is read before and after each run for every process and thread of the engine. Reports:
- CPU seconds and voluntary / involuntary context switches per process and per thread;
- steps: how many, their wall time (decode-only steps by batch size, prefill steps), the idle
  gap between one step's answer and the next step (the core's and the frontend's work), all
  offline beside served;
- the cores each process used during the decode-only steps (sampled every 0.5 s), which
  charges the client only for what it did while the engine decoded, not its start-up;
- the client's figures (output tok/s, TTFT, TPOT).
`--env` sets variables for both engines (an OpenMP wait policy, say), so settings can be
compared run against run. Results: benchmarks/results/serving_profile[_LABEL].{json,md}.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import msgspec

from benchmarks.harness import proc_stats
from benchmarks.harness.common import (
    RESULTS_DIR,
    core_serve,
    default_hf_folder,
    machine_info,
    markdown_table,
    random_token_prompts,
    write_results,
)
from benchmarks.peers.vllm import default_peer_python
from benchmarks.peers.vllm_bench_client import SATURATION, BurstWorkload, run_bench_serve, summary
from core_engine.core.step_trace import STEP_TRACE_ENV, StepRecord

QUICK = BurstWorkload("saturation", 16, 128, 16, float("inf"))


def tune_worker(root_pid: int, nice: int | None, pin: bool) -> None:
    """Experiments on the worker process under `root_pid`: every thread's nice value, and the
    two busiest threads (the OpenMP team) pinned to CPUs 0 and 1."""
    if nice is None and not pin:
        return
    workers = [pid for pid in proc_stats.process_tree(root_pid)
               if proc_stats.process_label(pid) == "worker"]  # fmt: skip
    for pid in workers:
        tids = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
        if nice is not None:
            for tid in tids:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        if pin:
            snapshot = proc_stats.snapshot([pid])
            busiest = sorted(snapshot.values(), key=lambda t: -t.cpu_s)[:2]
            for cpu, thread in enumerate(busiest):
                os.sched_setaffinity(thread.tid, {cpu})


def run_offline(
    workload: BurstWorkload,
    trace_path: Path,
    seed: int,
    nice: int | None = None,
    pin: bool = False,
) -> dict:
    """`LLM.generate` on random prompts of the workload's shape, traced and /proc-sampled."""
    from core_engine.frontend import LLM
    from core_engine.proto import SamplingParams

    prompts = random_token_prompts(random.Random(seed), workload.num_prompts, workload.input_len)
    # What vllm bench serve's requests get: no temperature is sent, so the server's default, 1.
    params = SamplingParams(temperature=1.0, max_tokens=workload.output_len, ignore_eos=True)
    os.environ[STEP_TRACE_ENV] = str(trace_path)
    try:
        with LLM(model=None, device="cpu", enable_prefix_caching=False) as llm:
            llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
            trace_path.write_text("")  # the warm-up's steps are not the workload's
            tune_worker(os.getpid(), nice, pin)
            before = proc_stats.snapshot(proc_stats.process_tree(os.getpid()))
            start = time.perf_counter()
            with proc_stats.CpuTimeline(os.getpid()) as timeline:
                llm.generate(prompts, params, use_tqdm=False)
            elapsed_s = time.perf_counter() - start
            after = proc_stats.snapshot(proc_stats.process_tree(os.getpid()))
    finally:
        del os.environ[STEP_TRACE_ENV]
    return {
        "elapsed_s": elapsed_s,
        "output_tok_s": workload.num_prompts * workload.output_len / elapsed_s,
        "threads": proc_stats.thread_deltas(before, after),
        "timeline": timeline,
    }


def run_served(
    workload: BurstWorkload,
    trace_path: Path,
    peer_python: str,
    work_dir: Path,
    seed: int,
    nice: int | None = None,
    pin: bool = False,
) -> dict:
    """core-serve under `vllm bench serve`, traced and /proc-sampled around the client."""
    import httpx

    tokenizer = default_hf_folder(None)
    os.environ[STEP_TRACE_ENV] = str(trace_path)
    try:
        with core_serve(["--device", "cpu", "--no-enable-prefix-caching"],
                        work_dir / "server.log") as url:  # fmt: skip
            model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
            warm_up = BurstWorkload("warm-up", 2, 16, 2, float("inf"))
            run_bench_serve(peer_python, url, model, tokenizer, warm_up, work_dir, seed)
            trace_path.write_text("")
            server_pid = _server_pid(url)
            tune_worker(server_pid, nice, pin)
            before = proc_stats.snapshot(proc_stats.process_tree(server_pid))
            client_before = resource.getrusage(resource.RUSAGE_CHILDREN)
            start = time.perf_counter()
            with proc_stats.CpuTimeline(os.getpid()) as timeline:
                result = run_bench_serve(
                    peer_python, url, model, tokenizer, workload, work_dir, seed
                )
            elapsed_s = time.perf_counter() - start
            client_after = resource.getrusage(resource.RUSAGE_CHILDREN)
            after = proc_stats.snapshot(proc_stats.process_tree(server_pid))
    finally:
        del os.environ[STEP_TRACE_ENV]
    return {
        "elapsed_s": elapsed_s,
        "client": summary(result),
        # The client is a finished child by then: its CPU time and switches, as rusage has them.
        "client_process": {
            "cpu_s": (client_after.ru_utime + client_after.ru_stime)
            - (client_before.ru_utime + client_before.ru_stime),
            "voluntary": client_after.ru_nvcsw - client_before.ru_nvcsw,
            "involuntary": client_after.ru_nivcsw - client_before.ru_nivcsw,
        },
        "threads": proc_stats.thread_deltas(before, after),
        "timeline": timeline,
    }


def read_step_trace(path: str | os.PathLike) -> list[StepRecord]:
    """The records of a trace the engine core wrote (CORE_ENGINE_STEP_TRACE)."""
    decoder = msgspec.json.Decoder(StepRecord)
    with open(path, encoding="utf-8") as file:
        return [decoder.decode(line) for line in file if line.strip()]


def decode_window_cores(timeline: proc_stats.CpuTimeline, records: list[StepRecord]) -> dict:
    """Cores each process used while the engine ran its decode-only steps: from the first
    decode-only step after the last prefill to the end of the last step (the client's start-up
    and the burst's prompts are outside it)."""
    last_prefill = max(
        (i for i, r in enumerate(records) if r.num_decode_reqs != r.num_reqs), default=-1
    )
    decodes = records[last_prefill + 1 :]
    if len(decodes) < 2:
        return {}
    cores = timeline.cores_used(decodes[0].sent_s, decodes[-1].received_s)
    return {"window_s": decodes[-1].received_s - decodes[0].sent_s, "cores": cores}


def _server_pid(url: str) -> int:
    """The pid of the core-serve listening at `url` (the child of this process)."""
    port = url.rsplit(":", 1)[1]
    for pid in proc_stats.process_tree(os.getpid())[1:]:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"frontend.openai.cli" in cmdline and port.encode() in cmdline:
            return pid
    raise RuntimeError(f"no core-serve process listening on port {port}")


def step_stats(records: list[StepRecord]) -> dict:
    """Step counts and times of a trace: decode-only steps by batch size, prefill steps, and
    the gaps between steps."""
    decode_ms: dict[int, list[float]] = defaultdict(list)
    prefill_ms: list[float] = []
    for record in records:
        wall_ms = 1000 * (record.received_s - record.sent_s)
        if record.num_decode_reqs == record.num_reqs:
            decode_ms[record.num_reqs].append(wall_ms)
        else:
            prefill_ms.append(wall_ms)
    gaps_ms = [
        1000 * (later.sent_s - earlier.received_s)
        for earlier, later in zip(records, records[1:], strict=False)
    ]
    steps_s = sum(r.received_s - r.sent_s for r in records)
    span_s = records[-1].received_s - records[0].sent_s if records else 0.0
    return {
        "num_steps": len(records),
        "num_prefill_steps": len(prefill_ms),
        "prefill_step_ms_median": _median(prefill_ms),
        "prefill_step_ms_total": sum(prefill_ms),
        "decode_step_ms_median_by_batch": {
            batch: _median(times) for batch, times in sorted(decode_ms.items())
        },
        "decode_steps_by_batch": {batch: len(times) for batch, times in sorted(decode_ms.items())},
        "gap_ms_median": _median(gaps_ms),
        "gap_ms_p90": _quantile(gaps_ms, 0.9),
        "gap_ms_total": sum(gaps_ms),
        "steps_s": steps_s,
        "span_s": span_s,
    }


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 prompts, 16 tokens each")
    parser.add_argument("--label", default="", help="suffix of the result files")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="set for both engines (repeatable)")  # fmt: skip
    parser.add_argument("--peer-python", default=default_peer_python(),
                        help="the Python of the virtual environment with vLLM (its client)")  # fmt: skip
    parser.add_argument("--worker-nice", type=int, default=None,
                        help="experiment: this nice value for every worker thread")  # fmt: skip
    parser.add_argument("--pin-worker-threads", action="store_true",
                        help="experiment: the worker's two busiest threads on CPUs 0 and 1")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    settings = dict(item.split("=", 1) for item in args.env)
    os.environ.update(settings)
    workload = QUICK if args.quick else SATURATION
    with tempfile.TemporaryDirectory(prefix="serving-profile-") as folder:
        work_dir = Path(folder)
        tweaks = {"nice": args.worker_nice, "pin": args.pin_worker_threads}
        offline = run_offline(workload, work_dir / "offline.jsonl", args.seed, **tweaks)
        records = read_step_trace(work_dir / "offline.jsonl")
        offline["steps"] = step_stats(records)
        offline["decode_window"] = decode_window_cores(offline.pop("timeline"), records)
        served = run_served(
            workload, work_dir / "served.jsonl", args.peer_python, work_dir, args.seed, **tweaks
        )
        records = read_step_trace(work_dir / "served.jsonl")
        served["steps"] = step_stats(records)
        served["decode_window"] = decode_window_cores(served.pop("timeline"), records)
    result = {
        "benchmark": "serving_profile",
        "machine": machine_info(),
        "workload": workload.describe(),
        "env": settings,
        "worker_nice": args.worker_nice,
        "pin_worker_threads": args.pin_worker_threads,
        "offline": _jsonable(offline),
        "served": _jsonable(served),
    }
    name = "serving_profile" + (f"_{args.label}" if args.label else "")
    write_results(result, render_markdown(result), args.output_dir, name)


def _jsonable(run: dict) -> dict:
    threads = run.pop("threads")
    return {
        **run,
        "processes": proc_stats.per_process(threads),
        "threads": [
            {
                "process": t.process,
                "thread": t.thread,
                "cpu_s": round(t.cpu_s, 2),
                "voluntary": t.voluntary_switches,
                "involuntary": t.involuntary_switches,
            }
            for t in threads
            if t.cpu_s >= 0.05 or t.involuntary_switches >= 50
        ],  # fmt: skip
    }


def render_markdown(result: dict) -> str:
    offline, served = result["offline"], result["served"]
    lines = [
        f"# Serving profile: {result['workload']}",
        "",
        f"Environment set for both engines: {result['env'] or 'none'}; worker nice "
        f"{result['worker_nice']}, worker threads pinned: {result['pin_worker_threads']}.",
        "",
        f"Offline: {offline['elapsed_s']:.2f} s, {offline['output_tok_s']:.1f} output tok/s. "
        f"Served: {served['elapsed_s']:.2f} s for the client's run; client: "
        + ", ".join(f"{k} {v:.1f}" for k, v in served["client"].items() if isinstance(v, float))
        + f", completed {served['client']['completed']}, failed {served['client']['failed']}.",
        "",
        "## Steps",
        "",
    ]
    rows = []
    for key in ("num_steps", "num_prefill_steps", "prefill_step_ms_median", "prefill_step_ms_total",
                "gap_ms_median", "gap_ms_p90", "gap_ms_total", "steps_s", "span_s"):  # fmt: skip
        rows.append([key, _fmt(offline["steps"][key]), _fmt(served["steps"][key])])
    lines.append(markdown_table(["", "offline", "served"], rows))
    batches = sorted(
        set(offline["steps"]["decode_step_ms_median_by_batch"])
        | set(served["steps"]["decode_step_ms_median_by_batch"]),
        key=int,
    )
    rows = [
        [
            batch,
            _fmt(offline["steps"]["decode_step_ms_median_by_batch"].get(batch)),
            offline["steps"]["decode_steps_by_batch"].get(batch, 0),
            _fmt(served["steps"]["decode_step_ms_median_by_batch"].get(batch)),
            served["steps"]["decode_steps_by_batch"].get(batch, 0),
        ]
        for batch in batches
    ]
    lines += ["", "Decode-only steps, median ms by batch size:", ""]
    lines.append(markdown_table(["batch", "offline ms", "steps", "served ms", "steps"], rows))
    lines += ["", "Cores each process used during the decode-only steps after the last prefill "
              "(CPU seconds over wall seconds, sampled every 0.5 s):", ""]  # fmt: skip
    labels = sorted(
        set(offline["decode_window"].get("cores", {}))
        | set(served["decode_window"].get("cores", {}))
    )
    rows = [
        [label, _fmt(offline["decode_window"].get("cores", {}).get(label)),
         _fmt(served["decode_window"].get("cores", {}).get(label))]
        for label in labels
    ]  # fmt: skip
    rows.append(["window s", _fmt(offline["decode_window"].get("window_s")),
                 _fmt(served["decode_window"].get("window_s"))])  # fmt: skip
    lines.append(markdown_table(["process", "offline cores", "served cores"], rows))
    for label, run in (("offline", offline), ("served", served)):
        lines += ["", f"## CPU, {label}", ""]
        rows = [
            [name, f"{p['cpu_s']:.2f}", p["voluntary"], p["involuntary"], p["threads"]]
            for name, p in sorted(run["processes"].items(), key=lambda kv: -kv[1]["cpu_s"])
        ]
        if "client_process" in run:
            client = run["client_process"]
            rows.append(["vllm bench serve (the client)", f"{client['cpu_s']:.2f}",
                         client["voluntary"], client["involuntary"], "n/a"])  # fmt: skip
        lines.append(markdown_table(
            ["process", "CPU s", "voluntary switches", "involuntary switches", "threads"], rows
        ))  # fmt: skip
        rows = [[t["process"], t["thread"], t["cpu_s"], t["voluntary"], t["involuntary"]]
                for t in run["threads"][:12]]  # fmt: skip
        lines += ["", markdown_table(["process", "thread", "CPU s", "voluntary", "involuntary"],
                                     rows)]  # fmt: skip
    return "\n".join(lines) + "\n"


def _fmt(value) -> str:
    if value is None:
        return "n/a"
    return (
        f"{value:.2f}"
        if isinstance(value, float) and abs(value) < 10
        else (f"{value:.1f}" if isinstance(value, float) else str(value))
    )


if __name__ == "__main__":
    main()
