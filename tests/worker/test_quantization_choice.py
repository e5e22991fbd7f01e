"""The quantization a worker runs when `--quantization` is not given: a GGUF file's blocks on a
CPU whose kernel build has a fast path at every call size (the AVX2 build, where they measured
faster), unless something was asked that keeps the dequantized path; what a build reports
decides, so every kind of CPU is covered on any host."""

from __future__ import annotations

import pytest
import torch

from core_engine.common.model_files import resolve_model_path
from core_engine.kernels.cpu import kernel_loader as cpu_kernel_loader
from core_engine.proto.engine_config import EngineConfig
from core_engine.worker import quantization_choice
from core_engine.worker.quantization_choice import gguf_by_default, resolve_quantization
from core_engine.worker.worker import Worker
from tests.helpers.cpu_kernel_builds import host_build
from tests.helpers.model_fixtures import build_tiny_model_folder

CPU = torch.device("cpu")


@pytest.fixture
def kernels_win(monkeypatch):
    """The rule under a build that has panels and the byte path, whatever this host's."""
    monkeypatch.setattr(quantization_choice, "kernels_win_at_every_size", lambda: True)


def test_only_a_build_with_panels_and_the_byte_path_wins_at_every_size():
    if cpu_kernel_loader.load() is None:
        pytest.skip("no C compiler: the CPU kernels are not built")
    build = host_build()
    expected = build.gguf_matmul_panels and build.gguf_matmul_byte_bits > 0
    assert quantization_choice.kernels_win_at_every_size() == expected


def test_a_gguf_file_runs_its_blocks_by_default_where_they_win(kernels_win):
    path = resolve_model_path(None)
    assert resolve_quantization(EngineConfig(device="cpu"), CPU, path) == "gguf"
    worker = Worker(EngineConfig(device="cpu"))
    assert worker.quantization == "gguf" and worker.dtype == torch.float32


def test_nothing_changes_where_the_build_does_not_win(monkeypatch):
    monkeypatch.setattr(quantization_choice, "kernels_win_at_every_size", lambda: False)
    path = resolve_model_path(None)
    assert resolve_quantization(EngineConfig(device="cpu"), CPU, path) is None
    assert Worker(EngineConfig(device="cpu")).quantization is None


@pytest.mark.parametrize(
    "asked",
    [
        {"dtype": "float32"},
        {"dtype": "bfloat16"},
        {"enable_lora": True},
        {"enforce_eager": True},
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
        {"tensor_parallel_size": 2},
    ],
    ids=lambda asked: next(iter(asked)),
)
def test_what_was_asked_keeps_the_dequantized_path(kernels_win, asked):
    config = EngineConfig(device="cpu", **asked)
    assert not gguf_by_default(config, CPU, resolve_model_path(None))


def test_an_hf_folder_a_gpu_and_a_file_of_other_types_keep_it(kernels_win, tmp_path, monkeypatch):
    config = EngineConfig(device="cpu")
    gguf_path = resolve_model_path(None)
    folder = build_tiny_model_folder(tmp_path / "tiny", "llama_untied")
    assert not gguf_by_default(config, CPU, folder)
    assert not gguf_by_default(config, torch.device("cuda"), gguf_path)
    empty = tmp_path / "empty.gguf"
    empty.touch()
    assert not gguf_by_default(config, CPU, empty)  # unreadable: the load reports it
    q5_k = 13  # a block type the kernels do not take
    monkeypatch.setattr(quantization_choice, "tensor_type_ids", lambda path: frozenset({0, q5_k}))
    assert not gguf_by_default(config, CPU, gguf_path)


def test_the_default_models_types_are_all_taken():
    """Its Q4_1 linears, Q8_0 embedding and F32 norms."""
    types = quantization_choice.tensor_type_ids(resolve_model_path(None))
    assert types == {0, 3, 8} and types <= quantization_choice.taken_type_ids()


def test_an_explicit_quantization_is_kept(monkeypatch):
    monkeypatch.setattr(quantization_choice, "kernels_win_at_every_size", lambda: False)
    config = EngineConfig(device="cpu", quantization="gguf")
    assert resolve_quantization(config, CPU, resolve_model_path(None)) == "gguf"
