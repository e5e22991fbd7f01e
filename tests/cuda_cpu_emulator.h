// A small CPU emulator of the CUDA execution model, just enough to run kernels/*.cu as host C++.
//
// Blocks run one after another; the threads of a block are ucontext fibers on one OS thread,
// switched at every synchronization point (__syncthreads, warp shuffles). Shared memory is the
// namespace-scope array the harness defines for each `extern __shared__` name. Used only by the
// tests (tests/cuda_cpu_emulator.py) to check the kernels' logic and argument packing without a
// GPU; it says nothing about performance or the memory model.
#pragma once

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>

#include <algorithm>
#include <cstddef>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __shared__
#define __forceinline__ inline
#define __launch_bounds__(...)

struct dim3 {
  unsigned int x = 1, y = 1, z = 1;
};
struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) {
  return uint4{x, y, z, w};
}
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline float __uint_as_float(unsigned int u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
inline unsigned int __float_as_uint(float f) {
  unsigned int u;
  memcpy(&u, &f, sizeof u);
  return u;
}
using std::max;
using std::min;

namespace emu {

constexpr size_t kStackBytes = 128 * 1024;
constexpr long kMaxSpins = 200000000L;

struct Fiber {
  ucontext_t context;
  dim3 thread_idx;
  int linear = 0;
  bool done = false;
};

struct Block {
  std::vector<Fiber> fibers;
  ucontext_t scheduler;
  int current = 0;
  int block_arrived = 0;
  long block_generation = 0;
  std::vector<int> warp_arrived;
  std::vector<long> warp_generation;
  std::vector<unsigned long long> shuffle_slots;
  std::vector<unsigned int> mma_a;  // 4 registers per thread
  std::vector<unsigned int> mma_b;  // 2 registers per thread
  void (*body)(void*) = nullptr;
  void* body_arg = nullptr;
};

inline Block* g_block = nullptr;
inline dim3 g_block_idx;
inline dim3 g_block_dim;
inline dim3 g_grid_dim;

inline Fiber& self() { return g_block->fibers[g_block->current]; }
inline dim3 thread_idx() { return self().thread_idx; }

inline void yield() {
  Fiber& fiber = self();
  swapcontext(&fiber.context, &g_block->scheduler);
}

inline void wait_while(const long* generation, long seen) {
  long spins = 0;
  while (*generation == seen) {
    if (++spins > kMaxSpins) {
      fprintf(stderr, "cuda_cpu_emulator: barrier deadlock (divergent __syncthreads/shuffle)\n");
      abort();
    }
    yield();
  }
}

inline void sync_block() {
  Block& block = *g_block;
  const long seen = block.block_generation;
  if (++block.block_arrived == static_cast<int>(block.fibers.size())) {
    block.block_arrived = 0;
    ++block.block_generation;
    return;
  }
  wait_while(&block.block_generation, seen);
}

inline void sync_warp() {
  Block& block = *g_block;
  const int warp = self().linear / 32;
  const int lanes = std::min(32, static_cast<int>(block.fibers.size()) - warp * 32);
  const long seen = block.warp_generation[warp];
  if (++block.warp_arrived[warp] == lanes) {
    block.warp_arrived[warp] = 0;
    ++block.warp_generation[warp];
    return;
  }
  wait_while(&block.warp_generation[warp], seen);
}

template <typename T>
T shuffle_xor(T value, int lane_mask) {
  static_assert(sizeof(T) <= sizeof(unsigned long long), "shuffle of a value wider than 8 bytes");
  const int me = self().linear;
  unsigned long long slot = 0;
  memcpy(&slot, &value, sizeof(T));
  g_block->shuffle_slots[me] = slot;
  sync_warp();
  const int source = (me & ~31) | ((me & 31) ^ lane_mask);
  const unsigned long long theirs = g_block->shuffle_slots[source];
  sync_warp();
  T result;
  memcpy(&result, &theirs, sizeof(T));
  return result;
}

inline void fiber_entry() {
  g_block->body(g_block->body_arg);
  self().done = true;
}

// Runs `body(arg)` as every thread of every block of the grid.
inline void run_grid(dim3 grid, dim3 block_dim, void (*body)(void*), void* arg) {
  const int num_threads = static_cast<int>(block_dim.x * block_dim.y * block_dim.z);
  std::vector<char> stacks(static_cast<size_t>(num_threads) * kStackBytes);
  g_grid_dim = grid;
  g_block_dim = block_dim;
  for (unsigned int bz = 0; bz < grid.z; ++bz) {
    for (unsigned int by = 0; by < grid.y; ++by) {
      for (unsigned int bx = 0; bx < grid.x; ++bx) {
        Block block;
        block.fibers.resize(num_threads);
        block.warp_arrived.assign((num_threads + 31) / 32, 0);
        block.warp_generation.assign((num_threads + 31) / 32, 0);
        block.shuffle_slots.assign(num_threads, 0);
        block.mma_a.assign(static_cast<size_t>(num_threads) * 4, 0u);
        block.mma_b.assign(static_cast<size_t>(num_threads) * 2, 0u);
        block.body = body;
        block.body_arg = arg;
        g_block = &block;
        g_block_idx = dim3{bx, by, bz};
        for (int t = 0; t < num_threads; ++t) {
          Fiber& fiber = block.fibers[t];
          fiber.linear = t;
          fiber.thread_idx = dim3{t % block_dim.x, (t / block_dim.x) % block_dim.y,
                                  t / (block_dim.x * block_dim.y)};
          getcontext(&fiber.context);
          fiber.context.uc_stack.ss_sp = stacks.data() + static_cast<size_t>(t) * kStackBytes;
          fiber.context.uc_stack.ss_size = kStackBytes;
          fiber.context.uc_link = &block.scheduler;
          makecontext(&fiber.context, fiber_entry, 0);
        }
        int alive = num_threads;
        while (alive > 0) {
          for (int t = 0; t < num_threads; ++t) {
            if (block.fibers[t].done) {
              continue;
            }
            block.current = t;
            swapcontext(&block.scheduler, &block.fibers[t].context);
            if (block.fibers[t].done) {
              --alive;
            }
          }
        }
        g_block = nullptr;
      }
    }
  }
}

template <typename... Args>
struct KernelCall {
  void (*kernel)(Args...);
  void** args;
};

template <typename... Args, size_t... I>
void invoke(void (*kernel)(Args...), void** args, std::index_sequence<I...>) {
  kernel(*reinterpret_cast<std::remove_cv_t<std::remove_reference_t<Args>>*>(args[I])...);
}

template <typename... Args>
void call_body(void* raw) {
  auto* call = static_cast<KernelCall<Args...>*>(raw);
  invoke(call->kernel, call->args, std::index_sequence_for<Args...>{});
}

template <typename... Args>
void launch(void (*kernel)(Args...), const unsigned int* grid, const unsigned int* block,
            void** args) {
  KernelCall<Args...> call{kernel, args};
  run_grid(dim3{grid[0], grid[1], grid[2]}, dim3{block[0], block[1], block[2]},
           &call_body<Args...>, &call);
}

template <typename... Args>
int param_sizes(void (*)(Args...), int* sizes) {
  const int values[] = {static_cast<int>(sizeof(std::remove_cv_t<std::remove_reference_t<Args>>))...};
  for (size_t i = 0; i < sizeof...(Args); ++i) {
    sizes[i] = values[i];
  }
  return static_cast<int>(sizeof...(Args));
}

}  // namespace emu

#define threadIdx (emu::thread_idx())
#define blockIdx (emu::g_block_idx)
#define blockDim (emu::g_block_dim)
#define gridDim (emu::g_grid_dim)
#define __syncthreads() emu::sync_block()
#define __shfl_xor_sync(mask, value, lane_mask) emu::shuffle_xor((value), (lane_mask))
