"""`EngineMetrics`: what the frontend measures, for Prometheus (through `prometheus_client`) and
for a periodic log line.

Names are vLLM's with our prefix in place of `vllm:` (`core:num_requests_running`, ...), so its
Grafana dashboards work after a prefix change. Latencies and token counters are measured here,
where requests arrive and tokens come out; queue lengths, KV cache usage, preemptions and prefix
cache counters come from the core's `SchedulerStats` at scrape time; queue time comes from the
core with each request's first token. With LoRA, vLLM's `lora_requests_info` gauge: labels
`max_lora`, `running_lora_adapters` and `waiting_lora_adapters` (comma-joined adapter names),
value the Unix time of the snapshot.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from core_engine.proto import SchedulerStats

METRIC_PREFIX = "core:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TIME_TO_FIRST_TOKEN_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip
INTER_TOKEN_LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
    0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
FINISHED_REASONS = ("stop", "length", "abort", "error")


@dataclass(slots=True)
class _LogMark:
    """Counters at the previous log line, to turn totals into per-interval throughput."""

    time_s: float
    num_prompt_tokens: float = 0.0
    num_generation_tokens: float = 0.0
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0


class EngineMetrics:
    """One frontend's metrics in their own registry (several clients may share a process).

    `max_loras`: the engine's adapters per step when it serves LoRA adapters (the
    `lora_requests_info` gauge is exported then only), else None."""

    def __init__(
        self, model_name: str = "", start_time_s: float = 0.0, max_loras: int | None = None
    ) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._scheduler = _SchedulerCollector(model_name)
        self.registry.register(self._scheduler)
        if max_loras is not None:
            self.registry.register(_LoRACollector(max_loras, self._scheduler))
        labels = {"model_name": model_name}

        def histogram(name: str, help_text: str, buckets: tuple[float, ...]) -> Histogram:
            metric = Histogram(
                METRIC_PREFIX + name, help_text, ["model_name"], buckets=buckets,
                registry=self.registry,
            )  # fmt: skip
            return metric.labels(**labels)

        self.prompt_tokens = Counter(
            METRIC_PREFIX + "prompt_tokens", "Prompt tokens received.", ["model_name"],
            registry=self.registry,
        ).labels(**labels)  # fmt: skip
        self.generation_tokens = Counter(
            METRIC_PREFIX + "generation_tokens", "Tokens generated.", ["model_name"],
            registry=self.registry,
        ).labels(**labels)  # fmt: skip
        self._request_success = Counter(
            METRIC_PREFIX + "request_success", "Requests (choices) finished, by reason.",
            ["model_name", "finished_reason"], registry=self.registry,
        )  # fmt: skip
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds",
            "Time from request arrival to its first generated token.",
            TIME_TO_FIRST_TOKEN_BUCKETS_S,
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds",
            "Time between two consecutive tokens of one request.",
            INTER_TOKEN_LATENCY_BUCKETS_S,
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds",
            "Time from request arrival to its last output.",
            REQUEST_LATENCY_BUCKETS_S,
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds",
            "Time a request waited in the engine core before it first ran.",
            REQUEST_LATENCY_BUCKETS_S,
        )
        for reason in FINISHED_REASONS:  # every series exists from the start, at 0
            self._request_success.labels(model_name=model_name, finished_reason=reason)
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self._log_mark = _LogMark(start_time_s)

    def record_request(self, num_prompt_tokens: int) -> None:
        self.num_prompt_tokens += num_prompt_tokens
        self.prompt_tokens.inc(num_prompt_tokens)

    def record_tokens(self, num_new_tokens: int) -> None:
        self.num_generation_tokens += num_new_tokens
        self.generation_tokens.inc(num_new_tokens)

    def record_finished(self, finished_reason: str) -> None:
        self._request_success.labels(
            model_name=self.model_name, finished_reason=finished_reason
        ).inc()

    def render_prometheus(
        self, stats: SchedulerStats, per_core: Sequence[SchedulerStats] = ()
    ) -> bytes:
        """Prometheus text exposition of these metrics and the engine's `stats`; with several
        data-parallel cores, also each core's (`per_core`) in the `*_by_engine` families,
        labelled `engine="<rank>"`."""
        self._scheduler.stats = stats
        self._scheduler.per_core = list(per_core) if len(per_core) > 1 else []
        return generate_latest(self.registry)

    def log_line(self, stats: SchedulerStats, now_s: float) -> str:
        """One line on throughput since the previous call, queues, KV usage and prefix hits;
        once the engine has verified drafts, their acceptance rate and mean acceptance length
        since the previous call too."""
        mark = self._log_mark
        elapsed_s = max(now_s - mark.time_s, 1e-9)
        num_prompt_tokens = self.num_prompt_tokens
        num_generation_tokens = self.num_generation_tokens
        prompt_throughput = (num_prompt_tokens - mark.num_prompt_tokens) / elapsed_s
        generation_throughput = (num_generation_tokens - mark.num_generation_tokens) / elapsed_s
        self._log_mark = _LogMark(
            now_s,
            num_prompt_tokens,
            num_generation_tokens,
            stats.spec_decode_num_drafts,
            stats.spec_decode_num_draft_tokens,
            stats.spec_decode_num_accepted_tokens,
        )
        line = (
            f"Avg prompt throughput: {prompt_throughput:.1f} tokens/s, "
            f"Avg generation throughput: {generation_throughput:.1f} tokens/s, "
            f"Running: {stats.num_running_reqs} reqs, Waiting: {stats.num_waiting_reqs} reqs, "
            f"KV cache usage: {stats.kv_cache_usage:.1%}, "
            f"Prefix cache hit rate: {stats.prefix_cache_hit_rate:.1%}"
        )
        if stats.spec_decode_num_drafts == 0:
            return line
        return f"{line}, {_spec_decode_interval(stats, mark)}"


def _spec_decode_interval(stats: SchedulerStats, mark: _LogMark) -> str:
    """Speculative decoding since `mark`, as vLLM's log line gives it."""
    num_drafts = stats.spec_decode_num_drafts - mark.spec_decode_num_drafts
    num_draft_tokens = stats.spec_decode_num_draft_tokens - mark.spec_decode_num_draft_tokens
    num_accepted = stats.spec_decode_num_accepted_tokens - mark.spec_decode_num_accepted_tokens
    acceptance_rate = num_accepted / num_draft_tokens if num_draft_tokens else 0.0
    mean_length = 1 + num_accepted / num_drafts if num_drafts else 0.0
    return (
        f"SpecDecoding: {num_drafts} drafts, {num_draft_tokens} draft tokens, "
        f"{num_accepted} accepted, acceptance rate: {acceptance_rate:.1%}, "
        f"mean acceptance length: {mean_length:.2f}"
    )


class _SchedulerCollector(Collector):
    """The engine's gauges and cumulative counters, as of the last `SchedulerStats`; per core
    too when there are several."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats = SchedulerStats()
        self.per_core: list[SchedulerStats] = []

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        yield from self._collect_scheduler_metrics()
        yield self._accepted_tokens_per_position()

    def _accepted_tokens_per_position(self) -> CounterMetricFamily:
        """One sample per draft position (none while speculation is off)."""
        metric = CounterMetricFamily(
            METRIC_PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position in the draft (0-based).",
            labels=["model_name", "position"],
        )
        for position, count in enumerate(self.stats.spec_decode_num_accepted_tokens_per_pos):
            metric.add_metric([self.model_name, str(position)], count)
        return metric

    def _collect_scheduler_metrics(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        for family, name, help_text, read in SCHEDULER_METRICS:
            metric = family(METRIC_PREFIX + name, help_text, labels=["model_name"])
            metric.add_metric([self.model_name], read(self.stats))
            yield metric
            if not self.per_core:
                continue
            metric = family(
                METRIC_PREFIX + name + "_by_engine",
                f"{help_text} Per data-parallel engine core.",
                labels=["model_name", "engine"],
            )
            for rank, stats in enumerate(self.per_core):
                metric.add_metric([self.model_name, str(rank)], read(stats))
            yield metric


class _LoRACollector(Collector):
    """vLLM's `lora_requests_info`, from the scheduler collector's last stats: one sample whose
    labels name the adapters of running and of waiting requests and whose value is the time
    the snapshot was exported (Unix seconds), as vLLM's `set_to_current_time`."""

    def __init__(self, max_loras: int, scheduler: _SchedulerCollector) -> None:
        self.max_loras = max_loras
        self.scheduler = scheduler

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self.scheduler.stats
        metric = GaugeMetricFamily(
            METRIC_PREFIX + "lora_requests_info",
            "Running stats on LoRA requests.",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        metric.add_metric(
            [
                str(self.max_loras),
                ",".join(stats.running_lora_adapters),
                ",".join(stats.waiting_lora_adapters),
            ],
            time.time(),
        )
        yield metric


# (family, name, help, value) of each scheduler metric.
SCHEDULER_METRICS = (
    (
        GaugeMetricFamily,
        "num_requests_running",
        "Requests in the running batch.",
        lambda stats: stats.num_running_reqs,
    ),
    (
        GaugeMetricFamily,
        "num_requests_waiting",
        "Requests waiting to be scheduled.",
        lambda stats: stats.num_waiting_reqs,
    ),
    (
        GaugeMetricFamily,
        "kv_cache_usage_perc",
        "Fraction of KV cache blocks in use (0 to 1).",
        lambda stats: stats.kv_cache_usage,
    ),
    (
        CounterMetricFamily,
        "prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache.",
        lambda stats: stats.prefix_cache_queries,
    ),
    (
        CounterMetricFamily,
        "prefix_cache_hits",
        "Prompt tokens found in the prefix cache.",
        lambda stats: stats.prefix_cache_hits,
    ),
    (
        CounterMetricFamily,
        "prefix_cache_preempted_queries",
        "Tokens looked up in the prefix cache by requests resumed after a preemption.",
        lambda stats: stats.prefix_cache_preempted_queries,
    ),
    (
        CounterMetricFamily,
        "prefix_cache_preempted_hits",
        "Tokens found in the prefix cache by requests resumed after a preemption.",
        lambda stats: stats.prefix_cache_preempted_hits,
    ),
    (
        CounterMetricFamily,
        "num_preemptions",
        "Requests preempted for lack of KV blocks.",
        lambda stats: stats.num_preemptions,
    ),
    (
        CounterMetricFamily,
        "spec_decode_num_drafts",
        "Drafts verified (one per request and step that verified draft tokens).",
        lambda stats: stats.spec_decode_num_drafts,
    ),
    (
        CounterMetricFamily,
        "spec_decode_num_draft_tokens",
        "Draft tokens verified.",
        lambda stats: stats.spec_decode_num_draft_tokens,
    ),
    (
        CounterMetricFamily,
        "spec_decode_num_accepted_tokens",
        "Draft tokens accepted.",
        lambda stats: stats.spec_decode_num_accepted_tokens,
    ),
    (
        CounterMetricFamily,
        "external_prefix_cache_queries",
        "Tokens looked up beyond the KV pool (the KV connector's tiers), on admission.",
        lambda stats: stats.external_prefix_cache_queries,
    ),
    (
        CounterMetricFamily,
        "external_prefix_cache_hits",
        "Tokens found beyond the KV pool (the KV connector's tiers), on admission.",
        lambda stats: stats.external_prefix_cache_hits,
    ),
    (
        GaugeMetricFamily,
        "kv_offload_host_bytes_used",
        "Bytes of KV blocks the host-memory offloading tier holds (all ranks).",
        lambda stats: stats.kv_offload_host_bytes,
    ),
    (
        GaugeMetricFamily,
        "kv_offload_disk_bytes_used",
        "Bytes of KV blocks the disk offloading tier holds (all ranks).",
        lambda stats: stats.kv_offload_disk_bytes,
    ),
    (
        CounterMetricFamily,
        "kv_offload_loaded_bytes",
        "Bytes of KV loaded from the offloading tiers into the pool.",
        lambda stats: stats.kv_offload_loaded_bytes,
    ),
    (
        CounterMetricFamily,
        "kv_offload_stored_bytes",
        "Bytes of KV stored from the pool into the offloading tiers.",
        lambda stats: stats.kv_offload_stored_bytes,
    ),
    (
        CounterMetricFamily,
        "kv_offload_load_seconds",
        "Seconds rank 0 spent loading KV from the offloading tiers.",
        lambda stats: stats.kv_offload_load_s,
    ),
    (
        CounterMetricFamily,
        "kv_offload_store_seconds",
        "Seconds rank 0 spent storing KV into the offloading tiers.",
        lambda stats: stats.kv_offload_store_s,
    ),
)
