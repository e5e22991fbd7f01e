"""Async scheduling (`--async-scheduling`) through real engine processes: the same tokens as one
step at a time on the default model (greedy, seeded sampling with penalties, early stops,
logprobs, chunked prefill beside decodes), and on the null model every request ends with its
tokens, aborted ones free their blocks, and the engine stays usable.
"""

from __future__ import annotations

import time

from core_engine.frontend import LLM, SamplingParams
from core_engine.frontend.text.null_tokenizer import NullTokenizer

# SmolLM2's tokens for "The capital of France is", "def fibonacci(n):", "Once upon a time, in
# a small village," and a ChatML turn that the model answers briefly (it ends on eos).
PROMPTS = [
    [504, 3575, 282, 4649, 314],
    [1604, 3987, 46477, 24, 94, 727],
    [6403, 1980, 253, 655, 28, 281, 253, 1165, 6560, 28],
    [1, 4093, 198, 22503, 506, 253, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198],
    [504, 1345, 2399, 3575, 253, 4649, 282, 253, 1165],
]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=24, logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=1),
    SamplingParams(
        temperature=0.9, seed=7, max_tokens=20, repetition_penalty=1.3, frequency_penalty=0.5
    ),
    SamplingParams(temperature=0.0, max_tokens=60),  # ends on eos before max_tokens
    SamplingParams(temperature=0.8, top_k=20, seed=11, max_tokens=16, presence_penalty=0.4),
]


def completions(async_scheduling: bool) -> list[tuple]:
    # Three requests at a time and a small step budget: later prompts are prefilled in chunks
    # beside running decodes.
    config = dict(
        dtype="float32",
        max_num_seqs=3,
        max_num_batched_tokens=8,
        max_model_len=256,
        async_scheduling=async_scheduling,
    )
    with LLM(**config) as llm:
        outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    results = []
    for output in outputs:
        (completion,) = output.outputs
        top_ids = [entry.top_token_ids for entry in completion.logprobs or []]
        results.append((completion.token_ids, completion.finish_reason, top_ids))
    return results


def test_async_scheduling_gives_the_tokens_of_one_step_at_a_time_on_the_default_model():
    expected = completions(async_scheduling=False)
    assert expected[1][0] and len(expected[1][0]) == 1
    assert expected[3][1] == "stop" and len(expected[3][0]) < 60  # an early stop is covered
    assert completions(async_scheduling=True) == expected


def test_null_model_requests_end_with_their_tokens_and_aborts_free_their_blocks():
    tokenizer = NullTokenizer()
    config = dict(model="null", max_num_seqs=2, max_model_len=65536, num_gpu_blocks_override=8192)
    with LLM(**config, async_scheduling=True) as llm:
        max_tokens = [9, 1, 5, 3, 2]
        outputs = llm.generate(
            ["a", [7, 8, 9], "ccc", "d", "e"],
            [SamplingParams(max_tokens=n) for n in max_tokens],
            use_tqdm=False,
        )
        assert [o.outputs[0].token_ids for o in outputs] == [[42] * n for n in max_tokens]
        assert outputs[0].prompt_token_ids == tokenizer.encode("a")
        client = llm._client
        stream = client.generate(
            "long", SamplingParams(max_tokens=60_000, ignore_eos=True), request_id="long"
        )
        assert next(stream).outputs[0].token_ids  # running, with steps in flight
        client.abort("long")
        deadline = time.monotonic() + 30
        while client.get_stats().kv_cache_usage and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = client.get_stats()
        assert stats.num_running_reqs == 0 and stats.kv_cache_usage == 0.0
        (again,) = llm.generate("again", SamplingParams(max_tokens=4), use_tqdm=False)
        assert again.outputs[0].token_ids == [42] * 4
