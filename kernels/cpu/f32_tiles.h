// The float32 micro-kernel of f32_matmul.c, shared with gguf_matmul.c (whose prompt-sized
// calls dequantize a panel into this layout and run it): a tile of TILE_ROWS rows of x times one
// panel of PANEL_COLUMNS output columns, packed [k][16] (one 64-byte line per k), its 6 x 2 sums
// kept in 12 AVX2 registers, and how a finished tile is stored. AVX2 + FMA builds without
// AVX-512 only (the includer checks).

#ifndef CPU_F32_TILES_H
#define CPU_F32_TILES_H

#include <immintrin.h>
#include <stdint.h>

#include "scalar_math.h"

#define PANEL_COLUMNS 16
#define TILE_ROWS 6
#define LINE_BYTES 64  // one k of a panel

// Where one tile's rows go: the tile's first output element, the output's row stride, the
// tile's first bias element (or NULL) and how many of the panel's columns are real. With a
// `gate` (the same tile of the gate projection, [rows][PANEL_COLUMNS]; only for whole panels)
// the tile is the up projection and stores silu(gate) * up instead of its sums.
typedef struct {
    float* out;
    int64_t stride;
    const float* bias;
    int32_t num_columns;
    const float* gate;
} TileOutput;

// Lanes of `first_column`..+7 that are below num_columns, as a maskload/maskstore mask.
static inline __m256i column_mask(int32_t num_columns, int32_t first_column) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(num_columns - first_column), lanes);
}

// dst[c] = silu(gate[c]) * up[c] for 8 columns: the same silu, vectorized the same way, as
// fused_ops.c's silu_and_mul, so fusing it here changes no bit.
static inline void store_silu_and_mul(float* dst, const float* gate, __m256 up) {
    float up_values[8];
    _mm256_storeu_ps(up_values, up);
#pragma omp simd
    for (int c = 0; c < 8; ++c) dst[c] = silu(gate[c]) * up_values[c];
}

static inline void store_half(const TileOutput* o, int r, int half, __m256 sums) {
    const int32_t first = half * 8;
    float* dst = o->out + r * o->stride + first;
    if (o->gate != NULL) {
        if (o->bias != NULL) sums = _mm256_add_ps(sums, _mm256_loadu_ps(o->bias + first));
        store_silu_and_mul(dst, o->gate + r * PANEL_COLUMNS + first, sums);
    } else if (o->num_columns >= first + 8) {
        if (o->bias != NULL) sums = _mm256_add_ps(sums, _mm256_loadu_ps(o->bias + first));
        _mm256_storeu_ps(dst, sums);
    } else if (o->num_columns > first) {
        const __m256i mask = column_mask(o->num_columns, first);
        if (o->bias != NULL) sums = _mm256_add_ps(sums, _mm256_maskload_ps(o->bias + first, mask));
        _mm256_maskstore_ps(dst, mask, sums);
    }
}

// A tile's sums, kept in L1 from one pass over k to the next.
typedef struct {
    __m256 lo[TILE_ROWS], hi[TILE_ROWS];
} TileSums;

// k of a panel per pass (at most): 12-16 KiB of it, which stays in L1 while every tile of the
// unit goes through it (a whole panel, 36 KiB at k = 576, does not fit a 32 KiB L1, so each
// tile read it from L2 again).
#define PASS_K 256

// num_rows (a compile-time constant once inlined) rows of x times k in [begin, end) of panel
// `w`, adding to `sums` (each output stays one k-ordered chain of FMAs however k is split
// into passes: the passes change no bit); prefetches `num_prefetch` (<= end - begin) lines
// from `prefetch` on, spread evenly over the k loop: line i * num_prefetch / n at step i of
// n, in 16.16 fixed point (branch-free: a line already asked for costs one load slot). One
// line per step from the start instead (a burst of them) filled the core's miss buffers, and
// the tile's own loads waited behind them: 1.07-1.15x slower at 27 rows on a 2-core AVX2 EPYC.
static inline void tile(const float* x, int64_t x_stride, const float* w, int64_t begin,
                        int64_t end, TileSums* sums, const char* prefetch, int64_t num_prefetch,
                        const int num_rows) {
    __m256 lo[TILE_ROWS], hi[TILE_ROWS];
    // Unrolled before GCC's scalar replacement, so the sums live in registers (without the
    // pragma they are stored to the stack at every k: 3x slower).
#pragma GCC unroll 8
    for (int r = 0; r < num_rows; ++r) {
        lo[r] = sums->lo[r];
        hi[r] = sums->hi[r];
    }
    const int64_t n = end - begin;
    const int64_t last_prefetch = num_prefetch > 0 ? num_prefetch - 1 : 0;
    const int64_t step = n > 0 ? ((num_prefetch << 16) + n - 1) / n : 0;
    for (int64_t i = begin; i < end; ++i) {
        const __m256 w_lo = _mm256_load_ps(w + i * PANEL_COLUMNS);
        const __m256 w_hi = _mm256_load_ps(w + i * PANEL_COLUMNS + 8);
        const int64_t line = ((i - begin) * step) >> 16;
        _mm_prefetch(prefetch + (line < last_prefetch ? line : last_prefetch) * LINE_BYTES,
                     _MM_HINT_T0);
#pragma GCC unroll 8
        for (int r = 0; r < num_rows; ++r) {
            const __m256 xi = _mm256_broadcast_ss(x + r * x_stride + i);
            lo[r] = _mm256_fmadd_ps(xi, w_lo, lo[r]);
            hi[r] = _mm256_fmadd_ps(xi, w_hi, hi[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < num_rows; ++r) {
        sums->lo[r] = lo[r];
        sums->hi[r] = hi[r];
    }
}

static void tile_rows(const float* x, int64_t x_stride, const float* w, int64_t begin,
                      int64_t end, TileSums* sums, const char* prefetch, int64_t num_prefetch,
                      int num_rows) {
    switch (num_rows) {
        case 1: tile(x, x_stride, w, begin, end, sums, prefetch, num_prefetch, 1); break;
        case 2: tile(x, x_stride, w, begin, end, sums, prefetch, num_prefetch, 2); break;
        case 3: tile(x, x_stride, w, begin, end, sums, prefetch, num_prefetch, 3); break;
        case 4: tile(x, x_stride, w, begin, end, sums, prefetch, num_prefetch, 4); break;
        case 5: tile(x, x_stride, w, begin, end, sums, prefetch, num_prefetch, 5); break;
        default: tile(x, x_stride, w, begin, end, sums, prefetch, num_prefetch, TILE_ROWS);
    }
}

// The tile's outputs from its finished sums.
static void store_tile(const TileSums* sums, const TileOutput* o, int num_rows) {
    for (int r = 0; r < num_rows; ++r) {
        store_half(o, r, 0, sums->lo[r]);
        store_half(o, r, 1, sums->hi[r]);
    }
}

#endif
