// Included by the CPU emulator after a kernel source: emulated warp-wide instructions that need
// the source's own helpers (fp16 conversion). See cuda_cpu_emulator.h.
#pragma once

// mma.sync.m16n8k16 with fp32 accumulators, fragment layout as documented in cuda_common.cuh:
// every lane publishes its A and B registers, then computes its own four D elements.
__host__ __device__ void host_mma_m16n8k16(float* d, const unsigned int* a, const unsigned int* b,
                                           bool is_bf16) {
  emu::Block& block = *emu::g_block;
  const int me = emu::self().linear;
  const int base = me & ~31;
  const int lane = me & 31;
  for (int r = 0; r < 4; ++r) block.mma_a[me * 4 + r] = a[r];
  for (int r = 0; r < 2; ++r) block.mma_b[me * 2 + r] = b[r];
  emu::sync_warp();
  auto element = [&](unsigned int word, int k) -> float {
    const unsigned short bits = static_cast<unsigned short>((k & 1) ? word >> 16 : word & 0xffffu);
    return is_bf16 ? bf16_bits_to_float(bits) : half_bits_to_float(bits);
  };
  auto a_at = [&](int row, int k) -> float {
    const int source = base + (row % 8) * 4 + (k % 8) / 2;
    const int reg = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
    return element(block.mma_a[source * 4 + reg], k);
  };
  auto b_at = [&](int k, int col) -> float {
    const int source = base + col * 4 + (k % 8) / 2;
    return element(block.mma_b[source * 2 + (k >= 8 ? 1 : 0)], k);
  };
  const int g = lane / 4;
  const int t = lane % 4;
  float result[4];
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i >= 2 ? 8 : 0);
    const int col = 2 * t + (i & 1);
    float acc = d[i];
    for (int k = 0; k < 16; ++k) acc += a_at(row, k) * b_at(k, col);
    result[i] = acc;
  }
  emu::sync_warp();
  for (int i = 0; i < 4; ++i) d[i] = result[i];
}
