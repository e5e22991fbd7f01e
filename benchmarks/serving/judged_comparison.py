"""What the one-user and LoRA comparisons share: their common flags (vLLM's Python, the HF
folder, threads, seed, output folder), ratios judged against an issue's targets, and the
targets table.

A target is (sign, bound): "<=" or ">=" a number; a ratio is None where a server was not
measured, and so is whether it met its target.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.harness.common import (
    RESULTS_DIR,
    default_hf_folder,
    default_num_threads,
    engine_default_dtype,
    markdown_table,
)
from benchmarks.peers.vllm import default_peer_python, vllm_version


def add_server_arguments(parser: argparse.ArgumentParser, hf_model_use: str) -> None:
    """--skip-vllm, --peer-python, --hf-model (used for `hf_model_use`), --threads, --seed,
    --output-dir."""
    parser.add_argument("--skip-vllm", action="store_true", help="leave vllm serve out")
    parser.add_argument(
        "--peer-python",
        default=None,
        help="vLLM's virtual environment's Python (its client runs from it)",
    )
    parser.add_argument(
        "--hf-model",
        type=Path,
        default=None,
        help=f"the default model as an HF folder ({hf_model_use})",
    )
    parser.add_argument("--threads", type=int, default=None, help="each server's CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)


def resolve_server_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fills in what the flags left unset: vLLM's Python and version (a parser error where it
    is not installed), the HF folder, the threads, and the engine's CPU dtype."""
    args.peer_python = args.peer_python or default_peer_python()
    try:
        args.peer_version = vllm_version(args.peer_python)
    except ValueError as exc:
        parser.error(str(exc))
    args.hf_model = args.hf_model or default_hf_folder(None)
    args.threads = args.threads or default_num_threads()
    args.dtype = engine_default_dtype("cpu")


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator and denominator else None


def judge(value: float | None, sign: str, bound: float) -> dict:
    """{"ratio", "target", "met"} of one ratio against its target."""
    met = None if value is None else (value <= bound if sign == "<=" else value >= bound)
    return {"ratio": value, "target": f"{sign} {bound}", "met": met}


def targets_table(targets: dict[str, dict]) -> str:
    """The markdown table of judged ratios, by name."""
    return markdown_table(["ratio", "measured", "target", "met"], [
        [name, fmt(t["ratio"], 2), t["target"], "n/a" if t["met"] is None else str(t["met"])]
        for name, t in targets.items()
    ])  # fmt: skip


def fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"
