// Paged attention on CPU for requests with short queries (decodes, small chunks), float32.
//
// Reads K/V straight from the paged cache [2, num_blocks, block_size, H_kv, D] through the
// block table: no gather copy, no padding, and slots past a request's length (or past a query
// token's causal limit) are never read, so NaN there cannot reach the output.
//
// One work item is one request: it reads the request's K tokens in order (a token's KV heads are
// contiguous), each K vector serving its whole query-head group (GQA) and filling one score row
// per (query token, query head); then softmax per row; then one pass over V accumulates the
// outputs. Requests run in parallel over `num_threads` OpenMP threads (1 = the calling thread).
// Decoding is bound by reading the cache: the next block of a request is prefetched while one
// is read, and exp is a vectorizable polynomial.
// Built by kernels/cpu_kernel_loader.py with `cc -O3 -march=native -fopenmp`.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const float* query;          // [T, H_q, D]
    const float* key_cache;      // [num_blocks, block_size, H_kv, D]
    const float* value_cache;    // same shape, right after the keys
    const int32_t* block_table;  // [B, block_table_stride]
    const int32_t* seq_lens;     // [B]: cached tokens after this step's write
    const int32_t* query_start;  // [B + 1]
    float* out;                  // [T, H_q, D]
    int64_t block_table_stride;
    int32_t block_size;
    int32_t num_q_heads;
    int32_t num_kv_heads;
    float scale;
} Problem;

static inline float dot(const float* a, const float* b, int32_t n) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int32_t d = 0; d < n; ++d) sum += a[d] * b[d];
    return sum;
}

// Asks for the `num_floats` at `address` to be brought into cache (a hint; GCC and Clang).
static inline void prefetch(const float* address, int64_t num_floats) {
    for (int64_t offset = 0; offset < num_floats; offset += 16) __builtin_prefetch(address + offset);
}

static inline void add_scaled(float* acc, const float* v, float weight, int32_t n) {
#pragma omp simd
    for (int32_t d = 0; d < n; ++d) acc[d] += weight * v[d];
}

// exp(x) for x <= 0 to about 2 ulp, in a form the compiler vectorizes (glibc's expf only
// vectorizes under -ffast-math, which would also drop the IEEE semantics the rest relies on).
static inline float exp_nonpositive(float x) {
    x = x > -87.0f ? x : -87.0f;
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

// Scores of one cached token (all its KV heads contiguous at `k`) for query tokens
// first_token..q_len-1: row (t * H_q + h * group + g) gets query head h * group + g of token t.
static inline void score_key(const float* query, const float* k, float* scores, int64_t key,
                             int64_t seq_len, int32_t first_token, int32_t q_len,
                             int32_t num_kv_heads, int32_t group, int32_t head_dim, float scale) {
    const int32_t num_q_heads = num_kv_heads * group;
    for (int32_t t = first_token; t < q_len; ++t) {
        for (int32_t h = 0; h < num_kv_heads; ++h) {
            const int64_t first_row = (int64_t)t * num_q_heads + (int64_t)h * group;
            for (int32_t g = 0; g < group; ++g) {
                const int64_t row = first_row + g;
                scores[row * seq_len + key] =
                    dot(query + row * head_dim, k + (int64_t)h * head_dim, head_dim) * scale;
            }
        }
    }
}

// The same walk for values: out rows accumulate weight * V of this token.
static inline void accumulate_value(const float* v, const float* scores, float* out, int64_t key,
                                    int64_t seq_len, int32_t first_token, int32_t q_len,
                                    int32_t num_kv_heads, int32_t group, int32_t head_dim) {
    const int32_t num_q_heads = num_kv_heads * group;
    for (int32_t t = first_token; t < q_len; ++t) {
        for (int32_t h = 0; h < num_kv_heads; ++h) {
            const int64_t first_row = (int64_t)t * num_q_heads + (int64_t)h * group;
            for (int32_t g = 0; g < group; ++g) {
                const int64_t row = first_row + g;
                add_scaled(out + row * head_dim, v + (int64_t)h * head_dim,
                           scores[row * seq_len + key], head_dim);
            }
        }
    }
}

// Each score row becomes its softmax over the keys its query token sees.
static inline void softmax_rows(float* scores, int64_t seq_len, int32_t context, int32_t q_len,
                                int32_t num_q_heads) {
    for (int32_t t = 0; t < q_len; ++t) {
        const int32_t visible = context + t + 1;
        for (int32_t head = 0; head < num_q_heads; ++head) {
            float* row = scores + ((int64_t)t * num_q_heads + head) * seq_len;
            float max_score = row[0];
#pragma omp simd reduction(max : max_score)
            for (int32_t key = 1; key < visible; ++key)
                max_score = row[key] > max_score ? row[key] : max_score;
            float total = 0.0f;
#pragma omp simd reduction(+ : total)
            for (int32_t key = 0; key < visible; ++key) {
                row[key] = exp_nonpositive(row[key] - max_score);
                total += row[key];
            }
            const float inverse = 1.0f / total;
#pragma omp simd
            for (int32_t key = 0; key < visible; ++key) row[key] *= inverse;
        }
    }
}

// Request `req`: its query token t sits at position context + t and sees keys 0..context + t.
// `scores` holds q_len * H_q * seq_len floats. Keys are read token by token, block by block
// (a token's KV heads are contiguous), each K/V vector serving its whole query-head group.
static inline void attend_request(const Problem* p, int32_t req, int32_t head_dim,
                                  float* scores) {
    const int32_t q_begin = p->query_start[req];
    const int32_t q_len = p->query_start[req + 1] - q_begin;
    const int32_t seq_len = p->seq_lens[req];
    const int32_t context = seq_len - q_len;
    const int32_t num_kv_heads = p->num_kv_heads;
    const int32_t group = p->num_q_heads / num_kv_heads;
    const int32_t block_size = p->block_size;
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;
    const int32_t* blocks = p->block_table + (int64_t)req * p->block_table_stride;
    const float* query = p->query + (int64_t)q_begin * p->num_q_heads * head_dim;
    float* out = p->out + (int64_t)q_begin * p->num_q_heads * head_dim;

    const int32_t num_blocks = (seq_len + block_size - 1) / block_size;
    // While one block is read, the same token of the next block is prefetched: blocks are
    // scattered, so the hardware prefetcher cannot follow from one to the next.
    for (int32_t start = 0, b = 0; start < seq_len; start += block_size, ++b) {
        const float* k = p->key_cache + (int64_t)blocks[b] * block_size * token_stride;
        const float* next = b + 1 < num_blocks
            ? p->key_cache + (int64_t)blocks[b + 1] * block_size * token_stride : NULL;
        const int32_t end = start + block_size < seq_len ? start + block_size : seq_len;
        for (int32_t key = start; key < end; ++key, k += token_stride) {
            if (next != NULL) prefetch(next + (int64_t)(key - start) * token_stride, token_stride);
            const int32_t first_token = key > context ? key - context : 0;
            score_key(query, k, scores, key, seq_len, first_token, q_len, num_kv_heads, group,
                      head_dim, p->scale);
        }
    }
    softmax_rows(scores, seq_len, context, q_len, p->num_q_heads);
    memset(out, 0, sizeof(float) * q_len * p->num_q_heads * head_dim);
    for (int32_t start = 0, b = 0; start < seq_len; start += block_size, ++b) {
        const float* v = p->value_cache + (int64_t)blocks[b] * block_size * token_stride;
        const float* next = b + 1 < num_blocks
            ? p->value_cache + (int64_t)blocks[b + 1] * block_size * token_stride : NULL;
        const int32_t end = start + block_size < seq_len ? start + block_size : seq_len;
        for (int32_t key = start; key < end; ++key, v += token_stride) {
            if (next != NULL) prefetch(next + (int64_t)(key - start) * token_stride, token_stride);
            const int32_t first_token = key > context ? key - context : 0;
            accumulate_value(v, scores, out, key, seq_len, first_token, q_len, num_kv_heads,
                             group, head_dim);
        }
    }
}

// Head sizes known at compile time get fully unrolled dot products.
static inline void attend(const Problem* p, int32_t req, int32_t head_dim, float* scores) {
    switch (head_dim) {
        case 64: attend_request(p, req, 64, scores); break;
        case 128: attend_request(p, req, 128, scores); break;
        default: attend_request(p, req, head_dim, scores);
    }
}

// Attends the requests listed in `requests` (indices into seq_lens / query_start); other
// rows of `out` are left untouched. Returns 0, or -1 when scratch memory ran out.
// `max_rows_x_len` bounds q_len * num_q_heads * seq_len over the listed requests (the scratch
// each thread allocates for its scores).
int paged_attention_f32(const float* query, const float* kv_cache, const int32_t* block_table,
                        int64_t block_table_stride, const int32_t* seq_lens,
                        const int32_t* query_start, const int32_t* requests,
                        int32_t num_requests, int64_t num_cache_blocks, int32_t block_size,
                        int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim, float scale,
                        int64_t max_rows_x_len, float* out, int32_t num_threads) {
    const int64_t cache_half = num_cache_blocks * block_size * num_kv_heads * head_dim;
    const Problem problem = {query,      kv_cache,     kv_cache + cache_half, block_table,
                             seq_lens,   query_start,  out,                   block_table_stride,
                             block_size, num_q_heads, num_kv_heads,          scale};
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && num_requests > 1)
    {
        float* scores = malloc(sizeof(float) * (max_rows_x_len > 0 ? max_rows_x_len : 1));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int32_t i = 0; i < num_requests; ++i) {
            if (scores != NULL) attend(&problem, requests[i], head_dim, scores);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
