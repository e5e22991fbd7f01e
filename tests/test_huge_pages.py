"""Large CPU tensors on 2 MiB pages: aligned, usable like any tensor, and backed by huge pages
where the kernel grants them to a process that asks."""

import re
import sys
from pathlib import Path

import torch

from kernels.cpu.f32_matmul import F32MatmulWeight, panel_columns
from kernels.cpu.huge_pages import HUGE_PAGE_BYTES, MIN_BYTES, empty_on_huge_pages

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
