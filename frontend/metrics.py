"""`EngineMetrics`: what the frontend measures, as Prometheus text and as a periodic log line.

Latencies and token counters are measured here, where requests arrive and tokens come out;
queue lengths, KV cache usage and prefix cache counters come from the core's `SchedulerStats`.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from proto import SchedulerStats

METRIC_PREFIX = "core"
TIME_TO_FIRST_TOKEN_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip
INTER_TOKEN_LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
    0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
)  # fmt: skip


@dataclass(slots=True)
class Histogram:
    """A Prometheus histogram.

    `bucket_counts[i]` counts observations in (`upper_bounds_s[i-1]`, `upper_bounds_s[i]`];
    `render` makes them cumulative. Observations above the last bound only count in `count`
    (the `+Inf` bucket).
    """

    upper_bounds_s: tuple[float, ...]
    bucket_counts: list[int] = field(default_factory=list)
    sum_s: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.bucket_counts = [0] * len(self.upper_bounds_s)

    def observe(self, value_s: float) -> None:
        index = bisect.bisect_left(self.upper_bounds_s, value_s)
        if index < len(self.bucket_counts):
            self.bucket_counts[index] += 1
        self.sum_s += value_s
        self.count += 1

    def render(self, name: str, help_text: str, labels: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, bucket_count in zip(self.upper_bounds_s, self.bucket_counts, strict=True):
            cumulative += bucket_count
            lines.append(f'{name}_bucket{{{labels},le="{bound}"}} {cumulative}')
        lines.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.count}')
        lines.append(f"{name}_sum{{{labels}}} {self.sum_s}")
        lines.append(f"{name}_count{{{labels}}} {self.count}")
        return lines


@dataclass(slots=True)
class _LogMark:
    """Counters at the previous log line, to turn totals into per-interval throughput."""

    time_s: float
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0


class EngineMetrics:
    """Counters and latency histograms of one frontend (monotonic, never reset)."""

    def __init__(self, start_time_s: float = 0.0) -> None:
        self.num_requests = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.time_to_first_token = Histogram(TIME_TO_FIRST_TOKEN_BUCKETS_S)
        self.inter_token_latency = Histogram(INTER_TOKEN_LATENCY_BUCKETS_S)
        self._log_mark = _LogMark(start_time_s)

    def record_request(self, num_prompt_tokens: int) -> None:
        self.num_requests += 1
        self.num_prompt_tokens += num_prompt_tokens

    def record_tokens(self, num_new_tokens: int) -> None:
        self.num_generation_tokens += num_new_tokens

    def render_prometheus(self, stats: SchedulerStats, model_name: str) -> str:
        """Prometheus text exposition (format 0.0.4) of these metrics and the core's `stats`."""
        labels = f'model_name="{_escape_label(model_name)}"'
        lines: list[str] = []
        for name, kind, help_text, value in (
            ("num_requests_running", "gauge", "Requests in the running batch.",
             stats.num_running_reqs),
            ("num_requests_waiting", "gauge", "Requests waiting to be scheduled.",
             stats.num_waiting_reqs),
            ("kv_cache_usage_perc", "gauge", "Fraction of KV cache blocks in use (0 to 1).",
             stats.kv_cache_usage),
            ("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
             stats.prefix_cache_queries),
            ("prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.",
             stats.prefix_cache_hits),
            ("num_preemptions_total", "counter", "Requests preempted for lack of KV blocks.",
             stats.num_preemptions),
            ("request_total", "counter", "Requests received.", self.num_requests),
            ("prompt_tokens_total", "counter", "Prompt tokens received.",
             self.num_prompt_tokens),
            ("generation_tokens_total", "counter", "Tokens generated.",
             self.num_generation_tokens),
        ):  # fmt: skip
            metric = f"{METRIC_PREFIX}_{name}"
            lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} {kind}"]
            lines.append(f"{metric}{{{labels}}} {value}")
        lines += self.time_to_first_token.render(
            f"{METRIC_PREFIX}_time_to_first_token_seconds",
            "Time from request arrival to its first generated token.",
            labels,
        )
        lines += self.inter_token_latency.render(
            f"{METRIC_PREFIX}_inter_token_latency_seconds",
            "Time between two consecutive tokens of one request.",
            labels,
        )
        return "\n".join(lines) + "\n"

    def log_line(self, stats: SchedulerStats, now_s: float) -> str:
        """One line on throughput since the previous call, queues, KV usage and prefix hits."""
        mark = self._log_mark
        elapsed_s = max(now_s - mark.time_s, 1e-9)
        prompt_throughput = (self.num_prompt_tokens - mark.num_prompt_tokens) / elapsed_s
        generation_throughput = (
            self.num_generation_tokens - mark.num_generation_tokens
        ) / elapsed_s
        self._log_mark = _LogMark(now_s, self.num_prompt_tokens, self.num_generation_tokens)
        return (
            f"Avg prompt throughput: {prompt_throughput:.1f} tokens/s, "
            f"Avg generation throughput: {generation_throughput:.1f} tokens/s, "
            f"Running: {stats.num_running_reqs} reqs, Waiting: {stats.num_waiting_reqs} reqs, "
            f"KV cache usage: {stats.kv_cache_usage:.1%}, "
            f"Prefix cache hit rate: {stats.prefix_cache_hit_rate:.1%}"
        )


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
