"""What every benchmark script shares: result files, machine facts, seeded workloads, statistics,
and server processes (`core-serve`, a peer's server) to measure over HTTP.

Contract for results: each benchmark writes `<name>.json` (everything measured, the machine, the
conditions) and `<name>.md` (a markdown table plus the ratios against its in-run baseline) under
`benchmarks/results/`; `--quick` runs write `<name>_quick.*` so they never overwrite a full run.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from core_engine.common.dtypes import dtype_name
from core_engine.common.ports import find_free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
PERCENTILES = (50, 90, 99)
SERVER_STARTUP_TIMEOUT_S = 600.0
SERVER_POLL_INTERVAL_S = 0.25

# A fixed vocabulary for synthetic prompts: common English words, so that a real tokenizer
# produces ordinary token counts (about 1.3 tokens per word for SmolLM2).
WORDS = tuple(
    """
    the of and to in is was for that with as on by at from his her they which this be are
    had not but have one all were when there an their we been has who more will if would so
    its into than other some could time these two may then do first any my now such like our
    over man me even most made after also did many before must through back years where much
    your way well down should because each just those people how too little state good very
    make world still own see men work long get here between both life being under never day
    same another know while last might us great old year off come since against go came right
    used take three states himself few house use during without again place american around
    however home small found thought went say part once general high upon school every does
    got united left number course war until always away something fact though water less
    public put think almost hand enough far took head yet government system better set told
    nothing night end why called didnt eyes find going look asked later knew point next city
    business give group toward young days let room president side social given present order
    national rather second face per among form important often things looked early white case
    john become large big need four within felt along children saw best church ever least power
    development light thing seemed family interest want members others mind country area
    """.split()  # noqa: SIM905 (a word list reads better as text)
)


# ---- machine and result files ------------------------------------------------------------------


def machine_info() -> dict:
    """The facts needed to read a figure: CPU, cores, load, memory, versions, commit, time."""
    info = {
        "machine": platform.machine(),
        "processor": _cpu_model_name(),
        "num_cpus": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],
        "memory_gib": _memory_gib(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_commit": _git_commit(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    with contextlib.suppress(ImportError):
        import torch

        from core_engine.worker.cpu_features import host_cpu_flags, simd_level

        info["torch"] = torch.__version__
        info["cpu_simd"] = simd_level(host_cpu_flags())
        info["torch_num_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["cuda_device"] = torch.cuda.get_device_name(0)
    return info


def machine_line(info: dict) -> str:
    """One markdown line describing the machine a result came from."""
    text = (
        f"Machine: {info['processor']}{_simd_suffix(info)} ({info['num_cpus']} CPUs, "
        f"{info['memory_gib']:.0f} GiB), "
        f"load average {info['load_average_1m']:.1f} at start, Python {info['python']}"
    )
    if "torch" in info:
        text += f", torch {info['torch']}"
    if "cuda_device" in info:
        text += f", GPU {info['cuda_device']}"
    return text + f", commit {info['git_commit']}, {info['date_utc']}."


def _simd_suffix(info: dict) -> str:
    return f" with {info['cpu_simd']}" if "cpu_simd" in info else ""


def device_results_dir(device: str) -> Path:
    """Where a benchmark of `device` files its results by default: `gpu/` for CUDA, else a
    folder named after the widest SIMD flag of this CPU (`avx2/`, `avx512_bf16/`, ...), so
    that results from CPUs of different kinds never overwrite one another."""
    if device == "cuda":
        return RESULTS_DIR / "gpu"
    from core_engine.worker.cpu_features import SIMD_LEVELS, host_cpu_flags

    flags = host_cpu_flags()
    return RESULTS_DIR / next((flag for flag, _ in SIMD_LEVELS if flag in flags), "generic_cpu")


def result_name(name: str, quick: bool) -> str:
    return f"{name}_quick" if quick else name


def write_results(result: dict, markdown: str, output_dir: Path, name: str) -> Path:
    """Writes `<name>.json` and `<name>.md` (the markdown plus the machine line); returns the
    JSON path."""
    output_dir.mkdir(parents=True, exist_ok=True)
    json_path = output_dir / f"{name}.json"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    machine = result.get("machine")
    footer = f"\n{machine_line(machine)}\n" if isinstance(machine, dict) else ""
    (output_dir / f"{name}.md").write_text(markdown.rstrip("\n") + "\n" + footer)
    return json_path


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table; the first column left-aligned, the others right-aligned."""
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join([":---"] + ["---:"] * (len(header) - 1)) + "|",
    ]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _cpu_model_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _memory_gib() -> float:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    return 0.0


def _git_commit() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        completed = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
        if completed.returncode == 0:
            return completed.stdout.strip()
    return "unknown"


def usable_cpu_ids() -> list[int]:
    """The CPUs this process may run on, in order (all of them where affinity is unknown)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def default_num_threads() -> int:
    """The engine's default on a CPU: one thread per usable core."""
    return len(usable_cpu_ids())


def cpu_list_text(cpu_ids: Sequence[int]) -> str:
    """CPU ids as a Linux CPU list, ranges joined: [0, 1, 2, 5] -> "0-2,5"."""
    if not cpu_ids:
        raise ValueError("an empty CPU list has no text form")
    ranges: list[list[int]] = []
    for cpu_id in sorted(set(cpu_ids)):
        if ranges and cpu_id == ranges[-1][1] + 1:
            ranges[-1][1] = cpu_id
        else:
            ranges.append([cpu_id, cpu_id])
    return ",".join(str(low) if low == high else f"{low}-{high}" for low, high in ranges)


def engine_default_dtype(device: str) -> str:
    """The dtype the engine picks when given none: bfloat16 on CUDA and on CPUs with native bf16
    instructions, float32 on other CPUs."""
    from core_engine.worker.worker import resolve_device, resolve_dtype

    return dtype_name(resolve_dtype(None, resolve_device(device)))


def default_hf_folder(model: str | None) -> Path:
    """The transformers-loadable folder holding the same weights as the engine's `model`."""
    if model is not None and (Path(model) / "config.json").is_file():
        return Path(model)
    if model is not None:
        raise ValueError(
            f"model {model!r} is not a Hugging Face folder; pass --hf-model with the same "
            "weights as a transformers-loadable folder"
        )
    from tools.reference_model import converted_default_model_folder

    return converted_default_model_folder()


# ---- statistics --------------------------------------------------------------------------------


def percentiles(values: Sequence[float], points: Sequence[int] = PERCENTILES) -> dict[str, float]:
    """{"p50": ..., "p90": ..., "p99": ...} by linear interpolation; NaN for no values."""
    if not values:
        return {f"p{point}": float("nan") for point in points}
    ordered = sorted(values)
    result = {}
    for point in points:
        rank = (len(ordered) - 1) * point / 100
        low = int(rank)
        high = min(low + 1, len(ordered) - 1)
        result[f"p{point}"] = ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
    return result


def mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


# ---- workloads ---------------------------------------------------------------------------------


def make_text(rng: random.Random, num_words: int) -> str:
    """`num_words` words drawn from `WORDS`, a sentence-like string."""
    return " ".join(rng.choice(WORDS) for _ in range(num_words)).capitalize() + "."


@dataclass(slots=True)
class GenerationWorkload:
    """Prompts (token ids) with their own output lengths; every request runs to `max_tokens`
    (ignore_eos), so `num_output_tokens` is exactly the useful work."""

    name: str
    description: str
    prompt_token_ids: list[list[int]]
    max_tokens: list[int]

    @property
    def num_prompts(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(prompt) for prompt in self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)


def word_prompts(rng: random.Random, num_prompts: int, min_words: int, max_words: int) -> list[str]:
    return [make_text(rng, rng.randint(min_words, max_words)) for _ in range(num_prompts)]


# Ids of ordinary tokens, the range vLLM's random dataset draws prompts from.
RANDOM_TOKEN_IDS = (100, 40000)


def random_token_prompts(rng: random.Random, num_prompts: int, length: int) -> list[list[int]]:
    """`num_prompts` prompts of `length` token ids drawn uniformly from RANDOM_TOKEN_IDS."""
    low, high = RANDOM_TOKEN_IDS
    return [[rng.randrange(low, high) for _ in range(length)] for _ in range(num_prompts)]


def exact_length_prompt(rng: random.Random, encode, num_tokens: int) -> list[int]:
    """Token ids of synthetic text, cut to exactly `num_tokens` (text is added until it fits)."""
    token_ids: list[int] = []
    while len(token_ids) < num_tokens:
        token_ids += encode(" " + make_text(rng, 64))
    return token_ids[:num_tokens]


# ---- server processes --------------------------------------------------------------------------


@contextlib.contextmanager
def core_serve(engine_flags: Sequence[str], log_path: Path | None = None) -> Iterator[str]:
    """Runs `core-serve` on a free local port until the block exits; yields its base URL.

    Waits (bounded by SERVER_STARTUP_TIMEOUT_S) until /health answers 200; raises RuntimeError
    with the tail of the server's log if it exits or never gets healthy. Always stops it.
    """
    port = find_free_port()
    argv = [
        sys.executable, "-m", "core_engine.frontend.openai.cli",
        "--host", "127.0.0.1", "--port", str(port), "--disable-log-stats",
        *engine_flags,
    ]  # fmt: skip
    with http_server(argv, port, f"core-serve {' '.join(engine_flags)}", log_path) as url:
        yield url


@contextlib.contextmanager
def http_server(
    argv: Sequence[str],
    port: int,
    name: str,
    log_path: Path | None = None,
    env: dict[str, str] | None = None,
    cwd: Path = REPO_ROOT,
    own_session: bool = False,
) -> Iterator[str]:
    """Runs the server `argv` (listening on 127.0.0.1:`port`) until the block exits; yields its
    base URL once /health answers 200.

    Raises RuntimeError, with the tail of its log, if it exits or is not healthy within
    SERVER_STARTUP_TIMEOUT_S. Always stops it; with `own_session` the server gets its own
    process group, and whatever of that group outlives the server is killed too.
    """
    import httpx

    log_file = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115
    process = subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=log_file, stderr=subprocess.STDOUT,
        start_new_session=own_session,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_STARTUP_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"{name} exited with code {process.returncode}" + log_tail(log_path)
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=5.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{name} was not healthy within {SERVER_STARTUP_TIMEOUT_S:.0f} s"
                    + log_tail(log_path)
                )
            time.sleep(SERVER_POLL_INTERVAL_S)
        yield url
    finally:
        stop_process(process, own_session)
        if log_path:
            log_file.close()


def stop_process(process: subprocess.Popen, own_session: bool, timeout_s: float = 30.0) -> None:
    """SIGTERM, then SIGKILL after `timeout_s`. With `own_session` (the process leads its own
    group), the group's leftovers get `timeout_s` more to exit before they are killed."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    if not own_session:
        return
    deadline = time.monotonic() + timeout_s
    while group_pids(process.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in group_pids(process.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def group_pids(group_id: int) -> list[int]:
    """The live (not zombie) processes of a process group, from /proc."""
    pids = []
    for stat_path in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # after "pid (comm) ": state, ppid, pgrp; comm may hold spaces, so split after ")"
            fields = stat_path.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == group_id and fields[0] not in ("Z", "X"):
                pids.append(int(stat_path.parent.name))
    return pids


def log_tail(log_path: Path | None, num_chars: int = 3000) -> str:
    """The last `num_chars` of the log after "; log tail:", to end an error message with."""
    if log_path is None or not log_path.is_file():
        return ""
    return "; log tail:\n" + log_path.read_text(errors="replace")[-num_chars:]


def read_metrics(url: str) -> dict[str, float]:
    """The server's /metrics as {metric name without labels: value} (histograms skipped)."""
    import httpx

    values = {}
    for line in httpx.get(f"{url}/metrics", timeout=30.0).text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_and_labels, _, value = line.rpartition(" ")
        name = name_and_labels.split("{", 1)[0]
        if not name.endswith(("_bucket", "_sum", "_count")):
            values[name] = float(value)
    return values


# ---- a streaming OpenAI completions client -----------------------------------------------------


@dataclass(slots=True)
class StreamedCompletion:
    """Timings of one streamed /v1/completions request (monotonic seconds).

    `chunk_times_s` holds the arrival time of every SSE chunk that carried generated text, and
    `text` that text joined; the token counts come from the final usage chunk. `error` is None
    for a request that streamed to `[DONE]` with HTTP 200 and no error event.
    """

    start_s: float
    end_s: float = 0.0
    chunk_times_s: list[float] | None = None
    text: str = ""
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None

    @property
    def ttft_s(self) -> float:
        return self.chunk_times_s[0] - self.start_s

    @property
    def inter_chunk_s(self) -> list[float]:
        times = self.chunk_times_s
        return [later - earlier for earlier, later in zip(times, times[1:], strict=False)]

    @property
    def latency_s(self) -> float:
        return self.end_s - self.start_s


async def stream_completion(client, url: str, payload: dict) -> StreamedCompletion:
    """POSTs `payload` with streaming on (usage included) and times every chunk.

    Never raises for a failed request: the failure is recorded in `error`.
    """
    body = {**payload, "stream": True, "stream_options": {"include_usage": True}}
    result = StreamedCompletion(start_s=time.monotonic(), chunk_times_s=[])
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:300]}"
                return result
            async for line in response.aiter_lines():
                _handle_sse_line(line, result)
        if result.error is None and not result.chunk_times_s:
            result.error = "the stream ended without any generated text"
    except Exception as exc:  # a benchmark counts failures; it does not stop at the first
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.end_s = time.monotonic()
    return result


def _handle_sse_line(line: str, result: StreamedCompletion) -> None:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return
    event = json.loads(line[len("data: ") :])
    if "error" in event:
        result.error = str(event["error"].get("message", event["error"]))
        return
    text = "".join(choice.get("text") or "" for choice in event.get("choices", ()))
    if text:
        result.chunk_times_s.append(time.monotonic())
        result.text += text
    if usage := event.get("usage"):
        result.num_prompt_tokens = usage["prompt_tokens"]
        result.num_output_tokens = usage["completion_tokens"]
