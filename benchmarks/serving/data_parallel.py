"""`bench_serving --data-parallel-size N`: serving with N engine cores against one, in one run.

The workload repeats prefixes, as chat traffic does: every prompt is one of `NUM_PREFIXES`
system prompts (about `PREFIX_WORDS` words) followed by its own question, so where a request
runs decides whether its prefix is cached. Three servers are measured one after another on the
same seeded requests at the same rates:

- `--data-parallel-size 1`, one worker thread: the baseline;
- `--data-parallel-size N`, one worker thread per core's worker: what data parallelism adds;
- `--data-parallel-size 1`, N worker threads: the same cores spent on intra-op threads instead.

Reported per rate: output tokens/s and TTFT p50 of each, the ratios against the baseline, and
each server's prefix cache hit rate over the whole run (from /metrics).
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness.common import core_serve, make_text, markdown_table, read_metrics

NUM_PREFIXES = 4
PREFIX_WORDS = 300


@dataclass(slots=True, frozen=True)
class SharedPrefixWorkload:
    """Prompts made of one of `prefixes` and a question of `question_words` words; output
    tokens uniform in `output_tokens`. Same `sample` interface as `LengthDistribution`."""

    prefixes: tuple[str, ...]
    question_words: tuple[int, int]
    output_tokens: tuple[int, int]

    @classmethod
    def seeded(
        cls, seed: int, question_words: tuple[int, int], output_tokens: tuple[int, int]
    ) -> SharedPrefixWorkload:
        rng = random.Random(f"{seed}-prefixes")
        prefixes = tuple(make_text(rng, PREFIX_WORDS) for _ in range(NUM_PREFIXES))
        return cls(prefixes, question_words, output_tokens)

    def sample(self, rng: random.Random) -> tuple[str, int]:
        prompt = (
            f"{rng.choice(self.prefixes)}\n\n{make_text(rng, rng.randint(*self.question_words))}"
        )
        return prompt, rng.randint(*self.output_tokens)


@dataclass(slots=True, frozen=True)
class ServerSetup:
    name: str
    data_parallel_size: int
    num_threads: int


def setups(data_parallel_size: int) -> list[ServerSetup]:
    n = data_parallel_size
    return [
        ServerSetup("dp 1, 1 thread (baseline)", 1, 1),
        ServerSetup(f"dp {n}, 1 thread per core", n, 1),
        ServerSetup(f"dp 1, {n} threads", 1, n),
    ]


def measure_setup(setup: ServerSetup, engine_flags: list[str], run_rows, log_dir: Path) -> dict:
    """Runs every rate against one server of `setup`; its rows and its prefix hit rate."""
    os.environ["OMP_NUM_THREADS"] = str(setup.num_threads)  # inherited by the workers
    flags = [*engine_flags, "--data-parallel-size", str(setup.data_parallel_size)]
    log_path = log_dir / f"dp{setup.data_parallel_size}-t{setup.num_threads}.log"
    print(f"--- {setup.name}")
    with core_serve(flags, log_path) as url:
        before = read_metrics(url)
        rows = run_rows(url)
        after = read_metrics(url)
        # Cumulative since start-up; the warm-up's few tokens are included.
        per_core_after = read_per_engine(url, "core:prefix_cache_queries_by_engine_total")
    queries = _delta(before, after, "core:prefix_cache_queries_total")
    hits = _delta(before, after, "core:prefix_cache_hits_total")
    return {
        "prompt_tokens_per_core": per_core_after or [queries],
        "setup": setup.name,
        "data_parallel_size": setup.data_parallel_size,
        "num_threads": setup.num_threads,
        "rows": rows,
        "prefix_hit_rate": hits / queries if queries else math.nan,
        "total_errors": sum(row["num_errors"] for row in rows),
    }


def read_per_engine(url: str, family: str) -> list[float]:
    """The values of `family`'s samples labelled engine="<rank>", in rank order ([] without)."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30.0).text
    pattern = rf'^{re.escape(family)}\{{[^}}]*engine="(\d+)"[^}}]*\}} (\S+)$'
    values = {int(rank): float(value) for rank, value in re.findall(pattern, text, re.MULTILINE)}
    return [values[rank] for rank in sorted(values)]


def _delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def compare(args, rates, dtype: str, run_rows, log_dir: Path) -> dict:
    """Measures every setup (see the module docstring); the result for `write_results`."""
    engine_flags = [*shlex.split(args.server_args), "--dtype", dtype]
    measured = [
        measure_setup(setup, engine_flags, run_rows, log_dir)
        for setup in setups(args.data_parallel_size)
    ]
    return {
        "benchmark": "serving_data_parallel",
        "server": f"core-serve {args.server_args}",
        "dtype": dtype,
        "rates": ["inf" if math.isinf(rate) else rate for rate in rates],
        "num_requests_per_rate": args.num_requests,
        "num_prefixes": NUM_PREFIXES,
        "prefix_words": PREFIX_WORDS,
        "setups": measured,
        "total_errors": sum(s["total_errors"] for s in measured),
    }


def render_markdown(result: dict) -> str:
    baseline, *others = result["setups"]
    header = ["offered req/s"]
    for setup in result["setups"]:
        header += [f"{setup['setup']}: output tok/s", "TTFT p50 ms"]
    header += [f"{s['setup']} / baseline" for s in others]
    rows = []
    for index, base_row in enumerate(baseline["rows"]):
        cells = [base_row["offered_rate"]]
        for setup in result["setups"]:
            row = setup["rows"][index]
            cells += [f"{row['output_tokens_per_s']:.1f}", f"{row['ttft_ms']['p50']:.0f}"]
        for setup in others:
            ratio = setup["rows"][index]["output_tokens_per_s"] / base_row["output_tokens_per_s"]
            cells.append(f"**{ratio:.2f}x**")
        rows.append(cells)
    hit_rates = ", ".join(f"{s['setup']}: {s['prefix_hit_rate']:.1%}" for s in result["setups"])
    spread = "; ".join(
        f"{s['setup']}: " + " / ".join(f"{tokens:.0f}" for tokens in s["prompt_tokens_per_core"])
        for s in result["setups"]
        if len(s["prompt_tokens_per_core"]) > 1
    )
    return (
        f"### Serving with data parallelism: {result['server']} ({result['dtype']}), "
        f"{result['num_requests_per_rate']} streamed requests per rate, each prompt one of "
        f"{result['num_prefixes']} {result['prefix_words']}-word system prompts plus its own "
        f"question\n\n{markdown_table(header, rows)}\n\nPrefix cache hit rate over the run: "
        f"{hit_rates}. Prompt tokens per core: {spread}. Errors: {result['total_errors']} "
        "(must be 0)."
    )


def run_rows_function(run_all, rates, num_requests: int, workload, seed: int, model):
    """`run_rows(url)` for `measure_setup`: every rate of bench_serving's `run_all`."""

    def run_rows(url: str) -> list[dict]:
        return asyncio.run(run_all(url, model, rates, num_requests, workload, seed))

    return run_rows
