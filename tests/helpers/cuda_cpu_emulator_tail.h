// Included by the CPU emulator after a kernel source: emulated warp-wide instructions that need
// the source's own helpers (fp16 conversion). See cuda_cpu_emulator.h.
#pragma once

// mma.sync.m16n8k16 with fp32 accumulators, fragment layout as documented in common.cuh:
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

// ---- ldmatrix and cp.async (kernels/cuda/async_copy.cuh) ---------------------------------------
// Plain unsigned long long addresses (SharedAddress on the host), so this compiles for every
// kernel, including the ones that do not include async_copy.cuh.

namespace emu_async {

// True if [address, address + bytes) lies in the dynamic or the static shared-memory arena.
inline bool in_shared_memory(unsigned long long address, size_t bytes) {
  const auto inside = [&](const unsigned char* begin, size_t size) {
    const unsigned long long lo = reinterpret_cast<uintptr_t>(begin);
    return address >= lo && address + bytes <= lo + size;
  };
  return inside(emu::g_dynamic_arena, sizeof emu::g_dynamic_arena) ||
         inside(emu::g_static_arena, sizeof emu::g_static_arena);
}

struct PendingCopy {
  unsigned char* dst;
  const unsigned char* src;
  int src_bytes;  // the rest of the 16 bytes is zero-filled
  int group;      // index of the commit group the copy belongs to
};

// One thread's cp.async state within one block run.
struct ThreadCopies {
  unsigned long long block_serial = 0;
  int committed = 0;  // groups committed so far; the open group has this index
  std::vector<PendingCopy> pending;
};

inline std::vector<ThreadCopies> g_threads;

inline ThreadCopies& mine() {
  const size_t me = static_cast<size_t>(emu::self().linear);
  if (g_threads.size() <= me) {
    g_threads.resize(me + 1);
  }
  ThreadCopies& copies = g_threads[me];
  if (copies.block_serial != emu::g_block_serial) {  // a new block: forget the last one's copies
    copies.block_serial = emu::g_block_serial;
    copies.committed = 0;
    copies.pending.clear();
  }
  return copies;
}

inline void perform(const PendingCopy& copy) {
  memcpy(copy.dst, copy.src, static_cast<size_t>(copy.src_bytes));
  memset(copy.dst + copy.src_bytes, 0, static_cast<size_t>(16 - copy.src_bytes));
}

}  // namespace emu_async

// cp.async.cg.shared.global of 16 bytes (src_bytes of them read, the rest zero): lands either
// now or only at the cp.async.wait_group that covers it, a coin flip of the block's seeded
// schedule, so a read of the destination before the wait (plus a barrier, for other threads'
// copies) sees NaN or stale data, and a refill of a buffer still being read shows up too.
__host__ __device__ void host_cp_async_16(unsigned long long dst, const void* src, int src_bytes) {
  if (dst % 16 != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0) {
    emu::fail("cp.async with a misaligned address (shared %#llx, global %p)", dst, src);
    return;
  }
  if (!emu_async::in_shared_memory(dst, 16)) {
    emu::fail("cp.async destination %#llx is not in shared memory", dst);
    return;
  }
  if (src_bytes < 0 || src_bytes > 16) {
    emu::fail("cp.async of %d source bytes, at most 16", src_bytes);
    return;
  }
  emu_async::ThreadCopies& copies = emu_async::mine();
  const emu_async::PendingCopy copy{reinterpret_cast<unsigned char*>(dst),
                                    static_cast<const unsigned char*>(src), src_bytes,
                                    copies.committed};
  if (emu::g_block->rng.below(2) == 0) {
    emu_async::perform(copy);
  } else {
    copies.pending.push_back(copy);
  }
}

__host__ __device__ void host_cp_async_commit() { ++emu_async::mine().committed; }

// cp.async.wait_group N: every copy of the groups older than the N most recent committed ones
// lands, in issue order; copies not yet committed are not waited for.
__host__ __device__ void host_cp_async_wait(int max_pending_groups) {
  emu_async::ThreadCopies& copies = emu_async::mine();
  const int complete_below = copies.committed - max_pending_groups;
  std::vector<emu_async::PendingCopy> still_pending;
  for (const emu_async::PendingCopy& copy : copies.pending) {
    if (copy.group < complete_below) {
      emu_async::perform(copy);
    } else {
      still_pending.push_back(copy);
    }
  }
  copies.pending.swap(still_pending);
}

// ldmatrix.sync.aligned.m8n8.x{1,2,4}{.trans}.shared.b16, warp-collective: every lane publishes
// its row address (one warp exchange); lane 8 m + r's is row r of matrix m. Then each lane reads
// its own fragment of every matrix: row lane / 4, columns 2 (lane % 4) and + 1 (transposed:
// rows 2 (lane % 4) and + 1 of column lane / 4), the lower index in the low half.
__host__ __device__ void host_ldmatrix(unsigned int* regs, int num_matrices, bool transpose,
                                       unsigned long long row_address) {
  const int me = emu::self().linear;
  const int base = me & ~31;
  const int lane = me & 31;
  if (base + 32 > static_cast<int>(emu::g_block->fibers.size())) {
    emu::fail("ldmatrix in a warp of fewer than 32 threads");
  }
  const bool bad_address =
      row_address % 16 != 0 || !emu_async::in_shared_memory(row_address, 16);
  if (lane < 8 * num_matrices && bad_address) {
    emu::fail("ldmatrix: lane %d's row address %#llx is not a 16-byte aligned shared address",
              lane, row_address);
  }
  unsigned int words[2];
  memcpy(words, &row_address, sizeof words);
  const unsigned int* published = emu::warp_exchange(words, 2);
  const auto element = [&](int matrix, int row, int col) -> unsigned int {
    unsigned long long address;
    memcpy(&address, published + (base + 8 * matrix + row) * emu::kExchangeWords, sizeof address);
    if (address % 16 != 0 || !emu_async::in_shared_memory(address, 16)) {
      return 0xffffu;  // reported above by the lane that gave it; NaN
    }
    unsigned short bits;
    memcpy(&bits, reinterpret_cast<const unsigned char*>(address) + 2 * col, sizeof bits);
    return bits;
  };
  const int g = lane / 4;
  const int t = lane % 4;
  for (int m = 0; m < num_matrices; ++m) {
    const unsigned int lo = transpose ? element(m, 2 * t, g) : element(m, g, 2 * t);
    const unsigned int hi = transpose ? element(m, 2 * t + 1, g) : element(m, g, 2 * t + 1);
    regs[m] = lo | (hi << 16);
  }
}
