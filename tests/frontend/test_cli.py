"""core-serve's command line, its periodic stats log line and the Prometheus histograms."""

from __future__ import annotations

import asyncio
import importlib
import logging
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from core_engine.frontend.metrics import EngineMetrics
from core_engine.frontend.openai.app import _log_stats
from core_engine.frontend.openai.cli import DEFAULT_PORT, DEFAULT_SERVED_MODEL_NAME, parse_args
from core_engine.proto import SchedulerStats
from core_engine.proto.engine_config import EngineConfig

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_defaults_serve_the_default_model_on_port_8000():
    config, settings, args = parse_args([])
    assert config == EngineConfig()
    assert config.model is None
    assert (args.host, args.port) == ("0.0.0.0", DEFAULT_PORT) == ("0.0.0.0", 8000)
    assert settings.served_model_name == DEFAULT_SERVED_MODEL_NAME
    assert settings.api_key is None
    assert settings.log_stats_interval_s == 10.0


def test_vllm_named_flags_reach_the_engine_config():
    config, settings, args = parse_args(
        [
            "--model", "null",
            "--device", "cpu",
            "--dtype", "float32",
            "--block-size", "32",
            "--max-num-seqs", "8",
            "--max-num-batched-tokens", "512",
            "--max-model-len", "1024",
            "--gpu-memory-utilization", "0.5",
            "--num-gpu-blocks-override", "100",
            "--no-enable-prefix-caching",
            "--tensor-parallel-size", "2",
            "--api-key", "secret",
            "--served-model-name", "my-model",
            "--port", "9000",
            "--disable-log-stats",
        ]
    )  # fmt: skip
    assert config == EngineConfig(
        model="null",
        device="cpu",
        dtype="float32",
        block_size=32,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        max_model_len=1024,
        gpu_memory_utilization=0.5,
        num_gpu_blocks_override=100,
        enable_prefix_caching=False,
        tensor_parallel_size=2,
    )
    assert settings.api_key == "secret"
    assert settings.served_model_name == "my-model"
    assert settings.log_stats_interval_s is None
    assert args.port == 9000
    assert parse_args(["--enable-prefix-caching"])[0].enable_prefix_caching is True
    assert parse_args(["--disable-hybrid-kv-cache"])[0].disable_hybrid_kv_cache is True


def test_served_model_name_defaults_to_the_model_argument():
    assert parse_args(["--model", "/models/qwen"])[1].served_model_name == "/models/qwen"


def test_vllm_habits_are_accepted_with_vllms_meaning():
    """`vllm serve MODEL`, --dtype auto/half/float, several served names, 16k / 16K."""
    config, settings, _ = parse_args(["/models/qwen", "--dtype", "auto", "--max-model-len", "16k"])
    assert (config.model, config.dtype, config.max_model_len) == ("/models/qwen", None, 16_000)
    assert settings.served_model_names == ("/models/qwen",)
    assert parse_args(["--dtype", "auto"])[0] == EngineConfig()  # auto picks what None picks
    assert parse_args(["--dtype", "half"])[0].dtype == "float16"
    assert parse_args(["--dtype", "float"])[0].dtype == "float32"
    assert parse_args(["--max-model-len", "16K"])[0].max_model_len == 16_384
    assert parse_args(["--max-model-len", "1.5k"])[0].max_model_len == 1_500
    assert parse_args(["--max-model-len", "auto"])[0].max_model_len is None
    assert parse_args(["--max-num-batched-tokens", "2K"])[0].max_num_batched_tokens == 2_048
    assert parse_args(["null", "--model", "null"])[0].model == "null"  # the same model twice
    settings = parse_args(["--served-model-name", "first", "second"])[1]
    assert settings.served_model_names == ("first", "second")
    assert settings.served_model_name == "first"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--block-size", "3"], "block_size must be a power of two, got 3"),
        (["--device", "tpu"], "device must be one of"),
        (["--max-num-seqs", "many"], "--max-num-seqs 'many': Expected `int`"),
        (["--max-model-len", "lots"], "--max-model-len 'lots': expected an integer such as"),
        (["--max-model-len", "1.5K"], "a fraction needs a decimal suffix (k, m, g, t)"),
        (["--dtype", "int8"], "dtype must be auto (None) or one of"),
        (["a", "--model", "b"], "the model is given twice, as MODEL 'a' and as --model 'b'"),
        (["--port", "70000"], "--port must be in [1, 65535], got 70000"),
        (
            ["--data-parallel-size", "2", "--frontend-address", "ipc:///tmp/core"],
            "--data-parallel-size 2 launches its own engine cores",
        ),
    ],
)
def test_bad_flags_exit_with_a_usage_error_naming_the_value(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_console_script_points_at_main():
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    match = re.search(r'^\[project\.scripts\]\ncore-serve = "([\w.:]+)"$', pyproject, re.M)
    assert match is not None, "pyproject.toml declares no core-serve console script"
    module_name, function_name = match.group(1).split(":")
    assert callable(getattr(importlib.import_module(module_name), function_name))


def make_stats(**fields) -> SchedulerStats:
    return SchedulerStats(**fields)


def test_log_line_reports_interval_throughput_queues_kv_and_prefix_hits():
    metrics = EngineMetrics(start_time_s=100.0)
    metrics.record_request(num_prompt_tokens=100)
    metrics.record_tokens(50)
    stats = make_stats(
        num_running_reqs=2,
        num_waiting_reqs=1,
        kv_cache_usage=0.25,
        prefix_cache_queries=40,
        prefix_cache_hits=10,
    )
    assert metrics.log_line(stats, now_s=110.0) == (
        "Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 5.0 tokens/s, "
        "Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%"
    )
    metrics.record_tokens(30)
    line = metrics.log_line(make_stats(), now_s=120.0)
    assert line.startswith(
        "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 3.0 tokens/s"
    )


def test_stats_are_logged_every_interval(caplog):
    class FakeEngine:
        def __init__(self) -> None:
            self.metrics = EngineMetrics()
            self.num_calls = 0

        async def get_stats(self) -> SchedulerStats:
            self.num_calls += 1
            return make_stats(num_running_reqs=self.num_calls)

    async def run_briefly(engine: FakeEngine) -> None:
        task = asyncio.create_task(_log_stats(engine, interval_s=0.01))
        while engine.num_calls < 3:
            await asyncio.sleep(0.005)
        task.cancel()

    with caplog.at_level(logging.INFO, logger="core_engine.frontend.openai.app"):
        asyncio.run(run_briefly(FakeEngine()))
    lines = [r.getMessage() for r in caplog.records if "throughput" in r.getMessage()]
    assert len(lines) >= 2
    assert "Running: 1 reqs" in lines[0] and "Running: 2 reqs" in lines[1]


def test_metrics_have_vllms_names_under_our_prefix_and_parse_as_prometheus_text():
    metrics = EngineMetrics('a"b')
    metrics.record_request(num_prompt_tokens=7)
    metrics.record_tokens(3)
    for value_s in (0.05, 0.1, 0.5, 3.0):
        metrics.time_to_first_token.observe(value_s)
    metrics.request_queue_time.observe(0.2)
    metrics.e2e_request_latency.observe(1.2)
    metrics.record_finished("stop")
    metrics.record_finished("length")
    metrics.record_finished("stop")
    text = metrics.render_prometheus(make_stats(num_waiting_reqs=3, prefix_cache_hits=9))
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text.decode())
        for sample in family.samples
    }
    model = ("model_name", 'a"b')

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted([model, *labels.items()])))]

    assert value("core:num_requests_waiting") == 3
    assert value("core:prefix_cache_hits_total") == 9
    assert value("core:prompt_tokens_total") == 7
    assert value("core:generation_tokens_total") == 3
    assert value("core:request_success_total", finished_reason="stop") == 2
    assert value("core:request_success_total", finished_reason="abort") == 0
    assert value("core:time_to_first_token_seconds_bucket", le="0.1") == 2
    assert value("core:time_to_first_token_seconds_bucket", le="+Inf") == 4
    assert value("core:time_to_first_token_seconds_count") == 4
    assert value("core:request_queue_time_seconds_count") == 1
    assert value("core:e2e_request_latency_seconds_sum") == 1.2


def test_each_client_has_its_own_registry():
    first, second = EngineMetrics("m"), EngineMetrics("m")
    first.record_tokens(5)
    assert b'core:generation_tokens_total{model_name="m"} 5.0' in first.render_prometheus(
        make_stats()
    )
    assert b'core:generation_tokens_total{model_name="m"} 0.0' in second.render_prometheus(
        make_stats()
    )


def test_the_api_key_may_come_from_the_environment_and_the_flag_wins(monkeypatch):
    monkeypatch.delenv("CORE_ENGINE_API_KEY", raising=False)
    assert parse_args([])[1].api_key is None
    monkeypatch.setenv("CORE_ENGINE_API_KEY", "from-env")
    assert parse_args([])[1].api_key == "from-env"
    assert parse_args(["--api-key", "from-flag"])[1].api_key == "from-flag"
    monkeypatch.setenv("CORE_ENGINE_API_KEY", "")
    assert parse_args([])[1].api_key is None


REPO_ROOT = Path(__file__).resolve().parents[2]
# Variables of other programs that the engine reads, listed in docs/serving.md with its own.
STANDARD_ENVIRONMENT_VARIABLES = (
    "CC",
    "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
    "TMPDIR",
    "XDG_CACHE_HOME",
)


def _serving_reference_section(title: str) -> str:
    """A section of docs/serving.md, the reference of core-serve."""
    reference = (REPO_ROOT / "docs" / "serving.md").read_text()
    start = reference.index(f"\n## {title}\n")
    end = reference.find("\n## ", start + 1)
    return reference[start:end]


def test_the_reference_flag_table_lists_every_core_serve_flag():
    from core_engine.frontend.openai.cli import make_parser

    table = _serving_reference_section("`core-serve` flags")
    flags = [
        option
        for action in make_parser()._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    ]
    assert len(flags) > 25
    missing = [flag for flag in flags if f"`{flag}`" not in table]
    assert missing == [], f"docs/serving.md's `core-serve` flags table lacks {missing}"


def test_the_reference_lists_every_environment_variable_the_engine_reads():
    table = _serving_reference_section("Environment variables")
    ours = set()
    for package in ("common", "core", "frontend", "kernels", "proto", "worker"):
        for path in (REPO_ROOT / package).rglob("*.py"):
            ours.update(re.findall(r"\bCORE_ENGINE_[A-Z_]+\b", path.read_text()))
    assert "CORE_ENGINE_KV_CACHE_MEMORY_BYTES" in ours  # the scan finds them
    missing = [
        name
        for name in sorted(ours) + list(STANDARD_ENVIRONMENT_VARIABLES)
        if f"`{name}`" not in table
    ]
    assert missing == [], f"docs/serving.md's environment variable table lacks {missing}"


def test_help_shows_the_default_host_and_port(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--host HOST interface to listen on (default: 0.0.0.0)" in help_text
    assert "--port PORT HTTP port (default: 8000)" in help_text


def test_chunked_prefill_switch_reaches_the_engine_config():
    assert parse_args([])[0].enable_chunked_prefill is True
    argv = ["--no-enable-chunked-prefill", "--max-model-len", "512", "--max-num-batched-tokens"]
    assert parse_args([*argv, "512"])[0].enable_chunked_prefill is False


def test_a_step_budget_below_the_context_without_chunked_prefill_is_a_usage_error(capsys):
    argv = ["--no-enable-chunked-prefill", "--max-model-len", "512", "--max-num-batched-tokens"]
    with pytest.raises(SystemExit) as exit_info:
        parse_args([*argv, "256"])
    assert exit_info.value.code == 2
    assert "max_num_batched_tokens=256 is below max_model_len=512" in capsys.readouterr().err
