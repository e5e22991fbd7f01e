// The GGUF block formats the CPU kernels take (ggml's Q4_0, Q4_1, Q8_0, Q4_K and Q6_K): their
// type ids, and each block dequantized to exactly the float32 values ggml (and the gguf
// package) computes, one block at a time into memory or, for the 32-value types on AVX2, into
// four vectors. Shared by gguf_matmul.c's paths; no state.

#ifndef CPU_GGUF_BLOCKS_H
#define CPU_GGUF_BLOCKS_H

#include <stdint.h>
#include <string.h>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// ggml's type ids of the block types taken here.
#define GGML_Q4_0 2
#define GGML_Q4_1 3
#define GGML_Q8_0 8
#define GGML_Q4_K 12
#define GGML_Q6_K 14
#define MAX_BLOCK_ELEMENTS 256

static inline float half_to_float(const uint8_t* bytes) {
    uint16_t h;
    memcpy(&h, bytes, sizeof(h));
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF, bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else {  // subnormal: normalize
        exponent = 113;
        while (!(mantissa & 0x400)) {
            mantissa <<= 1;
            --exponent;
        }
        bits = sign | (exponent << 23) | ((mantissa & 0x3FF) << 13);
    }
    float value;
    memcpy(&value, &bits, sizeof(value));
    return value;
#endif
}

// Each block's 32 or 256 float32 values, in ggml's float order (one multiply, then one add or
// subtract: the kernels are built with -std=c11, which contracts nothing into an FMA).
static inline void dequantize_q4_0(const uint8_t* block, float* y) {
    const float d = half_to_float(block);
    const uint8_t* qs = block + 2;
    for (int j = 0; j < 16; ++j) {
        y[j] = d * (float)((qs[j] & 0x0F) - 8);
        y[j + 16] = d * (float)((qs[j] >> 4) - 8);
    }
}

static inline void dequantize_q4_1(const uint8_t* block, float* y) {
    const float d = half_to_float(block), m = half_to_float(block + 2);
    const uint8_t* qs = block + 4;
    for (int j = 0; j < 16; ++j) {
        y[j] = d * (float)(qs[j] & 0x0F) + m;
        y[j + 16] = d * (float)(qs[j] >> 4) + m;
    }
}

static inline void dequantize_q8_0(const uint8_t* block, float* y) {
    const float d = half_to_float(block);
    const int8_t* qs = (const int8_t*)(block + 2);
    for (int j = 0; j < 32; ++j) y[j] = (float)qs[j] * d;
}

// Sub-block j's 6-bit scale and min of a Q4_K block (ggml's get_scale_min_k4).
static inline void q4_k_scale_min(int j, const uint8_t* q, int* scale, int* min) {
    if (j < 4) {
        *scale = q[j] & 63;
        *min = q[j + 4] & 63;
    } else {
        *scale = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
        *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

static inline void dequantize_q4_k(const uint8_t* block, float* y) {
    const float d = half_to_float(block), dmin = half_to_float(block + 2);
    const uint8_t* scales = block + 4;
    const uint8_t* qs = block + 16;
    for (int i = 0; i < 4; ++i) {  // 32 bytes: sub-blocks 2i (low nibbles) and 2i + 1 (high)
        int scale, min;
        q4_k_scale_min(2 * i, scales, &scale, &min);
        const float d_low = d * (float)scale, m_low = dmin * (float)min;
        q4_k_scale_min(2 * i + 1, scales, &scale, &min);
        const float d_high = d * (float)scale, m_high = dmin * (float)min;
        for (int l = 0; l < 32; ++l) {
            y[64 * i + l] = d_low * (float)(qs[32 * i + l] & 0x0F) - m_low;
            y[64 * i + 32 + l] = d_high * (float)(qs[32 * i + l] >> 4) - m_high;
        }
    }
}

static inline void dequantize_q6_k(const uint8_t* block, float* y) {
    const float d = half_to_float(block + 208);
    const int8_t* scales = (const int8_t*)(block + 192);
    for (int half = 0; half < 2; ++half) {
        const uint8_t* ql = block + 64 * half;
        const uint8_t* qh = block + 128 + 32 * half;
        const int8_t* sc = scales + 8 * half;
        float* out = y + 128 * half;
        for (int l = 0; l < 32; ++l) {
            const int is = l / 16;
            const int q1 = ((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32;
            const int q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32;
            const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            out[l] = (d * (float)sc[is]) * (float)q1;
            out[l + 32] = (d * (float)sc[is + 2]) * (float)q2;
            out[l + 64] = (d * (float)sc[is + 4]) * (float)q3;
            out[l + 96] = (d * (float)sc[is + 6]) * (float)q4;
        }
    }
}

static inline void dequantize_block(int32_t type, const uint8_t* block, float* y) {
    switch (type) {
        case GGML_Q4_0: dequantize_q4_0(block, y); break;
        case GGML_Q4_1: dequantize_q4_1(block, y); break;
        case GGML_Q8_0: dequantize_q8_0(block, y); break;
        case GGML_Q4_K: dequantize_q4_k(block, y); break;
        case GGML_Q6_K: dequantize_q6_k(block, y); break;
        default: memset(y, 0, sizeof(float) * MAX_BLOCK_ELEMENTS);
    }
}


static inline int is_block32(int32_t type) {
    return type == GGML_Q4_0 || type == GGML_Q4_1 || type == GGML_Q8_0;
}

#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 bytes_to_floats(__m128i bytes, int is_signed) {
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
}

// A block of Q4_0, Q4_1 or Q8_0 (32 values) as four vectors of 8 floats, values 0-7, 8-15,
// 16-23 and 24-31: the same values as dequantize_block (one multiply, then one add), made in
// registers.
static inline void block32_vectors(int32_t type, const uint8_t* block, __m256 v[4]) {
    const __m256 d = _mm256_set1_ps(half_to_float(block));
    if (type == GGML_Q8_0) {
        const __m128i low = _mm_loadu_si128((const __m128i*)(block + 2));
        const __m128i high = _mm_loadu_si128((const __m128i*)(block + 18));
        v[0] = _mm256_mul_ps(bytes_to_floats(low, 1), d);
        v[1] = _mm256_mul_ps(bytes_to_floats(_mm_srli_si128(low, 8), 1), d);
        v[2] = _mm256_mul_ps(bytes_to_floats(high, 1), d);
        v[3] = _mm256_mul_ps(bytes_to_floats(_mm_srli_si128(high, 8), 1), d);
        return;
    }
    const int q4_1 = type == GGML_Q4_1;
    const __m128i bytes = _mm_loadu_si128((const __m128i*)(block + (q4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m128i low = _mm_and_si128(bytes, mask);
    __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    if (!q4_1) {  // Q4_0: (q - 8) * d, q - 8 as an integer first, as ggml
        low = _mm_sub_epi8(low, _mm_set1_epi8(8));
        high = _mm_sub_epi8(high, _mm_set1_epi8(8));
    }
    v[0] = _mm256_mul_ps(bytes_to_floats(low, !q4_1), d);
    v[1] = _mm256_mul_ps(bytes_to_floats(_mm_srli_si128(low, 8), !q4_1), d);
    v[2] = _mm256_mul_ps(bytes_to_floats(high, !q4_1), d);
    v[3] = _mm256_mul_ps(bytes_to_floats(_mm_srli_si128(high, 8), !q4_1), d);
    if (q4_1) {
        const __m256 m = _mm256_set1_ps(half_to_float(block + 2));
        for (int j = 0; j < 4; ++j) v[j] = _mm256_add_ps(v[j], m);
    }
}
#endif

#endif
