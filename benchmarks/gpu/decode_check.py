"""The decode step on a GPU: where its time goes, how it compares with plain torch at its best,
and nano-vllm's benchmark workload. Random weights of a real model's shape (no weights travel).

    python -m benchmarks.gpu.decode_check --model llama-3.2-1b [--device cuda] [--out FILE.json]

1. Breakdown: an engine in this process (the core's Scheduler driving a Worker, bf16) decodes
   B requests of 128-token prompts, B = 1, 64 and 256, in its default mode (on a GPU, decode
   steps replayed as CUDA graphs) and with `enforce_eager`. Per decode step (medians): the worker's batch update
   and input preparation on the host; the host time of the forward call (a graph's replay, or
   every kernel's launch); the forward's device time (CUDA events); sampling (LM head, sampler and
   the device-to-host copy of the ids): its device time, and its host time, which includes
   waiting for the forward to end; the worker's whole step; the engine core's time between two
   steps (scheduling, outputs); and the IPC the multi-process engine adds (the step's real
   messages encoded, sent through a socketpair and decoded, measured after the run).
2. Reference: the plain-torch decode forward of the shape (torch_decode_reference.py: static
   batch, contiguous KV, one CUDA graph) at batch 256, the engine's decode step beside it.
3. Batch 1: the bytes one decode step reads (weights once, the request's KV) over the worker's
   step time, as a share of the device-to-device copy bandwidth measured here and of the card's
   HBM figure.
4. nano-vllm's benchmark workload through `LLM.generate` (the engine's processes): 256
   sequences, prompt and output lengths uniform in 100..1024 drawn in the order its bench.py
   draws them (Python's `random`, seed 0), temperature 0.6, ignore_eos; output tok/s beside
   the A100 figures reported for vLLM and nano-vllm.

The `tiny` shape on the CPU runs every part but the reference (it needs CUDA graphs), smaller,
in seconds: the GPU kit's dry run. Writes the figures as JSON (`--out`).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.gpu.engine_check import (
    MODEL_SHAPES,
    check_parser,
    cuda_missing,
    random_prompts,
    write_random_model,
)
from benchmarks.gpu.torch_decode_reference import DecodeShape, TorchDecodeReference
from benchmarks.harness.message_round_trip import MessageRoundTrip
from core_engine.core.in_process_engine import InProcessEngine
from core_engine.proto import ModelRunnerOutput, SamplingParams, SchedulerOutput
from core_engine.proto.engine_config import EngineConfig
from core_engine.worker.local_executor import LocalExecutor
from core_engine.worker.model_executor.cpu_linear import model_weight_bytes

# Output tok/s reported for nano-vllm's benchmark on one A100 40GB (the README of a public
# nano-vllm fork): the figures this check's are set beside.
NANO_VLLM_A100_REPORTED = {
    "qwen3-0.6b": {"vllm": 7484, "nano-vllm": 8961},
    "llama-3.2-1b": {"vllm": 11113, "nano-vllm": 14297},
}
# The targets: nano-vllm's workload (output tok/s), the decode step at the largest batch
# over the plain-torch graph's, and batch 1's share of the HBM bandwidth.
NANO_VLLM_TARGET_TOK_S = {"qwen3-0.6b": 18000, "llama-3.2-1b": 28600}
MAX_OVER_REFERENCE = 1.25
MIN_SHARE_OF_HBM = 0.6
# HBM bandwidth on the cards' data sheets (bytes/s), by a name fragment of the device.
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12, "A100": 1.555e12}
BLOCK_SIZE = 16


@dataclasses.dataclass(frozen=True, slots=True)
class DecodePlan:
    """The sizes of one run (smaller for the `tiny` dry run)."""

    batch_sizes: tuple[int, ...]
    prompt_len: int
    warm_steps: int  # decode steps dropped before measuring
    measured_steps: int
    nano_num_seqs: int
    nano_max_len: int  # prompt and output lengths uniform in [nano_min_len, nano_max_len]
    nano_min_len: int
    nano_batched_tokens: int  # nano-vllm's default step budget

    @property
    def max_tokens(self) -> int:
        return 1 + self.warm_steps + self.measured_steps

    @property
    def max_model_len(self) -> int:
        return max(self.prompt_len + self.max_tokens, 2 * self.nano_max_len)


FULL_PLAN = DecodePlan((1, 64, 256), 128, 4, 32, 256, 1024, 100, 16384)
TINY_PLAN = DecodePlan((1, 4, 8), 16, 2, 6, 8, 40, 10, 256)


@dataclasses.dataclass(slots=True)
class StepRecord:
    """One step of the worker, timed from outside (host seconds, device events)."""

    num_reqs: int
    is_decode: bool
    start_s: float = 0.0
    end_s: float = 0.0
    prepare_s: float = 0.0
    forward_host_s: float = 0.0
    sample_host_s: float = 0.0
    events: tuple = ()  # (before forward, after forward, after sampling) on CUDA


class StepProbe:
    """Times a `LocalExecutor`'s worker steps by wrapping its runner's passes (benchmark-side
    wrappers: the engine has no hooks). Keeps the last decode step's messages for the IPC."""

    def __init__(self, executor: LocalExecutor) -> None:
        self.executor = executor
        self.runner = executor.worker.model_runner
        self.cuda = self.runner.device.type == "cuda"
        self.records: list[StepRecord] = []
        self.current: StepRecord | None = None
        self.last_messages: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
        self._wrap_executor()
        for name, field in (
            ("_update_states", "prepare_s"),
            ("_prepare_inputs", "prepare_s"),
            ("_forward", "forward_host_s"),
            ("_sample", "sample_host_s"),
        ):
            setattr(self.runner, name, self._timed(getattr(self.runner, name), field))

    def _wrap_executor(self) -> None:
        execute = self.executor.execute_model

        def timed_execute(scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
            counts = list(scheduler_output.num_scheduled_tokens.values())
            self.current = StepRecord(len(counts), bool(counts) and max(counts) == 1)
            self.current.start_s = time.perf_counter()
            output = execute(scheduler_output)
            self.current.end_s = time.perf_counter()
            self.records.append(self.current)
            if self.current.is_decode:
                self.last_messages = (scheduler_output, output)
            return output

        self.executor.execute_model = timed_execute

    def _timed(self, method: Callable, field: str) -> Callable:
        def timed(*args, **kwargs):
            record = self.current
            if self.cuda and field == "forward_host_s":
                record.events = (_record_event(),)
            start = time.perf_counter()
            result = method(*args, **kwargs)
            setattr(record, field, getattr(record, field) + time.perf_counter() - start)
            if self.cuda and field in ("forward_host_s", "sample_host_s"):
                record.events = (*record.events, _record_event())
            return result

        return timed

    def take(self) -> list[StepRecord]:
        records, self.records = self.records, []
        return records


def _record_event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def summarize_steps(records: list[StepRecord], batch_size: int, plan: DecodePlan) -> dict:
    """Medians (ms) over the measured decode steps of `batch_size` requests."""
    steps = [
        (index, r) for index, r in enumerate(records) if r.is_decode and r.num_reqs == batch_size
    ][plan.warm_steps :]
    if not steps:
        raise RuntimeError(f"no decode step of {batch_size} requests was recorded")
    next_start = {i: records[i + 1].start_s for i, _ in steps if i + 1 < len(records)}

    def median_ms(values) -> float:
        return 1000 * statistics.median(values)

    parts = {
        "host_prepare_ms": median_ms(r.prepare_s for _, r in steps),
        "forward_host_ms": median_ms(r.forward_host_s for _, r in steps),
        "sample_host_ms": median_ms(r.sample_host_s for _, r in steps),
        "worker_step_ms": median_ms(r.end_s - r.start_s for _, r in steps),
        "core_between_steps_ms": median_ms(
            next_start[i] - r.end_s for i, r in steps if i in next_start
        )
        if next_start
        else None,
        "num_steps": len(steps),
    }
    if steps[0][1].events:
        torch.cuda.synchronize()
        parts["forward_device_ms"] = statistics.median(
            r.events[0].elapsed_time(r.events[1]) for _, r in steps
        )
        parts["sample_device_ms"] = statistics.median(
            r.events[1].elapsed_time(r.events[2]) for _, r in steps
        )
        busy = parts["forward_device_ms"] + parts["sample_device_ms"]
        parts["device_busy_share"] = busy / parts["worker_step_ms"]
    return parts


def ipc_round_trip_ms(messages: tuple[SchedulerOutput, ModelRunnerOutput], repeats: int = 50):
    """Median ms of one step's two messages through the link (encode, socketpair, decode)."""
    round_trip = MessageRoundTrip()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for message in messages:
            round_trip(message)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def step_breakdown(folder: Path, shape: dict, device: str, plan: DecodePlan) -> dict:
    """Per mode (graphs, eager) and batch size, the step's parts (see the module doc)."""
    result: dict = {}
    for mode, enforce_eager in (("default", False), ("enforce_eager", True)):
        config = EngineConfig(
            model=str(folder),
            device=device,
            max_model_len=plan.max_model_len,
            max_num_seqs=max(plan.batch_sizes),
            cuda_graph_sizes=list(plan.batch_sizes),
            enforce_eager=enforce_eager,
            enable_prefix_caching=False,
            block_size=BLOCK_SIZE,
            num_gpu_blocks_override=_blocks_for(plan),
        )
        executor = LocalExecutor(config)
        engine = InProcessEngine(config, executor)
        probe = StepProbe(executor)
        result[mode] = {}
        for batch_size in plan.batch_sizes:
            prompts = random_prompts(
                [plan.prompt_len] * batch_size, shape["vocab_size"], seed=batch_size
            )
            params = SamplingParams(temperature=0.0, max_tokens=plan.max_tokens, ignore_eos=True)
            engine.generate(prompts, params)
            figures = summarize_steps(probe.take(), batch_size, plan)
            figures["ipc_ms"] = ipc_round_trip_ms(probe.last_messages)
            result[mode][str(batch_size)] = figures
            print(f"{mode} batch {batch_size}: {figures}", flush=True)
        if mode == "default":
            result["weight_bytes"] = model_weight_bytes(executor.worker.model)
            result["dtype"] = str(executor.worker.dtype).removeprefix("torch.")
        del engine, executor, probe
        _release(device)
    return result


def _blocks_for(plan: DecodePlan) -> int:
    """KV blocks for the largest batch's requests, twice over (no memory profiling)."""
    per_request = -(-(plan.prompt_len + plan.max_tokens) // BLOCK_SIZE)
    return 2 + max(plan.batch_sizes) * per_request * 2


def _release(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def reference_step(shape: dict, plan: DecodePlan, batch_size: int) -> dict:
    """The plain-torch CUDA-graph decode step at `batch_size`, positions as the engine's."""
    max_len = plan.prompt_len + plan.max_tokens + 1
    reference = TorchDecodeReference(
        DecodeShape.from_config(shape), batch_size, max_len, torch.device("cuda")
    )
    reference.capture()
    ms = reference.replay_ms(plan.measured_steps, first_position=plan.prompt_len)
    del reference
    _release("cuda")
    return {"batch_size": batch_size, "max_len": max_len, "step_ms": ms}


def copy_bandwidth_bytes_per_s(num_bytes: int = 1 << 30, repeats: int = 10) -> float:
    """Device-to-device copy: bytes read plus bytes written per second."""
    source = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    target.copy_(source)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        target.copy_(source)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1000 / repeats
    del source, target
    _release("cuda")
    return 2 * num_bytes / seconds


def batch_one_bandwidth(shape: dict, plan: DecodePlan, breakdown: dict, device: str) -> dict:
    """Bytes one batch-1 decode step reads over its worker step time (graphs)."""
    head_dim = shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"]
    mean_context = plan.prompt_len + plan.warm_steps + plan.measured_steps / 2
    bytes_per_element = 2  # bf16
    kv_bytes = (
        shape["num_hidden_layers"] * 2 * shape["num_key_value_heads"] * head_dim * mean_context
    ) * bytes_per_element
    step_ms = breakdown["default"][str(min(plan.batch_sizes))]["worker_step_ms"]
    read_bytes = breakdown["weight_bytes"] + kv_bytes
    figures = {
        "weight_bytes": breakdown["weight_bytes"],
        "kv_bytes": kv_bytes,
        "worker_step_ms": step_ms,
        "bytes_per_s": read_bytes / (step_ms / 1000),
    }
    if device == "cuda":
        figures["copy_bytes_per_s"] = copy_bandwidth_bytes_per_s()
        figures["share_of_copy"] = figures["bytes_per_s"] / figures["copy_bytes_per_s"]
        name = torch.cuda.get_device_name()
        spec = next((bw for key, bw in HBM_BYTES_PER_S.items() if key in name), None)
        if spec is not None:
            figures["hbm_bytes_per_s"] = spec
            figures["share_of_hbm"] = figures["bytes_per_s"] / spec
            figures["target_min_share"] = MIN_SHARE_OF_HBM
    return figures


def nano_vllm_workload(plan: DecodePlan, vocab_size: int) -> tuple[list, list]:
    """Prompts and sampling parameters drawn as nano-vllm's bench.py draws them: prompts first
    (ids below 10,000, or the vocabulary), then each sequence's max_tokens, from `random` with
    seed 0."""
    rng = random.Random(0)
    max_id = min(10000, vocab_size - 1)
    prompts = [
        [rng.randint(0, max_id) for _ in range(rng.randint(plan.nano_min_len, plan.nano_max_len))]
        for _ in range(plan.nano_num_seqs)
    ]
    params = [
        SamplingParams(
            temperature=0.6,
            ignore_eos=True,
            max_tokens=rng.randint(plan.nano_min_len, plan.nano_max_len),
        )
        for _ in range(plan.nano_num_seqs)
    ]
    return prompts, params


def nano_vllm_throughput(folder: Path, model: str, shape: dict, device: str, plan: DecodePlan):
    """Output tok/s of nano-vllm's workload through the engine's processes (`LLM`)."""
    from core_engine.frontend import LLM

    prompts, params = nano_vllm_workload(plan, shape["vocab_size"])
    with LLM(
        model=str(folder),
        device=device,
        max_model_len=plan.max_model_len,
        max_num_seqs=plan.nano_num_seqs,
        max_num_batched_tokens=plan.nano_batched_tokens,
    ) as llm:
        warm_up = SamplingParams(temperature=0.6, max_tokens=16, ignore_eos=True)
        llm.generate(prompts[:4], warm_up, use_tqdm=False)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed_s = time.perf_counter() - start
    num_output = sum(len(output.outputs[0].token_ids) for output in outputs)
    expected = sum(p.max_tokens for p in params)
    if num_output != expected:
        raise RuntimeError(f"the engine returned {num_output} tokens, asked {expected}")
    return {
        "num_seqs": plan.nano_num_seqs,
        "lengths": [plan.nano_min_len, plan.nano_max_len],
        "max_num_batched_tokens": plan.nano_batched_tokens,
        "num_prompt_tokens": sum(map(len, prompts)),
        "num_output_tokens": num_output,
        "elapsed_s": elapsed_s,
        "output_tok_s": num_output / elapsed_s,
        "a100_reported": NANO_VLLM_A100_REPORTED.get(model),
        "target_tok_s": NANO_VLLM_TARGET_TOK_S.get(model),
    }


def main(argv: list[str] | None = None) -> int:
    args = check_parser(__doc__, "llama-3.2-1b").parse_args(argv)
    if cuda_missing(args.device):
        return 2
    shape = MODEL_SHAPES[args.model]
    plan = TINY_PLAN if args.model == "tiny" else FULL_PLAN
    result: dict = {"model": args.model, "device": args.device, "plan": dataclasses.asdict(plan)}
    with tempfile.TemporaryDirectory(prefix=f"random-{args.model}-") as tmp:
        folder = write_random_model(Path(tmp), shape, torch.device(args.device))
        result["breakdown"] = step_breakdown(folder, shape, args.device, plan)
        _write(args.out, result)
        result["batch_one"] = batch_one_bandwidth(shape, plan, result["breakdown"], args.device)
        print(f"batch 1: {result['batch_one']}", flush=True)
        if args.device == "cuda":
            largest = max(plan.batch_sizes)
            result["reference"] = reference_step(shape, plan, largest)
            engine_ms = result["breakdown"]["default"][str(largest)]["worker_step_ms"]
            reference = result["reference"]
            reference["engine_over_reference"] = engine_ms / reference["step_ms"]
            reference["target_max_ratio"] = MAX_OVER_REFERENCE
            print(f"reference: {result['reference']}", flush=True)
        _write(args.out, result)
        result["nano_vllm"] = nano_vllm_throughput(folder, args.model, shape, args.device, plan)
        print(f"nano-vllm workload: {result['nano_vllm']}", flush=True)
    _write(args.out, result)
    return 0


def _write(path: Path | None, result: dict) -> None:
    if path is not None:
        path.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
