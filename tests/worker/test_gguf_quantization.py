"""`--quantization gguf` on the default model (its GGUF file's Q4_1 linears and Q8_0 embedding,
tied to the LM head): the dequantized float32 path's greedy tokens on the parity prompts,
prompts chunked and decoded together, up to where x's rounding to 8 bits flips a close choice;
the weights resident at the file's size; and the settings it refuses, each named."""

from __future__ import annotations

import argparse

import pytest
import torch

from core_engine.common.config_error import ConfigError
from core_engine.common.model_files import resolve_model_path
from core_engine.frontend.text.tokenizer import load_tokenizer
from core_engine.kernels.cpu import kernel_loader as cpu_kernel_loader
from core_engine.kernels.cpu.gguf_matmul import GgufMatmulWeight
from core_engine.proto import SamplingParams
from core_engine.proto.engine_config import EngineConfig
from core_engine.worker import worker as worker_module
from core_engine.worker.model_executor.cpu_linear import model_weight_bytes, pack_linears
from core_engine.worker.model_executor.layers import ParallelLMHead, VocabParallelEmbedding
from core_engine.worker.model_executor.model_loader import _check_quantization, load_model
from core_engine.worker.worker import resolve_dtype
from tests.helpers.engine_helpers import generate_token_ids
from tests.worker.test_generation_parity import PROMPTS

pytestmark = pytest.mark.skipif(
    cpu_kernel_loader.load() is None, reason="no C compiler: the CPU kernels are not built"
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=8)
# How far a logprob may move between the two paths, in nats. Calls of more than 8 rows (every
# prompt here) round x to 8 bits per 32-value block (gguf_bytes.h: llama.cpp's Q8_1
# activations), which moves this 135M model's logprobs by up to 0.35 nats on these prompts:
# twice that is the bound.
LOGPROB_NOISE = 0.7
# A step budget that chunks the longer prompts and mixes their prefill with others' decodes.
POOL = dict(device="cpu", dtype="float32", max_model_len=256, num_gpu_blocks_override=160)


@pytest.fixture(scope="module")
def prompt_token_ids() -> list[list[int]]:
    tokenizer = load_tokenizer(resolve_model_path(None))
    return [tokenizer.encode(prompt, add_special_tokens=False) for prompt in PROMPTS]


def first_difference(got: list[int], want: list[int]) -> int | None:
    return next((t for t, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)


def assert_follows_until_a_close_choice(got, want, prompt: str) -> None:
    """`got` (the GGUF blocks) has `want`'s (the dequantized path's) tokens, each logprob
    within LOGPROB_NOISE, up to a step where both runs rank the two tokens each chose within
    each other's top 8, and the two gaps (want's pick over got's in want, and the reverse in
    got) add up to at most 2 * LOGPROB_NOISE: a choice the rounding can flip. From there the
    continuations differ."""
    t = first_difference(got.token_ids, want.token_ids)
    shared = len(got.token_ids) if t is None else t
    for step in range(shared):
        moved = abs(got.logprobs[step].sampled_logprob - want.logprobs[step].sampled_logprob)
        assert moved <= LOGPROB_NOISE, f"{prompt}: token {step}'s logprob moved {moved:.3f} nats"
    if t is None:
        return
    mine, theirs = got.token_ids[t], want.token_ids[t]
    ranked_got = dict(zip(got.logprobs[t].top_token_ids, got.logprobs[t].top_logprobs, strict=True))
    ranked_want = dict(
        zip(want.logprobs[t].top_token_ids, want.logprobs[t].top_logprobs, strict=True)
    )
    assert theirs in ranked_got and mine in ranked_want, f"{prompt}: token {t} not a close choice"
    gaps = (ranked_want[theirs] - ranked_want[mine]) + (ranked_got[mine] - ranked_got[theirs])
    assert gaps <= 2 * LOGPROB_NOISE, f"{prompt}: token {t} flipped over gaps of {gaps:.3f} nats"


def test_the_gguf_blocks_follow_the_dequantized_paths_greedy_tokens(prompt_token_ids):
    """Both compute with the same weight values (a block dequantizes to exactly what the
    loader's dequantization gives); prompts round x to 8 bits, decode steps of up to 8
    requests to 16 bits (within float32 summation noise). Most prompts keep every token."""
    dequantized = generate_token_ids(prompt_token_ids, EngineConfig(**POOL), sampling_params=GREEDY)
    for budget in (None, 48):  # prompts in one step each; chunked, mixed with decodes
        config = EngineConfig(**POOL, quantization="gguf", max_num_batched_tokens=budget)
        quantized = generate_token_ids(prompt_token_ids, config, sampling_params=GREEDY)
        kept = 0
        for i, (got, want) in enumerate(zip(quantized.results, dequantized.results, strict=True)):
            assert_follows_until_a_close_choice(got, want, f"prompt {i} ({PROMPTS[i][:40]!r})")
            kept += first_difference(got.token_ids, want.token_ids) is None
        assert kept >= len(PROMPTS) // 3, f"{kept} of {len(PROMPTS)} prompts kept every token"


def test_the_weights_stay_at_the_files_size_and_the_lm_head_shares_the_embedding():
    path = resolve_model_path(None)
    model, _ = load_model(path, torch.device("cpu"), torch.float32, quantization="gguf")
    pack_linears(model)
    embedding = next(m for m in model.modules() if type(m) is VocabParallelEmbedding)
    lm_head = next(m for m in model.modules() if isinstance(m, ParallelLMHead))
    assert isinstance(embedding.gguf_weight, GgufMatmulWeight)
    assert embedding.gguf_weight.describe() == "Q8_0"
    assert lm_head.kernel_weight.segments[0].blocks is embedding.gguf_weight.segments[0].blocks
    file_bytes = path.stat().st_size
    assert model_weight_bytes(model) <= 1.1 * file_bytes
    dense, _ = load_model(path, torch.device("cpu"), torch.float32)
    assert model_weight_bytes(dense) > 4 * file_bytes  # float32: eight times four bits a weight


def test_settings_it_cannot_run_with_are_refused_naming_them(tmp_path):
    with pytest.raises(ValueError, match="quantization must be None or one of \\('gguf',\\)"):
        EngineConfig(quantization="awq")
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_arguments(parser)
    assert (
        EngineConfig.from_cli_args(parser.parse_args(["--quantization", "gguf"])).quantization
        == "gguf"
    )
    folder = tmp_path / "hf-model"
    folder.mkdir()
    with pytest.raises(ConfigError, match="is not a GGUF file: drop --quantization"):
        _check_quantization("gguf", folder, torch.device("cpu"))
    gguf_path = resolve_model_path(None)
    with pytest.raises(ConfigError, match="runs on the CPU's kernels only, not on cuda"):
        _check_quantization("gguf", gguf_path, torch.device("cuda"))
    _check_quantization("gguf", gguf_path, torch.device("cpu"))
    _check_quantization(None, folder, torch.device("cuda"))


def test_the_gguf_kernels_default_dtype_is_float32_on_every_cpu(monkeypatch):
    """Their inputs and outputs are float32 whatever the CPU; a dtype given is kept."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(worker_module, "default_cpu_dtype", lambda: torch.bfloat16)
    assert resolve_dtype(None, cpu) == torch.bfloat16  # a CPU with native bf16
    assert resolve_dtype(None, cpu, "gguf") == torch.float32
    assert resolve_dtype("bfloat16", cpu, "gguf") == torch.bfloat16
