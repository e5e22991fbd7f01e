"""The CPU emulator itself (tests/cuda_cpu_emulator.*) on small probe kernels.

The schedule: between barriers each warp runs alone, warps in a seeded random order, lanes in a
random order between warp-synchronous operations. Shared memory: exactly the requested size,
NaN until written, and an access past it (dynamic or static) is an `EmulatorFault`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.cuda_cpu_emulator import (
    EmulatedKernel,
    EmulatedLoader,
    EmulatorFault,
    compiler_available,
    rewrite_shared_declarations,
)

pytestmark = pytest.mark.skipif(not compiler_available(), reason="g++ is not installed")

PROBES = r"""
extern "C" __global__ void read_unwritten(float* out) {
  extern __shared__ float4 smem4[];
  const float* smem = reinterpret_cast<const float*>(smem4);
  out[threadIdx.x] = smem[threadIdx.x];
}

extern "C" __global__ void write_shared(float* out, int index) {
  extern __shared__ float smem[];  // a comment: __shared__ float fake[3];
  if (threadIdx.x == 0) {
    smem[index] = 1.0f;
  }
  __syncthreads();
  out[threadIdx.x] = smem[index];
}

// tickets[thread] = the order in which the threads ran between the two barriers.
extern "C" __global__ void arrival_order(int* tickets, int* counter) {
  __syncthreads();
  tickets[blockIdx.x * blockDim.x + threadIdx.x] = (*counter)++;
  __syncthreads();
}

extern "C" __global__ void warp_sums(const float* in, float* out) {
  float value = in[threadIdx.x];
  for (int offset = 16; offset > 0; offset /= 2) {
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  }
  out[threadIdx.x] = value;
}

template <int N>
__global__ void static_tile(const float* in, float* out, int write_index) {
  __shared__ float tile[N];
  __shared__ float never_written[N];
  tile[threadIdx.x] = in[threadIdx.x];
  if (threadIdx.x == 0 && write_index >= 0) {
    tile[write_index] = 0.0f;
  }
  __syncthreads();
  out[threadIdx.x] = tile[N - 1 - threadIdx.x];
  out[N + threadIdx.x] = never_written[threadIdx.x];
}

extern "C" __global__ void divergent_barrier(int* out) {
  if (threadIdx.x >= 32) {
    return;
  }
  __syncthreads();
  out[threadIdx.x] = 1;
}
"""


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    source_dir = tmp_path_factory.mktemp("probes")
    (source_dir / "probes.cu").write_text(PROBES)

    def get(name: str, seed: int = 0) -> EmulatedKernel:
        return EmulatedLoader(source_dir=source_dir, seed=seed).get_kernel("probes.cu", name, None)

    return get


def ptr(tensor: torch.Tensor) -> np.uint64:
    return np.uint64(tensor.data_ptr())


def test_rewrites_shared_declarations_but_not_comments():
    source = (
        "// __shared__ float a[2];\n"
        "extern __shared__ __align__(16) float4 dyn[];\n"
        "__shared__ float b[N][4];\n"
    )
    rewritten = rewrite_shared_declarations(source)
    assert "// __shared__ float a[2];" in rewritten
    assert "#define dyn (reinterpret_cast<float4*>(emu::g_dynamic_shared))" in rewritten
    assert "#define b (emu::static_shared<float[N][4]>(0))" in rewritten


def test_unwritten_shared_memory_reads_as_nan(probes):
    out = torch.zeros(64)
    probes("read_unwritten")((1, 1, 1), (64, 1, 1), (ptr(out),), shared_mem=256)
    assert torch.isnan(out).all()


def test_above_48_kb_the_kernel_must_have_been_given_the_size(probes, tmp_path):
    out = torch.zeros(64)
    loader = EmulatedLoader(source_dir=tmp_path)
    (tmp_path / "probes.cu").write_text(PROBES)
    kernel = loader.get_kernel("probes.cu", "read_unwritten", None)
    with pytest.raises(ValueError, match="65536 bytes of dynamic shared memory above"):
        kernel((1, 1, 1), (64, 1, 1), (ptr(out),), shared_mem=65536)
    loader.get_kernel("probes.cu", "read_unwritten", None, shared_mem_bytes=65536)
    kernel((1, 1, 1), (64, 1, 1), (ptr(out),), shared_mem=65536)
    assert torch.isnan(out).all()


@pytest.mark.parametrize("index", [0, 63])
def test_the_last_requested_byte_is_usable(probes, index):
    out = torch.zeros(32)
    probes("write_shared")((2, 1, 1), (32, 1, 1), (ptr(out), np.int32(index)), shared_mem=256)
    assert (out == 1.0).all()


@pytest.mark.parametrize(("index", "where"), [(64, "past the 256 bytes"), (-1, "before")])
def test_an_access_outside_the_requested_size_is_a_fault(probes, index, where):
    out = torch.zeros(32)
    kernel = probes("write_shared")
    with pytest.raises(EmulatorFault, match=f"write_shared .*seed.*{where}"):
        kernel((1, 1, 1), (32, 1, 1), (ptr(out), np.int32(index)), shared_mem=256)


def test_static_shared_arrays_are_per_block_nan_filled_and_exact(probes):
    kernel = probes("static_tile<32>")
    values = torch.arange(32, dtype=torch.float32)
    out = torch.zeros(64)
    kernel((3, 1, 1), (32, 1, 1), (ptr(values), ptr(out), np.int32(-1)))
    assert torch.equal(out[:32], values.flip(0))
    assert torch.isnan(out[32:]).all()
    kernel((1, 1, 1), (32, 1, 1), (ptr(values), ptr(out), np.int32(31)))
    with pytest.raises(EmulatorFault, match="static __shared__ array #0, which has 128 bytes"):
        kernel((1, 1, 1), (32, 1, 1), (ptr(values), ptr(out), np.int32(32)))


def arrival_tickets(kernel: EmulatedKernel, num_blocks: int = 1) -> np.ndarray:
    tickets = torch.full((num_blocks, 128), -1, dtype=torch.int32)
    counter = torch.zeros(1, dtype=torch.int32)
    kernel((num_blocks, 1, 1), (128, 1, 1), (ptr(tickets), ptr(counter)))
    return tickets.numpy()


def warp_order(tickets: np.ndarray) -> tuple[int, ...]:
    """The order in which the warps of one block ran, checking that each ran alone."""
    starts = []
    for warp in range(len(tickets) // 32):
        lanes = np.sort(tickets[warp * 32 : (warp + 1) * 32])
        assert np.array_equal(lanes, np.arange(lanes[0], lanes[0] + 32)), "warps interleaved"
        starts.append(int(lanes[0]))
    return tuple(np.argsort(starts))


def test_each_warp_runs_alone_between_barriers_in_a_seeded_random_order(probes):
    orders = {warp_order(arrival_tickets(probes("arrival_order", seed))[0]) for seed in range(6)}
    assert len(orders) > 1
    blocks = arrival_tickets(probes("arrival_order", 0), num_blocks=6)
    assert len({warp_order(block - block.min()) for block in blocks}) > 1
    lane_orders = blocks[:, :32]
    assert not (np.diff(lane_orders, axis=1) == 1).all(), "lanes always run in order"


def test_a_seed_reproduces_its_schedule_and_launches_differ(probes):
    first, second = probes("arrival_order", 7), probes("arrival_order", 7)
    tickets = arrival_tickets(first)
    assert np.array_equal(tickets, arrival_tickets(second))
    assert first.last_seed == second.last_seed
    assert not np.array_equal(arrival_tickets(first), tickets)  # launch 2 gets its own seed


@pytest.mark.parametrize("seed", range(3))
def test_shuffles_work_with_lanes_in_random_order(probes, seed):
    values = torch.arange(96, dtype=torch.float32)
    out = torch.zeros(96)
    probes("warp_sums", seed)((1, 1, 1), (96, 1, 1), (ptr(values), ptr(out)))
    expected = values.view(3, 32).sum(dim=1).repeat_interleave(32)
    assert torch.equal(out, expected)


def test_a_barrier_some_threads_skip_is_a_fault(probes):
    out = torch.zeros(64, dtype=torch.int32)
    with pytest.raises(EmulatorFault, match="__syncthreads reached by 32 of 64 threads"):
        probes("divergent_barrier")((1, 1, 1), (64, 1, 1), (ptr(out),))
