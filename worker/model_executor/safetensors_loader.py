"""Reads the weights of a Hugging Face folder: one or several `*.safetensors` files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

SAFETENSORS_INDEX_FILE_NAME = "model.safetensors.index.json"
CHECKPOINT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def safetensors_files(folder: Path) -> list[Path]:
    """The shard files of `folder`: those named by the index file if there is one, else all.

    Raises FileNotFoundError naming a missing shard or an empty folder, ValueError when the
    folder holds only PyTorch pickles (.bin/.pt), which are never loaded.
    """
    folder = Path(folder)
    index_path = folder / SAFETENSORS_INDEX_FILE_NAME
    if index_path.is_file():
        with open(index_path, encoding="utf-8") as f:
            shard_names = sorted(set(json.load(f)["weight_map"].values()))
        files = [folder / name for name in shard_names]
        missing = [str(file) for file in files if not file.is_file()]
        if missing:
            raise FileNotFoundError(f"{index_path} names missing shard files: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(
        file.name for pattern in ("*.bin", "*.pt", "*.pth") for file in folder.glob(pattern)
    )
    if pickles:
        raise ValueError(
            f"model folder {str(folder)!r} has only PyTorch pickle weights ({', '.join(pickles)}); "
            "only *.safetensors are loaded (convert them, or use a GGUF file)"
        )
    raise FileNotFoundError(f"model folder {str(folder)!r} has no *.safetensors weight files")


def iter_safetensors_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Lazily yields (checkpoint name, CPU tensor) for every tensor of every shard.

    The shard list is checked now (errors as `safetensors_files`); reading raises ValueError
    for a tensor whose dtype is not float32/float16/bfloat16.
    """
    return _iter_shard_tensors(safetensors_files(folder))


def _iter_shard_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as shard:
            for name in shard.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensor = shard.get_tensor(name)
                if tensor.dtype not in CHECKPOINT_DTYPES:
                    raise ValueError(
                        f"tensor {name!r} in {file.name} has dtype {tensor.dtype}; supported "
                        "checkpoint dtypes: float32, float16, bfloat16"
                    )
                yield name, tensor
