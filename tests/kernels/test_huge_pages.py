"""Large CPU tensors on 2 MiB pages: aligned, usable like any tensor, and backed by huge pages
where the kernel grants them to a process that asks."""

import re
import sys
from pathlib import Path

import torch

from core_engine.kernels.cpu.f32_matmul import F32MatmulWeight, panel_columns
from core_engine.kernels.cpu.huge_pages import (
    HUGE_PAGE_BYTES,
    MIN_BYTES,
    HugePageArena,
    empty_on_huge_pages,
)

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_granted_on_request() -> bool:
    """Linux with transparent huge pages in `madvise` or `always` mode."""
    if not sys.platform.startswith("linux") or not THP_SETTING.exists():
        return False
    return re.search(r"\[(always|madvise)\]", THP_SETTING.read_text()) is not None


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if re.fullmatch(r"[0-9a-f]+-[0-9a-f]+", head):
            low, high = (int(part, 16) for part in head.split("-"))
            inside = low <= address < high
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_large_tensor_starts_on_a_huge_page_and_holds_what_is_written():
    shape = (2, 700, 16, 3, 64)  # 8.6 MB of float32
    tensor = empty_on_huge_pages(shape, torch.float32)
    assert tensor.shape == shape and tensor.dtype == torch.float32 and tensor.is_contiguous()
    assert tensor.data_ptr() % HUGE_PAGE_BYTES == 0
    values = torch.arange(tensor.numel(), dtype=torch.float32).view(shape)
    tensor.copy_(values)
    assert torch.equal(tensor, values)


def test_the_kernel_is_asked_for_huge_pages_where_it_grants_them_on_request():
    """Whether the kernel then finds free 2 MiB pages is its own affair (memory may be
    fragmented); what the tensor controls is the request: the mapping is marked `hg`
    (MADV_HUGEPAGE)."""
    tensor = empty_on_huge_pages((16 * HUGE_PAGE_BYTES // 4,), torch.float32)
    tensor.fill_(1.0)
    if _thp_granted_on_request():
        assert "hg" in _vm_flags(tensor.data_ptr())
        assert "hg" in _vm_flags(tensor.data_ptr() + tensor.numel() * 4 - HUGE_PAGE_BYTES)
    assert float(tensor.sum()) == tensor.numel()


def test_small_tensors_are_ordinary_ones():
    tensor = empty_on_huge_pages((3, 5), torch.bfloat16)
    assert tensor.shape == (3, 5) and tensor.dtype == torch.bfloat16
    assert tensor.numel() * tensor.element_size() < MIN_BYTES


def test_packed_float32_weights_of_a_large_linear_sit_on_huge_pages():
    weight = torch.randn(3072, 576)
    packed = F32MatmulWeight.pack(weight)
    if panel_columns() == 0:  # no AVX2 kernel on this CPU: oneDNN keeps the weight
        assert packed is None
        return
    assert packed.packed.data_ptr() % HUGE_PAGE_BYTES == 0
    x = torch.randn(5, 576)
    torch.testing.assert_close(packed.matmul(x), x @ weight.T, rtol=1e-4, atol=1e-4)


def test_an_arena_lays_tensors_side_by_side_aligned_and_apart():
    arena = HugePageArena(chunk_bytes=4 * HUGE_PAGE_BYTES)
    first = arena.empty((3, 7), torch.float32, alignment=64)
    second = arena.empty((5,), torch.bfloat16, alignment=64)
    third = arena.empty((10,), torch.float32, alignment=256)
    for tensor in (first, second, third):
        assert tensor.is_contiguous()
    assert first.data_ptr() % 64 == 0 and second.data_ptr() % 64 == 0
    assert third.data_ptr() % 256 == 0
    # 84 bytes rounded up to 64: the second starts 128 bytes after the first.
    assert second.data_ptr() - first.data_ptr() == 128
    assert third.data_ptr() >= second.data_ptr() + second.numel() * 2
    first.fill_(1.0), second.fill_(2.0), third.fill_(3.0)
    assert float(first.sum()) == 21.0 and float(second.sum()) == 10.0
    assert float(third.sum()) == 30.0


def test_an_arena_starts_a_chunk_for_what_does_not_fit_and_one_of_its_own_for_a_large_tensor():
    arena = HugePageArena(chunk_bytes=HUGE_PAGE_BYTES)
    small = arena.empty((HUGE_PAGE_BYTES // 8,), torch.float32)  # half the chunk
    spill = arena.empty((HUGE_PAGE_BYTES // 4 - 16,), torch.float32)  # does not fit what is left
    large = arena.empty((3 * HUGE_PAGE_BYTES // 4,), torch.float32)  # 3 chunks' worth
    assert spill.untyped_storage().data_ptr() != small.untyped_storage().data_ptr()
    assert large.untyped_storage().nbytes() >= 3 * HUGE_PAGE_BYTES
    large.fill_(1.0)
    assert float(large.sum()) == large.numel()


def test_small_tensors_of_an_arena_are_on_huge_pages_where_the_kernel_grants_them():
    """A 1.3 MB weight (SmolLM2's o_proj) alone would sit on 4 KiB pages."""
    arena = HugePageArena()
    tensors = [arena.empty((576, 576), torch.float32) for _ in range(3)]
    for tensor in tensors:
        tensor.fill_(1.0)
    if _thp_granted_on_request():
        for tensor in tensors:
            assert "hg" in _vm_flags(tensor.data_ptr())
            assert "hg" in _vm_flags(tensor.data_ptr() + tensor.numel() * 4 - 4)


def test_packed_float32_weights_in_an_arena_multiply_as_alone():
    arena = HugePageArena()
    weights = [torch.randn(576, 576), torch.randn(40, 576), torch.randn(960, 576)]
    if panel_columns() == 0:  # no AVX2 kernel on this CPU: oneDNN keeps the weights
        assert F32MatmulWeight.pack(weights[0], arena) is None
        return
    packed = [F32MatmulWeight.pack(weight, arena) for weight in weights]
    storages = {p.packed.untyped_storage().data_ptr() for p in packed}
    assert len(storages) == 1  # one chunk holds all three
    x = torch.randn(7, 576)
    for weight, in_arena in zip(weights, packed, strict=True):
        assert torch.equal(in_arena.matmul(x), F32MatmulWeight.pack(weight).matmul(x))
