"""Where a step's time goes on the CPU worker: linears, attention, norms and rotary, SiLU-and-mul,
LM head, sampling, host-side preparation, the scheduler, and the IPC of the step's messages.

Runs the offline benchmark's mixed workload (48 prompts, greedy, ignore_eos) in one process, the
core `Scheduler` driving a `Worker` as `scripts/generate.py` does, with a timer around each
part. Steps are split into decode steps (every scheduled request runs one token) and prefill
steps (at least one request runs a prompt chunk); each kind gets milliseconds per step and the
share of each part. Timers nest: a part's time excludes the timed parts inside it, and
"forward, untimed" is what remains of the model call (residual adds, reshapes, Python).
Where the float32 kernel fuses a SiLU MLP's gate_up matmul with SiLU-and-mul, that call is its
own part ("gate_up + SiLU-and-mul, fused") and the SiLU-and-mul and gate_up shares of the
other two parts are zero. Steps whose decoder layers run in one C call (cpu_decoder.py) get
the same parts from the C driver's own clock; `--python-layers` runs them from Python instead.
IPC is what the multi-process engine adds per step, measured here on the step's real messages:
encoding the `SchedulerOutput` and `ModelRunnerOutput`, one trip each through a socketpair
(`MessagePipe`), decoding.

    python -m benchmarks.micro.profile_step [--dtype float32|bfloat16] [--threads N] [--quick]
    python -m benchmarks.micro.profile_step --workload decode --num-prompts 1   # one user
    python -m benchmarks.micro.profile_step --quantization gguf   # a GGUF file's blocks as shipped
    python -m benchmarks.micro.profile_step --python-layers       # no one-call C decoder
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch

from benchmarks.harness.common import (
    RESULTS_DIR,
    machine_info,
    markdown_table,
    result_name,
    write_results,
)
from benchmarks.harness.message_round_trip import MessageRoundTrip
from benchmarks.offline.bench import FULL_SHAPE, QUICK_SHAPE, WORKLOAD_NAMES, build_workloads
from core_engine.common.model_files import resolve_model_path
from core_engine.core.engine_core import start_engine_core
from core_engine.core.request import Request
from core_engine.core.sched.scheduler import Scheduler
from core_engine.frontend.text.tokenizer import load_tokenizer
from core_engine.kernels.cpu import decode_layers as c_decode
from core_engine.proto import (
    ModelRunnerOutput,
    SamplingParams,
    SchedulerOutput,
)
from core_engine.proto.engine_config import QUANTIZATIONS, EngineConfig
from core_engine.worker import model_runner
from core_engine.worker.host_allocator import keep_freed_memory
from core_engine.worker.local_executor import LocalExecutor
from core_engine.worker.model_executor import layers
from core_engine.worker.model_executor.cpu_decoder import CpuDecoderStack
from core_engine.worker.model_executor.models import llama
from core_engine.worker.sample import sampler

LINEARS = "linears (qkv, o, gate_up, down)"
ATTENTION = "attention (KV write + paged attention)"
NORMS = "norms and rotary"
SILU = "SiLU-and-mul"
FUSED_GATE_UP = "gate_up + SiLU-and-mul, fused in one kernel"
EMBEDDING = "embedding"
LM_HEAD = "LM head"
SAMPLING = "sampling"
FORWARD = "forward, untimed (residual adds, reshapes, Python)"
HOST = "host-side preparation (batch update, metadata)"
SCHEDULER = "scheduler (schedule + update_from_output)"
IPC = "IPC (encode, socketpair, decode)"
PARTS = (
    LINEARS,
    ATTENTION,
    NORMS,
    SILU,
    FUSED_GATE_UP,
    EMBEDDING,
    LM_HEAD,
    SAMPLING,
    FORWARD,
    HOST,
    SCHEDULER,
    IPC,
)


class PartTimer:
    """Accumulates self time per part for the current step; nested parts are subtracted."""

    def __init__(self) -> None:
        self.step: dict[str, float] = defaultdict(float)
        self._child_time: list[float] = []

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        self._child_time.append(0.0)
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            children = self._child_time.pop()
            self.step[name] += elapsed - children
            if self._child_time:
                self._child_time[-1] += elapsed

    def wrap(self, owner: object, attribute: str, name: str, when=None) -> None:
        """Replaces `owner.attribute` (a function or method) with a timed version; with `when`,
        only the calls for which `when(*args)` holds are timed (the others count to whatever
        part encloses them)."""
        original = getattr(owner, attribute)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            if when is not None and not when(*args):
                return original(*args, **kwargs)
            with self.part(name):
                return original(*args, **kwargs)

        setattr(owner, attribute, timed)

    def add_child(self, name: str, seconds: float) -> None:
        """Adds `seconds` timed elsewhere (inside a C call) to part `name`, inside the part
        now open."""
        self.step[name] += seconds
        if self._child_time:
            self._child_time[-1] += seconds

    def take_step(self) -> dict[str, float]:
        step, self.step = self.step, defaultdict(float)
        return step


def instrument(timer: PartTimer) -> None:
    """Puts a timer around every part of the worker's step (patches classes of this process)."""
    for cls in (layers.ColumnParallelLinear, layers.RowParallelLinear):
        timer.wrap(cls, "forward", LINEARS)
    timer.wrap(llama, "write_kv_and_attend", ATTENTION)
    for owner, attribute in (
        (layers.RMSNorm, "forward"),
        (layers.RotaryEmbedding, "forward"),
        (llama, "apply_rotary_qk"),
    ):
        timer.wrap(owner, attribute, NORMS)
    # The module function: SiluAndMul and a gate_up projection that cannot fuse both call it;
    # the projection's own method is the fused kernel only where its weight fuses (elsewhere
    # it runs a timed linear, then the module function).
    timer.wrap(layers, "silu_and_mul", SILU)
    timer.wrap(
        layers.MergedColumnParallelLinear,
        "silu_and_mul",
        FUSED_GATE_UP,
        when=lambda projection, *_: projection.fuses_silu_and_mul,
    )
    timer.wrap(layers.VocabParallelEmbedding, "forward", EMBEDDING)
    timer.wrap(layers.ParallelLMHead, "compute_logits", LM_HEAD)
    timer.wrap(sampler.Sampler, "__call__", SAMPLING)
    timer.wrap(model_runner.ModelRunner, "execute_model", FORWARD)
    for attribute in ("schedule", "update_from_output"):
        timer.wrap(Scheduler, attribute, SCHEDULER)
    for attribute in ("_update_states", "_prepare_inputs"):
        timer.wrap(model_runner.ModelRunner, attribute, HOST)
    time_c_decoder_parts(timer)


def time_c_decoder_parts(timer: PartTimer) -> None:
    """The decoder layers run in one C call on the steps it takes (cpu_decoder.py): the C
    driver times its parts itself, and they count to the same parts as the Python layers'."""
    names = (LINEARS, ATTENTION, NORMS, SILU, FUSED_GATE_UP, EMBEDDING)  # decode_layers.c's
    assert len(names) == len(c_decode.PART_NAMES)
    original = CpuDecoderStack.run

    @functools.wraps(original)
    def run(stack, *args, **kwargs):
        seconds = (ctypes.c_double * len(names))()
        stack.part_seconds = seconds
        try:
            return original(stack, *args, **kwargs)
        finally:
            stack.part_seconds = None
            for name, part_seconds in zip(names, seconds, strict=True):
                timer.add_child(name, part_seconds)

    CpuDecoderStack.run = run


class ProfiledExecutor:
    """A local executor whose steps also pay what the worker process's link costs: the
    `SchedulerOutput` and `ModelRunnerOutput` encoded, sent through a socketpair and decoded."""

    def __init__(self, executor: LocalExecutor, timer: PartTimer) -> None:
        self.executor = executor
        self.timer = timer
        self.ipc = MessageRoundTrip()
        self.last_scheduler_output: SchedulerOutput | None = None

    def wait_until_ready(self):
        return self.executor.wait_until_ready()

    def initialize_cache(self, num_gpu_blocks: int) -> None:
        self.executor.initialize_cache(num_gpu_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.last_scheduler_output = scheduler_output
        with self.timer.part(IPC):
            self.ipc(scheduler_output)
        output = self.executor.execute_model(scheduler_output)
        with self.timer.part(IPC):
            self.ipc(output)
        return output


def run_profiled(
    config: EngineConfig, executor: ProfiledExecutor, requests: list[Request], timer: PartTimer
) -> list[dict]:
    """Starts a fresh engine core over `executor` and steps the workload to the end with
    `EngineCore.step`; one record per step: kind, tokens, seconds per part."""
    engine_core, _ = start_engine_core(config, executor)
    for request in requests:
        engine_core.scheduler.add_request(request)
    timer.take_step()  # start-up is not a step
    steps = []
    while True:
        start = time.perf_counter()
        if engine_core.step() is None:
            return steps
        scheduler_output = executor.last_scheduler_output
        counts = scheduler_output.num_scheduled_tokens.values()
        steps.append(
            {
                "kind": "decode" if max(counts, default=0) <= 1 else "prefill",
                "num_tokens": scheduler_output.total_num_scheduled_tokens,
                "num_requests": len(scheduler_output.num_scheduled_tokens),
                "seconds": time.perf_counter() - start,
                "parts": dict(timer.take_step()),
            }
        )


def summarize(steps: list[dict], kind: str) -> dict:
    """Mean milliseconds per step of each part over the steps of one kind, and their shares."""
    chosen = [step for step in steps if step["kind"] == kind]
    if not chosen:
        return {"num_steps": 0}
    total_s = sum(step["seconds"] for step in chosen)
    parts = {name: sum(step["parts"].get(name, 0.0) for step in chosen) for name in PARTS}
    parts["other (loop, untimed)"] = total_s - sum(parts.values())
    return {
        "num_steps": len(chosen),
        "mean_tokens_per_step": sum(step["num_tokens"] for step in chosen) / len(chosen),
        "mean_requests_per_step": sum(step["num_requests"] for step in chosen) / len(chosen),
        "ms_per_step": 1000 * total_s / len(chosen),
        "total_s": total_s,
        "parts_ms_per_step": {name: 1000 * s / len(chosen) for name, s in parts.items()},
        "parts_share": {name: s / total_s for name, s in parts.items()},
    }


def render_markdown(result: dict) -> str:
    kinds = result["summary"]
    names = list(next(iter(s for s in kinds.values() if s["num_steps"]))["parts_ms_per_step"])
    header = ["part"]
    for kind, summary in kinds.items():
        if summary["num_steps"]:
            header += [f"{kind} ms/step", f"{kind} share"]
    rows = []
    for name in names:
        row = [name]
        for summary in kinds.values():
            if summary["num_steps"]:
                row += [
                    f"{summary['parts_ms_per_step'][name]:.2f}",
                    f"{100 * summary['parts_share'][name]:.1f}%",
                ]
        rows.append(row)
    totals = ["**step**"]
    for summary in kinds.values():
        if summary["num_steps"]:
            totals += [f"**{summary['ms_per_step']:.2f}**", "100%"]
    rows.append(totals)
    lines = [
        f"### Step breakdown, CPU worker ({result['dtype']}"
        f"{', weights as GGUF blocks' if result.get('quantization') else ''}"
        f"{', decode layers in one C call' if result.get('layers_in_c') else ''}, "
        f"{result['threads']} threads, "
        f"{result['workload']})",
        "",
        markdown_table(header, rows),
        "",
    ]
    for kind, summary in kinds.items():
        if summary["num_steps"]:
            lines.append(
                f"- {kind}: {summary['num_steps']} steps, {summary['mean_requests_per_step']:.1f} "
                f"requests and {summary['mean_tokens_per_step']:.1f} tokens per step on average."
            )
    lines += [
        f"- Whole workload: {result['output_tokens']} output tokens in {result['elapsed_s']:.2f} s "
        f"= {result['output_tokens_per_s']:.1f} tok/s (timers included).",
        "",
        "Parts are self times (a nested timed part is not counted twice). IPC: the step's "
        "`SchedulerOutput` and `ModelRunnerOutput` encoded, sent through a socketpair and "
        "decoded, without the cross-process wake-up (see `ipc.md` for round trips).",
    ]
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default=None, help="default: the engine's default on cpu")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (0: the worker's default)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="a small workload")
    parser.add_argument("--model", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workload", default="mixed", choices=WORKLOAD_NAMES,
                        help="one of bench_offline's workloads (burst: vLLM's saturation burst)")  # fmt: skip
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="prompts of the workload (default: its own; 1: batch-1 decode steps, "
                        "one user)")  # fmt: skip
    parser.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                        help="gguf: the GGUF file's quantized weights as shipped")  # fmt: skip
    parser.add_argument("--python-layers", action="store_true",
                        help="run every step's decoder layers from Python (no one-call C "
                        "decoder), for comparison")  # fmt: skip
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--name", default="profile_step", help="results file name")
    return parser.parse_args()


def make_requests(workload, block_size: int) -> list[Request]:
    return [
        Request(
            str(i),
            list(prompt),
            SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            eos_token_id=None,
            block_size=block_size,
        )
        for i, (prompt, max_tokens) in enumerate(
            zip(workload.prompt_token_ids, workload.max_tokens, strict=True)
        )
    ]


def main() -> None:
    args = parse_args()
    machine = machine_info()
    keep_freed_memory()  # the worker process's allocator settings (worker/__main__.py)
    config = EngineConfig(
        model=args.model,
        device="cpu",
        dtype=args.dtype,
        quantization=args.quantization,
        max_num_seqs=256,
    )
    executor = LocalExecutor(config)
    worker = executor.worker
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    decoder = getattr(worker.model, "model", None)
    if args.python_layers and decoder is not None and hasattr(decoder, "cpu_decoder"):
        decoder.cpu_decoder = None
    tokenizer = load_tokenizer(resolve_model_path(args.model))
    shape = QUICK_SHAPE if args.quick else FULL_SHAPE
    (workload,) = build_workloads(
        shape, tokenizer.encode, args.seed, [args.workload], args.num_prompts
    )
    timer = PartTimer()
    instrument(timer)
    profiled = ProfiledExecutor(executor, timer)
    for _ in range(2):  # the first run warms up allocations and kernel builds
        start = time.perf_counter()
        steps = run_profiled(config, profiled, make_requests(workload, worker.block_size), timer)
        elapsed_s = time.perf_counter() - start
    result = {
        "benchmark": "profile_step",
        "quick": args.quick,
        "machine": machine,
        "dtype": str(worker.dtype).removeprefix("torch."),
        "quantization": worker.quantization,  # as asked, or the worker's default for the file
        "layers_in_c": getattr(decoder, "cpu_decoder", None) is not None,
        "threads": torch.get_num_threads(),
        "workload": workload.description,
        "output_tokens": workload.num_output_tokens,
        "elapsed_s": elapsed_s,
        "output_tokens_per_s": workload.num_output_tokens / elapsed_s,
        "summary": {kind: summarize(steps, kind) for kind in ("decode", "prefill")},
    }
    write_results(
        result, render_markdown(result), args.output_dir, result_name(args.name, args.quick)
    )
    print(render_markdown(result))


if __name__ == "__main__":
    main()
