// Included by the CPU emulator after a kernel source: emulated warp-wide instructions that need
// the source's own helpers (fp16 conversion). See cuda_cpu_emulator.h.
#pragma once

// mma.sync.m16n8k16 with fp32 accumulators, fragment layout as documented in cuda_common.cuh:
// every lane publishes its A and B registers (one warp exchange), then computes its own four D
// elements from the published registers of the whole warp.
__host__ __device__ void host_mma_m16n8k16(float* d, const unsigned int* a, const unsigned int* b,
                                           bool is_bf16) {
  const int me = emu::self().linear;
  const int base = me & ~31;
  const int lane = me & 31;
  const unsigned int words[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
  const unsigned int* regs = emu::warp_exchange(words, 6);
  auto element = [&](unsigned int word, int k) -> float {
    const unsigned short bits = static_cast<unsigned short>((k & 1) ? word >> 16 : word & 0xffffu);
    return is_bf16 ? bf16_bits_to_float(bits) : half_bits_to_float(bits);
  };
  auto a_at = [&](int row, int k) -> float {
    const int source = base + (row % 8) * 4 + (k % 8) / 2;
    const int reg = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
    return element(regs[source * emu::kExchangeWords + reg], k);
  };
  auto b_at = [&](int k, int col) -> float {
    const int source = base + col * 4 + (k % 8) / 2;
    return element(regs[source * emu::kExchangeWords + 4 + (k >= 8 ? 1 : 0)], k);
  };
  const int g = lane / 4;
  const int t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i >= 2 ? 8 : 0);
    const int col = 2 * t + (i & 1);
    float acc = d[i];
    for (int k = 0; k < 16; ++k) acc += a_at(row, k) * b_at(k, col);
    d[i] = acc;
  }
}
