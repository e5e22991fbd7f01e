// The elementwise parts of a Llama decoder layer on CPU, each one pass over its rows:
// residual add + RMSNorm, NEOX rotary embedding in place, SiLU-and-mul.
//
// Tensors are float32 or bf16 (`bf16` flag); every computation is float32 and a bf16 result
// is rounded once, to nearest even. The residual stream is always float32. Rows are split
// over `num_threads` OpenMP threads (1 = the calling thread only) when a call has at least
// PARALLEL_MIN_ELEMENTS elements: below that, waking a second thread costs more than the op
// (a decode step's ops are a few thousand elements each).
// Built by kernels/cpu/kernel_loader.py with `cc -O3 -march=native -fopenmp`.

#include <math.h>
#include <stdint.h>

#include "scalar_math.h"

#define PARALLEL_MIN_ELEMENTS 65536
#define WORTH_THREADS(num_threads, elements) \
    ((num_threads) > 1 && (elements) >= PARALLEL_MIN_ELEMENTS)

// residual[r] += x[r]; out[r] = weight * residual[r] / sqrt(mean(residual[r]^2) + eps).
static inline void add_rms_norm_row(const void* x, float* restrict residual, const void* weight,
                                    void* out, int64_t cols, float eps, int bf16) {
    float sum_of_squares = 0.0f;
#pragma omp simd reduction(+ : sum_of_squares)
    for (int64_t c = 0; c < cols; ++c) {
        const float value = residual[c] + load_at(x, c, bf16);
        residual[c] = value;
        sum_of_squares += value * value;
    }
    const float inverse_rms = 1.0f / sqrtf(sum_of_squares / (float)cols + eps);
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c)
        store_at(out, c, load_at(weight, c, bf16) * (residual[c] * inverse_rms), bf16);
}

// x, weight and out share a dtype (float32, or bf16 when `bf16`); residual is float32 and is
// updated in place. All are contiguous [rows, cols] (weight [cols]).
void fused_add_rms_norm(const void* x, float* residual, const void* weight, void* out,
                        int32_t bf16, int64_t rows, int64_t cols, float eps,
                        int32_t num_threads) {
    const int64_t elem = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(num_threads) if (WORTH_THREADS(num_threads, rows * cols))
    for (int64_t r = 0; r < rows; ++r) {
        const char* x_row = (const char*)x + r * cols * elem;
        char* out_row = (char*)out + r * cols * elem;
        if (bf16)
            add_rms_norm_row(x_row, residual + r * cols, weight, out_row, cols, eps, 1);
        else
            add_rms_norm_row(x_row, residual + r * cols, weight, out_row, cols, eps, 0);
    }
}

// Rotates the first num_heads heads of one row in place (rotate-half layout: element i pairs
// with i + head_dim / 2), by the angles whose cos and sin are `cos`, `sin` [head_dim / 2].
static inline void rotate_row(void* row, const float* restrict cos, const float* restrict sin,
                              int32_t num_heads, int32_t head_dim, int bf16) {
    const int32_t half = head_dim / 2;
    for (int32_t h = 0; h < num_heads; ++h) {
        const int64_t first = (int64_t)h * head_dim;
#pragma omp simd
        for (int32_t i = 0; i < half; ++i) {
            const float x1 = load_at(row, first + i, bf16);
            const float x2 = load_at(row, first + half + i, bf16);
            store_at(row, first + i, x1 * cos[i] - x2 * sin[i], bf16);
            store_at(row, first + half + i, x2 * cos[i] + x1 * sin[i], bf16);
        }
    }
}

// x: tokens rows of `row_stride` elements whose first num_heads * head_dim elements are
// heads to rotate (q and k side by side at the start of a fused qkv row, say). cos and sin
// are float32 [tokens, head_dim / 2], row t holding token t's angles.
void rotary_embedding_neox(void* x, int32_t bf16, int64_t tokens, int64_t row_stride,
                           int32_t num_heads, int32_t head_dim, const float* cos,
                           const float* sin, int32_t num_threads) {
    const int64_t elem = bf16 ? 2 : 4;
    const int32_t half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) \
    if (WORTH_THREADS(num_threads, tokens * num_heads * head_dim))
    for (int64_t t = 0; t < tokens; ++t) {
        char* row = (char*)x + t * row_stride * elem;
        if (bf16)
            rotate_row(row, cos + t * half, sin + t * half, num_heads, head_dim, 1);
        else
            rotate_row(row, cos + t * half, sin + t * half, num_heads, head_dim, 0);
    }
}

static inline void silu_and_mul_row(const void* x, void* out, int64_t width, int bf16) {
#pragma omp simd
    for (int64_t c = 0; c < width; ++c)
        store_at(out, c, silu(load_at(x, c, bf16)) * load_at(x, width + c, bf16), bf16);
}

// out [rows, width] = silu(x[:, :width]) * x[:, width:] for contiguous x [rows, 2 * width].
void silu_and_mul(const void* x, void* out, int32_t bf16, int64_t rows, int64_t width,
                  int32_t num_threads) {
    const int64_t elem = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(num_threads) if (WORTH_THREADS(num_threads, rows * width))
    for (int64_t r = 0; r < rows; ++r) {
        const char* x_row = (const char*)x + r * 2 * width * elem;
        char* out_row = (char*)out + r * width * elem;
        if (bf16)
            silu_and_mul_row(x_row, out_row, width, 1);
        else
            silu_and_mul_row(x_row, out_row, width, 0);
    }
}
