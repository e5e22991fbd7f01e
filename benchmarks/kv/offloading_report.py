"""The markdown of the KV offloading benchmark (`benchmarks/kv/offloading.py`): the flags,
one table per measurement with its ratio and its greedy-equality check."""

from __future__ import annotations

from benchmarks.harness.common import markdown_table

MIB = 2**20


def render_markdown(result: dict) -> str:
    """Everything measured in `result`; the machine line is added by write_results."""
    parts = [
        f"Servers: `{result['server']}`, OMP_NUM_THREADS={result['omp_num_threads']}, "
        f"CORE_ENGINE_PREFIX_HASH_SEED={result['prefix_hash_seed']}; the tier arms add "
        f"`--kv-offloading-size {result['host_tier_gib']:g}`."
    ]
    if "chat" in result:
        parts.append(render_chat(result["chat"]))
    if "restart" in result:
        parts.append(render_restart(result["restart"]))
    if warned := _warned_arms(result):
        parts.append(f"Warnings in the servers' logs (the lines are in the JSON): {warned}.")
    return "\n\n".join(parts)


def _warned_arms(result: dict) -> str:
    """ "arm: count" for every server whose log had WARNING or ERROR lines, joined."""
    return ", ".join(
        f"{result[part]['rows'][i]['arm']}: {len(row['server_warnings'])}"
        for part in ("chat", "restart")
        if part in result
        for i, row in enumerate(result[part]["rows"])
        if row["server_warnings"]
    )


def render_chat(chat: dict) -> str:
    shape, pool = chat["shape"], chat["pool"]
    rows = [
        [
            row["arm"],
            f"{row['ttft_ms']['p50']:.0f}/{row['ttft_ms']['p90']:.0f}",
            f"{row['ttft_mean_ms']:.0f}",
            f"{row['first_visit_ttft_mean_ms']:.0f}",
            f"{row['total_s']:.1f}",
            f"{row['prefix_cache_hits']:.0f}",
            f"{row['external_prefix_cache_hits']:.0f}/{row['external_prefix_cache_queries']:.0f}",
            f"{row['kv_offload_loaded_bytes'] / MIB:.1f}",
        ]
        for row in chat["rows"]
    ]
    header = ["arm", "TTFT p50/p90 ms", "TTFT mean ms", "first visits' TTFT mean ms",
              "total s", "pool hits", "tier hits/queries", "loaded MiB"]  # fmt: skip
    prompt_tokens = chat["prompt_tokens"]
    return (
        f"### Multi-turn chat: {shape['num_conversations']} conversations x "
        f"{shape['num_visits']} visits round robin over a {shape['document_tokens']}-token "
        f"document, host tier vs none\n\n"
        f"Each conversation opens with {shape['opening_tokens']} tokens of its own, then each "
        f"visit appends the reply ({shape['max_tokens']} tokens, greedy, ignore_eos) and "
        f"{shape['user_tokens']} user tokens: prompts of {min(prompt_tokens)}-"
        f"{max(prompt_tokens)} tokens. Pool: `--num-gpu-blocks-override "
        f"{pool['num_gpu_blocks']} --max-model-len {pool['max_model_len']}` (blocks of "
        f"{pool['block_size']}: the document's {pool['num_shared_blocks']}, then "
        f"{pool['num_blocks_beyond_document']}, two conversations at their longest; between two "
        f"visits of one conversation the others hold at least "
        f"{pool['min_blocks_between_visits']}). TTFT and counters over the "
        f"{chat['rows'][0]['num_revisits']} revisits (one request at a time); total over all "
        f"{len(prompt_tokens)} requests.\n\n"
        f"{markdown_table(header, rows)}\n\n"
        f"TTFT host tier / no tier: **{chat['ttft_p50_ratio']:.2f}** at p50, "
        f"{chat['ttft_mean_ratio']:.2f} in the mean, {chat['total_ratio']:.2f} in total time. "
        f"Pool hits if the pool kept only the "
        f"document: {chat['document_hit_tokens']}. "
        + _equality_sentence(
            chat["differing_replies"], len(prompt_tokens), "the host tier's replies", "no tier's"
        )
    )


def render_restart(restart: dict) -> str:
    rows = [
        [
            row["arm"],
            f"{row['ttft_ms']['p50']:.0f}",
            f"{row['ttft_mean_ms']:.0f}",
            f"{row['total_s']:.1f}",
            f"{row['prefix_cache_hits']:.0f}",
            f"{row['external_prefix_cache_hits']:.0f}/{row['external_prefix_cache_queries']:.0f}",
            f"{row['kv_offload_loaded_bytes'] / MIB:.1f}",
        ]
        for row in restart["rows"]
    ]
    header = ["server", "TTFT p50 ms", "TTFT mean ms", "total s", "pool hits",
              "tier hits/queries", "loaded MiB"]  # fmt: skip
    return (
        f"### Restart: {restart['num_prompts']} distinct {restart['prompt_tokens']}-token "
        f"prompts, disk tier warm vs cold\n\n"
        f"Every server: `--kv-offloading-size` and `--kv-offloading-path DIR`, a pool holding "
        f"every prompt, {restart['max_tokens']} greedy tokens each, one request at a time. The "
        f"first server left {restart['num_files_after_first']} block files "
        f"({restart['bytes_on_disk_after_first'] / MIB:.1f} MiB) in DIR"
        f"{_files_lost(restart)}; the warm server restarts on DIR, the cold one on an empty "
        f"folder.\n\n"
        f"{markdown_table(header, rows)}\n\n"
        f"TTFT warm / cold: **{restart['ttft_p50_ratio']:.2f}** at p50, "
        f"{restart['ttft_mean_ratio']:.2f} in the mean. "
        + _equality_sentence(
            restart["differing_replies_warm_vs_cold"],
            restart["num_prompts"],
            "the warm server's replies",
            "the cold server's",
        )
    )


def _files_lost(restart: dict) -> str:
    num_lost = restart["num_files_after_first"] - restart["num_files_after_warm"]
    return f" (of which the warm server removed {num_lost})" if num_lost > 0 else ""


def _equality_sentence(differing: list[int], num_replies: int, subject: str, other: str) -> str:
    if not differing:
        return f"Greedy check: {subject} equal {other} ({num_replies} of {num_replies})."
    return (
        f"Greedy check: {subject} differ from {other} in {len(differing)} of {num_replies} "
        f"(positions {differing})."
    )
