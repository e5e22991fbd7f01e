// gguf_matmul.c's byte path: calls of more than INT16_MAX_ROWS rows (a prompt, a step decoding
// many requests) on Q4_0, Q4_1 and Q8_0 weights, in the way llama.cpp computes them.
//
// - x is rounded once per call to 8-bit integers per 32-value block (the block's largest |x|
//   maps to 127: an error of at most half a step, 1/254 of that value), with the block's scale
//   and its exact float sum (`BytesX`).
// - Each group of 8 columns is repacked by the thread that takes it (`BytesGroup`), into a
//   buffer of its own that stays in L1: per block, the 32 nibbles of each column widened to
//   bytes and laid out as 8 vectors of 32 bytes, vector g holding values 4g..4g+3 of the 8
//   columns; and the 8 columns' d and m as floats (Q4_0: m = -8 d, as its values are d (q - 8)).
//   The thread then runs every row of the call (or its run of them, where the groups are too few
//   to share out) over it. Repacking all groups first into one call-wide buffer (twice the
//   nibbles' bytes, read back from L3 or memory) and sharing out 64-row blocks took about
//   1.05x as long (SmolLM2-135M's linears at 60 and 941 rows, 2 Zen 3 cores, medians of
//   alternating pairs); repacking per 256-row block instead of once per group, 1.15x.
// - vpmaddubsw multiplies a vector by x's 4 values of the same k broadcast to every column, and
//   the 8 products of a block add up in 16-bit lanes (8 * 2 * 15 * 127 = 30480 < 32767: no
//   saturation); one vpmaddwd, one convert and one multiply-add per block and row then scale
//   the 8 columns' sums by d * scale(x), and one more adds m * sum(x). Outputs land as whole
//   vectors of 8 columns: no horizontal sums.
//
// One vpmaddubsw does 32 multiply-adds where an FMA does 8, at the same rate on Zen 3. SmolLM2-
// 135M's Q4_1 linears, 4 layers, 2 threads, AMD EPYC Zen 3 with AVX2 (no AVX-512), best of 12
// alternating with the panels they replace, 3 rounds: 3.0 against 5.4 ms at 16 rows, 8.0
// against 16.5 at 64, 19.2 against 30.7 at 128, 111 against 225 at 960.

#ifndef GGUF_BYTES_H
#define GGUF_BYTES_H

// A tile: 4 rows times one group of 8 columns (4 rows of 16-bit sums and 4 of float sums in
// registers). Two groups a tile or 6 rows measured no different.
#define BYTES_TILE_ROWS 4
#define UNITS_PER_THREAD 8  // work units a call gives each thread at least, where it can
#define BYTES_LIMIT 127.0f

typedef struct {
    int8_t* values;  // [rows][k]: round(x / scale)
    float* scales;   // [rows][k / 32]: the block's largest |x| / 127 (0 for a block of zeros)
    float* sums;     // [rows][k / 32]: the block's float sum of x
} BytesX;

// 8 columns' blocks, repacked: per block `values` [8 vectors][8 columns][4 bytes], then `d`
// and `m` [8 columns] (columns past the weight's last are zeros).
typedef struct {
    uint8_t* values;  // [k / 32][256]
    float* d;         // [k / 32][8]
    float* m;         // [k / 32][8]
} BytesGroup;

// One block of x (32 values at `x`) rounded into `values`, its scale and sum.
static void round_block_to_bytes(const float* x, int8_t* values, float* scale, float* sum) {
    __m256i q[4];
    const float amax = round_block_words(x, BYTES_LIMIT, q, sum);
    // Two packs interleave 32-bit groups across 128-bit lanes; the permute restores order.
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    _mm256_storeu_si256((__m256i*)values, _mm256_permutevar8x32_epi32(packed, order));
    *scale = amax / BYTES_LIMIT;
}

static void round_rows_to_bytes(const Call* c, const BytesX* r, int64_t row) {
    const int64_t num_blocks = c->k / 32;
    for (int64_t b = 0; b < num_blocks; ++b) {
        const int64_t at = row * num_blocks + b;
        round_block_to_bytes(c->x + row * c->x_stride + 32 * b, r->values + row * c->k + 32 * b,
                             r->scales + at, r->sums + at);
    }
}

// Columns [first, first + 8) of `c` (those below num_columns) repacked into `g`.
static void repack_group(const Call* c, int64_t first, const BytesGroup* g) {
    const int64_t num_real = c->num_columns - first < 8 ? c->num_columns - first : 8;
    const int q4_1 = c->type == GGML_Q4_1, q8_0 = c->type == GGML_Q8_0;
    const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < c->k / 32; ++b) {
        __m256 vectors[8];  // column j's 32 values as bytes, then transposed in 4-byte groups
        float* d = g->d + 8 * b;
        float* m = g->m + 8 * b;
        for (int64_t j = 0; j < 8; ++j) {
            if (j >= num_real) {
                vectors[j] = _mm256_setzero_ps();
                d[j] = m[j] = 0.0f;
                continue;
            }
            const uint8_t* block = c->w + (first + j) * c->row_bytes + b * c->block_bytes;
            d[j] = half_to_float(block);
            if (q8_0) {  // its 32 values as they are (signed bytes), no offset
                vectors[j] = _mm256_loadu_ps((const float*)(block + 2));
                m[j] = 0.0f;
                continue;
            }
            const __m128i nibbles = _mm_loadu_si128((const __m128i*)(block + (q4_1 ? 4 : 2)));
            const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(nibbles),
                                                         _mm_srli_epi16(nibbles, 4), 1);
            vectors[j] = _mm256_castsi256_ps(_mm256_and_si256(both, low_nibbles));
            m[j] = q4_1 ? half_to_float(block + 2) : -8.0f * d[j];
        }
        transpose8(vectors);
        for (int v = 0; v < 8; ++v) _mm256_store_ps((float*)(g->values + 256 * b + 32 * v), vectors[v]);
    }
}

// Rows [row, row + num_rows) times group `g`: per block, Q4_0 and Q4_1 sum in 16-bit lanes
// (vpmaddubsw of the unsigned nibbles and x's signed bytes), Q8_0 in 32-bit ones (its signed
// bytes: vpmaddubsw of |w| and x with w's sign, whose pair sums reach 2 * 128 * 127, widened by
// vpmaddwd at once), then scaled into float sums. `num_rows` and `q8_0` are compile-time
// constants once inlined.
static inline __attribute__((always_inline)) void bytes_tile(const Call* c, const BytesX* r,
                                                             const BytesGroup* g, int64_t row,
                                                             int64_t first_column,
                                                             const int num_rows, const int q8_0) {
    const int64_t num_blocks = c->k / 32;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 sums[BYTES_TILE_ROWS];
    for (int i = 0; i < num_rows; ++i) sums[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < num_blocks; ++b) {
        __m256i words[BYTES_TILE_ROWS];  // 16-bit sums (Q4), 32-bit ones (Q8_0)
        for (int i = 0; i < num_rows; ++i) words[i] = _mm256_setzero_si256();
        for (int v = 0; v < 8; ++v) {
            const __m256i w = _mm256_load_si256((const __m256i*)(g->values + 256 * b + 32 * v));
            const __m256i magnitudes = q8_0 ? _mm256_abs_epi8(w) : w;
            for (int i = 0; i < num_rows; ++i) {
                int32_t four;
                memcpy(&four, r->values + (row + i) * c->k + 32 * b + 4 * v, 4);
                const __m256i x4 = _mm256_set1_epi32(four);
                if (q8_0) {
                    const __m256i pairs = _mm256_maddubs_epi16(magnitudes, _mm256_sign_epi8(x4, w));
                    words[i] = _mm256_add_epi32(words[i], _mm256_madd_epi16(pairs, ones));
                } else {
                    words[i] = _mm256_add_epi16(words[i], _mm256_maddubs_epi16(w, x4));
                }
                __asm__("" : "+x"(words[i]));  // keeps the sums in order: reassociated, they spill
            }
        }
        const __m256 d = _mm256_load_ps(g->d + 8 * b), m = _mm256_load_ps(g->m + 8 * b);
        for (int i = 0; i < num_rows; ++i) {
            const int64_t at = (row + i) * num_blocks + b;
            const __m256i exact = q8_0 ? words[i] : _mm256_madd_epi16(words[i], ones);
            const __m256 scale = _mm256_mul_ps(d, _mm256_broadcast_ss(r->scales + at));
            sums[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), scale, sums[i]);
            if (!q8_0) sums[i] = _mm256_fmadd_ps(m, _mm256_broadcast_ss(r->sums + at), sums[i]);
        }
    }
    const int64_t num_real = c->num_columns - first_column < 8 ? c->num_columns - first_column : 8;
    for (int i = 0; i < num_rows; ++i) {
        float lanes[8] __attribute__((aligned(32)));
        _mm256_store_ps(lanes, sums[i]);
        float* out = c->out + (row + i) * c->out_stride + first_column;
        for (int64_t n = 0; n < num_real; ++n) out[n] = lanes[n] + bias_at(c, first_column + n);
    }
}

// Rows [first_row, end_row) times group `g` (columns first_column..+8); `q8_0` a compile-time
// constant once inlined.
static inline __attribute__((always_inline)) void bytes_unit_of(const Call* c, const BytesX* r,
                                                                const BytesGroup* g,
                                                                int64_t first_row, int64_t end_row,
                                                                int64_t first_column, const int q8_0) {
    for (int64_t row = first_row; row < end_row; row += BYTES_TILE_ROWS) {
        switch (end_row - row < BYTES_TILE_ROWS ? end_row - row : BYTES_TILE_ROWS) {
            case 1: bytes_tile(c, r, g, row, first_column, 1, q8_0); break;
            case 2: bytes_tile(c, r, g, row, first_column, 2, q8_0); break;
            case 3: bytes_tile(c, r, g, row, first_column, 3, q8_0); break;
            default: bytes_tile(c, r, g, row, first_column, BYTES_TILE_ROWS, q8_0);
        }
    }
}

static void bytes_unit(const Call* c, const BytesX* r, const BytesGroup* g, int64_t first_row,
                       int64_t end_row, int64_t first_column) {
    if (c->type == GGML_Q8_0) {
        bytes_unit_of(c, r, g, first_row, end_row, first_column, 1);
    } else {
        bytes_unit_of(c, r, g, first_row, end_row, first_column, 0);
    }
}

// One thread's scratch, kept between calls (a prompt's linears take megabytes: allocating
// them per call would fault their pages in every time); grown as calls need.
static __thread void* bytes_scratch = NULL;
static __thread size_t bytes_scratch_size = 0;

static void* bytes_scratch_of(size_t size) {
    if (size > bytes_scratch_size) {
        free(bytes_scratch);
        bytes_scratch = aligned_alloc(64, size);
        bytes_scratch_size = bytes_scratch == NULL ? 0 : size;
    }
    return bytes_scratch;
}

// Row runs per group of a call: one (a group's repacked blocks serve every row while they sit
// in L1) unless the groups are too few to share out among the threads, UNITS_PER_THREAD each.
static int64_t row_runs_per_group(const Call* c, int32_t num_threads) {
    const int64_t num_groups = (c->num_columns + 7) / 8;
    const int64_t wanted = (UNITS_PER_THREAD * (int64_t)num_threads + num_groups - 1) / num_groups;
    const int64_t most = (c->rows + BYTES_TILE_ROWS - 1) / BYTES_TILE_ROWS;
    return wanted < 1 ? 1 : wanted < most ? wanted : most;
}

// `c` on the byte path; 0 when its scratch could not be had (the caller takes another path).
static int run_bytes(const Call* c, int32_t num_threads) {
    const int64_t num_blocks = c->k / 32, num_groups = (c->num_columns + 7) / 8;
    const size_t x_bytes = (size_t)((c->rows * c->k + 63) / 64 * 64);
    const size_t x_floats_bytes = (size_t)((c->rows * num_blocks * 4 + 63) / 64 * 64);
    const size_t group_bytes = (size_t)(num_blocks * (256 + 2 * 8 * 4));
    const int64_t num_groups_at_once = num_threads > 1 ? num_threads : 1;
    const size_t size = x_bytes + 2 * x_floats_bytes + (size_t)num_groups_at_once * group_bytes;
    uint8_t* scratch = bytes_scratch_of(size);
    if (scratch == NULL) return 0;
    const BytesX r = {
        .values = (int8_t*)scratch,
        .scales = (float*)(scratch + x_bytes),
        .sums = (float*)(scratch + x_bytes + x_floats_bytes),
    };
    uint8_t* group_memory = scratch + x_bytes + 2 * x_floats_bytes;
    const int64_t num_runs = row_runs_per_group(c, num_threads);
    const int64_t run_rows = ((c->rows + num_runs - 1) / num_runs + BYTES_TILE_ROWS - 1) / BYTES_TILE_ROWS * BYTES_TILE_ROWS;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        uint8_t* mine = group_memory + (size_t)omp_get_thread_num() * group_bytes;
        const BytesGroup group = {
            .values = mine,
            .d = (float*)(mine + 256 * num_blocks),
            .m = (float*)(mine + 256 * num_blocks + 32 * num_blocks),
        };
#pragma omp for schedule(static)
        for (int64_t row = 0; row < c->rows; ++row) round_rows_to_bytes(c, &r, row);
#pragma omp for schedule(dynamic, 1)
        for (int64_t unit = 0; unit < num_groups * num_runs; ++unit) {
            const int64_t g = unit / num_runs, first_row = unit % num_runs * run_rows;
            const int64_t end_row = first_row + run_rows < c->rows ? first_row + run_rows : c->rows;
            if (first_row >= end_row) continue;
            repack_group(c, 8 * g, &group);
            bytes_unit(c, &r, &group, first_row, end_row, 8 * g);
        }
    }
    return 1;
}

#endif
