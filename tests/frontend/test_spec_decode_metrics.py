"""Speculative decoding's counters, from the scheduler through `SchedulerStats` to the
Prometheus text, the periodic log line and the data-parallel sum."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from core_engine.frontend.data_parallel_client import sum_stats
from core_engine.frontend.metrics import EngineMetrics
from core_engine.proto import SchedulerStats
from tests.core.test_scheduler_spec_decode import _ngram, _periodic_prompt, step
from tests.helpers.core_factories import make_request, make_scheduler


def _samples(text: bytes) -> dict[tuple[str, tuple], float]:
    samples = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            samples[(sample.name, labels)] = sample.value
    return samples


def _stats_after_a_verifying_step() -> SchedulerStats:
    def model(request, token_ids):  # the period, except where the second draft stands
        return 0 if len(token_ids) == 9 else [5, 6, 7, 8, 9][len(token_ids) % 5]

    scheduler = make_scheduler(speculative_config=_ngram(k=3))
    scheduler.add_request(make_request("a", _periodic_prompt(7), max_tokens=30))
    step(scheduler, model)  # prefill
    step(scheduler, model)  # drafts 8 9 5: 8 accepted, 0 in place of 9
    return scheduler.get_stats()


def test_prometheus_exports_the_spec_decode_counters_from_the_scheduler():
    stats = _stats_after_a_verifying_step()
    assert (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens) == (1, 3)
    assert stats.spec_decode_num_accepted_tokens == 1
    samples = _samples(EngineMetrics("m").render_prometheus(stats))
    assert samples[("core:spec_decode_num_drafts_total", ())] == stats.spec_decode_num_drafts
    assert samples[("core:spec_decode_num_draft_tokens_total", ())] == (
        stats.spec_decode_num_draft_tokens
    )
    assert samples[("core:spec_decode_num_accepted_tokens_total", ())] == (
        stats.spec_decode_num_accepted_tokens
    )
    per_position = [
        samples[("core:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(i)),))]
        for i in range(3)
    ]
    assert per_position == stats.spec_decode_num_accepted_tokens_per_pos == [1, 0, 0]


def test_without_speculation_the_counters_are_zero_and_no_position_is_listed():
    samples = _samples(EngineMetrics("m").render_prometheus(SchedulerStats()))
    assert samples[("core:spec_decode_num_drafts_total", ())] == 0
    assert not [name for name, _ in samples if "per_pos" in name]


def test_log_line_gives_acceptance_rate_and_mean_length_over_the_interval():
    metrics = EngineMetrics(start_time_s=0.0)
    quiet = metrics.log_line(SchedulerStats(), now_s=10.0)
    assert "SpecDecoding" not in quiet
    first = SchedulerStats(spec_decode_num_drafts=4, spec_decode_num_draft_tokens=12,
                           spec_decode_num_accepted_tokens=6)  # fmt: skip
    assert metrics.log_line(first, now_s=20.0).endswith(
        "SpecDecoding: 4 drafts, 12 draft tokens, 6 accepted, acceptance rate: 50.0%, "
        "mean acceptance length: 2.50"
    )
    second = SchedulerStats(spec_decode_num_drafts=6, spec_decode_num_draft_tokens=18,
                            spec_decode_num_accepted_tokens=6)  # fmt: skip
    assert metrics.log_line(second, now_s=30.0).endswith(
        "SpecDecoding: 2 drafts, 6 draft tokens, 0 accepted, acceptance rate: 0.0%, "
        "mean acceptance length: 1.00"
    )
    assert second.spec_decode_acceptance_rate == 6 / 18
    assert second.spec_decode_mean_acceptance_length == 2.0


def test_data_parallel_cores_sum_position_by_position():
    cores = [
        SchedulerStats(spec_decode_num_drafts=2, spec_decode_num_accepted_tokens_per_pos=[2, 1]),
        SchedulerStats(spec_decode_num_drafts=3, spec_decode_num_accepted_tokens_per_pos=[1, 0]),
    ]
    total = sum_stats(cores)
    assert total.spec_decode_num_drafts == 5
    assert total.spec_decode_num_accepted_tokens_per_pos == [3, 1]
