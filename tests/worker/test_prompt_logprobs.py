"""Prompt logprobs: every prompt token's logprob given the tokens before it, equal to
transformers' on the same weights, whatever the chunking, and computed again after a
preemption rather than taken from the prefix cache."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from core_engine.proto import SamplingParams
from core_engine.proto.engine_config import EngineConfig
from tests.helpers.engine_helpers import generate_token_ids
from tests.helpers.model_fixtures import build_tiny_model_folder

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [30, 31, 32], [40, 41]]


def tiny_config(folder, **overrides) -> EngineConfig:
    """The tiny model in float32 on the CPU (block size 16, 64-token context)."""
    return EngineConfig(
        model=str(folder), device="cpu", dtype="float32", max_model_len=64, **overrides
    )


def reference(model, prompt: list[int], num_top: int) -> list[tuple[float, int, list[int]]]:
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0].float(), -1)
    out = []
    for position, token in enumerate(prompt[1:]):
        row = logprobs[position]
        rank = int((row > row[token]).sum()) + 1
        out.append((float(row[token]), rank, row.topk(num_top).indices.tolist()))
    return out


@pytest.mark.parametrize("budget", [64, 8], ids=["whole", "chunked"])
def test_prompt_logprobs_equal_transformers(tmp_path, budget):
    folder = build_tiny_model_folder(tmp_path / "tiny", "llama_untied")
    config = tiny_config(folder, max_num_batched_tokens=budget)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=3)
    output = generate_token_ids(PROMPTS, config, sampling_params=params)
    hf_model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    for prompt, result in zip(PROMPTS, output.results, strict=True):
        expected = reference(hf_model, prompt, 3)
        assert len(result.prompt_logprobs) == len(prompt) - 1
        for got, (logprob, rank, top_ids) in zip(result.prompt_logprobs, expected, strict=True):
            assert got.sampled_logprob == pytest.approx(logprob, abs=1e-4)
            assert got.sampled_rank == rank
            assert got.top_token_ids == top_ids


def test_requests_without_prompt_logprobs_get_none(tmp_path):
    folder = build_tiny_model_folder(tmp_path / "tiny", "llama_untied")
    config = tiny_config(folder)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    output = generate_token_ids(PROMPTS[:1], config, sampling_params=params)
    assert output.results[0].prompt_logprobs is None


def test_prompt_logprobs_survive_preemption_and_skip_the_prefix_cache(tmp_path):
    folder = build_tiny_model_folder(tmp_path / "tiny", "llama_untied")
    config = tiny_config(folder, max_num_batched_tokens=16, num_gpu_blocks_override=6)
    prompts = [PROMPTS[0] * 2, PROMPTS[0] * 2, [50, 51, 52] * 6]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, prompt_logprobs=0)
    output = generate_token_ids(prompts, config, sampling_params=params)
    assert output.stats.num_preemptions > 0
    assert output.stats.prefix_cache_hits == 0  # the second prompt repeats the first
    hf_model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    for prompt, result in zip(prompts, output.results, strict=True):
        expected = [logprob for logprob, _, _ in reference(hf_model, prompt, 1)]
        got = [entry.sampled_logprob for entry in result.prompt_logprobs]
        assert got == pytest.approx(expected, abs=1e-4)
