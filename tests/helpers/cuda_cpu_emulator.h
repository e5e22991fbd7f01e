// A small CPU emulator of the CUDA execution model, just enough to run kernels/*.cu as host C++.
//
// Blocks run one after another; the threads of a block are fibers on one OS thread (started with
// ucontext, switched with _setjmp/_longjmp, which skips ucontext's signal-mask system call).
// Used only by the tests (tests/cuda_cpu_emulator.py) to check the kernels' logic, argument
// packing and synchronization without a GPU; it says nothing about performance, and memory is
// sequentially consistent (no reordering beyond what the schedule below produces).
//
// Schedule (adversarial, seeded): between two __syncthreads the scheduler picks a random warp and
// runs it alone until all its lanes wait at the next __syncthreads (or exit), then another random
// warp, and so on: every warp "runs ahead" of the others by a whole barrier interval, so a missing
// __syncthreads shows up as a read of data another warp has not written yet (or has already
// overwritten). Inside a warp, lanes run one at a time, in a new random order after every
// warp-synchronous operation (shuffle, MMA, __syncwarp), which all lanes must reach together.
//
// Shared memory: the dynamic array is exactly the launch's shared-memory size, and every
// `__shared__` array exactly its declared size, each filled with 0xFF bytes (NaN as float, half and
// bf16) when a block starts and surrounded by guard bytes (0x7fc1, also NaN) checked when the
// block ends, so reading before writing or past the end yields NaN, and writing past the requested
// size is a reported fault. The harness rewrites each `extern __shared__ T name[];` into a macro
// for the dynamic pointer and each `__shared__ T name[N];` into a macro for a per-block slot (see
// rewrite_shared_declarations in cuda_cpu_emulator.py).
// Faults (guard bytes overwritten, divergent barriers) end the launch with an error message.
#pragma once

// _longjmp between fiber stacks must not go through glibc's __longjmp_chk.
#undef _FORTIFY_SOURCE

#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>

#include <algorithm>
#include <cstddef>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)

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
constexpr size_t kMaxSharedBytes = 256 * 1024;  // dynamic plus static, per block
constexpr size_t kGuardBytes = 4096;            // before the dynamic array, after each static one
constexpr unsigned char kUnwrittenByte = 0xff;  // 0xffff.. is NaN as float, half and bf16
constexpr unsigned char kGuardPattern[2] = {0xc1, 0x7f};  // 0x7fc1: NaN too, and recognizable
constexpr int kExchangeWords = 6;  // per lane: a shuffle value (2) or MMA operands (4 + 2)

enum class State : unsigned char { kReady, kAtWarpSync, kAtBarrier, kExited };

struct Fiber {
  ucontext_t start;
  jmp_buf resume;
  bool started = false;
  dim3 thread_idx;
  int linear = 0;
  State state = State::kReady;
  int exchange_phase = 0;  // which of the two exchange buffers this lane's next exchange uses
};

// splitmix64: small, fast and good enough to shuffle a few dozen warps.
struct Rng {
  unsigned long long state;
  unsigned long long next() {
    unsigned long long z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  int below(int n) { return static_cast<int>(next() % static_cast<unsigned long long>(n)); }
};

struct StaticSlot {
  size_t offset = 0;
  size_t bytes = 0;
};

struct Block {
  std::vector<Fiber> fibers;
  jmp_buf scheduler;
  int current = 0;
  std::vector<unsigned int> exchange[2];  // [thread][kExchangeWords], double-buffered
  std::vector<StaticSlot> static_slots;   // by declaration key; bytes == 0 until first use
  size_t static_used = kGuardBytes;       // end of the last static array's trailing guard
  Rng rng;
  void (*body)(void*) = nullptr;
  void* body_arg = nullptr;
};

inline Block* g_block = nullptr;
inline dim3 g_block_idx;
inline dim3 g_block_dim;
inline dim3 g_grid_dim;
inline unsigned long long g_block_serial = 0;  // counts every block run, for per-block state
inline char g_error[512] = "";

// Dynamic shared memory: [guard][g_dynamic_bytes][guard up to the end of the arena].
alignas(128) inline unsigned char g_dynamic_arena[kGuardBytes + kMaxSharedBytes + kGuardBytes];
inline unsigned char* const g_dynamic_shared = g_dynamic_arena + kGuardBytes;
inline size_t g_dynamic_bytes = 0;
// Static shared memory: [guard][array][guard][array][guard]..., arrays at 128-byte boundaries.
alignas(128) inline unsigned char g_static_arena[2 * kMaxSharedBytes];
inline size_t g_static_dirty = sizeof g_static_arena;  // bytes the previous block may have used

inline bool failed() { return g_error[0] != '\0'; }

inline void fail(const char* format, ...) {
  if (failed()) {
    return;
  }
  va_list args;
  va_start(args, format);
  vsnprintf(g_error, sizeof g_error, format, args);
  va_end(args);
}

inline void fill_guard(unsigned char* begin, unsigned char* end) {
  for (unsigned char* p = begin; p < end; ++p) {
    *p = kGuardPattern[reinterpret_cast<uintptr_t>(p) & 1];
  }
}

// The first overwritten guard byte in [begin, end), or nullptr.
inline const unsigned char* find_damage(const unsigned char* begin, const unsigned char* end) {
  for (const unsigned char* p = begin; p < end; ++p) {
    if (*p != kGuardPattern[reinterpret_cast<uintptr_t>(p) & 1]) {
      return p;
    }
  }
  return nullptr;
}

inline void reset_shared_memory(Block& block) {
  unsigned char* dynamic_end = g_dynamic_shared + g_dynamic_bytes;
  fill_guard(g_dynamic_arena, g_dynamic_shared);
  memset(g_dynamic_shared, kUnwrittenByte, g_dynamic_bytes);
  fill_guard(dynamic_end, g_dynamic_arena + sizeof g_dynamic_arena);
  fill_guard(g_static_arena, g_static_arena + g_static_dirty);
  block.static_used = kGuardBytes;
}

inline void check_shared_memory(const Block& block) {
  const unsigned char* arena_end = g_dynamic_arena + sizeof g_dynamic_arena;
  if (const unsigned char* p = find_damage(g_dynamic_arena, g_dynamic_shared)) {
    fail("shared memory written at byte %td, before the dynamic shared array",
         p - g_dynamic_shared);
    return;
  }
  if (const unsigned char* p = find_damage(g_dynamic_shared + g_dynamic_bytes, arena_end)) {
    fail("shared memory written at byte %td, past the %zu bytes of dynamic shared memory the "
         "launch requested",
         p - g_dynamic_shared, g_dynamic_bytes);
    return;
  }
  // Static arrays in arena order; the gap before each one and after the last is guard.
  std::vector<std::pair<size_t, size_t>> arrays;  // (offset, key)
  for (size_t key = 0; key < block.static_slots.size(); ++key) {
    if (block.static_slots[key].bytes != 0) {
      arrays.emplace_back(block.static_slots[key].offset, key);
    }
  }
  std::sort(arrays.begin(), arrays.end());
  size_t gap_begin = 0;
  for (size_t i = 0; i <= arrays.size(); ++i) {
    const size_t gap_end = i < arrays.size() ? arrays[i].first : block.static_used;
    const unsigned char* gap = g_static_arena + gap_begin;
    if (const unsigned char* p = find_damage(gap, g_static_arena + gap_end)) {
      if (i == 0) {
        fail("shared memory written %td bytes before the first static __shared__ array",
             g_static_arena + gap_end - p);
      } else {
        const StaticSlot& slot = block.static_slots[arrays[i - 1].second];
        fail("shared memory written at byte %td of static __shared__ array #%zu, which has %zu "
             "bytes",
             p - (g_static_arena + slot.offset), arrays[i - 1].second, slot.bytes);
      }
      return;
    }
    if (i < arrays.size()) {
      gap_begin = arrays[i].first + block.static_slots[arrays[i].second].bytes;
    }
  }
}

inline Fiber& self() { return g_block->fibers[g_block->current]; }
inline dim3 thread_idx() { return self().thread_idx; }

// Back to the scheduler; returns when the scheduler resumes this fiber.
inline void suspend(State state) {
  Fiber& fiber = self();
  fiber.state = state;
  if (_setjmp(fiber.resume) == 0) {
    _longjmp(g_block->scheduler, 1);
  }
}

inline void sync_block() { suspend(State::kAtBarrier); }
inline void sync_warp() { suspend(State::kAtWarpSync); }

// Every lane of the calling warp publishes `count` words, then waits for the whole warp. Returns
// the warp's published words ([thread][kExchangeWords], indexed by linear thread id), valid until
// the caller's next exchange: buffers alternate, and a lane can only overwrite a buffer after the
// warp-wide wait of the exchange that follows, which every lane reaches after its reads.
inline const unsigned int* warp_exchange(const unsigned int* words, int count) {
  Fiber& fiber = self();
  unsigned int* slots = g_block->exchange[fiber.exchange_phase].data();
  fiber.exchange_phase ^= 1;
  memcpy(slots + fiber.linear * kExchangeWords, words, sizeof(unsigned int) * count);
  sync_warp();
  return slots;
}

template <typename T>
T shuffle_from(T value, int source_lane) {
  static_assert(sizeof(T) <= 2 * sizeof(unsigned int), "shuffle of a value wider than 8 bytes");
  unsigned int words[2] = {0u, 0u};
  memcpy(words, &value, sizeof(T));
  const int me = self().linear;
  const unsigned int* slots = warp_exchange(words, 2);
  const int lanes = std::min(32, static_cast<int>(g_block->fibers.size()) - (me & ~31));
  const int source = (me & ~31) + ((source_lane % lanes + lanes) % lanes);
  T result;
  memcpy(&result, slots + source * kExchangeWords, sizeof(T));
  return result;
}

template <typename T>
T shuffle_xor(T value, int lane_mask) {
  return shuffle_from(value, (self().linear & 31) ^ lane_mask);
}

template <typename T>
T shuffle_down(T value, unsigned int delta) {
  const int lane = self().linear & 31;
  const int source = lane + static_cast<int>(delta);
  return shuffle_from(value, source < 32 ? source : lane);
}

template <typename T>
T shuffle_up(T value, unsigned int delta) {
  const int lane = self().linear & 31;
  const int source = lane - static_cast<int>(delta);
  return shuffle_from(value, source >= 0 ? source : lane);
}

// The block's instance of the static `__shared__` variable with declaration key `key`.
template <typename T>
T& static_shared(int key) {
  Block& block = *g_block;
  if (static_cast<size_t>(key) >= block.static_slots.size()) {
    block.static_slots.resize(key + 1);
  }
  StaticSlot& slot = block.static_slots[key];
  if (slot.bytes == 0) {
    slot.offset = block.static_used;
    slot.bytes = sizeof(T);
    block.static_used += (sizeof(T) + kGuardBytes + 127) / 128 * 128;
    size_t static_bytes = 0;
    for (const StaticSlot& other : block.static_slots) {
      static_bytes += other.bytes;
    }
    if (static_bytes + g_dynamic_bytes > kMaxSharedBytes) {
      fail("%zu bytes of static plus %zu of dynamic shared memory, above the emulator's %zu",
           static_bytes, g_dynamic_bytes, kMaxSharedBytes);
    }
    if (block.static_used > sizeof g_static_arena) {
      fprintf(stderr, "cuda_cpu_emulator: static __shared__ arrays overflow the arena\n");
      abort();
    }
    memset(g_static_arena + slot.offset, kUnwrittenByte, sizeof(T));
  }
  return *reinterpret_cast<T*>(g_static_arena + slot.offset);
}

[[noreturn]] inline void fiber_entry() {
  g_block->body(g_block->body_arg);
  self().state = State::kExited;
  _longjmp(g_block->scheduler, 1);
}

inline void resume(Block& block, int t) {
  Fiber& fiber = block.fibers[t];
  block.current = t;
  fiber.state = State::kReady;
  if (_setjmp(block.scheduler) == 0) {
    if (!fiber.started) {
      fiber.started = true;
      setcontext(&fiber.start);
    }
    _longjmp(fiber.resume, 1);
  }
}

// Runs warp `w` alone until every lane waits at __syncthreads or has exited. Lanes run one at a
// time in a random order, reshuffled whenever the whole warp meets at a warp-synchronous op.
inline void run_warp(Block& block, int w) {
  const int first = w * 32;
  const int last = std::min(first + 32, static_cast<int>(block.fibers.size()));
  int order[32];
  for (;;) {
    int ready = 0;
    int at_warp_sync = 0;
    for (int t = first; t < last; ++t) {
      const State state = block.fibers[t].state;
      if (state == State::kReady) {
        order[ready++] = t;
      }
      at_warp_sync += state == State::kAtWarpSync;
    }
    if (ready == 0) {
      if (at_warp_sync == 0) {
        return;
      }
      if (at_warp_sync != last - first) {
        fail("warp %d: %d of %d lanes wait at a warp-synchronous operation, the others at "
             "__syncthreads or exited (divergent shuffle / MMA)",
             w, at_warp_sync, last - first);
        return;
      }
      for (int t = first; t < last; ++t) {
        block.fibers[t].state = State::kReady;
      }
      continue;
    }
    for (int i = ready - 1; i > 0; --i) {
      std::swap(order[i], order[block.rng.below(i + 1)]);
    }
    for (int i = 0; i < ready; ++i) {
      resume(block, order[i]);
    }
  }
}

// Runs one block to completion (or to a fault) under the random warp schedule.
inline void run_block(Block& block) {
  const int num_threads = static_cast<int>(block.fibers.size());
  const int num_warps = (num_threads + 31) / 32;
  std::vector<int> runnable;
  for (;;) {
    runnable.clear();
    for (int w = 0; w < num_warps; ++w) {
      for (int t = w * 32; t < std::min((w + 1) * 32, num_threads); ++t) {
        if (block.fibers[t].state == State::kReady) {
          runnable.push_back(w);
          break;
        }
      }
    }
    if (runnable.empty()) {
      int at_barrier = 0;
      int exited = 0;
      for (const Fiber& fiber : block.fibers) {
        at_barrier += fiber.state == State::kAtBarrier;
        exited += fiber.state == State::kExited;
      }
      if (exited == num_threads) {
        return;
      }
      if (at_barrier != num_threads) {
        fail("__syncthreads reached by %d of %d threads, %d exited (divergent barrier)",
             at_barrier, num_threads, exited);
        return;
      }
      for (Fiber& fiber : block.fibers) {
        fiber.state = State::kReady;
      }
      continue;
    }
    run_warp(block, runnable[block.rng.below(static_cast<int>(runnable.size()))]);
    if (failed()) {
      return;
    }
  }
}

inline char* fiber_stacks(size_t bytes) {
  static std::unique_ptr<char[]> stacks;
  static size_t capacity = 0;
  if (bytes > capacity) {
    stacks.reset(new char[bytes]);
    capacity = bytes;
  }
  return stacks.get();
}

// Runs `body(arg)` as every thread of every block of the grid; false (and g_error) on a fault.
inline bool run_grid(dim3 grid, dim3 block_dim, size_t shared_bytes, unsigned long long seed,
                     void (*body)(void*), void* arg) {
  g_error[0] = '\0';
  if (shared_bytes > kMaxSharedBytes) {
    fail("%zu bytes of dynamic shared memory requested, the emulator has %zu", shared_bytes,
         kMaxSharedBytes);
    return false;
  }
  const int num_threads = static_cast<int>(block_dim.x * block_dim.y * block_dim.z);
  char* stacks = fiber_stacks(static_cast<size_t>(num_threads) * kStackBytes);
  g_grid_dim = grid;
  g_block_dim = block_dim;
  g_dynamic_bytes = shared_bytes;
  for (unsigned int bz = 0; bz < grid.z; ++bz) {
    for (unsigned int by = 0; by < grid.y; ++by) {
      for (unsigned int bx = 0; bx < grid.x; ++bx) {
        Block block;
        block.fibers.resize(num_threads);
        block.exchange[0].assign(static_cast<size_t>(num_threads) * kExchangeWords, 0u);
        block.exchange[1].assign(static_cast<size_t>(num_threads) * kExchangeWords, 0u);
        const unsigned long long block_id =
            (static_cast<unsigned long long>(bz) * grid.y + by) * grid.x + bx;
        block.rng.state = seed ^ (block_id * 0xd1342543de82ef95ull);
        block.rng.next();
        block.body = body;
        block.body_arg = arg;
        g_block = &block;
        g_block_idx = dim3{bx, by, bz};
        ++g_block_serial;
        reset_shared_memory(block);
        for (int t = 0; t < num_threads; ++t) {
          Fiber& fiber = block.fibers[t];
          fiber.linear = t;
          fiber.thread_idx = dim3{t % block_dim.x, (t / block_dim.x) % block_dim.y,
                                  t / (block_dim.x * block_dim.y)};
          getcontext(&fiber.start);
          fiber.start.uc_stack.ss_sp = stacks + static_cast<size_t>(t) * kStackBytes;
          fiber.start.uc_stack.ss_size = kStackBytes;
          fiber.start.uc_link = nullptr;
          makecontext(&fiber.start, reinterpret_cast<void (*)()>(fiber_entry), 0);
        }
        run_block(block);
        if (!failed()) {
          check_shared_memory(block);
        }
        g_static_dirty = block.static_used;
        g_block = nullptr;
        if (failed()) {
          const size_t used = strlen(g_error);
          snprintf(g_error + used, sizeof g_error - used, " (block %u,%u,%u)", bx, by, bz);
          return false;
        }
      }
    }
  }
  return true;
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
bool launch(void (*kernel)(Args...), const unsigned int* grid, const unsigned int* block,
            void** args, size_t shared_bytes, unsigned long long seed) {
  KernelCall<Args...> call{kernel, args};
  return run_grid(dim3{grid[0], grid[1], grid[2]}, dim3{block[0], block[1], block[2]},
                  shared_bytes, seed, &call_body<Args...>, &call);
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
#define __syncwarp(...) emu::sync_warp()
// Full-warp forms only (no width argument): a width would not compile, rather than be ignored.
#define __shfl_xor_sync(mask, value, lane_mask) emu::shuffle_xor((value), (lane_mask))
#define __shfl_sync(mask, value, source_lane) emu::shuffle_from((value), (source_lane))
#define __shfl_down_sync(mask, value, delta) emu::shuffle_down((value), (delta))
#define __shfl_up_sync(mask, value, delta) emu::shuffle_up((value), (delta))
