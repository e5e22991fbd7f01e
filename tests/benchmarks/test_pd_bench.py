"""The prefill/decode disaggregation benchmark's parts in process: the workload, the stream
statistics, the report, the servers."""

from __future__ import annotations

import argparse
import math

import pytest

from benchmarks.harness.common import (
    StreamedCompletion,
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
