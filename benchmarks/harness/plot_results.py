"""The serving plot (throughput and latency against load) and the README's benchmark section.

    python -m benchmarks.harness.plot_results   # re-plots serving.png, rewrites benchmarks/README_SECTION.md

`benchmarks/README_SECTION.md` is assembled from the latest full (non-quick) result tables in
`benchmarks/results/`, in a fixed order, with the plot referenced from the README's folder.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from benchmarks.harness.common import RESULTS_DIR

README_SECTION_PATH = RESULTS_DIR.parent / "README_SECTION.md"
SECTION_ORDER = (
    "offline", "offline_vllm", "offline_cuda", "serving", "serving_vllm", "prefix_cache", "ipc",
    "scheduler",
)  # fmt: skip
# Headings for result tables that do not start with their own.
SECTION_TITLES = {"scheduler": "### Scheduler: cost per running request (simulated model)"}
SECTION_INTRO = """## Benchmarks

Every figure is a ratio against a baseline measured in the same run, so that a noisy machine
still gives an honest comparison: transformers' batched `generate` for offline throughput, the
lightest load for serving latency, prefix caching off for time to first token, a raw ZeroMQ
ping-pong for IPC. Scripts live in `scripts/bench_*.py` (`python -m benchmarks.offline.bench`,
each with `--quick`); results (JSON + markdown) in `benchmarks/results/`. vLLM is a peer too,
started as a separate program from its own virtual environment and never imported:
`bench_offline --peer vllm` runs the same token-id workloads through its `LLM.generate`,
alternating with the engine, and `bench_serving --peer vllm` sends the same requests to
`vllm serve` after `core-serve` has stopped; both report engine / vLLM ratios.
"""


def plot_serving(result: dict, path: Path) -> None:
    """Two panels against offered load: throughput (output tok/s, requests/s) and latency
    (TTFT and ITL, p50 and p99, log scale). An infinite rate is drawn one step past the last.
    A peer measured at the same rates (`result["peer"]`) is drawn dashed: output tok/s and
    p50 latencies."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    peer = result.get("peer")
    positions, labels = _rate_axis([row["offered_rate"] for row in rows])
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(positions, [r["output_tokens_per_s"] for r in rows], "o-", label="output tok/s")
    if peer is not None:
        left.plot(positions, [r["output_tokens_per_s"] for r in peer["rows"]], "o--",
                  color="tab:gray", label=f"{peer['name']} output tok/s")  # fmt: skip
    left.set_ylabel("output tokens/s")
    twin = left.twinx()
    twin.plot(positions, [r["request_throughput"] for r in rows], "s--", color="tab:orange",
              label="requests/s")  # fmt: skip
    twin.set_ylabel("requests/s")
    left.set_title("throughput")
    left.legend(loc="upper left")
    twin.legend(loc="lower right")
    for key, name, style in (("ttft_ms", "TTFT", "o-"), ("itl_ms", "ITL", "s-")):
        for point, alpha in (("p50", 1.0), ("p99", 0.5)):
            values = [row[key][point] for row in rows]
            right.plot(positions, values, style, alpha=alpha, label=f"{name} {point}")
        if peer is not None:
            values = [row[key]["p50"] for row in peer["rows"]]
            right.plot(positions, values, style[0] + "--", color="tab:gray",
                       label=f"{peer['name']} {name} p50")  # fmt: skip
    right.set_yscale("log")
    right.set_ylabel("milliseconds")
    right.set_title("latency")
    right.legend()
    for axis in (left, right):
        axis.set_xticks(positions, labels)
        axis.set_xlabel("offered load (requests/s)")
        axis.grid(alpha=0.3)
    title = f"core-serve under Poisson load ({result['server']})"
    if peer is not None:
        title += f", {peer['name']} {peer['version']} dashed"
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _rate_axis(rates: list) -> tuple[list[float], list[str]]:
    finite = [float(r) for r in rates if r != "inf" and not math.isinf(float(r))]
    positions, labels = [], []
    for index, rate in enumerate(rates):
        if rate == "inf" or math.isinf(float(rate)):
            positions.append(len(finite))
            labels.append("all at once")
        else:
            positions.append(index)
            labels.append(f"{float(rate):g}")
    return [float(p) for p in positions], labels


def write_readme_section(results_dir: Path, path: Path) -> None:
    """The README section from the full runs' markdown tables that exist, in SECTION_ORDER."""
    parts = [SECTION_INTRO]
    for name in SECTION_ORDER:
        table = results_dir / f"{name}.md"
        if not table.is_file():
            continue
        text = table.read_text().strip()
        if not text.startswith("#") and name in SECTION_TITLES:
            text = f"{SECTION_TITLES[name]}\n\n{text}"
        parts.append(text + "\n")
        plot = results_dir / f"{name}.png"
        if name in ("serving", "serving_vllm") and plot.is_file():
            relative = plot.relative_to(path.parent.parent)
            parts.append(f"![throughput and latency against load]({relative.as_posix()})\n")
    conditions = results_dir / "CONDITIONS.md"
    if conditions.is_file():
        parts.append(conditions.read_text().strip() + "\n")
    path.write_text("\n".join(parts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--readme-section", type=Path, default=README_SECTION_PATH)
    args = parser.parse_args()
    serving_json = args.results_dir / "serving.json"
    if serving_json.is_file():
        plot_serving(json.loads(serving_json.read_text()), args.results_dir / "serving.png")
    write_readme_section(args.results_dir, args.readme_section)
    print(f"wrote {args.readme_section}")


if __name__ == "__main__":
    main()
