"""Speculative decoding is lossless: float32 greedy tokens of the default SmolLM2 GGUF are the
same with and without drafts, through chunked prefill, prefix-cache hits, a KV pool small enough
to preempt, stop tokens inside an accepted run and max_tokens cut mid-run, for both drafting
methods; and drafts are really verified and accepted (the stats say how many), so the equality
is not that of a run that never drafted."""

from __future__ import annotations

import pytest
import torch

from core_engine.common.model_files import resolve_model_path
from core_engine.core.in_process_engine import GenerationOutput
from core_engine.frontend.text.tokenizer import load_tokenizer
from core_engine.proto import SamplingParams
from core_engine.proto.engine_config import EngineConfig
from core_engine.worker.worker import Worker
from tests.helpers.engine_helpers import generate_token_ids

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 256
NUM_NEW_TOKENS = 40
SHARED_PREFIX = (
    "You are a careful assistant. Repeat the user's text exactly when asked, and keep every "
    "answer short. "
)
PROMPTS = [
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "def add(a, b):\n    return a + b\n\n\ndef add_three(a, b, c):\n    return",
    SHARED_PREFIX + "Text: the quick brown fox jumps over the lazy dog. Repeat it: the quick",
    SHARED_PREFIX + "Text: red, green, blue, red, green, blue, red, green,",
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]
METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
    "suffix": {"method": "suffix", "num_speculative_tokens": 6},
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def worker() -> Worker:
    w = Worker(
        EngineConfig(
            device="cpu",
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=16,
            max_num_batched_tokens=2048,
        )
    )
    w.load_model()
    return w


@pytest.fixture(scope="module")
def prompt_token_ids(worker) -> list[list[int]]:
    tokenizer = load_tokenizer(resolve_model_path(None))
    return [tokenizer.encode(prompt, add_special_tokens=False) for prompt in PROMPTS]


def run(worker, prompt_token_ids, params: SamplingParams, **options) -> GenerationOutput:
    config = EngineConfig(device="cpu", max_model_len=MAX_MODEL_LEN, max_num_seqs=16, **options)
    return generate_token_ids(prompt_token_ids, config, sampling_params=params, worker=worker)


GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def baseline(worker, prompt_token_ids) -> list[list[int]]:
    output = run(worker, prompt_token_ids, GREEDY, num_gpu_blocks_override=200)
    return [r.token_ids for r in output.results]


def assert_lossless(output: GenerationOutput, expected: list[list[int]]) -> None:
    for i, (result, want) in enumerate(zip(output.results, expected, strict=True)):
        assert result.token_ids == want, f"prompt {i} ({PROMPTS[i][:40]!r}) diverged"
    stats = output.stats
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens > 0  # copy-heavy prompts: drafts pay off


@pytest.mark.parametrize("method", sorted(METHODS))
def test_large_budget(worker, prompt_token_ids, baseline, method):
    output = run(
        worker,
        prompt_token_ids,
        GREEDY,
        num_gpu_blocks_override=200,
        speculative_config=METHODS[method],
    )
    assert_lossless(output, baseline)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_chunked_prefill_and_prefix_hits(worker, prompt_token_ids, baseline, method):
    output = run(
        worker,
        prompt_token_ids,
        GREEDY,
        max_num_batched_tokens=24,
        num_gpu_blocks_override=200,
        speculative_config=METHODS[method],
    )
    assert output.stats.prefix_cache_hits >= 16
    assert_lossless(output, baseline)


def test_tiny_pool_with_preemption(worker, prompt_token_ids, baseline):
    min_blocks = MAX_MODEL_LEN // worker.block_size + 1
    output = run(
        worker,
        prompt_token_ids,
        GREEDY,
        max_num_batched_tokens=64,
        num_gpu_blocks_override=min_blocks,
        speculative_config=METHODS["ngram"],
    )
    assert output.stats.num_preemptions > 0
    assert_lossless(output, baseline)


def test_stop_token_inside_an_accepted_run_and_odd_max_tokens(worker, prompt_token_ids, baseline):
    """Each request stops at its own baseline's 7th token (a stop token id), or at 13 tokens:
    accepted runs that pass either are cut exactly there."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=13, stop_token_ids=[tokens[6]], ignore_eos=True)
        for tokens in baseline
    ]
    for spec in (None, METHODS["ngram"]):
        outputs = [
            run(worker, [ids], p, num_gpu_blocks_override=200, speculative_config=spec).results[0]
            for ids, p in zip(prompt_token_ids, params, strict=True)
        ]
        for result, tokens in zip(outputs, baseline, strict=True):
            want = tokens[: tokens.index(tokens[6]) + 1]
            assert result.token_ids == want[:13]
