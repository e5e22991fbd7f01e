"""`load_lora_checkpoint`: a PEFT LoRA adapter folder, checked against the served model and read
as float32 numpy arrays; `check_lora_checkpoint` does the checks from the file headers alone.

A PEFT checkpoint is a folder with `adapter_config.json` (rank `r`, `lora_alpha`, options) and
`adapter_model.safetensors`, whose tensors are named `<prefix>layers.{i}.self_attn.{q,k,v,o}_proj`
or `<prefix>layers.{i}.mlp.{gate,up,down}_proj`, then `.lora_A.weight` ([r, in_features]) or
`.lora_B.weight` ([out_features, r]); the adapter adds `scaling * B @ A` to that weight.

safetensors: an 8-byte little-endian header length, a JSON header mapping each tensor name to its
dtype, shape and [begin, end) byte offsets into the data section that follows the header, then
the row-major little-endian data. It is parsed here with json and numpy, without torch (`common/`
is imported by processes that must not load it); bf16, which numpy lacks, is widened to float32
bit for bit.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import numpy as np

CONFIG_FILE_NAME = "adapter_config.json"
WEIGHTS_FILE_NAME = "adapter_model.safetensors"
PICKLED_WEIGHTS_FILE_NAME = "adapter_model.bin"

# The projections an adapter may target, in the order of a Llama decoder layer (proto's
# LoRATargetShapes names them).
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Target module -> the decoder-layer block that holds it.
MODULE_TO_BLOCK = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
# PEFT's LoraConfig defaults, for keys a hand-written config leaves out.
PEFT_DEFAULT_RANK = 8
PEFT_DEFAULT_LORA_ALPHA = 8
# Config key -> why an adapter that sets it (to anything truthy) cannot be served.
UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA adapters are not supported",
    "fan_in_fan_out": "transposed (Conv1D-style) LoRA weights are not supported",
    "modules_to_save": "fully trained extra modules are not supported",
    "rank_pattern": "per-module ranks are not supported, only one r for every module",
    "alpha_pattern": "per-module alphas are not supported, only one lora_alpha for every module",
    "lora_bias": "a bias on lora_B is not supported",
}

# Anything before `layers.{i}.` is the wrapper's prefix (`base_model.model.model.` from PEFT).
TENSOR_NAME = re.compile(r"(?:.*\.)?layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])\.weight")
HEADER_LENGTH_BYTES = 8
# The safetensors library refuses headers above 100 MB; so does this reader.
MAX_HEADER_BYTES = 100_000_000
METADATA_KEY = "__metadata__"
# safetensors dtype -> how its bytes are read (BF16 as its raw bits, widened afterwards).
DTYPE_TO_STORED = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}


class LoRACheckpointError(ValueError):
    """An adapter the engine cannot serve. The message names the adapter folder or file, the
    tensor or config key, the bad value and the limit it broke."""


class TargetShapes(Protocol):
    """The shapes an adapter must fit: `proto.lora_request.LoRATargetShapes` (declared here as a
    protocol because common/ may not import proto/). `modules` maps each target module the
    served model allows to its (in_features, out_features), the same in every layer."""

    @property
    def num_layers(self) -> int: ...

    @property
    def modules(self) -> Mapping[str, tuple[int, int]]: ...


@dataclass(frozen=True, slots=True)
class LoRAAdapterConfig:
    """What adapter_config.json says, validated: 1 <= rank <= max_lora_rank, and the modules the
    weights hold, a non-empty subset of LORA_TARGET_MODULES in that order."""

    rank: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]

    @property
    def scaling(self) -> float:
        """The factor on B @ A (PEFT's): lora_alpha / rank, or lora_alpha / sqrt(rank) with
        rank-stabilized LoRA."""
        if self.use_rslora:
            return self.lora_alpha / math.sqrt(self.rank)
        return self.lora_alpha / self.rank


@dataclass(frozen=True, slots=True)
class LoRACheckpoint:
    """An adapter's weights: (layer index, module) -> (A float32 [rank, in_features], B float32
    [out_features, rank]), B not multiplied by `config.scaling`; ordered by layer, then module in
    LORA_TARGET_MODULES order. Not every layer need hold every module."""

    path: Path
    config: LoRAAdapterConfig
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True, slots=True)
class _TensorEntry:
    """One tensor of the safetensors header: its bytes are [file_offset, file_offset + num_bytes)
    of the file, which the header check has found inside it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file_offset: int
    num_bytes: int


# A (layer, module) pair's lora_A and lora_B entries.
_EntryPairs = dict[tuple[int, str], tuple[_TensorEntry, _TensorEntry]]


def check_lora_checkpoint(
    path: str | Path, shapes: TargetShapes, max_rank: int
) -> LoRAAdapterConfig:
    """The adapter's validated config. Checks the config and every tensor's name, dtype and shape
    from the safetensors header only (no tensor data is read): what the frontend calls before a
    request or a load reaches the engine. Raises LoRACheckpointError."""
    config, _ = _inspect(Path(path), shapes, max_rank)
    return config


def load_lora_checkpoint(path: str | Path, shapes: TargetShapes, max_rank: int) -> LoRACheckpoint:
    """`check_lora_checkpoint`, then the tensors read as float32 numpy arrays (F32, F16 and BF16
    widen exactly). Raises LoRACheckpointError."""
    folder = Path(path)
    config, entry_pairs = _inspect(folder, shapes, max_rank)
    weights = {}
    with (folder / WEIGHTS_FILE_NAME).open("rb") as file:
        for key, (entry_a, entry_b) in entry_pairs.items():
            weights[key] = (_read_float32(file, entry_a), _read_float32(file, entry_b))
    return LoRACheckpoint(path=folder, config=config, weights=weights)


def _inspect(
    folder: Path, shapes: TargetShapes, max_rank: int
) -> tuple[LoRAAdapterConfig, _EntryPairs]:
    config_path, weights_path = _checkpoint_files(folder)
    raw_config = _read_config_json(config_path)
    _check_lora_options(config_path, raw_config)
    rank = _rank(folder, config_path, raw_config, max_rank)
    entry_pairs = _entry_pairs(weights_path, _read_tensor_table(weights_path), shapes)
    for (_, module), (entry_a, entry_b) in entry_pairs.items():
        in_features, out_features = shapes.modules[module]
        _check_tensor(weights_path, entry_a, (rank, in_features))
        _check_tensor(weights_path, entry_b, (out_features, rank))
    modules_present = {module for _, module in entry_pairs}
    config = LoRAAdapterConfig(
        rank=rank,
        lora_alpha=_lora_alpha(config_path, raw_config),
        use_rslora=_use_rslora(config_path, raw_config),
        target_modules=tuple(m for m in LORA_TARGET_MODULES if m in modules_present),
    )
    return config, entry_pairs


def _checkpoint_files(folder: Path) -> tuple[Path, Path]:
    """The config and weights files of an adapter folder, both present."""
    if not folder.is_dir():
        raise LoRACheckpointError(f"LoRA adapter folder {str(folder)!r} does not exist")
    config_path = folder / CONFIG_FILE_NAME
    if not config_path.is_file():
        raise LoRACheckpointError(f"LoRA adapter folder {str(folder)!r} has no {CONFIG_FILE_NAME}")
    weights_path = folder / WEIGHTS_FILE_NAME
    if not weights_path.is_file():
        has_pickled = (folder / PICKLED_WEIGHTS_FILE_NAME).is_file()
        pickled_note = f" (its {PICKLED_WEIGHTS_FILE_NAME} is not read)" if has_pickled else ""
        raise LoRACheckpointError(
            f"LoRA adapter folder {str(folder)!r} has no {WEIGHTS_FILE_NAME}{pickled_note}; only "
            "safetensors adapter weights are read (PEFT's save_pretrained writes them by default)"
        )
    return config_path, weights_path


def _read_config_json(config_path: Path) -> dict[str, Any]:
    try:
        raw_config = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise LoRACheckpointError(f"{str(config_path)!r} is not valid JSON: {error}") from error
    if not isinstance(raw_config, dict):
        raise LoRACheckpointError(
            f"{str(config_path)!r} holds a JSON {type(raw_config).__name__}, not an object"
        )
    return raw_config


def _check_lora_options(config_path: Path, raw_config: dict[str, Any]) -> None:
    """The config describes a plain LoRA adapter: no other PEFT method, no bias, none of
    UNSUPPORTED_OPTIONS."""
    peft_type = raw_config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRACheckpointError(
            f"{str(config_path)!r} has peft_type {peft_type!r}; only 'LORA' adapters are supported"
        )
    bias = raw_config.get("bias", "none")
    if bias != "none":
        raise LoRACheckpointError(
            f"{str(config_path)!r} has bias {bias!r}; only 'none' is supported (adapters that "
            "train biases are not)"
        )
    for key, reason in UNSUPPORTED_OPTIONS.items():
        value = raw_config.get(key)
        if value:
            raise LoRACheckpointError(f"{str(config_path)!r} has {key} {value!r}: {reason}")


def _rank(folder: Path, config_path: Path, raw_config: dict[str, Any], max_rank: int) -> int:
    rank = raw_config.get("r", PEFT_DEFAULT_RANK)
    if not _is_int(rank) or rank < 1:
        raise LoRACheckpointError(f"{str(config_path)!r} has r {rank!r}; it must be an int >= 1")
    if rank > max_rank:
        raise LoRACheckpointError(
            f"adapter {str(folder)!r} has rank (r) {rank}, above max_lora_rank {max_rank}"
        )
    return rank


def _lora_alpha(config_path: Path, raw_config: dict[str, Any]) -> float:
    lora_alpha = raw_config.get("lora_alpha", PEFT_DEFAULT_LORA_ALPHA)
    is_number = _is_int(lora_alpha) or isinstance(lora_alpha, float)
    if not is_number or not math.isfinite(lora_alpha):
        raise LoRACheckpointError(
            f"{str(config_path)!r} has lora_alpha {lora_alpha!r}; it must be a finite number"
        )
    return float(lora_alpha)


def _use_rslora(config_path: Path, raw_config: dict[str, Any]) -> bool:
    use_rslora = raw_config.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise LoRACheckpointError(
            f"{str(config_path)!r} has use_rslora {use_rslora!r}; it must be true or false"
        )
    return use_rslora


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _read_tensor_table(weights_path: Path) -> list[_TensorEntry]:
    """Every tensor the safetensors header lists, each with its bytes inside the file."""
    file_size = weights_path.stat().st_size
    with weights_path.open("rb") as file:
        length_bytes = file.read(HEADER_LENGTH_BYTES)
        if len(length_bytes) < HEADER_LENGTH_BYTES:
            raise LoRACheckpointError(
                f"{str(weights_path)!r} is {file_size} bytes, too short for a safetensors header"
            )
        header_length = int.from_bytes(length_bytes, "little")
        header_limit = min(MAX_HEADER_BYTES, file_size - HEADER_LENGTH_BYTES)
        if header_length > header_limit:
            raise LoRACheckpointError(
                f"{str(weights_path)!r} declares a {header_length}-byte safetensors header, "
                f"above the {header_limit} bytes it can have"
            )
        header_bytes = file.read(header_length)
    try:
        header = json.loads(header_bytes)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise LoRACheckpointError(
            f"{str(weights_path)!r} has a safetensors header that is not valid JSON: {error}"
        ) from error
    if not isinstance(header, dict):
        raise LoRACheckpointError(
            f"{str(weights_path)!r} has a safetensors header that is not a map"
        )
    data_offset = HEADER_LENGTH_BYTES + header_length
    return [
        _tensor_entry(weights_path, name, info, data_offset, file_size)
        for name, info in header.items()
        if name != METADATA_KEY
    ]


def _tensor_entry(
    weights_path: Path, name: str, info: Any, data_offset: int, file_size: int
) -> _TensorEntry:
    """A header entry, well-formed and with [begin, end) inside the file's data section."""
    try:
        dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        well_formed = (
            isinstance(dtype, str)
            and all(_is_int(size) and size >= 0 for size in shape)
            and _is_int(begin)
            and _is_int(end)
            and 0 <= begin <= end
        )
    except (TypeError, KeyError, ValueError):
        well_formed = False
    if not well_formed:
        raise LoRACheckpointError(
            f"{str(weights_path)!r}: tensor {name!r} has a malformed header entry {info!r}"
        )
    if data_offset + end > file_size:
        raise LoRACheckpointError(
            f"{str(weights_path)!r}: tensor {name!r} ends at byte {data_offset + end}, past the "
            f"end of the {file_size}-byte file"
        )
    return _TensorEntry(name, dtype, tuple(shape), data_offset + begin, end - begin)


def _entry_pairs(
    weights_path: Path, entries: list[_TensorEntry], shapes: TargetShapes
) -> _EntryPairs:
    """Each (layer, module) the tensors name -> its (lora_A, lora_B) entries, ordered by layer
    then LORA_TARGET_MODULES; both halves present, each module one `shapes` allows."""
    halves: dict[tuple[int, str], dict[str, _TensorEntry]] = {}
    for entry in entries:
        layer, module, half = _parse_tensor_name(weights_path, entry.name, shapes)
        halves.setdefault((layer, module), {})[half] = entry
    if not halves:
        raise LoRACheckpointError(f"{str(weights_path)!r} holds no LoRA tensors")
    entry_pairs = {}
    for layer, module in sorted(halves, key=lambda k: (k[0], LORA_TARGET_MODULES.index(k[1]))):
        by_half = halves[layer, module]
        for half in ("A", "B"):
            if half not in by_half:
                present = next(iter(by_half.values())).name
                raise LoRACheckpointError(
                    f"{str(weights_path)!r} has {present!r} but no lora_{half} for module "
                    f"{module} of layer {layer}"
                )
        entry_pairs[layer, module] = (by_half["A"], by_half["B"])
    return entry_pairs


def _parse_tensor_name(weights_path: Path, name: str, shapes: TargetShapes) -> tuple[int, str, str]:
    """(layer index, module, "A" or "B") of a LoRA tensor name of a module `shapes` allows."""
    match = TENSOR_NAME.fullmatch(name)
    if match is None:
        raise LoRACheckpointError(
            f"{str(weights_path)!r} has tensor {name!r}, which is not a LoRA weight of a decoder "
            f"layer's projection (<prefix>layers.<i>.self_attn|mlp.<module>.lora_A|lora_B.weight "
            f"with <module> one of {', '.join(LORA_TARGET_MODULES)})"
        )
    layer_text, block, module, half = match.groups()
    if module not in LORA_TARGET_MODULES:
        raise LoRACheckpointError(
            f"{str(weights_path)!r} has tensor {name!r} on module {module!r}; LoRA is supported "
            f"on {', '.join(LORA_TARGET_MODULES)} only"
        )
    if block != MODULE_TO_BLOCK[module]:
        raise LoRACheckpointError(
            f"{str(weights_path)!r} has tensor {name!r} with {module} under {block!r}; it belongs "
            f"under {MODULE_TO_BLOCK[module]!r}"
        )
    if module not in shapes.modules:
        raise LoRACheckpointError(
            f"{str(weights_path)!r} has tensor {name!r} on module {module}, which the served "
            f"model has no LoRA shape for (it has {', '.join(shapes.modules)})"
        )
    layer = int(layer_text)
    if layer >= shapes.num_layers:
        raise LoRACheckpointError(
            f"{str(weights_path)!r} has tensor {name!r} for layer {layer}; the served model has "
            f"{shapes.num_layers} layers (0 to {shapes.num_layers - 1})"
        )
    return layer, module, half


def _check_tensor(weights_path: Path, entry: _TensorEntry, expected_shape: tuple[int, int]) -> None:
    """The entry has a readable dtype, the expected shape, and exactly the bytes that shape needs."""
    if entry.dtype not in DTYPE_TO_STORED:
        raise LoRACheckpointError(
            f"{str(weights_path)!r}: tensor {entry.name!r} has dtype {entry.dtype}; only "
            f"{', '.join(DTYPE_TO_STORED)} are supported"
        )
    if entry.shape != expected_shape:
        raise LoRACheckpointError(
            f"{str(weights_path)!r}: tensor {entry.name!r} has shape {list(entry.shape)}, "
            f"expected {list(expected_shape)}"
        )
    expected_bytes = math.prod(expected_shape) * DTYPE_TO_STORED[entry.dtype].itemsize
    if entry.num_bytes != expected_bytes:
        raise LoRACheckpointError(
            f"{str(weights_path)!r}: tensor {entry.name!r} spans {entry.num_bytes} bytes, but "
            f"{entry.dtype} {list(entry.shape)} needs {expected_bytes}"
        )


def _read_float32(file: BinaryIO, entry: _TensorEntry) -> np.ndarray:
    """A checked entry's data as a new float32 array of its shape."""
    file.seek(entry.file_offset)
    data = file.read(entry.num_bytes)
    if len(data) != entry.num_bytes:
        raise LoRACheckpointError(
            f"{file.name!r}: tensor {entry.name!r} was cut short while reading (the file changed?)"
        )
    stored = np.frombuffer(data, dtype=DTYPE_TO_STORED[entry.dtype]).reshape(entry.shape)
    if entry.dtype == "BF16":
        # bf16 is the top half of a float32's bits.
        return (stored.astype(np.uint32) << 16).view(np.float32)
    return stored.astype(np.float32)
