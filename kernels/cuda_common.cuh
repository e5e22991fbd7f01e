// Device helpers shared by the paged-attention kernels.
//
// NVRTC-safe by construction: no host headers (not even cuda_fp16.h / cuda_bf16.h), no INFINITY,
// no printf. Half and bfloat16 are opaque 16-bit storage types converted with PTX `cvt`, so the
// same source compiles under NVRTC (CuPy) and `nvcc -ptx` without any include path.
// The module loader inlines this file into each .cu before compiling.
#pragma once

// Storage-only 16-bit float types: all math happens in fp32.
struct half_t {
  unsigned short bits;
};
struct bf16_t {
  unsigned short bits;
};

// A finite "minus infinity" for masked scores and empty running maxima: exp2f(kNegBig - x) == 0
// for every finite score x, while kNegBig - kNegBig == 0 keeps fully masked rows NaN-free.
constexpr float kNegBig = -1.0e30f;

__device__ __forceinline__ float half_bits_to_float(unsigned short bits) {
  float value;
  asm("cvt.f32.f16 %0, %1;" : "=f"(value) : "h"(bits));
  return value;
}

__device__ __forceinline__ unsigned short float_to_half_bits(float value) {
  unsigned short bits;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(value));
  return bits;
}

__device__ __forceinline__ float bf16_bits_to_float(unsigned short bits) {
  return __uint_as_float(static_cast<unsigned int>(bits) << 16);
}

__device__ __forceinline__ unsigned short float_to_bf16_bits(float value) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  unsigned short bits;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(value));
  return bits;
#else
  // Round to nearest even by hand on architectures without a bf16 cvt; NaN stays a quiet NaN.
  unsigned int u = __float_as_uint(value);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<unsigned short>((u >> 16) | 0x0040u);
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<unsigned short>(u >> 16);
#endif
}

// VecTraits<T>: a 16-byte vector (uint4) of T, unpacked to / packed from fp32.
template <typename T>
struct VecTraits;

template <>
struct VecTraits<float> {
  static constexpr int kElems = 4;
  __device__ __forceinline__ static void unpack(const uint4& raw, float* out) {
    out[0] = __uint_as_float(raw.x);
    out[1] = __uint_as_float(raw.y);
    out[2] = __uint_as_float(raw.z);
    out[3] = __uint_as_float(raw.w);
  }
  __device__ __forceinline__ static void store(float* dst, float value) { *dst = value; }
};

template <>
struct VecTraits<half_t> {
  static constexpr int kElems = 8;
  __device__ __forceinline__ static void unpack(const uint4& raw, float* out) {
    const unsigned int words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = half_bits_to_float(static_cast<unsigned short>(words[i] & 0xffffu));
      out[2 * i + 1] = half_bits_to_float(static_cast<unsigned short>(words[i] >> 16));
    }
  }
  __device__ __forceinline__ static void store(half_t* dst, float value) {
    dst->bits = float_to_half_bits(value);
  }
};

template <>
struct VecTraits<bf16_t> {
  static constexpr int kElems = 8;
  __device__ __forceinline__ static void unpack(const uint4& raw, float* out) {
    const unsigned int words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = __uint_as_float(words[i] << 16);
      out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
    }
  }
  __device__ __forceinline__ static void store(bf16_t* dst, float value) {
    dst->bits = float_to_bf16_bits(value);
  }
};

// Loads the 16 bytes at `ptr` (16-byte aligned: the launcher guarantees it) as floats.
template <typename T>
__device__ __forceinline__ void load_vec(const T* ptr, float* out) {
  const uint4 raw = *reinterpret_cast<const uint4*>(ptr);
  VecTraits<T>::unpack(raw, out);
}

template <typename T>
__device__ __forceinline__ uint4 load_raw(const T* ptr) {
  return *reinterpret_cast<const uint4*>(ptr);
}

// Smallest power of two >= x (x >= 1); used for compile-time lane layouts.
__host__ __device__ constexpr int next_pow2(int x) {
  int p = 1;
  while (p < x) {
    p *= 2;
  }
  return p;
}

// Physical cache slot of logical key position `pos` of a request whose block-table row is
// `block_row`. 64-bit: slot * row_elems can exceed 2^31 for large pools.
__device__ __forceinline__ long long cache_slot(const int* block_row, int pos, int block_size) {
  const int block = block_row[pos / block_size];
  return static_cast<long long>(block) * block_size + (pos % block_size);
}
