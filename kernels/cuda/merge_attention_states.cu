// merge_attention_states: combine split-KV decode partials with a log-sum-exp merge.
//
// Grid: x = query head, y = request. Split s of a request holds keys
// [key_begin + s * keys_per_split, + keys_per_split) of its key range [key_begin, seq_len)
// (key_begin > 0 only with a sliding window, as in decode_attention.cu); only the first
// ceil((seq_len - key_begin) / keys_per_split) splits hold keys and were written by
// decode_attention, so only those are read (the others may be uninitialized memory). Partial
// outputs are normalized per split and their lse values are in the log2 domain:
// out = sum_s 2^(lse_s - M) * out_s / sum_s 2^(lse_s - M), M = max_s lse_s.
// A request with seq_len == 0 gets zeros. Requests whose query length is not 1 are skipped.
#include "common.cuh"

template <typename T>
__global__ void merge_attention_states(
    const float* __restrict__ partial_out,  // [num_splits, num_reqs, num_heads, head_dim]
    const float* __restrict__ partial_lse,  // [num_splits, num_reqs, num_heads]
    T* __restrict__ out,                    // [num_tokens, num_heads, head_dim], token stride
    long long out_token_stride,             // elements
    const int* __restrict__ seq_lens,       // [num_reqs]
    const int* __restrict__ query_start_loc,  // [num_reqs + 1]
    int num_reqs,
    int num_heads,
    int head_dim,
    int keys_per_split,
    int num_splits,
    int sliding_window) {  // keys per query's window; 0 = no window
  const int head = blockIdx.x;
  const int req = blockIdx.y;
  const int q_row = query_start_loc[req];
  if (query_start_loc[req + 1] - q_row != 1) {
    return;
  }
  const int seq_len = seq_lens[req];
  const int num_keys = seq_len - window_start(seq_len - 1, sliding_window);
  const int num_valid = min(num_splits, (num_keys + keys_per_split - 1) / keys_per_split);
  const long long split_stride = static_cast<long long>(num_reqs) * num_heads;
  const long long row = static_cast<long long>(req) * num_heads + head;

  float lse_max = kNegBig;
  for (int s = 0; s < num_valid; ++s) {
    lse_max = fmaxf(lse_max, partial_lse[s * split_stride + row]);
  }
  float denom = 0.0f;
  for (int s = 0; s < num_valid; ++s) {
    denom += exp2f(partial_lse[s * split_stride + row] - lse_max);
  }
  const float inv_denom = denom > 0.0f ? 1.0f / denom : 0.0f;

  T* dst = out + q_row * out_token_stride + static_cast<long long>(head) * head_dim;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float val = 0.0f;
    for (int s = 0; s < num_valid; ++s) {
      const float weight = exp2f(partial_lse[s * split_stride + row] - lse_max);
      val = fmaf(weight, partial_out[(s * split_stride + row) * head_dim + d], val);
    }
    VecTraits<T>::store(dst + d, val * inv_denom);
  }
}
