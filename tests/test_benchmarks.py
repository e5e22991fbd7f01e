"""The benchmark scripts cannot rot: each runs with --quick in a subprocess and writes sane results.

The subprocess tests start real engines on the default model (or the null model for IPC), so
they are marked `slow`; together they take about two and a half minutes on two busy cores. The
helpers they rely on (percentiles, arrivals, the ideal prefix hit count, the plot and the README
section) are checked in-process first, and so are the peers' parts that need no peer: argument
parsing, result rendering, and the JSON-lines protocol, against fake runners (the real vLLM
runner over a fake `vllm` package). Nothing here imports or needs vLLM or llama.cpp. The GPU
run kit's dry run and the serving measurement tools are checked here too (sections below).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks.gpu import check as gpu_check
from benchmarks.gpu import sanitize_cases as gpu_sanitize_cases
from benchmarks.gpu.check import ProcessRun, junit_counts, sanitizer_outcome
from benchmarks.harness import proc_stats
from benchmarks.harness.closed_loop import (
    ClosedLoopRun,
    RequestTiming,
    first_differences,
    run_closed_loop,
)
from benchmarks.harness.common import (
    REPO_ROOT,
    GenerationWorkload,
    StreamedCompletion,
    cpu_list_text,
    default_num_threads,
    markdown_table,
    percentiles,
)
from benchmarks.harness.peer_process import (
    PeerError,
    PeerProcess,
    parse_peer_message,
    parse_run_result,
)
from benchmarks.harness.plot_results import plot_serving, write_readme_section
from benchmarks.kv import offloading as bench_kv_offloading
from benchmarks.kv.offloading import CHAT_SHAPE, QUICK_CHAT_SHAPE, Reply, differing_replies
from benchmarks.kv.offloading_report import render_markdown as render_kv_offloading
from benchmarks.kv.offloading_workload import (
    ChatSession,
    ChatShape,
    build_chat_plan,
    chat_pool_size,
    long_prompts,
    restart_pool_size,
)
from benchmarks.kv.prefix_cache import BLOCK_SIZE, build_prompts, ideal_hits
from benchmarks.micro import attention as bench_attention
from benchmarks.offline import bench as bench_offline
from benchmarks.offline.bench import (
    comparison_row,
    count_agreeing,
    median_pair,
    results_file_name,
    token_passes,
)
from benchmarks.pd import bench as bench_pd_disaggregation
from benchmarks.pd.report import add_ratios, compare_texts
from benchmarks.pd.report import render_markdown as render_pd_markdown
from benchmarks.pd.workload import (
    DECODE,
    LONG,
    WorkloadShape,
    build_workload,
    decode_stream_stats,
    num_long_prompts_during_decode,
    text_mismatches,
    tpot_s,
)
from benchmarks.peers import vllm as vllm_peer
from benchmarks.peers.llama_server import find_llama_server
from benchmarks.peers.vllm_bench_client import SATURATION, bench_serve_argv, summary
from benchmarks.peers.vllm_spec_decode_arm import parse_closed_loop_result
from benchmarks.serving import bench as bench_serving
from benchmarks.serving import vllm_client as serving_vllm_client
from benchmarks.serving.bench import arrival_offsets_s, peer_ratios, server_device
from benchmarks.serving.profile import step_stats
from benchmarks.spec_decode import bench as bench_spec_decode
from benchmarks.spec_decode.bench import measure_vllm, run_plan, speculative_configs
from benchmarks.spec_decode.copy_heavy_chats import COPY_HEAVY_TASKS, copy_heavy_conversations
from benchmarks.spec_decode.counts import SpecDecodeCounts
from benchmarks.spec_decode.replay import DrafterSpec, replay
from benchmarks.spec_decode.report import (
    BASELINE,
    Measurement,
    build_rows,
    engine_targets,
    num_differing_requests,
    render_markdown,
)
from benchmarks.spec_decode.report import SATURATION as SATURATION_BATCH
from benchmarks.spec_decode.workloads import (
    CHAT,
    RANDOM,
    DecodeWorkload,
    chat_workload,
    num_prompts_for,
)
from core_engine.core.kv_cache.kv_cache_manager import KVCacheManager
from core_engine.core.step_trace import StepRecord
from core_engine.frontend.text.null_tokenizer import NullTokenizer
from core_engine.kernels.cpu import f32_matmul as cpu_f32_matmul
from core_engine.kernels.cuda import backend as cuda_backend
from tests.core_factories import make_request
from tests.cuda_cpu_emulator import EmulatedLoader, compiler_available, launch_on_cpu

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


# ---- KV offloading: the chat workload, its pool, the report -----------------------------------


def test_chat_histories_grow_by_the_reply_and_the_next_user_message():
    plan = build_chat_plan(NullTokenizer().encode, ChatShape(4, 3, 40, 20, 6, 5), seed=0)
    session = ChatSession(plan)
    first_visits = [session.next_prompt(c) for c in range(4)]
    for conversation, prompt in enumerate(first_visits):
        assert prompt == plan.document + plan.openings[conversation]
        assert len(prompt) == 40 + 20
    # the shared prefix is exactly the document: the openings differ in their first block
    assert len({tuple(prompt[40 : 40 + 16]) for prompt in first_visits}) == 4
    session.add_reply(1, [7, 8, 9])
    second = session.next_prompt(1)
    assert second == first_visits[1] + [7, 8, 9] + plan.user_messages[1][0]
    session.add_reply(1, [])
    assert session.next_prompt(1) == second + plan.user_messages[1][1]
    with pytest.raises(ValueError, match="all 3 visits"):
        session.next_prompt(1)
    with pytest.raises(ValueError, match="6 tokens is longer than max_tokens=5"):
        session.add_reply(0, [1] * 6)


def test_chat_visits_go_round_robin_and_bound_their_prompt_lengths():
    plan = build_chat_plan(NullTokenizer().encode, ChatShape(3, 2, 40, 20, 6, 5), seed=0)
    assert plan.visit_order() == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    assert plan.prompt_tokens_bounds(2, 0) == (60, 60)
    assert plan.prompt_tokens_bounds(2, 1) == (66, 71)  # the reply: 0 to max_tokens=5 tokens


def test_the_chat_pool_holds_the_document_and_two_conversations_at_their_longest():
    plan = build_chat_plan(NullTokenizer().encode, CHAT_SHAPE, seed=0)
    pool = chat_pool_size(plan)
    # longest request: 768 + 320 + 4 x (24 + 32) + 24 = 1336 tokens = 84 blocks, 48 of them
    # the document's; the null block, the document and 2 x 36 blocks.
    assert (pool.num_shared_blocks, pool.max_own_blocks) == (48, 36)
    assert pool.num_gpu_blocks == 1 + 48 + 2 * 36 and pool.max_model_len == 84 * 16
    # between visits 0 and 1 of conversation 0, the five others' openings: 5 x (68 - 48) blocks
    assert pool.min_blocks_between_visits == 100 > pool.num_blocks_beyond_document == 72
    assert pool.evicts_between_visits


def test_a_pool_that_would_keep_a_conversation_between_visits_is_refused():
    plan = build_chat_plan(NullTokenizer().encode, ChatShape(3, 4, 64, 32, 16, 8), seed=0)
    with pytest.raises(ValueError, match="keeps a conversation between its visits"):
        chat_pool_size(plan)


@pytest.mark.parametrize("shape", [CHAT_SHAPE, QUICK_CHAT_SHAPE], ids=["full", "quick"])
def test_no_revisit_finds_its_own_history_in_the_pool(shape):
    """The engine's own KVCacheManager, sized by chat_pool_size, runs the chat with replies of
    max_tokens tokens: every request fits, and every revisit hits the document's full blocks
    and nothing of its own history."""
    plan = build_chat_plan(NullTokenizer().encode, shape, seed=0)
    pool = chat_pool_size(plan)
    manager = KVCacheManager(pool.num_gpu_blocks, pool.block_size, pool.max_model_len, True)
    session = ChatSession(plan)
    for index, (conversation, visit) in enumerate(plan.visit_order()):
        prompt = session.next_prompt(conversation)
        reply = [1000 + index] * plan.max_tokens
        # computed: the prompt and every reply token but the last (sampled, never fed back)
        request = make_request(f"r{index}", prompt + reply[:-1], block_size=pool.block_size)
        blocks, num_hit = manager.get_computed_blocks(request)
        if index > 0:
            assert num_hit == pool.num_shared_blocks * pool.block_size, (conversation, visit)
        new_tokens = request.num_tokens - num_hit + 1  # a slot for the last token too
        assert manager.allocate_slots(request, new_tokens, num_hit, blocks) is not None
        request.num_computed_tokens = request.num_tokens
        manager.free(request)
        manager.check_integrity()
        session.add_reply(conversation, reply)


def test_restart_prompts_share_no_block_and_fit_the_pool_together():
    prompts = long_prompts(NullTokenizer().encode, 5, 100, 16, seed=0)
    assert [len(prompt) for prompt in prompts] == [100] * 5
    assert len({tuple(prompt[:16]) for prompt in prompts}) == 5
    # each prompt with 8 output tokens: 7 blocks; plus the null block
    assert restart_pool_size(prompts, 8, 16) == (1 + 5 * 7, 7 * 16)


def kv_offloading_result(differing: list[int]) -> dict:
    counters = dict(prefix_cache_queries=0.0, prefix_cache_hits=0.0,
                    external_prefix_cache_queries=0.0, external_prefix_cache_hits=0.0,
                    kv_offload_loaded_bytes=0.0, kv_offload_stored_bytes=0.0)  # fmt: skip

    def row(arm: str, p50: float, **extra) -> dict:
        return {"arm": arm, "ttft_ms": {"p50": p50, "p90": 2 * p50, "p99": 3 * p50},
                "ttft_mean_ms": p50, "first_visit_ttft_mean_ms": 900.0, "total_s": 12.5,
                "num_revisits": 4, **counters, "server_warnings": [], **extra}  # fmt: skip

    tier = row("host tier", 250.0, prefix_cache_hits=512.0, external_prefix_cache_hits=960.0,
               external_prefix_cache_queries=1400.0, kv_offload_loaded_bytes=3 * 2**20)  # fmt: skip
    return {
        "server": "core-serve --device cpu --block-size 16",
        "omp_num_threads": 1,
        "prefix_hash_seed": "00" * 16,
        "host_tier_gib": 1.0,
        "chat": {
            "shape": {
                "num_conversations": 2,
                "num_visits": 3,
                "document_tokens": 64,
                "opening_tokens": 48,
                "user_tokens": 16,
                "max_tokens": 8,
            },  # fmt: skip
            "pool": {
                "num_gpu_blocks": 15,
                "block_size": 16,
                "num_shared_blocks": 4,
                "num_blocks_beyond_document": 10,
                "max_own_blocks": 5,
                "min_blocks_between_visits": 12,
                "max_model_len": 144,
            },  # fmt: skip
            "prompt_tokens": [112, 112, 136, 136, 160, 160],
            "document_hit_tokens": 256,
            "rows": [row("no tier", 1000.0), tier],
            "differing_replies": differing,
            "ttft_p50_ratio": 0.25,
            "ttft_mean_ratio": 0.25,
            "total_ratio": 0.5,
        },
        "restart": {
            "num_prompts": 2,
            "prompt_tokens": 128,
            "max_tokens": 8,
            "num_files_after_first": 16,
            "bytes_on_disk_after_first": 8 * 2**20,
            "num_files_after_warm": 16,
            "rows": [
                row("first (fills DIR)", 800.0),
                row("warm (restarted on DIR)", 100.0),
                row("cold (empty DIR)", 800.0),
            ],
            "differing_replies_warm_vs_cold": [],
            "ttft_p50_ratio": 0.125,
            "ttft_mean_ratio": 0.125,
        },  # fmt: skip
    }


def test_kv_offloading_markdown_has_the_flags_both_tables_and_the_checks():
    text = render_kv_offloading(kv_offloading_result(differing=[]))
    assert "`--num-gpu-blocks-override 15 --max-model-len 144`" in text
    assert "`--kv-offloading-size 1`" in text
    assert "| host tier | 250/500 | 250 | 900 | 12.5 | 512 | 960/1400 | 3.0 |" in text
    assert "TTFT host tier / no tier: **0.25** at p50, 0.25 in the mean, 0.50 in total" in text
    assert "the host tier's replies equal no tier's (6 of 6)" in text
    assert "| warm (restarted on DIR) | 100 | 100 | 12.5 | 0 | 0/0 | 0.0 |" in text
    assert "TTFT warm / cold: **0.12** at p50" in text
    assert "16 block files (8.0 MiB)" in text
    assert "removed" not in text and "Warnings" not in text
    result = kv_offloading_result(differing=[3, 5])
    result["restart"]["num_files_after_warm"] = 13
    result["restart"]["rows"][1]["server_warnings"] = ["... WARNING KV disk tier: ignoring"] * 2
    text = render_kv_offloading(result)
    assert "differ from no tier's in 2 of 6 (positions [3, 5])" in text
    assert "16 block files (8.0 MiB) in DIR (of which the warm server removed 3)" in text
    assert "Warnings in the servers' logs (the lines are in the JSON): warm" in text


def test_kv_offloading_replies_differ_by_text_or_token_count():
    def reply(text: str, num_tokens: int) -> Reply:
        return Reply([1, 2], 0.1, text, num_tokens)

    same = [reply("a b", 2), reply("c", 1), reply("d", 1)]
    other = [reply("a b", 2), reply("c!", 1), reply("d", 2)]
    assert differing_replies(same, same) == []
    assert differing_replies(same, other) == [1, 2]


def test_kv_offloading_refuses_server_flags_it_sets_per_arm(capsys):
    with pytest.raises(SystemExit):
        bench_kv_offloading.parse_args(["--server-args", "--device cpu --max-model-len 512"])
    assert "may not hold --max-model-len" in capsys.readouterr().err
    args = bench_kv_offloading.parse_args(["--quick", "--server-args", "--device cuda"])
    assert args.chat_shape == QUICK_CHAT_SHAPE and args.output_dir.name == "gpu"


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
    peer = {"name": "vllm", "version": "9.9", "rows": rows}
    plot_serving({"rows": rows, "server": "test", "peer": peer}, results_dir / "serving_vllm.png")
    assert (results_dir / "serving_vllm.png").read_bytes().startswith(PNG_MAGIC)
    (results_dir / "offline.md").write_text("### Offline table\n")
    (results_dir / "serving.md").write_text("### Serving table\n")
    (results_dir / "offline_quick.md").write_text("### must not appear\n")
    (results_dir / "scheduler.md").write_text("| running |\n|---:|\n| 64 |\n")
    section = tmp_path / "benchmarks" / "README_SECTION.md"
    write_readme_section(results_dir, section)
    text = section.read_text()
    assert text.index("### Offline table") < text.index("### Serving table")
    assert "](benchmarks/results/serving.png)" in text
    assert "](benchmarks/results/serving_vllm.png)" not in text  # no serving_vllm.md table
    assert "must not appear" not in text
    assert "### Scheduler" in text and text.index("### Scheduler") < text.index("| running |")


# ---- peers, in-process and with fake runners ---------------------------------------------------

FAKE_VLLM_INIT = """
import sys

__version__ = "0.0.fake"


class SamplingParams:
    def __init__(self, max_tokens, temperature, ignore_eos):
        assert temperature == 0.0 and ignore_eos
        self.max_tokens = max_tokens


class _Completion:
    def __init__(self, token_ids):
        self.token_ids = token_ids


class _Output:
    def __init__(self, token_ids):
        self.outputs = [_Completion(token_ids)]


class LLM:
    def __init__(self, model, dtype, max_model_len, seed):
        print("INFO fake vLLM logs to stdout, as vLLM does", flush=True)
        self.dtype = dtype

    def reset_prefix_cache(self):
        return True

    def generate(self, prompts, params, use_tqdm):
        # token i of a request: its prompt's first id plus i, so outputs are checkable
        return [
            _Output([prompt["prompt_token_ids"][0] + i for i in range(p.max_tokens)])
            for prompt, p in zip(prompts, params)
        ]
"""
FAKE_VLLM_INPUTS = """
def TokensPrompt(prompt_token_ids):
    return {"prompt_token_ids": prompt_token_ids}
"""


def tiny_workload(name: str = "mixed") -> GenerationWorkload:
    return GenerationWorkload(name, "2 prompts", [[10, 11, 12], [20, 21]], [3, 2])


def write_fake_runner(tmp_path: Path, body: str) -> Path:
    """A stand-in runner: reads the request file, then runs `body` (Python, with `send`)."""
    script = tmp_path / "fake_runner.py"
    script.write_text(
        "import json, sys, time\n"
        "def send(message):\n"
        "    print(json.dumps(message), flush=True)\n"
        "request = json.load(open(sys.argv[1]))\n" + body
    )
    (tmp_path / "request.json").write_text(json.dumps({"model": "m"}))
    return script


def fake_peer(tmp_path: Path, body: str) -> PeerProcess:
    script = write_fake_runner(tmp_path, body)
    argv = [sys.executable, str(script), str(tmp_path / "request.json")]
    return PeerProcess(argv, "fake peer", tmp_path / "peer.log", cwd=tmp_path)


def test_offline_args_choose_peers_threads_and_dtype(monkeypatch):
    monkeypatch.setenv("VLLM_PYTHON", "/venv/bin/python")
    monkeypatch.setattr(vllm_peer, "vllm_version", lambda python: "9.9")
    args = bench_offline.parse_args([])
    assert args.peers == ["transformers"] and args.threads is None and args.dtype is None
    assert args.peer_python is None  # only looked up for vLLM
    args = bench_offline.parse_args(["--peer", "vllm", "transformers", "vllm", "--quick"])
    assert args.peers == ["vllm", "transformers"] and args.repeats == 1
    assert args.peer_python == "/venv/bin/python"
    args = bench_offline.parse_args(
        ["--peers", "vllm", "--peer-python", "/p", "--dtype", "bfloat16"]
    )
    assert args.peers == ["vllm"] and args.peer_python == "/p" and args.dtype == "bfloat16"
    for bad in (["--threads", "0"], ["--peer", "sglang"], ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            bench_offline.parse_args(bad)


def test_a_missing_llama_server_is_a_clear_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ValueError, match="llama-server is not on PATH.*--llama-server PATH"):
        find_llama_server(None)
    with pytest.raises(ValueError, match="--llama-server /no/such/llama-server: no such"):
        find_llama_server("/no/such/llama-server")
    with pytest.raises(SystemExit):
        bench_offline.parse_args(["--peer", "llama-server"])
    assert "llama-server is not on PATH" in capsys.readouterr().err


def test_a_peer_dtype_for_llama_server_is_a_clear_error(capsys):
    """llama-server runs the GGUF's own weight types: a peer dtype would be a false label."""
    with pytest.raises(SystemExit):
        bench_offline.parse_args(["--peer", "llama-server", "--peer-dtype", "bfloat16"])
    assert "--peer-dtype bfloat16 does not apply to llama-server" in capsys.readouterr().err


def test_results_file_names_keep_the_transformers_table_apart():
    assert results_file_name("cpu", ["transformers"]) == "offline"
    assert results_file_name("cpu", ["vllm"]) == "offline_vllm"
    assert results_file_name("cpu", ["transformers", "llama-server"]) == (
        "offline_transformers_llama_server"
    )
    assert results_file_name("cuda", ["transformers"]) == "offline_cuda"
    # peers in a dtype of their own (vLLM bf16 beside a float32 engine) keep their own file
    assert results_file_name("cpu", ["vllm"], "bfloat16") == "offline_vllm_peer_bfloat16"


def test_cpu_list_text_joins_ranges():
    assert cpu_list_text([0, 1]) == "0-1"
    assert cpu_list_text([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert cpu_list_text([3]) == "3"
    with pytest.raises(ValueError):
        cpu_list_text([])


def test_comparison_row_reports_the_median_pair_and_agreement():
    workload = tiny_workload()
    pairs = [(1.0, 2.0), (1.0, 4.0), (2.0, 2.0)]  # ratios 2, 4, 1 -> median pair (1.0, 2.0)
    row = comparison_row(workload, "vllm", pairs, [[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]])
    assert row["peer"] == "vllm" and (row["engine_s"], row["peer_s"]) == (1.0, 2.0)
    assert row["engine_output_tokens_per_s"] == 5.0 and row["peer_output_tokens_per_s"] == 2.5
    assert row["ratio"] == 2.0 and row["pair_ratios"] == [2.0, 4.0, 1.0]
    assert row["num_requests_first_tokens_agree"] == 1
    assert count_agreeing([[1, 2, 9]], [[1, 2, 8]], num_tokens=2) == 1


def offline_result(peers: dict, rows: list[dict], repeats: int = 1) -> dict:
    mixed = next((row["ratio"] for row in rows if row["peer"] == "transformers"), None)
    return {
        "device": "cpu", "dtype": "float32", "num_threads": 2, "repeats": repeats,
        "peers": peers, "rows": rows, "mixed_speedup": mixed, "target_speedup_mixed": 2.0,
        "meets_target": bool(mixed and mixed >= 2.0),
    }  # fmt: skip


def test_offline_markdown_has_a_table_per_peer():
    workload = tiny_workload()
    hf_row = comparison_row(
        workload, "transformers", [(1.0, 2.5), (1.0, 3.0)], [[1], [2]], [[1], [2]]
    )
    hf_row.update(engine_token_passes=10, peer_token_passes=15, work_ratio=1.5)
    vllm_row = comparison_row(workload, "vllm", [(1.0, 0.5), (1.0, 0.4)], [[1], [2]], [[1], [3]])
    peers = {
        "transformers": {"label": "transformers `generate`", "column": "transformers"},
        "vllm": {"label": "vLLM 9.9 `LLM.generate`", "column": "vLLM", "note": "Own process."},
    }
    text = bench_offline.render_markdown(offline_result(peers, [hf_row, vllm_row], repeats=2))
    assert "vs transformers `generate` (cpu, float32, 2 threads)" in text
    assert (
        "| workload | engine output tok/s | transformers output tok/s | engine / transformers "
        "| token positions transformers / engine | same first 8 tokens |"
    ) in text
    vllm_section = text[text.index("vs vLLM 9.9 `LLM.generate` (cpu, float32, 2 threads)") :]
    assert "| workload | engine output tok/s | vLLM output tok/s | engine / vLLM | same first" in (
        vllm_section
    )
    assert "| mixed (2 prompts) | 5.0 | 12.5 | **0.40x** | 1/2 |" in vllm_section
    assert "token positions" not in vllm_section.split("Mixed workload")[0]
    assert "Own process." in vllm_section
    assert "all pairs: mixed 0.50x, 0.40x" in vllm_section
    assert "Mixed workload: engine / transformers = **2.50x** (target >= 2x, met)" in text
    only_vllm = bench_offline.render_markdown(offline_result({"vllm": peers["vllm"]}, [vllm_row]))
    assert "Mixed workload" not in only_vllm and "transformers" not in only_vllm
    bf16_peer = offline_result({"vllm": peers["vllm"]}, [vllm_row]) | {"peer_dtype": "bfloat16"}
    assert "(cpu, engine float32, vLLM bfloat16, 2 threads)" in bench_offline.render_markdown(
        bf16_peer
    )


def test_peer_messages_parse_or_fail_with_the_peer_s_words():
    assert parse_peer_message('{"type": "ready", "version": "1"}\n')["version"] == "1"
    with pytest.raises(PeerError, match="the peer failed: ValueError: bad dtype"):
        parse_peer_message('{"type": "error", "message": "ValueError: bad dtype"}')
    with pytest.raises(PeerError, match="not JSON"):
        parse_peer_message("INFO loading weights")
    with pytest.raises(PeerError, match="expected an object with type"):
        parse_peer_message('{"type": "hello"}')


def test_run_results_are_checked_against_the_workload():
    workload = tiny_workload()
    message = {"type": "result", "workload": "mixed", "elapsed_s": 0.5,
               "output_token_ids": [[1, 2, 3], [4, 5]]}  # fmt: skip
    assert parse_run_result(message, workload) == (0.5, [[1, 2, 3], [4, 5]])
    for bad, match in (
        ({"workload": "decode-heavy"}, "expected the result of workload 'mixed'"),
        ({"elapsed_s": 0}, "positive"),
        ({"output_token_ids": [[1, 2, 3]]}, "1 outputs for the 2 prompts"),
        ({"output_token_ids": [[1, 2, 3], [4]]}, "1 tokens for prompt 1 of 'mixed', asked 2"),
    ):
        with pytest.raises(PeerError, match=match):
            parse_run_result({**message, **bad}, workload)


def test_peer_process_speaks_json_lines(tmp_path):
    body = (
        "print('to the log', file=sys.stderr, flush=True)\n"
        "send({'type': 'ready', 'version': '1.2', 'model': request['model']})\n"
        "for line in sys.stdin:\n"
        "    name = json.loads(line)['run']\n"
        "    send({'type': 'result', 'workload': name, 'elapsed_s': 0.25,\n"
        "          'output_token_ids': [[7, 8, 9], [7, 8]]})\n"
        "print('exiting at end of input', file=sys.stderr, flush=True)\n"
    )
    with fake_peer(tmp_path, body) as peer:
        assert peer.start(timeout_s=30) == {"type": "ready", "version": "1.2", "model": "m"}
        for _ in range(2):
            message = peer.request({"run": "mixed"}, timeout_s=30)
            assert parse_run_result(message, tiny_workload()) == (0.25, [[7, 8, 9], [7, 8]])
        process = peer._process
    assert process.returncode == 0  # it exited by itself at the end of its input
    assert "to the log" in (tmp_path / "peer.log").read_text()
    assert "exiting at end of input" in (tmp_path / "peer.log").read_text()


def test_peer_process_failures_carry_the_log(tmp_path):
    crash = "print('Traceback: no model here', file=sys.stderr, flush=True)\nsys.exit(3)\n"
    with fake_peer(tmp_path, crash) as peer, pytest.raises(PeerError) as error:
        peer.start(timeout_s=30)
    assert "fake peer exited with code 3" in str(error.value)
    assert "Traceback: no model here" in str(error.value)
    never_ready = "sys.stdin.read()\n"  # exits at the end of its input, never ready before
    with fake_peer(tmp_path, never_ready) as peer, pytest.raises(PeerError) as error:
        peer.start(timeout_s=0.5)
    assert "did not start within 0 s" in str(error.value)
    refuse = "send({'type': 'ready', 'version': '1'})\nsys.stdin.readline()\n"
    refuse += "send({'type': 'error', 'message': 'RuntimeError: out of memory'})\n"
    with fake_peer(tmp_path, refuse) as peer, pytest.raises(PeerError, match="out of memory"):
        peer.start(timeout_s=30)
        peer.request({"run": "mixed"}, timeout_s=30)


def test_vllm_runner_over_a_fake_vllm_package(tmp_path, monkeypatch):
    """The real runner and `VllmOfflinePeer`, with a stand-in `vllm` package that logs to
    stdout as vLLM does: the protocol stays clean, the workloads and settings arrive."""
    package = tmp_path / "fake_site" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_VLLM_INIT)
    (package / "inputs.py").write_text(FAKE_VLLM_INPUTS)
    monkeypatch.setenv("PYTHONPATH", str(package.parent))
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    workload = tiny_workload()
    warm_up = GenerationWorkload("warm-up", "", [[1, 2]], [2])
    peer = vllm_peer.VllmOfflinePeer(
        sys.executable, tmp_path, "float32", 1, [workload], warm_up, tmp_path
    )
    try:
        assert peer.version == "0.0.fake" and peer.label == "vLLM 0.0.fake `LLM.generate`"
        elapsed_s, token_ids = peer.run(workload)
        assert elapsed_s > 0 and token_ids == [[10, 11, 12], [20, 21]]
        record = peer.describe()
        assert record["env"]["VLLM_CPU_OMP_THREADS_BIND"] == cpu_list_text(
            vllm_peer.vllm_cpu_ids(1)
        )
        assert record["dtype"] == "float32" and "VLLM_CPU_KVCACHE_SPACE=4" in record["note"]
    finally:
        peer.close()
    request = json.loads((tmp_path / "vllm_request.json").read_text())
    assert request["workloads"]["mixed"]["max_tokens"] == [3, 2]
    assert "fake vLLM logs to stdout" in (tmp_path / "vllm.log").read_text()


def test_vllm_env_and_serve_command(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    env = vllm_peer.vllm_env([0, 1])
    assert "OMP_NUM_THREADS" not in env
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert env["HF_HUB_OFFLINE"] == "1"
    argv = vllm_peer.vllm_serve_argv("/venv/bin/python", Path("/m"), 8123, "float32", "name")
    flags = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert flags["--model"] == "/m" and flags["--host"] == "127.0.0.1"
    assert flags["--port"] == "8123" and flags["--dtype"] == "float32"
    assert flags["--served-model-name"] == "name" and flags["--max-model-len"] == "2048"
    with pytest.raises(ValueError, match="vLLM binds one thread per core"):
        vllm_peer.vllm_cpu_ids(default_num_threads() + 1)
    with pytest.raises(ValueError, match="--peer-python /no/such/python: cannot run it"):
        vllm_peer.vllm_version("/no/such/python")


def test_serving_args_and_device(monkeypatch, capsys):
    monkeypatch.setenv("VLLM_PYTHON", "/no/such/python")
    with pytest.raises(SystemExit):
        bench_serving.parse_args(["--peer", "vllm"])
    assert "--peer-python /no/such/python: cannot run it" in capsys.readouterr().err
    monkeypatch.setenv("VLLM_PYTHON", "/venv/bin/python")
    monkeypatch.setattr(vllm_peer, "vllm_version", lambda python: "9.9")
    args = bench_serving.parse_args(["--quick", "--peer", "vllm"])
    assert args.peer == "vllm" and args.peer_python == "/venv/bin/python"
    assert args.peer_version == "9.9"
    assert args.num_requests == 8 and args.threads is None
    for bad in (
        ["--peer", "vllm", "--url", "http://127.0.0.1:8000"],
        ["--server-args", "--device cpu --dtype float32"],
        ["--threads", "0"],
    ):
        with pytest.raises(SystemExit):
            bench_serving.parse_args(bad)
    assert server_device("--device cpu --max-num-seqs 8") == "cpu"
    assert server_device("--device=cuda") == "cuda"
    assert server_device("--max-num-seqs 8") == "auto"


def serving_row(rate, throughput: float, ttft_ms: float) -> dict:
    to_ms = lambda p50: {"p50": p50, "p90": 2 * p50, "p99": 3 * p50}  # noqa: E731
    return {
        "offered_rate": rate, "request_throughput": throughput,
        "output_tokens_per_s": 10 * throughput, "ttft_ms": to_ms(ttft_ms),
        "itl_ms": to_ms(50.0), "latency_ms": to_ms(ttft_ms + 500), "num_errors": 0,
        "achieved_vs_offered": None, "ttft_p50_vs_lightest": 1.0, "itl_p50_vs_lightest": 1.0,
    }  # fmt: skip


def test_data_parallel_serving_args_workload_and_markdown():
    from benchmarks.serving import data_parallel as dp

    assert bench_serving.parse_args(["--data-parallel-size", "2"]).data_parallel_size == 2
    for bad in (["--data-parallel-size", "1"], ["--data-parallel-size", "2", "--url", "x"]):
        with pytest.raises(SystemExit):
            bench_serving.parse_args(bad)
    workload = dp.SharedPrefixWorkload.seeded(0, (5, 10), (4, 8))
    assert workload == dp.SharedPrefixWorkload.seeded(0, (5, 10), (4, 8))
    assert len(set(workload.prefixes)) == dp.NUM_PREFIXES
    rng = random.Random(1)
    for _ in range(20):
        prompt, max_tokens = workload.sample(rng)
        prefix, _, question = prompt.partition("\n\n")
        assert prefix in workload.prefixes and 5 <= len(question.split()) <= 10
        assert 4 <= max_tokens <= 8
    setups = [
        {
            "setup": s.name,
            "rows": [serving_row("inf", factor, 100.0)],
            "prefix_hit_rate": 0.5,
            "prompt_tokens_per_core": [100.0] * s.data_parallel_size,
        }
        for s, factor in zip(dp.setups(2), (1.0, 1.8, 1.2), strict=True)
    ]
    result = {
        "server": "core-serve --device cpu", "dtype": "float32", "num_requests_per_rate": 8,
        "num_prefixes": 4, "prefix_words": 300, "setups": setups, "total_errors": 0,
    }  # fmt: skip
    text = dp.render_markdown(result)
    assert "| inf | 10.0 | 100 | 18.0 | 100 | 12.0 | 100 | **1.80x** | **1.20x** |" in text
    assert "dp 2, 1 thread per core: 50.0%" in text
    assert "Prompt tokens per core: dp 2, 1 thread per core: 100 / 100." in text


def test_serving_ratios_and_markdown_with_a_peer():
    rows = [serving_row(1.0, 1.0, 100.0), serving_row("inf", 2.0, 400.0)]
    peer_rows = [serving_row(1.0, 0.5, 200.0), serving_row("inf", 4.0, 100.0)]
    ratios = peer_ratios(rows, peer_rows)
    assert ratios[0]["output_tokens_per_s"] == 2.0 and ratios[0]["ttft_p50"] == 0.5
    assert ratios[1]["request_throughput"] == 0.5 and ratios[1]["ttft_p50"] == 4.0
    assert ratios[1]["latency_p50"] == pytest.approx(900 / 600)
    with pytest.raises(ValueError, match="rates differ"):
        peer_ratios(rows, peer_rows[::-1])
    result = {
        "server": "core-serve --device cpu", "dtype": "float32", "num_threads": 2,
        "num_requests_per_rate": 2, "prompt_words": [5, 30], "output_tokens": [4, 12],
        "rows": rows, "total_errors": 0, "plot": "serving_vllm.png",
        "peer": {"name": "vllm", "version": "9.9", "server": "vllm serve /m --dtype float32",
                 "rows": peer_rows, "total_errors": 0, "env": {"VLLM_CPU_KVCACHE_SPACE": "4"}},
        "peer_ratios": ratios,
    }  # fmt: skip
    text = bench_serving.render_markdown(result)
    assert text.startswith("### Serving: core-serve --device cpu (float32, 2 threads), 2 streamed")
    assert "### Serving: vLLM 9.9, the same requests at the same rates" in text
    assert "Server: vllm serve /m --dtype float32. Errors: 0" in text
    assert "`VLLM_CPU_KVCACHE_SPACE=4`" in text
    assert "### Serving: engine / vLLM 9.9" in text
    assert "| inf | **0.50x** | 0.50x | 4.00x | 1.00x | 1.50x |" in text
    del result["peer"], result["peer_ratios"]
    assert "vLLM" not in bench_serving.render_markdown(result)


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
def test_profile_step_quick_times_every_part(tmp_path):
    """Every part has a timer that ran (a renamed layer function would leave it at zero)."""
    result = run_quick("micro.profile_step", "profile_step", tmp_path, "--name", "profile_step")
    assert result["output_tokens"] > 0
    for kind in ("decode", "prefill"):
        summary = result["summary"][kind]
        assert summary["num_steps"] > 0
        parts = summary["parts_ms_per_step"]
        for part in ("linears", "attention", "norms", "LM head", "sampling"):
            (name,) = [name for name in parts if name.startswith(part)]
            assert parts[name] > 0, f"{kind}: {name} was never timed"
        # The MLP's activation runs on its own or inside the gate_up kernel, never both ways.
        fused = parts["gate_up + SiLU-and-mul, fused in one kernel"] > 0
        assert fused != (parts["SiLU-and-mul"] > 0), f"{kind}: {parts}"
        assert fused == (cpu_f32_matmul.panel_columns() > 0)


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
    import argparse

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


# ---- the GPU run kit (benchmarks/gpu/check.py): its dry run goes through the same plumbing as a
# GPU run; its parsers read real tool output shapes; its sanitizer cases launch every kernel
# they promise (in the CPU emulator of the CUDA kernels); what it imports exists on the GPU
# machine or in its wheelhouse; its benchmark targets are the issue's. -------------------------


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run of a machine without CUDA")
def test_dry_run_records_every_step_and_runs_the_engine_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu.check", "--dry-run", "--out", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    report = json.loads((out / gpu_check.REPORT_JSON).read_text())
    steps = {step["name"]: step for step in report["steps"]}
    assert list(steps) == ["gpu tests", "attention benchmark", "engine tiny", "compute-sanitizer"]
    assert steps["gpu tests"]["status"] == "skipped"
    assert steps["gpu tests"]["figures"]["collected"] >= 100
    assert steps["gpu tests"]["figures"]["files"] == ["tests/test_kernels_gpu.py"]
    for name in ("compute-sanitizer", "attention benchmark"):
        assert steps[name] | {"seconds": 0} == {
            "name": name, "status": "skipped", "summary": "skipped: no CUDA", "seconds": 0,
            "figures": {},
        }  # fmt: skip
    engine = steps["engine tiny"]
    assert engine["status"] == "passed", engine
    assert engine["figures"]["parity"]["equal"]
    assert engine["figures"]["throughput"]["output_tok_s"] > 0
    assert report["environment"]["torch"] == torch.__version__
    # What comes back from the GPU machine: at most 8 files, none in a subfolder.
    files = list(out.iterdir())
    assert 3 <= len(files) <= 8 and all(f.is_file() for f in files)
    markdown = (out / gpu_check.REPORT_MD).read_text()
    assert all(f"| {name} |" in markdown for name in steps)
    assert "===== engine tiny" in (out / gpu_check.LOG_FILE).read_text()


def test_a_failing_step_is_recorded_and_the_next_steps_still_run(tmp_path, monkeypatch):
    def broken(context, timeout_s):
        raise KeyError("a bug in the kit")

    def fine(context, timeout_s):
        return gpu_check.StepResult("fine", "passed", "ran")

    monkeypatch.setattr(
        gpu_check,
        "kit_steps",
        lambda dry_run: [gpu_check.Step("broken", 10, broken), gpu_check.Step("fine", 10, fine)],
    )
    monkeypatch.setattr(gpu_check, "environment", lambda: {"python": "3"})
    results = gpu_check.run_kit(tmp_path, dry_run=True, budget_s=100)
    assert [(r.name, r.status) for r in results] == [("broken", "failed"), ("fine", "passed")]
    assert "KeyError" in results[0].summary
    saved = json.loads((tmp_path / gpu_check.REPORT_JSON).read_text())
    assert [step["status"] for step in saved["steps"]] == ["failed", "passed"]


def test_steps_that_no_longer_fit_the_budget_are_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "environment", dict)
    results = gpu_check.run_kit(tmp_path, dry_run=True, budget_s=gpu_check.MIN_STEP_S - 1)
    assert results and all(r.status == "skipped" for r in results)
    assert all(r.summary.startswith("out of time") for r in results)


def test_a_step_past_its_timeout_is_killed_and_says_so(tmp_path):
    context = gpu_check.KitContext(tmp_path, tmp_path, dry_run=True, cuda=False, deadline=0)
    run = gpu_check.run_process(
        context, "sleeper", [sys.executable, "-c", "print('started', flush=True); "
                             "import time; time.sleep(30)"], timeout_s=2,
    )  # fmt: skip
    assert run.timed_out and "started" in run.output
    assert "sleeper" in context.log[0] and "timed out" in context.log[0]


def test_junit_counts_and_failing_ids(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(
        '<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="4" failures="1" '
        'errors="1" skipped="1"><testcase classname="tests.test_kernels_gpu" name="test_a"/>'
        '<testcase classname="tests.test_kernels_gpu" name="test_b"><failure message="x"/>'
        '</testcase><testcase classname="tests.test_kernels_gpu" name="test_c"><error/>'
        '</testcase><testcase classname="t" name="test_d"><skipped/></testcase>'
        "</testsuite></testsuites>"
    )
    assert junit_counts(path) == {
        "tests": 4, "failures": 1, "errors": 1, "skipped": 1,
        "failing": ["tests.test_kernels_gpu::test_b", "tests.test_kernels_gpu::test_c"],
    }  # fmt: skip


@pytest.mark.parametrize(
    ("returncode", "output", "outcome"),
    [
        (0, "========= ERROR SUMMARY: 0 errors\n", "clean"),
        (0, "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n", "clean"),
        (3, "========= Invalid __global__ read of size 4\n========= ERROR SUMMARY: 2 errors\n",
         "2 errors or hazards"),
        (1, "ok: case\n========= ERROR SUMMARY: 0 errors\n", "exit 1 (see the log)"),
        (0, "ok: case\n", "no sanitizer summary in the output"),
        (None, "", "timed out"),
    ],
)  # fmt: skip
def test_sanitizer_outcome(returncode, output, outcome):
    assert sanitizer_outcome(ProcessRun(returncode, output, 1.0)) == outcome


@pytest.mark.skipif(not compiler_available(), reason="g++ is not installed")
def test_sanitizer_cases_launch_every_kernel_they_promise(monkeypatch):
    """Every case in the CUDA emulator: each expected kernel launches, outputs match."""
    emulated = EmulatedLoader()
    monkeypatch.setattr(cuda_backend, "default_loader", lambda: emulated)
    monkeypatch.setattr(cuda_backend, "_launch", launch_on_cpu)
    monkeypatch.setattr(cuda_backend, "_num_sms", lambda device_index: 4)
    # Occupancy unknown, as without a GPU: decode splits by its CTAs-per-SM rule.
    monkeypatch.setattr(cuda_backend, "_resident_ctas_per_sm", lambda *args: None)
    monkeypatch.setattr(cuda_backend, "_max_shared_mem", lambda device_index: 227 * 1024)
    all_expected = set()
    for case in gpu_sanitize_cases.CASES:
        assert gpu_sanitize_cases.run_case(case, torch.device("cpu")) == []
        all_expected.update(case.expected_kernels)
    launched = {name for (_, name), kernel in emulated.kernels.items() if kernel.num_launches}
    for prefix in all_expected:
        assert any(name.startswith(prefix) for name in launched), prefix
    kinds = {name.split("<")[0] for name in launched}
    assert kinds == {
        "reshape_and_cache", "decode_attention", "decode_attention_tc", "merge_attention_states",
        "prefill_attention", "prefill_attention_tc",
    }  # fmt: skip


def test_sanitizer_case_script_refuses_to_run_without_cuda():
    if cuda_backend.is_available():
        pytest.skip("this machine has CUDA")
    assert gpu_sanitize_cases.main([]) == 2


IMPORT_PROBE = """
import sys
import benchmarks.gpu.engine_check, benchmarks.gpu.sanitize_cases, benchmarks.micro.attention
import tests.test_kernels_gpu, core_engine.frontend.llm, core_engine.core.engine_core_proc
import core_engine.worker.worker, core_engine.worker.model_executor.model_loader
import core_engine.worker.model_executor.safetensors_loader, core_engine.worker.__main__
print(" ".join(sorted({name.split(".")[0] for name in sys.modules})))
"""


def test_the_kit_imports_only_what_the_gpu_machine_has_or_the_wheelhouse_brings():
    completed = subprocess.run(
        [sys.executable, "-c", IMPORT_PROBE],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    ours = {"core_engine", "tools", "scripts", "tests"}
    third_party = {
        name
        for name in completed.stdout.split()
        if name not in sys.stdlib_module_names and not name.startswith("_") and name not in ours
    }
    allowed = gpu_check.GPU_MACHINE_HAS | gpu_check.GPU_MACHINE_LACKS_MODULES
    # Not packages: the editable install's finder, torch's build helpers, Cython's runtime.
    local = {
        name
        for name in third_party
        if name.startswith(("__editable__", "torchgen")) or name == "cython_runtime"
    }
    assert third_party - local - allowed == set()
    assert third_party >= gpu_check.GPU_MACHINE_LACKS_MODULES  # nothing brought for nothing


def test_wheelhouse_downloads_only_what_the_machine_lacks_at_our_versions(tmp_path):
    command = gpu_check.wheelhouse_command(tmp_path)
    assert command[:4] == [sys.executable, "-m", "pip", "download"]
    assert {"--no-deps", "--only-binary=:all:"} <= set(command)
    assert command[command.index("--python-version") + 1] == "3.12"
    assert "manylinux_2_28_x86_64" in command and str(tmp_path) in command
    pins = [arg for arg in command if "==" in arg]
    assert pins == [f"{name}=={importlib.metadata.version(name)}" for name in ("msgspec", "pyzmq")]


def test_kit_benchmark_shapes_and_targets_are_the_issues():
    decode = bench_attention.kit_decode_shapes()
    assert [(s.num_heads // s.num_kv_heads, s.batch, s.context_lens[0], s.head_dim)
            for s in decode] == [(1, 64, 4096, 128), (4, 64, 4096, 128), (8, 64, 4096, 128)]  # fmt: skip
    prefill = bench_attention.kit_prefill_shapes()
    assert [(batch, q_len, ctx) for batch, q_len, ctx, *_ in prefill] == [
        (8, 1024, 1024), (2, 4096, 4096),
    ]  # fmt: skip

    def decode_result(shape, pct):
        return bench_attention.DecodeResult(
            shape.label, 64, 4096.0, shape.num_heads, shape.num_kv_heads, 128, "bfloat16", 1,
            100.0, 1.0, None, pct, None, None, None, None,
        )  # fmt: skip

    def prefill_result(q_len, ratio):
        return bench_attention.PrefillResult(
            f"kit: prefill {q_len}", 1, q_len, q_len, 32, 8, 128, "bfloat16", 1.0, 1.0, 1.0, 1.0,
            ratio, "flash",
        )  # fmt: skip

    targets = bench_attention.check_targets(
        [decode_result(decode[0], 50.0), decode_result(decode[1], 86.0),
         decode_result(decode[2], 84.0)],
        [prefill_result(1024, 0.71), prefill_result(4096, 0.69)],
    )  # fmt: skip
    assert [(t["name"], t["met"]) for t in targets] == [
        ("decode b64 ctx4k group 4 >= 85% of copy ceiling", True),
        ("decode b64 ctx4k group 8 >= 85% of copy ceiling", False),
        ("prefill 1024 tokens >= 0.7x SDPA (flash)", True),
        ("prefill 4096 tokens >= 0.7x SDPA (flash)", False),
    ]


# ---- the serving measurement tools: /proc accounting, step statistics, vLLM's client's command
# line and the engine / vLLM comparison, on this process and on fake results (no vLLM). --------


def test_proc_stats_see_this_process_and_a_busy_child():
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\n"
                              "while time.time() - t < 1.5: pass"])  # fmt: skip
    try:
        time.sleep(0.2)
        pids = proc_stats.process_tree(os.getpid())
        assert os.getpid() in pids and child.pid in pids
        before = proc_stats.snapshot(pids)
        time.sleep(0.8)
        deltas = proc_stats.thread_deltas(before, proc_stats.snapshot(pids))
    finally:
        child.wait()
    busiest = deltas[0]
    assert busiest.pid == child.pid and busiest.process == "-c"
    assert 0.3 <= busiest.cpu_s <= 1.2
    totals = proc_stats.per_process(deltas)
    assert totals["-c"]["threads"] == 1 and totals["-c"]["cpu_s"] == busiest.cpu_s


def test_process_label_names_python_modules():
    assert proc_stats.process_label(os.getpid()) in ("pytest", "py.test", "__main__.py")


def record(sent, received, tokens, reqs, decodes):
    return StepRecord(sent, received, tokens, reqs, decodes)


def test_step_stats_split_decode_and_prefill_steps_and_measure_gaps():
    records = [
        record(0.000, 0.100, 200, 2, 0),  # prefill
        record(0.110, 0.140, 2, 2, 2),  # decode, batch 2
        record(0.150, 0.170, 2, 2, 2),
        record(0.200, 0.230, 1, 1, 1),  # decode, batch 1
    ]
    stats = step_stats(records)
    assert stats["num_steps"] == 4 and stats["num_prefill_steps"] == 1
    assert math.isclose(stats["prefill_step_ms_median"], 100.0)
    assert stats["decode_steps_by_batch"] == {1: 1, 2: 2}
    assert math.isclose(stats["decode_step_ms_median_by_batch"][2], 25.0)
    assert math.isclose(stats["gap_ms_total"], 10 + 10 + 30)
    assert math.isclose(stats["gap_ms_median"], 10.0)
    assert math.isclose(stats["span_s"], 0.230)
    assert math.isclose(stats["steps_s"], 0.100 + 0.030 + 0.020 + 0.030)


def test_vllm_client_argv_runs_the_random_burst_with_ignore_eos(tmp_path):
    argv = bench_serve_argv("/venv/bin/python", "http://127.0.0.1:9", "m", tmp_path / "tok",
                            SATURATION, tmp_path, "r.json")  # fmt: skip
    assert argv[0] == "/venv/bin/python" and argv[1] == "-c"
    pairs = dict(zip(argv[3::1], argv[4::1], strict=False))
    assert pairs["--random-input-len"] == "128" and pairs["--random-output-len"] == "64"
    assert pairs["--num-prompts"] == "64" and pairs["--request-rate"] == "inf"
    assert pairs["--endpoint"] == "/v1/completions" and "--ignore-eos" in argv


def fake_result(throughput, ttft, tpot, completed=64):
    return {"output_throughput": throughput, "median_ttft_ms": ttft, "median_tpot_ms": tpot,
            "median_itl_ms": tpot, "p99_tpot_ms": 2 * tpot, "completed": completed,
            "num_prompts": 64}  # fmt: skip


def test_summary_counts_failed_requests_when_the_client_does_not():
    assert summary(fake_result(100.0, 5.0, 2.0, completed=60))["failed"] == 4


def test_ratios_and_markdown_compare_engine_with_vllm():
    ours = {"saturation": {"summary": summary(fake_result(150.0, 400.0, 30.0))}}
    theirs = {"saturation": {"summary": summary(fake_result(100.0, 500.0, 40.0))}}
    table = serving_vllm_client.ratios(ours, theirs)
    assert math.isclose(table["saturation"]["output_throughput"], 1.5)
    assert math.isclose(table["saturation"]["median_ttft_ms"], 0.8)
    result = {
        "machine": {"processor": "cpu", "num_cpus": 2, "memory_gib": 24.0,
                    "load_average_1m": 0.0, "python": "3", "git_commit": "x",
                    "date_utc": "now", "cpu_simd": "AVX2"},
        "client": "vllm bench serve", "server": "core-serve", "peer": "vLLM",
        "num_threads": 2, "workloads": {"saturation": SATURATION.describe()},
        "engine": ours, "vllm": theirs, "ratios": table,
    }  # fmt: skip
    markdown = serving_vllm_client.render_markdown(result)
    assert "| output tok/s | 150.0 | 100.0 | 1.50 |" in markdown
    assert "AVX2" in markdown and "64 prompts, 128 in / 64 out, rate inf" in markdown


# ---- bench_spec_decode's parts, in process: closed-loop timing, the copy-heavy chats, the run
# plan, the rows, ratios and equality gate, the arguments, and the vLLM runner over a stand-in
# `vllm` package (nothing here imports or needs vLLM) ----
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}  # fmt: skip


# ---- closed loop -------------------------------------------------------------------------------


def test_closed_loop_keeps_the_batch_full_and_starts_requests_in_order():
    in_flight, max_in_flight, started = 0, 0, []

    async def send(index: int) -> RequestTiming:
        nonlocal in_flight, max_in_flight
        in_flight += 1
        max_in_flight = max(max_in_flight, in_flight)
        started.append(index)
        await asyncio.sleep(0.001 * (index % 3))
        in_flight -= 1
        return RequestTiming(0.0, 1.0, 2.0, [index])

    run = asyncio.run(run_closed_loop(send, 10, 3))
    assert max_in_flight == 3 and started == list(range(10))
    assert run.output_token_ids == [[index] for index in range(10)]  # prompt order
    assert run.elapsed_s > 0
    with pytest.raises(ValueError, match="concurrency must be at least 1, got 0"):
        asyncio.run(run_closed_loop(send, 1, 0))


def test_tpot_divides_the_decode_time_by_the_tokens_after_the_first():
    timing = RequestTiming(start_s=10.0, first_token_s=10.5, end_s=12.5, output_token_ids=[1] * 5)
    assert timing.tpot_s == pytest.approx(0.5) and timing.ttft_s == pytest.approx(0.5)
    assert RequestTiming(0.0, 1.0, 1.0, [7]).tpot_s is None  # one token: no decode time
    assert RequestTiming(0.0, None, 1.0, []).ttft_s is None
    other = RequestTiming(0.0, 0.1, 0.4, [1, 2])  # TPOT 300 ms
    run = ClosedLoopRun(elapsed_s=2.0, requests=[timing, other])
    summary = run.summary()
    assert summary["num_output_tokens"] == 7 and summary["output_tokens_per_s"] == 3.5
    assert summary["tpot_ms"]["mean"] == pytest.approx(400.0)
    assert summary["tpot_ms"]["p50"] == pytest.approx(400.0)


def test_request_records_from_a_peer_are_checked():
    record = {"start_s": 1, "first_token_s": 2.0, "end_s": 3.0, "output_token_ids": [5, 6]}
    assert RequestTiming.from_json(record) == RequestTiming(1.0, 2.0, 3.0, [5, 6])
    with pytest.raises(ValueError, match="'end_s' must be a number"):
        RequestTiming.from_json({**record, "end_s": "late"})
    with pytest.raises(ValueError, match="'output_token_ids' must be a list"):
        RequestTiming.from_json({**record, "output_token_ids": None})


def test_first_differences_find_the_first_differing_position():
    reference = [[1, 2, 3], [4, 5], [6, 7, 8]]
    assert first_differences(reference, [[1, 2, 3], [4, 9], [6, 7]]) == [None, 1, 2]
    with pytest.raises(ValueError, match="2 outputs to compare with 3 references"):
        first_differences(reference, [[1], [2]])


def test_spec_decode_counts_deltas_and_rates():
    before = SpecDecodeCounts(10, 40, 20, [8, 6, 4, 2])
    after = SpecDecodeCounts(14, 56, 29, [11, 9, 6, 3])
    run = after.minus(before)
    assert run == SpecDecodeCounts(4, 16, 9, [3, 3, 2, 1])
    assert run.acceptance_rate == pytest.approx(9 / 16)
    assert run.mean_acceptance_length == pytest.approx(1 + 9 / 4)
    assert SpecDecodeCounts().acceptance_rate is None
    assert SpecDecodeCounts().mean_acceptance_length is None
    assert SpecDecodeCounts(1, 2, 1, [1]).minus(SpecDecodeCounts()) == SpecDecodeCounts(
        1, 2, 1, [1]
    )
    assert SpecDecodeCounts.from_json(run.to_json()) == run
    with pytest.raises(ValueError, match="spec_decode.num_drafts must be a count"):
        SpecDecodeCounts.from_json({"num_drafts": -1, "num_draft_tokens": 0,
                                    "num_accepted_tokens": 0})  # fmt: skip


# ---- workloads and plan ------------------------------------------------------------------------


def test_copy_heavy_chats_interleave_eight_distinct_tasks():
    assert len(COPY_HEAVY_TASKS) == 8
    assert len({task.name for task in COPY_HEAVY_TASKS}) == 8
    conversations = copy_heavy_conversations(4)
    assert len(conversations) == 32
    assert [name for name, _ in conversations[:8]] == [task.name for task in COPY_HEAVY_TASKS]
    contents = [conversation[0]["content"] for _, conversation in conversations]
    assert len(set(contents)) == 32 and all("{payload}" not in text for text in contents)
    # each reply's material is in the prompt: the payload is there whole
    for index, (name, conversation) in enumerate(conversations):
        task = COPY_HEAVY_TASKS[index % 8]
        assert name == task.name
        assert task.payloads[index // 8] in conversation[0]["content"]
    for bad in (0, 5):
        with pytest.raises(ValueError, match=f"num_per_task must be in \\[1, 4\\] .*, got {bad}"):
            copy_heavy_conversations(bad)


def test_chat_workload_renders_every_conversation_and_stops_at_eos():
    rendered = []

    def render(conversation):
        rendered.append(conversation)
        return [len(rendered), 100]

    workload = chat_workload(render, 2, max_tokens=64)
    assert workload.name == CHAT and workload.num_prompts == 16 and len(rendered) == 16
    assert workload.prompt_token_ids[3] == [4, 100]
    assert workload.max_tokens == 64 and workload.ignore_eos is False
    assert workload.to_json()["prompt_token_ids"] == workload.prompt_token_ids


def test_run_plan_sends_two_rounds_per_batch_and_everything_at_saturation():
    workload = DecodeWorkload(RANDOM, "", [[1]] * 64, 16, ignore_eos=True)
    plan = run_plan(workload, ["1", "4", "16", SATURATION_BATCH])
    assert plan == [("1", 1, 8), ("4", 4, 8), ("16", 16, 32), (SATURATION_BATCH, 64, 64)]
    assert num_prompts_for(6, 4, min_prompts=8, rounds=2) == 6  # never more than there are
    every_chat = run_plan(workload, ["1", "4"], min_prompts=32)
    assert every_chat == [("1", 1, 32), ("4", 4, 32)]


def test_speculative_configs_default_and_override():
    assert speculative_configs(["ngram"], []) == {"ngram": NGRAM}
    configs = speculative_configs(["ngram"], ['{"method": "suffix", "num_speculative_tokens": 8}'])
    assert configs == {"ngram": NGRAM, "suffix": {"method": "suffix", "num_speculative_tokens": 8}}
    override = '{"method": "ngram", "num_speculative_tokens": 2}'
    assert speculative_configs(["ngram", "suffix"], [override])["ngram"] == json.loads(override)
    with pytest.raises(ValueError, match="num_speculative_tokens must be in \\[1, 32\\], got 0"):
        speculative_configs([], ['{"method": "ngram", "num_speculative_tokens": 0}'])


def test_args_fill_defaults_and_refuse_bad_values(monkeypatch, capsys):
    args = bench_spec_decode.parse_args(["--quick", "--output-dir", "/tmp/x"])
    assert args.batch_sizes == ["1", "4", SATURATION_BATCH] and args.configs == {"ngram": NGRAM}
    args = bench_spec_decode.parse_args(["--output-dir", "/tmp/x", "--methods", "suffix"])
    assert args.batch_sizes == ["1", "4", "16", SATURATION_BATCH] and list(args.configs) == [
        "suffix"
    ]
    assert bench_spec_decode.parse_args([]).output_dir.parent.name == "results"
    bad_values = {
        "--batch-sizes takes integers >= 1 or 'sat', got '0'": ["--batch-sizes", "1", "0"],
        "--repeats must be >= 1, got 0": ["--repeats", "0"],
        "--kv-cache-gib must be positive, got 0.0": ["--kv-cache-gib", "0"],
        "speculative_config.method must be one of ('ngram', 'suffix'), got 'eagle'": [
            "--speculative-config", '{"method": "eagle"}'],
        "--peer vllm needs a real model": ["--peer", "vllm", "--model", "null"],
    }  # fmt: skip
    for message, argv in bad_values.items():
        with pytest.raises(SystemExit):
            bench_spec_decode.parse_args(argv)
        assert message in capsys.readouterr().err
    monkeypatch.setattr(vllm_peer, "vllm_version", lambda python: "9.9")
    monkeypatch.setenv("VLLM_PYTHON", "/venv/bin/python")
    assert bench_spec_decode.parse_args(["--peer", "vllm"]).peer_python == "/venv/bin/python"


# ---- rows, targets, markdown -------------------------------------------------------------------


def measurement(arm, workload, batch, seconds, tokens, counts=None, side="engine", repeat=0):
    """A run of len(tokens) requests that each took `seconds` after a first token at 0.1 s."""
    requests = [RequestTiming(0.0, 0.1, 0.1 + seconds, list(t)) for t in tokens]
    return Measurement(side, arm, workload, batch, len(tokens), repeat,
                       ClosedLoopRun(seconds, requests), counts or SpecDecodeCounts())  # fmt: skip


def test_rows_compare_each_arm_with_its_baseline_and_count_differences():
    same, other = [[1, 2, 3, 4, 5]] * 2, [[1, 2, 3, 4, 5], [1, 2, 9, 9, 9]]
    measurements = [
        measurement(BASELINE, CHAT, "1", 2.0, same),
        measurement("ngram", CHAT, "1", 1.0, same, SpecDecodeCounts(4, 16, 12, [4, 3, 3, 2])),
        measurement(BASELINE, RANDOM, SATURATION_BATCH, 1.0, same),
        measurement(
            "ngram", RANDOM, SATURATION_BATCH, 1.25, other, SpecDecodeCounts(2, 8, 0, [0] * 4)
        ),
    ]
    rows = build_rows(measurements)
    assert [(r["arm"], r["workload"], r["batch"]) for r in rows] == [
        (BASELINE, CHAT, "1"), ("ngram", CHAT, "1"),
        (BASELINE, RANDOM, SATURATION_BATCH), ("ngram", RANDOM, SATURATION_BATCH),
    ]  # fmt: skip
    baseline, ngram, _, saturated = rows
    assert baseline["speedup"] is None and baseline["num_differing_requests"] is None
    assert ngram["speedup"] == pytest.approx(2.0) and ngram["tpot_ratio"] == pytest.approx(0.5)
    assert ngram["output_tokens_per_s"] == pytest.approx(10.0)
    assert ngram["spec_decode"]["mean_acceptance_length"] == pytest.approx(4.0)
    assert ngram["num_differing_requests"] == 0
    assert saturated["speedup"] == pytest.approx(0.8)
    assert saturated["num_differing_requests"] == 1 and saturated["first_difference_positions"] == [
        2
    ]
    assert num_differing_requests(rows, "engine") == 1
    targets = engine_targets(rows)["ngram"]
    assert targets["batch1_chat_speedup"] == pytest.approx(2.0) and targets["meets_batch1_chat"]
    assert targets["saturation_random_ratio"] == pytest.approx(0.8)
    assert targets["meets_saturation_random"] is False


def test_repeats_report_medians_and_sum_the_drafting_counts():
    same = [[1, 2, 3]]
    measurements = [
        measurement(BASELINE, CHAT, "1", seconds, same, repeat=repeat)
        for repeat, seconds in enumerate((1.0, 2.0, 4.0))
    ] + [
        measurement("ngram", CHAT, "1", seconds, same, SpecDecodeCounts(1, 4, 2, [1, 1]), repeat=r)
        for r, seconds in enumerate((0.5, 0.5, 1.0))
    ]
    baseline, ngram = build_rows(measurements)
    assert len(ngram["runs"]) == 3 and ngram["spec_decode"]["num_drafts"] == 3
    assert ngram["spec_decode"]["num_accepted_tokens_per_pos"] == [3, 3]
    assert ngram["speedup"] == pytest.approx(4.0)  # ratios 2, 4, 4 per repeat
    assert baseline["output_tokens_per_s"] == pytest.approx(1.5)  # 3, 1.5, 0.75 tok/s


def test_markdown_shows_every_side_the_targets_the_gate_and_vllm_errors():
    same = [[1, 2, 3]]
    measurements = [
        measurement(BASELINE, CHAT, "1", 2.0, same),
        measurement("ngram", CHAT, "1", 1.0, same, SpecDecodeCounts(2, 8, 4, [2, 1, 1, 0])),
        measurement(BASELINE, CHAT, "1", 3.0, same, side="vllm"),
    ]
    rows = build_rows(measurements)
    result = {
        "workloads": [{"name": CHAT, "description": "8 chats"}], "rows": rows,
        "device": "cpu", "dtype": "float32", "model": "m", "repeats": 1,
        "speculative_configs": {"ngram": NGRAM}, "targets": engine_targets(rows),
        "num_differing_requests_engine": 0,
        "vllm": {BASELINE: {"version": "0.32.0"},
                 "ngram": {"speculative_config": NGRAM, "error": "ValueError: no ngram on CPU"}},
    }  # fmt: skip
    text = render_markdown(result)
    assert "### engine: copy-heavy-chat (8 chats)" in text
    assert "### vLLM 0.32.0: copy-heavy-chat (8 chats)" in text
    assert "| 1 | ngram | 3.0 | **2.00x** |" in text and "| 50% | 3.00 | 0/1 |" in text
    assert "**2.00x** output tok/s (target >= 1.8x, met)" in text
    assert "equality gate (passed): 0 engine requests" in text
    assert "- ngram (`" in text and "ValueError: no ngram on CPU" in text


# ---- vLLM, over a stand-in package -------------------------------------------------------------

FAKE_VLLM_FILES = {
    "__init__.py": """
__version__ = "0.0.fake"


class SamplingParams:
    def __init__(self, max_tokens, temperature, ignore_eos):
        assert temperature == 0.0
        self.max_tokens = max_tokens
""",
    "engine/__init__.py": "",
    "engine/arg_utils.py": """
class AsyncEngineArgs:
    def __init__(self, **kwargs):
        self.kwargs = kwargs
""",
    "v1/__init__.py": "",
    "v1/engine/__init__.py": "",
    "v1/engine/async_llm.py": """
import asyncio

from vllm.v1.metrics import reader


class _Completion:
    def __init__(self, token_ids):
        self.token_ids = token_ids


class _Output:
    def __init__(self, token_ids):
        self.outputs = [_Completion(token_ids)]


class AsyncLLM:
    @classmethod
    def from_engine_args(cls, args):
        config = args.kwargs["speculative_config"]
        if config is not None and config["method"] == "suffix":
            raise ValueError("Arctic Inference is required for suffix decoding")
        print("INFO fake vLLM logs to stdout, as vLLM does", flush=True)
        return cls(config)

    def __init__(self, config):
        self.config = config

    async def reset_prefix_cache(self):
        return True

    async def generate(self, prompt, params, request_id):
        # token i of a request: its prompt's first id plus i; cumulative outputs
        first = prompt["prompt_token_ids"][0]
        for count in range(1, params.max_tokens + 1):
            if self.config is not None and count > 1:
                reader.COUNTS["vllm:spec_decode_num_drafts"] += 1
                reader.COUNTS["vllm:spec_decode_num_draft_tokens"] += 2
                reader.COUNTS["vllm:spec_decode_num_accepted_tokens"] += 1
                reader.PER_POS[0] += 1
            await asyncio.sleep(0)
            yield _Output([first + i for i in range(count)])

    def shutdown(self):
        pass
""",
    "v1/metrics/__init__.py": "",
    "v1/metrics/reader.py": """
from dataclasses import dataclass

COUNTS = {"vllm:spec_decode_num_drafts": 0, "vllm:spec_decode_num_draft_tokens": 0,
          "vllm:spec_decode_num_accepted_tokens": 0}
PER_POS = [0, 0]


@dataclass
class Counter:
    name: str
    labels: dict
    value: int


@dataclass
class Vector:
    name: str
    labels: dict
    values: list


def get_metrics_snapshot():
    metrics = [Counter(name, {"engine": "0"}, value) for name, value in COUNTS.items()]
    return metrics + [Vector("vllm:spec_decode_num_accepted_tokens_per_pos", {}, list(PER_POS))]
""",
}


def test_vllm_arms_over_a_fake_vllm_package(tmp_path, monkeypatch):
    """The real runner and `measure_vllm` with a stand-in `vllm` package: runs with and
    without speculation arrive with their counter deltas; a config vLLM refuses is recorded
    with the error it gave, and the other arms still run."""
    site = tmp_path / "fake_site"
    for relative, text in FAKE_VLLM_FILES.items():
        path = site / "vllm" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    monkeypatch.setenv("PYTHONPATH", str(site))
    workload = DecodeWorkload(CHAT, "", [[10, 11], [20], [30, 31, 32]], 4, ignore_eos=False)
    warm_up = DecodeWorkload("warm-up", "", [[1, 2]], 2, ignore_eos=False)
    args = argparse.Namespace(hf_model=tmp_path, model=None, peer_python=sys.executable,
                              seed=0, repeats=1, min_prompts=8,
                              batch_sizes=["1", SATURATION_BATCH])  # fmt: skip
    configs = {"ngram": NGRAM, "suffix": {"method": "suffix"}}
    measurements, records = measure_vllm(args, configs, [workload], warm_up, "float32", tmp_path)
    assert (
        records[BASELINE]["version"] == "0.0.fake"
        and records["ngram"]["speculative_config"] == NGRAM
    )
    assert "Arctic Inference is required" in records["suffix"]["error"]
    assert [(m.arm, m.batch) for m in measurements] == [
        (BASELINE, "1"), (BASELINE, SATURATION_BATCH), ("ngram", "1"), ("ngram", SATURATION_BATCH),
    ]  # fmt: skip
    expected = [[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]]
    assert all(m.run.output_token_ids == expected for m in measurements)
    assert measurements[0].counts == SpecDecodeCounts(0, 0, 0, [0, 0])
    # 3 requests x 3 tokens after the first, one draft each (the counters of the warm-up and
    # the earlier run are not in this run's deltas)
    assert measurements[3].counts == SpecDecodeCounts(9, 18, 9, [9, 0])
    rows = build_rows(measurements)
    assert {row["num_differing_requests"] for row in rows if row["arm"] == "ngram"} == {0}


def test_peer_results_are_checked():
    record = {"start_s": 0.0, "first_token_s": 0.1, "end_s": 0.2, "output_token_ids": [1]}
    counts = {"num_drafts": 1, "num_draft_tokens": 2, "num_accepted_tokens": 1,
              "num_accepted_tokens_per_pos": [1, 0]}  # fmt: skip
    message = {"type": "result", "workload": CHAT, "elapsed_s": 0.5, "requests": [record],
               "spec_decode": counts}  # fmt: skip
    run, parsed = parse_closed_loop_result(message, CHAT, 1)
    assert run.elapsed_s == 0.5 and parsed == SpecDecodeCounts(1, 2, 1, [1, 0])
    for bad, error in (
        ({"workload": RANDOM}, "expected the result of 'copy-heavy-chat'"),
        ({"requests": []}, "0 request records for 1 prompts"),
        ({"elapsed_s": 0}, "elapsed_s must be a positive number"),
        ({"requests": [{**record, "end_s": None}]}, "'end_s' must be a number"),
    ):
        with pytest.raises(PeerError, match=error):
            parse_closed_loop_result({**message, **bad}, CHAT, 1)


def test_results_go_to_a_folder_named_after_the_cpu_kind(monkeypatch):
    from benchmarks.harness.common import RESULTS_DIR, device_results_dir
    from core_engine.worker import cpu_features

    monkeypatch.setattr(cpu_features, "host_cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert device_results_dir("cpu") == RESULTS_DIR / "avx2"
    flags = frozenset({"avx2", "avx512f", "avx512_bf16"})
    monkeypatch.setattr(cpu_features, "host_cpu_flags", lambda: flags)
    assert device_results_dir("cpu") == RESULTS_DIR / "avx512_bf16"
    monkeypatch.setattr(cpu_features, "host_cpu_flags", lambda: frozenset())
    assert device_results_dir("cpu") == RESULTS_DIR / "generic_cpu"
    assert device_results_dir("cuda") == RESULTS_DIR / "gpu"


def test_the_vllm_runner_imports_nothing_of_the_project():
    source = (Path(bench_spec_decode.__file__).with_name("peer_vllm_spec_decode.py")).read_text()
    imports = [
        line.split()[1] for line in source.splitlines() if line.startswith(("import ", "from "))
    ]
    assert set(imports) <= {"asyncio", "json", "os", "sys", "time", "traceback"}


# ---- bench_pd_disaggregation's parts, in process: the workload, the stream statistics, the
# comparison across arms and the markdown ------------------------------------------------------


PD_SHAPE = WorkloadShape(
    num_decode_streams=3,
    decode_prompt_tokens=(5, 9),
    decode_output_tokens=(20, 30),
    num_long_prompts=4,
    long_prompt_tokens=(100, 140),
    long_output_tokens=8,
    first_long_offset_s=0.5,
    long_interval_s=2.0,
)


def fake_encode(text: str) -> list[int]:
    """One id per word (its length): a stand-in tokenizer with a known count."""
    return [len(word) for word in text.split()]


def test_pd_workload_sends_decode_streams_first_then_long_prompts_on_schedule():
    requests = build_workload(PD_SHAPE, fake_encode, seed=3)
    decode, long = requests[:3], requests[3:]
    assert [request.kind for request in requests] == [DECODE] * 3 + [LONG] * 4
    assert [request.offset_s for request in decode] == [0.0, 0.0, 0.0]
    assert [request.offset_s for request in long] == [0.5, 2.5, 4.5, 6.5]
    for request in decode:
        assert 5 <= len(request.prompt_token_ids) <= 9 and 20 <= request.max_tokens <= 30
    for request in long:
        assert 100 <= len(request.prompt_token_ids) <= 140 and request.max_tokens == 8
    assert len({request.prompt_token_ids for request in requests}) == len(requests)
    assert build_workload(PD_SHAPE, fake_encode, seed=3) == requests  # seeded
    assert build_workload(PD_SHAPE, fake_encode, seed=4) != requests
    assert PD_SHAPE.max_tokens_per_request == 148


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"long_prompt_tokens": (10, 5)}, r"long_prompt_tokens must be a range .* \(10, 5\)"),
        ({"decode_output_tokens": (0, 5)}, r"decode_output_tokens must be a range"),
        ({"num_decode_streams": 0}, "at least one decode stream"),
        ({"long_interval_s": 0.0}, "long_interval_s > 0, got 0.5 and 0.0"),
    ],
)
def test_a_bad_pd_workload_shape_is_refused_naming_the_value(change, error):
    fields = {name: getattr(PD_SHAPE, name) for name in PD_SHAPE.__slots__}
    with pytest.raises(ValueError, match=error):
        WorkloadShape(**{**fields, **change})


def streamed(start_s: float, chunk_times_s: list[float], num_tokens: int, text="x"):
    end_s = chunk_times_s[-1] + 0.01 if chunk_times_s else start_s
    return StreamedCompletion(start_s, end_s, chunk_times_s, text, 5, num_tokens)


def test_itl_statistics_keep_the_stall_and_tpot_spans_the_tokens_after_the_first():
    # Two streams; the 1.0 s gap of the first is the stall a long prefill causes.
    first = streamed(0.0, [0.1, 0.2, 0.3, 1.3, 1.4], 5)
    second = streamed(0.0, [0.2, 0.3, 0.4], 3)
    failed = StreamedCompletion(0.0, 9.0, [5.0, 9.0], "", 0, 2, error="HTTP 500")
    assert tpot_s(first) == pytest.approx(1.3 / 4)
    assert math.isnan(tpot_s(streamed(0.0, [0.5], 1)))
    stats = decode_stream_stats([first, second, failed])
    itl = stats["itl_ms"]  # gaps: 100, 100, 1000, 100 | 100, 100 (the failed stream left out)
    assert itl["max"] == pytest.approx(1000.0)
    assert itl["p50"] == pytest.approx(100.0)
    assert itl["p90"] == pytest.approx(550.0)  # rank 4.5 of 6: halfway from 100 to 1000
    assert itl["mean"] == pytest.approx(1500.0 / 6)
    assert stats["tpot_ms"]["mean"] == pytest.approx((325.0 + 100.0) / 2)
    assert stats["ttft_ms"]["p50"] == pytest.approx(150.0)


def test_long_prompts_during_decode_count_those_answered_before_the_first_stream_ended():
    decode = [streamed(0.0, [1.0, 4.0], 2), streamed(0.0, [1.0, 6.0], 2)]  # ends 4.01, 6.01
    # first tokens at 2.0 and 3.9 (in), 4.5 (after the first stream ended), none (failed)
    long = [streamed(start, [start + 1.0], 1) for start in (1.0, 2.9, 3.5)]
    long.append(StreamedCompletion(0.5, 9.0, [], "", 0, 0, error="HTTP 503"))
    assert num_long_prompts_during_decode(decode, long) == 2


def test_text_mismatches_name_the_request_and_the_first_differing_character():
    assert text_mismatches(["abc", "de"], ["abc", "de"]) == []
    assert text_mismatches(["abc", "de", "xy"], ["abd", "de", "x"]) == [
        {"request": 0, "first_differing_char": 2},
        {"request": 2, "first_differing_char": 1},
    ]
    with pytest.raises(ValueError, match="cannot compare 1 texts with 2 references"):
        text_mismatches(["a", "b"], ["a"])


def pd_row(arm: str, itl_ms: list[float], long_ttft_ms: float, total_s: float, texts) -> dict:
    stats = lambda values: {"p50": values[0], "p90": values[1], "p99": values[2],  # noqa: E731
                            "max": values[3], "mean": values[0]}  # fmt: skip
    return {
        "arm": arm,
        "total_s": total_s,
        "decode": {"itl_ms": stats(itl_ms), "tpot_ms": stats(itl_ms), "ttft_ms": stats(itl_ms)},
        "long": {"ttft_ms": stats([long_ttft_ms] * 4)},
        "num_long_prompts_during_decode": 4,
        "num_errors": 0,
        "num_wrong_length": 0,
        "decode_texts": texts,
        "long_texts": ["L"],
        "placement": f"{arm} somewhere",
        "worker_threads": {"one": 2},
        "load_average_1m_at_start": 0.5,
    }


def test_pd_report_compares_texts_and_divides_by_one_instance():
    rows = [
        pd_row("one instance", [50, 60, 900, 1000], 1000.0, 20.0, ["same", "same"]),
        pd_row("disaggregated", [100, 110, 200, 250], 3000.0, 25.0, ["same", "other"]),
    ]
    compare_texts(rows)
    add_ratios(rows)
    assert rows[0]["text_mismatches"] == [] and rows[0]["vs_baseline"] is None
    assert rows[1]["text_mismatches"] == [
        {"kind": "decode", "request": 1, "first_differing_char": 0}
    ]
    ratios = rows[1]["vs_baseline"]
    assert ratios["itl_p50"] == pytest.approx(2.0) and ratios["itl_max"] == pytest.approx(0.25)
    assert ratios["long_ttft_p50"] == pytest.approx(3.0)
    assert ratios["total_s"] == pytest.approx(1.25)
    shape = {name: getattr(PD_SHAPE, name) for name in PD_SHAPE.__slots__}
    result = {"workload": shape, "rows": rows, "dtype": "float32", "seed": 0,
              "engine_flags": ["--device", "cpu"]}  # fmt: skip
    markdown = render_pd_markdown(result)
    assert "3 decode streams of 20-30 output tokens while 4 prompts of 100-140 tokens" in markdown
    baseline_row = (
        "| one instance | 50/60/900/1000 | 50.0 | 50 | 1000/1000/1000 | 20.0 | 4/4 | 0 | 0 |"
    )
    assert baseline_row in markdown
    assert "| disaggregated | 2.00x | 0.22x | 0.25x | 2.00x | 3.00x | 1.25x |" in markdown
    assert "disaggregated: decode request 1 from character 0" in markdown
    assert "`core-serve --device cpu`" in markdown
    assert "disaggregated somewhere; worker threads by server: one 2; load average 0.5" in markdown


def test_pd_args_put_one_instance_first_and_need_two_cpus(monkeypatch, capsys):
    monkeypatch.setattr(bench_pd_disaggregation, "usable_cpu_ids", lambda: [0, 1, 2])
    args = bench_pd_disaggregation.parse_args(["--arms", "single-core", "disaggregated"])
    assert args.arms == ["one instance", "one instance, 1 core", "disaggregated"]
    assert args.cpus == [0, 1]
    assert bench_pd_disaggregation.parse_args(["--cpus", "2", "0"]).cpus == [2, 0]
    for bad in (["--cpus", "1", "1"], ["--cpus", "0", "5"]):
        with pytest.raises(SystemExit):
            bench_pd_disaggregation.parse_args(bad)
        assert "needs two distinct usable CPUs; usable: 0-2" in capsys.readouterr().err
    assert args.shape.decode_output_tokens == (384, 512) and args.shape.long_interval_s == 2.5
    quick = bench_pd_disaggregation.parse_args(
        ["--quick", "--long-interval-s", "4", "--decode-output-tokens", "10", "20"]
    )
    assert quick.shape.long_interval_s == 4.0 and quick.shape.decode_output_tokens == (10, 20)
    assert quick.shape.long_prompt_tokens == (300, 400)  # the rest of the quick shape
    with pytest.raises(SystemExit):
        bench_pd_disaggregation.parse_args(["--long-interval-s", "0"])
    assert "long_interval_s > 0, got 2.0 and 0.0" in capsys.readouterr().err


class RecordingServer:
    """A context manager that records entering and leaving, or fails on entering."""

    def __init__(self, name: str, events: list[str], fail: bool = False) -> None:
        self.name, self.events, self.fail = name, events, fail

    def __enter__(self) -> str:
        if self.fail:
            raise RuntimeError(f"{self.name} never got healthy")
        self.events.append(f"enter {self.name}")
        return f"http://{self.name}"

    def __exit__(self, *exc_info) -> None:
        self.events.append(f"exit {self.name}")


def test_servers_started_together_are_all_stopped_when_one_fails():
    import contextlib

    events: list[str] = []
    with contextlib.ExitStack() as stack:
        urls = bench_pd_disaggregation.enter_together(
            stack, [RecordingServer("a", events), RecordingServer("b", events)]
        )
        assert urls == ["http://a", "http://b"]
    assert sorted(events) == ["enter a", "enter b", "exit a", "exit b"]
    events.clear()
    with pytest.raises(RuntimeError, match="b never got healthy"), contextlib.ExitStack() as stack:
        bench_pd_disaggregation.enter_together(
            stack, [RecordingServer("a", events), RecordingServer("b", events, fail=True)]
        )
    assert events == ["enter a", "exit a"]


def test_pd_servers_hold_the_whole_workload_and_pinned_workers_get_one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    assert bench_pd_disaggregation.server_env(1)["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in bench_pd_disaggregation.server_env(None)
    args = argparse.Namespace(model=None, server_args="--seed 3")
    requests = build_workload(PD_SHAPE, fake_encode, seed=0)
    flags = bench_pd_disaggregation.engine_flags(args, PD_SHAPE, requests, "float32")
    assert flags[-2:] == ["--seed", "3"]
    num_blocks = int(flags[flags.index("--num-gpu-blocks-override") + 1])
    needed = sum(-(-(len(r.prompt_token_ids) + r.max_tokens) // 16) for r in requests)
    assert num_blocks > needed
    assert int(flags[flags.index("--max-model-len") + 1]) >= PD_SHAPE.max_tokens_per_request


def test_spec_decode_replay_keeps_what_greedy_verification_would():
    """A reply copying its prompt: the 1-gram [1] drafts 2-5, all kept plus the bonus 6; then
    [4, 5, 6] drafts 7 (one left before the end), kept plus 8. Two steps for seven tokens."""
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    totals = replay([(prompt, list(prompt))], DrafterSpec(1, 3, 4, adaptive=False))
    assert (totals.num_steps, totals.num_tokens, totals.num_drafts) == (2, 7, 5)
    assert totals.speedup(46.0, 2.5) == pytest.approx(7 * 46 / (2 * 46 + 5 * 2.5))


def test_spec_decode_replay_adaptive_length_shrinks_after_rejections():
    # Each step drafts from the earliest [9]: 1 2 3 ..., which the reply never continues.
    prompt = [9, 1, 2, 3, 4]
    reply = [9, 5, 9, 6, 9, 7, 9, 8]
    fixed = replay([(prompt, reply)], DrafterSpec(1, 1, 4, adaptive=False))
    adaptive = replay([(prompt, reply)], DrafterSpec(1, 1, 4, adaptive=True))
    assert fixed.num_tokens == adaptive.num_tokens == len(reply) - 1
    assert adaptive.num_drafts < fixed.num_drafts
