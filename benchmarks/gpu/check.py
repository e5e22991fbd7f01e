"""The whole GPU verification in one command, for a GPU that is lent for minutes.

    python -m benchmarks.gpu.check --out DIR [--budget-s 450]     # on the CUDA machine
    python -m benchmarks.gpu.check --out DIR --only decode,engine # some steps (name prefixes)
    python -m benchmarks.gpu.check --out DIR --dry-run            # anywhere: the plumbing
    python -m benchmarks.gpu.check --make-wheelhouse DIR          # here, before the GPU run

Steps, each run in its own process (a crash or a sticky CUDA error stays in its step), each
recorded with its outcome even when an earlier one failed, in this order:
1. `pytest -m gpu`: every kernel against the torch reference (decode on CUDA cores and tensor
   cores, prefill on both, reshape_and_cache, sliding windows, GQA groups, block sizes, dtypes,
   streams, graphs, the engine on a tiny model with decode CUDA graphs on and off);
2. the engine end to end on random weights of SmolLM2-135M and Llama-3.2-1B shapes made on the
   machine (benchmarks/gpu/engine_check.py): float32 greedy tokens of the CUDA kernels (decode
   steps as CUDA graphs) equal to the torch reference backend's and to the kernels' run with
   `--enforce-eager`; offline throughput at batch 256 with the defaults, with async scheduling
   (same tokens required) and eagerly;
3. the decode step on random weights of Llama-3.2-1B and Qwen3-0.6B shapes
   (benchmarks/gpu/decode_check.py): its breakdown at batch 1, 64 and 256 with graphs and
   eagerly (host preparation, launches, device time, sampling, the core's time, IPC), beside a
   plain-torch CUDA-graph forward of the shape at batch 256; batch 1's share of the HBM
   bandwidth; nano-vllm's benchmark workload in output tok/s beside the A100 figures reported
   for vLLM and nano-vllm;
4. `core-serve` on random weights of the Llama-3.2-1B shape (benchmarks/gpu/serve_check.py),
   driven over HTTP by the project's streaming client: one user, 64 at once and 256 at once;
5. `bench_attention --kit`: decode GB/s against the device-to-device copy bandwidth measured
   in the same run, tensor-core prefill against SDPA's flash kernel;
6. `compute-sanitizer` memcheck and racecheck over one small case of each kernel
   (benchmarks/gpu/sanitize_cases.py);
7. the report: gpu_report.md and gpu_report.json (GPU, driver, versions, every figure and
   target), gpu_check.log (every step's output) and pytest_gpu.xml, rewritten after every step
   so a run cut short still leaves what it measured. At most 8 files, none in a subfolder.

`--budget-s` bounds the whole run: each step gets the smaller of its own cap and what is left,
and a step that no longer fits is recorded as skipped. `--dry-run` runs the same plumbing on
tiny shapes: CUDA steps report "skipped: no CUDA", the GPU tests are only collected, and the
engine and decode checks run the tiny shape on the CPU (CI runs it, so the kit cannot rot between GPU
runs). Exits 1 when a step failed or timed out.

The CUDA machine has Python 3.12 with torch, CuPy, pytest and numpy but not msgspec, pyzmq or
core-serve's FastAPI, uvicorn, pydantic and httpx
(nor gguf, which the kit does not need: no GGUF file travels), and nothing can be installed
there from a registry: `--make-wheelhouse DIR` downloads exactly those wheels (the versions
installed here) for it. docs/kernels.md's GPU section gives the
device command.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
TESTS_DIR = REPO_ROOT / "tests"
DEFAULT_BUDGET_S = 450.0
# A step is not started with less than this left: it could not finish anything useful.
MIN_STEP_S = 20.0
ENGINE_MODELS = ("smollm2-135m", "llama-3.2-1b")
DECODE_MODELS = ("llama-3.2-1b", "qwen3-0.6b")
SERVE_MODELS = ("llama-3.2-1b",)
DRY_RUN_ENGINE_MODEL = "tiny"
# Third-party modules the GPU machine's image has (import names; its package list, 2026-11:
# Python 3.12, torch 2.11 + CUDA 13, cupy-cuda13x, ...), among those the kit's code may import.
GPU_MACHINE_HAS = frozenset({
    "torch", "cupy", "cupy_backends", "fastrlock", "numpy", "tokenizers", "safetensors",
    "jinja2", "markupsafe", "xxhash", "uvloop", "prometheus_client", "tqdm", "yaml",
    "requests", "urllib3", "certifi", "idna", "charset_normalizer", "typing_extensions",
    "transformers", "huggingface_hub", "filelock", "fsspec", "packaging", "regex", "sympy",
    "mpmath", "networkx", "triton", "pytest", "_pytest", "py", "pluggy", "iniconfig", "pygments",
    "pytest_timeout", "xdist", "execnet", "hypothesis", "sortedcontainers", "attr", "attrs",
})  # fmt: skip
# What it lacks of what the kit imports, as distributions (with their import names): the
# wheelhouse brings these.
# The first two the engine needs; the others core-serve (FastAPI on uvicorn) and its HTTP client
# (httpx), for the serve step.
GPU_MACHINE_LACKS = (
    "msgspec", "pyzmq",
    "fastapi", "starlette", "pydantic", "pydantic-core", "annotated-types", "annotated-doc",
    "typing-inspection", "opentelemetry-api", "anyio", "sniffio", "uvicorn", "click", "h11",
    "httpx", "httpcore",
)  # fmt: skip
GPU_MACHINE_LACKS_MODULES = frozenset({
    "msgspec", "zmq", "fastapi", "starlette", "pydantic", "pydantic_core", "annotated_types",
    "annotated_doc", "typing_inspection", "opentelemetry", "anyio", "sniffio", "uvicorn", "click",
    "h11", "httpx", "httpcore",
})  # fmt: skip
# Imported only where installed (FastAPI's orjson responses, httpx's command line, httpcore's
# trio support).
OPTIONAL_IMPORTS = frozenset({"orjson", "rich", "trio", "outcome"})
WHEEL_PYTHON = "3.12"
WHEEL_PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
WHEELHOUSE_LIMIT_BYTES = 40 << 20
REPORT_MD = "gpu_report.md"
REPORT_JSON = "gpu_report.json"
LOG_FILE = "gpu_check.log"
JUNIT_FILE = "pytest_gpu.xml"
# Processes for the GPU tests where pytest-xdist is installed (NVRTC compiles in parallel).
TEST_PROCESSES = 4
TEST_TIMEOUT_S = 120  # per GPU test: a hung kernel costs two minutes, not the whole budget


@dataclass(slots=True)
class StepResult:
    """One step's outcome: status is passed, failed, timed out or skipped."""

    name: str
    status: str
    summary: str
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)


@dataclass(slots=True)
class KitContext:
    """What every step needs: where to write, whether CUDA is here, the deadline."""

    out_dir: Path
    work_dir: Path
    dry_run: bool
    cuda: bool
    deadline: float
    log: list[str] = field(default_factory=list)

    def seconds_left(self) -> float:
        return self.deadline - time.monotonic()

    def cuda_skip_reason(self) -> str | None:
        """Why a CUDA step does not run here; None when it runs."""
        if not self.cuda:
            return "skipped: no CUDA"
        if self.dry_run:
            return "skipped: dry run"
        return None


@dataclass(slots=True)
class Step:
    name: str
    cap_s: float  # the most this step may take
    run: Callable[[KitContext, float], StepResult]  # (context, timeout_s)


@dataclass(slots=True)
class ProcessRun:
    returncode: int | None  # None: killed at its timeout
    output: str
    seconds: float

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def run_process(
    context: KitContext, title: str, command: list[str], timeout_s: float
) -> ProcessRun:
    """Runs `command` from the repository root with the repository importable, its output
    (stdout and stderr together) appended to the kit's log under `title`."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p
    )
    start = time.monotonic()
    try:
        completed = subprocess.run(
            command,
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            timeout=timeout_s,
            start_new_session=True,
        )
        returncode, output = completed.returncode, completed.stdout
    except subprocess.TimeoutExpired as expired:
        returncode = None
        output = _text(expired.stdout) + f"\n[killed after {timeout_s:.0f} s]\n"
    except OSError as error:  # the program is missing
        returncode, output = 127, f"{error}\n"
    seconds = time.monotonic() - start
    status = "timed out" if returncode is None else f"exit {returncode}"
    context.log.append(
        f"===== {title}: {' '.join(command)} ({status}, {seconds:.1f} s)\n{output.rstrip()}\n"
    )
    return ProcessRun(returncode, output, seconds)


def _text(output: bytes | str | None) -> str:
    if output is None:
        return ""
    return output if isinstance(output, str) else output.decode(errors="replace")


# ---- step 1: the GPU tests --------------------------------------------------------------------


def gpu_test_files() -> list[str]:
    """Test files that hold gpu-marked tests (only these are collected: the others import
    packages the GPU machine does not have)."""
    return sorted(
        str(path.relative_to(REPO_ROOT))
        for path in TESTS_DIR.rglob("test_*.py")
        if "mark.gpu" in path.read_text()
    )


def run_gpu_tests(context: KitContext, timeout_s: float) -> StepResult:
    files = gpu_test_files()
    base = [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", *files]
    skip_reason = context.cuda_skip_reason()
    if skip_reason:
        run = run_process(context, "gpu tests (collect only)", [*base, "--collect-only", "-q"],
                          timeout_s)  # fmt: skip
        collected = _collected_count(run.output)
        if run.returncode != 0 or not collected:
            return StepResult("gpu tests", "failed", f"collection failed ({len(files)} files)")
        return StepResult(
            "gpu tests", "skipped", f"{skip_reason} ({collected} gpu tests collected)",
            run.seconds, {"collected": collected, "files": files},
        )  # fmt: skip
    junit = context.out_dir / JUNIT_FILE
    command = [*base, "-q", "-rfE", f"--timeout={TEST_TIMEOUT_S}", f"--junitxml={junit}"]
    if _has_module("xdist"):
        command += ["-n", str(TEST_PROCESSES)]
    run = run_process(context, "gpu tests", command, timeout_s)
    counts = junit_counts(junit) if junit.is_file() else {}
    figures = {"files": files, **counts}
    if run.timed_out:
        return StepResult("gpu tests", "timed out", f"killed after {timeout_s:.0f} s",
                          run.seconds, figures)  # fmt: skip
    ran = counts.get("tests", 0) - counts.get("skipped", 0)
    bad = counts.get("failures", 0) + counts.get("errors", 0)
    summary = (
        f"{ran - bad} passed, {counts.get('failures', 0)} failed, {counts.get('errors', 0)} "
        f"errors, {counts.get('skipped', 0)} skipped (pytest exit {run.returncode})"
    )
    passed = run.returncode == 0 and ran > 0 and bad == 0
    return StepResult("gpu tests", "passed" if passed else "failed", summary, run.seconds, figures)


def _collected_count(output: str) -> int:
    match = re.search(r"(\d+)(?:/\d+)? tests? (?:collected|selected)", output)
    return int(match.group(1)) if match else 0


def junit_counts(path: Path) -> dict:
    """tests, failures, errors, skipped and the failing test ids of a JUnit XML report."""
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {
        key: sum(int(suite.get(key, 0)) for suite in suites)
        for key in ("tests", "failures", "errors", "skipped")
    }
    failing = []
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failing.append(f"{case.get('classname')}::{case.get('name')}")
    counts["failing"] = failing
    return counts


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


# ---- step 2: compute-sanitizer ----------------------------------------------------------------

SANITIZER_TOOLS = ("memcheck", "racecheck")
_SANITIZER_SUMMARY = re.compile(r"(ERROR|RACECHECK) SUMMARY: (\d+) (?:errors?|hazards?)")


def sanitizer_path() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for candidate in ("/usr/local/cuda/bin/compute-sanitizer",):
        if Path(candidate).is_file():
            return candidate
    return None


def run_sanitizer(context: KitContext, timeout_s: float) -> StepResult:
    skip_reason = context.cuda_skip_reason()
    if skip_reason:
        return StepResult("compute-sanitizer", "skipped", skip_reason)
    sanitizer = sanitizer_path()
    if sanitizer is None:
        return StepResult("compute-sanitizer", "failed", "compute-sanitizer is not installed")
    start = time.monotonic()
    figures, problems = {}, []
    for index, tool in enumerate(SANITIZER_TOOLS):
        left = timeout_s - (time.monotonic() - start)
        share = left / (len(SANITIZER_TOOLS) - index)
        command = [
            sanitizer, "--tool", tool, "--error-exitcode", "3", "--report-api-errors", "no",
            sys.executable, "-m", "benchmarks.gpu.sanitize_cases",
        ]  # fmt: skip
        run = run_process(context, f"compute-sanitizer {tool}", command, share)
        outcome = sanitizer_outcome(run)
        figures[tool] = outcome
        if outcome != "clean":
            problems.append(f"{tool}: {outcome}")
    seconds = time.monotonic() - start
    if problems:
        return StepResult("compute-sanitizer", "failed", "; ".join(problems), seconds, figures)
    return StepResult("compute-sanitizer", "passed", "memcheck and racecheck clean over every "
                      "kernel's case", seconds, figures)  # fmt: skip


def sanitizer_outcome(run: ProcessRun) -> str:
    """ "clean", or what went wrong: errors found, the cases failing, a timeout."""
    if run.timed_out:
        return "timed out"
    summaries = _SANITIZER_SUMMARY.findall(run.output)
    errors = sum(int(count) for _, count in summaries)
    if errors:
        return f"{errors} errors or hazards"
    if run.returncode != 0:
        return f"exit {run.returncode} (see the log)"
    if not summaries:
        return "no sanitizer summary in the output"
    return "clean"


# ---- step 3: the attention benchmark ----------------------------------------------------------


def run_attention_bench(context: KitContext, timeout_s: float) -> StepResult:
    skip_reason = context.cuda_skip_reason()
    if skip_reason:
        return StepResult("attention benchmark", "skipped", skip_reason)
    bench_dir = context.work_dir / "attention"
    command = [sys.executable, "-m", "benchmarks.micro.attention", "--kit", "--out", str(bench_dir)]
    run = run_process(context, "bench_attention --kit", command, timeout_s)
    reports = sorted(bench_dir.glob("attention_*_kit.json"))
    if run.timed_out or run.returncode != 0 or not reports:
        status = "timed out" if run.timed_out else "failed"
        return StepResult("attention benchmark", status, f"exit {run.returncode}", run.seconds)
    report = json.loads(reports[0].read_text())
    missed = [t["name"] for t in report["targets"] if not t["met"]]
    summary = ", ".join(f"{t['name']}: {t['value']:.2f}" for t in report["targets"])
    status = "failed" if missed else "passed"
    return StepResult("attention benchmark", status, summary, run.seconds, report)


# ---- step 4: the engine on random weights of real shapes --------------------------------------


def engine_step(model: str) -> Callable[[KitContext, float], StepResult]:
    return _random_weights_step("engine", "benchmarks.gpu.engine_check", model, engine_summary)


def decode_step(model: str) -> Callable[[KitContext, float], StepResult]:
    return _random_weights_step("decode", "benchmarks.gpu.decode_check", model, decode_summary)


def serve_step(model: str) -> Callable[[KitContext, float], StepResult]:
    return _random_weights_step("serve", "benchmarks.gpu.serve_check", model, serve_summary)


def _random_weights_step(
    kind: str, module: str, model: str, summarize: Callable[[dict], str]
) -> Callable[[KitContext, float], StepResult]:
    """A step that runs `module` on random weights of `model`'s shape in its own process
    (the dry run's tiny shape on the CPU) and keeps the JSON figures it writes."""

    def run_check(context: KitContext, timeout_s: float) -> StepResult:
        name = f"{kind} {model}"
        if model != DRY_RUN_ENGINE_MODEL:
            skip_reason = context.cuda_skip_reason()
            if skip_reason:
                return StepResult(name, "skipped", skip_reason)
        device = "cuda" if context.cuda and not context.dry_run else "cpu"
        figures_path = context.work_dir / f"{kind}_{model}.json"
        command = [
            sys.executable, "-m", module, "--model", model,
            "--device", device, "--out", str(figures_path),
        ]  # fmt: skip
        run = run_process(context, name, command, timeout_s)
        figures = json.loads(figures_path.read_text()) if figures_path.is_file() else {}
        if run.timed_out:
            return StepResult(name, "timed out", f"killed after {timeout_s:.0f} s",
                              run.seconds, figures)  # fmt: skip
        if run.returncode != 0 or not figures:
            return StepResult(name, "failed", f"exit {run.returncode}", run.seconds, figures)
        return StepResult(name, "passed", summarize(figures), run.seconds, figures)

    return run_check


def engine_summary(figures: dict) -> str:
    parity = figures["parity"]
    text = f"{figures['device']}: float32 greedy tokens equal to the torch reference's"
    if not parity["equal"]:
        text = f"{figures['device']}: greedy tokens DIFFER from the torch reference's"
    if "eager_equal" in parity:
        text += ", and with --enforce-eager " + ("too" if parity["eager_equal"] else "they DIFFER")
    throughput = figures.get("throughput")
    if throughput:
        text += (
            f"; {throughput['output_tok_s']:.0f} output tok/s at batch "
            f"{throughput['num_prompts']} ({throughput['prompt_len']} in / "
            f"{throughput['max_tokens']} out)"
        )
        text += _variant_summary(throughput)
    return text


# Throughput runs beside the default one: (figures key, tokens-equal key, what it is).
THROUGHPUT_VARIANTS = (
    ("async_scheduling", "async_equal", "with async scheduling"),
    ("enforce_eager", "eager_equal", "eager (no CUDA graphs)"),
)


def _variant_summary(throughput: dict) -> str:
    """The variant runs beside the default one (absent in figures of older kits)."""
    text = ""
    for key, equal_key, label in THROUGHPUT_VARIANTS:
        variant = throughput.get(key)
        if variant is None:
            continue
        same = "same tokens" if throughput[equal_key] else "tokens differ"
        text += (
            f", {variant['output_tok_s']:.0f} {label} "
            f"({variant['output_tok_s'] / throughput['output_tok_s']:.2f}x, {same})"
        )
    return text


def decode_summary(figures: dict) -> str:
    """The decode check's headline figures against the issue's targets."""
    parts = [figures["device"]]
    largest = max(int(size) for size in figures["breakdown"]["default"])
    default, eager = (
        figures["breakdown"][mode][str(largest)] for mode in ("default", "enforce_eager")
    )
    parts.append(
        f"batch {largest} step {default['worker_step_ms']:.2f} ms "
        f"({eager['worker_step_ms']:.2f} eager)"
    )
    reference = figures.get("reference")
    if reference:
        parts.append(
            f"{reference['engine_over_reference']:.2f}x the plain-torch graph "
            f"(target <= {reference['target_max_ratio']})"
        )
    share = figures.get("batch_one", {}).get("share_of_hbm")
    if share is not None:
        parts.append(
            f"batch 1 at {100 * share:.0f}% of HBM "
            f"(target >= {100 * figures['batch_one']['target_min_share']:.0f}%)"
        )
    nano = figures.get("nano_vllm")
    if nano:
        target = f" (target >= {nano['target_tok_s']})" if nano.get("target_tok_s") else ""
        parts.append(f"nano-vllm workload {nano['output_tok_s']:.0f} output tok/s{target}")
    return ", ".join(parts)


def serve_summary(figures: dict) -> str:
    loads = ", ".join(
        f"{row['load']} {row['output_tokens_per_s']:.0f} output tok/s "
        f"(TTFT p50 {row['ttft_ms']['p50']:.0f} ms, ITL p50 {row['itl_ms']['p50']:.1f} ms)"
        for row in figures["loads"]
    )
    return f"{figures['device']}, core-serve over HTTP: {loads}"


# ---- the environment and the report -----------------------------------------------------------


def environment() -> dict:
    """GPU, driver, versions: what the figures were measured on."""
    info = {
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "commit": _git_commit(),
    }
    for distribution in ("torch", "cupy-cuda13x", "cupy-cuda12x", "triton", *GPU_MACHINE_LACKS):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            info[distribution] = importlib.metadata.version(distribution)
    try:
        import torch

        info["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            properties = torch.cuda.get_device_properties(0)
            info["gpu"] = properties.name
            info["gpu_memory_gib"] = round(properties.total_memory / 2**30, 1)
            info["multiprocessors"] = properties.multi_processor_count
            info["compute_capability"] = f"{properties.major}.{properties.minor}"
    except ImportError:
        info["torch"] = "not installed"
    info["driver"] = _command_output(
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    )
    info["nvcc"] = _last_line(_command_output(["nvcc", "--version"]))
    sanitizer = sanitizer_path()
    if sanitizer:
        info["compute_sanitizer"] = _last_line(_command_output([sanitizer, "--version"]))
    return info


def _git_commit() -> str:
    """The commit the tree was copied from: GPU_CHECK_COMMIT when set (the GPU machine's copy
    may carry the session's base commit, not the one under test), else git's HEAD."""
    commit = os.environ.get("GPU_CHECK_COMMIT")
    if commit:
        return commit
    return _command_output(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"]) or "?"


def _command_output(command: list[str]) -> str:
    try:
        completed = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return completed.stdout.strip() if completed.returncode == 0 else ""


def _last_line(text: str) -> str:
    return text.splitlines()[-1] if text else ""


def write_report(context: KitContext, env: dict, results: list[StepResult]) -> None:
    """gpu_report.json, gpu_report.md and gpu_check.log in the output folder."""
    report = {
        "dry_run": context.dry_run,
        "environment": env,
        "steps": [asdict(result) for result in results],
    }
    out = context.out_dir
    (out / REPORT_JSON).write_text(json.dumps(report, indent=2) + "\n")
    (out / REPORT_MD).write_text(report_markdown(report))
    (out / LOG_FILE).write_text("\n".join(context.log))


def report_markdown(report: dict) -> str:
    env = report["environment"]
    title = "GPU check (dry run)" if report["dry_run"] else "GPU check"
    lines = [
        f"# {title}: {env.get('gpu', 'no GPU')}",
        "",
        ", ".join(f"{key} {value}" for key, value in env.items() if value not in ("", None)),
        "",
        "| step | outcome | seconds | summary |",
        "|---|---|---|---|",
    ]
    for step in report["steps"]:
        lines.append(
            f"| {step['name']} | {step['status']} | {step['seconds']:.0f} | {step['summary']} |"
        )
    for step in report["steps"]:
        lines += _step_details(step)
    return "\n".join(lines) + "\n"


def _step_details(step: dict) -> list[str]:
    figures = step["figures"]
    if step["name"] == "gpu tests" and figures.get("failing"):
        return ["", "## Failing GPU tests", "", *(f"- `{name}`" for name in figures["failing"])]
    if step["name"] == "attention benchmark" and figures.get("decode"):
        return ["", *_attention_lines(figures)]
    if step["name"].startswith("engine") and figures.get("parity"):
        return ["", *_engine_lines(step["name"], figures)]
    if step["name"].startswith("decode") and figures.get("breakdown"):
        return ["", *_decode_lines(step["name"], figures)]
    if step["name"].startswith("serve") and figures.get("loads"):
        return ["", *_serve_lines(step["name"], figures)]
    return []


def _attention_lines(report: dict) -> list[str]:
    lines = [
        f"## Attention (bf16), copy ceiling {report['copy_ceiling_gbps']:.0f} GB/s",
        "",
        "| decode | splits | µs | GB/s | % copy | x SDPA |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["decode"]:
        speedup = r["speedup_vs_sdpa"]
        lines.append(
            f"| {r['label']} ({r['num_heads']}/{r['num_kv_heads']}/{r['head_dim']}) | "
            f"{r['num_splits']} | {r['kernel_us']:.1f} | {r['gbps']:.0f} | "
            f"{r['pct_copy_ceiling']:.1f} | {'n/a' if speedup is None else f'{speedup:.2f}'} |"
        )
    lines += ["", "| prefill | batch | µs | TFLOP/s | SDPA TFLOP/s | x SDPA | SDPA backend |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in report["prefill"]:
        ratio, sdpa = r["ratio_vs_sdpa"], r["sdpa_tflops"]
        lines.append(
            f"| {r['label']} | {r['batch']} | {r['kernel_us']:.1f} | {r['kernel_tflops']:.1f} | "
            f"{'n/a' if sdpa is None else f'{sdpa:.1f}'} | "
            f"{'n/a' if ratio is None else f'{ratio:.2f}'} | {r.get('sdpa_backend')} |"
        )
    if report.get("decode_variants"):
        lines += ["", "| decode b64 ctx4k variant | group | kernel | splits | µs | GB/s | % copy |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
        for v in report["decode_variants"]:
            lines.append(
                f"| {v['label']} | {v['group']} | `{v['kernel']}` | {v['num_splits']} | "
                f"{v['kernel_us']:.1f} | {v['gbps']:.0f} | {v['pct_copy_ceiling']:.1f} |"
            )
    copies = report.get("copy_bandwidths_gbps", {})
    lines += [
        "",
        "Copy bandwidth (read + write): "
        + ", ".join(f"{name} {gbps:.0f} GB/s" for name, gbps in copies.items()),
        "",
        *(f"- {'PASS' if t['met'] else 'FAIL'}: {t['name']} ({t['value']:.2f})"
          for t in report["targets"]),
    ]  # fmt: skip
    return lines


def _engine_lines(name: str, figures: dict) -> list[str]:
    parity = figures["parity"]
    lines = [
        f"## {name} ({figures['device']}, random weights)",
        "",
        f"Greedy parity in float32, step budget {parity['max_num_batched_tokens']} tokens: "
        + ", ".join(
            f"prompt {p['prompt_len']}: {p['equal_prefix']}/{p['num_tokens']} equal"
            for p in parity["prompts"]
        ),
    ]
    throughput = figures.get("throughput")
    if throughput:
        lines += [
            "",
            f"Offline: {throughput['num_prompts']} prompts x {throughput['prompt_len']} tokens "
            f"in, {throughput['max_tokens']} out: {throughput['elapsed_s']:.2f} s, "
            f"{throughput['output_tok_s']:.0f} output tok/s, "
            f"{throughput['total_tok_s']:.0f} total tok/s" + _variant_summary(throughput),
        ]
    return lines


# (label, figures key, format) of the breakdown table's columns, in milliseconds unless a share.
BREAKDOWN_COLUMNS = (
    ("worker step", "worker_step_ms", "{:.2f}"),
    ("host prepare", "host_prepare_ms", "{:.2f}"),
    ("forward, host", "forward_host_ms", "{:.2f}"),
    ("forward, device", "forward_device_ms", "{:.2f}"),
    ("sampling, host", "sample_host_ms", "{:.2f}"),
    ("sampling, device", "sample_device_ms", "{:.2f}"),
    ("device busy", "device_busy_share", "{:.0%}"),
    ("core between steps", "core_between_steps_ms", "{:.2f}"),
    ("IPC", "ipc_ms", "{:.2f}"),
)


def _decode_lines(name: str, figures: dict) -> list[str]:
    lines = [
        f"## {name} ({figures['device']}, random weights, {figures['breakdown']['dtype']})",
        "",
        "Median ms per decode step; sampling's host time includes waiting for the forward.",
        "",
        "| mode | batch | " + " | ".join(label for label, _, _ in BREAKDOWN_COLUMNS) + " |",
        "|---|---|" + "---|" * len(BREAKDOWN_COLUMNS),
    ]
    for mode in ("default", "enforce_eager"):
        for batch, parts in figures["breakdown"][mode].items():
            cells = [
                "" if parts.get(key) is None else form.format(parts[key])
                for _, key, form in BREAKDOWN_COLUMNS
            ]
            lines.append(f"| {mode} | {batch} | " + " | ".join(cells) + " |")
    reference = figures.get("reference")
    if reference:
        lines += [
            "",
            f"Plain-torch CUDA-graph decode step at batch {reference['batch_size']} (static "
            f"batch, contiguous KV of {reference['max_len']}): {reference['step_ms']:.2f} ms; "
            f"the engine's step {reference['engine_over_reference']:.2f}x that "
            f"(target <= {reference['target_max_ratio']}).",
        ]
    one = figures.get("batch_one")
    if one and "copy_bytes_per_s" in one:
        hbm = ""
        if "share_of_hbm" in one:
            hbm = (
                f", {100 * one['share_of_hbm']:.0f}% of the data sheet's "
                f"{one['hbm_bytes_per_s'] / 1e9:.0f} GB/s (target >= "
                f"{100 * one['target_min_share']:.0f}%)"
            )
        lines += [
            "",
            f"Batch 1: {(one['weight_bytes'] + one['kv_bytes']) / 1e6:.0f} MB read per step in "
            f"{one['worker_step_ms']:.2f} ms = {one['bytes_per_s'] / 1e9:.0f} GB/s, "
            f"{100 * one['share_of_copy']:.0f}% of the {one['copy_bytes_per_s'] / 1e9:.0f} GB/s "
            f"copy measured here{hbm}.",
        ]
    nano = figures.get("nano_vllm")
    if nano:
        reported = nano.get("a100_reported") or {}
        beside = ", ".join(f"{who} {tok_s:,}" for who, tok_s in reported.items())
        lines += [
            "",
            f"nano-vllm's workload ({nano['num_seqs']} sequences, lengths uniform in "
            f"{nano['lengths'][0]}..{nano['lengths'][1]}, temperature 0.6, step budget "
            f"{nano['max_num_batched_tokens']}): {nano['output_tok_s']:,.0f} output tok/s in "
            f"{nano['elapsed_s']:.1f} s"
            + (f"; reported on one A100 40GB: {beside}" if beside else "")
            + (f"; target >= {nano['target_tok_s']:,}" if nano.get("target_tok_s") else "")
            + ".",
        ]
    return lines


def _serve_lines(name: str, figures: dict) -> list[str]:
    lines = [
        f"## {name} ({figures['device']}, random weights, core-serve's defaults)",
        "",
        f"Streamed /v1/completions, {figures['prompt_len']} token ids in, "
        f"{figures['max_tokens']} greedy tokens out, closed loop.",
        "",
        "| load | requests | in flight | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms "
        "| ITL p99 ms | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in figures["loads"]:
        lines.append(
            f"| {row['load']} | {row['num_requests']} | {row['concurrency']} | "
            f"{row['output_tokens_per_s']:.0f} | {row['ttft_ms']['p50']:.1f} | "
            f"{row['ttft_ms']['p99']:.1f} | {row['itl_ms']['p50']:.2f} | "
            f"{row['itl_ms']['p99']:.2f} | {row['num_errors']} |"
        )
    return lines


# ---- the kit ----------------------------------------------------------------------------------


def kit_steps(dry_run: bool) -> list[Step]:
    models = (DRY_RUN_ENGINE_MODEL,) if dry_run else ENGINE_MODELS
    decode_models = (DRY_RUN_ENGINE_MODEL,) if dry_run else DECODE_MODELS
    serve_models = (DRY_RUN_ENGINE_MODEL,) if dry_run else SERVE_MODELS
    # The GPU tests gate the rest; then the figures the open GPU work needs (the engine with and
    # without CUDA graphs, the decode step's breakdown); the attention benchmark and the
    # sanitizer, which earlier runs measured, come last, the sanitizer (whose speed on a given
    # machine is the least known) at the very end: a slow one takes what is left.
    return [
        Step("gpu tests", 200.0, run_gpu_tests),
        *(Step(f"engine {model}", 150.0, engine_step(model)) for model in models),
        *(Step(f"decode {model}", 180.0, decode_step(model)) for model in decode_models),
        *(Step(f"serve {model}", 120.0, serve_step(model)) for model in serve_models),
        Step("attention benchmark", 90.0, run_attention_bench),
        Step("compute-sanitizer", 180.0, run_sanitizer),
    ]


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def select_steps(steps: list[Step], only: str | None) -> list[Step]:
    """The steps whose name starts with one of the comma-separated prefixes in `only` (None:
    all); ValueError naming a prefix that matches none."""
    if only is None:
        return steps
    prefixes = [prefix.strip() for prefix in only.split(",") if prefix.strip()]
    for prefix in prefixes:
        if not any(step.name.startswith(prefix) for step in steps):
            names = ", ".join(step.name for step in steps)
            raise ValueError(f"--only {prefix!r} matches no step (steps: {names})")
    return [step for step in steps if any(step.name.startswith(p) for p in prefixes)]


def run_kit(
    out_dir: Path, dry_run: bool, budget_s: float, only: str | None = None
) -> list[StepResult]:
    """Every step (or those `only` selects) in order within the budget; the report rewritten
    after each."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = environment()
    results: list[StepResult] = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        context = KitContext(
            out_dir=out_dir,
            work_dir=Path(work),
            dry_run=dry_run,
            cuda=cuda_available(),
            deadline=time.monotonic() + budget_s,
        )
        for step in select_steps(kit_steps(dry_run), only):
            left = context.seconds_left()
            if left < MIN_STEP_S:
                result = StepResult(step.name, "skipped", f"out of time ({left:.0f} s left)")
            else:
                result = _run_step(step, context, min(step.cap_s, left))
            print(f"[{result.status}] {result.name}: {result.summary} ({result.seconds:.0f} s)",
                  flush=True)  # fmt: skip
            results.append(result)
            write_report(context, env, results)
    return results


def _run_step(step: Step, context: KitContext, timeout_s: float) -> StepResult:
    """The step's result; a bug in the kit itself fails the step, not the kit."""
    start = time.monotonic()
    try:
        result = step.run(context, timeout_s)
    except Exception as error:  # noqa: BLE001 - recorded as the step's failure
        context.log.append(f"===== {step.name}: the kit raised {error!r}")
        result = StepResult(step.name, "failed", f"the kit raised {error!r}")
    result.seconds = result.seconds or time.monotonic() - start
    return result


# ---- the wheelhouse ---------------------------------------------------------------------------


def wheelhouse_command(target: Path) -> list[str]:
    """pip download of GPU_MACHINE_LACKS at the versions installed here, as cp312 manylinux
    x86-64 wheels, without their dependencies (the machine has those)."""
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--python-version", WHEEL_PYTHON, "--implementation", "cp", "-d", str(target),
    ]  # fmt: skip
    for platform_tag in WHEEL_PLATFORMS:
        command += ["--platform", platform_tag]
    for distribution in GPU_MACHINE_LACKS:
        command.append(f"{distribution}=={importlib.metadata.version(distribution)}")
    return command


def make_wheelhouse(target: Path) -> int:
    target.mkdir(parents=True, exist_ok=True)
    completed = subprocess.run(wheelhouse_command(target))
    if completed.returncode != 0:
        return completed.returncode
    wheels = sorted(target.glob("*.whl"))
    total = sum(wheel.stat().st_size for wheel in wheels)
    for wheel in wheels:
        print(f"{wheel.stat().st_size / 2**20:6.2f} MiB  {wheel.name}")
    print(
        f"{total / 2**20:.2f} MiB in {len(wheels)} wheels (limit {WHEELHOUSE_LIMIT_BYTES >> 20} MiB)"
    )
    if total > WHEELHOUSE_LIMIT_BYTES:
        print("the wheelhouse is over its limit", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--out", type=Path, help="folder for the report (at most 8 files)")
    action.add_argument("--make-wheelhouse", type=Path, metavar="DIR",
                        help="download the wheels the GPU machine lacks into DIR")  # fmt: skip
    parser.add_argument("--dry-run", action="store_true", help="the plumbing on tiny shapes")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help=f"the whole run's time limit (default {DEFAULT_BUDGET_S:.0f})")  # fmt: skip
    parser.add_argument("--only", metavar="PREFIXES",
                        help="run only the steps whose names start with these, comma-separated "
                        "(e.g. 'decode,engine llama')")  # fmt: skip
    args = parser.parse_args(argv)
    if args.make_wheelhouse:
        return make_wheelhouse(args.make_wheelhouse)
    try:
        select_steps(kit_steps(args.dry_run), args.only)
    except ValueError as error:
        parser.error(str(error))
    results = run_kit(args.out, args.dry_run, args.budget_s, args.only)
    print(f"report: {args.out / REPORT_MD}")
    return 1 if any(r.status in ("failed", "timed out") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
