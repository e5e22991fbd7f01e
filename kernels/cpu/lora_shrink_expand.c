// y[t] += B[s] (A[s] x[t]) for every token t whose adapter slot s = token_slots[t] is not -1:
// the batched LoRA shrink and expand of one linear (vLLM's punica sgmv / bgmv) on CPU.
//
// x [T, IN], y [T, OUT], lora_a [S, W, IN], lora_b [S, OUT, W] are contiguous and of one dtype,
// float32 or bf16 (`bf16`); token_slots is int32 [T]. Every product and sum is float32: a
// token's shrink A x ([W]) stays float32 in a scratch, never rounded, and y is rounded once
// (nearest even for bf16). Tokens whose slot is -1 are never read or written.
//
// Tokens are grouped by slot (a stable counting sort: a decode batch's tokens of one adapter
// need not be adjacent) and cut into tiles of at most TILE_TOKENS tokens of one slot. A unit of
// work is one tile times a block of rows of A (shrink) or of B (expand), so the rows a unit
// reads serve every token of its tile from L1/L2. Shrink and expand are the same product,
// out[t][r] = M[r] . v[t] over the rows r of a row-major matrix M of k columns, computed
// GROUP_ROWS rows at a time: one vector sum over k per row, the eight reduced into one vector
// of eight results (sum_each). With bf16 weights and a tile of several tokens, each group of
// rows is widened to float32 once per tile rather than once per token.
//
// Threads: every shrink unit, then (after a barrier) every expand unit, each thread owning a
// run of units and taking what is left of the others' from their ends (work_sharing.h); below
// PARALLEL_MIN_MACS multiply-adds the calling thread does it all.
// Built by kernels/cpu/kernel_loader.py with `cc -O3 -march=native -fopenmp`.

#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "scalar_math.h"
#include "work_sharing.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define VECTOR_FLOATS 16
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VECTOR_FLOATS 8
#else
#define VECTOR_FLOATS 1
#endif

#define GROUP_ROWS 8           // rows of M per dot_group call: one result vector of 8 floats
#define TILE_TOKENS 16         // tokens of one slot per tile
#define WIDEN_MIN_TOKENS 2     // bf16 rows are widened once per tile from this many tokens
#define SHRINK_BLOCK_ROWS 16   // rows of A per shrink unit
#define EXPAND_BLOCK_ROWS 64   // rows of B (output columns) per expand unit
#define K_CHUNK 512            // floats of a row per pass over a tile's tokens (group_products)
#define PARALLEL_MIN_MACS (1 << 18)

#define MIN(a, b) ((a) < (b) ? (a) : (b))
#define MAX(a, b) ((a) > (b) ? (a) : (b))

// Tokens order[first .. first + count) all run the adapter in `slot`.
typedef struct {
    int64_t first, count;
    int32_t slot;
} Tile;

// One call as its units see it.
typedef struct {
    const void* x;
    void* y;
    const void* lora_a;
    const void* lora_b;
    int64_t in_features, out_features, width;
    int32_t bf16;
    const int32_t* order;  // the tokens with a slot, by slot
    const Tile* tiles;
    float* shrunk;  // [T, W]: A[s] x[t], float32
} Call;

// One thread's working memory.
typedef struct {
    float* x_rows;          // [TILE_TOKENS, IN]: x of tile `x_rows_tile` widened (bf16 calls)
    int64_t x_rows_tile;    // -1: none yet
    float* widened_rows;    // [GROUP_ROWS, max(IN, W)]: a group of bf16 rows widened
} Scratch;

// The rows a product's results go to: the shrink's float32 scratch, or y (the expand).
typedef struct {
    void* base;
    int64_t token_stride;  // elements
} Sink;

#if VECTOR_FLOATS >= 8
// 8 elements of a float32 or bf16 row from `i`, as float32 (a bf16 is a float32's upper half).
static inline __m256 load8(const void* row, int64_t i, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float*)row + i);
    const __m128i half = _mm_loadu_si128((const __m128i*)((const uint16_t*)row + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

// The vector whose lane r is the sum of the lanes of sums[r].
static inline __m256 sum_each(const __m256* sums) {
    const __m256 pairs01 = _mm256_hadd_ps(sums[0], sums[1]);
    const __m256 pairs23 = _mm256_hadd_ps(sums[2], sums[3]);
    const __m256 pairs45 = _mm256_hadd_ps(sums[4], sums[5]);
    const __m256 pairs67 = _mm256_hadd_ps(sums[6], sums[7]);
    // Lanes 0-3: rows 0-3 (or 4-7) summed over their lower halves; lanes 4-7: upper halves.
    const __m256 quads0123 = _mm256_hadd_ps(pairs01, pairs23);
    const __m256 quads4567 = _mm256_hadd_ps(pairs45, pairs67);
    return _mm256_add_ps(_mm256_permute2f128_ps(quads0123, quads4567, 0x20),
                         _mm256_permute2f128_ps(quads0123, quads4567, 0x31));
}
#endif

#if VECTOR_FLOATS == 16
static inline __m512 load16(const void* row, int64_t i, int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float*)row + i);
    const __m256i half = _mm256_loadu_si256((const __m256i*)((const uint16_t*)row + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// The 8-lane sum of a 16-lane vector's halves.
static inline __m256 fold(__m512 v) {
    const __m256 upper = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    return _mm256_add_ps(_mm512_castps512_ps256(v), upper);
}
#endif

// out[r] = rows[r] . v over k elements for r < GROUP_ROWS; rows are float32, or bf16 when
// `bf16` (a compile-time constant once inlined). Any k: the vector loops leave a tail under 8.
static inline void dot_group(const void* const* rows, const float* restrict v, int64_t k,
                             float* restrict out, int bf16) {
#if VECTOR_FLOATS >= 8
    int64_t i = 0;
    __m256 sums[GROUP_ROWS];
#if VECTOR_FLOATS == 16
    __m512 wide[GROUP_ROWS];
    for (int r = 0; r < GROUP_ROWS; ++r) wide[r] = _mm512_setzero_ps();
    for (; i + 16 <= k; i += 16) {
        const __m512 values = _mm512_loadu_ps(v + i);
        for (int r = 0; r < GROUP_ROWS; ++r)
            wide[r] = _mm512_fmadd_ps(load16(rows[r], i, bf16), values, wide[r]);
    }
    for (int r = 0; r < GROUP_ROWS; ++r) sums[r] = fold(wide[r]);
#else
    for (int r = 0; r < GROUP_ROWS; ++r) sums[r] = _mm256_setzero_ps();
#endif
    for (; i + 8 <= k; i += 8) {
        const __m256 values = _mm256_loadu_ps(v + i);
        for (int r = 0; r < GROUP_ROWS; ++r)
            sums[r] = _mm256_fmadd_ps(load8(rows[r], i, bf16), values, sums[r]);
    }
    _mm256_storeu_ps(out, sum_each(sums));
    for (; i < k; ++i)
        for (int r = 0; r < GROUP_ROWS; ++r) out[r] += load_at(rows[r], i, bf16) * v[i];
#else
    for (int r = 0; r < GROUP_ROWS; ++r) {
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < k; ++i) sum += load_at(rows[r], i, bf16) * v[i];
        out[r] = sum;
    }
#endif
}

static inline void widen(const uint16_t* restrict from, float* restrict to, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) to[i] = bf16_to_float(from[i]);
}

// Rows [first_row, first_row + n) of token `token` receive values[0 .. n): stored (the
// shrink's float32 rows) or, when `accumulate`, added into float32 or (`bf16`) bf16 rows. The
// flags are compile-time constants once inlined, and a whole group is one vector operation.
static inline __attribute__((always_inline)) void emit(const Sink* sink, int64_t token,
                                                       int64_t first_row, const float* values,
                                                       const int n, const int accumulate,
                                                       const int bf16) {
    const int64_t first = token * sink->token_stride + first_row;
    if (!accumulate) {
        float* restrict out = (float*)sink->base + first;
#pragma omp simd
        for (int j = 0; j < n; ++j) out[j] = values[j];
        return;
    }
    void* base = sink->base;
#pragma omp simd
    for (int j = 0; j < n; ++j)
        store_at(base, first + j, load_at(base, first + j, bf16) + values[j], bf16);
}

// emit for a group of n rows: a whole group (the common case) with its count known.
static inline __attribute__((always_inline)) void emit_group(const Sink* sink, int64_t token,
                                                             int64_t first_row,
                                                             const float* values, int n,
                                                             const int accumulate,
                                                             const int bf16) {
    if (n == GROUP_ROWS)
        emit(sink, token, first_row, values, GROUP_ROWS, accumulate, bf16);
    else
        emit(sink, token, first_row, values, n, accumulate, bf16);
}

// One group of rows (`rows`: n of them, padded to GROUP_ROWS by repeats) times every token of
// a tile, emitted to `sink`. Rows longer than K_CHUNK are walked in chunks, every token per
// chunk, so the group's chunk stays in L1 while the tile's tokens go by (a shrink's rows are
// IN long: 8 of 2048 floats would be read from L2 again for every token). `rows_bf16`,
// `accumulate` and `y_bf16` are compile-time constants at every call site (see tile_product),
// so each combination is its own straight code.
static inline __attribute__((always_inline)) void group_products(
    const void* const* rows, int64_t k, const float* const* v, const int32_t* tokens,
    int64_t num_tokens, const Sink* sink, int64_t first_row, int n, const int rows_bf16,
    const int accumulate, const int y_bf16) {
    float results[TILE_TOKENS][GROUP_ROWS];
    if (k <= K_CHUNK) {  // an expand's rows (W long): each token's sums straight out
        for (int64_t i = 0; i < num_tokens; ++i) {
            dot_group(rows, v[i], k, results[i], rows_bf16);
            emit_group(sink, tokens[i], first_row, results[i], n, accumulate, y_bf16);
        }
        return;
    }
    memset(results, 0, sizeof(results[0]) * (size_t)num_tokens);
    for (int64_t first = 0; first < k; first += K_CHUNK) {
        const int64_t length = MIN(K_CHUNK, k - first);
        const void* chunk[GROUP_ROWS];
        for (int j = 0; j < GROUP_ROWS; ++j)
            chunk[j] = (const char*)rows[j] + first * (rows_bf16 ? 2 : 4);
        for (int64_t i = 0; i < num_tokens; ++i) {
            float partial[GROUP_ROWS];
            dot_group(chunk, v[i] + first, length, partial, rows_bf16);
            for (int r = 0; r < GROUP_ROWS; ++r) results[i][r] += partial[r];
        }
    }
    for (int64_t i = 0; i < num_tokens; ++i)
        emit_group(sink, tokens[i], first_row, results[i], n, accumulate, y_bf16);
}

// For rows [row_begin, row_end) of m (row-major, k columns, bf16 when `bf16`) and each token i
// of a tile (float32 vector v[i] of k, token id tokens[i]): row r of the token in `sink` gets
// m[r] . v[i] (stored, or added into y of m's dtype when `accumulate`). A group past row_end
// repeats its last row, and the repeats are not emitted.
static void tile_product(const void* m, int64_t k, int64_t row_begin, int64_t row_end,
                         const float* const* v, const int32_t* tokens, int64_t num_tokens,
                         const Sink* sink, int bf16, int accumulate, float* widened_rows) {
    const int64_t elem = bf16 ? 2 : 4;
    const int widen_once = bf16 && num_tokens >= WIDEN_MIN_TOKENS;
    for (int64_t row = row_begin; row < row_end; row += GROUP_ROWS) {
        const int n = (int)MIN(GROUP_ROWS, row_end - row);
        const void* rows[GROUP_ROWS];
        for (int j = 0; j < GROUP_ROWS; ++j) {
            const char* source = (const char*)m + (row + MIN(j, n - 1)) * k * elem;
            if (widen_once && j < n) widen((const uint16_t*)source, widened_rows + j * k, k);
            rows[j] = widen_once ? (const void*)(widened_rows + MIN(j, n - 1) * k) : source;
        }
        const int rows_bf16 = bf16 && !widen_once;
        if (!accumulate && rows_bf16)
            group_products(rows, k, v, tokens, num_tokens, sink, row, n, 1, 0, 0);
        else if (!accumulate)
            group_products(rows, k, v, tokens, num_tokens, sink, row, n, 0, 0, 0);
        else if (rows_bf16)
            group_products(rows, k, v, tokens, num_tokens, sink, row, n, 1, 1, 1);
        else if (bf16)
            group_products(rows, k, v, tokens, num_tokens, sink, row, n, 0, 1, 1);
        else
            group_products(rows, k, v, tokens, num_tokens, sink, row, n, 0, 1, 0);
    }
}

static int64_t shrink_blocks(const Call* c) {
    return (c->width + SHRINK_BLOCK_ROWS - 1) / SHRINK_BLOCK_ROWS;
}

static int64_t expand_blocks(const Call* c) {
    return (c->out_features + EXPAND_BLOCK_ROWS - 1) / EXPAND_BLOCK_ROWS;
}

// shrunk[t][block's rows] = A[s][rows] . x[t] for the tile's tokens t.
static void shrink_unit(const Call* c, Scratch* s, int64_t unit) {
    const int64_t tile_index = unit / shrink_blocks(c), block = unit % shrink_blocks(c);
    const Tile* tile = &c->tiles[tile_index];
    const int32_t* tokens = c->order + tile->first;
    const int64_t in = c->in_features, width = c->width;
    const float* v[TILE_TOKENS];
    for (int64_t i = 0; i < tile->count; ++i) {
        if (!c->bf16) {
            v[i] = (const float*)c->x + tokens[i] * in;
            continue;
        }
        v[i] = s->x_rows + i * in;
        if (s->x_rows_tile != tile_index)
            widen((const uint16_t*)c->x + tokens[i] * in, s->x_rows + i * in, in);
    }
    s->x_rows_tile = tile_index;
    const Sink sink = {c->shrunk, width};
    const char* a = (const char*)c->lora_a + tile->slot * width * in * (c->bf16 ? 2 : 4);
    const int64_t first_row = block * SHRINK_BLOCK_ROWS;
    tile_product(a, in, first_row, MIN(width, first_row + SHRINK_BLOCK_ROWS), v, tokens,
                 tile->count, &sink, c->bf16, 0, s->widened_rows);
}

// y[t][block's columns] += B[s][columns] . shrunk[t] for the tile's tokens t.
static void expand_unit(const Call* c, Scratch* s, int64_t unit) {
    const int64_t tile_index = unit / expand_blocks(c), block = unit % expand_blocks(c);
    const Tile* tile = &c->tiles[tile_index];
    const int32_t* tokens = c->order + tile->first;
    const int64_t out = c->out_features, width = c->width;
    const float* v[TILE_TOKENS];
    for (int64_t i = 0; i < tile->count; ++i) v[i] = c->shrunk + tokens[i] * width;
    const Sink sink = {c->y, out};
    const char* b = (const char*)c->lora_b + tile->slot * out * width * (c->bf16 ? 2 : 4);
    const int64_t first_row = block * EXPAND_BLOCK_ROWS;
    tile_product(b, width, first_row, MIN(out, first_row + EXPAND_BLOCK_ROWS), v, tokens,
                 tile->count, &sink, c->bf16, 1, s->widened_rows);
}

typedef void (*UnitFunction)(const Call*, Scratch*, int64_t);

// This thread's run of the units [0, num_units) in order, then what is left of the others'.
static void share_units(RunClaims* claims, int64_t num_units, UnitFunction run_unit,
                        const Call* c, Scratch* s) {
    const int parts = omp_get_num_threads(), part = omp_get_thread_num();
    for (int other = 0; other < parts; ++other) {
        const int run = (part + other) % parts;
        const int64_t first = num_units * run / parts, end = num_units * (run + 1) / parts;
        for (int64_t i; (i = claim(&claims[run], end - first, other == 0)) >= 0;)
            run_unit(c, s, first + i);
    }
}

// Sorts the tokens that have a slot by slot, stably, into order[], and cuts each slot's tokens
// into tiles of at most TILE_TOKENS. `starts` has room for num_slots + 1 counts. Returns the
// number of tiles, or -1 when a slot lies outside [-1, num_slots).
static int64_t make_tiles(const int32_t* token_slots, int64_t num_tokens, int64_t num_slots,
                          int64_t* starts, int32_t* order, Tile* tiles) {
    memset(starts, 0, sizeof(int64_t) * (size_t)(num_slots + 1));
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int32_t slot = token_slots[t];
        if (slot < -1 || slot >= num_slots) return -1;
        if (slot >= 0) ++starts[slot + 1];
    }
    for (int64_t slot = 0; slot < num_slots; ++slot) starts[slot + 1] += starts[slot];
    int64_t num_tiles = 0;
    for (int64_t slot = 0; slot < num_slots; ++slot)
        for (int64_t first = starts[slot]; first < starts[slot + 1]; first += TILE_TOKENS) {
            const Tile tile = {first, MIN(TILE_TOKENS, starts[slot + 1] - first), (int32_t)slot};
            tiles[num_tiles++] = tile;
        }
    for (int64_t t = 0; t < num_tokens; ++t)
        if (token_slots[t] >= 0) order[starts[token_slots[t]]++] = (int32_t)t;
    return num_tiles;
}

int lora_shrink_expand_vector_floats(void) { return VECTOR_FLOATS; }

// x, y, lora_a, lora_b as above (bf16 when `bf16`, else float32), token_slots int32 [T].
// Returns 0; -1 when memory for the scratch could not be had, -2 when a slot lies outside
// [-1, num_slots): in both cases before y is touched.
int lora_shrink_expand(const void* x, void* y, const void* lora_a, const void* lora_b,
                       const int32_t* token_slots, int32_t bf16, int64_t num_tokens,
                       int64_t in_features, int64_t out_features, int64_t width,
                       int64_t num_slots, int32_t num_threads) {
    if (num_tokens <= 0 || width <= 0 || out_features <= 0) return 0;
    int64_t* starts = malloc(sizeof(int64_t) * (size_t)(num_slots + 1));
    int32_t* order = malloc(sizeof(int32_t) * (size_t)num_tokens);
    Tile* tiles = malloc(sizeof(Tile) * (size_t)num_tokens);
    float* shrunk = malloc(sizeof(float) * (size_t)(num_tokens * width));
    int status = starts && order && tiles && shrunk ? 0 : -1;
    const int64_t num_tiles =
        status == 0 ? make_tiles(token_slots, num_tokens, num_slots, starts, order, tiles) : 0;
    if (num_tiles < 0) status = -2;
    int64_t num_routed = 0;
    for (int64_t i = 0; status == 0 && i < num_tiles; ++i) num_routed += tiles[i].count;
    const int threads = num_threads > 1 && num_routed * width * (in_features + out_features) >=
                                               PARALLEL_MIN_MACS
                            ? num_threads
                            : 1;
    // Every thread's scratch up front, so a failed allocation leaves y untouched.
    const int64_t x_floats = bf16 ? TILE_TOKENS * in_features : 0;
    const int64_t row_floats = bf16 ? GROUP_ROWS * MAX(in_features, width) : 0;
    float* scratch = status == 0 && bf16
                         ? malloc(sizeof(float) * (size_t)(threads * (x_floats + row_floats)))
                         : NULL;
    if (status == 0 && bf16 && scratch == NULL) status = -1;
    if (status == 0 && num_tiles > 0) {
        const Call call = {x,     y,   lora_a, lora_b, in_features, out_features,
                           width, bf16, order, tiles,  shrunk};
        RunClaims shrink_claims[threads], expand_claims[threads];
        init_claims(shrink_claims, threads);
        init_claims(expand_claims, threads);
#pragma omp parallel num_threads(threads) if (threads > 1)
        {
            float* mine = bf16 ? scratch + omp_get_thread_num() * (x_floats + row_floats) : NULL;
            Scratch s = {mine, -1, bf16 ? mine + x_floats : NULL};
            share_units(shrink_claims, num_tiles * shrink_blocks(&call), shrink_unit, &call, &s);
#pragma omp barrier
            share_units(expand_claims, num_tiles * expand_blocks(&call), expand_unit, &call, &s);
        }
    }
    free(scratch);
    free(shrunk);
    free(tiles);
    free(order);
    free(starts);
    return status;
}
