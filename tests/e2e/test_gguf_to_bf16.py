"""scripts/gguf_to_bf16.py: the default model rewritten in bf16 keeps every metadata field
and holds, for every weight matrix, the dequantized weights rounded to bf16 (vectors stay
float32), so the engine loaded from it runs the same numbers as from the original file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from core_engine.common.model_files import default_model_path

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_default_model_in_bf16_keeps_metadata_and_rounds_each_weight(tmp_path):
    source = default_model_path()
    target = tmp_path / "bf16.gguf"
    command = [sys.executable, "-m", "scripts.gguf_to_bf16", str(source), str(target)]
    completed = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    original, rewritten = gguf.GGUFReader(source), gguf.GGUFReader(target)
    assert {n for n in original.fields if not n.startswith("GGUF.")} == {
        n for n in rewritten.fields if not n.startswith("GGUF.")
    }
    for name in ("tokenizer.ggml.tokens", "general.architecture", "llama.block_count"):
        assert original.fields[name].contents() == rewritten.fields[name].contents()
    tensors = {t.name: t for t in rewritten.tensors}
    assert len(tensors) == len(original.tensors)
    for tensor in original.tensors[:12]:
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        out = tensors[tensor.name]
        actual = gguf.quants.dequantize(out.data, out.tensor_type)
        if out.tensor_type == gguf.GGMLQuantizationType.BF16:
            expected = torch.from_numpy(expected).bfloat16().float().numpy()
        else:
            assert out.tensor_type == gguf.GGMLQuantizationType.F32
            assert expected.ndim == 1 or tensor.tensor_type == gguf.GGMLQuantizationType.F32
        np.testing.assert_array_equal(actual.reshape(expected.shape), expected)
    assert any(t.tensor_type == gguf.GGMLQuantizationType.BF16 for t in rewritten.tensors)
