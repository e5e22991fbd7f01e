// Decode attention over the paged KV cache: one query token per request.
//
// Grid: x = kv_head * num_head_chunks + head_chunk, y = request, z = KV split.
// Each CTA serves HEADS query heads of one GQA group (a "head chunk"; the whole group when the
// group has <= 8 heads), so every K/V byte of its key range is read once for all of them.
//
// Work split inside a CTA: 4 warps take interleaved warp tiles of keys. Inside a warp,
// kLanesPerKey lanes share one key (each lane owns kElemsPerLane dims of the head), so one warp
// pass covers kKeysPerWarpPass keys, and a warp tile is kKeysPerThread passes whose 16-byte K and
// V loads are all issued before any math (memory-level parallelism without shared memory).
// Each warp keeps its own online softmax (running max m is warp-uniform; the sum l and the output
// accumulator are per lane and reduced once at the end), so the key loop has no __syncthreads.
// Scores live in the log2 domain: q is pre-multiplied by scale * log2(e), softmax uses exp2f.
//
// Key range: the query (position seq_len - 1) attends to keys [key_begin, seq_len), key_begin =
// max(0, seq_len - sliding_window) with a sliding window (sliding_window > 0), else 0. Keys before
// key_begin are never loaded: a hybrid KV cache may have replaced their blocks by the null block.
// Splits: with gridDim.z == 1 the CTA covers the whole key range and writes normalized output.
// With gridDim.z > 1 split z covers keys [key_begin + z * keys_per_split, + keys_per_split) of it
// and writes its normalized partial output plus log2-sum-exp, merged by merge_attention_states.cu.
// Requests whose query length is not 1 are skipped (the prefill kernel serves them), so decode
// and prefill kernels can both run over one mixed batch.
#include "cuda_common.cuh"

constexpr int kDecodeThreads = 128;
constexpr int kDecodeWarps = kDecodeThreads / 32;
constexpr int kDecodeKeysPerThread = 4;

template <typename T, int HEAD_DIM>
struct DecodeLayout {
  static constexpr int kVec = VecTraits<T>::kElems;
  static constexpr int kVecsPerRow = HEAD_DIM / kVec;
  static constexpr int kLanesPerKey = next_pow2(kVecsPerRow < 32 ? kVecsPerRow : 32);
  static constexpr int kVecsPerLane = (kVecsPerRow + kLanesPerKey - 1) / kLanesPerKey;
  static constexpr int kElemsPerLane = kVecsPerLane * kVec;
  static constexpr int kKeysPerWarpPass = 32 / kLanesPerKey;
  static constexpr int kWarpTile = kKeysPerWarpPass * kDecodeKeysPerThread;
  static_assert(HEAD_DIM % kVec == 0, "head_dim must be a whole number of 16-byte vectors");
};

template <typename T, int HEAD_DIM, int HEADS>
__global__ void __launch_bounds__(kDecodeThreads) decode_attention(
    const T* __restrict__ query,            // [num_tokens, num_heads, HEAD_DIM], token stride
    long long query_token_stride,           // elements
    const T* __restrict__ key_cache,        // [num_blocks * block_size, num_kv_heads, HEAD_DIM]
    const T* __restrict__ value_cache,      // same layout as key_cache
    const int* __restrict__ block_table,    // [num_reqs, block_table_stride]
    int block_table_stride,
    const int* __restrict__ seq_lens,       // [num_reqs]
    const int* __restrict__ query_start_loc,  // [num_reqs + 1]
    T* __restrict__ out,                    // [num_tokens, num_heads, HEAD_DIM], token stride
    long long out_token_stride,             // elements
    float* __restrict__ partial_out,        // [num_splits, num_reqs, num_heads, HEAD_DIM]
    float* __restrict__ partial_lse,        // [num_splits, num_reqs, num_heads]
    float scale_log2,                       // softmax scale * log2(e)
    int sliding_window,                     // keys per query's window; 0 = no window
    int num_kv_heads,
    int group_size,
    int num_head_chunks,
    int block_size,
    int keys_per_split,
    int num_reqs) {
  using L = DecodeLayout<T, HEAD_DIM>;
  constexpr int E = L::kElemsPerLane;
  constexpr int KPT = kDecodeKeysPerThread;

  const int kv_head = blockIdx.x / num_head_chunks;
  const int head_chunk = blockIdx.x % num_head_chunks;
  const int req = blockIdx.y;
  const int split = blockIdx.z;
  const bool is_split = gridDim.z > 1;

  const int q_row = query_start_loc[req];
  if (query_start_loc[req + 1] - q_row != 1) {
    return;
  }
  const int seq_len = seq_lens[req];
  const int split_begin = window_start(seq_len - 1, sliding_window) + split * keys_per_split;
  if (is_split && split_begin >= seq_len) {
    return;  // the merge only reads splits that hold keys
  }
  // Written so that UNSPLIT_KEYS_PER_SPLIT (INT_MAX) cannot overflow.
  const int split_end = split_begin + min(seq_len - split_begin, keys_per_split);

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int lane_in_key = lane % L::kLanesPerKey;
  const int key_in_pass = lane / L::kLanesPerKey;
  const int num_heads = num_kv_heads * group_size;
  const int first_head = kv_head * group_size + head_chunk * HEADS;
  const int heads_here = min(HEADS, group_size - head_chunk * HEADS);

  // This lane's slice of every query head, scaled into the log2 domain.
  float q[HEADS][E];
#pragma unroll
  for (int h = 0; h < HEADS; ++h) {
#pragma unroll
    for (int v = 0; v < L::kVecsPerLane; ++v) {
      const int vec = lane_in_key + v * L::kLanesPerKey;
      if (h < heads_here && vec < L::kVecsPerRow) {
        const T* src = query + q_row * query_token_stride +
                       static_cast<long long>(first_head + h) * HEAD_DIM + vec * L::kVec;
        load_vec(src, &q[h][v * L::kVec]);
#pragma unroll
        for (int i = 0; i < L::kVec; ++i) {
          q[h][v * L::kVec + i] *= scale_log2;
        }
      } else {
#pragma unroll
        for (int i = 0; i < L::kVec; ++i) {
          q[h][v * L::kVec + i] = 0.0f;
        }
      }
    }
  }

  float m[HEADS];       // running max, warp-uniform
  float l[HEADS];       // running sum of exp2(s - m) over this lane's keys
  float acc[HEADS][E];  // running sum of p * v over this lane's keys, this lane's dims
#pragma unroll
  for (int h = 0; h < HEADS; ++h) {
    m[h] = kNegBig;
    l[h] = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      acc[h][e] = 0.0f;
    }
  }

  const long long slot_stride = static_cast<long long>(num_kv_heads) * HEAD_DIM;
  const long long head_offset = static_cast<long long>(kv_head) * HEAD_DIM;
  const int* block_row = block_table + static_cast<long long>(req) * block_table_stride;

  for (int tile = split_begin + warp * L::kWarpTile; tile < split_end;
       tile += kDecodeWarps * L::kWarpTile) {
    uint4 k_raw[KPT][L::kVecsPerLane];
    uint4 v_raw[KPT][L::kVecsPerLane];
    bool valid[KPT];
#pragma unroll
    for (int k = 0; k < KPT; ++k) {
      const int pos = tile + k * L::kKeysPerWarpPass + key_in_pass;
      valid[k] = pos < split_end;
      const long long base =
          valid[k] ? cache_slot(block_row, pos, block_size) * slot_stride + head_offset : 0;
#pragma unroll
      for (int v = 0; v < L::kVecsPerLane; ++v) {
        const int vec = lane_in_key + v * L::kLanesPerKey;
        if (valid[k] && vec < L::kVecsPerRow) {
          k_raw[k][v] = load_raw(key_cache + base + vec * L::kVec);
          v_raw[k][v] = load_raw(value_cache + base + vec * L::kVec);
        } else {
          k_raw[k][v] = make_uint4(0u, 0u, 0u, 0u);
          v_raw[k][v] = make_uint4(0u, 0u, 0u, 0u);
        }
      }
    }

    // Scores: every lane of a key ends up holding the full dot product.
    float s[KPT][HEADS];
#pragma unroll
    for (int k = 0; k < KPT; ++k) {
      float kf[E];
#pragma unroll
      for (int v = 0; v < L::kVecsPerLane; ++v) {
        VecTraits<T>::unpack(k_raw[k][v], &kf[v * L::kVec]);
      }
#pragma unroll
      for (int h = 0; h < HEADS; ++h) {
        float dot = 0.0f;
#pragma unroll
        for (int e = 0; e < E; ++e) {
          dot = fmaf(q[h][e], kf[e], dot);
        }
#pragma unroll
        for (int offset = L::kLanesPerKey / 2; offset > 0; offset /= 2) {
          dot += __shfl_xor_sync(0xffffffffu, dot, offset);
        }
        s[k][h] = valid[k] ? dot : kNegBig;
      }
    }

    // Online softmax update with one rescale per warp tile.
#pragma unroll
    for (int h = 0; h < HEADS; ++h) {
      float tile_max = s[0][h];
#pragma unroll
      for (int k = 1; k < KPT; ++k) {
        tile_max = fmaxf(tile_max, s[k][h]);
      }
#pragma unroll
      for (int offset = L::kLanesPerKey; offset < 32; offset *= 2) {
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, offset));
      }
      const float m_new = fmaxf(m[h], tile_max);
      const float alpha = exp2f(m[h] - m_new);
      m[h] = m_new;
      l[h] *= alpha;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        acc[h][e] *= alpha;
      }
    }
#pragma unroll
    for (int k = 0; k < KPT; ++k) {
      if (valid[k]) {
        float vf[E];
#pragma unroll
        for (int v = 0; v < L::kVecsPerLane; ++v) {
          VecTraits<T>::unpack(v_raw[k][v], &vf[v * L::kVec]);
        }
#pragma unroll
        for (int h = 0; h < HEADS; ++h) {
          const float p = exp2f(s[k][h] - m[h]);
          l[h] += p;
#pragma unroll
          for (int e = 0; e < E; ++e) {
            acc[h][e] = fmaf(p, vf[e], acc[h][e]);
          }
        }
      }
    }
  }

  // Sum l and acc over the keys-per-pass lane groups of this warp (m is already warp-uniform).
#pragma unroll
  for (int offset = L::kLanesPerKey; offset < 32; offset *= 2) {
#pragma unroll
    for (int h = 0; h < HEADS; ++h) {
      l[h] += __shfl_xor_sync(0xffffffffu, l[h], offset);
#pragma unroll
      for (int e = 0; e < E; ++e) {
        acc[h][e] += __shfl_xor_sync(0xffffffffu, acc[h][e], offset);
      }
    }
  }

  // Merge the warps through shared memory: [warps][HEADS] maxima and sums, then
  // [warps][HEADS][HEAD_DIM] accumulators.
  extern __shared__ float4 decode_smem4[];
  float* s_max = reinterpret_cast<float*>(decode_smem4);
  float* s_sum = s_max + kDecodeWarps * HEADS;
  float* s_acc = s_sum + kDecodeWarps * HEADS;
  if (key_in_pass == 0) {
#pragma unroll
    for (int h = 0; h < HEADS; ++h) {
#pragma unroll
      for (int v = 0; v < L::kVecsPerLane; ++v) {
        const int vec = lane_in_key + v * L::kLanesPerKey;
        if (vec < L::kVecsPerRow) {
#pragma unroll
          for (int i = 0; i < L::kVec; ++i) {
            s_acc[(warp * HEADS + h) * HEAD_DIM + vec * L::kVec + i] = acc[h][v * L::kVec + i];
          }
        }
      }
      if (lane == 0) {
        s_max[warp * HEADS + h] = m[h];
        s_sum[warp * HEADS + h] = l[h];
      }
    }
  }
  __syncthreads();

  for (int idx = threadIdx.x; idx < heads_here * HEAD_DIM; idx += kDecodeThreads) {
    const int h = idx / HEAD_DIM;
    const int d = idx % HEAD_DIM;
    float m_all = kNegBig;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) {
      m_all = fmaxf(m_all, s_max[w * HEADS + h]);
    }
    float sum = 0.0f;
    float val = 0.0f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) {
      const float factor = exp2f(s_max[w * HEADS + h] - m_all);
      sum = fmaf(s_sum[w * HEADS + h], factor, sum);
      val = fmaf(s_acc[(w * HEADS + h) * HEAD_DIM + d], factor, val);
    }
    const float inv_sum = sum > 0.0f ? 1.0f / sum : 0.0f;
    const int head = first_head + h;
    if (!is_split) {
      T* dst = out + q_row * out_token_stride + static_cast<long long>(head) * HEAD_DIM + d;
      VecTraits<T>::store(dst, val * inv_sum);
    } else {
      const long long row = (static_cast<long long>(split) * num_reqs + req) * num_heads + head;
      partial_out[row * HEAD_DIM + d] = val * inv_sum;
      if (d == 0) {
        partial_lse[row] = sum > 0.0f ? m_all + log2f(sum) : kNegBig;
      }
    }
  }
}
