"""The offline and serving benchmarks' parts in process: ratios, percentiles, arrivals, the
prefix-cache workload, the peers over fake runners (vLLM's runner over a fake `vllm` package),
the arguments, result files and markdown. Nothing here imports or needs vLLM or llama.cpp."""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import pytest

from benchmarks.harness.common import (
    GenerationWorkload,
    cpu_list_text,
    default_num_threads,
    percentiles,
)
from benchmarks.harness.peer_process import (
    PeerError,
    PeerProcess,
    parse_peer_message,
    parse_run_result,
)
from benchmarks.kv.prefix_cache import BLOCK_SIZE, build_prompts, ideal_hits
from benchmarks.offline import bench as bench_offline
from benchmarks.offline.bench import (
    comparison_row,
    count_agreeing,
    median_pair,
    results_file_name,
    token_passes,
)
from benchmarks.peers import vllm as vllm_peer
from benchmarks.peers.llama_server import find_llama_server
from benchmarks.serving import bench as bench_serving
from benchmarks.serving.bench import arrival_offsets_s, peer_ratios, server_device
from core_engine.frontend.text.null_tokenizer import NullTokenizer


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
