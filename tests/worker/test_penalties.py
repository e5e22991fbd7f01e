"""Penalties and logit bias end to end: the engine's greedy tokens equal transformers' greedy
decoding with the same rules applied by hand to its logits."""

from __future__ import annotations

import msgspec
import pytest
import torch
from transformers import AutoModelForCausalLM

from core_engine.proto import SamplingParams
from core_engine.proto.engine_config import EngineConfig
from tests.helpers.engine_helpers import generate_token_ids
from tests.helpers.model_fixtures import build_tiny_model_folder

NUM_NEW_TOKENS = 12


def penalized(logits: torch.Tensor, prompt: list[int], output: list[int], params) -> torch.Tensor:
    """OpenAI's and vLLM's definitions, token by token, then the logit bias."""
    logits = logits.clone()
    for token, bias in params.logit_bias.items():
        logits[token] += bias
    for token in set(prompt) | set(output):
        value = float(logits[token])
        rp = params.repetition_penalty
        logits[token] = value / rp if value > 0 else value * rp
    for token in set(output):
        logits[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    return logits


def reference_greedy(model, prompt: list[int], params: SamplingParams) -> list[int]:
    output: list[int] = []
    for _ in range(NUM_NEW_TOKENS):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + output])).logits[0, -1]
        output.append(int(penalized(logits, prompt, output, params).argmax()))
    return output


@pytest.mark.parametrize(
    "penalties",
    [
        {"repetition_penalty": 1.5},
        {"frequency_penalty": 1.5, "presence_penalty": 0.5},
        {"presence_penalty": -1.0, "logit_bias": {7: 3.0, 11: -50.0}},
    ],
    ids=["repetition", "frequency+presence", "negative-presence+bias"],
)
def test_greedy_with_penalties_equals_transformers_with_the_same_rules(tmp_path, penalties):
    folder = build_tiny_model_folder(tmp_path / "tiny", "llama_untied")
    prompts = [[5, 6, 7, 5, 6, 7, 5], [20, 21], [30] * 9]
    params = SamplingParams(
        temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, **penalties
    )
    plain = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    config = EngineConfig(model=str(folder), device="cpu", dtype="float32", max_model_len=64)
    output = generate_token_ids(prompts, config, sampling_params=params)
    hf_model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    expected = [reference_greedy(hf_model, prompt, params) for prompt in prompts]
    assert [r.token_ids for r in output.results] == expected
    unpenalized = reference_greedy(hf_model, prompts[0], plain)
    assert expected[0] != unpenalized  # the rules changed something on this prompt


def test_bad_words_never_appear_and_change_nothing_before_them(tmp_path):
    folder = build_tiny_model_folder(tmp_path / "tiny", "llama_untied")
    config = EngineConfig(model=str(folder), device="cpu", dtype="float32", max_model_len=64)
    prompt = [5, 6, 7, 5, 6, 7, 5]
    free = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    (plain,) = generate_token_ids([prompt], config, sampling_params=free).results
    pair = plain.token_ids[2:4]  # a two-token word the model does write
    banned = msgspec.structs.replace(free, bad_words_token_ids=[pair, [plain.token_ids[6]]])
    (result,) = generate_token_ids([prompt], config, sampling_params=banned).results
    tokens = result.token_ids
    assert tokens[:3] == plain.token_ids[:3]  # up to the first word's first token, unchanged
    assert plain.token_ids[6] not in tokens
    assert all(tokens[i : i + 2] != pair for i in range(len(tokens) - 1))
