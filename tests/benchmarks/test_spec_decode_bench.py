"""The speculative decoding benchmark's parts in process: closed-loop timing, the copy-heavy
chats, the run plan, rows and markdown, vLLM over a stand-in package, the replay."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import pytest

from benchmarks.harness.closed_loop import (
    ClosedLoopRun,
    RequestTiming,
    first_differences,
    run_closed_loop,
)
from benchmarks.harness.common import (
    REPO_ROOT,
)
from benchmarks.harness.peer_process import (
    PeerError,
)
from benchmarks.peers import vllm as vllm_peer
from benchmarks.peers.vllm_spec_decode_arm import parse_closed_loop_result
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
    runner = REPO_ROOT / "benchmarks" / "peers" / "vllm_spec_decode_runner.py"
    source = runner.read_text()
    imports = [
        line.split()[1] for line in source.splitlines() if line.startswith(("import ", "from "))
    ]
    assert set(imports) <= {"asyncio", "json", "os", "sys", "time", "traceback"}


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
