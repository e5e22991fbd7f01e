"""Every `__syncthreads()` in kernels/ is needed, and the CPU emulator proves it.

For each barrier of each kernel source (found by scanning the current sources, so a new barrier
is covered without editing this file), a copy of kernels/ with just that barrier removed runs a
few paged-attention cases in the emulator under several schedule seeds; at least one run must
fail: a wrong or NaN output against the reference, or an emulator fault. The emulator makes such
races visible by running each warp alone from one barrier to the next in a random order, and by
filling shared memory with NaN (tests/cuda_cpu_emulator.h). The same cases with the unmodified
sources pass under every seed. Launching a kernel with half the shared memory it needs is a fault.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from core_engine.kernels.cuda import backend as cuda_backend
from core_engine.kernels.cuda import launch_config as lc
from core_engine.kernels.cuda.module_loader import KERNEL_DIR, load_source
from tests.helpers.cuda_cpu_emulator import (
    EmulatedLoader,
    EmulatorFault,
    build_library,
    compiler_available,
    launch_on_cpu,
    mask_comments,
    translation_unit,
)
from tests.helpers.paged_attention_cases import AttentionCase, assert_close_to_reference, make_case

pytestmark = pytest.mark.skipif(not compiler_available(), reason="g++ is not installed")

NUM_SMS = 4
SEEDS = (0, 1, 2)
_BARRIER = re.compile(r"\b__syncthreads\s*\(\s*\)\s*;")


@dataclass(frozen=True, slots=True)
class Barrier:
    """The `index`-th `__syncthreads();` (comments excluded) of `file_name`, at [start, end)."""

    file_name: str
    index: int
    line: int
    start: int
    end: int

    @property
    def test_id(self) -> str:
        return f"{self.file_name}#{self.index}"


def kernel_files(source_dir: Path = KERNEL_DIR) -> list[str]:
    return sorted(p.name for p in [*source_dir.glob("*.cu"), *source_dir.glob("*.cuh")])


def find_barriers(file_name: str, text: str) -> list[Barrier]:
    code = mask_comments(text)
    return [
        Barrier(file_name, index, code.count("\n", 0, m.start()) + 1, m.start(), m.end())
        for index, m in enumerate(_BARRIER.finditer(code))
    ]


def all_barriers(source_dir: Path = KERNEL_DIR) -> list[Barrier]:
    return [
        barrier
        for name in kernel_files(source_dir)
        for barrier in find_barriers(name, (source_dir / name).read_text())
    ]


def without_barrier(text: str, barrier: Barrier) -> str:
    return text[: barrier.start] + "/* __syncthreads() removed */" + text[barrier.end :]


BARRIERS = all_barriers()


# Cases that together launch every kernel with a barrier, with several KV tiles per CTA (the
# loop-top barriers guard the reuse of the tile buffers) and several warps per CTA.
CASES: dict[str, Callable[[], AttentionCase]] = {
    "decode": lambda: make_case([3, 40, 100], [1, 1, 1], 8, 2, 64),
    "decode-split-bf16": lambda: make_case([700, 3], [1, 1], 8, 2, 128, dtype=torch.bfloat16),
    "prefill-fp32": lambda: make_case([70, 9, 40], [40, 9, 3], 8, 2, 64),
    "prefill-tc-bf16": lambda: make_case([150, 70], [150, 20], 8, 2, 64, dtype=torch.bfloat16),
    "prefill-tc-fp16": lambda: make_case([140, 33], [70, 33], 4, 1, 32, dtype=torch.float16),
}


def use_emulator(monkeypatch: pytest.MonkeyPatch, loader: EmulatedLoader) -> None:
    monkeypatch.setattr(cuda_backend, "default_loader", lambda: loader)
    monkeypatch.setattr(cuda_backend, "_launch", launch_on_cpu)
    monkeypatch.setattr(cuda_backend, "_num_sms", lambda device_index: NUM_SMS)
    # Occupancy unknown, as without a GPU: decode splits by its CTAs-per-SM rule.
    monkeypatch.setattr(cuda_backend, "_resident_ctas_per_sm", lambda *args: None)
    monkeypatch.setattr(cuda_backend, "_max_shared_mem", lambda device_index: 227 * 1024)


def attend(case: AttentionCase) -> torch.Tensor:
    cuda_backend.reshape_and_cache(case.key, case.value, case.kv_cache, case.metadata.slot_mapping)
    return cuda_backend.paged_attention(case.query, case.kv_cache, case.metadata, case.scale)


def run_case(case_id: str, loader: EmulatedLoader) -> str | None:
    """None if the case matches the reference through `loader`'s kernels, else why not."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        use_emulator(monkeypatch, loader)
        case = CASES[case_id]()
        try:
            assert_close_to_reference(case, attend(case))
        except (AssertionError, EmulatorFault) as exc:
            return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return None


@dataclass(frozen=True, slots=True)
class Baseline:
    """What each case launched with the unmodified sources: (source file, name expression)s."""

    launched: dict[str, frozenset[tuple[str, str]]]

    def cases_using(self, file_name: str) -> list[str]:
        """The cases that launch a kernel whose source is, or includes, `file_name`."""
        return [
            case_id
            for case_id, kernels in self.launched.items()
            if any(_uses(source, file_name) for source, _ in kernels)
        ]


def _uses(source_name: str, file_name: str) -> bool:
    return source_name == file_name or f"// begin {file_name}\n" in load_source(source_name)


@pytest.fixture(scope="module")
def baseline() -> Baseline:
    launched = {}
    for case_id in CASES:
        for seed in SEEDS:
            loader = EmulatedLoader(seed=seed)
            failure = run_case(case_id, loader)
            assert failure is None, f"unmodified kernels fail {case_id} with seed {seed}: {failure}"
            launched[case_id] = frozenset(
                key for key, kernel in loader.kernels.items() if kernel.num_launches
            )
    return Baseline(launched)


@pytest.fixture(scope="module")
def variant_dirs(baseline, tmp_path_factory) -> dict[str, Path]:
    """A copy of kernels/ per barrier, without that barrier; their kernels compiled in parallel."""
    dirs = {}
    builds = []
    for barrier in BARRIERS:
        target = tmp_path_factory.mktemp(barrier.test_id.replace("#", "-"))
        for name in kernel_files():
            shutil.copy(KERNEL_DIR / name, target / name)
        text = (KERNEL_DIR / barrier.file_name).read_text()
        current = find_barriers(barrier.file_name, text)
        assert len(current) > barrier.index, f"{barrier.file_name} changed during the test run"
        (target / barrier.file_name).write_text(without_barrier(text, current[barrier.index]))
        dirs[barrier.test_id] = target
        for case_id in baseline.cases_using(barrier.file_name):
            builds += [(source, name, target) for source, name in baseline.launched[case_id]]
    texts = {translation_unit(source, name, target) for source, name, target in set(builds)}
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(build_library, sorted(texts)))
    return dirs


def test_barrier_scan_finds_every_barrier():
    """The parametrization below covers each file's barriers: a plain count agrees with it."""
    assert BARRIERS, "no __syncthreads() found in kernels/"
    for name in kernel_files():
        text = (KERNEL_DIR / name).read_text()
        code = re.sub(r"/\*.*?\*/", "", text, flags=re.DOTALL)
        code = "\n".join(line.split("//")[0] for line in code.splitlines())
        found = [b for b in BARRIERS if b.file_name == name]
        assert len(found) == code.count("__syncthreads()"), name
        assert [b.index for b in found] == list(range(len(found)))
    files_with_barriers = {b.file_name for b in BARRIERS}
    assert {"decode_attention.cu", "prefill_attention.cu", "prefill_attention_tc.cu"} <= (
        files_with_barriers
    )


def test_cases_cover_every_file_with_barriers(baseline):
    for file_name in {b.file_name for b in BARRIERS}:
        assert baseline.cases_using(file_name), f"no case launches a kernel from {file_name}"


@pytest.mark.parametrize("barrier", BARRIERS, ids=[b.test_id for b in BARRIERS])
def test_deleting_a_barrier_is_caught(barrier, baseline, variant_dirs):
    source_dir = variant_dirs[barrier.test_id]
    case_ids = baseline.cases_using(barrier.file_name)
    for seed in SEEDS:
        for case_id in case_ids:
            if run_case(case_id, EmulatedLoader(source_dir=source_dir, seed=seed)) is not None:
                return
    pytest.fail(
        f"{barrier.file_name}:{barrier.line}: removing this __syncthreads() passes "
        f"{case_ids} under seeds {SEEDS}"
    )


def _halve_shared_mem(launch):
    return dataclasses.replace(launch, shared_mem_bytes=launch.shared_mem_bytes // 2)


@pytest.mark.parametrize(
    ("launch_function", "case_id"),
    [
        ("prefill_launch", "prefill-tc-bf16"),
        ("prefill_launch", "prefill-fp32"),
        ("decode_launch", "decode"),
    ],
)
def test_half_the_shared_memory_is_a_fault(monkeypatch, launch_function, case_id):
    original = getattr(lc, launch_function)
    monkeypatch.setattr(lc, launch_function, lambda *a, **k: _halve_shared_mem(original(*a, **k)))
    with pytest.MonkeyPatch.context() as inner:
        use_emulator(inner, EmulatedLoader())
        case = CASES[case_id]()
        with pytest.raises(EmulatorFault, match="past the .* bytes of dynamic shared memory"):
            attend(case)
