"""Which weights a worker computes with when `--quantization` is not given: a GGUF file's own
blocks (`gguf`, `kernels/cpu/gguf_matmul.c`) where they measured faster, else the weights
dequantized at load (today's path, and always the path of an HF folder).

On the AVX2 build (AVX2 + FMA, no AVX-512) the blocks beat the dequantized float32 weights for
one user (a third of the bytes to read per token) and at saturation (prompts and many-request
decode steps on the byte path): benchmarks/results/avx2/one_user.md. Elsewhere they are not
measured to win at every size (an AVX-512 build has no panel path for Q8_0 and K-quant prompts),
so the default stays there until they are.
"""

from __future__ import annotations

from pathlib import Path

import torch

from core_engine.common.gguf_file import GGUFFile
from core_engine.common.model_files import is_gguf_file
from core_engine.kernels.cpu import kernel_loader as cpu_kernel_loader
from core_engine.kernels.cpu.gguf_matmul import GGUF_MATMUL_TYPES
from core_engine.proto.engine_config import EngineConfig

# ggml type ids a GGUF file may hold besides the kernels' block types: kept dense either way
# (F32, F16, BF16).
DENSE_TYPE_IDS = frozenset({0, 1, 30})


def resolve_quantization(config: EngineConfig, device: torch.device, path: Path) -> str | None:
    """`config.quantization` if given; else "gguf" where `gguf_by_default`, else None."""
    if config.quantization is not None:
        return config.quantization
    return "gguf" if gguf_by_default(config, device, path) else None


def gguf_by_default(config: EngineConfig, device: torch.device, path: Path) -> bool:
    """Whether a run that names no quantization computes `path`'s blocks as they ship: a GGUF
    file on a CPU, nothing asked that the blocks change or cannot take (an explicit --dtype
    keeps the dequantized path; LoRA adapters; speculative decoding, whose verification rows
    would round x to 8 bits where plain decode rows round it to 16, so drafts would no longer
    be lossless; tensor parallelism; --enforce-eager, which turns the C kernels off), a kernel
    build with a fast path at every call size, and a readable file of types the kernels take."""
    if device.type != "cpu" or not is_gguf_file(path):
        return False
    if config.dtype is not None or config.enable_lora or config.enforce_eager:
        return False
    if config.speculative_config is not None or config.tensor_parallel_size != 1:
        return False
    if not kernels_win_at_every_size():
        return False
    try:
        return tensor_type_ids(path) <= taken_type_ids()
    except (OSError, ValueError):  # not a readable GGUF file: loading it says why
        return False


def kernels_win_at_every_size() -> bool:
    """The loaded build dequantizes panels for prompt-sized K-quant calls and has the byte path
    for Q4_0, Q4_1 and Q8_0 (the AVX2 build: the one measured)."""
    library = cpu_kernel_loader.load()
    return (
        library is not None
        and bool(library.gguf_matmul_has_panels())
        and bool(library.gguf_matmul_byte_bits())
    )


def taken_type_ids() -> frozenset[int]:
    return DENSE_TYPE_IDS | frozenset(GGUF_MATMUL_TYPES.values())


def tensor_type_ids(path: Path) -> frozenset[int]:
    """The ggml type ids of GGUF file `path`'s tensors (from its header)."""
    return frozenset(tensor.type_id for tensor in GGUFFile(path).tensors)
