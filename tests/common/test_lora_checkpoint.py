"""`load_lora_checkpoint` and `check_lora_checkpoint`: PEFT's own checkpoints (f32 and bf16, with
and without rsLoRA) read back exactly with PEFT's scaling, and every adapter the engine cannot
serve refused with a message naming the file, the key or tensor, the value and the limit."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from core_engine.common import lora_checkpoint
from core_engine.common.lora_checkpoint import (
    LORA_TARGET_MODULES,
    LoRACheckpointError,
    check_lora_checkpoint,
    load_lora_checkpoint,
)
from core_engine.proto.lora_request import LoRATargetShapes

# A tiny Llama: hidden 64, 4 heads and 2 KV heads of 16, intermediate 128, 2 layers.
HIDDEN, INTERMEDIATE, NUM_HEADS, NUM_KV_HEADS, NUM_LAYERS, VOCAB = 64, 128, 4, 2, 2, 128
KV_WIDTH = NUM_KV_HEADS * HIDDEN // NUM_HEADS
SHAPES = LoRATargetShapes(
    num_layers=NUM_LAYERS,
    modules={
        "q_proj": (HIDDEN, HIDDEN),
        "k_proj": (HIDDEN, KV_WIDTH),
        "v_proj": (HIDDEN, KV_WIDTH),
        "o_proj": (HIDDEN, HIDDEN),
        "gate_proj": (HIDDEN, INTERMEDIATE),
        "up_proj": (HIDDEN, INTERMEDIATE),
        "down_proj": (INTERMEDIATE, HIDDEN),
    },
)
RANK, MAX_RANK = 4, 16
PREFIX = "base_model.model.model.layers"


def tensor_name(layer: int, module: str, half: str) -> str:
    block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"{PREFIX}.{layer}.{block}.{module}.lora_{half}.weight"


def lora_tensors(
    layers=range(NUM_LAYERS), modules=LORA_TARGET_MODULES, rank=RANK, dtype=np.float32
) -> dict[str, np.ndarray]:
    """PEFT-named random A [rank, in] and B [out, rank] for each layer and module."""
    rng = np.random.default_rng(0)
    tensors = {}
    for layer in layers:
        for module in modules:
            in_features, out_features = SHAPES.modules[module]
            a = rng.standard_normal((rank, in_features)).astype(dtype)
            b = rng.standard_normal((out_features, rank)).astype(dtype)
            tensors[tensor_name(layer, module, "A")] = a
            tensors[tensor_name(layer, module, "B")] = b
    return tensors


def write_adapter(folder, tensors=None, **config):
    """An adapter folder: PEFT's usual config (r=RANK, lora_alpha 8) with `config` on top, and
    `tensors` (every module of every layer by default) as adapter_model.safetensors."""
    folder.mkdir(exist_ok=True)
    full_config = {"peft_type": "LORA", "r": RANK, "lora_alpha": 8, "bias": "none", **config}
    (folder / "adapter_config.json").write_text(json.dumps(full_config))
    save_file(
        lora_tensors() if tensors is None else tensors, str(folder / "adapter_model.safetensors")
    )
    return folder


def refused(path, *fragments, max_rank=MAX_RANK) -> None:
    """Both entry points refuse the adapter with a message holding every fragment."""
    for read in (check_lora_checkpoint, load_lora_checkpoint):
        with pytest.raises(LoRACheckpointError) as error:
            read(path, SHAPES, max_rank)
        for fragment in fragments:
            assert fragment in str(error.value), (fragment, str(error.value))


# ---- PEFT's own checkpoints -------------------------------------------------------------------


def save_peft_adapter(folder, use_rslora=False, bf16=False):
    """A tiny Llama with a PEFT LoRA on every target module, B made non-zero, saved to `folder`;
    returns the PEFT model."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        num_hidden_layers=NUM_LAYERS,
        vocab_size=VOCAB,
    )
    lora_config = peft.LoraConfig(
        r=RANK, lora_alpha=12, use_rslora=use_rslora, target_modules=list(LORA_TARGET_MODULES)
    )
    model = peft.get_peft_model(transformers.LlamaForCausalLM(config), lora_config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_()
    if bf16:
        model = model.to(torch.bfloat16)
    model.save_pretrained(str(folder))
    return model


def peft_layer(model, layer: int, module: str):
    """The PEFT LoRA layer wrapping `module` of decoder layer `layer`."""
    decoder_layer = model.base_model.model.model.layers[layer]
    block = (
        decoder_layer.mlp
        if module in ("gate_proj", "up_proj", "down_proj")
        else decoder_layer.self_attn
    )
    return getattr(block, module)


def assert_matches_peft(checkpoint, model) -> None:
    assert checkpoint.config.rank == RANK
    assert checkpoint.config.target_modules == LORA_TARGET_MODULES
    expected_keys = [(layer, m) for layer in range(NUM_LAYERS) for m in LORA_TARGET_MODULES]
    assert list(checkpoint.weights) == expected_keys
    for (layer, module), (a, b) in checkpoint.weights.items():
        lora_layer = peft_layer(model, layer, module)
        assert a.dtype == np.float32 and b.dtype == np.float32
        expected_a = lora_layer.lora_A["default"].weight.detach().float().numpy()
        expected_b = lora_layer.lora_B["default"].weight.detach().float().numpy()
        np.testing.assert_array_equal(a, expected_a)
        np.testing.assert_array_equal(b, expected_b)
        assert checkpoint.config.scaling == pytest.approx(lora_layer.scaling["default"], rel=1e-12)


@pytest.mark.parametrize("use_rslora", [False, True])
def test_a_peft_checkpoint_reads_back_its_weights_and_scaling(tmp_path, use_rslora):
    model = save_peft_adapter(tmp_path, use_rslora=use_rslora)
    checkpoint = load_lora_checkpoint(tmp_path, SHAPES, MAX_RANK)
    assert checkpoint.path == tmp_path
    assert checkpoint.config.use_rslora is use_rslora
    assert_matches_peft(checkpoint, model)


def test_a_bf16_peft_checkpoint_widens_to_float32_exactly(tmp_path):
    model = save_peft_adapter(tmp_path, bf16=True)
    header_length = int.from_bytes(
        (tmp_path / "adapter_model.safetensors").read_bytes()[:8], "little"
    )
    header = json.loads(
        (tmp_path / "adapter_model.safetensors").read_bytes()[8 : 8 + header_length]
    )
    assert {info["dtype"] for name, info in header.items() if name != "__metadata__"} == {"BF16"}
    assert_matches_peft(load_lora_checkpoint(tmp_path, SHAPES, MAX_RANK), model)


# ---- hand-written checkpoints -----------------------------------------------------------------


def test_f16_tensors_read_as_float32(tmp_path):
    tensors = lora_tensors(dtype=np.float16)
    checkpoint = load_lora_checkpoint(write_adapter(tmp_path, tensors), SHAPES, MAX_RANK)
    a, b = checkpoint.weights[1, "k_proj"]
    assert a.dtype == np.float32 and b.dtype == np.float32
    np.testing.assert_array_equal(a, tensors[tensor_name(1, "k_proj", "A")].astype(np.float32))
    np.testing.assert_array_equal(b, tensors[tensor_name(1, "k_proj", "B")].astype(np.float32))


def test_some_layers_and_modules_only_in_target_module_order(tmp_path):
    tensors = lora_tensors(layers=[1], modules=["down_proj", "q_proj"])
    checkpoint = load_lora_checkpoint(write_adapter(tmp_path, tensors), SHAPES, MAX_RANK)
    assert checkpoint.config.target_modules == ("q_proj", "down_proj")
    assert list(checkpoint.weights) == [(1, "q_proj"), (1, "down_proj")]


def test_any_prefix_before_layers_is_accepted(tmp_path):
    tensors = {
        name.replace(PREFIX, "model.layers" if "lora_A" in name else "layers"): value
        for name, value in lora_tensors(modules=["o_proj"]).items()
    }
    checkpoint = load_lora_checkpoint(write_adapter(tmp_path, tensors), SHAPES, MAX_RANK)
    assert list(checkpoint.weights) == [(0, "o_proj"), (1, "o_proj")]


@pytest.mark.parametrize(
    ("config", "scaling"),
    [({"r": 16, "lora_alpha": 32}, 2.0), ({"r": 16, "lora_alpha": 32, "use_rslora": True}, 8.0)],
)
def test_scaling_is_pefts(tmp_path, config, scaling):
    tensors = lora_tensors(rank=config["r"])
    adapter = check_lora_checkpoint(write_adapter(tmp_path, tensors, **config), SHAPES, MAX_RANK)
    assert adapter.scaling == scaling


def test_left_out_keys_take_pefts_defaults(tmp_path):
    folder = write_adapter(tmp_path, lora_tensors(rank=8))
    (folder / "adapter_config.json").write_text("{}")
    adapter = check_lora_checkpoint(folder, SHAPES, MAX_RANK)
    assert (adapter.rank, adapter.lora_alpha, adapter.use_rslora, adapter.scaling) == (
        8,
        8.0,
        False,
        1.0,
    )


def test_check_agrees_with_load_and_reads_no_tensor_data(tmp_path, monkeypatch):
    folder = write_adapter(tmp_path, lora_tensors(modules=["v_proj", "gate_proj"]), lora_alpha=6)
    loaded = load_lora_checkpoint(folder, SHAPES, MAX_RANK)

    def no_data_read(*args):
        raise AssertionError("check_lora_checkpoint read tensor data")

    monkeypatch.setattr(lora_checkpoint, "_read_float32", no_data_read)
    assert check_lora_checkpoint(str(folder), SHAPES, MAX_RANK) == loaded.config
    assert loaded.config.target_modules == ("v_proj", "gate_proj")
    assert loaded.config.lora_alpha == 6.0


# ---- refusals ---------------------------------------------------------------------------------


def test_missing_folder_and_files_are_refused_naming_them(tmp_path):
    refused(tmp_path / "nowhere", "nowhere", "does not exist")
    folder = tmp_path / "adapter"
    folder.mkdir()
    refused(folder, str(folder), "no adapter_config.json")
    (folder / "adapter_config.json").write_text(json.dumps({"r": RANK}))
    refused(folder, "no adapter_model.safetensors", "only safetensors")
    (folder / "adapter_model.bin").write_bytes(b"pickle")
    refused(folder, "no adapter_model.safetensors", "adapter_model.bin", "only safetensors")


def test_invalid_config_json_is_refused_naming_the_file(tmp_path):
    folder = write_adapter(tmp_path)
    (folder / "adapter_config.json").write_text("{r: 4")
    refused(folder, "adapter_config.json", "not valid JSON")
    (folder / "adapter_config.json").write_text("[4]")
    refused(folder, "adapter_config.json", "list")


@pytest.mark.parametrize(
    ("config", "fragments"),
    [
        ({"r": 64}, ["has rank (r) 64, above max_lora_rank 16"]),
        ({"r": 0}, ["r 0", ">= 1"]),
        ({"r": "4"}, ["r '4'", "int"]),
        ({"r": True}, ["r True", "int"]),
        ({"peft_type": "LOHA"}, ["peft_type 'LOHA'", "'LORA'"]),
        ({"bias": "all"}, ["bias 'all'", "'none'"]),
        ({"use_dora": True}, ["use_dora True", "DoRA"]),
        ({"modules_to_save": ["lm_head"]}, ["modules_to_save ['lm_head']", "not supported"]),
        ({"fan_in_fan_out": True}, ["fan_in_fan_out True", "not supported"]),
        ({"rank_pattern": {"q_proj": 8}}, ["rank_pattern {'q_proj': 8}", "per-module ranks"]),
        ({"alpha_pattern": {"q_proj": 8}}, ["alpha_pattern {'q_proj': 8}", "per-module alphas"]),
        ({"lora_bias": True}, ["lora_bias True", "not supported"]),
        ({"lora_alpha": "big"}, ["lora_alpha 'big'", "number"]),
        ({"use_rslora": "yes"}, ["use_rslora 'yes'", "true or false"]),
    ],
)
def test_unservable_configs_are_refused_naming_the_key(tmp_path, config, fragments):
    folder = write_adapter(tmp_path, **config)
    refused(folder, str(folder), *fragments)


def test_empty_options_are_accepted(tmp_path):
    empty = {"modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {}, "use_dora": False}
    assert check_lora_checkpoint(write_adapter(tmp_path, **empty), SHAPES, MAX_RANK).rank == RANK


@pytest.mark.parametrize(
    ("name", "shape", "fragments"),
    [
        ("base_model.model.model.embed_tokens.lora_embedding_A", (RANK, VOCAB), ["embed_tokens"]),
        ("base_model.model.lm_head.lora_A.weight", (RANK, HIDDEN), ["lm_head.lora_A"]),
        (f"{PREFIX}.0.self_attn.q_proj.lora_A.bias", (RANK,), ["q_proj.lora_A.bias"]),
        (f"{PREFIX}.0.self_attn.qkv_proj.lora_A.weight", (RANK, HIDDEN), ["'qkv_proj'", "o_proj"]),
        (f"{PREFIX}.2.self_attn.q_proj.lora_A.weight", (RANK, HIDDEN), ["layer 2", "2 layers"]),
        (f"{PREFIX}.0.mlp.q_proj.lora_A.weight", (RANK, HIDDEN), ["mlp.q_proj", "'self_attn'"]),
    ],
)
def test_tensors_outside_the_target_modules_are_refused_naming_them(
    tmp_path, name, shape, fragments
):
    tensors = {**lora_tensors(), name: np.zeros(shape, np.float32)}
    refused(write_adapter(tmp_path, tensors), "adapter_model.safetensors", *fragments)


def test_a_module_the_served_model_has_no_shape_for_is_refused(tmp_path):
    shapes = LoRATargetShapes(num_layers=NUM_LAYERS, modules={"q_proj": (HIDDEN, HIDDEN)})
    folder = write_adapter(tmp_path, lora_tensors(modules=["q_proj", "up_proj"]))
    with pytest.raises(LoRACheckpointError, match=r"up_proj.*no LoRA shape.*q_proj"):
        check_lora_checkpoint(folder, shapes, MAX_RANK)


def test_a_missing_half_is_refused_naming_it(tmp_path):
    tensors = lora_tensors()
    del tensors[tensor_name(1, "v_proj", "B")]
    refused(write_adapter(tmp_path, tensors), tensor_name(1, "v_proj", "A"), "no lora_B", "v_proj")


@pytest.mark.parametrize(
    ("name", "shape", "expected"),
    [
        (tensor_name(0, "q_proj", "A"), (RANK + 1, HIDDEN), [RANK, HIDDEN]),
        (tensor_name(1, "k_proj", "B"), (HIDDEN, RANK), [KV_WIDTH, RANK]),
        (tensor_name(0, "down_proj", "A"), (RANK, HIDDEN), [RANK, INTERMEDIATE]),
    ],
)
def test_wrong_shapes_are_refused_naming_tensor_shape_and_expected(tmp_path, name, shape, expected):
    tensors = {**lora_tensors(), name: np.zeros(shape, np.float32)}
    refused(write_adapter(tmp_path, tensors), name, f"shape {list(shape)}", f"expected {expected}")


def test_unsupported_dtypes_are_refused_naming_tensor_and_dtype(tmp_path):
    name = tensor_name(0, "o_proj", "B")
    tensors = {**lora_tensors(), name: np.zeros((HIDDEN, RANK), np.float64)}
    refused(write_adapter(tmp_path, tensors), name, "dtype F64", "F32, F16, BF16")


def test_an_adapter_without_lora_tensors_is_refused(tmp_path):
    refused(write_adapter(tmp_path, {}), "holds no LoRA tensors")


def test_a_broken_safetensors_file_is_refused_naming_it(tmp_path):
    folder = write_adapter(tmp_path)
    weights = folder / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:5])
    refused(folder, "adapter_model.safetensors", "too short")
    weights.write_bytes((10**6).to_bytes(8, "little") + data[8:])
    refused(folder, "adapter_model.safetensors", "1000000-byte safetensors header")
    weights.write_bytes(len(b"{oops").to_bytes(8, "little") + b"{oops")
    refused(folder, "adapter_model.safetensors", "not valid JSON")
    weights.write_bytes(data[:-1])
    refused(folder, "adapter_model.safetensors", "past the end")
