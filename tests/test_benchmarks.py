"""The benchmark scripts cannot rot: each runs with --quick in a subprocess and writes sane results.

The subprocess tests start real engines on the default model (or the null model for IPC), so
they are marked `slow`; together they take about two and a half minutes on two busy cores. The
helpers they rely on (percentiles, arrivals, the ideal prefix hit count, the plot and the README
section) are checked in-process first.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from frontend.null_tokenizer import NullTokenizer
from scripts.bench_common import REPO_ROOT, GenerationWorkload, markdown_table, percentiles
from scripts.bench_offline import median_pair, token_passes
from scripts.bench_prefix_cache import BLOCK_SIZE, build_prompts, ideal_hits
from scripts.bench_serving import arrival_offsets_s
from scripts.plot_results import plot_serving, write_readme_section

SCRIPT_TIMEOUT_S = 300
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_median_pair_is_the_pair_with_the_median_ratio():
    # ratios 2.0, 3.0, 1.0 -> the pair of ratio 2.0; two pairs -> the lower middle.
    assert median_pair([(1.0, 2.0), (1.0, 3.0), (2.0, 2.0)]) == (1.0, 2.0)
    assert median_pair([(2.0, 7.0), (1.0, 2.0)]) == (1.0, 2.0)
    assert median_pair([(4.0, 5.0)]) == (4.0, 5.0)


def test_token_passes_count_padding_and_overgeneration_for_transformers_only():
    workload = GenerationWorkload("w", "", [[1] * 3, [1] * 10, [1] * 4], [5, 2, 8])
    engine, transformers = token_passes(workload, hf_batch_size=2)
    assert engine == (3 + 10 + 4) + (4 + 1 + 7)
    # batch 1: two rows padded to 10, run to 5 tokens; batch 2: one row of 4, run to 8.
    assert transformers == 2 * (10 + 4) + 1 * (4 + 7)


def run_quick(module: str, output_dir: Path, *extra: str) -> dict:
    """Runs `python -m scripts.<module> --quick`; returns the JSON it wrote."""
    argv = [sys.executable, "-m", f"scripts.{module}", "--quick", "--output-dir", str(output_dir)]
    completed = subprocess.run(
        [*argv, *extra],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT_S,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-5000:]
    name = module.removeprefix("bench_")
    assert (output_dir / f"{name}_quick.md").is_file()
    return json.loads((output_dir / f"{name}_quick.json").read_text())


# ---- helpers, in-process -----------------------------------------------------------------------


def test_percentiles_interpolate_linearly():
    values = [float(v) for v in range(1, 101)]  # 1..100
    result = percentiles(values)
    assert result["p50"] == pytest.approx(50.5)
    assert result["p90"] == pytest.approx(90.1)
    assert result["p99"] == pytest.approx(99.01)
    assert math.isnan(percentiles([])["p50"])


def test_poisson_arrivals_have_the_offered_rate():
    offsets = arrival_offsets_s(random.Random(0), 4.0, 4000)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert len(offsets) / offsets[-1] == pytest.approx(4.0, rel=0.05)
    assert arrival_offsets_s(random.Random(0), math.inf, 3) == [0.0, 0.0, 0.0]


def test_prefix_prompts_share_exactly_the_system_prompt():
    tokenizer = NullTokenizer()
    prompts = build_prompts(tokenizer.encode, 12, seed=0, system_prompt_tokens=100)
    assert len(prompts) == 12
    assert all(prompt[:100] == prompts[0][:100] for prompt in prompts)
    question_starts = {tuple(prompt[100 : 100 + BLOCK_SIZE]) for prompt in prompts}
    assert len(question_starts) == 12


def test_ideal_hits_count_full_system_prompt_blocks_after_the_first_request():
    prompts = [[0] * 1010, [0] * 1020, [0] * 1000]
    # 1000 // 16 = 62 full blocks; the third prompt may hit at most 999 tokens: 62 blocks.
    assert ideal_hits(prompts, 1000, 16) == 2 * 62 * 16
    assert ideal_hits([[0] * 20, [0] * 20], 32, 16) == 16  # capped by the prompt's last token


def test_markdown_table_aligns_numbers_right():
    table = markdown_table(["name", "value"], [["a", 1]])
    assert table.splitlines() == ["| name | value |", "|:---|---:|", "| a | 1 |"]


def test_plot_and_readme_section(tmp_path):
    rows = [
        {
            "offered_rate": rate,
            "request_throughput": throughput,
            "output_tokens_per_s": 20 * throughput,
            "ttft_ms": {"p50": 100.0 * (i + 1), "p90": 150.0, "p99": 200.0 * (i + 1)},
            "itl_ms": {"p50": 50.0, "p90": 60.0, "p99": 90.0},
        }
        for i, (rate, throughput) in enumerate([(0.5, 0.5), (1.0, 0.9), ("inf", 1.2)])
    ]
    results_dir = tmp_path / "benchmarks" / "results"
    plot_serving({"rows": rows, "server": "test"}, results_dir / "serving.png")
    assert (results_dir / "serving.png").read_bytes().startswith(PNG_MAGIC)
    (results_dir / "offline.md").write_text("### Offline table\n")
    (results_dir / "serving.md").write_text("### Serving table\n")
    (results_dir / "offline_quick.md").write_text("### must not appear\n")
    (results_dir / "scheduler.md").write_text("| running |\n|---:|\n| 64 |\n")
    section = tmp_path / "benchmarks" / "README_SECTION.md"
    write_readme_section(results_dir, section)
    text = section.read_text()
    assert text.index("### Offline table") < text.index("### Serving table")
    assert "](benchmarks/results/serving.png)" in text
    assert "must not appear" not in text
    assert "### Scheduler" in text and text.index("### Scheduler") < text.index("| running |")


# ---- the scripts, --quick in a subprocess ------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 60)
def test_bench_offline_quick(tmp_path):
    result = run_quick("bench_offline", tmp_path)
    assert [row["workload"] for row in result["rows"]] == ["mixed", "decode-heavy", "prefill-heavy"]
    assert result["torch_num_threads"] == 1
    num_prompts = num_agreeing = 0
    for row in result["rows"]:
        assert row["engine_output_tokens_per_s"] > 0
        assert row["transformers_output_tokens_per_s"] > 0
        assert row["speedup"] == pytest.approx(row["transformers_s"] / row["engine_s"])
        assert row["pair_speedups"] == [pytest.approx(row["speedup"])]  # --quick: one pair
        assert row["transformers_token_passes"] >= row["engine_token_passes"] > 0
        assert row["num_output_tokens"] > 0 and row["num_prompt_tokens"] > row["num_prompts"]
        num_prompts += row["num_prompts"]
        num_agreeing += row["num_requests_first_tokens_agree"]
    # Same weights, fp32, greedy: both must produce the same first tokens (one near-tie allowed).
    assert num_agreeing >= num_prompts - 1
    assert result["mixed_speedup"] == result["rows"][0]["speedup"]


@pytest.mark.slow
@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 60)
def test_bench_serving_quick(tmp_path):
    result = run_quick("bench_serving", tmp_path)
    assert result["total_errors"] == 0
    assert [row["offered_rate"] for row in result["rows"]] == [2.0, "inf"]
    for row in result["rows"]:
        assert row["num_errors"] == 0 and row["num_wrong_length"] == 0
        assert row["request_throughput"] > 0 and row["output_tokens_per_s"] > 0
        assert 0 < row["ttft_ms"]["p50"] <= row["ttft_ms"]["p99"]
        assert 0 < row["itl_ms"]["p50"] <= row["itl_ms"]["p99"]
        assert row["latency_ms"]["p50"] >= row["ttft_ms"]["p50"]
    assert result["rows"][0]["ttft_p50_vs_lightest"] == 1.0
    assert (tmp_path / "serving_quick.png").read_bytes().startswith(PNG_MAGIC)


@pytest.mark.slow
@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 60)
def test_bench_ipc_quick(tmp_path):
    result = run_quick("bench_ipc", tmp_path)
    raw, core, frontend = result["rows"]
    assert raw["path"].startswith("raw") and core["path"].startswith("engine core")
    for row in (raw, core, frontend):
        assert row["requests_per_s"] > 0 and row["round_trip_us"]["p50"] > 0
    assert result["core_round_trip_vs_raw"] == pytest.approx(
        core["round_trip_us"]["p50"] / raw["round_trip_us"]["p50"]
    )
    assert result["request_bytes"] > 0 and result["reply_bytes"] > 0


@pytest.mark.slow
@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 60)
def test_bench_prefix_cache_quick(tmp_path):
    result = run_quick("bench_prefix_cache", tmp_path)
    off, on = result["rows"]
    assert off["prefix_caching"] is False and off["hit_rate"] == 0.0
    assert on["prefix_caching"] is True
    assert result["meets_hit_rate_target"], (on["hit_rate"], result["ideal_hit_rate"])
    assert on["hit_rate"] <= result["ideal_hit_rate"] + 1e-9  # never more than is shareable
    assert on["ttft_ms"]["p50"] < off["ttft_ms"]["p50"]
