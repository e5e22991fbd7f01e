"""The GPU run kit: its dry run goes through the same plumbing as a GPU run; its steps' parts,
the sanitizer cases under the CPU emulator, and what it may import on the GPU machine."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys

import pytest
import torch

from benchmarks.gpu import check as gpu_check
from benchmarks.gpu import sanitize_cases as gpu_sanitize_cases
from benchmarks.gpu.check import ProcessRun, junit_counts, sanitizer_outcome
from benchmarks.harness.common import (
    REPO_ROOT,
)
from benchmarks.micro import attention as bench_attention
from core_engine.kernels.cuda import backend as cuda_backend
from core_engine.worker.cpu_features import default_cpu_dtype
from tests.helpers.cuda_cpu_emulator import EmulatedLoader, compiler_available, launch_on_cpu

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
    assert list(steps) == [
        "gpu tests", "engine tiny", "decode tiny", "serve tiny", "attention benchmark",
        "compute-sanitizer",
    ]  # fmt: skip
    assert steps["gpu tests"]["status"] == "skipped"
    assert steps["gpu tests"]["figures"]["collected"] >= 100
    assert steps["gpu tests"]["figures"]["files"] == [
        "tests/kernels/test_cuda_lora_shrink_expand.py",
        "tests/kernels/test_kernels_gpu.py",
    ]
    for name in ("compute-sanitizer", "attention benchmark"):
        assert steps[name] | {"seconds": 0} == {
            "name": name, "status": "skipped", "summary": "skipped: no CUDA", "seconds": 0,
            "figures": {},
        }  # fmt: skip
    engine = steps["engine tiny"]
    assert engine["status"] == "passed", engine
    assert engine["figures"]["parity"]["equal"] and engine["figures"]["parity"]["eager_equal"]
    assert engine["figures"]["throughput"]["output_tok_s"] > 0
    for variant in ("async_scheduling", "enforce_eager"):
        assert engine["figures"]["throughput"][variant]["output_tok_s"] > 0
    assert engine["figures"]["throughput"]["async_equal"]
    assert "with async scheduling" in engine["summary"]
    assert "eager (no CUDA graphs)" in engine["summary"]
    decode = steps["decode tiny"]
    assert decode["status"] == "passed", decode
    breakdown = decode["figures"]["breakdown"]
    for mode in ("default", "enforce_eager"):
        assert set(breakdown[mode]) == {"1", "4", "8"}
        for parts in breakdown[mode].values():
            assert 0 < parts["host_prepare_ms"] < parts["worker_step_ms"]
            assert parts["num_steps"] >= 4 and parts["ipc_ms"] > 0
    assert decode["figures"]["nano_vllm"]["output_tok_s"] > 0
    assert "reference" not in decode["figures"]  # it needs CUDA graphs
    serve = steps["serve tiny"]
    assert serve["status"] == "passed", serve
    loads = serve["figures"]["loads"]
    assert [row["load"] for row in loads] == ["one user", "64 at once", "saturation"]
    assert all(row["num_errors"] == 0 and row["output_tokens_per_s"] > 0 for row in loads)
    assert "core-serve over HTTP: one user" in serve["summary"]
    assert report["environment"]["torch"] == torch.__version__
    # What comes back from the GPU machine: at most 8 files, none in a subfolder.
    files = list(out.iterdir())
    assert 3 <= len(files) <= 8 and all(f.is_file() for f in files)
    markdown = (out / gpu_check.REPORT_MD).read_text()
    assert all(f"| {name} |" in markdown for name in steps)
    assert "===== engine tiny" in (out / gpu_check.LOG_FILE).read_text()
    dtype = str(default_cpu_dtype()).removeprefix("torch.")  # bf16 on CPUs with native bf16
    assert f"## decode tiny (cpu, random weights, {dtype})" in markdown


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


def test_only_selects_steps_by_name_prefix_and_names_an_unknown_one():
    steps = gpu_check.kit_steps(dry_run=False)
    chosen = gpu_check.select_steps(steps, "decode, engine llama")
    assert [step.name for step in chosen] == [
        "engine llama-3.2-1b", "decode llama-3.2-1b", "decode qwen3-0.6b",
    ]  # fmt: skip
    assert gpu_check.select_steps(steps, None) == steps
    with pytest.raises(ValueError, match="--only 'graphs' matches no step"):
        gpu_check.select_steps(steps, "decode,graphs")


def test_the_decode_report_sets_each_figure_beside_its_target():
    parts = {
        "worker_step_ms": 4.0, "host_prepare_ms": 0.3, "forward_host_ms": 0.1,
        "forward_device_ms": 3.1, "sample_host_ms": 3.4, "sample_device_ms": 0.4,
        "device_busy_share": 0.875, "core_between_steps_ms": 0.2, "ipc_ms": 0.1, "num_steps": 32,
    }  # fmt: skip
    figures = {
        "device": "cuda",
        "breakdown": {"default": {"256": parts}, "dtype": "bfloat16",
                      "enforce_eager": {"256": {**parts, "worker_step_ms": 9.0}}},
        "reference": {"batch_size": 256, "max_len": 166, "step_ms": 3.5,
                      "engine_over_reference": 4.0 / 3.5, "target_max_ratio": 1.25},
        "batch_one": {"weight_bytes": 2.5e9, "kv_bytes": 1e6, "worker_step_ms": 1.0,
                      "bytes_per_s": 2.501e12, "copy_bytes_per_s": 4.2e12, "share_of_copy": 0.6,
                      "hbm_bytes_per_s": 4.8e12, "share_of_hbm": 0.52, "target_min_share": 0.6},
        "nano_vllm": {"num_seqs": 256, "lengths": [100, 1024], "max_num_batched_tokens": 16384,
                      "output_tok_s": 30123.0, "elapsed_s": 4.7, "target_tok_s": 28600,
                      "a100_reported": {"vllm": 11113, "nano-vllm": 14297}},
    }  # fmt: skip
    summary = gpu_check.decode_summary(figures)
    assert "batch 256 step 4.00 ms (9.00 eager)" in summary
    assert "1.14x the plain-torch graph (target <= 1.25)" in summary
    assert "batch 1 at 52% of HBM (target >= 60%)" in summary
    assert "nano-vllm workload 30123 output tok/s (target >= 28600)" in summary
    lines = "\n".join(gpu_check._decode_lines("decode llama-3.2-1b", figures))
    assert (
        "| default | 256 | 4.00 | 0.30 | 0.10 | 3.10 | 3.40 | 0.40 | 88% | 0.20 | 0.10 |" in lines
    )
    assert "the engine's step 1.14x that (target <= 1.25)" in lines
    assert "60% of the 4200 GB/s copy measured here, 52% of the data sheet's 4800 GB/s" in lines
    assert "30,123 output tok/s in 4.7 s; reported on one A100 40GB: vllm 11,113" in lines


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
        'errors="1" skipped="1"><testcase classname="tests.kernels.test_kernels_gpu" name="test_a"/>'
        '<testcase classname="tests.kernels.test_kernels_gpu" name="test_b"><failure message="x"/>'
        '</testcase><testcase classname="tests.kernels.test_kernels_gpu" name="test_c"><error/>'
        '</testcase><testcase classname="t" name="test_d"><skipped/></testcase>'
        "</testsuite></testsuites>"
    )
    assert junit_counts(path) == {
        "tests": 4, "failures": 1, "errors": 1, "skipped": 1,
        "failing": ["tests.kernels.test_kernels_gpu::test_b", "tests.kernels.test_kernels_gpu::test_c"],
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
import benchmarks.gpu.decode_check, benchmarks.gpu.serve_check, core_engine.frontend.openai.cli
import core_engine.frontend.openai.app, httpx, h11, httpcore
import tests.kernels.test_kernels_gpu, core_engine.frontend.llm, core_engine.core.engine_core_proc
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
    ours = {"core_engine", "tools", "scripts", "benchmarks", "tests"}
    third_party = {
        name
        for name in completed.stdout.split()
        if name not in sys.stdlib_module_names and not name.startswith("_") and name not in ours
    }
    allowed = (
        gpu_check.GPU_MACHINE_HAS | gpu_check.GPU_MACHINE_LACKS_MODULES | gpu_check.OPTIONAL_IMPORTS
    )
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
    assert pins == [
        f"{name}=={importlib.metadata.version(name)}" for name in gpu_check.GPU_MACHINE_LACKS
    ]
    assert pins[:2] == [
        f"{name}=={importlib.metadata.version(name)}" for name in ("msgspec", "pyzmq")
    ]


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
