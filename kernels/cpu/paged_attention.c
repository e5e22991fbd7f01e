// Paged attention on CPU for requests with short queries (decodes, chunks; whole prompts of a
// bf16 model): float32 queries and outputs over a float32 or bfloat16 cache (bf16 values widen
// to float32 exactly, by a 16-bit shift, as they are loaded; every sum is float32).
//
// Reads K/V straight from the paged cache [2, num_blocks, block_size, H_kv, D] through the
// block table: no gather copy, no padding, and slots past a request's length (or past a query
// token's causal limit) never reach the output: the general path does not read them, and the
// bf16 fast path (below) computes scores of a whole 16-key group inside the request's own
// block and stores only the lanes of real keys, so NaN there stays in dropped lanes.
//
// One work item is one request. Its score rows are (query token t, query head): a first pass
// reads the request's K block by block (a block is contiguous in memory, a token's KV heads
// side by side), each K vector serving its whole query-head group (GQA); then softmax per
// row; then a pass over V adds each block's weighted sum into the output rows, accumulating
// in registers. Decoding is bound by reading the cache, so the next block is prefetched while
// one is read (blocks are scattered: the hardware prefetcher cannot follow), and exp is a
// polynomial the compiler vectorizes. Items run in parallel over `num_threads` OpenMP threads
// (1 = the calling thread only), each owning a run of about equal cost and taking what is left
// of the others' once done (work_sharing.h); with fewer requests than threads, each KV head of
// a request is an item of its own.
// Built by kernels/cpu/kernel_loader.py with `cc -O3 -march=native -fopenmp`.

#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention_args.h"
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

#define MIN(a, b) ((a) < (b) ? (a) : (b))
#define MAX(a, b) ((a) > (b) ? (a) : (b))

typedef struct {
    const float* query;          // [T, H_q, D]
    const char* key_cache;       // [num_blocks, block_size, H_kv, D] of float32 or bf16
    const char* value_cache;     // same shape, right after the keys
    const int32_t* block_table;  // [B, block_table_stride]
    const int32_t* seq_lens;     // [B]: cached tokens after this step's write
    const int32_t* query_start;  // [B + 1]
    float* out;                  // [T, H_q, D]
    int64_t block_table_stride;
    int32_t block_size;
    int32_t num_q_heads;
    int32_t num_kv_heads;
    float scale;
    int32_t fast_bf16;       // the bf16 fast path applies (see below)
    int32_t sliding_window;  // > 0: the query at position q sees keys q - window + 1 .. q only
} Problem;

// One thread's working memory: score rows, and for the bf16 fast path the request's query
// in bf16 and one block of values widened to float32.
typedef struct {
    float* scores;
    uint16_t* query_bf16;
    float* widened_values;
} Scratch;

// One request as the passes see it.
typedef struct {
    const int32_t* blocks;  // its block table row
    const float* query;     // its first query row
    float* out;             // its first output row
    int32_t q_len;
    int32_t seq_len;
    int32_t context;        // query token t sits at position context + t, sees keys ..context + t
    int32_t group;          // query heads per KV head
    int64_t token_stride;   // elements from one cached token to the next (H_kv * D)
    int32_t kv_head_begin;  // the KV heads this work item covers, and their query heads
    int32_t kv_head_end;
} Request;

// The first key query token t of `r` sees: 0, or the start of its sliding window.
static inline int32_t first_visible_key(const Problem* p, const Request* r, int32_t t) {
    return p->sliding_window > 0 ? MAX(0, r->context + t + 1 - p->sliding_window) : 0;
}

#if VECTOR_FLOATS == 16
// 16 bf16 values at p, widened to float32 exactly (a bf16 is the upper half of a float32).
static inline __m512 widen_bf16x16(const uint16_t* p) {
    const __m256i half = _mm256_loadu_si256((const __m256i*)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
#endif

// a . b over n floats; the vector paths need n % VECTOR_FLOATS == 0 (the caller checks).
static inline float dot(const float* restrict a, const float* restrict b, int32_t n) {
#if VECTOR_FLOATS == 16
    __m512 sum = _mm512_setzero_ps();
    for (int32_t d = 0; d < n; d += 16)
        sum = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), sum);
    return _mm512_reduce_add_ps(sum);
#elif VECTOR_FLOATS == 8
    __m256 sum = _mm256_setzero_ps();
    for (int32_t d = 0; d < n; d += 8)
        sum = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), sum);
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
#else
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int32_t d = 0; d < n; ++d) sum += a[d] * b[d];
    return sum;
#endif
}

// a . b over n elements for a bf16 b; same conditions as dot.
static inline float dot_bf16(const float* restrict a, const uint16_t* restrict b, int32_t n) {
#if VECTOR_FLOATS == 16
    __m512 sum = _mm512_setzero_ps();
    for (int32_t d = 0; d < n; d += 16)
        sum = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), widen_bf16x16(b + d), sum);
    return _mm512_reduce_add_ps(sum);
#else
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int32_t d = 0; d < n; ++d) sum += a[d] * bf16_to_float(b[d]);
    return sum;
#endif
}

// out += sum over keys of weights[key] * v[key * stride], n elements of float32 or, when
// `bf16` (a compile-time constant once inlined), bf16 values; with AVX-512 (n <= 256) the sum
// stays in registers and `out` is read and written once. (AVX2 with a float32 cache sums a
// whole GQA group at once instead: value_block_f32.)
static inline void add_weighted_sum(float* restrict out, const void* v, int64_t stride,
                                    const float* restrict weights, int32_t num_keys, int32_t n,
                                    int bf16) {
#if VECTOR_FLOATS == 16
    if (n <= 256) {
        __m512 acc[16];
        for (int32_t c = 0; c < n / 16; ++c) acc[c] = _mm512_loadu_ps(out + c * 16);
        for (int32_t key = 0; key < num_keys; ++key) {
            const __m512 weight = _mm512_set1_ps(weights[key]);
            const int64_t first = key * stride;
            for (int32_t c = 0; c < n / 16; ++c) {
                const int64_t i = first + c * 16;
                const __m512 values = bf16 ? widen_bf16x16((const uint16_t*)v + i)
                                           : _mm512_loadu_ps((const float*)v + i);
                acc[c] = _mm512_fmadd_ps(weight, values, acc[c]);
            }
        }
        for (int32_t c = 0; c < n / 16; ++c) _mm512_storeu_ps(out + c * 16, acc[c]);
        return;
    }
#endif
    for (int32_t key = 0; key < num_keys; ++key) {
        const float weight = weights[key];
#pragma omp simd
        for (int32_t d = 0; d < n; ++d) out[d] += weight * load_at(v, key * stride + d, bf16);
    }
}

// The two element types of the cache: `bf16` is a compile-time constant wherever this is
// inlined (see attend), so each specialization keeps one branch.
static inline float dot_cache(const float* q, const char* k, int32_t n, int bf16) {
    return bf16 ? dot_bf16(q, (const uint16_t*)k, n) : dot(q, (const float*)k, n);
}

// The cached rows of tokens start.. (to the end of start's block), all KV heads; `elem` is
// the cache's element size in bytes.
static inline const char* block_rows(const Problem* p, const Request* r, const char* cache,
                                     int32_t start, int32_t elem) {
    const int64_t slot = (int64_t)r->blocks[start / p->block_size] * p->block_size;
    return cache + (slot + start % p->block_size) * r->token_stride * elem;
}

// Hints that `num_bytes` from `row` will be read soon (GCC and Clang builtin). Into L2 only
// (locality 1): an L1 prefetch holds one of the core's few L1 miss slots until it lands, and
// with those full the loads stall; L2 has several times more.
static inline void prefetch_line(const char* address) { __builtin_prefetch(address, 0, 1); }

static inline void prefetch_row(const char* row, int64_t num_bytes) {
    for (int64_t offset = 0; offset < num_bytes; offset += 64) prefetch_line(row + offset);
}

#if defined(__AVX512BF16__)
// bf16 fast path, taken for a bf16 cache and bf16 queries (exact in float32, so rounding them
// back to bf16 loses nothing) when head_dim % 32 == 0 and block_size % 16 == 0. Scores come 16
// keys at a time from bf16 dot products (vdpbf16ps: exact products, float32 sums), the 16
// vectors of partial sums reduced together; values are widened to float32 once per block and
// KV head, then shared by every query row of the head's group.
#define FAST_KEYS 16

// p[j] -> lane j of the result: the sum of p[j]'s lanes (a transposed reduction: 15 adds and
// 31 shuffles for 16 sums, where one reduction each would take 8 dependent steps apiece).
static inline __m512 sum_each_of_16(const __m512 p[FAST_KEYS]) {
    __m512 r[8], s[4];
    for (int i = 0; i < 8; ++i)  // lanes 0-7: key i, lanes 8-15: key i + 8
        r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(p[i], p[i + 8], 0x44),
                             _mm512_shuffle_f32x4(p[i], p[i + 8], 0xEE));
    for (int i = 0; i < 4; ++i)  // 128-bit chunks: keys i, i + 8, i + 4, i + 12
        s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(r[i], r[i + 4], 0x88),
                             _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD));
    const __m512 u0 =
        _mm512_add_ps(_mm512_unpacklo_ps(s[0], s[1]), _mm512_unpackhi_ps(s[0], s[1]));
    const __m512 u1 =
        _mm512_add_ps(_mm512_unpacklo_ps(s[2], s[3]), _mm512_unpackhi_ps(s[2], s[3]));
    // chunks hold keys 0-3, 8-11, 4-7, 12-15; the last shuffle puts them in order
    const __m512 v =
        _mm512_add_ps(_mm512_shuffle_ps(u0, u1, 0x44), _mm512_shuffle_ps(u0, u1, 0xEE));
    return _mm512_shuffle_f32x4(v, v, 0xD8);
}

// Two regions of `num_bytes` each (either may be NULL), prefetched a few lines at a time.
typedef struct {
    const char* first;
    const char* second;
    int64_t num_bytes;
    int64_t done;  // bytes of first, then of second, already prefetched
} Prefetcher;

static inline void prefetch_some(Prefetcher* f, int64_t num_lines) {
    for (; num_lines > 0 && f->done < 2 * f->num_bytes; --num_lines, f->done += 64) {
        const int in_first = f->done < f->num_bytes;
        const char* base = in_first ? f->first : f->second;
        if (base != NULL) prefetch_line(base + f->done - (in_first ? 0 : f->num_bytes));
    }
}

// Scaled scores of query row `row` (bf16, q16) against keys key0..key0+n-1 (n <= 16), whose
// head rows start at k, token_stride elements apart. Rows up to key0 + 16 must be readable
// (they are, inside one block); lanes past n are computed and dropped.
static inline void score_16_keys(const uint16_t* q16, const uint16_t* k, int64_t token_stride,
                                 int32_t head_dim, int32_t n, float scale, float* out) {
    __m512 part[FAST_KEYS];
    for (int j = 0; j < FAST_KEYS; ++j) part[j] = _mm512_setzero_ps();
    for (int32_t c = 0; c < head_dim; c += 32) {
        const __m512bh q = (__m512bh)_mm512_loadu_si512(q16 + c);
        for (int j = 0; j < FAST_KEYS; ++j)
            part[j] = _mm512_dpbf16_ps(
                part[j], q, (__m512bh)_mm512_loadu_si512(k + j * token_stride + c));
    }
    const __m512 sums = _mm512_mul_ps(sum_each_of_16(part), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(out, (__mmask16)((1u << n) - 1), sums);
}

// score_block for the fast path: the item's score rows against keys start..end-1 of one block.
static inline void score_block_bf16(const Problem* p, const Request* r, const uint16_t* k,
                                    const char* next_keys, const char* values, int32_t start,
                                    int32_t end, int32_t head_dim, const uint16_t* q16,
                                    float* scores) {
    // Decoding waits on memory: the next block's keys and this block's values (for the value
    // pass) are prefetched a few lines before each group of dot products, so the loads
    // overlap the arithmetic instead of queueing up in one burst.
    const int64_t block_bytes = (int64_t)(end - start) * r->token_stride * 2;
    Prefetcher prefetcher = {next_keys, values, block_bytes, 0};
    const int32_t first_token_of_block = start > r->context ? start - r->context : 0;
    const int64_t num_calls = (int64_t)(r->q_len - first_token_of_block) *
                              (r->kv_head_end - r->kv_head_begin) * r->group;
    const int64_t lines_per_call =
        num_calls > 0 ? (2 * block_bytes / 64 + num_calls - 1) / num_calls : 0;
    for (int32_t key0 = start; key0 < end; key0 += FAST_KEYS) {
        const int32_t n = MIN(FAST_KEYS, end - key0);
        const uint16_t* k0 = k + (int64_t)(key0 - start) * r->token_stride;
        const int32_t first_token = key0 > r->context ? key0 - r->context : 0;
        for (int32_t t = first_token; t < r->q_len; ++t) {
            int64_t row = (int64_t)t * p->num_q_heads + (int64_t)r->kv_head_begin * r->group;
            for (int32_t kv_head = r->kv_head_begin; kv_head < r->kv_head_end; ++kv_head)
                for (int32_t g = 0; g < r->group; ++g, ++row) {
                    prefetch_some(&prefetcher, lines_per_call);
                    score_16_keys(q16 + row * head_dim, k0 + (int64_t)kv_head * head_dim,
                                  r->token_stride, head_dim, n, p->scale,
                                  scores + row * r->seq_len + key0);
                }
        }
    }
    prefetch_some(&prefetcher, 2 * block_bytes / 64);  // whatever is left
}

// value_block for the fast path; `widened` holds block_size * head_dim floats.
static inline void value_block_bf16(const Problem* p, const Request* r, const uint16_t* v,
                                    int32_t start, int32_t end, int32_t head_dim,
                                    const float* scores, float* widened) {
    const int32_t num_q_heads = p->num_q_heads;
    const int32_t first_token = start > r->context ? start - r->context : 0;
    if (first_token >= r->q_len) return;
    for (int32_t kv_head = r->kv_head_begin; kv_head < r->kv_head_end; ++kv_head) {
        for (int32_t key = start; key < end; ++key) {
            const uint16_t* row = v + (int64_t)(key - start) * r->token_stride +
                                  (int64_t)kv_head * head_dim;
            float* dst = widened + (int64_t)(key - start) * head_dim;
            for (int32_t d = 0; d < head_dim; d += 16)
                _mm512_storeu_ps(dst + d, widen_bf16x16(row + d));
        }
        for (int32_t t = first_token; t < r->q_len; ++t) {
            const int32_t visible_end = MIN(end, r->context + t + 1);
            const int32_t visible_start = MAX(start, first_visible_key(p, r, t));
            if (visible_end <= visible_start) continue;
            int64_t row = (int64_t)t * num_q_heads + (int64_t)kv_head * r->group;
            for (int32_t g = 0; g < r->group; ++g, ++row)
                add_weighted_sum(r->out + row * head_dim,
                                 widened + (int64_t)(visible_start - start) * head_dim, head_dim,
                                 scores + row * r->seq_len + visible_start,
                                 visible_end - visible_start, head_dim, 0);
        }
    }
}

// The request's query rows (float32 holding bf16 values) as bf16, exactly.
static inline void query_to_bf16(const float* query, int64_t num_floats, uint16_t* q16) {
    for (int64_t i = 0; i < num_floats; i += 16)
        _mm256_storeu_si256((__m256i*)(q16 + i),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(query + i)));
}
#endif

#if VECTOR_FLOATS == 8
// AVX2 float32 keys: scores come 8 keys at a time, 8 independent FMA chains (one dot product
// at a time would wait on one chain's latency at every step) reduced together.
#define AVX2_KEYS 8

// p[j] -> lane j of the result: the sum of p[j]'s lanes (a transposed reduction).
static inline __m256 sum_each_of_8(const __m256 p[AVX2_KEYS]) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(p[0], p[1]), _mm256_hadd_ps(p[2], p[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(p[4], p[5]), _mm256_hadd_ps(p[6], p[7]));
    // a: lanes 0-3 keys 0-3 (low halves), 4-7 keys 0-3 (high halves); b likewise keys 4-7
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// Scaled scores of query row q against n <= 8 float32 keys whose head rows start at k,
// token_stride floats apart; only the n real keys are read and stored. `n` is a compile-time
// constant once inlined (see score_8_keys), so the key loop has no branches.
static inline void score_n_keys(const float* q, const float* k, int64_t token_stride,
                                int32_t head_dim, const int32_t n, float scale, float* out) {
    __m256 part[AVX2_KEYS];
#pragma GCC unroll 8
    for (int j = 0; j < AVX2_KEYS; ++j) part[j] = _mm256_setzero_ps();
    for (int32_t c = 0; c < head_dim; c += 8) {
        const __m256 query = _mm256_loadu_ps(q + c);
#pragma GCC unroll 8
        for (int j = 0; j < n; ++j)
            part[j] = _mm256_fmadd_ps(query, _mm256_loadu_ps(k + j * token_stride + c), part[j]);
    }
    const __m256 sums = _mm256_mul_ps(sum_each_of_8(part), _mm256_set1_ps(scale));
    if (n == AVX2_KEYS) {
        _mm256_storeu_ps(out, sums);
        return;
    }
    float lanes[AVX2_KEYS];
    _mm256_storeu_ps(lanes, sums);
    memcpy(out, lanes, sizeof(float) * n);
}

// score_n_keys with every key count its own code: 8 (all but a block's last keys) first.
static inline void score_8_keys(const float* q, const float* k, int64_t token_stride,
                                int32_t head_dim, int32_t n, float scale, float* out) {
    switch (n) {
        case 8: score_n_keys(q, k, token_stride, head_dim, 8, scale, out); break;
        case 7: score_n_keys(q, k, token_stride, head_dim, 7, scale, out); break;
        case 6: score_n_keys(q, k, token_stride, head_dim, 6, scale, out); break;
        case 5: score_n_keys(q, k, token_stride, head_dim, 5, scale, out); break;
        case 4: score_n_keys(q, k, token_stride, head_dim, 4, scale, out); break;
        case 3: score_n_keys(q, k, token_stride, head_dim, 3, scale, out); break;
        case 2: score_n_keys(q, k, token_stride, head_dim, 2, scale, out); break;
        default: score_n_keys(q, k, token_stride, head_dim, 1, scale, out);
    }
}

// Lines [first, end) of `span` bytes from `rows` on in each of a block's token rows,
// `row_bytes` apart: line l is line l % lines_per_row of row l / lines_per_row.
static inline void prefetch_lines(const char* rows, int64_t row_bytes, int64_t lines_per_row,
                                  int64_t first, int64_t end) {
    if (first >= end) return;
    int64_t row = first / lines_per_row, line = first % lines_per_row;
    for (int64_t l = first; l < end; ++l) {
        prefetch_line(rows + row * row_bytes + line * 64);
        if (++line == lines_per_row) line = 0, ++row;
    }
}

// score_block for a float32 cache: each query row against 8 keys at a time. The same keys of
// the next block's rows (`next`) are prefetched a few lines before each row's dot products,
// so the next block streams in while this one is scored (in one burst before the rows, the
// prefetches filled the core's miss buffers and stalled it: decode attention 1.19-1.25x
// slower on a 2-core AVX2 EPYC).
static inline void score_block_f32(const Problem* p, const Request* r, const float* k,
                                   const char* next, int32_t start, int32_t end,
                                   int32_t head_dim, float* scores) {
    const int64_t row_bytes = r->token_stride * 4;
    const int64_t first_byte = (int64_t)r->kv_head_begin * head_dim * 4;
    const int64_t span = (int64_t)(r->kv_head_end - r->kv_head_begin) * head_dim * 4;
    const int64_t lines_per_row = (span + 63) / 64;
    const int32_t rows_per_token = (r->kv_head_end - r->kv_head_begin) * r->group;
    for (int32_t key0 = start; key0 < end; key0 += AVX2_KEYS) {
        const int32_t n = MIN(AVX2_KEYS, end - key0);
        const float* k0 = k + (int64_t)(key0 - start) * r->token_stride;
        const int32_t first_token = key0 > r->context ? key0 - r->context : 0;
        const char* next_rows =
            next != NULL ? next + (key0 - start) * row_bytes + first_byte : NULL;
        const int64_t lines = next != NULL ? n * lines_per_row : 0;
        const int64_t calls = (int64_t)(r->q_len - first_token) * rows_per_token;
        int64_t call = 0, prefetched = 0;
        for (int32_t t = first_token; t < r->q_len; ++t) {
            int64_t row = (int64_t)t * p->num_q_heads + (int64_t)r->kv_head_begin * r->group;
            for (int32_t kv_head = r->kv_head_begin; kv_head < r->kv_head_end; ++kv_head)
                for (int32_t g = 0; g < r->group; ++g, ++row, ++call) {
                    const int64_t until = lines * (call + 1) / calls;
                    prefetch_lines(next_rows, row_bytes, lines_per_row, prefetched, until);
                    prefetched = until;
                    score_8_keys(r->query + row * head_dim, k0 + (int64_t)kv_head * head_dim,
                                 r->token_stride, head_dim, n, p->scale,
                                 scores + row * r->seq_len + key0);
                }
        }
    }
}

// Up to WEIGHTED_ROWS query rows of one KV head times `num_vectors` (<= WEIGHTED_VECTORS, both
// compile-time constants once inlined) 8-float chunks of the head: out[r] += sum over keys of
// weights[r][key] * v[key]. The rows share every value load (a GQA group reads V once), with
// 4 x 3 sums, 3 weights and 1 value in the 16 registers. When `next` is not NULL, the lines of
// the same chunk of the next block's rows (`next + key * stride`) are prefetched, one key at a
// time, so the next block streams in while this one is summed.
#define WEIGHTED_ROWS 3
#define WEIGHTED_VECTORS 4

static inline void weighted_rows(float* out, int32_t out_stride, const float* v, int64_t stride,
                                 const float* weights, int32_t weight_stride, int32_t num_keys,
                                 const char* next, const int num_rows, const int num_vectors) {
    __m256 acc[WEIGHTED_ROWS][WEIGHTED_VECTORS];
#pragma GCC unroll 4
    for (int r = 0; r < num_rows; ++r)
#pragma GCC unroll 4
        for (int c = 0; c < num_vectors; ++c) acc[r][c] = _mm256_loadu_ps(out + r * out_stride + c * 8);
    for (int32_t key = 0; key < num_keys; ++key) {
        if (next != NULL) {
            const char* line = next + key * stride * 4;
            prefetch_line(line);
            if (num_vectors > 2) prefetch_line(line + 64);
        }
        __m256 weight[WEIGHTED_ROWS];
#pragma GCC unroll 4
        for (int r = 0; r < num_rows; ++r)
            weight[r] = _mm256_broadcast_ss(weights + r * weight_stride + key);
        const float* row = v + key * stride;
#pragma GCC unroll 4
        for (int c = 0; c < num_vectors; ++c) {
            const __m256 values = _mm256_loadu_ps(row + c * 8);
#pragma GCC unroll 4
            for (int r = 0; r < num_rows; ++r)
                acc[r][c] = _mm256_fmadd_ps(weight[r], values, acc[r][c]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < num_rows; ++r)
#pragma GCC unroll 4
        for (int c = 0; c < num_vectors; ++c) _mm256_storeu_ps(out + r * out_stride + c * 8, acc[r][c]);
}

// weighted_rows with every (rows, chunks) pair its own code.
static inline void weighted_rows_any(float* out, int32_t out_stride, const float* v,
                                     int64_t stride, const float* weights, int32_t weight_stride,
                                     int32_t num_keys, const char* next, int num_rows,
                                     int num_vectors) {
#define WEIGHTED_CASE(R, C)                                                                    \
    case (R) * 8 + (C):                                                                        \
        weighted_rows(out, out_stride, v, stride, weights, weight_stride, num_keys, next, R, C); \
        break
    switch (num_rows * 8 + num_vectors) {
        WEIGHTED_CASE(1, 1); WEIGHTED_CASE(1, 2); WEIGHTED_CASE(1, 3); WEIGHTED_CASE(1, 4);
        WEIGHTED_CASE(2, 1); WEIGHTED_CASE(2, 2); WEIGHTED_CASE(2, 3); WEIGHTED_CASE(2, 4);
        WEIGHTED_CASE(3, 1); WEIGHTED_CASE(3, 2); WEIGHTED_CASE(3, 3); WEIGHTED_CASE(3, 4);
    }
#undef WEIGHTED_CASE
}

// value_block for a float32 cache: each query token's group rows of a KV head together,
// WEIGHTED_ROWS rows and WEIGHTED_VECTORS chunks at a time. The next block's rows of the
// item's KV heads are prefetched along the first token's first rows, one key at a time (the
// keys it does not see, in one go after them).
static inline void value_block_f32(const Problem* p, const Request* r, const float* v,
                                   const char* next, int32_t start, int32_t end,
                                   int32_t head_dim, const float* scores) {
    const int32_t first_token = start > r->context ? start - r->context : 0;
    for (int32_t t = first_token; t < r->q_len; ++t) {
        const int32_t visible_end = MIN(end, r->context + t + 1);
        const int32_t visible_start = MAX(start, first_visible_key(p, r, t));
        const int32_t num_keys = MAX(0, visible_end - visible_start);
        for (int32_t kv_head = r->kv_head_begin; kv_head < r->kv_head_end; ++kv_head) {
            const int64_t first_row = (int64_t)t * p->num_q_heads + (int64_t)kv_head * r->group;
            const int64_t head_offset = (int64_t)kv_head * head_dim;
            const float* v_head =
                v + (int64_t)(visible_start - start) * r->token_stride + head_offset;
            for (int32_t row0 = 0; row0 < r->group; row0 += WEIGHTED_ROWS) {
                const int num_rows = MIN(WEIGHTED_ROWS, r->group - row0);
                const int64_t row = first_row + row0;
                const int prefetches = next != NULL && t == first_token && row0 == 0;
                for (int32_t d = 0; d < head_dim; d += 8 * WEIGHTED_VECTORS) {
                    const int num_vectors = MIN(WEIGHTED_VECTORS, (head_dim - d) / 8);
                    const char* next_chunk = prefetches ? next + (head_offset + d) * 4 : NULL;
                    weighted_rows_any(r->out + row * head_dim + d, head_dim, v_head + d,
                                      r->token_stride, scores + row * r->seq_len + visible_start,
                                      r->seq_len, num_keys, next_chunk, num_rows, num_vectors);
                    if (next_chunk != NULL)
                        for (int32_t key = num_keys; key < end - start; ++key)
                            prefetch_row(next_chunk + key * r->token_stride * 4,
                                         num_vectors * 32);
                }
            }
        }
    }
}
#endif

// Score rows t * H_q + head, `seq_len` floats apart: the scaled dot products of the item's
// query rows with the keys of one block, start..end-1. Token `key - start` of the next block
// (`next`, or NULL) is prefetched alongside.
static inline void score_block(const Problem* p, const Request* r, const char* k,
                               const char* next, int32_t start, int32_t end, int32_t head_dim,
                               int32_t elem, float* scores) {
    const int32_t num_q_heads = p->num_q_heads;
    const int64_t row_bytes = r->token_stride * elem;
    const int64_t first_byte = (int64_t)r->kv_head_begin * head_dim * elem;
    const int64_t span = (int64_t)(r->kv_head_end - r->kv_head_begin) * head_dim * elem;
    for (int32_t key = start; key < end; ++key, k += row_bytes) {
        if (next != NULL) prefetch_row(next + (key - start) * row_bytes + first_byte, span);
        const int32_t first_token = key > r->context ? key - r->context : 0;
        for (int32_t t = first_token; t < r->q_len; ++t) {
            int64_t row = (int64_t)t * num_q_heads + (int64_t)r->kv_head_begin * r->group;
            for (int32_t kv_head = r->kv_head_begin; kv_head < r->kv_head_end; ++kv_head) {
                const char* k_head = k + (int64_t)kv_head * head_dim * elem;
                for (int32_t g = 0; g < r->group; ++g, ++row)
                    scores[row * r->seq_len + key] =
                        dot_cache(r->query + row * head_dim, k_head, head_dim, elem == 2) *
                        p->scale;
            }
        }
    }
}

// Each of the item's score rows becomes its softmax over the keys its query token sees; keys
// before its sliding window get weight 0 (and the value pass skips them, so whatever their
// blocks hold, even NaN, never reaches the output).
static inline void softmax_rows(const Problem* p, const Request* r, float* scores) {
    for (int32_t t = 0; t < r->q_len; ++t) {
        const int32_t visible = r->context + t + 1;
        const int32_t first = first_visible_key(p, r, t);
        const int32_t last_head = r->kv_head_end * r->group;
        for (int32_t head = r->kv_head_begin * r->group; head < last_head; ++head) {
            float* row = scores + ((int64_t)t * p->num_q_heads + head) * r->seq_len;
            float max_score = row[first];
#pragma omp simd reduction(max : max_score)
            for (int32_t key = first + 1; key < visible; ++key)
                max_score = row[key] > max_score ? row[key] : max_score;
            float total = 0.0f;
#pragma omp simd reduction(+ : total)
            for (int32_t key = first; key < visible; ++key) {
                row[key] = exp_nonpositive(row[key] - max_score);
                total += row[key];
            }
            const float inverse = 1.0f / total;
#pragma omp simd
            for (int32_t key = first; key < visible; ++key) row[key] *= inverse;
            for (int32_t key = 0; key < first; ++key) row[key] = 0.0f;
        }
    }
}

// Output rows += softmax weights * V over the keys start..end-1 of one block that each query
// token sees; `next` as in score_block.
static inline void value_block(const Problem* p, const Request* r, const char* v,
                               const char* next, int32_t start, int32_t end, int32_t head_dim,
                               int32_t elem, const float* scores) {
    const int64_t row_bytes = r->token_stride * elem;
    const int64_t first_byte = (int64_t)r->kv_head_begin * head_dim * elem;
    const int64_t span = (int64_t)(r->kv_head_end - r->kv_head_begin) * head_dim * elem;
    if (next != NULL) {
        for (int32_t key = start; key < end; ++key)
            prefetch_row(next + (key - start) * row_bytes + first_byte, span);
    }
    const int32_t num_q_heads = p->num_q_heads;
    for (int32_t t = 0; t < r->q_len; ++t) {
        const int32_t visible_end = MIN(end, r->context + t + 1);
        const int32_t visible_start = MAX(start, first_visible_key(p, r, t));
        if (visible_end <= visible_start) continue;
        int64_t row = (int64_t)t * num_q_heads + (int64_t)r->kv_head_begin * r->group;
        for (int32_t kv_head = r->kv_head_begin; kv_head < r->kv_head_end; ++kv_head) {
            const int64_t offset =
                (int64_t)(visible_start - start) * r->token_stride + (int64_t)kv_head * head_dim;
            const char* v_head = v + offset * elem;
            for (int32_t g = 0; g < r->group; ++g, ++row)
                add_weighted_sum(r->out + row * head_dim, v_head, r->token_stride,
                                 scores + row * r->seq_len + visible_start,
                                 visible_end - visible_start, head_dim, elem == 2);
        }
    }
}

// Request `req`, KV heads kv_head_begin..kv_head_end-1 and their query heads; `scores` holds
// q_len * H_q * seq_len floats; `elem` is the cache's element size (4: float32, 2: bf16).
static inline void attend_request(const Problem* p, int32_t req, int32_t kv_head_begin,
                                  int32_t kv_head_end, int32_t head_dim, int32_t elem,
                                  const Scratch* scratch, const char* after) {
    float* scores = scratch->scores;
    const int32_t q_begin = p->query_start[req];
    Request r = {
        .blocks = p->block_table + (int64_t)req * p->block_table_stride,
        .query = p->query + (int64_t)q_begin * p->num_q_heads * head_dim,
        .out = p->out + (int64_t)q_begin * p->num_q_heads * head_dim,
        .q_len = p->query_start[req + 1] - q_begin,
        .seq_len = p->seq_lens[req],
        .group = p->num_q_heads / p->num_kv_heads,
        .token_stride = (int64_t)p->num_kv_heads * head_dim,
        .kv_head_begin = kv_head_begin,
        .kv_head_end = kv_head_end,
    };
    r.context = r.seq_len - r.q_len;
    const int32_t block_size = p->block_size;
#if defined(__AVX512BF16__)
    if (p->fast_bf16)
        query_to_bf16(r.query, (int64_t)r.q_len * p->num_q_heads * head_dim, scratch->query_bf16);
#endif
    // Blocks wholly before every query token's window are neither read nor scored (a score
    // row is read only from its token's first visible key on).
    const int32_t first_block_key = first_visible_key(p, &r, 0) / block_size * block_size;
    for (int32_t start = first_block_key; start < r.seq_len; start += block_size) {
        const int32_t end = MIN(start + block_size, r.seq_len);
        const char* next = end < r.seq_len
                               ? block_rows(p, &r, p->key_cache, end, elem)
                               : block_rows(p, &r, p->value_cache, first_block_key, elem);
        const char* k = block_rows(p, &r, p->key_cache, start, elem);
#if defined(__AVX512BF16__)
        if (p->fast_bf16) {
            score_block_bf16(p, &r, (const uint16_t*)k, next,
                             block_rows(p, &r, p->value_cache, start, elem), start, end,
                             head_dim, scratch->query_bf16, scores);
            continue;
        }
#endif
#if VECTOR_FLOATS == 8
        if (elem == 4) {
            score_block_f32(p, &r, (const float*)k, next, start, end, head_dim, scores);
            continue;
        }
#endif
        score_block(p, &r, k, next, start, end, head_dim, elem, scores);
    }
    softmax_rows(p, &r, scores);
    const int64_t num_floats = (int64_t)(kv_head_end - kv_head_begin) * r.group * head_dim;
    for (int32_t t = 0; t < r.q_len; ++t) {
        const int64_t row = (int64_t)t * p->num_q_heads + (int64_t)kv_head_begin * r.group;
        memset(r.out + row * head_dim, 0, sizeof(float) * num_floats);
    }
    for (int32_t start = first_block_key; start < r.seq_len; start += block_size) {
        const int32_t end = MIN(start + block_size, r.seq_len);
        const char* next =
            end < r.seq_len ? block_rows(p, &r, p->value_cache, end, elem) : after;
        const char* v = block_rows(p, &r, p->value_cache, start, elem);
#if defined(__AVX512BF16__)
        if (p->fast_bf16) {
            value_block_bf16(p, &r, (const uint16_t*)v, start, end, head_dim, scores,
                             scratch->widened_values);
            continue;
        }
#endif
#if VECTOR_FLOATS == 8
        if (elem == 4) {
            value_block_f32(p, &r, (const float*)v, next, start, end, head_dim, scores);
            continue;
        }
#endif
        value_block(p, &r, v, next, start, end, head_dim, elem, scores);
    }
}

// Head sizes known at compile time get fully unrolled loops; each element type its own code.
static inline void attend_typed(const Problem* p, int32_t req, int32_t kv_head_begin,
                                int32_t kv_head_end, int32_t head_dim, int32_t elem,
                                const Scratch* scratch, const char* after) {
    switch (head_dim) {
        case 64:
            attend_request(p, req, kv_head_begin, kv_head_end, 64, elem, scratch, after);
            break;
        case 128:
            attend_request(p, req, kv_head_begin, kv_head_end, 128, elem, scratch, after);
            break;
        default:
            attend_request(p, req, kv_head_begin, kv_head_end, head_dim, elem, scratch, after);
    }
}

// Request `req`'s KV heads kv_head_begin..kv_head_end-1; `after` (or NULL) is the first key
// block of the item this thread attends next, prefetched along the item's last value block.
static inline void attend(const Problem* p, int32_t req, int32_t kv_head_begin,
                          int32_t kv_head_end, int32_t head_dim, int32_t cache_is_bf16,
                          const Scratch* scratch, const char* after) {
    if (cache_is_bf16)
        attend_typed(p, req, kv_head_begin, kv_head_end, head_dim, 2, scratch, after);
    else
        attend_typed(p, req, kv_head_begin, kv_head_end, head_dim, 4, scratch, after);
}

// The cached rows of request `req`'s first block (every KV head): what its first pass reads
// first (a sliding window may start later; then the prefetch is merely wasted).
static const char* first_key_block(const Problem* p, int32_t req, int32_t head_dim,
                                   int32_t elem) {
    const int64_t block = p->block_table[(int64_t)req * p->block_table_stride];
    return p->key_cache + block * p->block_size * p->num_kv_heads * head_dim * elem;
}

// Items [*begin, *end) of thread `part` of `parts`: contiguous runs of about equal cost (each
// item reads its request's cache once and scores q_len rows against it), so that a thread
// knows its next item and can prefetch it.
static void thread_items(const Problem* p, const int32_t* requests, int64_t num_items,
                         int32_t split, int part, int parts, int64_t* begin, int64_t* end) {
    int64_t total = 0;
    for (int64_t item = 0; item < num_items; ++item) {
        const int32_t req = requests[item / split];
        total += (int64_t)p->seq_lens[req] * (1 + p->query_start[req + 1] - p->query_start[req]);
    }
    const int64_t low = total * part / parts, high = total * (part + 1) / parts;
    int64_t so_far = 0;
    *begin = *end = num_items;
    for (int64_t item = 0; item < num_items; ++item) {
        const int32_t req = requests[item / split];
        const int64_t cost =
            (int64_t)p->seq_lens[req] * (1 + p->query_start[req + 1] - p->query_start[req]);
        const int64_t middle = so_far + cost / 2;  // an item goes where its middle falls
        if (*begin == num_items && middle >= low) *begin = item;
        if (middle >= high) {
            *end = item;
            break;
        }
        so_far += cost;
    }
    if (*end < *begin) *end = *begin;
}

// The head_dim the vector paths need a multiple of (the caller checks before calling).
int paged_attention_vector_floats(void) { return VECTOR_FLOATS; }

// Whether the bf16 fast path applies: compiled with AVX512_BF16, a bf16 cache, queries that
// hold bf16 values, head_dim a multiple of 32 and blocks a multiple of 16 tokens.
static int use_fast_bf16(int32_t cache_is_bf16, int32_t query_is_bf16, int32_t head_dim,
                         int32_t block_size) {
#if defined(__AVX512BF16__)
    return cache_is_bf16 && query_is_bf16 && head_dim % 32 == 0 && block_size % FAST_KEYS == 0;
#else
    (void)cache_is_bf16, (void)query_is_bf16, (void)head_dim, (void)block_size;
    return 0;
#endif
}

// Writes each token's key and value rows (`row_bytes` each: its KV heads side by side) into
// the cache [2, num_blocks * block_size slots, row] at slots[t]; tokens whose slot is negative
// are skipped. Key and value rows are `key_stride` / `value_stride` bytes apart (views of a
// fused qkv projection); the values half starts `half_bytes` into the cache.
void reshape_and_cache(const char* key, int64_t key_stride, const char* value,
                       int64_t value_stride, char* kv_cache, int64_t half_bytes,
                       const int64_t* slots, int64_t num_tokens, int64_t row_bytes) {
    for (int64_t t = 0; t < num_tokens; ++t) {
        if (slots[t] < 0) continue;
        memcpy(kv_cache + slots[t] * row_bytes, key + t * key_stride, row_bytes);
        memcpy(kv_cache + half_bytes + slots[t] * row_bytes, value + t * value_stride, row_bytes);
    }
}

// Whether a bf16 model's attention (bf16 cache and queries) of these shapes takes the bf16 fast
// path in this build; the CPU backend sends it every query length when it does.
int paged_attention_bf16_fast_path(int32_t head_dim, int32_t block_size) {
    return use_fast_bf16(1, 1, head_dim, block_size);
}

static int32_t max_query_len(const int32_t* query_start, const int32_t* requests,
                             int32_t num_requests) {
    int32_t longest = 0;
    for (int32_t i = 0; i < num_requests; ++i) {
        const int32_t q_len = query_start[requests[i] + 1] - query_start[requests[i]];
        longest = q_len > longest ? q_len : longest;
    }
    return longest;
}

// Attends the requests listed in `a->requests` (indices into seq_lens / query_start); other
// rows of `a->out` are left untouched. The cache holds float32, or bf16 when `cache_is_bf16`;
// `query_is_bf16` says the float32 queries hold bf16 values (a bf16 model's), which lets the
// bf16 fast path run. `max_rows_x_len` bounds q_len * num_q_heads * seq_len over the listed
// requests (the scratch each thread allocates for its scores). Returns 0, or -1 when an
// allocation failed.
int paged_attention(const AttentionArgs* a, int64_t max_rows_x_len) {
    const int32_t cache_is_bf16 = a->cache_is_bf16, head_dim = a->head_dim;
    const int32_t block_size = a->block_size, num_q_heads = a->num_q_heads;
    const int32_t num_kv_heads = a->num_kv_heads, num_requests = a->num_requests;
    const int32_t num_threads = a->num_threads;
    const int32_t* requests = a->requests;
    const int64_t elem = cache_is_bf16 ? 2 : 4;
    const int64_t half_bytes = a->num_cache_blocks * block_size * num_kv_heads * head_dim * elem;
    const char* keys = (const char*)a->kv_cache;
    const int32_t fast = use_fast_bf16(cache_is_bf16, a->query_is_bf16, head_dim, block_size);
    const Problem problem = {a->query,       keys,        keys + half_bytes, a->block_table,
                             a->seq_lens,    a->query_start, a->out,        a->block_table_stride,
                             block_size,     num_q_heads, num_kv_heads,     a->scale,
                             fast,           a->sliding_window};
    const int64_t query_elements =
        fast ? (int64_t)max_query_len(a->query_start, requests, num_requests) * num_q_heads *
                   head_dim
             : 0;
    // A work item is a request, or with fewer requests than threads one KV head of one (a
    // single long decode would otherwise run on one thread).
    const int32_t split = num_threads > 1 && num_requests < num_threads ? num_kv_heads : 1;
    const int64_t num_items = (int64_t)num_requests * split;
    int failed = 0;
    RunClaims claims[num_threads > 1 ? num_threads : 1];
    init_claims(claims, num_threads > 1 ? num_threads : 1);
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && num_items > 1)
    {
        const Scratch scratch = {
            malloc(sizeof(float) * (max_rows_x_len > 0 ? max_rows_x_len : 1)),
            fast ? malloc(sizeof(uint16_t) * (query_elements > 0 ? query_elements : 1)) : NULL,
            fast ? malloc(sizeof(float) * block_size * head_dim) : NULL,
        };
        const int ok = scratch.scores != NULL &&
                       (!fast || (scratch.query_bf16 != NULL && scratch.widened_values != NULL));
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        // Its own run of items in order, then what is left of the others' from their ends
        // (work_sharing.h); `after` is the item it attends next in that direction.
        const int parts = omp_get_num_threads(), part = omp_get_thread_num();
        for (int other = 0; ok && other < parts; ++other) {
            const int run = (part + other) % parts, from_front = other == 0;
            int64_t first_item, end_item;
            thread_items(&problem, requests, num_items, split, run, parts, &first_item, &end_item);
            for (int64_t i; (i = claim(&claims[run], end_item - first_item, from_front)) >= 0;) {
                const int64_t item = first_item + i, neighbour = from_front ? item + 1 : item - 1;
                const int32_t begin = split == 1 ? 0 : (int32_t)(item % split);
                const int32_t end = split == 1 ? num_kv_heads : begin + 1;
                const char* after = neighbour >= first_item && neighbour < end_item
                                        ? first_key_block(&problem, requests[neighbour / split],
                                                          head_dim, (int32_t)elem)
                                        : NULL;
                attend(&problem, requests[item / split], begin, end, head_dim, cache_is_bf16,
                       &scratch, after);
            }
        }
        free(scratch.scores);
        free(scratch.query_bf16);
        free(scratch.widened_values);
    }
    return failed ? -1 : 0;
}

// sizeof(AttentionArgs), and the byte offset of each of its fields in declaration order in
// offsets[0 .. capacity): the tests compare them with the ctypes.Structure's.
int64_t attention_args_layout(int64_t* offsets, int32_t capacity) {
    const int64_t all[] = {
        offsetof(AttentionArgs, query),          offsetof(AttentionArgs, kv_cache),
        offsetof(AttentionArgs, block_table),    offsetof(AttentionArgs, seq_lens),
        offsetof(AttentionArgs, query_start),    offsetof(AttentionArgs, requests),
        offsetof(AttentionArgs, out),            offsetof(AttentionArgs, block_table_stride),
        offsetof(AttentionArgs, num_cache_blocks), offsetof(AttentionArgs, num_requests),
        offsetof(AttentionArgs, block_size),     offsetof(AttentionArgs, num_q_heads),
        offsetof(AttentionArgs, num_kv_heads),   offsetof(AttentionArgs, head_dim),
        offsetof(AttentionArgs, cache_is_bf16),  offsetof(AttentionArgs, query_is_bf16),
        offsetof(AttentionArgs, sliding_window), offsetof(AttentionArgs, scale),
        offsetof(AttentionArgs, num_threads),
    };
    const int32_t count = (int32_t)(sizeof(all) / sizeof(all[0]));
    for (int32_t i = 0; i < count && i < capacity; ++i) offsets[i] = all[i];
    return (int64_t)sizeof(AttentionArgs);
}
