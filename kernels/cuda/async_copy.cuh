// Shared-memory data movement for the tensor-core kernels: asynchronous 16-byte global->shared
// copies (cp.async, sm_80+) and warp-collective 8x8 matrix loads from shared memory (ldmatrix).
//
// Without __CUDA_ARCH__ (the tests' CPU emulator) each wrapper calls a host emulation defined in
// tests/cuda_cpu_emulator_tail.h: ldmatrix is a warp exchange of the row addresses, and a
// cp.async copy lands either when it is issued or only at the cp_async_wait that covers it
// (chosen at random), so reading a destination before waiting sees NaN / stale data.
#pragma once

#include "common.cuh"

// A byte address in shared memory: 32 bits in the .shared window on the GPU (cheaper than a
// generic pointer: one register, no conversion per access), the host pointer in the emulator.
#if defined(__CUDA_ARCH__)
using SharedAddress = unsigned int;
#else
using SharedAddress = unsigned long long;
__host__ __device__ void host_ldmatrix(unsigned int* regs, int num_matrices, bool transpose,
                                       SharedAddress row_address);
__host__ __device__ void host_cp_async_16(SharedAddress dst, const void* src, int src_bytes);
__host__ __device__ void host_cp_async_commit();
__host__ __device__ void host_cp_async_wait(int max_pending_groups);
#endif

__device__ __forceinline__ SharedAddress shared_address(const void* ptr) {
#if defined(__CUDA_ARCH__)
  unsigned int address;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(address) : "l"(ptr));
  return address;
#else
  return reinterpret_cast<SharedAddress>(ptr);
#endif
}

// Copies 16 bytes from global `src` to shared `dst` (both 16-byte aligned) without blocking;
// when `valid` is false nothing is read and `dst` is zero-filled. The copy belongs to the
// thread's open group, closed by cp_async_commit().
__device__ __forceinline__ void cp_async_16(SharedAddress dst, const void* src, bool valid) {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
               :
               : "r"(dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
#else
  host_cp_async_16(dst, src, valid ? 16 : 0);
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.commit_group;" ::: "memory");
#else
  host_cp_async_commit();
#endif
}

// Blocks until at most MAX_PENDING of this thread's committed groups are still in flight. Other
// threads' copies are visible only after a barrier that follows their own wait.
template <int MAX_PENDING>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.wait_group %0;" : : "n"(MAX_PENDING) : "memory");
#else
  host_cp_async_wait(MAX_PENDING);
#endif
}

// ldmatrix.sync.aligned.m8n8.xN{.trans}.shared.b16: lane i gives the (16-byte aligned) address
// of row i % 8 of matrix i / 8; regs[m] receives lane l's fragment of matrix m: row l / 4,
// columns 2 (l % 4) and 2 (l % 4) + 1 (transposed: column l / 4, rows 2 (l % 4) and + 1), the
// lower index in the low half. This is the mma.m16n8k16 A / B fragment layout.
template <bool TRANSPOSE>
__device__ __forceinline__ void ldmatrix_x4(unsigned int (&regs)[4], SharedAddress row_address) {
#if defined(__CUDA_ARCH__)
  if constexpr (TRANSPOSE) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(regs[0]), "=r"(regs[1]), "=r"(regs[2]), "=r"(regs[3])
                 : "r"(row_address));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(regs[0]), "=r"(regs[1]), "=r"(regs[2]), "=r"(regs[3])
                 : "r"(row_address));
  }
#else
  host_ldmatrix(regs, 4, TRANSPOSE, row_address);
#endif
}

template <bool TRANSPOSE>
__device__ __forceinline__ void ldmatrix_x2(unsigned int (&regs)[2], SharedAddress row_address) {
#if defined(__CUDA_ARCH__)
  if constexpr (TRANSPOSE) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];"
                 : "=r"(regs[0]), "=r"(regs[1])
                 : "r"(row_address));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];"
                 : "=r"(regs[0]), "=r"(regs[1])
                 : "r"(row_address));
  }
#else
  host_ldmatrix(regs, 2, TRANSPOSE, row_address);
#endif
}

template <bool TRANSPOSE>
__device__ __forceinline__ void ldmatrix_x1(unsigned int (&regs)[1], SharedAddress row_address) {
#if defined(__CUDA_ARCH__)
  if constexpr (TRANSPOSE) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];"
                 : "=r"(regs[0])
                 : "r"(row_address));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];"
                 : "=r"(regs[0])
                 : "r"(row_address));
  }
#else
  host_ldmatrix(regs, 1, TRANSPOSE, row_address);
#endif
}
