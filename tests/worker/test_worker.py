"""Worker: argument errors, max_model_len, KV sizing and the full lifecycle on a tiny model."""

import argparse
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from core_engine.kernels.cpu import backend as cpu_backend
from core_engine.kernels.cpu import kernel_loader as cpu_kernel_loader
from core_engine.proto import SamplingParams
from core_engine.proto.engine_config import EngineConfig
from core_engine.worker import cpu_features, memory_profiler
from core_engine.worker.cpu_features import (
    default_cpu_dtype,
    host_cpu_flags,
    parse_cpu_flags,
    simd_level,
)
from core_engine.worker.memory_profiler import GiB
from core_engine.worker.model_executor import model_loader
from core_engine.worker.worker import Worker, resolve_device, resolve_dtype
from tests.helpers.engine_helpers import generate_token_ids
from tests.helpers.tiny_causal_lm import VOCAB, TinyCausalLM

CPU = torch.device("cpu")


@dataclass(frozen=True)
class TinyConfig:
    num_hidden_layers: int = 2
    num_key_value_heads: int = 2
    head_dim: int = 8
    max_position_embeddings: int = 64
    eos_token_ids: tuple[int, ...] = (3, 7)
    vocab_size: int = VOCAB
    layer_sliding_windows: tuple[None, ...] = (None, None)


@pytest.fixture
def tiny_loader(monkeypatch):
    """Makes Worker.load_model load TinyCausalLM; records what it was asked for."""
    calls = []

    def load_model(path, device, dtype, tp_rank=0, tp_size=1, quantization=None):
        calls.append((path, device, dtype, tp_rank, tp_size))
        return TinyCausalLM(), TinyConfig()

    monkeypatch.setattr(model_loader, "load_model", load_model)
    return calls


def test_cuda_without_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(
        RuntimeError, match="device 'cuda' was requested but torch sees no CUDA GPU"
    ):
        Worker(EngineConfig(device="cuda"))
    assert resolve_device("auto") == CPU


def test_unknown_device_and_dtype_name_the_choices():
    with pytest.raises(ValueError, match=r"device must be one of \('auto', 'cpu', 'cuda'\)"):
        resolve_device("tpu")
    with pytest.raises(
        ValueError, match=r"dtype must be one of \('float32', 'float16', 'bfloat16'\) or None"
    ):
        resolve_dtype("int4", CPU)


AVX2_ONLY_FLAGS = "fpu sse2 avx avx2 fma"  # an AMD Zen 2 / Intel Skylake client


@pytest.mark.parametrize(
    ("flags", "expected", "simd"),
    [
        (AVX2_ONLY_FLAGS, torch.float32, "AVX2"),  # AMD Zen 2/3
        (AVX2_ONLY_FLAGS + " avx512f avx512bw", torch.float32, "AVX-512 without bf16"),
        (AVX2_ONLY_FLAGS + " avx512f avx512_bf16", torch.bfloat16, "AVX512_BF16"),  # Zen 4
        (AVX2_ONLY_FLAGS + " avx512f amx_bf16", torch.bfloat16, "AMX-BF16"),  # Sapphire Rapids
        ("", torch.float32, "no AVX2/AVX-512/NEON"),  # cpuinfo unreadable
    ],
)
def test_cpu_default_dtype_follows_native_bf16(monkeypatch, flags, expected, simd):
    cpuinfo = f"processor\t: 0\nvendor_id\t: X\nflags\t\t: {flags}\n\nprocessor\t: 1\n"
    assert default_cpu_dtype(parse_cpu_flags(cpuinfo)) == expected
    assert simd_level(parse_cpu_flags(cpuinfo)) == simd
    monkeypatch.setattr(cpu_features, "host_cpu_flags", lambda: parse_cpu_flags(cpuinfo))
    assert resolve_dtype(None, CPU) == expected
    assert resolve_dtype("float32", CPU) == torch.float32  # --dtype overrides
    assert resolve_dtype("bfloat16", CPU) == torch.bfloat16


def test_cuda_defaults_to_bfloat16_and_float32_where_asked():
    cuda = torch.device("cuda", 0)  # a name only: resolve_dtype touches no device
    assert resolve_dtype(None, cuda) == torch.bfloat16
    assert resolve_dtype("float32", cuda) == torch.float32
    assert resolve_dtype(None, cuda, quantization="gguf") == torch.float32  # its kernels


def test_arm_features_line_is_read():
    cpuinfo = "processor\t: 0\nFeatures\t: fp asimd bf16 sve\n"
    assert parse_cpu_flags(cpuinfo) == {"fp", "asimd", "bf16", "sve"}


def test_host_flags_match_this_machine():
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    assert host_cpu_flags() == parse_cpu_flags(text)


def test_default_dtypes():
    assert resolve_dtype(None, torch.device("cuda", 0)) == torch.bfloat16
    assert resolve_dtype("float16", CPU) == torch.float16


def test_step_budget_defaults_by_device_and_a_given_one_wins(monkeypatch):
    assert cpu_worker().max_num_batched_tokens == 1024
    assert cpu_worker(max_num_batched_tokens=4096).max_num_batched_tokens == 4096
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert Worker(EngineConfig(device="cuda")).max_num_batched_tokens == 2048


def test_a_rank_outside_the_world_is_refused():
    """The worker checks only what is its own; the config's fields were checked when it was
    made (tests/core/test_engine_core.py)."""
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size=2\), got 2"):
        Worker(EngineConfig(device="cpu"), rank=2, world_size=2)


def cpu_worker(**fields) -> Worker:
    return Worker(EngineConfig(device="cpu", **fields))


def test_max_model_len_is_clamped_to_the_model(tiny_loader, tmp_path):
    model_file = tmp_path / "tiny.gguf"
    model_file.touch()
    w = cpu_worker(model=str(model_file))
    w.load_model()
    assert w.max_model_len == 64
    assert tiny_loader == [(model_file, CPU, default_cpu_dtype(), 0, 1)]
    shorter = cpu_worker(model=str(model_file), max_model_len=32)
    shorter.load_model()
    assert shorter.max_model_len == 32
    with pytest.raises(ValueError, match="max_model_len=100 exceeds .*max_position_embeddings=64"):
        cpu_worker(model=str(model_file), max_model_len=100).load_model()


def test_lifecycle_sizes_cache_and_generates(tiny_loader, tmp_path):
    model_file = tmp_path / "tiny.gguf"
    model_file.touch()
    w = Worker(
        EngineConfig(model=str(model_file), device="cpu", dtype="float32", block_size=4),
        kv_cache_memory_bytes=1 << 20,
    )
    with pytest.raises(RuntimeError, match="load_model"):
        w.determine_num_available_blocks()
    w.load_model()
    assert w.eos_token_ids == [3, 7]
    assert w.bytes_per_block == 2 * 4 * 2 * 8 * 2 * 4
    assert w.determine_num_available_blocks() == (1 << 20) // w.bytes_per_block
    with pytest.raises(RuntimeError, match="before initialize_cache"):
        w.execute_model(None)

    w.initialize_cache(40)
    assert [tuple(c.shape) for c in w.kv_caches] == [(2, 40, 4, 2, 8)] * 2
    prompts = [[1, 2, 4, 5, 6], [8, 9]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    config = EngineConfig(device="cpu", block_size=4, max_model_len=64, num_gpu_blocks_override=40)
    output = generate_token_ids(prompts, config, sampling_params=params, worker=w)
    model = TinyCausalLM()
    assert [r.token_ids for r in output.results] == [model.dense_greedy(p, 6) for p in prompts]


def test_enforce_eager_turns_the_cpu_kernels_off_and_keeps_the_output(tiny_loader, tmp_path):
    model_file = tmp_path / "tiny.gguf"
    model_file.touch()
    prompts = [[1, 2, 4, 5, 6], [8, 9]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    config = EngineConfig(device="cpu", block_size=4, max_model_len=64, num_gpu_blocks_override=40)
    outputs = []
    try:
        for enforce_eager in (True, False):
            w = cpu_worker(
                model=str(model_file), dtype="float32", block_size=4, enforce_eager=enforce_eager
            )
            w.load_model()
            assert cpu_backend.is_available() is not enforce_eager
            w.initialize_cache(40)
            output = generate_token_ids(prompts, config, sampling_params=params, worker=w)
            outputs.append([r.token_ids for r in output.results])
    finally:
        cpu_kernel_loader.set_enabled(True)
    assert outputs[0] == outputs[1] == [TinyCausalLM().dense_greedy(p, 6) for p in prompts]


def test_an_eager_worker_counts_its_opaque_weight_copies(tmp_path):
    """Without the C kernels the linears' weights are oneDNN's blocked copies, which have no
    storage: the start-up line still counts them (it once raised on their data pointer)."""
    from core_engine.worker.model_executor.cpu_linear import model_weight_bytes
    from core_engine.worker.worker_factory import worker_ready
    from tests.helpers.model_fixtures import build_tiny_model_folder

    folder = build_tiny_model_folder(tmp_path / "tiny", "llama_untied")
    config = EngineConfig(model=str(folder), device="cpu", enforce_eager=True)
    worker = Worker(config)
    try:
        worker.load_model()
        linears = [
            m for m in worker.model.modules() if getattr(m, "packed_weight", None) is not None
        ]
        assert linears and all(m.packed_weight.is_mkldnn for m in linears)
        dense_bytes = sum(m.packed_weight.numel() * 4 for m in linears)
        assert model_weight_bytes(worker.model) >= dense_bytes
        assert "weights 0.000 GiB resident" in worker.describe(worker_ready(worker, 0, 64), 0.0)
    finally:
        cpu_kernel_loader.set_enabled(True)


def test_enforce_eager_is_a_cli_flag():
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_arguments(parser)
    assert EngineConfig.from_cli_args(parser.parse_args(["--enforce-eager"])).enforce_eager
    assert not EngineConfig.from_cli_args(parser.parse_args([])).enforce_eager


def test_cpu_kv_budget_is_capped_and_overridable(monkeypatch):
    monkeypatch.setattr(memory_profiler, "read_mem_available_bytes", lambda: 20 * GiB)
    assert memory_profiler.cpu_kv_cache_bytes() == 4 * GiB
    monkeypatch.setattr(memory_profiler, "read_mem_available_bytes", lambda: 5 * GiB)
    assert memory_profiler.cpu_kv_cache_bytes() == 2 * GiB
    assert memory_profiler.cpu_kv_cache_bytes(override_bytes=123) == 123
    with pytest.raises(ValueError, match="kv_cache_memory_bytes must be positive, got 0"):
        memory_profiler.cpu_kv_cache_bytes(override_bytes=0)
    assert memory_profiler.read_mem_available_bytes() > 0


class FakeCudaMemory:
    """torch.cuda memory counters of a 100 GiB device with 12 GiB reserved by torch and 2 GiB
    held outside it; the workload peaks at 10 GiB allocated."""

    def __init__(self, monkeypatch, peak_gib: float = 10):
        self.ran = False
        for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
            monkeypatch.setattr(torch.cuda, name, lambda *args: None)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: int(peak_gib * GiB))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 12 * GiB)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (86 * GiB, 100 * GiB))

    def workload(self):
        self.ran = True


def test_cuda_kv_budget_subtracts_peak_and_non_torch_memory(monkeypatch):
    fake = FakeCudaMemory(monkeypatch)
    budget = memory_profiler.cuda_kv_cache_bytes(torch.device("cuda", 0), 0.9, fake.workload)
    assert fake.ran
    assert budget == int(100 * GiB * 0.9) - 10 * GiB - 2 * GiB


def test_cuda_kv_budget_exhausted_is_a_clear_error(monkeypatch):
    fake = FakeCudaMemory(monkeypatch, peak_gib=30)
    with pytest.raises(RuntimeError, match="no memory left for the KV cache .* raise gpu_memory"):
        memory_profiler.cuda_kv_cache_bytes(torch.device("cuda", 0), 0.3, fake.workload)
