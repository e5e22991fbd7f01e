"""Greedy generation of the default SmolLM2 GGUF, engine vs transformers, token for token.

The engine (core Scheduler + Worker in one process, scripts.generate) runs all prompts as one
continuously batched workload; transformers generates each prompt alone from the same GGUF
converted by its own code (tools.reference_model). Small token budgets (chunked prompts), a KV
pool small enough to force preemption, and prefix-cache hits must all give the same tokens.
"""

from __future__ import annotations

import pytest
import torch

from core_engine.core.in_process_engine import GenerationOutput
from core_engine.proto import SamplingParams
from core_engine.proto.engine_config import EngineConfig
from core_engine.worker.worker import Worker
from tests.helpers.engine_helpers import generate_token_ids
from tests.helpers.model_fixtures import hf_greedy
from tools.reference_model import converted_default_model_folder

pytestmark = pytest.mark.slow

NUM_NEW_TOKENS = 32
MAX_MODEL_LEN = 256
SHARED_PREFIX = (
    "You are a careful assistant. Answer in plain English, keep every answer short, and never "
    "invent facts. If a question is unclear, say what is missing before answering it. "
)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 4, 5,",
    SHARED_PREFIX + "Question: what is the boiling point of water?",
    SHARED_PREFIX + "Question: how many legs does a spider have?",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight "
    "to synthesize foods from carbon dioxide and water. In plants, photosynthesis generally "
    "involves the green pigment chlorophyll and",
    SHARED_PREFIX + "Question: why is the sky blue?",
]


@pytest.fixture(scope="module")
def hf_folder():
    return converted_default_model_folder()


@pytest.fixture(scope="module")
def prompt_token_ids(hf_folder) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(hf_folder))
    return [tokenizer.encode(prompt, add_special_tokens=False) for prompt in PROMPTS]


@pytest.fixture(scope="module")
def expected_token_ids(hf_folder, prompt_token_ids) -> list[list[int]]:
    """transformers' greedy continuation of each prompt alone (no padding, eos ignored)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_folder), dtype=torch.float32).eval()
    return [hf_greedy(model, ids, NUM_NEW_TOKENS) for ids in prompt_token_ids]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on a shared 2-core machine two threads that wait on each other
    run tens of times slower than one, and this module is the suite's heaviest."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def worker() -> Worker:
    # float32 like the reference, whatever this CPU's default (bf16 is tests/worker/test_bf16_accuracy.py).
    w = Worker(
        EngineConfig(
            model=None,
            device="cpu",
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=16,
            max_num_batched_tokens=2048,
        )
    )
    w.load_model()
    return w


def run(worker, prompt_token_ids, **options) -> GenerationOutput:
    config = EngineConfig(device="cpu", max_model_len=MAX_MODEL_LEN, max_num_seqs=16, **options)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    return generate_token_ids(prompt_token_ids, config, sampling_params=params, worker=worker)


def assert_same_tokens(output: GenerationOutput, expected: list[list[int]]) -> None:
    for i, (result, want) in enumerate(zip(output.results, expected, strict=True)):
        assert result.token_ids == want, f"prompt {i} ({PROMPTS[i][:40]!r}) diverged"
        assert result.finish_reason == "length"


def test_large_budget_matches_transformers(worker, prompt_token_ids, expected_token_ids):
    output = run(
        worker,
        prompt_token_ids,
        max_num_batched_tokens=2048,
        num_gpu_blocks_override=200,
        enable_prefix_caching=False,
    )
    assert output.stats.prefix_cache_hits == 0
    assert_same_tokens(output, expected_token_ids)


def test_chunked_prompts_with_prefix_hits_match_transformers(
    worker, prompt_token_ids, expected_token_ids
):
    assert max(len(ids) for ids in prompt_token_ids) > 32  # so a 32-token budget chunks prompts
    output = run(worker, prompt_token_ids, max_num_batched_tokens=32, num_gpu_blocks_override=200)
    assert output.stats.prefix_cache_hits >= 2 * 16  # the shared prefix is several full blocks
    assert_same_tokens(output, expected_token_ids)


def test_preemption_and_resume_match_transformers(worker, prompt_token_ids, expected_token_ids):
    min_blocks = MAX_MODEL_LEN // worker.block_size + 1
    output = run(
        worker, prompt_token_ids, max_num_batched_tokens=64, num_gpu_blocks_override=min_blocks + 4
    )
    assert output.stats.num_preemptions > 0
    assert_same_tokens(output, expected_token_ids)
