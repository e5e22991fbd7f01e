"""Logits parity with transformers on CPU in float32, through the paged-attention path.

The default SmolLM2 GGUF is loaded by our GGUF loader and compared with transformers'
LlamaForCausalLM on transformers' own conversion of the same file; the tiny random-weight
variants (untied Llama, Llama 3 RoPE scaling, Qwen2 bias, Qwen3 q/k norm, 8 heads / 4 KV heads)
are loaded from safetensors folders. Several prompts run as one varlen batch with scattered
KV blocks; chunked prefill and a decode step must give the same logits as one full pass.
"""

from __future__ import annotations

import pytest
import torch

from core_engine.common.model_files import default_model_path
from core_engine.worker.model_executor.model_loader import load_model
from tests.helpers.model_fixtures import (
    TINY_VARIANTS,
    build_paged_batch,
    build_tiny_model_folder,
    make_kv_caches,
    num_blocks_needed,
    scattered_block_ids,
    write_gguf_from_transformers_model,
)
from tools.reference_model import converted_default_model_folder

MAX_ABS_DIFF = 1e-3
GGUF_ARCH_TO_ARCHITECTURE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
BLOCK_SIZE = 16
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "<|im_start|>user\nWrite a haiku about paged attention, caches and GPUs.<|im_end|>\n"
    "<|im_start|>assistant\n",
)


@pytest.fixture(scope="module", autouse=True)
def _limit_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(min(previous, 2))
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def reference_folder():
    return converted_default_model_folder()


@pytest.fixture(scope="module")
def reference_model(reference_folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(reference_folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_token_ids(reference_folder) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(reference_folder)
    return [tokenizer.encode(prompt) for prompt in PROMPTS]


@pytest.fixture(scope="module")
def gguf_model():
    return load_model(default_model_path(), torch.device("cpu"), torch.float32)


def reference_logits_of(reference_model):
    """token ids -> transformers' logits [len, vocab] for that one sequence, memoized."""
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    @torch.inference_mode()
    def logits(token_ids: list[int]) -> torch.Tensor:
        key = tuple(token_ids)
        if key not in cache:
            cache[key] = reference_model(torch.tensor([token_ids])).logits[0].float()
        return cache[key]

    return logits


@pytest.fixture(scope="module")
def default_reference(reference_model):
    return reference_logits_of(reference_model)


@torch.inference_mode()
def run_step(
    model, kv_caches, token_ids_per_request, num_computed_per_request, block_ids_per_request
):
    """One paged forward; returns the logits of every scheduled token, split per request."""
    batch = build_paged_batch(
        token_ids_per_request, num_computed_per_request, block_ids_per_request, BLOCK_SIZE
    )
    hidden_states = model(batch.input_ids, batch.positions, kv_caches, batch.metadata)
    logits = model.compute_logits(hidden_states)
    assert logits.dtype == torch.float32
    bounds = batch.metadata.query_start_loc.tolist()
    return [logits[start:end] for start, end in zip(bounds[:-1], bounds[1:], strict=True)]


def assert_batched_prefill_matches(model, config, reference, prompts: list[list[int]]):
    block_ids = scattered_block_ids([len(p) for p in prompts], BLOCK_SIZE)
    kv_caches = make_kv_caches(config, num_blocks_needed(block_ids), BLOCK_SIZE)
    ours = run_step(model, kv_caches, prompts, [0] * len(prompts), block_ids)
    for prompt, logits in zip(prompts, ours, strict=True):
        expected = reference(prompt)
        assert logits.shape == expected.shape
        torch.testing.assert_close(logits, expected, atol=MAX_ABS_DIFF, rtol=0)


def assert_chunked_prefill_and_decode_match(model, config, reference, prompts: list[list[int]]):
    """Step 1: first half of prompt A + all of prompt B. Step 2: rest of A + one decode of B."""
    prompt_a, prompt_b = prompts[0], prompts[1]
    split = len(prompt_a) // 2 + 1
    next_b = int(reference(prompt_b)[-1].argmax())
    sequence_b = [*prompt_b, next_b]
    block_ids = scattered_block_ids([len(prompt_a), len(sequence_b)], BLOCK_SIZE)
    kv_caches = make_kv_caches(config, num_blocks_needed(block_ids), BLOCK_SIZE)
    run_step(model, kv_caches, [prompt_a[:split], prompt_b], [0, 0], block_ids)
    logits_a, logits_b = run_step(
        model, kv_caches, [prompt_a, sequence_b], [split, len(prompt_b)], block_ids
    )
    expected_a = reference(prompt_a)
    expected_b = reference(sequence_b)
    assert logits_a.shape[0] == len(prompt_a) - split
    torch.testing.assert_close(logits_a, expected_a[split:], atol=MAX_ABS_DIFF, rtol=0)
    assert logits_b.shape[0] == 1
    torch.testing.assert_close(logits_b, expected_b[-1:], atol=MAX_ABS_DIFF, rtol=0)


def test_default_gguf_batched_prefill_matches_transformers(
    gguf_model, default_reference, prompt_token_ids
):
    model, config = gguf_model
    assert config.architecture == "LlamaForCausalLM"
    assert config.tie_word_embeddings
    assert_batched_prefill_matches(model, config, default_reference, prompt_token_ids)


def test_default_gguf_chunked_prefill_and_decode_match_transformers(
    gguf_model, default_reference, prompt_token_ids
):
    model, config = gguf_model
    assert_chunked_prefill_and_decode_match(model, config, default_reference, prompt_token_ids)


def test_default_model_from_converted_folder_matches_gguf_load(gguf_model, reference_folder):
    """Our safetensors path on transformers' conversion gives our GGUF path's config and weights."""
    gguf_params = dict(gguf_model[0].named_parameters())
    folder_model, folder_config = load_model(reference_folder, torch.device("cpu"), torch.float32)
    assert folder_config == gguf_model[1]
    for name, param in folder_model.named_parameters():
        torch.testing.assert_close(param, gguf_params[name], atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("variant_name", sorted(TINY_VARIANTS))
def test_tiny_variant_matches_transformers(variant_name, tmp_path):
    from transformers import AutoModelForCausalLM

    folder = build_tiny_model_folder(tmp_path / variant_name, variant_name)
    reference_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model, config = load_model(folder, torch.device("cpu"), torch.float32)
    assert config.architecture == TINY_VARIANTS[variant_name].architecture
    generator = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(3, config.vocab_size, (length,), generator=generator).tolist()
        for length in (5, 19, 40)
    ]
    assert_batched_prefill_matches(model, config, reference_logits_of(reference_model), prompts)
    assert_chunked_prefill_and_decode_match(
        model, config, reference_logits_of(reference_model), prompts
    )


@pytest.mark.parametrize(
    ("variant_name", "arch"),
    [
        ("llama_untied", "llama"),
        ("llama3_rope", "llama"),
        ("mistral_8_heads", "llama"),
        ("qwen2_bias", "qwen2"),
        ("qwen3_qk_norm", "qwen3"),
    ],
)
def test_tiny_variant_from_gguf_matches_transformers(variant_name, arch, tmp_path):
    """A GGUF written like llama.cpp's converter (Q/K permuted for llama) loads exactly."""
    from transformers import AutoModelForCausalLM

    folder = build_tiny_model_folder(tmp_path / variant_name, variant_name)
    reference_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    gguf_path = write_gguf_from_transformers_model(reference_model, tmp_path / "model.gguf", arch)
    model, config = load_model(gguf_path, torch.device("cpu"), torch.float32)
    assert config.architecture == GGUF_ARCH_TO_ARCHITECTURE[arch]
    assert config.tie_word_embeddings == reference_model.config.tie_word_embeddings
    generator = torch.Generator().manual_seed(2)
    prompts = [
        torch.randint(3, config.vocab_size, (n,), generator=generator).tolist() for n in (7, 30)
    ]
    assert_batched_prefill_matches(model, config, reference_logits_of(reference_model), prompts)
