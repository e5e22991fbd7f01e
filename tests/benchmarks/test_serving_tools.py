"""The serving measurement tools: /proc accounting, step statistics, vLLM's client's command
and its results."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.harness import proc_stats
from benchmarks.peers.vllm_bench_client import SATURATION, bench_serve_argv, summary
from benchmarks.serving import async_scheduling, lora, one_user
from benchmarks.serving import vllm_client as serving_vllm_client
from benchmarks.serving.profile import step_stats
from core_engine.core.step_trace import StepRecord

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


# ---- the one-user comparison (benchmarks/serving/one_user.py) on fake results ----------------


def test_a_bounded_concurrency_reaches_the_clients_command_line(tmp_path):
    argv = bench_serve_argv("/venv/bin/python", "http://127.0.0.1:9", "m", tmp_path / "tok",
                            one_user.ONE_USER, tmp_path, "r.json")  # fmt: skip
    pairs = dict(zip(argv[3::1], argv[4::1], strict=False))
    assert pairs["--max-concurrency"] == "1" and pairs["--num-prompts"] == "8"
    assert "--max-concurrency" not in bench_serve_argv(
        "/p", "http://h:9", "m", tmp_path, SATURATION, tmp_path, "r.json"
    )
    assert one_user.ONE_USER.describe().endswith("rate inf, 1 at a time")


def test_rounds_merge_as_medians_and_the_targets_are_judged():
    rounds = [summary(fake_result(70.0, 300.0, tpot)) for tpot in (9.0, 8.0, 11.0)]
    merged = one_user.median_summary(rounds)
    assert merged["median_tpot_ms"] == 9.0 and merged["failed"] == 0
    assert merged["completed"] == 3 * 64

    def server(tpot, ttft, throughput):
        row = {"summary": summary(fake_result(throughput, ttft, tpot))}
        return {"one user": row, "saturation": row}

    results = {
        one_user.CORE_DEQUANTIZED: server(20.0, 300.0, 100.0),
        one_user.CORE_GGUF: server(8.0, 280.0, 160.0),
        one_user.LLAMA_SERVER: server(11.0, 500.0, 80.0),
        one_user.VLLM: server(25.0, 200.0, 100.0),
    }
    targets = one_user.targets(results)
    tpot, ttft, saturation = targets.values()
    assert math.isclose(tpot["ratio"], 8.0 / 11.0) and tpot["met"] is True
    assert math.isclose(ttft["ratio"], 280.0 / 300.0) and ttft["met"] is True
    assert math.isclose(saturation["ratio"], 1.6) and saturation["met"] is True
    del results[one_user.LLAMA_SERVER]
    assert one_user.targets(results)["TPOT p50, one user: gguf / llama-server"]["met"] is None


def test_greedy_agreement_counts_identical_completions_and_common_prefixes():
    result = one_user.agreement(["abcd", "same", "xy"], ["abXX", "same", "q"])
    assert result["identical"] == 1 and result["total"] == 3
    assert math.isclose(result["mean_common_prefix"], (0.5 + 1.0 + 0.0) / 3)


# ---- async scheduling on and off (benchmarks/serving/async_scheduling.py) on fake results ----


def test_async_scheduling_ratios_are_on_over_off_per_pass_and_their_median():
    def setting(tpot: float, throughput: float) -> dict:
        row = {"summary": summary(fake_result(throughput, 300.0, tpot))}
        return {"one user": row, "saturation": row}

    passes = [
        {"off": setting(10.0, 100.0), "on": setting(9.0, 110.0)},
        {"off": setting(10.0, 100.0), "on": setting(8.0, 130.0)},
        {"off": setting(10.0, 100.0), "on": setting(12.0, 90.0)},
    ]
    medians = async_scheduling.median_ratios(passes)
    assert medians["TPOT p50, one user"] == pytest.approx(0.9)
    assert medians["output tok/s, saturation"] == pytest.approx(1.1)
    assert medians["TTFT p50, one user"] == pytest.approx(1.0)
    result = {
        "machine": {"processor": "cpu", "num_cpus": 2, "memory_gib": 24.0,
                    "load_average_1m": 0.0, "python": "3", "git_commit": "x",
                    "date_utc": "now", "cpu_simd": "AVX2"},
        "client": "vllm bench serve", "threads": 2, "dtype": "float32", "passes_per_engine": 3,
        "engines": {"gguf": {"passes": passes, "median_ratios": medians,
                             "identical_greedy": False}},
    }  # fmt: skip
    markdown = async_scheduling.render_markdown(result)
    assert "| 2 | on | 8.00 |" in markdown and "## core-serve --quantization gguf" in markdown
    assert async_scheduling.engine_arguments("dequantized", "bfloat16") == ["--dtype", "bfloat16"]
    assert "TPOT p50, one user 0.90" in markdown and "NOT identical" in markdown


# ---- the LoRA serving comparison (benchmarks/serving/lora.py) on fake results ----------------


def test_the_mixed_workload_names_every_adapter_and_the_base_model_in_turn(tmp_path):
    mixed = lora.workloads(quick=False)["saturation, 4 adapters + base"]
    argv = bench_serve_argv("/p", "http://h:9", "base", tmp_path, mixed, tmp_path, "r.json")
    start = argv.index("--lora-modules") + 1
    assert argv[start : start + 5] == ["a0", "a1", "a2", "a3", "base"]
    assert argv[argv.index("--lora-assignment") + 1] == "round-robin"
    base = lora.workloads(quick=False)["saturation, base"]
    assert "--lora-modules" not in bench_serve_argv(
        "/p", "http://h:9", "base", tmp_path, base, tmp_path, "r.json"
    )
    flags = lora.lora_flags(Path("/adapters"))
    assert flags[:5] == ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "16"]
    assert flags[-1] == "a3=/adapters/a3"


def test_the_cost_of_adapters_is_judged_against_the_targets():
    def server(mixed_tput: float, adapter_tpot: float) -> dict:
        return {
            "saturation, base": summary(fake_result(100.0, 300.0, 10.0)),
            "saturation, 4 adapters + base": summary(fake_result(mixed_tput, 300.0, 10.0)),
            "batch 1, base": summary(fake_result(50.0, 100.0, 10.0)),
            "batch 1, adapter a0": summary(fake_result(50.0, 100.0, adapter_tpot)),
        }

    plain = server(0.0, 0.0)
    plain = {name: plain[name] for name in lora.BASE_WORKLOADS}
    plain["saturation, base"] = summary(fake_result(125.0, 300.0, 10.0))
    servers = {lora.CORE: server(90.0, 13.0), lora.CORE_LORA_OFF: plain,
               lora.VLLM: server(80.0, 11.0)}  # fmt: skip
    judged = lora.targets(servers)
    assert judged["saturation output tok/s, mixed / base"]["ratio"] == pytest.approx(0.9)
    assert judged["saturation output tok/s, mixed / base"]["met"] is True
    assert judged["batch 1 TPOT p50, adapter / base"]["ratio"] == pytest.approx(1.3)
    assert judged["batch 1 TPOT p50, adapter / base"]["met"] is False
    result = {
        "machine": {"processor": "cpu", "num_cpus": 2, "memory_gib": 24.0,
                    "load_average_1m": 0.0, "python": "3", "git_commit": "x",
                    "date_utc": "now", "cpu_simd": "AVX2"},
        "client": "vllm bench serve",
        "threads": 2, "dtype": "float32", "adapters": "a0 (rank 8)", "flags": "--enable-lora",
        "workloads": {name: w.describe() for name, w in lora.workloads(quick=False).items()},
        "servers": servers, "targets": judged,
    }  # fmt: skip
    markdown = lora.render_markdown(result)
    assert "| core-serve | 0.90 | 1.30 |" in markdown
    assert "| saturation, 4 adapters + base | 1.12 | 1.00 |" in markdown
    assert "AVX2" in markdown and "- batch 1, adapter a0: 8 prompts" in markdown
    assert "| saturation output tok/s, base, LoRA on / off | 0.80 |" in markdown
    assert "| core-serve without --enable-lora | 0." not in markdown  # not in the cost table
