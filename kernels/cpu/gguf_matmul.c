// out [M, N] = x [M, K] float32 times w [N, K] transposed (+ a float32 bias), with w held as the
// GGUF blocks a file ships (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K): the linears and LM head of a GGUF
// model under --quantization gguf, never as a dequantized copy. A decode step reads every weight
// once: 4.5 to 8.5 bits of it here instead of 32 (float32) or 16 (bf16).
//
// w is rows of blocks, one row per output column, `k / block_elements` blocks of `block_bytes`
// each (kernels/cpu/gguf_matmul.py keeps a weight as one or more such segments). A block
// dequantizes to exactly the float32 values ggml (and the gguf package, which the dequantizing
// loader uses) computes, so a product differs from the dequantized float32 matmul only in the
// order of its sums.
//
// Decode-sized calls (rows <= DECODE_ROWS): threads share units of COLUMN_UNIT output columns;
// a column's blocks are dequantized one at a time into L1 and every row of x multiplied by it
// (weight-only: x stays float32). Larger calls, on builds with f32_tiles.h (AVX2 + FMA without
// AVX-512): a panel of 16 columns is dequantized PASS_K of k at a time into an L1 scratch laid
// out as f32_matmul's packed panel, and f32_matmul's micro-kernel runs every row tile of a row
// block over it, so the dequantization is paid once per row block instead of once per row.
// Built by kernels/cpu/kernel_loader.py with `cc -O3 -march=native -fopenmp`.

#include <stdint.h>
#include <string.h>

#include <omp.h>

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

#define DECODE_ROWS 4
#define COLUMN_UNIT 16

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

// ---- decode-sized calls: a column's blocks dequantized one at a time -----------------------

#if defined(__AVX2__) && defined(__FMA__)
static inline float sum_lanes(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

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

static inline int is_block32(int32_t type) {
    return type == GGML_Q4_0 || type == GGML_Q4_1 || type == GGML_Q8_0;
}

// Columns n and n + 1 (n + 1 < num_columns) of `out` for every row, num_rows (a compile-time
// constant once inlined) at most DECODE_ROWS, for a 32-value block type: each block made in
// registers, two sums per row and column (four FMA chains at one row).
static inline void column_pair_dot32(const Call* c, int64_t n, const int num_rows) {
    __m256 sums[2][DECODE_ROWS][2];
#pragma GCC unroll 4
    for (int r = 0; r < num_rows; ++r)
        sums[0][r][0] = sums[0][r][1] = sums[1][r][0] = sums[1][r][1] = _mm256_setzero_ps();
    const uint8_t* rows[2] = {c->w + n * c->row_bytes, c->w + (n + 1) * c->row_bytes};
    const int64_t num_blocks = c->k / 32;
    for (int64_t b = 0; b < num_blocks; ++b) {
        __m256 w[2][4];
        block32_vectors(c->type, rows[0] + b * c->block_bytes, w[0]);
        block32_vectors(c->type, rows[1] + b * c->block_bytes, w[1]);
#pragma GCC unroll 4
        for (int r = 0; r < num_rows; ++r) {
            const float* x = c->x + r * c->x_stride + b * 32;
            const __m256 x0 = _mm256_loadu_ps(x), x1 = _mm256_loadu_ps(x + 8);
            const __m256 x2 = _mm256_loadu_ps(x + 16), x3 = _mm256_loadu_ps(x + 24);
#pragma GCC unroll 2
            for (int j = 0; j < 2; ++j) {
                sums[j][r][0] = _mm256_fmadd_ps(w[j][0], x0, sums[j][r][0]);
                sums[j][r][1] = _mm256_fmadd_ps(w[j][1], x1, sums[j][r][1]);
                sums[j][r][0] = _mm256_fmadd_ps(w[j][2], x2, sums[j][r][0]);
                sums[j][r][1] = _mm256_fmadd_ps(w[j][3], x3, sums[j][r][1]);
            }
        }
    }
#pragma GCC unroll 2
    for (int j = 0; j < 2; ++j) {
        const float bias = c->bias != NULL ? c->bias[n + j] : 0.0f;
#pragma GCC unroll 4
        for (int r = 0; r < num_rows; ++r)
            c->out[r * c->out_stride + n + j] =
                sum_lanes(_mm256_add_ps(sums[j][r][0], sums[j][r][1])) + bias;
    }
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

// Columns [n, end): pairs in registers for a 32-value type, the rest through `buffer`.
static inline int64_t fast_columns(const Call* c, int64_t n, int64_t end, const int num_rows) {
    if (!is_block32(c->type)) return n;
    for (; n + 1 < end; n += 2) column_pair_dot32(c, n, num_rows);
    return n;
}
#else
static inline int64_t fast_columns(const Call* c, int64_t n, int64_t end, const int num_rows) {
    (void)c, (void)end, (void)num_rows;
    return n;
}

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

static inline void columns_of_rows(const Call* c, int64_t n, int64_t end, const int num_rows) {
    float buffer[MAX_BLOCK_ELEMENTS] __attribute__((aligned(64)));
    for (n = fast_columns(c, n, end, num_rows); n < end; ++n) column_dot(c, n, buffer, num_rows);
}

static void decode_columns(const Call* c, int64_t first, int64_t end) {
    switch (c->rows) {
        case 1: columns_of_rows(c, first, end, 1); break;
        case 2: columns_of_rows(c, first, end, 2); break;
        case 3: columns_of_rows(c, first, end, 3); break;
        default: columns_of_rows(c, first, end, DECODE_ROWS);
    }
}

static void run_decode(const Call* c, int32_t num_threads) {
    const int64_t num_units = (c->num_columns + COLUMN_UNIT - 1) / COLUMN_UNIT;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) if (num_threads > 1)
    for (int64_t unit = 0; unit < num_units; ++unit) {
        const int64_t first = unit * COLUMN_UNIT;
        const int64_t end = first + COLUMN_UNIT < c->num_columns ? first + COLUMN_UNIT
                                                                  : c->num_columns;
        decode_columns(c, first, end);
    }
}

// ---- larger calls: panels dequantized for f32_matmul's micro-kernel ------------------------

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define GGUF_PANELS_BUILT 1
#include "f32_tiles.h"

// x rows of one row block (as f32_matmul: at most ~192 KiB of x, and at most 64 tiles).
#define ROW_BLOCK_BYTES (192 * 1024)
#define MAX_BLOCK_TILES 64

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

// Row tiles [first_tile, end_tile) of `num_tiles` over the rows, times panel `panel`.
static void panel_unit(const Call* c, int64_t panel, int64_t first_tile, int64_t end_tile,
                       int64_t num_tiles) {
    float scratch[PASS_K * PANEL_COLUMNS] __attribute__((aligned(64)));
    const int64_t first_column = panel * PANEL_COLUMNS;
    TileSums sums[end_tile - first_tile];
    memset(sums, 0, sizeof(sums));
    for (int64_t begin = 0; begin < c->k; begin += PASS_K) {
        const int64_t end = begin + PASS_K < c->k ? begin + PASS_K : c->k;
        dequantize_panel(c, first_column, begin, end, scratch);
        for (int64_t t = first_tile; t < end_tile; ++t) {
            const int64_t row = c->rows * t / num_tiles;
            const int num_rows = (int)(c->rows * (t + 1) / num_tiles - row);
            tile_rows(c->x + row * c->x_stride, c->x_stride, scratch - begin * PANEL_COLUMNS,
                      begin, end, &sums[t - first_tile], (const char*)scratch, 0, num_rows);
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

static void run_panels(const Call* c, int32_t num_threads) {
    const int64_t num_tiles = (c->rows + TILE_ROWS - 1) / TILE_ROWS;
    const int64_t tile_bytes = TILE_ROWS * c->k * (int64_t)sizeof(float);
    const int64_t fitting = tile_bytes < ROW_BLOCK_BYTES ? ROW_BLOCK_BYTES / tile_bytes : 1;
    const int64_t block_tiles = fitting < MAX_BLOCK_TILES ? fitting : MAX_BLOCK_TILES;
    const int64_t num_blocks = (num_tiles + block_tiles - 1) / block_tiles;
    const int64_t num_panels = (c->num_columns + PANEL_COLUMNS - 1) / PANEL_COLUMNS;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) if (num_threads > 1)
    for (int64_t unit = 0; unit < num_blocks * num_panels; ++unit) {
        const int64_t block = unit / num_panels;
        const int64_t first_tile = block * block_tiles;
        const int64_t end_tile =
            first_tile + block_tiles < num_tiles ? first_tile + block_tiles : num_tiles;
        panel_unit(c, unit % num_panels, first_tile, end_tile, num_tiles);
    }
}
#endif

// Whether calls of more than DECODE_ROWS rows dequantize panels for f32_matmul's micro-kernel
// (1), or go column by column as decode-sized calls do (0).
int gguf_matmul_has_panels(void) {
#if defined(GGUF_PANELS_BUILT)
    return 1;
#else
    return 0;
#endif
}

// The rows DECODE_ROWS at a time through the column-by-column path.
static void run_decode_rows(Call c, int32_t num_threads) {
    for (int64_t first = 0; first < c.rows; first += DECODE_ROWS) {
        Call part = c;
        part.x = c.x + first * c.x_stride;
        part.out = c.out + first * c.out_stride;
        part.rows = c.rows - first < DECODE_ROWS ? c.rows - first : DECODE_ROWS;
        run_decode(&part, num_threads);
    }
}

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
#if defined(GGUF_PANELS_BUILT)
    if (rows > DECODE_ROWS) {
        run_panels(&c, num_threads);
        return;
    }
#endif
    run_decode_rows(c, num_threads);
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
