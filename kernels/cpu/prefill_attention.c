// Prefill attention on CPU for long queries over a float32 paged cache, with AVX2 and FMA: the
// prompts (and long chunks) of a float32 model on CPUs without AVX-512, where attention over
// hundreds of keys is matmul work and the decode kernel's dot products (paged_attention.c)
// would leave most of the FMA units idle.
//
// Flash-attention order, one work item per (request, tile of query tokens, KV head): the
// item's rows are its tokens x the KV head's query heads (token-major), gathered once; keys go
// by in blocks of KEYS_PER_PASS, each gathered from the paged cache [2, num_blocks, block_size,
// H_kv, D] into two contiguous panels (K transposed to [D][keys], V as [keys][D]) that every
// row of the item then reads from cache. Scores S = Q K^T and the update O += P V run on the
// same 6 x 16 register tiles as the float32 matmul (6 rows x two 8-float vectors of keys or of
// head dims, 12 sums in registers), and an online softmax keeps each row's running maximum and
// sum, so no row of scores longer than one block of keys is ever stored.
//
// Masks: query token t of a request with `context` cached tokens before its query sits at
// position context + t and sees keys up to it (bottom-right causal), and with a sliding window
// W only keys after position - W. Keys no row of the item sees are never gathered, so slots
// past a request's length or before every row's window (freed blocks) are never read; a key
// one row sees and another does not is real data and gets weight exactly 0 for the other (a
// NaN in its value row would still reach the other through 0 x NaN: only a model that already
// produced NaN has one there).
// Built by kernels/cpu/kernel_loader.py with `cc -O3 -march=native -fopenmp`.

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention_args.h"
#include "scalar_math.h"

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define PREFILL_ATTENTION_BUILT 1
#include <immintrin.h>
#include <math.h>
#include <omp.h>

#define TILE_ROWS 6
#define TILE_COLUMNS 16          // two 8-float vectors
#define KEYS_PER_PASS 64         // keys gathered and scored at once
#define ROWS_PER_ITEM 96         // query rows (tokens x group) an item aims for
#define MAX_HEAD_DIM 256

typedef struct {
    const float* query;  // [T, H_q, D]
    const float* key_cache;
    const float* value_cache;
    const int32_t* block_table;
    const int32_t* seq_lens;
    const int32_t* query_start;
    float* out;  // [T, H_q, D]
    int64_t block_table_stride;
    int32_t block_size;
    int32_t num_q_heads;
    int32_t num_kv_heads;
    int32_t head_dim;
    float scale;
    int32_t sliding_window;  // > 0: position p sees keys p - window + 1 .. p
} Problem;

// One work item: `tokens` query tokens of request `request` from its query token `first_token`
// on, against KV head `kv_head`.
typedef struct {
    int32_t request;
    int32_t first_token;
    int32_t tokens;
    int32_t kv_head;
} Item;

// One thread's panels and running state, sized for the largest item.
typedef struct {
    float* rows;    // [R][D]: the item's query rows
    float* keys_t;  // [D][KEYS_PER_PASS]: the block's keys, transposed
    float* values;  // [KEYS_PER_PASS][D]
    float* scores;  // [R][KEYS_PER_PASS], then the block's softmax weights
    float* acc;     // [R][D]: unnormalized output rows
    float* row_max;
    float* row_sum;
    float* zero_row;  // [D] zeros: the keys past a pass's last
} Scratch;

static inline float max_float(float a, float b) { return a > b ? a : b; }

// The cached row of token `token` of a request (its block table row `blocks`), head `kv_head`.
static inline const float* cached_row(const Problem* p, const float* cache, const int32_t* blocks,
                                      int32_t token, int32_t kv_head) {
    const int64_t slot =
        (int64_t)blocks[token / p->block_size] * p->block_size + token % p->block_size;
    return cache + (slot * p->num_kv_heads + kv_head) * p->head_dim;
}

// out[r][c] = sum_k a[r][k] * b[k][c] for `num_rows` (a compile-time constant once inlined)
// rows and one tile of 16 columns of b, then stored into (or added to, when `accumulate`) out.
// Always inlined: left to itself GCC makes one out-of-line copy per `accumulate` with
// `num_rows` a run-time value, testing it five times per k in the inner loop.
static inline __attribute__((always_inline)) void tile(const float* a, int64_t a_stride,
                                                       const float* b, int64_t b_stride,
                                                       int32_t k, float* out, int64_t out_stride,
                                                       int accumulate, const int num_rows) {
    __m256 lo[TILE_ROWS], hi[TILE_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < num_rows; ++r) {
        lo[r] = accumulate ? _mm256_loadu_ps(out + r * out_stride) : _mm256_setzero_ps();
        hi[r] = accumulate ? _mm256_loadu_ps(out + r * out_stride + 8) : _mm256_setzero_ps();
    }
    for (int32_t i = 0; i < k; ++i) {
        const __m256 b_lo = _mm256_loadu_ps(b + i * b_stride);
        const __m256 b_hi = _mm256_loadu_ps(b + i * b_stride + 8);
#pragma GCC unroll 8
        for (int r = 0; r < num_rows; ++r) {
            const __m256 ai = _mm256_broadcast_ss(a + r * a_stride + i);
            lo[r] = _mm256_fmadd_ps(ai, b_lo, lo[r]);
            hi[r] = _mm256_fmadd_ps(ai, b_hi, hi[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < num_rows; ++r) {
        _mm256_storeu_ps(out + r * out_stride, lo[r]);
        _mm256_storeu_ps(out + r * out_stride + 8, hi[r]);
    }
}

// out [rows, columns] (=|+=) a [rows, k] b [k, columns]; columns a multiple of 16; rows split
// evenly over tiles of at most 6 (see f32_matmul.c).
static void matmul(const float* a, int64_t a_stride, const float* b, int64_t b_stride, int32_t k,
                   float* out, int64_t out_stride, int32_t rows, int32_t columns,
                   int accumulate) {
    const int32_t num_tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
    for (int32_t t = 0; t < num_tiles; ++t) {
        const int32_t row = rows * t / num_tiles;
        const int num_rows = rows * (t + 1) / num_tiles - row;
        for (int32_t c = 0; c < columns; c += TILE_COLUMNS) {
            const float* ar = a + row * a_stride;
            float* o = out + row * out_stride + c;
            switch (num_rows) {
                case 1: tile(ar, a_stride, b + c, b_stride, k, o, out_stride, accumulate, 1); break;
                case 2: tile(ar, a_stride, b + c, b_stride, k, o, out_stride, accumulate, 2); break;
                case 3: tile(ar, a_stride, b + c, b_stride, k, o, out_stride, accumulate, 3); break;
                case 4: tile(ar, a_stride, b + c, b_stride, k, o, out_stride, accumulate, 4); break;
                case 5: tile(ar, a_stride, b + c, b_stride, k, o, out_stride, accumulate, 5); break;
                default: tile(ar, a_stride, b + c, b_stride, k, o, out_stride, accumulate, 6);
            }
        }
    }
}

// 8 rows of 8 floats (rows[i] + d) stored as 8 columns of `out` (column i of row d at
// out[d * stride + i]): the usual unpack/shuffle/permute transpose.
static inline void transpose_8x8(const float* const rows[8], int32_t d, float* out,
                                 int64_t stride) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(rows[i] + d);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; ++i) {
        _mm256_storeu_ps(out + (d + i) * stride, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_storeu_ps(out + (d + i + 4) * stride, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
    }
}

// Keys first_key.. (num_keys of them) of the item's KV head into the two panels; key columns
// past num_keys are zero (read from the zero row), so their scores are finite (and masked).
static void gather_block(const Problem* p, const int32_t* blocks, int32_t kv_head,
                         int32_t first_key, int32_t num_keys, const Scratch* s) {
    const int32_t head_dim = p->head_dim;
    for (int32_t j = 0; j < num_keys; ++j)
        memcpy(s->values + (int64_t)j * head_dim,
               cached_row(p, p->value_cache, blocks, first_key + j, kv_head),
               sizeof(float) * head_dim);
    for (int32_t j0 = 0; j0 < KEYS_PER_PASS; j0 += 8) {
        const float* rows[8];
        for (int i = 0; i < 8; ++i)
            rows[i] = j0 + i < num_keys
                          ? cached_row(p, p->key_cache, blocks, first_key + j0 + i, kv_head)
                          : s->zero_row;
        for (int32_t d = 0; d < head_dim; d += 8)
            transpose_8x8(rows, d, s->keys_t + j0, KEYS_PER_PASS);
    }
}

// Turns row r's scores for keys first_key.. into softmax weights against its running maximum
// (updated), rescaling the row's sums and output by how much the maximum grew. `lo`..`hi` are
// the keys the row sees (inclusive); the others get weight 0.
static void softmax_block_row(const Problem* p, const Scratch* s, int32_t r, int32_t first_key,
                              int32_t num_keys, int32_t lo, int32_t hi) {
    float* scores = s->scores + (int64_t)r * KEYS_PER_PASS;
    const int32_t begin = lo > first_key ? lo - first_key : 0;
    const int32_t end = hi - first_key + 1 < num_keys ? hi - first_key + 1 : num_keys;
    if (begin >= end) {
        memset(scores, 0, sizeof(float) * num_keys);
        return;
    }
    const float scale = p->scale;
    float block_max = -INFINITY;
#pragma omp simd reduction(max : block_max)
    for (int32_t j = begin; j < end; ++j) block_max = max_float(block_max, scores[j] * scale);
    const float old_max = s->row_max[r];
    const float new_max = max_float(old_max, block_max);
    // exp(-inf) is 0: a row's first visible block leaves its zero sums as they are.
    const float rescale = old_max == -INFINITY ? 0.0f : exp_nonpositive(old_max - new_max);
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int32_t j = 0; j < num_keys; ++j) {
        const float weight = exp_nonpositive(scores[j] * scale - new_max);
        scores[j] = j >= begin && j < end ? weight : 0.0f;
        total += scores[j];
    }
    s->row_max[r] = new_max;
    s->row_sum[r] = s->row_sum[r] * rescale + total;
    if (rescale != 1.0f) {
        float* acc = s->acc + (int64_t)r * p->head_dim;
#pragma omp simd
        for (int32_t d = 0; d < p->head_dim; ++d) acc[d] *= rescale;
    }
}

static void attend_item(const Problem* p, const Item* item, const Scratch* s) {
    const int32_t group = p->num_q_heads / p->num_kv_heads;
    const int32_t head_dim = p->head_dim;
    const int32_t q_begin = p->query_start[item->request];
    const int32_t q_len = p->query_start[item->request + 1] - q_begin;
    const int32_t seq_len = p->seq_lens[item->request];
    const int32_t context = seq_len - q_len;
    const int32_t* blocks = p->block_table + (int64_t)item->request * p->block_table_stride;
    const int32_t rows = item->tokens * group;
    const int32_t first_position = context + item->first_token;
    const int32_t last_position = first_position + item->tokens - 1;
    const int32_t window = p->sliding_window;
    for (int32_t t = 0; t < item->tokens; ++t) {
        const float* q = p->query + ((int64_t)(q_begin + item->first_token + t) * p->num_q_heads +
                                     (int64_t)item->kv_head * group) * head_dim;
        memcpy(s->rows + (int64_t)t * group * head_dim, q, sizeof(float) * group * head_dim);
    }
    for (int32_t r = 0; r < rows; ++r) {
        s->row_max[r] = -INFINITY;
        s->row_sum[r] = 0.0f;
    }
    memset(s->acc, 0, sizeof(float) * rows * head_dim);
    const int32_t first_key = window > 0 && first_position + 1 > window
                                  ? first_position + 1 - window
                                  : 0;
    for (int32_t key0 = first_key; key0 <= last_position; key0 += KEYS_PER_PASS) {
        const int32_t num_keys = last_position + 1 - key0 < KEYS_PER_PASS
                                     ? last_position + 1 - key0
                                     : KEYS_PER_PASS;
        gather_block(p, blocks, item->kv_head, key0, num_keys, s);
        const int32_t columns = (num_keys + TILE_COLUMNS - 1) / TILE_COLUMNS * TILE_COLUMNS;
        matmul(s->rows, head_dim, s->keys_t, KEYS_PER_PASS, head_dim, s->scores, KEYS_PER_PASS,
               rows, columns, 0);
        for (int32_t r = 0; r < rows; ++r) {
            const int32_t position = first_position + r / group;
            const int32_t lo = window > 0 && position + 1 > window ? position + 1 - window : 0;
            softmax_block_row(p, s, r, key0, num_keys, lo, position);
        }
        matmul(s->scores, KEYS_PER_PASS, s->values, head_dim, num_keys, s->acc, head_dim, rows,
               head_dim, 1);
    }
    for (int32_t r = 0; r < rows; ++r) {
        const int32_t t = r / group, g = r % group;
        float* o = p->out + ((int64_t)(q_begin + item->first_token + t) * p->num_q_heads +
                             (int64_t)item->kv_head * group + g) * head_dim;
        const float inverse = 1.0f / s->row_sum[r];
        const float* acc = s->acc + (int64_t)r * head_dim;
        for (int32_t d = 0; d < head_dim; ++d) o[d] = acc[d] * inverse;
    }
}

static int allocate(Scratch* s, int64_t rows, int32_t head_dim) {
    s->rows = malloc(sizeof(float) * rows * head_dim);
    s->keys_t = malloc(sizeof(float) * head_dim * KEYS_PER_PASS);
    s->values = malloc(sizeof(float) * KEYS_PER_PASS * head_dim);
    s->scores = malloc(sizeof(float) * rows * KEYS_PER_PASS);
    s->acc = malloc(sizeof(float) * rows * head_dim);
    s->row_max = malloc(sizeof(float) * rows);
    s->row_sum = malloc(sizeof(float) * rows);
    s->zero_row = calloc(head_dim, sizeof(float));
    return s->rows && s->keys_t && s->values && s->scores && s->acc && s->row_max && s->row_sum &&
           s->zero_row;
}

static void release(Scratch* s) {
    free(s->rows), free(s->keys_t), free(s->values), free(s->scores);
    free(s->acc), free(s->row_max), free(s->row_sum), free(s->zero_row);
}
#endif

// Query tokens per work item for a GQA group of `group` query heads per KV head (so an item
// has about ROWS_PER_ITEM rows); 0 where the kernel is not built or cannot take the head size.
int prefill_attention_tile_tokens(int32_t group, int32_t head_dim) {
#if defined(PREFILL_ATTENTION_BUILT)
    if (group < 1 || head_dim % TILE_COLUMNS != 0 || head_dim > MAX_HEAD_DIM) return 0;
    return group >= ROWS_PER_ITEM ? 1 : ROWS_PER_ITEM / group;
#else
    (void)group, (void)head_dim;
    return 0;
#endif
}

// Attends the `a->num_requests` requests listed in `a->requests` (indices into seq_lens and
// query_start; their rows of `out` only) over the float32 cache [2, num_cache_blocks,
// block_size, H_kv, D]; queries and outputs float32 [T, H_q, D]. Items run over
// `num_threads` OpenMP threads. Returns 0, -1 when an allocation failed, -2 when the kernel
// is not built for these shapes (prefill_attention_tile_tokens is 0).
int prefill_attention(const AttentionArgs* a) {
#if defined(PREFILL_ATTENTION_BUILT)
    const int32_t num_kv_heads = a->num_kv_heads, head_dim = a->head_dim;
    const int32_t num_requests = a->num_requests, num_threads = a->num_threads;
    const int32_t* requests = a->requests;
    const int32_t* query_start = a->query_start;
    const int32_t group = a->num_q_heads / num_kv_heads;
    const int32_t tile_tokens = prefill_attention_tile_tokens(group, head_dim);
    if (tile_tokens == 0) return -2;
    const float* keys = (const float*)a->kv_cache;
    const Problem problem = {
        a->query, keys, keys + a->num_cache_blocks * a->block_size * num_kv_heads * head_dim,
        a->block_table, a->seq_lens, query_start, a->out, a->block_table_stride, a->block_size,
        a->num_q_heads, num_kv_heads, head_dim, a->scale, a->sliding_window,
    };
    int64_t num_items = 0;
    for (int32_t i = 0; i < num_requests; ++i) {
        const int32_t q_len = query_start[requests[i] + 1] - query_start[requests[i]];
        if (q_len > 0) num_items += (int64_t)(q_len + tile_tokens - 1) / tile_tokens * num_kv_heads;
    }
    Item* items = malloc(sizeof(Item) * (num_items > 0 ? num_items : 1));
    if (items == NULL) return -1;
    int64_t n = 0;
    for (int32_t i = 0; i < num_requests; ++i) {
        const int32_t q_len = query_start[requests[i] + 1] - query_start[requests[i]];
        if (q_len <= 0) continue;
        // The heaviest tiles (last tokens: the most keys) first, so threads finish together.
        for (int32_t first = (q_len - 1) / tile_tokens * tile_tokens; first >= 0;
             first -= tile_tokens)
            for (int32_t h = 0; h < num_kv_heads; ++h)
                items[n++] = (Item){requests[i], first,
                                    q_len - first < tile_tokens ? q_len - first : tile_tokens, h};
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && num_items > 1)
    {
        Scratch scratch;
        const int ok = allocate(&scratch, (int64_t)tile_tokens * group, head_dim);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_items; ++i)
            if (ok) attend_item(&problem, &items[i], &scratch);
        release(&scratch);
    }
    free(items);
    return failed ? -1 : 0;
#else
    (void)a;
    return -2;
#endif
}
