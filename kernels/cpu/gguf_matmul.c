// out [M, N] = x [M, K] float32 times w [N, K] transposed (+ a float32 bias), with w held as the
// GGUF blocks a file ships (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K; gguf_blocks.h): the linears and LM
// head of a GGUF model under --quantization gguf, never as a dequantized copy. A decode step
// reads every weight once: 4.5 to 8.5 bits of it here instead of 32 (float32) or 16 (bf16).
//
// w is rows of blocks, one row per output column, `k / block_elements` blocks of `block_bytes`
// each (kernels/cpu/gguf_matmul.py keeps a weight as one or more such segments). Four paths:
//
// - The integer path (AVX2 builds; the 32-value types Q4_0, Q4_1, Q8_0; up to INT16_MAX_ROWS
//   rows). x is rounded once per call to 16-bit integers per 32-value block (the block's
//   largest |x| maps to 32767: an error of at most 2^-16 of that value, finer than bf16's
//   2^-9 of every value for all but values under 1/128 of their block's largest), each weight
//   block is widened to 16-bit lanes and vpmaddwd sums the products exactly in 32 bits; one
//   float multiply-add per block applies the weight's and x's scales, and Q4_1's offset m adds
//   m times the block's exact float sum of x. A weight block is read once for every row.
// - The byte path (AVX2 builds; Q4_0, Q4_1 and Q8_0 past INT16_MAX_ROWS rows; gguf_bytes.h): x
//   rounded to 8 bits per block, weights repacked 8 columns at a time once per call, and
//   vpmaddubsw's 16-bit sums, as llama.cpp computes prompts (an error of up to half of 1/127
//   of a block's largest |x| per value, which moves SmolLM2-135M's logprobs by up to ~0.35
//   nats: tests/worker/test_gguf_quantization.py).
// - The float column path (the K-quants at decode sizes, and every call on builds without
//   AVX2): a column's blocks dequantized one at a time into L1, exactly as ggml does, and
//   every row of x (float32) multiplied by it, DECODE_ROWS rows at a time.
// - Panels (AVX2 + FMA builds without AVX-512, calls the others do not take): a panel of 16
//   columns dequantized PASS_K of k at a time into an L1 scratch laid out as f32_matmul's
//   packed panel, and f32_matmul's micro-kernel run over every row tile of a row block; a
//   prompt-sized call dequantizes the whole weight once, for all its row blocks.
//
// Column paths share out units of COLUMN_UNIT columns as work_sharing.h does. Built by
// kernels/cpu/kernel_loader.py with `cc -O3 -march=native -fopenmp`.

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "gguf_blocks.h"
#include "work_sharing.h"

#define DECODE_ROWS 4
#define COLUMN_UNIT 16
// Rows up to which the integer path runs (beyond, panels are faster on AVX2: measured on
// SmolLM2-135M's linears, AMD EPYC Zen 3 with AVX2, benchmarks/results/avx2/gguf_linears.md).
#ifndef INT16_MAX_ROWS
#define INT16_MAX_ROWS 8
#endif

// Values per block of `type`, or 0 for a type not taken here.
int gguf_block_elements(int32_t type) {
    switch (type) {
        case GGML_Q4_0:
        case GGML_Q4_1:
        case GGML_Q8_0: return 32;
        case GGML_Q4_K:
        case GGML_Q6_K: return 256;
        default: return 0;
    }
}

// Bytes per block of `type`, or 0 for a type not taken here.
int gguf_block_bytes(int32_t type) {
    switch (type) {
        case GGML_Q4_0: return 2 + 16;
        case GGML_Q4_1: return 2 + 2 + 16;
        case GGML_Q8_0: return 2 + 32;
        case GGML_Q4_K: return 2 + 2 + 12 + 128;
        case GGML_Q6_K: return 128 + 64 + 16 + 2;
        default: return 0;
    }
}

// One call: x [rows, k] (rows x_stride floats apart), w [num_columns] rows of blocks, out
// [rows, num_columns] with rows out_stride floats apart.
typedef struct {
    const float* x;
    int64_t x_stride;
    const uint8_t* w;
    int32_t type;
    int64_t block_elements, block_bytes, row_bytes;
    const float* bias;
    float* out;
    int64_t out_stride;
    int64_t rows, k, num_columns;
} Call;

static inline float bias_at(const Call* c, int64_t n) { return c->bias != NULL ? c->bias[n] : 0.0f; }

// ---- the float column path: a column's blocks dequantized one at a time -------------------

#if defined(__AVX2__) && defined(__FMA__)
static inline float sum_lanes(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// rows[0..7] (8 floats each) transposed in place: rows[i][j] <-> rows[j][i].
static inline void transpose8(__m256 rows[8]) {
    const __m256 t0 = _mm256_unpacklo_ps(rows[0], rows[1]), t1 = _mm256_unpackhi_ps(rows[0], rows[1]);
    const __m256 t2 = _mm256_unpacklo_ps(rows[2], rows[3]), t3 = _mm256_unpackhi_ps(rows[2], rows[3]);
    const __m256 t4 = _mm256_unpacklo_ps(rows[4], rows[5]), t5 = _mm256_unpackhi_ps(rows[4], rows[5]);
    const __m256 t6 = _mm256_unpacklo_ps(rows[6], rows[7]), t7 = _mm256_unpackhi_ps(rows[6], rows[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    rows[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
    rows[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    rows[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
    rows[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    rows[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
    rows[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    rows[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
    rows[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// Column n of `out` for every row, any block type: each block dequantized into `buffer`, two
// sums per row.
static inline void column_dot(const Call* c, int64_t n, float* buffer, const int num_rows) {
    __m256 sums[DECODE_ROWS][2];
#pragma GCC unroll 4
    for (int r = 0; r < num_rows; ++r) sums[r][0] = sums[r][1] = _mm256_setzero_ps();
    const uint8_t* row = c->w + n * c->row_bytes;
    const int64_t num_blocks = c->k / c->block_elements;
    for (int64_t b = 0; b < num_blocks; ++b) {
        dequantize_block(c->type, row + b * c->block_bytes, buffer);
        const int64_t first = b * c->block_elements;
        for (int64_t i = 0; i < c->block_elements; i += 16) {
            const __m256 w_lo = _mm256_load_ps(buffer + i);
            const __m256 w_hi = _mm256_load_ps(buffer + i + 8);
#pragma GCC unroll 4
            for (int r = 0; r < num_rows; ++r) {
                const float* x = c->x + r * c->x_stride + first + i;
                sums[r][0] = _mm256_fmadd_ps(w_lo, _mm256_loadu_ps(x), sums[r][0]);
                sums[r][1] = _mm256_fmadd_ps(w_hi, _mm256_loadu_ps(x + 8), sums[r][1]);
            }
        }
    }
    const float bias = c->bias != NULL ? c->bias[n] : 0.0f;
#pragma GCC unroll 4
    for (int r = 0; r < num_rows; ++r)
        c->out[r * c->out_stride + n] = sum_lanes(_mm256_add_ps(sums[r][0], sums[r][1])) + bias;
}

#else
static inline void column_dot(const Call* c, int64_t n, float* buffer, const int num_rows) {
    float sums[DECODE_ROWS][8];
    memset(sums, 0, sizeof(sums));
    const uint8_t* row = c->w + n * c->row_bytes;
    const int64_t num_blocks = c->k / c->block_elements;
    for (int64_t b = 0; b < num_blocks; ++b) {
        dequantize_block(c->type, row + b * c->block_bytes, buffer);
        const int64_t first = b * c->block_elements;
        for (int r = 0; r < num_rows; ++r) {
            const float* x = c->x + r * c->x_stride + first;
            for (int64_t i = 0; i < c->block_elements; i += 8)
                for (int lane = 0; lane < 8; ++lane) sums[r][lane] += buffer[i + lane] * x[i + lane];
        }
    }
    const float bias = c->bias != NULL ? c->bias[n] : 0.0f;
    for (int r = 0; r < num_rows; ++r) {
        float total = 0.0f;
        for (int lane = 0; lane < 8; ++lane) total += sums[r][lane];
        c->out[r * c->out_stride + n] = total + bias;
    }
}
#endif

// Columns [first, end) of rows [first_row, first_row + num_rows) (num_rows a compile-time
// constant once inlined, at most DECODE_ROWS).
static inline void float_columns_of_rows(const Call* c, int64_t first, int64_t end,
                                         const int num_rows) {
    float buffer[MAX_BLOCK_ELEMENTS] __attribute__((aligned(64)));
    for (int64_t n = first; n < end; ++n) column_dot(c, n, buffer, num_rows);
}

static void float_columns(const Call* c, int64_t first, int64_t end) {
    for (int64_t row = 0; row < c->rows; row += DECODE_ROWS) {
        Call part = *c;
        part.x = c->x + row * c->x_stride;
        part.out = c->out + row * c->out_stride;
        switch (c->rows - row < DECODE_ROWS ? c->rows - row : DECODE_ROWS) {
            case 1: float_columns_of_rows(&part, first, end, 1); break;
            case 2: float_columns_of_rows(&part, first, end, 2); break;
            case 3: float_columns_of_rows(&part, first, end, 3); break;
            default: float_columns_of_rows(&part, first, end, DECODE_ROWS);
        }
    }
}

// ---- the integer path: x as 16-bit integers per block, vpmaddwd ---------------------------

#if defined(__AVX2__) && defined(__FMA__)
#define INT16_BUILT 1
#define INT16_LIMIT 32767.0f

// x rounded for the integer path: per row and 32-value block, `values` round(x / scale) with
// scale = the block's largest |x| / 32767 (0 for a block of zeros), and `scale_sums` the pair
// (scale, the block's float sum of x).
typedef struct {
    int16_t* values;    // [rows][k]
    float* scale_sums;  // [rows][k / 32][2]
    float* scales;      // [rows][k / 32]: the pairs' first halves, 8 blocks' in one load
} RoundedX;

static inline float max_lanes(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// A 32-value block of x (at `x`) rounded to integers, its largest |x| mapping to `limit`:
// `q` the values as four vectors of int32 (values 0-7, 8-15, 16-23, 24-31); returns the
// block's largest |x|, and its float sum in `sum`. Shared by the integer and byte paths.
static inline __attribute__((always_inline)) float round_block_words(const float* x,
                                                                    const float limit,
                                                                    __m256i q[4], float* sum) {
    __m256 v[4], largest = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int j = 0; j < 4; ++j) {
        v[j] = _mm256_loadu_ps(x + 8 * j);
        largest = _mm256_max_ps(largest, _mm256_andnot_ps(sign, v[j]));
    }
    const float amax = max_lanes(largest);
    const __m256 inverse = _mm256_set1_ps(amax > 0.0f ? limit / amax : 0.0f);
    for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inverse));
    *sum = sum_lanes(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
    return amax;
}

static void round_block(const float* x, int16_t* values, float* scale_sum) {
    __m256i q[4];
    const float amax = round_block_words(x, INT16_LIMIT, q, &scale_sum[1]);
    // packs interleaves 128-bit lanes: [q0 lo, q1 lo, q0 hi, q1 hi]; the permute restores order.
    const __m256i low = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8);
    const __m256i high = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8);
    _mm256_storeu_si256((__m256i*)values, low);
    _mm256_storeu_si256((__m256i*)(values + 16), high);
    scale_sum[0] = amax / INT16_LIMIT;
}

// x of `c` rounded into `r` (allocated by the caller: rows * k values, rows * k / 16 floats).
static void round_x(const Call* c, RoundedX* r) {
    const int64_t num_blocks = c->k / 32;
    for (int64_t row = 0; row < c->rows; ++row)
        for (int64_t b = 0; b < num_blocks; ++b) {
            const int64_t at = row * num_blocks + b;
            round_block(c->x + row * c->x_stride + 32 * b, r->values + row * c->k + 32 * b,
                        r->scale_sums + 2 * at);
            r->scales[at] = r->scale_sums[2 * at];
        }
}

// A block of a 32-value type as 16-bit lanes: w[0] values 0-15, w[1] values 16-31 (Q4_0's
// q - 8, Q4_1's q, Q8_0's signed q).
static inline __attribute__((always_inline)) void block_words(const int type, const uint8_t* block, __m256i w[2]) {
    if (type == GGML_Q8_0) {
        w[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(block + 2)));
        w[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(block + 18)));
        return;
    }
    const __m128i bytes = _mm_loadu_si128((const __m128i*)(block + (type == GGML_Q4_1 ? 4 : 2)));
    const __m256i words = _mm256_cvtepu8_epi16(bytes);
    w[0] = _mm256_and_si256(words, _mm256_set1_epi16(0x0F));
    w[1] = _mm256_srli_epi16(words, 4);
    if (type == GGML_Q4_0) {
        w[0] = _mm256_sub_epi16(w[0], _mm256_set1_epi16(8));
        w[1] = _mm256_sub_epi16(w[1], _mm256_set1_epi16(8));
    }
}

// A block's scales as float lanes [d, m, 0, 0] (Q4_1) or [d, 0, 0, 0].
static inline __m128 block_scales(const int type, const uint8_t* block) {
    uint32_t halves = 0;
    memcpy(&halves, block, type == GGML_Q4_1 ? 4 : 2);
    return _mm_cvtph_ps(_mm_cvtsi32_si128((int)halves));
}

// Columns [n, n + num_cols) for rows [row, row + num_rows) (both compile-time constants once
// inlined; num_cols * num_rows <= 8 sums): per block and row one float multiply-add of the
// integer sums, d * scale(x) folded; Q4_1 adds m * sum(x) into the sums' lane 1.
static inline __attribute__((always_inline)) void int16_columns(const int type, const Call* c, const RoundedX* r, int64_t n,
                                 int64_t row, const int num_rows, const int num_cols) {
    __m256 sums[4][4];
#pragma GCC unroll 4
    for (int j = 0; j < num_cols; ++j)
#pragma GCC unroll 4
        for (int i = 0; i < num_rows; ++i) sums[j][i] = _mm256_setzero_ps();
    const int64_t num_blocks = c->k / 32, block_bytes = c->block_bytes;
    const uint8_t* w = c->w + n * c->row_bytes;
    const int64_t ahead = 2 * num_cols * c->row_bytes;  // the group of columns after next
    for (int64_t b = 0; b < num_blocks; ++b) {
#pragma GCC unroll 4
        for (int j = 0; j < num_cols; ++j) {
            const uint8_t* block = w + j * c->row_bytes + b * block_bytes;
            _mm_prefetch((const char*)(block + ahead), _MM_HINT_T0);
            __m256i words[2];
            block_words(type, block, words);
            const __m128 scales = block_scales(type, block);
#pragma GCC unroll 4
            for (int i = 0; i < num_rows; ++i) {
                const int16_t* xq = r->values + (row + i) * c->k + 32 * b;
                const __m256i products = _mm256_add_epi32(
                    _mm256_madd_epi16(words[0], _mm256_loadu_si256((const __m256i*)xq)),
                    _mm256_madd_epi16(words[1], _mm256_loadu_si256((const __m256i*)(xq + 16))));
                const float* pair = r->scale_sums + 2 * ((row + i) * num_blocks + b);
                const __m128 both = _mm_mul_ps(scales, _mm_castpd_ps(_mm_load_sd((const double*)pair)));
                sums[j][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(products),
                                             _mm256_broadcastss_ps(both), sums[j][i]);
                if (type == GGML_Q4_1)
                    sums[j][i] = _mm256_add_ps(
                        sums[j][i],
                        _mm256_blend_ps(_mm256_setzero_ps(), _mm256_castps128_ps256(both), 0x02));
            }
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < num_cols; ++j)
#pragma GCC unroll 4
        for (int i = 0; i < num_rows; ++i)
            c->out[(row + i) * c->out_stride + n + j] = sum_lanes(sums[j][i]) + bias_at(c, n + j);
}

// ---- the integer path at one row: scales applied once per 8 blocks ------------------------
//
// At batch 1 the per-block float work (convert, broadcast, scale, multiply-add) costs more than
// a Q8_0 block's integer products. Here the 8 blocks of a group keep their exact int32 sums,
// reduced to one vector of 8 block totals (lane t: block t), which one convert and one
// multiply-add scale by the 8 blocks' d * scale(x): the same terms as int16_columns, summed in
// another order. Taken for Q8_0 only (an LM head such as SmolLM2's tied embedding, 1.5x
// int16_columns' speed at one row); for Q4_0 and Q4_1, whose nibbles cost more to widen, and
// whose m would need a second gather, it measured no faster (AMD EPYC Zen 3, AVX2), so the
// code below has no m term.

#define GROUP_BLOCKS 8

// The exact int32 products of one block of `type` (at `block`) with 32 rounded values of x.
static inline __attribute__((always_inline)) __m256i block_products(const int type,
                                                                   const uint8_t* block,
                                                                   const int16_t* xq) {
    __m256i words[2];
    block_words(type, block, words);
    return _mm256_add_epi32(
        _mm256_madd_epi16(words[0], _mm256_loadu_si256((const __m256i*)xq)),
        _mm256_madd_epi16(words[1], _mm256_loadu_si256((const __m256i*)(xq + 16))));
}

// Lanes [a0+..+a3, b0+..+b3, c.., d.. | a4+..+a7, b.., c.., d..]: four blocks' products
// reduced to one vector, two halves per block.
static inline __m256i four_totals(__m256i a, __m256i b, __m256i c, __m256i d) {
    return _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
}

// The scale d (the float16 each block starts with) of 8 consecutive blocks, as float lanes.
static inline __m256 group_scales(const uint8_t* first_block, int64_t block_bytes) {
    __m128i halves = _mm_setzero_si128();
#define HALF_AT(t) \
    halves = _mm_insert_epi16(halves, *(const uint16_t*)(first_block + (t) * block_bytes), t)
    HALF_AT(0); HALF_AT(1); HALF_AT(2); HALF_AT(3); HALF_AT(4); HALF_AT(5); HALF_AT(6); HALF_AT(7);
#undef HALF_AT
    return _mm256_cvtph_ps(halves);
}

// A block's contribution to one row's sum, as int16_columns computes it (d times scale(x)
// times the integer sum; the blocks past the last whole group).
static inline float block_term(const int type, const RoundedX* r, const uint8_t* block,
                               const int16_t* xq, int64_t at) {
    const __m256i products = block_products(type, block, xq);
    const __m128 scales = block_scales(type, block);
    return sum_lanes(_mm256_cvtepi32_ps(products)) * _mm_cvtss_f32(scales) * r->scales[at];
}

// Column n of one row (`row`).
static inline __attribute__((always_inline)) void int16_column_grouped(const int type,
                                                                      const Call* c,
                                                                      const RoundedX* r,
                                                                      int64_t n, int64_t row) {
    const int64_t num_blocks = c->k / 32, block_bytes = c->block_bytes;
    const uint8_t* w = c->w + n * c->row_bytes;
    const int16_t* x = r->values + row * c->k;
    const float* x_scales = r->scales + row * num_blocks;
    const int64_t ahead = 4 * c->row_bytes;  // four columns ahead
    __m256 sum = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + GROUP_BLOCKS <= num_blocks; b += GROUP_BLOCKS) {
        const uint8_t* first = w + b * block_bytes;
        for (int64_t line = 0; line < GROUP_BLOCKS * block_bytes; line += 64)
            _mm_prefetch((const char*)(first + ahead + line), _MM_HINT_T0);
        const int16_t* xq = x + 32 * b;
        const __m256i low = four_totals(
            block_products(type, first, xq), block_products(type, first + block_bytes, xq + 32),
            block_products(type, first + 2 * block_bytes, xq + 64),
            block_products(type, first + 3 * block_bytes, xq + 96));
        const __m256i high = four_totals(
            block_products(type, first + 4 * block_bytes, xq + 128),
            block_products(type, first + 5 * block_bytes, xq + 160),
            block_products(type, first + 6 * block_bytes, xq + 192),
            block_products(type, first + 7 * block_bytes, xq + 224));
        // Lane t: block t's total (the halves of low and high, added across 128-bit lanes).
        const __m256i totals = _mm256_add_epi32(_mm256_permute2x128_si256(low, high, 0x20),
                                                _mm256_permute2x128_si256(low, high, 0x31));
        const __m256 scale =
            _mm256_mul_ps(group_scales(first, block_bytes), _mm256_loadu_ps(x_scales + b));
        sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(totals), scale, sum);
    }
    float tail = 0.0f;
    for (; b < num_blocks; ++b)
        tail += block_term(type, r, w + b * block_bytes, x + 32 * b, row * num_blocks + b);
    c->out[row * c->out_stride + n] = sum_lanes(sum) + tail + bias_at(c, n);
}

// Columns [first, end) of rows [row, row + num_rows): Q8_0 at one row a column at a time,
// scaled per group of blocks; otherwise four columns a pass at one or two rows, two at three
// or four, the last ones singly.
static inline __attribute__((always_inline)) void int16_rows(const int type, const Call* c, const RoundedX* r, int64_t first,
                              int64_t end, int64_t row, const int num_rows) {
    int64_t n = first;
    if (type == GGML_Q8_0 && num_rows == 1) {
        for (; n < end; ++n) int16_column_grouped(type, c, r, n, row);
        return;
    }
    const int width = num_rows <= 2 ? 4 : 2;
    for (; n + width <= end; n += width) int16_columns(type, c, r, n, row, num_rows, width);
    for (; n < end; ++n) int16_columns(type, c, r, n, row, num_rows, 1);
}

static inline void int16_unit_of_type(const int type, const Call* c, const RoundedX* r,
                                      int64_t first, int64_t end) {
    for (int64_t row = 0; row < c->rows; row += DECODE_ROWS) {
        switch (c->rows - row < DECODE_ROWS ? c->rows - row : DECODE_ROWS) {
            case 1: int16_rows(type, c, r, first, end, row, 1); break;
            case 2: int16_rows(type, c, r, first, end, row, 2); break;
            case 3: int16_rows(type, c, r, first, end, row, 3); break;
            default: int16_rows(type, c, r, first, end, row, DECODE_ROWS);
        }
    }
}

static void int16_columns_unit(const Call* c, const RoundedX* r, int64_t first, int64_t end) {
    switch (c->type) {
        case GGML_Q4_0: int16_unit_of_type(GGML_Q4_0, c, r, first, end); break;
        case GGML_Q4_1: int16_unit_of_type(GGML_Q4_1, c, r, first, end); break;
        default: int16_unit_of_type(GGML_Q8_0, c, r, first, end);
    }
}
#endif

// ---- calls of more rows on Q4_0, Q4_1, Q8_0: x as bytes, vpmaddubsw (gguf_bytes.h) ----------

#if defined(INT16_BUILT)
#define BYTES_BUILT 1
#include "gguf_bytes.h"
#endif

// ---- the column paths' threads: runs of COLUMN_UNIT columns (work_sharing.h) ---------------

// Columns [first, end) of every row, on the integer path when `rounded` is not NULL.
static void columns_unit(const Call* c, const void* rounded, int64_t first, int64_t end) {
#if defined(INT16_BUILT)
    if (rounded != NULL) {
        int16_columns_unit(c, (const RoundedX*)rounded, first, end);
        return;
    }
#endif
    (void)rounded;
    float_columns(c, first, end);
}

static void take_column_units(const Call* c, const void* rounded, RunClaims* claims, int parts,
                              int run, int from_front) {
    const int64_t num_units = (c->num_columns + COLUMN_UNIT - 1) / COLUMN_UNIT;
    const int64_t first_unit = num_units * run / parts;
    const int64_t size = num_units * (run + 1) / parts - first_unit;
    for (int64_t i; (i = claim(&claims[run], size, from_front)) >= 0;) {
        const int64_t first = (first_unit + i) * COLUMN_UNIT;
        const int64_t end = first + COLUMN_UNIT < c->num_columns ? first + COLUMN_UNIT
                                                                 : c->num_columns;
        columns_unit(c, rounded, first, end);
    }
}

static void run_columns(const Call* c, const void* rounded, int32_t num_threads) {
    const int32_t slots = num_threads > 1 ? num_threads : 1;
    RunClaims runs[slots];
    init_claims(runs, slots);
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        const int parts = omp_get_num_threads(), part = omp_get_thread_num();
        take_column_units(c, rounded, runs, parts, part, 1);
        for (int other = 1; other < parts; ++other)
            take_column_units(c, rounded, runs, parts, (part + other) % parts, 0);
    }
}

// ---- larger calls: panels dequantized for f32_matmul's micro-kernel ------------------------

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define GGUF_PANELS_BUILT 1
#include "f32_tiles.h"

// x rows of one row block (as f32_matmul: at most ~192 KiB of x, and at most 64 tiles).
#define ROW_BLOCK_BYTES (192 * 1024)
#define MAX_BLOCK_TILES 64

// One block of column `column` (< num_columns) at k = `at`, dequantized into `dst`.
static inline void dequantize_column_block(const Call* c, int64_t column, int64_t at, float* dst) {
    const uint8_t* block = c->w + column * c->row_bytes + at / c->block_elements * c->block_bytes;
    if (is_block32(c->type)) {
        __m256 v[4];
        block32_vectors(c->type, block, v);
        for (int j = 0; j < 4; ++j) _mm256_store_ps(dst + 8 * j, v[j]);
    } else {
        dequantize_block(c->type, block, dst);
    }
}

// Columns [first_column, first_column + 16) of w for k in [begin, end), dequantized into
// `panel` [end - begin][16]; columns past num_columns are zeros. Eight columns at a time, one
// block each into `columns` [8][block], then transposed 8 x 8 into the panel's rows.
static void dequantize_panel(const Call* c, int64_t first_column, int64_t begin, int64_t end,
                             float* panel) {
    float columns[8 * MAX_BLOCK_ELEMENTS] __attribute__((aligned(64)));
    const int64_t e = c->block_elements;
    for (int64_t group = 0; group < PANEL_COLUMNS; group += 8) {
        const int64_t first = first_column + group;
        const int64_t num_real = c->num_columns - first < 8 ? c->num_columns - first : 8;
        if (num_real < 8) memset(columns, 0, sizeof(float) * 8 * e);
        for (int64_t at = begin; at < end; at += e) {
            for (int64_t col = 0; col < num_real; ++col)
                dequantize_column_block(c, first + col, at, columns + col * e);
            for (int64_t i = 0; i < e; i += 8) {
                __m256 rows[8];
                for (int r = 0; r < 8; ++r) rows[r] = _mm256_load_ps(columns + r * e + i);
                transpose8(rows);
                float* dst = panel + (at - begin + i) * PANEL_COLUMNS + group;
                for (int r = 0; r < 8; ++r) _mm256_store_ps(dst + r * PANEL_COLUMNS, rows[r]);
            }
        }
    }
}

// Asks for the blocks of columns [first_column, first_column + 16) that hold k in [begin, end),
// so that the next pass's dequantization finds them in cache while this pass's tiles run:
// sixteen interleaved rows of blocks are more streams than the hardware prefetcher follows.
// SmolLM2-135M's Q4_1 linears, 30 layers, 2 threads, AMD EPYC Zen 3 with AVX2, best of 12
// alternating runs: 98 against 114 ms at 64 rows, 194 against 209 ms at 128; at 256 rows
// (421 against 416) no different.
static inline void prefetch_panel_blocks(const Call* c, int64_t first_column, int64_t begin,
                                         int64_t end) {
    const int64_t columns_left = c->num_columns - first_column;
    const int64_t columns = columns_left < PANEL_COLUMNS ? columns_left : PANEL_COLUMNS;
    const int64_t first_byte = begin / c->block_elements * c->block_bytes / 64 * 64;
    const int64_t end_byte = end / c->block_elements * c->block_bytes;
    for (int64_t col = 0; col < columns; ++col) {
        const char* row = (const char*)(c->w + (first_column + col) * c->row_bytes);
        for (int64_t at = first_byte; at < end_byte; at += 64) _mm_prefetch(row + at, _MM_HINT_T0);
    }
}

// Row tiles [first_tile, end_tile) of `num_tiles` over the rows, times panel `panel`: from
// `dequantized` (the whole panel, [k][16]) when not NULL, else dequantized PASS_K of k at a
// time into an L1 scratch.
static void panel_unit(const Call* c, int64_t panel, int64_t first_tile, int64_t end_tile,
                       int64_t num_tiles, const float* dequantized) {
    float scratch[PASS_K * PANEL_COLUMNS] __attribute__((aligned(64)));
    const int64_t first_column = panel * PANEL_COLUMNS;
    TileSums sums[end_tile - first_tile];
    memset(sums, 0, sizeof(sums));
    for (int64_t begin = 0; begin < c->k; begin += PASS_K) {
        const int64_t end = begin + PASS_K < c->k ? begin + PASS_K : c->k;
        const float* w = dequantized;  // indexed by k from 0
        if (w == NULL) {
            dequantize_panel(c, first_column, begin, end, scratch);
            w = scratch - begin * PANEL_COLUMNS;
            if (end < c->k)  // the next pass's blocks, else the next panel's first
                prefetch_panel_blocks(c, first_column, end, end + PASS_K < c->k ? end + PASS_K : c->k);
            else if (first_column + PANEL_COLUMNS < c->num_columns)
                prefetch_panel_blocks(c, first_column + PANEL_COLUMNS, 0, PASS_K < c->k ? PASS_K : c->k);
        }
        for (int64_t t = first_tile; t < end_tile; ++t) {
            const int64_t row = c->rows * t / num_tiles;
            const int num_rows = (int)(c->rows * (t + 1) / num_tiles - row);
            tile_rows(c->x + row * c->x_stride, c->x_stride, w, begin, end,
                      &sums[t - first_tile], (const char*)w, 0, num_rows);
        }
    }
    const int64_t columns_left = c->num_columns - first_column;
    for (int64_t t = first_tile; t < end_tile; ++t) {
        const int64_t row = c->rows * t / num_tiles;
        const TileOutput o = {
            c->out + row * c->out_stride + first_column,
            c->out_stride,
            c->bias != NULL ? c->bias + first_column : NULL,
            (int32_t)(columns_left < PANEL_COLUMNS ? columns_left : PANEL_COLUMNS),
            NULL,
        };
        store_tile(&sums[t - first_tile], &o, (int)(c->rows * (t + 1) / num_tiles - row));
    }
}

// Calls of at least WHOLE_WEIGHT_MIN_BLOCKS row blocks (prompt-sized: 8 blocks are ~620 rows
// at k = 576) dequantize each panel once, into a whole-weight scratch in the f32 kernel's
// packed layout, instead of once per row block, when the scratch takes at most
// WHOLE_WEIGHT_BYTES. SmolLM2-135M's Q4_1 linears at 1024 rows, 4 layers, 2 threads, AMD
// EPYC Zen 3 with AVX2: 174 ms against 190 (the best of 16 alternating runs each, a VM whose
// speed drifts by 20%); at 256 rows (4 blocks at k = 576) the scratch, read from L3 by every
// block, was no faster than dequantizing into L1 per block.
#define WHOLE_WEIGHT_MIN_BLOCKS 8
#define WHOLE_WEIGHT_BYTES (32 << 20)

static void run_panels(const Call* c, int32_t num_threads) {
    const int64_t num_tiles = (c->rows + TILE_ROWS - 1) / TILE_ROWS;
    const int64_t tile_bytes = TILE_ROWS * c->k * (int64_t)sizeof(float);
    const int64_t fitting = tile_bytes < ROW_BLOCK_BYTES ? ROW_BLOCK_BYTES / tile_bytes : 1;
    const int64_t block_tiles = fitting < MAX_BLOCK_TILES ? fitting : MAX_BLOCK_TILES;
    const int64_t num_blocks = (num_tiles + block_tiles - 1) / block_tiles;
    const int64_t num_panels = (c->num_columns + PANEL_COLUMNS - 1) / PANEL_COLUMNS;
    const int64_t panel_floats = c->k * PANEL_COLUMNS;
    const int64_t whole_bytes = num_panels * panel_floats * (int64_t)sizeof(float);
    float* whole =
        num_blocks >= WHOLE_WEIGHT_MIN_BLOCKS && whole_bytes <= WHOLE_WEIGHT_BYTES
            ? aligned_alloc(64, whole_bytes)
            : NULL;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        if (whole != NULL) {
#pragma omp for schedule(static)
            for (int64_t panel = 0; panel < num_panels; ++panel)
                dequantize_panel(c, panel * PANEL_COLUMNS, 0, c->k, whole + panel * panel_floats);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t unit = 0; unit < num_blocks * num_panels; ++unit) {
            const int64_t block = unit / num_panels, panel = unit % num_panels;
            const int64_t first_tile = block * block_tiles;
            const int64_t end_tile =
                first_tile + block_tiles < num_tiles ? first_tile + block_tiles : num_tiles;
            panel_unit(c, panel, first_tile, end_tile, num_tiles,
                       whole != NULL ? whole + panel * panel_floats : NULL);
        }
    }
    free(whole);
}
#endif

// Whether calls the integer path does not take, of more than DECODE_ROWS rows, dequantize
// panels for f32_matmul's micro-kernel (1), or go column by column (0).
int gguf_matmul_has_panels(void) {
#if defined(GGUF_PANELS_BUILT)
    return 1;
#else
    return 0;
#endif
}

// Bits x is rounded to on the integer path (16), or 0 where it is not built; and the most rows
// it takes.
int gguf_matmul_integer_bits(void) {
#if defined(INT16_BUILT)
    return 16;
#else
    return 0;
#endif
}

int gguf_matmul_integer_max_rows(void) { return INT16_MAX_ROWS; }

// Bits x is rounded to on the byte path (8: Q4_0, Q4_1 and Q8_0 calls of more than
// INT16_MAX_ROWS rows), or 0 where it is not built.
int gguf_matmul_byte_bits(void) {
#if defined(BYTES_BUILT)
    return 8;
#else
    return 0;
#endif
}

#if defined(INT16_BUILT)
// `c` on the integer path: x rounded once, then the column units shared.
static void run_integer(const Call* c, int32_t num_threads) {
    const int64_t num_values = c->rows * c->k;
    const size_t scale_bytes = (sizeof(float) * num_values / 32 + 63) / 64 * 64;
    RoundedX r = {
        .values = aligned_alloc(64, (sizeof(int16_t) * num_values + 63) / 64 * 64),
        .scale_sums = aligned_alloc(64, 2 * scale_bytes),
        .scales = aligned_alloc(64, scale_bytes),
    };
    if (r.values == NULL || r.scale_sums == NULL || r.scales == NULL) {
        // out of memory: the float path needs none
        free(r.values), free(r.scale_sums), free(r.scales);
        run_columns(c, NULL, num_threads);
        return;
    }
    round_x(c, &r);
    run_columns(c, &r, num_threads);
    free(r.values), free(r.scale_sums), free(r.scales);
}
#endif

// x: float32 [rows, k], rows x_stride floats apart, unit column stride; w: num_columns rows of
// k / gguf_block_elements(type) blocks of `type`; bias: float32 [num_columns] or NULL; out:
// float32 [rows, num_columns], rows out_stride floats apart. k must be a multiple of the block
// elements and `type` one of those above (the Python side checks both). Shared by
// `num_threads` threads.
void gguf_matmul(const float* x, int64_t x_stride, const uint8_t* w, int32_t type,
                 const float* bias, float* out, int64_t out_stride, int64_t rows, int64_t k,
                 int64_t num_columns, int32_t num_threads) {
    const int64_t block_elements = gguf_block_elements(type);
    if (block_elements == 0 || rows <= 0 || num_columns <= 0) return;
    const Call c = {
        .x = x,
        .x_stride = x_stride,
        .w = w,
        .type = type,
        .block_elements = block_elements,
        .block_bytes = gguf_block_bytes(type),
        .row_bytes = k / block_elements * gguf_block_bytes(type),
        .bias = bias,
        .out = out,
        .out_stride = out_stride,
        .rows = rows,
        .k = k,
        .num_columns = num_columns,
    };
#if defined(INT16_BUILT)
    if (is_block32(type) && rows <= INT16_MAX_ROWS) {
        run_integer(&c, num_threads);
        return;
    }
#endif
#if defined(BYTES_BUILT)
    if (is_block32(type) && run_bytes(&c, num_threads)) return;
#endif
#if defined(GGUF_PANELS_BUILT)
    if (rows > DECODE_ROWS) {
        run_panels(&c, num_threads);
        return;
    }
#endif
    run_columns(&c, NULL, num_threads);
}

// Rows `row_ids` of a [*, k] weight held as blocks of `type` (an embedding lookup), as float32
// into out [num_rows, k].
void gguf_dequantize_rows(const uint8_t* w, int32_t type, int64_t k, const int64_t* row_ids,
                          int64_t num_rows, float* out) {
    const int64_t block_elements = gguf_block_elements(type);
    if (block_elements == 0) return;
    const int64_t block_bytes = gguf_block_bytes(type);
    const int64_t row_bytes = k / block_elements * block_bytes;
    for (int64_t r = 0; r < num_rows; ++r) {
        const uint8_t* row = w + row_ids[r] * row_bytes;
        for (int64_t b = 0; b < k / block_elements; ++b)
            dequantize_block(type, row + b * block_bytes, out + r * k + b * block_elements);
    }
}
