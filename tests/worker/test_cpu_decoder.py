"""The decoder layers in one C call (`worker/model_executor/cpu_decoder.py`) give the Python
layers' hidden states and KV caches bit for bit, on the steps they take: decodes, and small
chunks beside decodes; longer prompts stay the Python layers'. On the default model's GGUF
blocks (`--quantization gguf`, every build), and on a tiny float32 model with biases on the
float32 kernel where the build has it (AVX2 without AVX-512); models with a part the driver
does not run (q/k norm) keep the Python layers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from core_engine.common.model_files import resolve_model_path
from core_engine.kernels.cpu import f32_matmul as cpu_f32_matmul
from core_engine.kernels.cpu import kernel_loader as cpu_kernel_loader
from core_engine.proto.engine_config import EngineConfig
from core_engine.worker.lora.lora_manager import LoRAManager
from core_engine.worker.model_executor.cpu_decoder import enable_cpu_decoder
from core_engine.worker.model_executor.cpu_linear import pack_linears
from core_engine.worker.model_executor.model_loader import load_model
from tests.helpers.model_fixtures import (
    build_paged_batch,
    build_tiny_model_folder,
    make_kv_caches,
)

pytestmark = pytest.mark.skipif(
    cpu_kernel_loader.load() is None, reason="no C compiler: the CPU kernels are not built"
)
BLOCK_SIZE = 16
NUM_BLOCKS = 24


def load_packed(path, quantization=None):
    model, config = load_model(path, torch.device("cpu"), torch.float32, quantization=quantization)
    pack_linears(model)
    return model, config


def prompts_of(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    lengths = (37, 5, 70)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def block_ids_of(prompts: list[list[int]], extra_tokens: int) -> list[list[int]]:
    """Each request's blocks, scattered (every other free block), room for extra tokens."""
    free = iter(range(1, NUM_BLOCKS, 2))
    ids = []
    for prompt in prompts:
        count = -(-(len(prompt) + extra_tokens) // BLOCK_SIZE)
        ids.append([next(free) for _ in range(count)])
    return ids


def run_step(model, tokens, computed, block_ids, caches, in_c: bool):
    """One step's hidden states, with or without the C decoder; and whether it ran in C."""
    decoder = model.model.cpu_decoder
    batch = build_paged_batch(tokens, computed, block_ids, BLOCK_SIZE)
    took = decoder is not None and decoder.takes(batch.input_ids, caches, batch.metadata)
    model.model.cpu_decoder = decoder if in_c else None
    try:
        with torch.no_grad():
            hidden = model(batch.input_ids, batch.positions, caches, batch.metadata)
    finally:
        model.model.cpu_decoder = decoder
    return hidden, took


def assert_steps_match(model, config, lora_step=None):
    """Prefill three prompts (Python layers: long queries), then a decode step, then a step
    of a 6-token chunk beside two decodes: both ways give the same bits. With `lora_step`,
    the three requests run adapter slots 0, none and 1."""
    prompts = prompts_of(config.vocab_size)
    block_ids = block_ids_of(prompts, extra_tokens=8)
    caches = make_kv_caches(config, NUM_BLOCKS, BLOCK_SIZE)
    hidden, took = run_step(model, prompts, [0, 0, 0], block_ids, caches, in_c=True)
    assert not took, "a 70-token prompt is the prefill path's"
    steps = [
        ([p + [7] for p in prompts], [len(p) for p in prompts]),  # decode
        ([prompts[0] + [7, 8, 9, 10, 11, 12, 13], prompts[1] + [7, 8], prompts[2] + [7, 8]],
         [len(prompts[0]) + 1, len(prompts[1]) + 1, len(prompts[2]) + 1]),  # a chunk + decodes
    ]  # fmt: skip
    for tokens, computed in steps:
        if lora_step is not None:
            num_new = [len(t) - c for t, c in zip(tokens, computed, strict=True)]
            lora_step.set_token_slots([0, -1, 1], np.array(num_new))
        caches_c = [cache.clone() for cache in caches]
        in_c, took = run_step(model, tokens, computed, block_ids, caches_c, in_c=True)
        in_python, _ = run_step(model, tokens, computed, block_ids, caches, in_c=False)
        assert took
        assert torch.equal(in_c, in_python)
        assert all(torch.equal(a, b) for a, b in zip(caches_c, caches, strict=True))


@pytest.fixture(autouse=True)
def _two_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


def test_the_default_models_gguf_blocks_decode_in_c_as_in_python():
    model, config = load_packed(resolve_model_path(None), quantization="gguf")
    assert enable_cpu_decoder(model)
    assert_steps_match(model, config)


@pytest.mark.parametrize("variant", ["llama_mqa_bias", "qwen2_bias"])
def test_a_float32_model_on_the_float32_kernel_decodes_in_c_as_in_python(tmp_path, variant):
    model, config = load_packed(build_tiny_model_folder(tmp_path, variant))
    # The float32 kernel is built on AVX2 without AVX-512; elsewhere oneDNN packs float32
    # linears, which the driver does not call.
    assert enable_cpu_decoder(model) == (cpu_f32_matmul.panel_columns() > 0)
    if model.model.cpu_decoder is not None:
        assert_steps_match(model, config)


def test_lora_adapters_decode_in_c_as_in_python():
    """Adapter slots beside the GGUF linears: the driver adds them per token (slots 0, none,
    1) with the shrink/expand kernel, as the Python layers do, and they change the output."""
    model, config = load_packed(resolve_model_path(None), quantization="gguf")
    lora_config = EngineConfig(enable_lora=True, max_loras=2, max_lora_rank=8)
    manager = LoRAManager(model, config, lora_config, torch.float32)
    generator = torch.Generator().manual_seed(0)
    for linears in manager.layers:
        for linear in linears:
            for weights in (linear.lora_a, linear.lora_b):
                weights.copy_(torch.randn(weights.shape, generator=generator) * 0.05)
    assert enable_cpu_decoder(model)
    assert_steps_match(model, config, manager.step)
    manager.clear_step()
    prompts = prompts_of(config.vocab_size)
    block_ids = block_ids_of(prompts, extra_tokens=8)
    caches = make_kv_caches(config, NUM_BLOCKS, BLOCK_SIZE)
    run_step(model, prompts, [0, 0, 0], block_ids, caches, in_c=False)
    decode = ([p + [7] for p in prompts], [len(p) for p in prompts])
    manager.step.set_token_slots([0, -1, 1], np.ones(3, dtype=np.int64))
    with_adapters, _ = run_step(model, *decode, block_ids, [c.clone() for c in caches], True)
    manager.clear_step()
    without, _ = run_step(model, *decode, block_ids, [c.clone() for c in caches], True)
    assert torch.equal(with_adapters[1], without[1])  # the request without an adapter
    assert not torch.equal(with_adapters[0], without[0])
    assert not torch.equal(with_adapters[2], without[2])


def test_a_model_with_qk_norm_keeps_the_python_layers(tmp_path):
    model, _ = load_packed(build_tiny_model_folder(tmp_path, "qwen3_qk_norm"))
    assert not enable_cpu_decoder(model)
    assert model.model.cpu_decoder is None


def test_without_the_kernels_nothing_is_enabled(monkeypatch):
    model, _ = load_packed(resolve_model_path(None), quantization="gguf")
    monkeypatch.setattr(cpu_kernel_loader, "load", lambda: None)
    assert not enable_cpu_decoder(model)


def decode_batch_and_caches(config, model):
    """A decode step of the three prompts over caches their prefill (Python layers) filled."""
    prompts = prompts_of(config.vocab_size)
    block_ids = block_ids_of(prompts, extra_tokens=8)
    caches = make_kv_caches(config, NUM_BLOCKS, BLOCK_SIZE)
    run_step(model, prompts, [0, 0, 0], block_ids, caches, in_c=False)
    batch = build_paged_batch([p + [7] for p in prompts], [len(p) for p in prompts], block_ids,
                              BLOCK_SIZE)  # fmt: skip
    return batch, caches


def test_a_token_id_outside_the_vocabulary_is_an_index_error_that_writes_nothing():
    model, config = load_packed(resolve_model_path(None), quantization="gguf")
    assert enable_cpu_decoder(model)
    batch, caches = decode_batch_and_caches(config, model)
    before = [cache.clone() for cache in caches]
    for bad_id in (config.vocab_size, -1):
        input_ids = batch.input_ids.clone()
        input_ids[1] = bad_id
        message = rf"token id {bad_id} is outside the vocabulary \[0, {config.vocab_size}\)"
        with pytest.raises(IndexError, match=message):
            model.model.cpu_decoder.run(input_ids, batch.positions, caches, batch.metadata)
    assert all(torch.equal(a, b) for a, b in zip(caches, before, strict=True))
    hidden = model.model.cpu_decoder.run(batch.input_ids, batch.positions, caches, batch.metadata)
    assert hidden.shape == (3, config.hidden_size) and torch.isfinite(hidden).all()


def test_a_position_past_the_angle_table_is_a_value_error():
    """The driver reads each token's rotary angles from the table `run` sizes to the step's
    max_seq_len; a position the metadata does not account for is refused, not read."""
    model, config = load_packed(resolve_model_path(None), quantization="gguf")
    assert enable_cpu_decoder(model)
    batch, caches = decode_batch_and_caches(config, model)
    rows = model.model.rotary_emb.angle_table(batch.metadata.max_seq_len)[0].shape[0]
    positions = batch.positions.clone()
    positions[0] = rows
    with pytest.raises(ValueError, match=rf"position {rows} is outside the rotary angle table"):
        model.model.cpu_decoder.run(batch.input_ids, positions, caches, batch.metadata)


def test_steps_of_growing_and_shrinking_batches_reuse_the_scratch_and_match_python():
    """The driver keeps its scratch rows across steps (regrown for a larger step): a step
    of one request after a step of three, then three again, still gives the Python bits."""
    model, config = load_packed(resolve_model_path(None), quantization="gguf")
    assert enable_cpu_decoder(model)
    prompts = prompts_of(config.vocab_size)
    block_ids = block_ids_of(prompts, extra_tokens=8)
    caches = make_kv_caches(config, NUM_BLOCKS, BLOCK_SIZE)
    run_step(model, prompts, [0, 0, 0], block_ids, caches, in_c=False)
    steps = [
        ([prompts[0] + [7]], [len(prompts[0])], block_ids[:1]),
        ([p + [7] for p in prompts], [len(p) for p in prompts], block_ids),
        ([prompts[2] + [7]], [len(prompts[2])], block_ids[2:]),
    ]
    for tokens, computed, blocks in steps:
        caches_c = [cache.clone() for cache in caches]
        in_c, took = run_step(model, tokens, computed, blocks, caches_c, in_c=True)
        in_python, _ = run_step(model, tokens, computed, blocks, caches, in_c=False)
        assert took and torch.equal(in_c, in_python)


def test_caches_replaced_at_the_same_addresses_with_another_shape_are_bound_again():
    """The driver keeps the caches' binding while they stay; caches of another shape at the
    same addresses (as an allocator may hand back) must not keep the old block shape."""
    model, config = load_packed(resolve_model_path(None), quantization="gguf")
    assert enable_cpu_decoder(model)
    batch, caches = decode_batch_and_caches(config, model)
    decoder = model.model.cpu_decoder
    assert decoder.takes(batch.input_ids, caches, batch.metadata)
    assert decoder._step.attention.block_size == BLOCK_SIZE
    two, blocks, block_size, heads, head_dim = caches[0].shape
    reshaped = [c.view(two, blocks // 2, 2 * block_size, heads, head_dim) for c in caches]
    assert reshaped[0].data_ptr() == caches[0].data_ptr()
    decoder.takes(batch.input_ids, reshaped, batch.metadata)
    assert decoder._step.attention.block_size == 2 * BLOCK_SIZE
    assert decoder._step.attention.num_cache_blocks == blocks // 2
