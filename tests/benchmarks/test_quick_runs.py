"""Every benchmark cannot rot: each runs with --quick in a subprocess and writes sane results
(real engines on the default model, or the null model); every command answers --help."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.harness.common import (
    REPO_ROOT,
    default_num_threads,
)
from core_engine.kernels.cpu import f32_matmul as cpu_f32_matmul

SCRIPT_TIMEOUT_S = 300
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_quick(module: str, name: str, output_dir: Path, *extra: str) -> dict:
    """Runs `python -m benchmarks.<module> --quick`; returns the JSON it wrote as `name`."""
    argv = [
        sys.executable,
        "-m",
        f"benchmarks.{module}",
        "--quick",
        "--output-dir",
        str(output_dir),
    ]
    completed = subprocess.run(
        [*argv, *extra],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT_S,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-5000:]
    assert (output_dir / f"{name}_quick.md").is_file()
    return json.loads((output_dir / f"{name}_quick.json").read_text())


# ---- the scripts, --quick in a subprocess ------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 60)
def test_bench_offline_quick(tmp_path):
    # float32 on both sides whatever this CPU's default, so greedy first tokens can be compared.
    result = run_quick("offline.bench", "offline", tmp_path, "--dtype", "float32")
    assert result["dtype"] == "float32"
    assert [row["workload"] for row in result["rows"]] == ["mixed", "decode-heavy", "prefill-heavy"]
    assert [row["peer"] for row in result["rows"]] == ["transformers"] * 3
    assert result["num_threads"] == result["torch_num_threads"] == default_num_threads()
    assert result["peers"]["transformers"]["version"]
    num_prompts = num_agreeing = 0
    for row in result["rows"]:
        assert row["engine_output_tokens_per_s"] > 0
        assert row["peer_output_tokens_per_s"] > 0
        assert row["ratio"] == pytest.approx(row["peer_s"] / row["engine_s"])
        assert row["pair_ratios"] == [pytest.approx(row["ratio"])]  # --quick: one pair
        assert row["peer_token_passes"] >= row["engine_token_passes"] > 0
        assert row["num_output_tokens"] > 0 and row["num_prompt_tokens"] > row["num_prompts"]
        num_prompts += row["num_prompts"]
        num_agreeing += row["num_requests_first_tokens_agree"]
    # Same weights, fp32, greedy: both must produce the same first tokens (one near-tie allowed).
    assert num_agreeing >= num_prompts - 1
    assert result["mixed_speedup"] == result["rows"][0]["ratio"]
    assert result["mixed_ratios"] == {"transformers": result["mixed_speedup"]}


@pytest.mark.slow
@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 60)
def test_bench_serving_quick(tmp_path):
    result = run_quick("serving.bench", "serving", tmp_path)
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
    result = run_quick("micro.ipc", "ipc", tmp_path)
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
    result = run_quick("kv.prefix_cache", "prefix_cache", tmp_path)
    off, on = result["rows"]
    assert off["prefix_caching"] is False and off["hit_rate"] == 0.0
    assert on["prefix_caching"] is True
    assert result["meets_hit_rate_target"], (on["hit_rate"], result["ideal_hit_rate"])
    assert on["hit_rate"] <= result["ideal_hit_rate"] + 1e-9  # never more than is shareable
    assert on["ttft_ms"]["p50"] < off["ttft_ms"]["p50"]


def tier_hit_bounds(chat: dict) -> tuple[int, int]:
    """Tier hits over the revisits if the tier holds every block the conversation computed
    before, beyond the document's: at least the last prompt's full blocks, at most also the
    reply's (computed but its last token; a hit never covers the new prompt's last token)."""
    num_conversations = chat["shape"]["num_conversations"]
    max_tokens, block_size = chat["shape"]["max_tokens"], chat["pool"]["block_size"]
    num_shared = chat["pool"]["num_shared_blocks"]
    lengths = chat["prompt_tokens"]
    fewest = most = 0
    for index in range(num_conversations, len(lengths)):
        last = lengths[index - num_conversations]
        fewest += (last // block_size - num_shared) * block_size
        computed = min(last + max_tokens - 1, lengths[index] - 1)
        most += (computed // block_size - num_shared) * block_size
    return fewest, most


@pytest.mark.slow
@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 60)
def test_bench_kv_offloading_quick_chat(tmp_path):
    """The chat measurement only: with the restart's three more servers the run takes over two
    minutes here (its parts are tested above, in-process)."""
    result = run_quick("kv.offloading", "kv_offloading", tmp_path, "--measurements", "chat")
    assert "restart" not in result
    chat = result["chat"]
    no_tier, tier = chat["rows"]
    # the pool lost every revisit's own history: only the document's blocks were hit there
    assert no_tier["prefix_cache_hits"] == tier["prefix_cache_hits"] == chat["document_hit_tokens"]
    assert no_tier["external_prefix_cache_queries"] == 0
    # the tier held each revisit's own history: at least every full block of its last prompt
    fewest, most = tier_hit_bounds(chat)
    assert fewest <= tier["external_prefix_cache_hits"] <= most
    assert tier["kv_offload_loaded_bytes"] > 0
    assert chat["differing_replies"] == []
    assert (
        no_tier["num_revisits"] == len(chat["prompt_tokens"]) - chat["shape"]["num_conversations"]
    )


@pytest.mark.slow
@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 60)
def test_bench_spec_decode_quick_on_the_null_model(tmp_path):
    """The whole plumbing (engines with and without drafts, closed loops, counters, rows, the
    equality gate); the null model drafts but never has a draft accepted."""
    result = run_quick("spec_decode.bench", "spec_decode", tmp_path, "--model", "null",
                       "--methods", "ngram", "suffix")  # fmt: skip
    assert result["num_differing_requests_engine"] == 0
    assert [w["name"] for w in result["workloads"]] == ["copy-heavy-chat", "random"]
    keys = [(row["workload"], row["batch"], row["arm"]) for row in result["rows"]]
    assert keys == [
        (workload, batch, arm)
        for workload in ("copy-heavy-chat", "random")
        for batch in ("1", "4", "sat")
        for arm in ("no spec", "ngram", "suffix")
    ]
    for row in result["rows"]:
        assert row["output_tokens_per_s"] > 0 and row["tpot_ms_mean"] > 0
        drafts = row["spec_decode"]["num_drafts"]
        if row["arm"] == "no spec":
            assert drafts == 0 and row["speedup"] is None
        else:
            # null replies repeat one token: n-gram and suffix both find drafts
            assert drafts > 0 and row["num_differing_requests"] == 0
            assert row["speedup"] > 0 and row["tpot_ratio"] > 0
    assert set(result["targets"]) == {"ngram", "suffix"}
    assert "equality gate (passed)" in (tmp_path / "spec_decode_quick.md").read_text()


@pytest.mark.slow
@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 60)
@pytest.mark.parametrize("dtype", [[], ["--dtype", "float32"]], ids=["default", "float32"])
def test_profile_step_quick_times_every_part(tmp_path, dtype):
    """Every part has a timer that ran (a renamed layer function would leave it at zero), by
    default (the default model's GGUF blocks where the AVX2 kernels are built) and on weights
    dequantized to float32 (an explicit dtype)."""
    result = run_quick("micro.profile_step", "profile_step", tmp_path, "--name", "profile_step",
                       *dtype)  # fmt: skip
    assert result["output_tokens"] > 0
    for kind in ("decode", "prefill"):
        summary = result["summary"][kind]
        assert summary["num_steps"] > 0
        parts = summary["parts_ms_per_step"]
        for part in ("linears", "attention", "norms", "embedding", "LM head", "sampling"):
            (name,) = [name for name in parts if name.startswith(part)]
            assert parts[name] > 0, f"{kind}: {name} was never timed"
        # The MLP's activation runs on its own or inside the gate_up kernel, never both ways:
        # inside it where the float32 kernel is built (AVX2 without AVX-512) and the run is
        # float32 on dequantized weights (a bf16 build's gate_up never fuses, nor do GGUF
        # blocks, the default for the default model's file where the AVX2 kernels are built).
        fused = parts["gate_up + SiLU-and-mul, fused in one kernel"] > 0
        assert fused != (parts["SiLU-and-mul"] > 0), f"{kind}: {parts}"
        dense_float32 = result["dtype"] == "float32" and result["quantization"] is None
        assert fused == (dense_float32 and cpu_f32_matmul.panel_columns() > 0)


@pytest.mark.slow
@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 60)
@pytest.mark.parametrize(
    ("dtype", "torch_ways"),
    [
        ("float32", {"oneDNN float32", "F.linear float32"}),
        ("bfloat16", {"torch int8 weight-only"}),
    ],
)
def test_bench_linears_quick_times_every_way(tmp_path, dtype, torch_ways):
    """Every way torch offers everywhere, plus the project's kernel first where it is built."""
    result = run_quick("micro.linears", "linears", tmp_path, "--dtype", dtype)
    assert result["dtype"] == dtype
    assert [row["rows"] for row in result["rows"]] == [1, 28]
    for row in result["rows"]:
        assert torch_ways <= set(row["ms_per_pass"])
        assert all(ms > 0 for ms in row["ms_per_pass"].values())


@pytest.mark.slow
@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 60)
def test_bench_linears_quick_times_the_gguf_kernel_against_float32(tmp_path):
    result = run_quick("micro.linears", "gguf_linears", tmp_path, "--quantization", "gguf")
    assert (result["dtype"], result["quantization"]) == ("float32", "gguf")
    for rows, kernel in ((result["rows"], "GGUF Q4_1 kernel"),
                         (result["lm_head_rows"], "GGUF Q8_0 kernel")):  # fmt: skip
        assert [row["rows"] for row in rows] == [1, 28]
        for row in rows:
            ways = list(row["ms_per_pass"])
            assert ways[0] == kernel and "oneDNN float32" in ways
            assert all(ms > 0 for ms in row["ms_per_pass"].values())


@pytest.mark.slow
@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 60)
def test_bench_pd_disaggregation_quick(tmp_path):
    """One instance and the disaggregated arm (the single-core arm is left out to save time)."""
    result = run_quick("pd.bench", "pd_disaggregation", tmp_path, "--arms", "disaggregated",
                       "--dtype", "float32")  # fmt: skip
    assert result["total_errors"] == 0
    one, disaggregated = result["rows"]
    assert (one["arm"], disaggregated["arm"]) == ("one instance", "disaggregated")
    assert one["worker_threads"] == {"one": default_num_threads()}
    assert disaggregated["worker_threads"] == {"prefill": 1, "decode": 1}
    for row in result["rows"]:
        itl = row["decode"]["itl_ms"]
        assert 0 < itl["p50"] <= itl["p99"] <= itl["max"]
        assert row["decode"]["tpot_ms"]["mean"] > 0 and row["long"]["ttft_ms"]["p50"] > 0
        assert len(row["decode_texts"]) == 3 and all(row["decode_texts"])
    assert disaggregated["vs_baseline"]["itl_max"] > 0
    # Greedy float32 on both arms; 1 and 2 threads round sums differently: one near-tie allowed.
    assert result["total_text_mismatches"] <= 1


# The user tools in scripts/: each has an argparse --help and runs as a file or as a module.
USER_SCRIPTS = sorted(
    path.stem
    for path in (REPO_ROOT / "scripts").glob("*.py")
    if 'if __name__ == "__main__"' in path.read_text()
)
# Every benchmark module with a command line, run as `python -m benchmarks.<subject>.<name>`;
# the vLLM runners run inside vLLM's own virtual environment and read their work from stdin.
BENCHMARK_COMMANDS = sorted(
    ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)
    for path in (REPO_ROOT / "benchmarks").rglob("*.py")
    if 'if __name__ == "__main__"' in path.read_text() and not path.stem.endswith("_runner")
) + sorted(
    f"benchmarks.{path.parent.name}" for path in (REPO_ROOT / "benchmarks").glob("*/__main__.py")
)


def test_scripts_holds_the_user_tools_only():
    assert USER_SCRIPTS == ["generate", "gguf_to_bf16"]
    assert len(BENCHMARK_COMMANDS) >= 20


@pytest.mark.parametrize("name", [f"scripts.{n}" for n in USER_SCRIPTS] + BENCHMARK_COMMANDS)
def test_every_command_answers_help(name, tmp_path):
    """As `python -m` from the repository; a user tool also as a file from anywhere."""
    runs = [([sys.executable, "-m", name, "--help"], REPO_ROOT)]
    if name.startswith("scripts."):
        path = REPO_ROOT.joinpath(*name.split(".")).with_suffix(".py")
        runs.append(([sys.executable, str(path), "--help"], tmp_path))
    for argv, cwd in runs:
        result = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, f"{' '.join(argv[1:])}: {result.stderr[-2000:]}"
        assert "usage:" in result.stdout


def test_kv_memory_benchmark_groups_gemma3_layers_and_frees_out_of_window_blocks():

    from benchmarks.kv.memory import ModelShape, measure

    shape = ModelShape(
        num_layers=18, num_kv_heads=1, head_dim=256, sliding_window=512, global_layer_every=6
    )
    assert (shape.num_global_layers, shape.layers_per_group) == (3, 3)
    config = shape.kv_cache_config(hybrid=True, max_model_len=8193)
    assert [type(g).__name__ for g in config.kv_cache_groups] == (
        ["FullAttentionSpec"] + ["SlidingWindowSpec"] * 5
    )
    args = argparse.Namespace(seed=0, step_tokens=1024, dtype_bytes=4, kv_budget_gib=1.0)
    hybrid = measure(shape, 8192, True, args)
    full = measure(shape, 8192, False, args)
    # 8192 prompt tokens + 1 decoded = 513 blocks of 16. All-full: 6 groups x 513. Hybrid: the
    # global group's 513, and per window group the blocks holding the last 511 computed tokens
    # and the decoded one: 513 - (8192 - 511) // 16 = 33.
    assert full["blocks_per_request"] == 6 * 513
    assert hybrid["blocks_per_request"] == 513 + 5 * 33
    budget_blocks = 2**30 // (3 * 16 * 2 * 256 * 4)  # 3 layers' K and V per block
    assert full["max_concurrent_requests"] == budget_blocks // (6 * 513) == 3
    # The last request admitted also needs its peak: the prompt's last 1024-token step, when a
    # window group holds 512 - (7168 - 511) // 16 = 96 blocks.
    peak = 512 + 5 * 96
    expected = (budget_blocks - peak) // hybrid["blocks_per_request"] + 1
    assert hybrid["max_concurrent_requests"] == expected == 15
