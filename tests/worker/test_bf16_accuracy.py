"""Accuracy gate for bfloat16 on CPU, the default dtype where the CPU has native bf16.

The default model runs a fixed prompt set in float32 and in bfloat16 through the same code
(oneDNN-packed linears where this CPU packs the dtype, the CPU attention backend):
- greedy output: the first 16 tokens are equal on at least 90% of the prompts;
- next-token logits of every prompt: bounded mean difference and KL divergence.

Why these logit tolerances: bf16 keeps 8 significant bits (unit roundoff 2^-9, about 0.2%).
A hidden state is rounded after each of about 7 ops in each of 30 layers, and independent
roundings add up like a random walk: sqrt(210) * 0.2% is about 3% of the logit scale. Measured
on SmolLM2-135M (float32 residual stream and LM head, fused C kernels, bf16 attention kernel):
a mean |difference| of 1.9-2.1% of the logits' standard deviation averaged over the prompts,
3.4-9.0% for the worst single prompt (a 4-token prompt: which prompt is worst, and by how much,
moves with any change of rounding order, even one that makes each op more exact), and a largest
KL divergence of 0.0024 nats; greedy output matched on 38 of 40 prompts. The gates are 3% for
the average, 12% for the worst prompt and 0.01 nats: loose enough for rounding, while a real
mistake in a bf16 path (a norm, RoPE or residual computed in the wrong precision or order)
moves logits of every prompt by a large fraction of their spread and the KL by far more.
"""

from __future__ import annotations

import pytest
import torch

from core_engine.common.model_files import default_model_path
from core_engine.frontend.text.tokenizer import load_tokenizer
from core_engine.proto import SamplingParams
from core_engine.proto.engine_config import EngineConfig
from core_engine.worker.model_executor.cpu_linear import pack_linears
from core_engine.worker.model_executor.model_loader import load_model
from tests.helpers.engine_helpers import generate_token_ids
from tests.helpers.model_fixtures import (
    build_paged_batch,
    make_kv_caches,
    num_blocks_needed,
    scattered_block_ids,
)

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
NUM_COMPARED_TOKENS = 16
MIN_MATCHING_SHARE = 0.9
MAX_MEAN_ABS_DIFF_PER_LOGIT_STD = 0.03  # averaged over the prompts
MAX_WORST_PROMPT_ABS_DIFF_PER_LOGIT_STD = 0.12
MAX_KL_NATS = 0.01
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "Water boils at",
    "The three primary colors are",
    "import numpy as np\n",
    "Q: What is 12 times 7?\nA:",
    "The quick brown fox",
    "In 1969, Neil Armstrong",
    "My favourite recipe for pancakes is",
    "The largest planet in the solar system",
    "Translate to French: good morning",
    "SELECT name FROM users WHERE",
    "Photosynthesis is the process",
    "<|im_start|>user\nWhat is the capital of Japan?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWrite a haiku about autumn.<|im_end|>\n<|im_start|>assistant\n",
    "The theory of relativity",
    "To be or not to be,",
    "A healthy breakfast includes",
    "The main difference between TCP and UDP is",
    "The best way to learn a new language is",
    "Here is a short poem about the sea:\n",
    "The function returns",
    "Dear Sir or Madam,\n",
    "The population of Tokyo is",
    "Machine learning is a field of",
    "class Stack:\n    def __init__(self):",
    "The French Revolution began in",
    "Step 1: Preheat the oven to",
    "The human heart has four",
    "<|im_start|>user\nGive me three tips for better sleep.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nExplain recursion to a child.<|im_end|>\n<|im_start|>assistant\n",
    "for i in range(10):",
    "The Great Wall of China",
    "Mount Everest is located",
    "A prime number is",
    "The stock market",
    "Coffee is made from",
    "The chemical symbol for gold is",
    "Shakespeare wrote",
)


@pytest.fixture(scope="module")
def prompt_token_ids() -> list[list[int]]:
    tokenizer = load_tokenizer(default_model_path())
    return [tokenizer.encode(prompt) for prompt in PROMPTS]


@pytest.fixture(scope="module", autouse=True)
def _two_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(min(previous, 2))
    yield
    torch.set_num_threads(previous)


def greedy_tokens(prompts: list[list[int]], dtype: str) -> list[list[int]]:
    config = EngineConfig(device="cpu", dtype=dtype, max_num_seqs=len(prompts))
    params = SamplingParams(temperature=0.0, max_tokens=NUM_COMPARED_TOKENS, ignore_eos=True)
    output = generate_token_ids(prompts, config, sampling_params=params)
    return [result.token_ids for result in output.results]


@torch.inference_mode()
def next_token_logits(prompts: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
    """float32 logits [num_prompts, vocab] after each prompt, one batched paged prefill."""
    model, config = load_model(default_model_path(), torch.device("cpu"), dtype)
    pack_linears(model)
    block_ids = scattered_block_ids([len(p) for p in prompts], BLOCK_SIZE)
    kv_caches = make_kv_caches(config, num_blocks_needed(block_ids), BLOCK_SIZE, dtype)
    batch = build_paged_batch(prompts, [0] * len(prompts), block_ids, BLOCK_SIZE)
    hidden_states = model(batch.input_ids, batch.positions, kv_caches, batch.metadata)
    last_rows = batch.metadata.query_start_loc[1:] - 1
    return model.compute_logits(hidden_states[last_rows])


def test_bf16_greedy_matches_fp32_on_most_prompts(prompt_token_ids):
    fp32 = greedy_tokens(prompt_token_ids, "float32")
    bf16 = greedy_tokens(prompt_token_ids, "bfloat16")
    assert all(len(tokens) == NUM_COMPARED_TOKENS for tokens in fp32 + bf16)
    matching = [a == b for a, b in zip(fp32, bf16, strict=True)]
    share = sum(matching) / len(matching)
    assert share >= MIN_MATCHING_SHARE, (
        f"bf16 greedy matched fp32 on {sum(matching)}/{len(matching)} prompts "
        f"(need {MIN_MATCHING_SHARE:.0%}); differing: "
        f"{[PROMPTS[i] for i, same in enumerate(matching) if not same]}"
    )


def test_bf16_logits_stay_within_rounding_of_fp32(prompt_token_ids):
    fp32 = next_token_logits(prompt_token_ids, torch.float32)
    bf16 = next_token_logits(prompt_token_ids, torch.bfloat16)
    assert fp32.dtype == bf16.dtype == torch.float32
    assert torch.isfinite(bf16).all()
    mean_abs_diff = (fp32 - bf16).abs().mean(dim=-1)
    logit_std = fp32.std(dim=-1)
    relative_diff = mean_abs_diff / logit_std
    average, worst = float(relative_diff.mean()), float(relative_diff.max())
    assert average <= MAX_MEAN_ABS_DIFF_PER_LOGIT_STD, f"mean |diff| / std = {average:.4f}"
    assert worst <= MAX_WORST_PROMPT_ABS_DIFF_PER_LOGIT_STD, f"worst prompt: {worst:.4f}"
    log_p, log_q = fp32.log_softmax(-1), bf16.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    assert float(kl.max()) <= MAX_KL_NATS, f"KL(fp32 || bf16) per prompt: {kl.tolist()}"
