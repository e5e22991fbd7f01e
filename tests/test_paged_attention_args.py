"""`PagedAttentionArgs` (kernels/cuda/common.cuh) and its NumPy twin (PAGED_ATTENTION_ARGS) have
one layout: the compiler's offsets and size, read by a probe kernel in the CPU emulator, equal
the dtype's, and a struct built by the launcher reaches a kernel field for field."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from kernels.cuda.module_loader import KERNEL_DIR
from kernels.cuda.paged_attention_args import PAGED_ATTENTION_ARGS, paged_attention_args
from tests.cuda_cpu_emulator import EmulatedLoader, compiler_available

pytestmark = pytest.mark.skipif(not compiler_available(), reason="g++ is not installed")

FIELDS = PAGED_ATTENTION_ARGS.names

PROBE = (
    '#include "common.cuh"\n#include <cstddef>\n'
    "__global__ void layout(long long* out) {\n"
    "  if (threadIdx.x != 0) return;\n"
    "  out[0] = sizeof(PagedAttentionArgs);\n"
    + "".join(
        f"  out[{i + 1}] = offsetof(PagedAttentionArgs, {name});\n" for i, name in enumerate(FIELDS)
    )
    + "}\n"
    "__global__ void echo(const PagedAttentionArgs args, long long* echoed) {\n"
    "  if (threadIdx.x != 0) return;\n"
    "  UNPACK_PAGED_ATTENTION_ARGS(float, args);\n"
    + "".join(
        f"  echoed[{i}] = (long long)({name});\n"
        for i, name in enumerate(FIELDS)
        if name != "scale_log2"
    )
    + f"  echoed[{FIELDS.index('scale_log2')}] = (long long)(scale_log2 * 1000.0f);\n"
    "}\n"
)


@pytest.fixture(scope="module")
def loader(tmp_path_factory) -> EmulatedLoader:
    source_dir = tmp_path_factory.mktemp("paged_args")
    for header in KERNEL_DIR.glob("*.cuh"):
        shutil.copy(header, source_dir / header.name)
    (source_dir / "probe.cu").write_text(PROBE)
    return EmulatedLoader(source_dir=source_dir)


def test_numpy_layout_is_the_structs(loader):
    out = torch.zeros(len(FIELDS) + 1, dtype=torch.int64)
    kernel = loader.get_kernel("probe.cu", "layout", None)
    kernel((1, 1, 1), (1, 1, 1), (np.uint64(out.data_ptr()),))
    offsets = [PAGED_ATTENTION_ARGS.fields[name][1] for name in FIELDS]
    assert out.tolist() == [PAGED_ATTENTION_ARGS.itemsize, *offsets]


def test_launcher_struct_reaches_the_kernel_field_for_field(loader):
    kv_cache = torch.zeros(2, 3, 16, 2, 8)  # [k/v, blocks, block_size, kv_heads, head_dim]
    query = torch.zeros(5, 4, 8)[:, :, :].reshape(5, 32)
    out = torch.zeros(5, 64)[:, :32]  # a token stride wider than a row
    block_table = torch.zeros(2, 7, dtype=torch.int32)
    seq_lens = torch.zeros(2, dtype=torch.int32)
    query_start_loc = torch.zeros(3, dtype=torch.int32)
    args = paged_attention_args(
        query, kv_cache, block_table, seq_lens, query_start_loc, out, 1.5, 4096, num_heads=4
    )
    echoed = torch.zeros(len(FIELDS), dtype=torch.int64)
    kernel = loader.get_kernel("probe.cu", "echo", None)
    kernel((1, 1, 1), (1, 1, 1), (args, np.uint64(echoed.data_ptr())))
    assert dict(zip(FIELDS, echoed.tolist(), strict=True)) == {
        "query": query.data_ptr(),
        "query_token_stride": 32,
        "key_cache": kv_cache[0].data_ptr(),
        "value_cache": kv_cache[1].data_ptr(),
        "block_table": block_table.data_ptr(),
        "block_table_stride": 7,
        "seq_lens": seq_lens.data_ptr(),
        "query_start_loc": query_start_loc.data_ptr(),
        "out": out.data_ptr(),
        "out_token_stride": 64,
        "scale_log2": 1500,
        "sliding_window": 4096,
        "num_kv_heads": 2,
        "group_size": 2,
        "block_size": 16,
    }
