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


def _anon_huge_kib() -> int:
    rollup = Path("/proc/self/smaps_rollup").read_text()
    return int(re.search(r"AnonHugePages:\s+(\d+) kB", rollup).group(1))


def test_a_large_tensor_starts_on_a_huge_page_and_holds_what_is_written():
    shape = (2, 700, 16, 3, 64)  # 8.6 MB of float32
    tensor = empty_on_huge_pages(shape, torch.float32)
    assert tensor.shape == shape and tensor.dtype == torch.float32 and tensor.is_contiguous()
    assert tensor.data_ptr() % HUGE_PAGE_BYTES == 0
    values = torch.arange(tensor.numel(), dtype=torch.float32).view(shape)
    tensor.copy_(values)
    assert torch.equal(tensor, values)


def test_the_kernel_backs_it_with_huge_pages_where_it_grants_them():
    before = _anon_huge_kib() if Path("/proc/self/smaps_rollup").exists() else 0
    tensor = empty_on_huge_pages((16 * HUGE_PAGE_BYTES // 4,), torch.float32)
    tensor.fill_(1.0)
    if _thp_granted_on_request():
        gained_kib = _anon_huge_kib() - before
        assert gained_kib >= 8 * HUGE_PAGE_BYTES // 1024, gained_kib
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
