"""The default model as a transformers-loadable Hugging Face folder: the reference that parity
tests and the transformers baseline of the benchmarks compare the engine against.

The conversion is transformers' own GGUF code (dequantize, undo llama.cpp's Q/K permutation), so
it is independent of `worker.model_executor.gguf_loader`. Needs the `test` extra (transformers); nothing is
downloaded. The folder (float32) is cached on disk under $CORE_ENGINE_TEST_CACHE or
~/.cache/core-engine-tests, keyed by the GGUF's name, size and mtime.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import torch

from core_engine.common.model_files import default_model_path

CONVERTER_VERSION = 1
COMPLETE_MARKER = ".complete"


def reference_cache_root() -> Path:
    """Where converted models are cached between test sessions."""
    root = os.environ.get("CORE_ENGINE_TEST_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "core-engine-tests"


def converted_default_model_folder() -> Path:
    """The default GGUF as an HF folder, converted once by transformers and cached on disk."""
    return converted_gguf_folder(default_model_path())


def converted_gguf_folder(gguf_path: Path) -> Path:
    """A GGUF file as an HF folder, converted once by transformers and cached on disk.

    The conversion is transformers' own (dequantize + undo llama.cpp's Q/K permutation, Gemma's
    norm weights minus 1), so it is an independent reference for `worker.model_executor.gguf_loader`. Safe
    against concurrent builders: the folder is built aside and renamed into place.
    """
    gguf_path = Path(gguf_path)
    stat = gguf_path.stat()
    key_text = f"{CONVERTER_VERSION}:{gguf_path.name}:{stat.st_size}:{stat.st_mtime_ns}"
    key = hashlib.sha256(key_text.encode()).hexdigest()[:12]
    folder = reference_cache_root() / f"{gguf_path.stem}-hf-{key}"
    if (folder / COMPLETE_MARKER).is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{folder.name}.", dir=folder.parent))
    try:
        convert_gguf_to_hf_folder(gguf_path, staging)
        (staging / COMPLETE_MARKER).touch()
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(staging, folder)
    except OSError:
        if not (folder / COMPLETE_MARKER).is_file():  # lost a race only if the winner finished
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def convert_gguf_to_hf_folder(gguf_path: Path, folder: Path) -> None:
    """Writes config.json, generation_config.json, model.safetensors and tokenizer files."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    parsed = load_gguf_checkpoint(str(gguf_path))["config"]
    parsed.pop("_model_name_or_path", None)
    config = AutoConfig.for_model(**parsed)
    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(config)
    config.architectures = [type(meta_model).__name__]
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=meta_model)[
        "tensors"
    ]
    save_file(
        {name: t.contiguous() for name, t in tensors.items()},
        str(folder / "model.safetensors"),
        metadata={"format": "pt"},
    )
    config.save_pretrained(folder)
    GenerationConfig(
        bos_token_id=parsed.get("bos_token_id"), eos_token_id=parsed.get("eos_token_id")
    ).save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(folder)
