// The arguments of the CPU attention kernels (paged_attention.c, prefill_attention.c), as one
// struct: kernels/cpu/attention_args.py declares the same fields as a ctypes.Structure and
// fills it once per call; its layout is checked against attention_args_layout() by the tests.
#ifndef ATTENTION_ARGS_H
#define ATTENTION_ARGS_H

#include <stdint.h>

typedef struct {
    const float* query;          // [T, H_q, D] float32
    const void* kv_cache;        // [2, num_cache_blocks, block_size, H_kv, D], float32 or bf16
    const int32_t* block_table;  // [B, block_table_stride]
    const int32_t* seq_lens;     // [B]: cached tokens after this step's write
    const int32_t* query_start;  // [B + 1]
    const int32_t* requests;     // the requests (indices into seq_lens) this call attends
    float* out;                  // [T, H_q, D] float32; only the listed requests' rows are written
    int64_t block_table_stride;
    int64_t num_cache_blocks;
    int32_t num_requests;
    int32_t block_size;
    int32_t num_q_heads;
    int32_t num_kv_heads;
    int32_t head_dim;
    int32_t cache_is_bf16;   // the cache holds bf16 (else float32)
    int32_t query_is_bf16;   // the float32 queries hold bf16 values (a bf16 model's)
    int32_t sliding_window;  // > 0: the query at position q sees keys q - window + 1 .. q only
    float scale;
    int32_t num_threads;
} AttentionArgs;

#endif
