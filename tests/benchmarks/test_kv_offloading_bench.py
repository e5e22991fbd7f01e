"""The KV offloading benchmark's parts in process: the chat workload, its pool, the report;
and the shared markdown table and serving plot."""

from __future__ import annotations

import pytest

from benchmarks.harness.common import (
    RESULTS_DIR,
    markdown_table,
)
from benchmarks.harness.results_page import (
    PAGE_INTRO,
    PAGE_PATH,
    plot_serving,
    render_page,
    write_page,
)
from benchmarks.kv import offloading as bench_kv_offloading
from benchmarks.kv.offloading import CHAT_SHAPE, QUICK_CHAT_SHAPE, Reply, differing_replies
from benchmarks.kv.offloading_report import render_markdown as render_kv_offloading
from benchmarks.kv.offloading_workload import (
    ChatSession,
    ChatShape,
    build_chat_plan,
    chat_pool_size,
    long_prompts,
    restart_pool_size,
)
from core_engine.core.kv_cache.kv_cache_manager import KVCacheManager
from core_engine.frontend.text.null_tokenizer import NullTokenizer
from tests.helpers.core_factories import make_request

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---- KV offloading: the chat workload, its pool, the report -----------------------------------


def test_chat_histories_grow_by_the_reply_and_the_next_user_message():
    plan = build_chat_plan(NullTokenizer().encode, ChatShape(4, 3, 40, 20, 6, 5), seed=0)
    session = ChatSession(plan)
    first_visits = [session.next_prompt(c) for c in range(4)]
    for conversation, prompt in enumerate(first_visits):
        assert prompt == plan.document + plan.openings[conversation]
        assert len(prompt) == 40 + 20
    # the shared prefix is exactly the document: the openings differ in their first block
    assert len({tuple(prompt[40 : 40 + 16]) for prompt in first_visits}) == 4
    session.add_reply(1, [7, 8, 9])
    second = session.next_prompt(1)
    assert second == first_visits[1] + [7, 8, 9] + plan.user_messages[1][0]
    session.add_reply(1, [])
    assert session.next_prompt(1) == second + plan.user_messages[1][1]
    with pytest.raises(ValueError, match="all 3 visits"):
        session.next_prompt(1)
    with pytest.raises(ValueError, match="6 tokens is longer than max_tokens=5"):
        session.add_reply(0, [1] * 6)


def test_chat_visits_go_round_robin_and_bound_their_prompt_lengths():
    plan = build_chat_plan(NullTokenizer().encode, ChatShape(3, 2, 40, 20, 6, 5), seed=0)
    assert plan.visit_order() == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    assert plan.prompt_tokens_bounds(2, 0) == (60, 60)
    assert plan.prompt_tokens_bounds(2, 1) == (66, 71)  # the reply: 0 to max_tokens=5 tokens


def test_the_chat_pool_holds_the_document_and_two_conversations_at_their_longest():
    plan = build_chat_plan(NullTokenizer().encode, CHAT_SHAPE, seed=0)
    pool = chat_pool_size(plan)
    # longest request: 768 + 320 + 4 x (24 + 32) + 24 = 1336 tokens = 84 blocks, 48 of them
    # the document's; the null block, the document and 2 x 36 blocks.
    assert (pool.num_shared_blocks, pool.max_own_blocks) == (48, 36)
    assert pool.num_gpu_blocks == 1 + 48 + 2 * 36 and pool.max_model_len == 84 * 16
    # between visits 0 and 1 of conversation 0, the five others' openings: 5 x (68 - 48) blocks
    assert pool.min_blocks_between_visits == 100 > pool.num_blocks_beyond_document == 72
    assert pool.evicts_between_visits


def test_a_pool_that_would_keep_a_conversation_between_visits_is_refused():
    plan = build_chat_plan(NullTokenizer().encode, ChatShape(3, 4, 64, 32, 16, 8), seed=0)
    with pytest.raises(ValueError, match="keeps a conversation between its visits"):
        chat_pool_size(plan)


@pytest.mark.parametrize("shape", [CHAT_SHAPE, QUICK_CHAT_SHAPE], ids=["full", "quick"])
def test_no_revisit_finds_its_own_history_in_the_pool(shape):
    """The engine's own KVCacheManager, sized by chat_pool_size, runs the chat with replies of
    max_tokens tokens: every request fits, and every revisit hits the document's full blocks
    and nothing of its own history."""
    plan = build_chat_plan(NullTokenizer().encode, shape, seed=0)
    pool = chat_pool_size(plan)
    manager = KVCacheManager(pool.num_gpu_blocks, pool.block_size, pool.max_model_len, True)
    session = ChatSession(plan)
    for index, (conversation, visit) in enumerate(plan.visit_order()):
        prompt = session.next_prompt(conversation)
        reply = [1000 + index] * plan.max_tokens
        # computed: the prompt and every reply token but the last (sampled, never fed back)
        request = make_request(f"r{index}", prompt + reply[:-1], block_size=pool.block_size)
        blocks, num_hit = manager.get_computed_blocks(request)
        if index > 0:
            assert num_hit == pool.num_shared_blocks * pool.block_size, (conversation, visit)
        new_tokens = request.num_tokens - num_hit + 1  # a slot for the last token too
        assert manager.allocate_slots(request, new_tokens, num_hit, blocks) is not None
        request.num_computed_tokens = request.num_tokens
        manager.free(request)
        manager.check_integrity()
        session.add_reply(conversation, reply)


def test_restart_prompts_share_no_block_and_fit_the_pool_together():
    prompts = long_prompts(NullTokenizer().encode, 5, 100, 16, seed=0)
    assert [len(prompt) for prompt in prompts] == [100] * 5
    assert len({tuple(prompt[:16]) for prompt in prompts}) == 5
    # each prompt with 8 output tokens: 7 blocks; plus the null block
    assert restart_pool_size(prompts, 8, 16) == (1 + 5 * 7, 7 * 16)


def kv_offloading_result(differing: list[int]) -> dict:
    counters = dict(prefix_cache_queries=0.0, prefix_cache_hits=0.0,
                    external_prefix_cache_queries=0.0, external_prefix_cache_hits=0.0,
                    kv_offload_loaded_bytes=0.0, kv_offload_stored_bytes=0.0)  # fmt: skip

    def row(arm: str, p50: float, **extra) -> dict:
        return {"arm": arm, "ttft_ms": {"p50": p50, "p90": 2 * p50, "p99": 3 * p50},
                "ttft_mean_ms": p50, "first_visit_ttft_mean_ms": 900.0, "total_s": 12.5,
                "num_revisits": 4, **counters, "server_warnings": [], **extra}  # fmt: skip

    tier = row("host tier", 250.0, prefix_cache_hits=512.0, external_prefix_cache_hits=960.0,
               external_prefix_cache_queries=1400.0, kv_offload_loaded_bytes=3 * 2**20)  # fmt: skip
    return {
        "server": "core-serve --device cpu --block-size 16",
        "omp_num_threads": 1,
        "prefix_hash_seed": "00" * 16,
        "host_tier_gib": 1.0,
        "chat": {
            "shape": {
                "num_conversations": 2,
                "num_visits": 3,
                "document_tokens": 64,
                "opening_tokens": 48,
                "user_tokens": 16,
                "max_tokens": 8,
            },  # fmt: skip
            "pool": {
                "num_gpu_blocks": 15,
                "block_size": 16,
                "num_shared_blocks": 4,
                "num_blocks_beyond_document": 10,
                "max_own_blocks": 5,
                "min_blocks_between_visits": 12,
                "max_model_len": 144,
            },  # fmt: skip
            "prompt_tokens": [112, 112, 136, 136, 160, 160],
            "document_hit_tokens": 256,
            "rows": [row("no tier", 1000.0), tier],
            "differing_replies": differing,
            "ttft_p50_ratio": 0.25,
            "ttft_mean_ratio": 0.25,
            "total_ratio": 0.5,
        },
        "restart": {
            "num_prompts": 2,
            "prompt_tokens": 128,
            "max_tokens": 8,
            "num_files_after_first": 16,
            "bytes_on_disk_after_first": 8 * 2**20,
            "num_files_after_warm": 16,
            "rows": [
                row("first (fills DIR)", 800.0),
                row("warm (restarted on DIR)", 100.0),
                row("cold (empty DIR)", 800.0),
            ],
            "differing_replies_warm_vs_cold": [],
            "ttft_p50_ratio": 0.125,
            "ttft_mean_ratio": 0.125,
        },  # fmt: skip
    }


def test_kv_offloading_markdown_has_the_flags_both_tables_and_the_checks():
    text = render_kv_offloading(kv_offloading_result(differing=[]))
    assert "`--num-gpu-blocks-override 15 --max-model-len 144`" in text
    assert "`--kv-offloading-size 1`" in text
    assert "| host tier | 250/500 | 250 | 900 | 12.5 | 512 | 960/1400 | 3.0 |" in text
    assert "TTFT host tier / no tier: **0.25** at p50, 0.25 in the mean, 0.50 in total" in text
    assert "the host tier's replies equal no tier's (6 of 6)" in text
    assert "| warm (restarted on DIR) | 100 | 100 | 12.5 | 0 | 0/0 | 0.0 |" in text
    assert "TTFT warm / cold: **0.12** at p50" in text
    assert "16 block files (8.0 MiB)" in text
    assert "removed" not in text and "Warnings" not in text
    result = kv_offloading_result(differing=[3, 5])
    result["restart"]["num_files_after_warm"] = 13
    result["restart"]["rows"][1]["server_warnings"] = ["... WARNING KV disk tier: ignoring"] * 2
    text = render_kv_offloading(result)
    assert "differ from no tier's in 2 of 6 (positions [3, 5])" in text
    assert "16 block files (8.0 MiB) in DIR (of which the warm server removed 3)" in text
    assert "Warnings in the servers' logs (the lines are in the JSON): warm" in text


def test_kv_offloading_replies_differ_by_text_or_token_count():
    def reply(text: str, num_tokens: int) -> Reply:
        return Reply([1, 2], 0.1, text, num_tokens)

    same = [reply("a b", 2), reply("c", 1), reply("d", 1)]
    other = [reply("a b", 2), reply("c!", 1), reply("d", 2)]
    assert differing_replies(same, same) == []
    assert differing_replies(same, other) == [1, 2]


def test_kv_offloading_refuses_server_flags_it_sets_per_arm(capsys):
    with pytest.raises(SystemExit):
        bench_kv_offloading.parse_args(["--server-args", "--device cpu --max-model-len 512"])
    assert "may not hold --max-model-len" in capsys.readouterr().err
    args = bench_kv_offloading.parse_args(["--quick", "--server-args", "--device cuda"])
    assert args.chat_shape == QUICK_CHAT_SHAPE and args.output_dir.name == "gpu"


def test_markdown_table_aligns_numbers_right():
    table = markdown_table(["name", "value"], [["a", 1]])
    assert table.splitlines() == ["| name | value |", "|:---|---:|", "| a | 1 |"]


def test_plot_and_benchmarks_page(tmp_path):
    rows = [
        {
            "offered_rate": rate,
            "request_throughput": throughput,
            "output_tokens_per_s": 20 * throughput,
            "ttft_ms": {"p50": 100.0 * (i + 1), "p90": 150.0, "p99": 200.0 * (i + 1)},
            "itl_ms": {"p50": 50.0, "p90": 60.0, "p99": 90.0},
        }
        for i, (rate, throughput) in enumerate([(0.5, 0.5), (1.0, 0.9), ("inf", 1.2)])
    ]
    results_dir = tmp_path / "benchmarks" / "results"
    plot_serving({"rows": rows, "server": "test"}, results_dir / "serving.png")
    assert (results_dir / "serving.png").read_bytes().startswith(PNG_MAGIC)
    peer = {"name": "vllm", "version": "9.9", "rows": rows}
    plot_serving({"rows": rows, "server": "test", "peer": peer}, results_dir / "serving_vllm.png")
    assert (results_dir / "serving_vllm.png").read_bytes().startswith(PNG_MAGIC)
    (results_dir / "README.md").write_text("# CPU runs\n\n## On one CPU\n\nwhat ran\n")
    (results_dir / "offline.md").write_text("### Offline table\n")
    (results_dir / "serving.md").write_text("### Serving table\n")
    (results_dir / "offline_quick.md").write_text("### must not appear\n")
    (results_dir / "scheduler.md").write_text("| running |\n|---:|\n| 64 |\n")
    page = tmp_path / "docs" / "benchmarks.md"
    write_page(results_dir, page)
    text = page.read_text()
    assert text.startswith(PAGE_INTRO)
    assert "\n## CPU runs\n" in text and "\n### On one CPU\n" in text  # a section of the page
    assert text.index("what ran") < text.index("### Offline table") < text.index("### Serving")
    assert "](../benchmarks/results/serving.png)" in text
    assert "serving_vllm.png" not in text  # no serving_vllm.md table
    assert "must not appear" not in text
    assert "### Scheduler" in text and text.index("### Scheduler") < text.index("| running |")


def test_the_benchmarks_page_is_the_one_the_results_give():
    """docs/benchmarks.md is generated, never edited: it equals what the results give now."""
    assert render_page(RESULTS_DIR, PAGE_PATH.parent) == PAGE_PATH.read_text(), (
        "docs/benchmarks.md is out of date: python -m benchmarks.harness.results_page"
    )
