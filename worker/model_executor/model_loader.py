"""`load_model`: build the model for a config and fill it from an HF folder or a GGUF file."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from core_engine.common.config_error import ConfigError
from core_engine.common.dtypes import dtype_name
from core_engine.common.gguf_file import GGUFFile
from core_engine.common.model_files import is_gguf_file
from core_engine.proto.engine_config import QUANTIZATIONS
from core_engine.worker.model_executor.gguf_loader import gguf_model_config, iter_gguf_weights
from core_engine.worker.model_executor.gguf_tensor import GgufTensor
from core_engine.worker.model_executor.layers import VocabParallelEmbedding
from core_engine.worker.model_executor.model_config import ModelConfig, load_hf_model_config
from core_engine.worker.model_executor.models import get_model_class

# Checkpoint tensors with no parameter here (recomputed buffers).
IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(
    path: Path,
    device: torch.device,
    dtype: torch.dtype,
    tp_rank: int = 0,
    tp_size: int = 1,
    quantization: str | None = None,
) -> tuple[nn.Module, ModelConfig]:
    """(model in eval mode on `device` in `dtype`, its config); this rank's shard when tp_size > 1.
    `quantization="gguf"` keeps a GGUF file's quantized matrices as their blocks (computed by
    `kernels.cpu.gguf_matmul`; CPU only), None dequantizes them.

    Every parameter is loaded exactly from the checkpoint or this raises ValueError naming the
    missing or unexpected tensors; also FileNotFoundError for missing files, ValueError for
    an unsupported architecture or dtype, and ConfigError for a quantization the model or device
    cannot take.
    """
    dtype_name(dtype)  # ValueError for a dtype the engine does not compute in
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} must be in [0, tp_size={tp_size})")
    path = Path(path)
    _check_quantization(quantization, path, device)
    config, weights = open_checkpoint(path, keep_quantized=quantization == "gguf")
    with _default_dtype(dtype), torch.device(device):
        model = get_model_class(config.architecture)(config, tp_rank, tp_size)
    load_weights(model, weights)
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding):
            module.finish_loading()
    return model.eval(), config


def _check_quantization(quantization: str | None, path: Path, device: torch.device) -> None:
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"quantization={quantization!r}: the engine knows {QUANTIZATIONS}")
    if not is_gguf_file(path):
        raise ConfigError(
            f"quantization='gguf' keeps a GGUF file's quantized weights, but {str(path)!r} is "
            "not a GGUF file: drop --quantization"
        )
    if device.type != "cpu":
        raise ConfigError(
            f"quantization='gguf' runs on the CPU's kernels only, not on {device.type}: drop "
            "--quantization, or use --device cpu"
        )


def open_checkpoint(
    path: Path, keep_quantized: bool = False
) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor | GgufTensor]]]:
    """(config, lazy (HF tensor name, full CPU tensor) pairs) of a GGUF file or an HF folder;
    `keep_quantized`: a GGUF file's quantized matrices come as `GgufTensor`s.

    A GGUF file is opened once for both.
    """
    if is_gguf_file(path):
        gguf_file = GGUFFile(path)
        config = gguf_model_config(gguf_file)
        return config, iter_gguf_weights(gguf_file, config, keep_quantized)
    from core_engine.worker.model_executor.safetensors_loader import iter_safetensors_weights

    config = load_hf_model_config(path)
    return config, iter_safetensors_weights(path)


def load_model_config(path: Path) -> ModelConfig:
    """The config of a GGUF file (its metadata) or an HF folder (config.json), without weights.

    Raises FileNotFoundError naming the missing file, ValueError for unsupported models.
    """
    path = Path(path)
    if is_gguf_file(path):
        return gguf_model_config(GGUFFile(path))
    return load_hf_model_config(path)


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Routes each checkpoint tensor to its parameter's `weight_loader` (fused shards included).

    Raises ValueError for a tensor that matches no parameter and for parameters (or fused
    shards) that no tensor filled.
    """
    params = dict(model.named_parameters())
    packed = model.packed_modules_mapping
    skip_lm_head = model.config.tie_word_embeddings
    loaded: set[tuple[str, object]] = set()
    for checkpoint_name, tensor in weights:
        if checkpoint_name.endswith(IGNORED_TENSOR_SUFFIXES):
            continue
        if skip_lm_head and checkpoint_name == "lm_head.weight":
            continue
        name, shard_id = _fused_name(checkpoint_name, packed)
        param = params.get(name)
        if param is None:
            raise ValueError(f"checkpoint tensor {checkpoint_name!r} matches no model parameter")
        with torch.no_grad():
            try:
                if shard_id is None:
                    param.weight_loader(param, tensor)
                else:
                    param.weight_loader(param, tensor, shard_id)
            except ValueError as error:
                raise ValueError(f"checkpoint tensor {checkpoint_name!r}: {error}") from error
        loaded.add((name, shard_id))
    missing = sorted(
        f"{name}[{shard}]" if shard is not None else name
        for name, shard in _expected_shards(params, packed)
        if (name, shard) not in loaded
    )
    if missing:
        shown = ", ".join(missing[:8]) + (
            f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""
        )
        raise ValueError(f"checkpoint lacks {len(missing)} model tensors: {shown}")


def _fused_name(checkpoint_name: str, packed: dict[str, tuple[str, object]]) -> tuple[str, object]:
    for checkpoint_module, (fused_module, shard_id) in packed.items():
        marker = f".{checkpoint_module}."
        if marker in checkpoint_name:
            return checkpoint_name.replace(marker, f".{fused_module}."), shard_id
    return checkpoint_name, None


def _expected_shards(params: dict[str, nn.Parameter], packed: dict[str, tuple[str, object]]):
    fused_to_shards: dict[str, list[object]] = {}
    for fused_module, shard_id in packed.values():
        fused_to_shards.setdefault(fused_module, []).append(shard_id)
    for name in params:
        module_name = name.split(".")[-2]
        for shard_id in fused_to_shards.get(module_name, [None]):
            yield name, shard_id


@contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
