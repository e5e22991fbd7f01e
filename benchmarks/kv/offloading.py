"""KV offloading: time to first token with the host tier against without it, and warm against
cold after a restart with the disk tier.

1. Multi-turn chats (`benchmarks/kv/offloading_workload.py`): conversations over one shared
   document, each turn appending the reply and a new user message, visited round robin on a
   pool (`--num-gpu-blocks-override`) that holds the document and about two conversations, so
   each revisit finds its own history evicted from the pool. Two `core-serve` processes, one
   after the other and identical but for `--kv-offloading-size`, receive the same requests one
   at a time (closed loop: TTFT is the prefill). The first arm (no tier) appends the replies it
   generates; the second arm is sent exactly the prompts the first one built, and its replies
   are compared with the first arm's (greedy: they should be equal).
2. A restart: with `CORE_ENGINE_PREFIX_HASH_SEED` fixed, a server with the disk tier on DIR
   computes distinct long prompts and stops; a restarted server on DIR (warm) and a server on
   an empty folder (cold) then receive the same prompts, and their outputs are compared.

TTFT is reported over the chat's revisits (every visit after each conversation's first), and
the counters from /metrics over those same requests (`core:prefix_cache_hits_total`, the
tiers' `core:external_prefix_cache_*_total`, `core:kv_offload_loaded_bytes_total`).

    python -m benchmarks.kv.offloading [--quick] [--server-args "--device cpu"]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.harness.common import (
    core_serve,
    device_results_dir,
    machine_info,
    mean,
    percentiles,
    read_metrics,
    result_name,
    stream_completion,
    write_results,
)
from benchmarks.kv.offloading_report import render_markdown
from benchmarks.kv.offloading_workload import (
    ChatPlan,
    ChatPoolSize,
    ChatSession,
    ChatShape,
    Encode,
    build_chat_plan,
    chat_pool_size,
    long_prompts,
    restart_pool_size,
    warm_up_prompt,
)
from core_engine.common.block_hash import PREFIX_HASH_SEED_ENV
from core_engine.frontend.async_engine_client import load_engine_tokenizer
from core_engine.proto.engine_config import EngineConfig

CHAT_SHAPE = ChatShape(num_conversations=6, num_visits=5, document_tokens=768,
                       opening_tokens=320, user_tokens=32, max_tokens=24)  # fmt: skip
# --quick: the plumbing, in about a minute (five server starts take most of it)
QUICK_CHAT_SHAPE = ChatShape(num_conversations=5, num_visits=2, document_tokens=64,
                             opening_tokens=48, user_tokens=16, max_tokens=8)  # fmt: skip
RESTART_PROMPTS, RESTART_PROMPT_TOKENS, RESTART_MAX_TOKENS = 8, 1000, 16
QUICK_RESTART_PROMPTS, QUICK_RESTART_PROMPT_TOKENS, QUICK_RESTART_MAX_TOKENS = 2, 128, 8
DEFAULT_PREFIX_HASH_SEED = "0123456789abcdef0123456789abcdef"
WARM_UP_MAX_TOKENS = 4
# /metrics counters read per arm: {key in the results: metric name}
COUNTERS = {
    "prefix_cache_queries": "core:prefix_cache_queries_total",
    "prefix_cache_hits": "core:prefix_cache_hits_total",
    "external_prefix_cache_queries": "core:external_prefix_cache_queries_total",
    "external_prefix_cache_hits": "core:external_prefix_cache_hits_total",
    "kv_offload_loaded_bytes": "core:kv_offload_loaded_bytes_total",
    "kv_offload_stored_bytes": "core:kv_offload_stored_bytes_total",
}


@dataclass(slots=True)
class Reply:
    """One request's outcome: its prompt, TTFT and generated text."""

    prompt: list[int]
    ttft_s: float
    text: str
    num_output_tokens: int


@dataclass(slots=True)
class ArmRun:
    """An arm's replies in order, its wall time, its counters over the measured part, and the
    warning and error lines of its server's log."""

    replies: list[Reply] = field(default_factory=list)
    total_s: float = 0.0
    counters: dict[str, float] = field(default_factory=dict)
    server_warnings: list[str] = field(default_factory=list)


# ---- requests ----------------------------------------------------------------------------------


async def send(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> Reply:
    """One streamed greedy request of exactly `max_tokens` tokens; raises if it failed."""
    payload = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    result = await stream_completion(client, url, payload)
    if result.error is not None:
        raise RuntimeError(f"a request of {len(prompt)} prompt tokens failed: {result.error}")
    return Reply(prompt, result.ttft_s, result.text, result.num_output_tokens)


async def send_all(url: str, prompts: list[list[int]], max_tokens: int) -> list[Reply]:
    """The prompts one at a time (closed loop)."""
    async with httpx.AsyncClient(timeout=1800.0) as client:
        return [await send(client, url, prompt, max_tokens) for prompt in prompts]


async def run_chat(
    url: str, plan: ChatPlan, encode: Encode, reference: list[Reply] | None
) -> tuple[ArmRun, dict[str, float]]:
    """Sends the plan's visits in order; returns the run (counters unset) and /metrics after
    the first visits. Each reply appended to its conversation is the one generated here, or
    with `reference` the reference's reply at the same position (so the prompts are its)."""
    session, run = ChatSession(plan), ArmRun()
    after_first_visits: dict[str, float] = {}
    start_s = time.monotonic()
    async with httpx.AsyncClient(timeout=1800.0) as client:
        for index, (conversation, _visit) in enumerate(plan.visit_order()):
            if index == plan.num_conversations:
                after_first_visits = read_metrics(url)
            reply = await send(client, url, session.next_prompt(conversation), plan.max_tokens)
            appended = reply.text if reference is None else reference[index].text
            session.add_reply(conversation, encode(appended)[: plan.max_tokens])
            run.replies.append(reply)
    run.total_s = time.monotonic() - start_s
    return run, after_first_visits


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {key: after.get(name, 0.0) - before.get(name, 0.0) for key, name in COUNTERS.items()}


# ---- 1. multi-turn chat, host tier against none ------------------------------------------------


def chat_arm(
    args: argparse.Namespace,
    tier: bool,
    plan: ChatPlan,
    pool: ChatPoolSize,
    encode: Encode,
    reference: list[Reply] | None,
) -> ArmRun:
    """One server (with the host tier or without), warmed up, then the whole chat."""
    flags = [*args.server_flags, *pool_flags(pool.num_gpu_blocks, pool.max_model_len)]
    if tier:
        flags += ["--kv-offloading-size", str(args.host_tier_gib)]
    log_path = args.log_dir / f"chat-{'tier' if tier else 'no-tier'}.log"
    with core_serve(flags, log_path) as url:
        asyncio.run(send_all(url, [warm_up_prompt(encode, "chat")], WARM_UP_MAX_TOKENS))
        run, after_first_visits = asyncio.run(run_chat(url, plan, encode, reference))
        run.counters = counter_deltas(after_first_visits, read_metrics(url))
    run.server_warnings = log_warnings(log_path)
    return run


def measure_chat(args: argparse.Namespace, encode: Encode) -> dict:
    plan = build_chat_plan(encode, args.chat_shape, args.seed)
    pool = chat_pool_size(plan)
    print(
        f"chat: {plan.num_conversations} conversations x {plan.num_visits} visits, pool of "
        f"{pool.num_gpu_blocks} blocks of {pool.block_size} (document {pool.num_shared_blocks}, "
        f"{pool.num_blocks_beyond_document} beyond it; one conversation holds up to "
        f"{pool.max_own_blocks}, the others at least {pool.min_blocks_between_visits} between "
        f"two of its visits), --max-model-len {pool.max_model_len}"
    )
    no_tier = chat_arm(args, False, plan, pool, encode, None)
    print_chat_arm("no tier", no_tier, plan)
    host_tier = chat_arm(args, True, plan, pool, encode, no_tier.replies)
    print_chat_arm("host tier", host_tier, plan)
    if [r.prompt for r in host_tier.replies] != [r.prompt for r in no_tier.replies]:
        raise RuntimeError("the arms were sent different prompts")
    rows = [chat_row("no tier", no_tier, plan), chat_row("host tier", host_tier, plan)]
    differing = differing_replies(no_tier.replies, host_tier.replies)
    return {
        "shape": _shape_dict(args.chat_shape),
        "pool": pool_dict(pool),
        "prompt_tokens": [len(reply.prompt) for reply in no_tier.replies],
        "document_hit_tokens": document_hit_tokens(plan),
        "rows": rows,
        "tier_flags": ["--kv-offloading-size", str(args.host_tier_gib)],
        "differing_replies": differing,
        "ttft_p50_ratio": rows[1]["ttft_ms"]["p50"] / rows[0]["ttft_ms"]["p50"],
        "ttft_mean_ratio": rows[1]["ttft_mean_ms"] / rows[0]["ttft_mean_ms"],
        "total_ratio": rows[1]["total_s"] / rows[0]["total_s"],
    }


def chat_row(arm: str, run: ArmRun, plan: ChatPlan) -> dict:
    revisits_ms = [reply.ttft_s * 1e3 for reply in run.replies[plan.num_conversations :]]
    first_ms = [reply.ttft_s * 1e3 for reply in run.replies[: plan.num_conversations]]
    return {
        "arm": arm,
        "ttft_ms": percentiles(revisits_ms),
        "ttft_mean_ms": mean(revisits_ms),
        "first_visit_ttft_mean_ms": mean(first_ms),
        "total_s": run.total_s,
        "num_revisits": len(revisits_ms),
        **run.counters,
        "server_warnings": run.server_warnings,
    }


def document_hit_tokens(plan: ChatPlan) -> int:
    """Pool hits of the revisits if the pool keeps the document's full blocks and nothing else
    (a hit never covers a prompt's last token, and the document is followed by an opening)."""
    return (plan.num_visits - 1) * plan.num_conversations * plan.num_shared_blocks * plan.block_size


def print_chat_arm(arm: str, run: ArmRun, plan: ChatPlan) -> None:
    row = chat_row(arm, run, plan)
    print(
        f"{arm}: revisit TTFT p50 {row['ttft_ms']['p50']:.0f} ms, mean {row['ttft_mean_ms']:.0f}"
        f" ms, total {row['total_s']:.1f} s, pool hits {row['prefix_cache_hits']:.0f}, tier hits"
        f" {row['external_prefix_cache_hits']:.0f}/{row['external_prefix_cache_queries']:.0f}"
    )


# ---- 2. restart: warm disk tier against an empty one -------------------------------------------


def restart_arm(
    args: argparse.Namespace, folder: Path, prompts: list[list[int]], encode: Encode, label: str
) -> ArmRun:
    """One server with both tiers on `folder`, warmed up, then the prompts."""
    num_blocks, max_model_len = restart_pool_size(
        [*prompts, warm_up_prompt(encode, "restart")], args.restart_max_tokens, args.block_size
    )
    flags = [*args.server_flags, *pool_flags(num_blocks, max_model_len),
             "--kv-offloading-size", str(args.host_tier_gib),
             "--kv-offloading-path", str(folder)]  # fmt: skip
    log_path = args.log_dir / f"restart-{label}.log"
    with core_serve(flags, log_path) as url:
        asyncio.run(send_all(url, [warm_up_prompt(encode, "restart")], WARM_UP_MAX_TOKENS))
        before = read_metrics(url)
        start_s = time.monotonic()
        replies = asyncio.run(send_all(url, prompts, args.restart_max_tokens))
        run = ArmRun(replies, time.monotonic() - start_s)
        run.counters = counter_deltas(before, read_metrics(url))
    run.server_warnings = log_warnings(log_path)
    return run


def measure_restart(args: argparse.Namespace, encode: Encode) -> dict:
    prompts = long_prompts(encode, args.restart_prompts, args.restart_prompt_tokens,
                           args.block_size, args.seed + 1)  # fmt: skip
    with (
        tempfile.TemporaryDirectory(prefix="bench-kv-warm-", dir=args.disk_root) as warm_dir,
        tempfile.TemporaryDirectory(prefix="bench-kv-cold-", dir=args.disk_root) as cold_dir,
    ):
        first = restart_arm(args, Path(warm_dir), prompts, encode, "first")
        file_sizes = [path.stat().st_size for path in Path(warm_dir).rglob("*.kv")]
        print(f"restart: the first server left {len(file_sizes)} block files in {warm_dir}")
        warm = restart_arm(args, Path(warm_dir), prompts, encode, "warm")
        num_files_after_warm = len(list(Path(warm_dir).rglob("*.kv")))
        cold = restart_arm(args, Path(cold_dir), prompts, encode, "cold")
    rows = [restart_row("first (fills DIR)", first), restart_row("warm (restarted on DIR)", warm),
            restart_row("cold (empty DIR)", cold)]  # fmt: skip
    for row in rows:
        print(f"{row['arm']}: TTFT p50 {row['ttft_ms']['p50']:.0f} ms, tier hits "
              f"{row['external_prefix_cache_hits']:.0f}")  # fmt: skip
    return {
        "num_prompts": len(prompts),
        "prompt_tokens": args.restart_prompt_tokens,
        "max_tokens": args.restart_max_tokens,
        "num_files_after_first": len(file_sizes),
        "bytes_on_disk_after_first": sum(file_sizes),
        "num_files_after_warm": num_files_after_warm,
        "rows": rows,
        "differing_replies_warm_vs_cold": differing_replies(cold.replies, warm.replies),
        "differing_replies_warm_vs_first": differing_replies(first.replies, warm.replies),
        "ttft_p50_ratio": rows[1]["ttft_ms"]["p50"] / rows[2]["ttft_ms"]["p50"],
        "ttft_mean_ratio": rows[1]["ttft_mean_ms"] / rows[2]["ttft_mean_ms"],
    }


def restart_row(arm: str, run: ArmRun) -> dict:
    ttfts_ms = [reply.ttft_s * 1e3 for reply in run.replies]
    return {"arm": arm, "ttft_ms": percentiles(ttfts_ms), "ttft_mean_ms": mean(ttfts_ms),
            "total_s": run.total_s, **run.counters,
            "server_warnings": run.server_warnings}  # fmt: skip


# ---- shared --------------------------------------------------------------------------------------


def log_warnings(log_path: Path, most: int = 20) -> list[str]:
    """The first `most` WARNING or ERROR lines of a server's log (a tier that skipped a file
    says so there)."""
    lines = log_path.read_text(errors="replace").splitlines()
    return [line for line in lines if " WARNING " in line or " ERROR " in line][:most]


def pool_flags(num_gpu_blocks: int, max_model_len: int) -> list[str]:
    return ["--num-gpu-blocks-override", str(num_gpu_blocks), "--max-model-len", str(max_model_len)]


def differing_replies(reference: list[Reply], other: list[Reply]) -> list[int]:
    """Positions whose generated text or token count differs between two runs."""
    return [
        index
        for index, (a, b) in enumerate(zip(reference, other, strict=True))
        if (a.text, a.num_output_tokens) != (b.text, b.num_output_tokens)
    ]


def pool_dict(pool: ChatPoolSize) -> dict:
    return {
        "num_gpu_blocks": pool.num_gpu_blocks,
        "block_size": pool.block_size,
        "num_shared_blocks": pool.num_shared_blocks,
        "num_blocks_beyond_document": pool.num_blocks_beyond_document,
        "max_own_blocks": pool.max_own_blocks,
        "min_blocks_between_visits": pool.min_blocks_between_visits,
        "max_model_len": pool.max_model_len,
    }


def _shape_dict(shape: ChatShape) -> dict:
    return {name: getattr(shape, name) for name in ChatShape.__slots__}


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value of `flag` in core-serve flags (`--flag V` or `--flag=V`), None if absent."""
    for index, arg in enumerate(argv):
        if arg == flag and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


# ---- command line --------------------------------------------------------------------------------

MEASUREMENTS = ("chat", "restart")
# Flags the benchmark sets itself, per arm: the same flag in --server-args would fight them.
OWN_FLAGS = ("--block-size", "--num-gpu-blocks-override", "--max-model-len",
             "--kv-offloading-size", "--kv-offloading-path", "--kv-transfer-config",
             "--no-enable-prefix-caching")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="small run, about a minute on a quiet machine"
    )
    parser.add_argument("--server-args", default="--device cpu",
                        help="core-serve flags for every server (not the pool or tier flags)")  # fmt: skip
    parser.add_argument("--measurements", nargs="+", choices=MEASUREMENTS, default=MEASUREMENTS)
    parser.add_argument("--host-tier-gib", type=float, default=1.0,
                        help="--kv-offloading-size of the arms with a tier")  # fmt: skip
    parser.add_argument("--disk-root", type=Path, default=None,
                        help="where the disk tiers' folders are made (default: the temp dir)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1,
                        help="OMP_NUM_THREADS for the servers (0: leave unset)")  # fmt: skip
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="keep the servers' logs here (default: a temporary folder)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", type=Path, default=None,
                        help="default: benchmarks/results/<device folder>/")  # fmt: skip
    args = parser.parse_args(argv)
    args.server_flags = shlex.split(args.server_args)
    for flag in OWN_FLAGS:
        if flag_value(args.server_flags, flag) is not None or flag in args.server_flags:
            parser.error(f"--server-args may not hold {flag}: the benchmark sets it per arm")
    if args.host_tier_gib <= 0:
        parser.error(f"--host-tier-gib must be positive, got {args.host_tier_gib}")
    args.chat_shape = QUICK_CHAT_SHAPE if args.quick else CHAT_SHAPE
    args.block_size = args.chat_shape.block_size
    args.restart_prompts = QUICK_RESTART_PROMPTS if args.quick else RESTART_PROMPTS
    args.restart_prompt_tokens = (
        QUICK_RESTART_PROMPT_TOKENS if args.quick else RESTART_PROMPT_TOKENS
    )
    args.restart_max_tokens = QUICK_RESTART_MAX_TOKENS if args.quick else RESTART_MAX_TOKENS
    args.device = flag_value(args.server_flags, "--device") or "auto"
    if args.output_dir is None:
        args.output_dir = device_results_dir(args.device)
    return args


def main() -> None:
    args = parse_args()
    tokenizer = load_engine_tokenizer(EngineConfig(model=flag_value(args.server_flags, "--model")))
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    if args.threads > 0:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the servers' workers
    # The restart needs one hash seed in every server; the chat arms share it too.
    os.environ.setdefault(PREFIX_HASH_SEED_ENV, DEFAULT_PREFIX_HASH_SEED)
    args.server_flags = [*args.server_flags, "--block-size", str(args.block_size)]
    machine = machine_info()
    start_s = time.monotonic()
    result = {
        "benchmark": "kv_offloading",
        "quick": args.quick,
        "machine": machine,
        "server": f"core-serve {shlex.join(args.server_flags)}",
        "omp_num_threads": args.threads or None,
        "prefix_hash_seed": os.environ[PREFIX_HASH_SEED_ENV],
        "host_tier_gib": args.host_tier_gib,
    }
    with tempfile.TemporaryDirectory(prefix="bench-kv-logs-") as log_dir:
        args.log_dir = args.log_dir or Path(log_dir)
        args.log_dir.mkdir(parents=True, exist_ok=True)
        if "chat" in args.measurements:
            result["chat"] = measure_chat(args, encode)
        if "restart" in args.measurements:
            result["restart"] = measure_restart(args, encode)
    result["wall_s"] = time.monotonic() - start_s
    name = result_name("kv_offloading", args.quick)
    print(write_results(result, render_markdown(result), args.output_dir, name))
    print(render_markdown(result))


if __name__ == "__main__":
    main()
