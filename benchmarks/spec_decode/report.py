"""The speculative-decoding benchmark's rows, targets and markdown, from its measurements.

Every ratio compares an arm with the arm without speculation of the same side (engine or
vLLM), on the same workload, batch size and repeat, measured back to back (the engine's arms)
or in the same session (vLLM's). With greedy decoding speculation must not change a single
token: every row counts the requests whose output differs from the same side's baseline.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from benchmarks.harness.closed_loop import ClosedLoopRun, first_differences
from benchmarks.harness.common import markdown_table
from benchmarks.spec_decode.counts import SpecDecodeCounts
from benchmarks.spec_decode.workloads import CHAT, RANDOM

BASELINE = "no spec"
SATURATION = "sat"
TARGET_BATCH1_CHAT_SPEEDUP = 1.8
TARGET_SATURATION_RANDOM_RATIO = 0.97


@dataclass(slots=True)
class Measurement:
    """One closed-loop run of one arm: `side` "engine" or "vllm", `batch` "1", "4", ... or
    SATURATION (every prompt at once, `concurrency` = the number of prompts)."""

    side: str
    arm: str
    workload: str
    batch: str
    concurrency: int
    repeat: int
    run: ClosedLoopRun
    counts: SpecDecodeCounts


def build_rows(measurements: list[Measurement]) -> list[dict]:
    """One row per (side, workload, batch, arm), in measurement order; medians over repeats,
    drafting counts summed over them."""
    by_key = {(m.side, m.workload, m.batch, m.arm, m.repeat): m for m in measurements}
    groups: dict[tuple, list[Measurement]] = {}
    for m in measurements:
        groups.setdefault((m.side, m.workload, m.batch, m.arm), []).append(m)
    rows = []
    for (side, workload, batch, _arm), runs in groups.items():
        baselines = [by_key.get((side, workload, batch, BASELINE, m.repeat)) for m in runs]
        rows.append(_row(runs, baselines))
    return rows


def _row(runs: list[Measurement], baselines: list[Measurement | None]) -> dict:
    first = runs[0]
    summaries = [m.run.summary() for m in runs]
    counts = SpecDecodeCounts()
    for m in runs:
        counts = _sum_counts(counts, m.counts)
    row = {
        "side": first.side,
        "arm": first.arm,
        "workload": first.workload,
        "batch": first.batch,
        "concurrency": first.concurrency,
        "num_requests": summaries[0]["num_requests"],
        "output_tokens_per_s": _median(s["output_tokens_per_s"] for s in summaries),
        "tpot_ms_mean": _median(s["tpot_ms"]["mean"] for s in summaries),
        "tpot_ms_p50": _median(s["tpot_ms"]["p50"] for s in summaries),
        "ttft_ms_p50": _median(s["ttft_ms"]["p50"] for s in summaries),
        "spec_decode": counts.to_json(),
        "runs": summaries,
        "speedup": None,
        "tpot_ratio": None,
        "num_differing_requests": None,
        "first_difference_positions": None,
    }
    if first.arm != BASELINE and all(baseline is not None for baseline in baselines):
        row.update(_against_baseline(runs, baselines))
    return row


def _against_baseline(runs: list[Measurement], baselines: list[Measurement]) -> dict:
    """Median ratios of the arm's run to the baseline's of the same repeat, and the requests
    whose tokens differ from the baseline's (over every repeat)."""
    speedups, tpot_ratios, differences = [], [], []
    for m, baseline in zip(runs, baselines, strict=True):
        ours, theirs = m.run.summary(), baseline.run.summary()
        speedups.append(ours["output_tokens_per_s"] / theirs["output_tokens_per_s"])
        tpot_ratios.append(ours["tpot_ms"]["mean"] / theirs["tpot_ms"]["mean"])
        differences += first_differences(baseline.run.output_token_ids, m.run.output_token_ids)
    positions = [position for position in differences if position is not None]
    return {
        "speedup": _median(speedups),
        "tpot_ratio": _median(tpot_ratios),
        "num_differing_requests": len(positions),
        "first_difference_positions": positions,
    }


def _sum_counts(a: SpecDecodeCounts, b: SpecDecodeCounts) -> SpecDecodeCounts:
    length = max(len(a.num_accepted_tokens_per_pos), len(b.num_accepted_tokens_per_pos))
    pad = lambda values: values + [0] * (length - len(values))  # noqa: E731
    return SpecDecodeCounts(
        a.num_drafts + b.num_drafts,
        a.num_draft_tokens + b.num_draft_tokens,
        a.num_accepted_tokens + b.num_accepted_tokens,
        [x + y for x, y in zip(pad(a.num_accepted_tokens_per_pos),
                               pad(b.num_accepted_tokens_per_pos), strict=True)],
    )  # fmt: skip


def _median(values) -> float:
    values = [value for value in values if value == value]  # NaN: no request of 2+ tokens
    return statistics.median(values) if values else float("nan")


# ---- targets -----------------------------------------------------------------------------------


def engine_targets(rows: list[dict]) -> dict:
    """The issue's targets for each engine arm with speculation: batch 1 on the copy-heavy
    chats at least TARGET_BATCH1_CHAT_SPEEDUP x the output tok/s without it, saturation on the
    random workload at least TARGET_SATURATION_RANDOM_RATIO x; None where not measured."""
    targets = {}
    for arm in dict.fromkeys(r["arm"] for r in rows if r["side"] == "engine"):
        if arm == BASELINE:
            continue
        batch1 = _speedup(rows, arm, CHAT, "1")
        saturation = _speedup(rows, arm, RANDOM, SATURATION)
        targets[arm] = {
            "batch1_chat_speedup": batch1,
            "meets_batch1_chat": None if batch1 is None else batch1 >= TARGET_BATCH1_CHAT_SPEEDUP,
            "saturation_random_ratio": saturation,
            "meets_saturation_random": (
                None if saturation is None else saturation >= TARGET_SATURATION_RANDOM_RATIO
            ),
        }
    return targets


def _speedup(rows: list[dict], arm: str, workload: str, batch: str) -> float | None:
    for row in rows:
        if (row["side"], row["arm"], row["workload"], row["batch"]) == (
            "engine", arm, workload, batch,
        ):  # fmt: skip
            return row["speedup"]
    return None


def num_differing_requests(rows: list[dict], side: str) -> int:
    return sum(row["num_differing_requests"] or 0 for row in rows if row["side"] == side)


# ---- markdown ----------------------------------------------------------------------------------

HEADER = (
    "batch", "arm", "output tok/s", "vs no spec", "TPOT mean ms", "TPOT p50 ms",
    "TPOT vs no spec", "acceptance rate", "mean accepted length", "differing requests",
)  # fmt: skip


def render_markdown(result: dict) -> str:
    """Per side and workload a table of every batch and arm; then the targets, the equality
    gate, and vLLM's arms that did not run with the error each gave."""
    sections = []
    for side, title in (("engine", "engine"), ("vllm", _vllm_title(result))):
        for workload in result["workloads"]:
            rows = [
                r for r in result["rows"] if (r["side"], r["workload"]) == (side, workload["name"])
            ]
            if rows:
                sections.append(
                    f"### {title}: {workload['name']} ({workload['description']})\n\n"
                    f"{markdown_table(HEADER, [_cells(row) for row in rows])}\n"
                )
    sections.append(_conditions(result))
    sections.append(_targets_text(result))
    sections.append(_vllm_errors_text(result))
    return "\n".join(section for section in sections if section)


def _vllm_title(result: dict) -> str:
    versions = {r["version"] for r in result.get("vllm", {}).values() if "version" in r}
    return "vLLM " + "/".join(sorted(versions)) if versions else "vLLM"


def _cells(row: dict) -> list[str]:
    counts = row["spec_decode"]
    return [
        "saturation" if row["batch"] == SATURATION else row["batch"],
        row["arm"],
        f"{row['output_tokens_per_s']:.1f}",
        _ratio(row["speedup"], row["arm"]),
        f"{row['tpot_ms_mean']:.1f}",
        f"{row['tpot_ms_p50']:.1f}",
        _ratio(row["tpot_ratio"], row["arm"]),
        "-" if counts["acceptance_rate"] is None else f"{counts['acceptance_rate']:.0%}",
        "-" if counts["mean_acceptance_length"] is None else f"{counts['mean_acceptance_length']:.2f}",
        "-" if row["num_differing_requests"] is None
        else f"{row['num_differing_requests']}/{row['num_requests'] * len(row['runs'])}",
    ]  # fmt: skip


def _ratio(value: float | None, arm: str) -> str:
    if arm == BASELINE:
        return "1.00x"
    return "-" if value is None else f"**{value:.2f}x**"


def _conditions(result: dict) -> str:
    configs = "; ".join(
        f"{arm}: `{config}`" for arm, config in result["speculative_configs"].items()
    )
    return (
        f"Greedy, {result['device']}, {result['dtype']}, model {result['model']}; "
        f"speculative configs {configs}. Closed loop: `batch` requests in flight, each new one "
        "sent when one finishes (saturation: every prompt at once); TPOT = (finish - first "
        "token) / (tokens - 1) per request; acceptance and mean accepted length from the "
        f"engine's spec_decode counters over the run. {result['repeats']} repeat(s), medians "
        "shown; each ratio against the run without speculation of the same repeat.\n"
    )


def _targets_text(result: dict) -> str:
    lines = []
    for arm, target in result["targets"].items():
        batch1, saturation = target["batch1_chat_speedup"], target["saturation_random_ratio"]
        if batch1 is not None:
            verdict = "met" if target["meets_batch1_chat"] else "missed"
            lines.append(f"- {arm}, batch 1, copy-heavy chats: **{batch1:.2f}x** output tok/s "
                         f"(target >= {TARGET_BATCH1_CHAT_SPEEDUP}x, {verdict})")  # fmt: skip
        if saturation is not None:
            verdict = "met" if target["meets_saturation_random"] else "missed"
            lines.append(f"- {arm}, saturation, random: **{saturation:.2f}x** output tok/s "
                         f"(target >= {TARGET_SATURATION_RANDOM_RATIO}x, {verdict})")  # fmt: skip
    differing = result["num_differing_requests_engine"]
    gate = "passed" if differing == 0 else "FAILED"
    lines.append(f"- equality gate ({gate}): {differing} engine requests whose greedy output "
                 "differs with speculation (expected 0)")  # fmt: skip
    return "Targets:\n\n" + "\n".join(lines) + "\n"


def _vllm_errors_text(result: dict) -> str:
    failed = {arm: r for arm, r in result.get("vllm", {}).items() if "error" in r}
    if not failed:
        return ""
    lines = [f"- {arm} (`{r['speculative_config']}`): {r['error']}" for arm, r in failed.items()]
    return "vLLM arms that did not run, with the error vLLM gave:\n\n" + "\n".join(lines) + "\n"
