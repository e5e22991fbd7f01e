// Device helpers shared by the paged-attention kernels.
//
// NVRTC-safe by construction: no host headers (not even cuda_fp16.h / cuda_bf16.h), no INFINITY,
// no printf. Half and bfloat16 are opaque 16-bit storage types converted with PTX `cvt`, so the
// same source compiles under NVRTC (CuPy) and `nvcc -ptx` without any include path.
// The module loader inlines this file into each .cu before compiling. Without __CUDA_ARCH__
// (the tests' CPU emulator compiles these sources as host C++) conversions run in software.
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
#if defined(__CUDA_ARCH__)
  float value;
  asm("cvt.f32.f16 %0, %1;" : "=f"(value) : "h"(bits));
  return value;
#else
  // Host build (the CPU emulator used by the tests): the same IEEE conversion in software.
  const unsigned int sign = static_cast<unsigned int>(bits & 0x8000u) << 16;
  const unsigned int exponent = (bits >> 10) & 0x1fu;
  const unsigned int mantissa = bits & 0x3ffu;
  if (exponent == 0) {
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-08f;  // 2^-24
    return __uint_as_float(__float_as_uint(magnitude) | sign);
  }
  if (exponent == 31) {
    return __uint_as_float(sign | 0x7f800000u | (mantissa << 13));
  }
  return __uint_as_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
#endif
}

__device__ __forceinline__ unsigned short float_to_half_bits(float value) {
#if defined(__CUDA_ARCH__)
  unsigned short bits;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(value));
  return bits;
#else
  // Host build: round to nearest even, with subnormals, overflow to inf and quiet NaNs.
  const unsigned int x = __float_as_uint(value);
  const unsigned int sign = (x >> 16) & 0x8000u;
  const unsigned int exponent = (x >> 23) & 0xffu;
  const unsigned int mantissa = x & 0x7fffffu;
  if (exponent == 0xffu) {
    return static_cast<unsigned short>(sign | 0x7c00u | (mantissa ? 0x200u : 0u));
  }
  const int half_exponent = static_cast<int>(exponent) - 112;
  if (half_exponent >= 31) {
    return static_cast<unsigned short>(sign | 0x7c00u);
  }
  if (half_exponent <= 0) {
    if (half_exponent < -10) {
      return static_cast<unsigned short>(sign);
    }
    const unsigned int full = mantissa | 0x800000u;
    const int shift = 14 - half_exponent;
    unsigned int rounded = full >> shift;
    const unsigned int rest = full & ((1u << shift) - 1u);
    const unsigned int halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (rounded & 1u))) {
      ++rounded;
    }
    return static_cast<unsigned short>(sign | rounded);
  }
  unsigned int bits = sign | (static_cast<unsigned int>(half_exponent) << 10) | (mantissa >> 13);
  const unsigned int rest = mantissa & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (bits & 1u))) {
    ++bits;  // a carry into the exponent is correct, up to inf
  }
  return static_cast<unsigned short>(bits);
#endif
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
  // Round to nearest even by hand (pre-sm_80 devices, host builds); NaN stays a quiet NaN.
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

#if !defined(__CUDA_ARCH__)
// Host builds only (the tests' CPU emulator defines it): one warp-wide m16n8k16 MMA.
__host__ __device__ void host_mma_m16n8k16(float* d, const unsigned int* a, const unsigned int* b,
                                           bool is_bf16);
#endif

// D += A * B for one warp-wide m16n8k16 tile on tensor cores, fp32 accumulators (sm_80+).
// Fragments follow the PTX ISA layout for mma.m16n8k16 (g = lane / 4, t = lane % 4):
//   a[0] = A[g][2t..2t+1], a[1] = A[g+8][2t..], a[2] = A[g][2t+8..], a[3] = A[g+8][2t+8..]
//   b[0] = B[2t..2t+1][g], b[1] = B[2t+8..2t+9][g]
//   d[0..1] = D[g][2t..2t+1], d[2..3] = D[g+8][2t..2t+1]
// Each 32-bit register holds two 16-bit elements, the lower index in the low half.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const unsigned int (&a)[4],
                                             const unsigned int (&b)[2]);

template <>
__device__ __forceinline__ void mma_m16n8k16<half_t>(float (&d)[4], const unsigned int (&a)[4],
                                                     const unsigned int (&b)[2]) {
#if defined(__CUDA_ARCH__)
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  host_mma_m16n8k16(d, a, b, false);
#endif
}

template <>
__device__ __forceinline__ void mma_m16n8k16<bf16_t>(float (&d)[4], const unsigned int (&a)[4],
                                                     const unsigned int (&b)[2]) {
#if defined(__CUDA_ARCH__)
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  host_mma_m16n8k16(d, a, b, true);
#endif
}

// Two floats rounded to T and packed into one 32-bit MMA operand register (lo in the low half).
template <typename T>
__device__ __forceinline__ unsigned int pack2(float lo, float hi);

template <>
__device__ __forceinline__ unsigned int pack2<half_t>(float lo, float hi) {
  return static_cast<unsigned int>(float_to_half_bits(lo)) |
         (static_cast<unsigned int>(float_to_half_bits(hi)) << 16);
}

template <>
__device__ __forceinline__ unsigned int pack2<bf16_t>(float lo, float hi) {
  return static_cast<unsigned int>(float_to_bf16_bits(lo)) |
         (static_cast<unsigned int>(float_to_bf16_bits(hi)) << 16);
}

// First key the query at position `pos` attends to: with a sliding window of `sliding_window`
// keys (> 0) only keys pos - sliding_window + 1 ..= pos are visible; 0 means no window. Keys
// before it must never be read: a hybrid KV cache may have freed their blocks (null block 0).
__device__ __forceinline__ int window_start(int pos, int sliding_window) {
  return sliding_window > 0 ? max(0, pos - sliding_window + 1) : 0;
}

// Visibility as one unsigned compare: key `key` is visible to the query at position `pos` iff
// key_visible(pos, key, window_span(sliding_window)), i.e. pos - sliding_window < key <= pos
// (0 <= key <= pos without a window). A query with pos < 0 (a padding row) sees nothing.
__device__ __forceinline__ unsigned int window_span(int sliding_window) {
  return sliding_window > 0 ? static_cast<unsigned int>(sliding_window) : 0x80000000u;
}

__device__ __forceinline__ bool key_visible(int pos, int key, unsigned int span) {
  return static_cast<unsigned int>(pos - key) < span;
}

// The arguments every paged-attention kernel (decode_attention[_tc], prefill_attention[_tc])
// takes, written once. Each kernel's parameter list is
//   PAGED_ATTENTION_TENSORS(T), [its own], PAGED_ATTENTION_SHAPE, [its own]
// and the launcher builds the same two runs once (`_Batch.tensor_args`, `_Batch.shape_args` in
// kernels/cuda/backend.py). They stay plain kernel parameters: a struct passed by value measured
// 10-16% slower tensor-core prefill on an H200 (benchmarks/results/gpu/h200_struct_ab_0cca9e3).
#define PAGED_ATTENTION_TENSORS(T)                                                \
  const T* __restrict__ query,            /* [num_tokens, num_heads, HEAD_DIM] */ \
      long long query_token_stride,       /* elements */                          \
      const T* __restrict__ key_cache,    /* [blocks * block_size, kv_heads, D] */ \
      const T* __restrict__ value_cache,  /* same layout as key_cache */          \
      const int* __restrict__ block_table, /* [num_reqs, block_table_stride] */   \
      int block_table_stride,                                                     \
      const int* __restrict__ seq_lens,        /* [num_reqs] */                   \
      const int* __restrict__ query_start_loc, /* [num_reqs + 1] */               \
      T* __restrict__ out,                /* [num_tokens, num_heads, HEAD_DIM] */ \
      long long out_token_stride          /* elements */

#define PAGED_ATTENTION_SHAPE                                                     \
  float scale_log2,        /* softmax scale * log2(e) */                          \
      int sliding_window,  /* keys per query's window; 0 = no window */           \
      int num_kv_heads,                                                           \
      int group_size       /* query heads per kv head */

// The query tile a prefill CTA owns (grid x = query tile, y = request, z = kv_head); shared by
// prefill_attention.cu and prefill_attention_tc.cu. Rows are token_in_tile * group + head.
struct PrefillTile {
  int req;
  int kv_head;
  int q_begin;      // first query token of the request
  int tok0;         // first query token of the tile, within the request
  int context_len;  // cached tokens before the request's query
  int num_rows;     // tokens in the tile * group size
  int kv_begin;     // first key visible to the tile's first token (its window start, or 0)
  int kv_end;       // keys visible to the tile's last token (bottom-right causal)
};

// Fills `tile`; false when this CTA has nothing to do (tile past the query, or a one-token
// query left to the decode kernel). Every key the tile may read lies in [kv_begin, kv_end):
// window starts grow with the position, so the first token's is the tile's lowest. With
// `heavy_first`, blockIdx.x counts tiles from the END of the request's query (x = 0 is the last,
// heaviest causal tile, so it starts first); the tiles themselves are the same.
__device__ __forceinline__ bool find_prefill_tile(const int* query_start_loc, const int* seq_lens,
                                                  int tokens_per_tile, int group_size,
                                                  int skip_single_token_queries, int sliding_window,
                                                  bool heavy_first, PrefillTile* tile) {
  const int req = blockIdx.y;
  const int q_begin = query_start_loc[req];
  const int q_len = query_start_loc[req + 1] - q_begin;
  if (skip_single_token_queries && q_len == 1) {
    return false;
  }
  const int num_tiles = (q_len + tokens_per_tile - 1) / tokens_per_tile;
  const int x = static_cast<int>(blockIdx.x);
  if (x >= num_tiles) {
    return false;
  }
  const int tok0 = (heavy_first ? num_tiles - 1 - x : x) * tokens_per_tile;
  const int num_tokens = min(tokens_per_tile, q_len - tok0);
  tile->req = req;
  tile->kv_head = blockIdx.z;
  tile->q_begin = q_begin;
  tile->tok0 = tok0;
  tile->context_len = seq_lens[req] - q_len;
  tile->num_rows = num_tokens * group_size;
  tile->kv_begin = window_start(tile->context_len + tok0, sliding_window);
  tile->kv_end = tile->context_len + tok0 + num_tokens;
  return true;
}

// ---- Decode helpers (decode_attention.cu) ------------------------------------------------------

// 2^x with the fast MUFU instruction (flush-to-zero: 2^x for x < -126 is 0, as kNegBig needs).
__device__ __forceinline__ float fast_exp2(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return exp2f(x);
#endif
}

// High 32 bits of the 64-bit product a * b.
__device__ __forceinline__ unsigned int mul_hi_u32(unsigned int a, unsigned int b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<unsigned int>((static_cast<unsigned long long>(a) * b) >> 32);
#endif
}
