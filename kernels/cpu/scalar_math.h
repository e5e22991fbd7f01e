// Scalar helpers shared by the CPU kernels, written so that GCC and Clang vectorize the loops
// that call them: bf16 <-> float32 conversions, element access to float32-or-bf16 arrays and an
// exp for non-positive arguments.

#ifndef CPU_SCALAR_MATH_H
#define CPU_SCALAR_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

// The float32 whose upper half is the bf16 value `bits` (exact).
static inline float bf16_to_float(uint16_t bits) {
    const uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, sizeof value);
    return value;
}

// `value` rounded to the nearest bf16, ties to even (torch's rounding); NaN stays a quiet NaN.
static inline uint16_t float_to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    return value != value ? (uint16_t)((bits >> 16) | 0x40u) : (uint16_t)rounded;
}

// exp(x) for x <= 0 to about 2 ulp (glibc's expf only vectorizes under -ffast-math, which
// would also drop the IEEE semantics the kernels rely on).
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;  // NaN stays NaN
    // n = round(x / ln 2) by the float-add trick: 1.5 * 2^23 pushes the fraction out.
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = fmaf(n, -0.693359375f, fmaf(n, 2.12194440e-4f, x));
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p * r, r, r + 1.0f);
    const int32_t bits = ((int32_t)n + 127) << 23;
    float two_to_n;
    memcpy(&two_to_n, &bits, sizeof two_to_n);
    return p * two_to_n;
}

// Element i of a float32 or bf16 array; `bf16` is a compile-time constant wherever these are
// inlined, so each loop is specialized and vectorized.
static inline float load_at(const void* base, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t*)base)[i]) : ((const float*)base)[i];
}

static inline void store_at(void* base, int64_t i, float value, int bf16) {
    if (bf16)
        ((uint16_t*)base)[i] = float_to_bf16(value);
    else
        ((float*)base)[i] = value;
}

// x * sigmoid(x), from exp(-|x|) so the exponent never overflows.
static inline float silu(float x) {
    const float e = exp_nonpositive(-fabsf(x));
    const float sigmoid = (x >= 0.0f ? 1.0f : e) / (1.0f + e);
    return x * sigmoid;
}

#endif
