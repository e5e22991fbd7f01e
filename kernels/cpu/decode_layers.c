// A Llama decoder stack's layers in one call, from the token ids to the final norm: the
// embedding lookup and the rotary angles of the step's positions, then for every layer the add + RMSNorm, the qkv projection, rotary, the KV write, paged attention, the o
// projection, the second add + RMSNorm, gate_up with SiLU-and-mul and the down projection, then
// the model's final add + RMSNorm, each through the same C entry point (and so the same
// arithmetic) the Python layers call one at a time. A decode step of
// SmolLM2-135M makes some 300 such calls; from Python each costs tens of microseconds of tensor
// bookkeeping, more than the kernel itself at batch 1 (kernels/cpu/decode_layers.py says when
// the engine takes this path).
//
// Layout: activations are float32 [num_tokens, width] rows, contiguous; the KV cache float32
// [2, num_blocks, block_size, num_kv_heads, head_dim] per layer. Linears are the project's
// kernel weights: GGUF blocks (gguf_matmul.c, one call per segment of one block type) or
// float32 panels (f32_matmul.c, whose gate_up may store silu(gate) * up directly).
// Built by kernels/cpu/kernel_loader.py with the library's other sources.

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "attention_args.h"

// The other sources' entry points this file drives (the library links them together).
void gguf_matmul(const float* x, int64_t x_stride, const uint8_t* w, int32_t type,
                 const float* bias, float* out, int64_t out_stride, int64_t rows, int64_t k,
                 int64_t num_columns, int32_t num_threads);
void f32_matmul(const float* x, int64_t x_stride, const float* packed, const float* bias,
                float* out, int64_t rows, int64_t k, int64_t num_panels, int64_t num_columns,
                int32_t num_threads);
void f32_matmul_silu_and_mul(const float* x, int64_t x_stride, const float* packed,
                             const float* bias, float* out, int64_t rows, int64_t k,
                             int64_t num_pairs, int32_t num_threads);
void fused_add_rms_norm(const void* x, float* residual, const void* weight, void* out,
                        int32_t bf16, int64_t rows, int64_t cols, float eps, int32_t num_threads);
void gguf_dequantize_rows(const uint8_t* w, int32_t type, int64_t k, const int64_t* row_ids,
                          int64_t num_rows, float* out);
void rotary_embedding_neox(void* x, int32_t bf16, int64_t tokens, int64_t row_stride,
                           int32_t num_heads, int32_t head_dim, const float* cos,
                           const float* sin, int32_t num_threads);
void silu_and_mul(const void* x, void* out, int32_t bf16, int64_t rows, int64_t width,
                  int32_t num_threads);
void reshape_and_cache(const char* key, int64_t key_stride, const char* value,
                       int64_t value_stride, char* kv_cache, int64_t half_bytes,
                       const int64_t* slots, int64_t num_tokens, int64_t row_bytes);
int paged_attention(const AttentionArgs* a, int64_t max_rows_x_len);
int lora_shrink_expand(const void* x, void* y, const void* lora_a, const void* lora_b,
                       const int32_t* token_slots, int32_t bf16, int64_t num_tokens,
                       int64_t in_features, int64_t out_features, int64_t width,
                       int64_t num_slots, int32_t num_threads);

#define MAX_SEGMENTS 4
#define LINEAR_GGUF 1
#define LINEAR_F32 2

// One projection: `num_columns` outputs of `k` inputs, plus an optional float32 bias.
// GGUF: `num_segments` runs of rows, segment s being `segment_rows[s]` rows of blocks of
// `types[s]` at `blocks[s]`. F32: `packed` panels (`num_panels` of them); with
// `fuses_silu_and_mul` (a gate_up of two equal halves on panel boundaries) its gated call
// stores silu(gate) * up. `lora_a` [lora_slots, lora_width, k] and `lora_b` [lora_slots,
// num_columns, lora_width] (float32; NULL without LoRA): the adapters' slots of this linear,
// added per token by lora_shrink_expand.c when the step maps tokens to slots.
typedef struct {
    int32_t kind;
    int32_t num_segments;
    const uint8_t* blocks[MAX_SEGMENTS];
    int32_t types[MAX_SEGMENTS];
    int64_t segment_rows[MAX_SEGMENTS];
    const float* packed;
    int64_t num_panels;
    int32_t fuses_silu_and_mul;
    const float* bias;
    int64_t k, num_columns;
    const float* lora_a;
    const float* lora_b;
    int64_t lora_width, lora_slots;
} Linear;

typedef struct {
    const float* input_norm;           // [hidden]
    const float* post_attention_norm;  // [hidden]
    Linear qkv, o, gate_up, down;
    char* kv_cache;  // float32 [2, num_cache_blocks, block_size, num_kv_heads, head_dim]
} DecoderLayer;

// The token embedding: `vocab_rows` rows of `hidden_size`, GGUF blocks of `embedding_type` at
// `embedding_blocks`, or (`embedding_type` EMBEDDING_F32) float32 rows at `embedding_rows`.
#define EMBEDDING_F32 (-1)

typedef struct {
    const DecoderLayer* layers;
    int32_t num_layers, hidden_size, num_q_heads, num_kv_heads, head_dim, intermediate_size;
    float rms_norm_eps, attention_scale;
    const float* final_norm;  // [hidden]: the model's norm after the last layer
    int32_t embedding_type;
    const uint8_t* embedding_blocks;
    const float* embedding_rows;
    int64_t vocab_rows;
} DecoderStack;

// The parts timed when `part_seconds` is not NULL (benchmarks.micro.profile_step reads them).
#define PART_LINEARS 0
#define PART_ATTENTION 1
#define PART_NORMS 2  // both add + RMSNorms and rotary
#define PART_SILU 3
#define PART_GATE_UP_SILU 4  // f32_matmul's gate_up storing silu(gate) * up
#define PART_EMBEDDING 5
#define NUM_PARTS 6

// decode_layers' results besides 0.
#define ERROR_ATTENTION_SCORES (-1)  // attention could not allocate its scores
#define ERROR_TOKEN_ID (-2)          // a token id outside [0, vocab_rows)
#define ERROR_POSITION (-3)          // a position outside [0, angle_rows)

// One step: its tokens, their positions and KV slots, the rotary angle table (row p: the
// cos and sin of position p, as RotaryEmbedding computes them), the attention's metadata
// (`attention`: block table, seq_lens, query_start, the requests and their count, block and
// head shapes; query, out and kv_cache are set per layer here), the scratch rows it writes,
// the threads.
typedef struct {
    int64_t num_tokens;
    const int64_t* token_ids;     // [T]
    const int64_t* positions;     // [T]
    const int64_t* slot_mapping;  // [T]; a negative slot is not written
    const float* angle_cos;       // [angle_rows, head_dim / 2]
    const float* angle_sin;       // [angle_rows, head_dim / 2]
    int64_t angle_rows;
    AttentionArgs attention;
    int64_t attention_scratch_floats;
    float* cos;         // [T, head_dim / 2]: the tokens' rows of angle_cos
    float* sin;         // [T, head_dim / 2]
    float* qkv;         // [T, (H_q + 2 H_kv) D]
    float* query;       // [T, H_q D]
    float* attended;    // [T, H_q D]
    float* gate_up;     // [T, 2 I] (unused where the gate_up fuses)
    float* activation;  // [T, I]
    int32_t num_threads;
    double* part_seconds;  // [NUM_PARTS] accumulated, or NULL
    const int32_t* lora_token_slots;  // [T] each token's adapter slot (-1: none), or NULL
} DecodeStep;

static double seconds_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

// Adds the time since *since to `part` (when timing) and restarts the clock.
static void charge(const DecodeStep* s, int part, double* since) {
    if (s->part_seconds == NULL) return;
    const double now = seconds_now();
    s->part_seconds[part] += now - *since;
    *since = now;
}

// Whether the step's tokens go through adapters of `w`.
static int runs_lora(const Linear* w, const DecodeStep* s) {
    return s->lora_token_slots != NULL && w->lora_a != NULL;
}

// out += the step's adapters of `w` applied to x, as the Python LoRA linears call it.
static void add_lora(const Linear* w, const float* x, float* out, const DecodeStep* s) {
    if (!runs_lora(w, s)) return;
    lora_shrink_expand(x, out, w->lora_a, w->lora_b, s->lora_token_slots, 0, s->num_tokens, w->k,
                       w->num_columns, w->lora_width, w->lora_slots, s->num_threads);
}

// out [T, num_columns] = x [T, k] times `w` (plus its adapters), as the Python linears call
// the same kernels.
static void linear(const Linear* w, const float* x, float* out, const DecodeStep* s) {
    if (w->kind == LINEAR_F32) {
        f32_matmul(x, w->k, w->packed, w->bias, out, s->num_tokens, w->k, w->num_panels,
                   w->num_columns, s->num_threads);
        add_lora(w, x, out, s);
        return;
    }
    int64_t first = 0;
    for (int32_t i = 0; i < w->num_segments; ++i) {
        gguf_matmul(x, w->k, w->blocks[i], w->types[i], w->bias != NULL ? w->bias + first : NULL,
                    out + first, w->num_columns, s->num_tokens, w->k, w->segment_rows[i],
                    s->num_threads);
        first += w->segment_rows[i];
    }
    add_lora(w, x, out, s);
}

// x + attention(norm(x)) of one layer, from `normed` (its input norm's output) onward; the
// residual stream gets the o projection's output added, `normed` the post-attention norm's.
static int attention_block(const DecoderStack* m, const DecoderLayer* layer, DecodeStep* s,
                           float* normed, float* residual, float* projected, double* clock) {
    const int64_t tokens = s->num_tokens, head_dim = m->head_dim;
    const int64_t q_width = m->num_q_heads * head_dim, kv_width = m->num_kv_heads * head_dim;
    const int64_t qkv_width = q_width + 2 * kv_width;
    linear(&layer->qkv, normed, s->qkv, s);
    charge(s, PART_LINEARS, clock);
    rotary_embedding_neox(s->qkv, 0, tokens, qkv_width, m->num_q_heads + m->num_kv_heads,
                          m->head_dim, s->cos, s->sin, s->num_threads);
    charge(s, PART_NORMS, clock);
    const AttentionArgs* a = &s->attention;
    const int64_t row_bytes = kv_width * (int64_t)sizeof(float);
    reshape_and_cache((const char*)(s->qkv + q_width), qkv_width * (int64_t)sizeof(float),
                      (const char*)(s->qkv + q_width + kv_width),
                      qkv_width * (int64_t)sizeof(float), layer->kv_cache,
                      a->num_cache_blocks * a->block_size * row_bytes, s->slot_mapping, tokens,
                      row_bytes);
    for (int64_t t = 0; t < tokens; ++t)
        memcpy(s->query + t * q_width, s->qkv + t * qkv_width, sizeof(float) * q_width);
    s->attention.query = s->query;
    s->attention.out = s->attended;
    s->attention.kv_cache = layer->kv_cache;
    if (paged_attention(&s->attention, s->attention_scratch_floats) != 0) return -1;
    charge(s, PART_ATTENTION, clock);
    linear(&layer->o, s->attended, projected, s);
    charge(s, PART_LINEARS, clock);
    fused_add_rms_norm(projected, residual, layer->post_attention_norm, normed, 0, tokens,
                       m->hidden_size, m->rms_norm_eps, s->num_threads);
    charge(s, PART_NORMS, clock);
    return 0;
}

// down(silu(gate(normed)) * up(normed)) into `projected`.
static void mlp_block(const DecoderLayer* layer, const DecodeStep* s, const float* normed,
                      float* projected, double* clock) {
    const Linear* gate_up = &layer->gate_up;
    if (gate_up->fuses_silu_and_mul && !runs_lora(gate_up, s)) {
        f32_matmul_silu_and_mul(normed, gate_up->k, gate_up->packed, gate_up->bias,
                                s->activation, s->num_tokens, gate_up->k, gate_up->num_panels / 2,
                                s->num_threads);
        charge(s, PART_GATE_UP_SILU, clock);
    } else {
        linear(gate_up, normed, s->gate_up, s);
        charge(s, PART_LINEARS, clock);
        silu_and_mul(s->gate_up, s->activation, 0, s->num_tokens, gate_up->num_columns / 2,
                     s->num_threads);
        charge(s, PART_SILU, clock);
    }
    linear(&layer->down, s->activation, projected, s);
    charge(s, PART_LINEARS, clock);
}

// The tokens' embeddings into out [T, hidden], as VocabParallelEmbedding looks them up (the
// same dequantization of the same blocks, or a copy of float32 rows); ERROR_TOKEN_ID for an id
// outside the vocabulary.
static int embed(const DecoderStack* m, const DecodeStep* s, float* out) {
    const int64_t hidden = m->hidden_size;
    for (int64_t t = 0; t < s->num_tokens; ++t)
        if (s->token_ids[t] < 0 || s->token_ids[t] >= m->vocab_rows) return ERROR_TOKEN_ID;
    if (m->embedding_type != EMBEDDING_F32) {
        gguf_dequantize_rows(m->embedding_blocks, m->embedding_type, hidden, s->token_ids,
                             s->num_tokens, out);
        return 0;
    }
    for (int64_t t = 0; t < s->num_tokens; ++t)
        memcpy(out + t * hidden, m->embedding_rows + s->token_ids[t] * hidden,
               sizeof(float) * hidden);
    return 0;
}

// The tokens' rows of the angle table into s->cos and s->sin; ERROR_POSITION for a position
// the table does not hold.
static int gather_angles(const DecoderStack* m, DecodeStep* s) {
    const int64_t half = m->head_dim / 2;
    for (int64_t t = 0; t < s->num_tokens; ++t) {
        const int64_t position = s->positions[t];
        if (position < 0 || position >= s->angle_rows) return ERROR_POSITION;
        memcpy(s->cos + t * half, s->angle_cos + position * half, sizeof(float) * half);
        memcpy(s->sin + t * half, s->angle_sin + position * half, sizeof(float) * half);
    }
    return 0;
}

// The model from its token ids to its final norm over one step: `out` [T, hidden] = the final
// norm of the last layer's output added to the residual stream, every norm the fused add +
// RMSNorm the Python layers call (the first one onto a zero stream, as LlamaDecoderLayer's
// input_norm does, so the stream starts as the embeddings exactly). `residual`, `normed` and
// `projected` [T, hidden] are scratch. Returns 0 or an ERROR_ code (nothing is written to the
// caches for a bad token id or position).
int decode_layers(const DecoderStack* m, DecodeStep* s, float* residual, float* normed,
                  float* projected, float* out) {
    double clock = s->part_seconds != NULL ? seconds_now() : 0.0;
    const int64_t tokens = s->num_tokens, hidden = m->hidden_size;
    int status = embed(m, s, projected);
    if (status != 0) return status;
    charge(s, PART_EMBEDDING, &clock);
    status = gather_angles(m, s);
    if (status != 0) return status;
    memset(residual, 0, sizeof(float) * tokens * hidden);
    const float* layer_input = projected;
    for (int32_t i = 0; i < m->num_layers; ++i) {
        const DecoderLayer* layer = &m->layers[i];
        fused_add_rms_norm(layer_input, residual, layer->input_norm, normed, 0, tokens, hidden,
                           m->rms_norm_eps, s->num_threads);
        charge(s, PART_NORMS, &clock);
        if (attention_block(m, layer, s, normed, residual, projected, &clock) != 0)
            return ERROR_ATTENTION_SCORES;
        mlp_block(layer, s, normed, projected, &clock);
        layer_input = projected;
    }
    fused_add_rms_norm(projected, residual, m->final_norm, out, 0, tokens, hidden, m->rms_norm_eps,
                       s->num_threads);
    charge(s, PART_NORMS, &clock);
    return 0;
}

// sizeof of the structs, and the offsets the ctypes twins must match, for the tests:
// [Linear, DecoderLayer, DecoderStack, DecodeStep sizes; DecodeStep.attention, .part_seconds,
// DecoderLayer.kv_cache, Linear.bias, Linear.lora_slots, DecodeStep.lora_token_slots,
// DecoderStack.final_norm, DecoderStack.vocab_rows, DecodeStep.angle_rows, DecodeStep.sin
// offsets].
int64_t decode_layers_layout(int64_t* out, int32_t capacity) {
    const int64_t all[] = {
        sizeof(Linear),
        sizeof(DecoderLayer),
        sizeof(DecoderStack),
        sizeof(DecodeStep),
        offsetof(DecodeStep, attention),
        offsetof(DecodeStep, part_seconds),
        offsetof(DecoderLayer, kv_cache),
        offsetof(Linear, bias),
        offsetof(Linear, lora_slots),
        offsetof(DecodeStep, lora_token_slots),
        offsetof(DecoderStack, final_norm),
        offsetof(DecoderStack, vocab_rows),
        offsetof(DecodeStep, angle_rows),
        offsetof(DecodeStep, sin),
    };
    const int32_t count = (int32_t)(sizeof(all) / sizeof(all[0]));
    for (int32_t i = 0; i < count && i < capacity; ++i) out[i] = all[i];
    return count;
}
