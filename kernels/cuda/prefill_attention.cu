// Prefill / append attention over the paged KV cache (chunked prefill), fp32 math on CUDA cores.
//
// Grid: x = query tile, y = request, z = kv_head. A CTA owns kPrefillRows "rows", each row one
// (query token, query head of this kv_head's GQA group) pair: row = token_in_tile * group + head.
// tokens_per_tile = kPrefillRows / group_size tokens share every K/V tile load.
// Bottom-right causal mask: query token i (0-based within the request's q_len new tokens) sits at
// position context_len + i, context_len = seq_len - q_len, and sees keys 0 ..= that position;
// with a sliding window (sliding_window > 0) only the last sliding_window of them.
// K/V tiles of kPrefillKeys keys are gathered through the block table into shared memory (fp32);
// only keys in [kv_begin, kv_end) are loaded (from the tile's first token's window start to its
// last token's position), so unused cache slots and keys before the window (whose blocks may be
// gone, NaN included) are never read; each row masks the keys outside its own window.
// Online softmax in the log2 domain.
//
// Thread layout (256 threads): ty = tid / 8 owns rows ty and ty + 32; tx = tid % 8 owns score
// columns tx + 8c (c < 4) and output dims 4 * tx + 32 * chunk.
// With skip_single_token_queries set, requests with q_len == 1 are left to decode_attention.
#include "common.cuh"

constexpr int kPrefillThreads = 256;
constexpr int kPrefillRows = 64;
constexpr int kPrefillKeys = 32;
constexpr int kPrefillRowPad = 4;
constexpr int kPrefillProbStride = kPrefillKeys + 1;

template <int HEAD_DIM>
struct PrefillLayout {
  static constexpr int kStride = HEAD_DIM + kPrefillRowPad;  // floats per shared Q/K/V row
  static constexpr int kDimChunks = (HEAD_DIM + 31) / 32;
  // Pins ptxas's register budget at 65536 / (kPrefillThreads * kMinCtasPerSm). Left free, ptxas
  // trades registers for occupancy and spills (sm_90: float/128 at 80 registers, 36 bytes).
  // The kernel needs at most 128 registers up to head_dim 160 (2 CTAs per SM), about 150 above
  // (where shared memory allows at most 1-2 CTAs per SM anyway).
  static constexpr int kMinCtasPerSm = HEAD_DIM <= 160 ? 2 : 1;
  static_assert(HEAD_DIM % 8 == 0, "head_dim must be a multiple of 8");
};

template <typename T, int HEAD_DIM>
__device__ __forceinline__ void store_row_vec(float* dst, const float* vals) {
  constexpr int kVec = VecTraits<T>::kElems;
#pragma unroll
  for (int i = 0; i < kVec; i += 4) {
    *reinterpret_cast<float4*>(dst + i) = make_float4(vals[i], vals[i + 1], vals[i + 2], vals[i + 3]);
  }
}

template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(kPrefillThreads, PrefillLayout<HEAD_DIM>::kMinCtasPerSm)
    prefill_attention(
    PAGED_ATTENTION_TENSORS(T),
    PAGED_ATTENTION_SHAPE,
    int tokens_per_tile,
    int block_size,
    int skip_single_token_queries) {
  using L = PrefillLayout<HEAD_DIM>;
  constexpr int kVec = VecTraits<T>::kElems;
  constexpr int kVecsPerRow = HEAD_DIM / kVec;
  constexpr int kStride = L::kStride;
  constexpr int kChunks = L::kDimChunks;

  PrefillTile tile;
  if (!find_prefill_tile(query_start_loc, seq_lens, tokens_per_tile, group_size,
                         skip_single_token_queries, sliding_window, /*heavy_first=*/false, &tile)) {
    return;
  }
  const int req = tile.req;
  const int kv_head = tile.kv_head;
  const int q_begin = tile.q_begin;
  const int tok0 = tile.tok0;
  const int context_len = tile.context_len;
  const int num_rows = tile.num_rows;
  const int kv_begin = tile.kv_begin;
  const int kv_end = tile.kv_end;

  extern __shared__ float4 prefill_smem4[];
  float* s_q = reinterpret_cast<float*>(prefill_smem4);  // [kPrefillRows][kStride]
  float* s_k = s_q + kPrefillRows * kStride;             // [kPrefillKeys][kStride]
  float* s_v = s_k + kPrefillKeys * kStride;             // [kPrefillKeys][kStride]
  float* s_p = s_v + kPrefillKeys * kStride;             // [kPrefillRows][kPrefillProbStride]

  const long long slot_stride = static_cast<long long>(num_kv_heads) * HEAD_DIM;
  const long long head_offset = static_cast<long long>(kv_head) * HEAD_DIM;
  const int* block_row = block_table + static_cast<long long>(req) * block_table_stride;

  for (int idx = threadIdx.x; idx < kPrefillRows * kVecsPerRow; idx += kPrefillThreads) {
    const int row = idx / kVecsPerRow;
    const int vec = idx % kVecsPerRow;
    float vals[kVec];
    if (row < num_rows) {
      const long long token = q_begin + tok0 + row / group_size;
      const long long head = static_cast<long long>(kv_head) * group_size + row % group_size;
      load_vec(query + token * query_token_stride + head * HEAD_DIM + vec * kVec, vals);
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        vals[i] *= scale_log2;
      }
    } else {
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        vals[i] = 0.0f;
      }
    }
    store_row_vec<T, HEAD_DIM>(s_q + row * kStride + vec * kVec, vals);
  }

  const int ty = threadIdx.x / 8;
  const int tx = threadIdx.x % 8;
  const int rows[2] = {ty, ty + 32};
  const unsigned int span = window_span(sliding_window);
  int last_visible[2];  // row r sees key j iff key_visible(last_visible[r], j, span)
  float m[2];
  float l[2];
  float o[2][kChunks * 4];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    last_visible[r] = rows[r] < num_rows ? context_len + tok0 + rows[r] / group_size : -1;
    m[r] = kNegBig;
    l[r] = 0.0f;
#pragma unroll
    for (int e = 0; e < kChunks * 4; ++e) {
      o[r][e] = 0.0f;
    }
  }

  for (int kv0 = kv_begin; kv0 < kv_end; kv0 += kPrefillKeys) {
    __syncthreads();  // the previous tile is consumed (first pass: s_q is complete)
    for (int idx = threadIdx.x; idx < kPrefillKeys * kVecsPerRow; idx += kPrefillThreads) {
      const int j = idx / kVecsPerRow;
      const int vec = idx % kVecsPerRow;
      const int pos = kv0 + j;
      float k_vals[kVec];
      float v_vals[kVec];
      if (pos < kv_end) {
        const long long base =
            cache_slot(block_row, pos, block_size) * slot_stride + head_offset + vec * kVec;
        load_vec(key_cache + base, k_vals);
        load_vec(value_cache + base, v_vals);
      } else {
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          k_vals[i] = 0.0f;
          v_vals[i] = 0.0f;
        }
      }
      store_row_vec<T, HEAD_DIM>(s_k + j * kStride + vec * kVec, k_vals);
      store_row_vec<T, HEAD_DIM>(s_v + j * kStride + vec * kVec, v_vals);
    }
    __syncthreads();

    float s[2][4];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        s[r][c] = 0.0f;
      }
    }
#pragma unroll 4
    for (int d = 0; d < HEAD_DIM; d += 4) {
      const float4 qa = *reinterpret_cast<const float4*>(s_q + rows[0] * kStride + d);
      const float4 qb = *reinterpret_cast<const float4*>(s_q + rows[1] * kStride + d);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const float4 kk = *reinterpret_cast<const float4*>(s_k + (tx + 8 * c) * kStride + d);
        s[0][c] = fmaf(qa.x, kk.x, fmaf(qa.y, kk.y, fmaf(qa.z, kk.z, fmaf(qa.w, kk.w, s[0][c]))));
        s[1][c] = fmaf(qb.x, kk.x, fmaf(qb.y, kk.y, fmaf(qb.z, kk.z, fmaf(qb.w, kk.w, s[1][c]))));
      }
    }

#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float tile_max = kNegBig;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int key = kv0 + tx + 8 * c;
        if (!key_visible(last_visible[r], key, span)) {
          s[r][c] = kNegBig;
        }
        tile_max = fmaxf(tile_max, s[r][c]);
      }
#pragma unroll
      for (int offset = 1; offset < 8; offset *= 2) {
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, offset));
      }
      const float m_new = fmaxf(m[r], tile_max);
      const float alpha = exp2f(m[r] - m_new);
      m[r] = m_new;
      l[r] *= alpha;
#pragma unroll
      for (int e = 0; e < kChunks * 4; ++e) {
        o[r][e] *= alpha;
      }
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int key = kv0 + tx + 8 * c;
        const bool visible = key_visible(last_visible[r], key, span);
        const float p = visible ? exp2f(s[r][c] - m_new) : 0.0f;
        l[r] += p;
        s_p[rows[r] * kPrefillProbStride + tx + 8 * c] = p;
      }
    }
    __syncthreads();

    const int keys_here = min(kPrefillKeys, kv_end - kv0);
    for (int j = 0; j < keys_here; ++j) {
      const float pa = s_p[rows[0] * kPrefillProbStride + j];
      const float pb = s_p[rows[1] * kPrefillProbStride + j];
#pragma unroll
      for (int ch = 0; ch < kChunks; ++ch) {
        const int d = 4 * tx + 32 * ch;
        if (d < HEAD_DIM) {
          const float4 vv = *reinterpret_cast<const float4*>(s_v + j * kStride + d);
          o[0][ch * 4 + 0] = fmaf(pa, vv.x, o[0][ch * 4 + 0]);
          o[0][ch * 4 + 1] = fmaf(pa, vv.y, o[0][ch * 4 + 1]);
          o[0][ch * 4 + 2] = fmaf(pa, vv.z, o[0][ch * 4 + 2]);
          o[0][ch * 4 + 3] = fmaf(pa, vv.w, o[0][ch * 4 + 3]);
          o[1][ch * 4 + 0] = fmaf(pb, vv.x, o[1][ch * 4 + 0]);
          o[1][ch * 4 + 1] = fmaf(pb, vv.y, o[1][ch * 4 + 1]);
          o[1][ch * 4 + 2] = fmaf(pb, vv.z, o[1][ch * 4 + 2]);
          o[1][ch * 4 + 3] = fmaf(pb, vv.w, o[1][ch * 4 + 3]);
        }
      }
    }
  }

  // The 8 tx lanes of a row hold partial sums over their columns; m is already row-uniform.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
#pragma unroll
    for (int offset = 1; offset < 8; offset *= 2) {
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], offset);
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (rows[r] < num_rows) {
      const long long token = q_begin + tok0 + rows[r] / group_size;
      const long long head = static_cast<long long>(kv_head) * group_size + rows[r] % group_size;
      T* dst = out + token * out_token_stride + head * HEAD_DIM;
      const float inv_sum = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
#pragma unroll
      for (int ch = 0; ch < kChunks; ++ch) {
        const int d = 4 * tx + 32 * ch;
        if (d < HEAD_DIM) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            VecTraits<T>::store(dst + d + i, o[r][ch * 4 + i] * inv_sum);
          }
        }
      }
    }
  }
}
