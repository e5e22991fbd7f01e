// out [M, N] float32 = x [M, K] bf16 times w [N, K] bf16 transposed, every product exact and
// every sum float32: the same numbers as a float32 matmul of the two bf16 tensors widened,
// with half the weight bytes and the bf16 dot-product instructions (AVX512_BF16) doing the
// work. The CPU worker's LM head uses it, so that bf16 models get float32 logits at bf16
// speed (logits rounded to bf16 flip greedy choices; see worker/layers.py).
//
// The weight is packed once (kernels/cpu_bf16_matmul.py): rows padded to a multiple of
// TILE_COLUMNS, then [N / 16][K / 2][16][2], so one 64-byte load holds two consecutive k of
// 16 output columns, the operand layout of vdpbf16ps. K must be even. `out` has the padded
// column count as its row stride.
// Built by kernels/cpu_kernel_loader.py with `cc -O3 -march=native -fopenmp`.

#include <stdint.h>
#include <string.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>

#define VECTOR_COLUMNS 16
#define TILE_VECTORS 4  // output columns per tile: 4 x 16
#define TILE_ROWS 6     // 6 x 4 accumulators + 4 weight vectors + 1 input pair of 32 registers

// The pair x[row][2 * k2], x[row][2 * k2 + 1] in every 32-bit lane.
static inline __m512bh input_pair(const uint16_t* row, int64_t k2) {
    int32_t pair;
    memcpy(&pair, row + 2 * k2, sizeof pair);
    return (__m512bh)_mm512_set1_epi32(pair);
}

// out[r][0:64] for rows r < num_rows (a compile-time constant once inlined) of one tile;
// `w` points at the tile's first packed vector, the next ones are num_pairs * 32 apart.
static inline void tile(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t num_pairs,
                        float* out, int64_t out_stride, const int num_rows) {
    __m512 acc[TILE_ROWS][TILE_VECTORS];
    for (int r = 0; r < num_rows; ++r)
        for (int v = 0; v < TILE_VECTORS; ++v) acc[r][v] = _mm512_setzero_ps();
    for (int64_t k2 = 0; k2 < num_pairs; ++k2) {
        __m512bh weights[TILE_VECTORS];
        for (int v = 0; v < TILE_VECTORS; ++v)
            weights[v] = (__m512bh)_mm512_loadu_si512(w + (v * num_pairs + k2) * 32);
        for (int r = 0; r < num_rows; ++r) {
            const __m512bh pair = input_pair(x + r * x_stride, k2);
            for (int v = 0; v < TILE_VECTORS; ++v)
                acc[r][v] = _mm512_dpbf16_ps(acc[r][v], pair, weights[v]);
        }
    }
    for (int r = 0; r < num_rows; ++r)
        for (int v = 0; v < TILE_VECTORS; ++v)
            _mm512_storeu_ps(out + r * out_stride + v * VECTOR_COLUMNS, acc[r][v]);
}

static void tile_rows(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t num_pairs,
                      float* out, int64_t out_stride, int num_rows) {
    switch (num_rows) {
        case 1: tile(x, x_stride, w, num_pairs, out, out_stride, 1); break;
        case 2: tile(x, x_stride, w, num_pairs, out, out_stride, 2); break;
        case 3: tile(x, x_stride, w, num_pairs, out, out_stride, 3); break;
        case 4: tile(x, x_stride, w, num_pairs, out, out_stride, 4); break;
        case 5: tile(x, x_stride, w, num_pairs, out, out_stride, 5); break;
        default: tile(x, x_stride, w, num_pairs, out, out_stride, TILE_ROWS);
    }
}
#endif

// Output columns per tile: the packed weight's rows are padded to a multiple of this.
int bf16_matmul_tile_columns(void) {
#if defined(__AVX512BF16__)
    return VECTOR_COLUMNS * TILE_VECTORS;
#else
    return 0;  // not built for this CPU: callers use torch
#endif
}

// x: contiguous bf16 [rows, k]; packed: the weight as above, `padded_columns` rows of k;
// out: float32 [rows, padded_columns]. Column tiles are split over `num_threads` threads.
void bf16_matmul_f32_out(const uint16_t* x, const uint16_t* packed, float* out, int64_t rows,
                         int64_t k, int64_t padded_columns, int32_t num_threads) {
#if defined(__AVX512BF16__)
    const int64_t num_pairs = k / 2;
    const int64_t tile_columns = VECTOR_COLUMNS * TILE_VECTORS;
    const int64_t num_tiles = padded_columns / tile_columns;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
    for (int64_t t = 0; t < num_tiles; ++t) {
        const uint16_t* w = packed + t * TILE_VECTORS * num_pairs * 32;
        for (int64_t row = 0; row < rows; row += TILE_ROWS) {
            const int num_rows = rows - row < TILE_ROWS ? (int)(rows - row) : TILE_ROWS;
            tile_rows(x + row * k, k, w, num_pairs, out + row * padded_columns + t * tile_columns,
                      padded_columns, num_rows);
        }
    }
#else
    (void)x, (void)packed, (void)out, (void)rows, (void)k, (void)padded_columns, (void)num_threads;
#endif
}
