"""Reusable model helpers for tests: reference HF folders, tiny random models, paged inputs.

- `converted_default_model_folder()`: the default SmolLM2 GGUF as a transformers-loadable HF
  folder (`tools.reference_model`, shared with the benchmarks).
- `build_tiny_model_folder(folder, variant)`: small random-weight HF folders, one per variant
  in TINY_VARIANTS, written with transformers' `save_pretrained` plus a byte-level tokenizer.
- `hf_greedy`: transformers' greedy tokens with its own KV cache, the parity reference.
- `make_kv_caches` / `build_paged_batch`: a KV cache and the `AttentionMetadata` of a varlen
  batch, with scattered (non-contiguous) block ids so paging is really exercised.

Nothing here downloads anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from core_engine.kernels import AttentionMetadata


@dataclass(frozen=True, slots=True)
class TinyVariant:
    """A small random-weight model of one architecture flavour."""

    name: str
    architecture: str
    config_kwargs: dict


_TINY_COMMON = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
TINY_VARIANTS = {
    variant.name: variant
    for variant in (
        TinyVariant("llama_untied", "LlamaForCausalLM", {"tie_word_embeddings": False}),
        TinyVariant(
            "llama3_rope",
            "LlamaForCausalLM",
            {
                "tie_word_embeddings": True,
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            },
        ),
        TinyVariant(
            "llama_mqa_bias",
            "LlamaForCausalLM",
            {"num_key_value_heads": 1, "attention_bias": True, "tie_word_embeddings": True},
        ),
        TinyVariant("qwen2_bias", "Qwen2ForCausalLM", {"tie_word_embeddings": False}),
        TinyVariant(
            "qwen3_qk_norm", "Qwen3ForCausalLM", {"head_dim": 24, "tie_word_embeddings": True}
        ),
        TinyVariant(
            "mistral_8_heads",
            "MistralForCausalLM",
            {"num_attention_heads": 8, "num_key_value_heads": 4, "sliding_window": None},
        ),
    )
}
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)


def build_tiny_model_folder(folder: Path, variant_name: str, seed: int = 0, **save_kwargs) -> Path:
    """Writes a random-weight HF folder for TINY_VARIANTS[variant_name]; returns `folder`.

    Every parameter (norm weights and biases included) is drawn at random so that a missing
    bias or a misplaced norm changes the logits. `save_kwargs` go to `save_pretrained`
    (e.g. max_shard_size="100KB" for a sharded checkpoint with an index file).
    """
    import transformers

    variant = TINY_VARIANTS[variant_name]
    model_class = getattr(transformers, variant.architecture)
    config = model_class.config_class(**{**_TINY_COMMON, **variant.config_kwargs})
    torch.manual_seed(seed)
    model = model_class(config).eval()
    randomize_parameters(model, seed)
    folder = Path(folder)
    model.save_pretrained(folder, **save_kwargs)
    write_byte_level_tokenizer(folder)
    return folder


def randomize_parameters(model: torch.nn.Module, seed: int) -> None:
    """Norm weights ~ 1 + N(0, 0.1), biases ~ N(0, 0.1), matrices ~ N(0, 0.1)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * 0.1
            param.copy_(1.0 + noise if "norm" in name else noise)


def write_byte_level_tokenizer(folder: Path) -> None:
    """tokenizer.json (byte-level BPE, no merges: one token per byte after 3 specials) and
    tokenizer_config.json with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for symbol in sorted(alphabet):
        vocab[symbol] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.save(str(folder / "tokenizer.json"))
    tokenizer_config = {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "chat_template": CHATML_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))


def make_kv_caches(
    config, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    """One zeroed cache per layer, [2, num_blocks, block_size, num_kv_heads, head_dim]."""
    shape = (2, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    return [torch.zeros(shape, dtype=dtype) for _ in range(config.num_hidden_layers)]


@dataclass(slots=True)
class PagedBatch:
    """Model inputs of one step: flattened tokens, their positions and the attention metadata."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata


def build_paged_batch(
    token_ids_per_request: list[list[int]],
    num_computed_per_request: list[int],
    block_ids_per_request: list[list[int]],
    block_size: int,
) -> PagedBatch:
    """Schedules, for each request r, its tokens [num_computed[r], len(token_ids[r])).

    The cache must already hold tokens [0, num_computed[r]) of request r in its blocks.
    """
    input_ids, positions, slots, query_start_loc = [], [], [], [0]
    for token_ids, num_computed, block_ids in zip(
        token_ids_per_request, num_computed_per_request, block_ids_per_request, strict=True
    ):
        for position in range(num_computed, len(token_ids)):
            input_ids.append(token_ids[position])
            positions.append(position)
            slots.append(block_ids[position // block_size] * block_size + position % block_size)
        query_start_loc.append(len(input_ids))
    max_blocks = max(len(block_ids) for block_ids in block_ids_per_request)
    block_table = torch.zeros(len(block_ids_per_request), max_blocks, dtype=torch.int32)
    for row, block_ids in enumerate(block_ids_per_request):
        block_table[row, : len(block_ids)] = torch.tensor(block_ids, dtype=torch.int32)
    seq_lens = [len(token_ids) for token_ids in token_ids_per_request]
    query_lens = [
        end - start for start, end in zip(query_start_loc[:-1], query_start_loc[1:], strict=True)
    ]
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_table=block_table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    return PagedBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        metadata=metadata,
    )


def scattered_block_ids(seq_lens: list[int], block_size: int) -> list[list[int]]:
    """Disjoint block lists, one per request, interleaved across requests and never block 0.

    Request r's i-th block is 1 + i * num_reqs + r, so consecutive blocks of one request are
    never adjacent in memory (when there are several requests).
    """
    num_reqs = len(seq_lens)
    return [
        [1 + i * num_reqs + r for i in range(-(-seq_len // block_size))]
        for r, seq_len in enumerate(seq_lens)
    ]


def num_blocks_needed(block_ids_per_request: list[list[int]]) -> int:
    """Cache size (in blocks) that holds every listed block id."""
    return 1 + max(max(block_ids) for block_ids in block_ids_per_request)


# HF module name -> llama.cpp tensor name, written out independently of worker.model_executor.gguf_loader.
_HF_TO_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_HF_TO_GGUF_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def write_gguf_from_transformers_model(
    model: torch.nn.Module, path: Path, arch: str, add_metadata=None
) -> Path:
    """Writes `model` (a transformers Llama/Qwen2/Qwen3) as an F32 GGUF the way llama.cpp's
    converter does, Q/K rows permuted for arch "llama"; `add_metadata(writer)`, if given, adds
    more (a tokenizer, say). Returns `path`."""
    import gguf
    import numpy as np

    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if add_metadata is not None:
        add_metadata(writer)
    if config.rope_parameters.get("rope_type") == "llama3":
        writer.add_tensor(
            "rope_freqs.weight", _llama_cpp_rope_freqs(config.rope_parameters, head_dim)
        )
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        weights = tensor.detach().float().numpy()
        if arch == "llama" and ".q_proj." in name:
            weights = _llama_cpp_permute(
                weights, config.num_attention_heads, config.num_attention_heads
            )
        elif arch == "llama" and ".k_proj." in name:
            weights = _llama_cpp_permute(
                weights, config.num_attention_heads, config.num_key_value_heads
            )
        writer.add_tensor(_gguf_tensor_name(name), np.ascontiguousarray(weights, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_tensor_name(hf_name: str) -> str:
    if hf_name in _HF_TO_GGUF_GLOBAL_NAMES:
        return _HF_TO_GGUF_GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_HF_TO_GGUF_LAYER_NAMES[module]}.{suffix}"


def _llama_cpp_permute(weights, num_heads: int, num_kv_heads: int):
    """llama.cpp convert_hf_to_gguf.py's `LlamaModel.permute`."""
    if num_kv_heads is not None and num_heads != num_kv_heads:
        num_heads = num_kv_heads
    return (
        weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _llama_cpp_rope_freqs(rope_parameters: dict, head_dim: int):
    """llama.cpp convert_hf_to_gguf.py's Llama 3 `rope_freqs` tensor: per-frequency divisors."""
    import math

    import numpy as np

    factor = rope_parameters["factor"]
    low_freq_factor = rope_parameters["low_freq_factor"]
    high_freq_factor = rope_parameters["high_freq_factor"]
    old_context_len = rope_parameters["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    freqs = 1.0 / (
        rope_parameters["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    )
    rope_factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            rope_factors.append(1)
        elif wavelen > low_freq_wavelen:
            rope_factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor
            )
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(rope_factors, dtype=np.float32)


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], num_new_tokens: int) -> list[int]:
    output = model(input_ids=torch.tensor([prompt]), use_cache=True)
    generated = []
    for _ in range(num_new_tokens):
        next_token = int(output.logits[0, -1].argmax())
        generated.append(next_token)
        output = model(
            input_ids=torch.tensor([[next_token]]),
            past_key_values=output.past_key_values,
            use_cache=True,
        )
    return generated
