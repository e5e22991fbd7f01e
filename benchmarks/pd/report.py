"""The report of `bench_pd_disaggregation`: greedy texts compared across arms, ratios against
one instance, and the markdown.

Rows are the arms' summaries (`bench_pd_disaggregation.summarize_arm`); the first row is the
baseline, one instance on every core.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from benchmarks.harness.common import markdown_table
from benchmarks.pd.workload import text_mismatches

# (key in a row's "vs_baseline", label, how to read it from a row)
RATIOS = (
    ("itl_p50", "decode ITL p50", lambda row: row["decode"]["itl_ms"]["p50"]),
    ("itl_p99", "decode ITL p99", lambda row: row["decode"]["itl_ms"]["p99"]),
    ("itl_max", "decode ITL max", lambda row: row["decode"]["itl_ms"]["max"]),
    ("tpot_mean", "decode TPOT", lambda row: row["decode"]["tpot_ms"]["mean"]),
    ("long_ttft_p50", "long-prompt TTFT p50", lambda row: row["long"]["ttft_ms"]["p50"]),
    ("total_s", "total time", lambda row: row["total_s"]),
)


def compare_texts(rows: Sequence[dict]) -> None:
    """Sets each row's "text_mismatches": the decode streams and long prompts whose greedy text
    differs from the baseline's (none for the baseline itself)."""
    baseline = rows[0]
    for row in rows:
        row["text_mismatches"] = [
            {"kind": kind, **mismatch}
            for kind in ("decode", "long")
            for mismatch in text_mismatches(baseline[f"{kind}_texts"], row[f"{kind}_texts"])
        ]


def add_ratios(rows: Sequence[dict]) -> None:
    """Sets each row's "vs_baseline": every figure of RATIOS over the baseline's (below 1: the
    arm is faster); None for the baseline."""
    baseline = rows[0]
    baseline["vs_baseline"] = None
    for row in rows[1:]:
        row["vs_baseline"] = {key: _ratio(read(row), read(baseline)) for key, _, read in RATIOS}


def _ratio(value: float, baseline: float) -> float:
    return value / baseline if baseline else math.nan


def render_markdown(result: dict) -> str:
    shape = result["workload"]
    rows = result["rows"]
    title = (
        f"### Prefill/decode disaggregation: {shape['num_decode_streams']} decode streams of "
        f"{_range(shape['decode_output_tokens'])} output tokens while "
        f"{shape['num_long_prompts']} prompts of {_range(shape['long_prompt_tokens'])} tokens "
        f"arrive every {shape['long_interval_s']:g} s (core-serve --device cpu, "
        f"{result['dtype']}, greedy)"
    )
    return "\n\n".join(
        [
            title,
            markdown_table(*_arms_table(rows, shape["num_long_prompts"])),
            f"Each arm / {rows[0]['arm']} (below 1: the arm is faster):",
            markdown_table(*_ratios_table(rows)),
            _conditions(result),
        ]
    )


def _range(bounds: Sequence[int]) -> str:
    low, high = bounds
    return str(low) if low == high else f"{low}-{high}"


def _arms_table(rows: Sequence[dict], num_long_prompts: int) -> tuple[list[str], list[list]]:
    header = [
        "arm",
        "decode ITL p50/p90/p99/max ms",
        "decode TPOT ms",
        "decode TTFT p50 ms",
        "long-prompt TTFT p50/p90/max ms",
        "total s",
        "long prompts during decode",
        "errors",
        "text mismatches",
    ]
    cells = []
    for row in rows:
        itl, long_ttft = row["decode"]["itl_ms"], row["long"]["ttft_ms"]
        cells.append(
            [
                row["arm"],
                "/".join(f"{itl[key]:.0f}" for key in ("p50", "p90", "p99", "max")),
                f"{row['decode']['tpot_ms']['mean']:.1f}",
                f"{row['decode']['ttft_ms']['p50']:.0f}",
                "/".join(f"{long_ttft[key]:.0f}" for key in ("p50", "p90", "max")),
                f"{row['total_s']:.1f}",
                f"{row['num_long_prompts_during_decode']}/{num_long_prompts}",
                row["num_errors"] + row["num_wrong_length"],
                len(row["text_mismatches"]),
            ]
        )
    return header, cells


def _ratios_table(rows: Sequence[dict]) -> tuple[list[str], list[list]]:
    header = ["arm", *(label for _, label, _ in RATIOS)]
    cells = [
        [row["arm"], *(f"{row['vs_baseline'][key]:.2f}x" for key, _, _ in RATIOS)]
        for row in rows[1:]
    ]
    return header, cells


def _conditions(result: dict) -> str:
    lines = [
        f"- **{row['arm']}**: {row['placement']}; worker threads by server: "
        + ", ".join(f"{name} {threads}" for name, threads in row["worker_threads"].items())
        + f"; load average {row['load_average_1m_at_start']:.1f} when the arm started"
        for row in result["rows"]
    ]
    shape = result["workload"]
    lines += [
        f"- Workload (seed {result['seed']}, token-id prompts, ignore_eos): decode prompts of "
        f"{_range(shape['decode_prompt_tokens'])} tokens, all sent at 0 s; long prompts with "
        f"{shape['long_output_tokens']} output tokens, the first at "
        f"{shape['first_long_offset_s']:g} s. ITL: the gaps between streamed chunks of the "
        "decode streams; TPOT: each stream's time after its first token over its tokens after "
        "the first, averaged; long prompts during decode: those whose first token came "
        "while every decode stream still ran (fewer than all: part of the long prompts' work "
        "missed the streams). Every request goes through the arm's one URL (the proxy for "
        "the disaggregated arm); each arm gets one warm-up request first.",
        "- Every server: `core-serve " + " ".join(result["engine_flags"]) + "`.",
        _mismatch_line(result["rows"]),
    ]
    return "\n".join(lines)


def _mismatch_line(rows: Sequence[dict]) -> str:
    baseline = rows[0]["arm"]
    found = [
        f"{row['arm']}: {mismatch['kind']} request {mismatch['request']} from character "
        f"{mismatch['first_differing_char']}"
        for row in rows
        for mismatch in row["text_mismatches"]
    ]
    if not found:
        return f"- Greedy texts: every arm's equal {baseline}'s, request by request."
    return f"- Greedy texts differing from {baseline}'s: " + "; ".join(found) + "."
