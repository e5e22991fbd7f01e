// out [M, N] = x [M, K] bf16 times w [N, K] bf16 transposed (+ a float32 bias), every product
// exact and every sum float32: the same numbers as a float32 matmul of the two bf16 tensors
// widened, then rounded once to bf16 (nearest even) or kept in float32. The bf16 dot-product
// instructions (AVX512_BF16) do the work. The CPU worker runs a bf16 model's linears on it
// (faster than oneDNN's bf16 matmul at decode batch sizes, level for prompts:
// benchmarks/results/linears.md), and its LM head with float32 output (logits rounded to bf16
// flip greedy choices).
//
// The weight is packed once (kernels/cpu/bf16_matmul.py): rows padded to a multiple of
// TILE_COLUMNS, then [N / 16][K / 2][16][2], so one 64-byte load holds two consecutive k of
// 16 output columns, the operand layout of vdpbf16ps. K must be even. `out` is contiguous
// [M, N]: the padding columns are computed and never stored.
// Built by kernels/cpu/kernel_loader.py with `cc -O3 -march=native -fopenmp`.

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
// Output of one tile's rows: float32 or bf16, the first `num_columns` columns of the tile.
typedef struct {
    void* out;  // the tile's first output element
    int64_t stride;
    const float* bias;  // the tile's first bias element, or NULL
    int32_t num_columns;
    int32_t bf16;
} TileOutput;

static inline void store(const TileOutput* o, int r, int v, __m512 sums) {
    const int32_t left = o->num_columns - v * VECTOR_COLUMNS;
    if (left <= 0) return;
    const __mmask16 mask = left >= VECTOR_COLUMNS ? 0xFFFF : (__mmask16)((1u << left) - 1);
    if (o->bias != NULL)
        sums = _mm512_add_ps(sums, _mm512_maskz_loadu_ps(mask, o->bias + v * VECTOR_COLUMNS));
    const int64_t offset = r * o->stride + v * VECTOR_COLUMNS;
    if (o->bf16)
        _mm256_mask_storeu_epi16((uint16_t*)o->out + offset, mask,
                                 (__m256i)_mm512_cvtneps_pbh(sums));
    else
        _mm512_mask_storeu_ps((float*)o->out + offset, mask, sums);
}

static inline void tile(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t num_pairs,
                        const TileOutput* o, const int num_rows) {
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
        for (int v = 0; v < TILE_VECTORS; ++v) store(o, r, v, acc[r][v]);
}

static void tile_rows(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t num_pairs,
                      const TileOutput* o, int num_rows) {
    switch (num_rows) {
        case 1: tile(x, x_stride, w, num_pairs, o, 1); break;
        case 2: tile(x, x_stride, w, num_pairs, o, 2); break;
        case 3: tile(x, x_stride, w, num_pairs, o, 3); break;
        case 4: tile(x, x_stride, w, num_pairs, o, 4); break;
        case 5: tile(x, x_stride, w, num_pairs, o, 5); break;
        default: tile(x, x_stride, w, num_pairs, o, TILE_ROWS);
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

// x: contiguous bf16 [rows, k]; packed: the weight as above, `padded_columns` rows of k, of
// which the first `num_columns` are real; bias: float32 [num_columns] or NULL; out: contiguous
// [rows, num_columns], bf16 when `out_bf16`, else float32. Column tiles are split over
// `num_threads` threads.
void bf16_matmul(const uint16_t* x, const uint16_t* packed, const float* bias, void* out,
                 int32_t out_bf16, int64_t rows, int64_t k, int64_t padded_columns,
                 int64_t num_columns, int32_t num_threads) {
#if defined(__AVX512BF16__)
    const int64_t num_pairs = k / 2;
    const int64_t tile_columns = VECTOR_COLUMNS * TILE_VECTORS;
    const int64_t num_tiles = padded_columns / tile_columns;
    const int64_t elem = out_bf16 ? 2 : 4;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
    for (int64_t t = 0; t < num_tiles; ++t) {
        const uint16_t* w = packed + t * TILE_VECTORS * num_pairs * 32;
        const int64_t first_column = t * tile_columns;
        for (int64_t row = 0; row < rows; row += TILE_ROWS) {
            const int num_rows = rows - row < TILE_ROWS ? (int)(rows - row) : TILE_ROWS;
            const int64_t columns_left = num_columns - first_column;
            const TileOutput o = {
                (char*)out + (row * num_columns + first_column) * elem,
                num_columns,
                bias != NULL ? bias + first_column : NULL,
                (int32_t)(columns_left < tile_columns ? columns_left : tile_columns),
                out_bf16,
            };
            tile_rows(x + row * k, k, w, num_pairs, &o, num_rows);
        }
    }
#else
    (void)x, (void)packed, (void)bias, (void)out, (void)out_bf16, (void)rows, (void)k;
    (void)padded_columns, (void)num_columns, (void)num_threads;
#endif
}
