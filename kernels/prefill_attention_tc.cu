// Prefill / append attention on tensor cores (mma.sync m16n8k16, fp16/bf16 in, fp32 accumulate).
//
// Same arguments, grid and row packing as prefill_attention.cu: grid x = query tile, y = request,
// z = kv_head; a CTA owns kTcRows rows, row = token_in_tile * group + head; bottom-right causal
// mask (query token i sees keys 0 ..= seq_len - q_len + i, only the last sliding_window of them
// when sliding_window > 0); only keys in [kv_begin, kv_end) are loaded (the tile's first token's
// window start to its last token's position), so unused cache slots and keys before the window
// are never read. Within that range each row masks its own window (P = 0 before the MMA; the
// loaded V there is data the first token sees, so finite).
//
// Four warps, 16 rows each (FlashAttention-2 style): per KV tile of kTcKeys keys the warp computes
// S = Q K^T on tensor cores, applies the mask and the online softmax to its accumulator fragments
// in fp32, re-packs P (rounded to T) as the A operand and accumulates O += P V. Shared memory holds
// Q and the K tile row-major and the V tile transposed, so every MMA operand register is one
// aligned 32-bit shared load. HEAD_DIM must be a multiple of 16.
#include "cuda_common.cuh"

constexpr int kTcThreads = 128;
constexpr int kTcRows = 64;
constexpr int kTcKeys = 64;
constexpr int kTcPad = 8;  // 16-bit elements of padding per shared row (spreads banks)

template <int HEAD_DIM>
struct TcLayout {
  static constexpr int kQkStride = HEAD_DIM + kTcPad;  // elements per Q / K shared row
  static constexpr int kVtStride = kTcKeys + kTcPad;   // elements per transposed-V shared row
  static constexpr int kVecsPerRow = HEAD_DIM / 8;     // 16-byte vectors per K/V/Q row
  static constexpr int kDimSteps = HEAD_DIM / 16;      // k-steps of S = Q K^T
  static constexpr int kDimTiles = HEAD_DIM / 8;       // n-tiles of O
  static constexpr int kKeyTiles = kTcKeys / 8;        // n-tiles of S
  static constexpr int kKeySteps = kTcKeys / 16;       // k-steps of O += P V
  static_assert(HEAD_DIM % 16 == 0, "the tensor-core prefill needs head_dim % 16 == 0");
};

__device__ __forceinline__ unsigned int load_pair(const unsigned short* ptr) {
  return *reinterpret_cast<const unsigned int*>(ptr);
}

template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(kTcThreads) prefill_attention_tc(
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
    float scale_log2,                       // softmax scale * log2(e)
    int sliding_window,                     // keys per query's window; 0 = no window
    int num_kv_heads,
    int group_size,
    int tokens_per_tile,
    int block_size,
    int skip_single_token_queries) {
  using L = TcLayout<HEAD_DIM>;

  PrefillTile tile;
  if (!find_prefill_tile(query_start_loc, seq_lens, tokens_per_tile, group_size,
                         skip_single_token_queries, sliding_window, &tile)) {
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

  extern __shared__ float4 tc_smem4[];
  unsigned short* s_q = reinterpret_cast<unsigned short*>(tc_smem4);  // [kTcRows][kQkStride]
  unsigned short* s_k = s_q + kTcRows * L::kQkStride;                  // [kTcKeys][kQkStride]
  unsigned short* s_vt = s_k + kTcKeys * L::kQkStride;                 // [HEAD_DIM][kVtStride]

  const long long slot_stride = static_cast<long long>(num_kv_heads) * HEAD_DIM;
  const long long head_offset = static_cast<long long>(kv_head) * HEAD_DIM;
  const int* block_row = block_table + static_cast<long long>(req) * block_table_stride;

  for (int idx = threadIdx.x; idx < kTcRows * L::kVecsPerRow; idx += kTcThreads) {
    const int row = idx / L::kVecsPerRow;
    const int vec = idx % L::kVecsPerRow;
    uint4 raw = make_uint4(0u, 0u, 0u, 0u);
    if (row < num_rows) {
      const long long token = q_begin + tok0 + row / group_size;
      const long long head = static_cast<long long>(kv_head) * group_size + row % group_size;
      raw = load_raw(query + token * query_token_stride + head * HEAD_DIM + vec * 8);
    }
    *reinterpret_cast<uint4*>(s_q + row * L::kQkStride + vec * 8) = raw;
  }

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4;
  const int t = lane % 4;
  const int rows[2] = {warp * 16 + g, warp * 16 + g + 8};
  const unsigned int span = window_span(sliding_window);
  int last_visible[2];  // row h sees key j iff key_visible(last_visible[h], j, span)
  float m[2];
  float l[2];
  float o[L::kDimTiles][4];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    last_visible[h] = rows[h] < num_rows ? context_len + tok0 + rows[h] / group_size : -1;
    m[h] = kNegBig;
    l[h] = 0.0f;
  }
#pragma unroll
  for (int dt = 0; dt < L::kDimTiles; ++dt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      o[dt][i] = 0.0f;
    }
  }

  for (int kv0 = kv_begin; kv0 < kv_end; kv0 += kTcKeys) {
    __syncthreads();  // the previous tile is consumed (first pass: s_q is complete)
    for (int idx = threadIdx.x; idx < kTcKeys * L::kVecsPerRow; idx += kTcThreads) {
      const int j = idx / L::kVecsPerRow;
      const int vec = idx % L::kVecsPerRow;
      const int pos = kv0 + j;
      uint4 k_raw = make_uint4(0u, 0u, 0u, 0u);
      uint4 v_raw = make_uint4(0u, 0u, 0u, 0u);
      if (pos < kv_end) {
        const long long base =
            cache_slot(block_row, pos, block_size) * slot_stride + head_offset + vec * 8;
        k_raw = load_raw(key_cache + base);
        v_raw = load_raw(value_cache + base);
      }
      *reinterpret_cast<uint4*>(s_k + j * L::kQkStride + vec * 8) = k_raw;
      const unsigned int words[4] = {v_raw.x, v_raw.y, v_raw.z, v_raw.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        s_vt[(vec * 8 + 2 * i) * L::kVtStride + j] = static_cast<unsigned short>(words[i] & 0xffffu);
        s_vt[(vec * 8 + 2 * i + 1) * L::kVtStride + j] = static_cast<unsigned short>(words[i] >> 16);
      }
    }
    __syncthreads();

    // S = Q K^T for this warp's 16 rows and the tile's keys.
    float s[L::kKeyTiles][4];
#pragma unroll
    for (int nt = 0; nt < L::kKeyTiles; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        s[nt][i] = 0.0f;
      }
    }
#pragma unroll
    for (int ks = 0; ks < L::kDimSteps; ++ks) {
      const unsigned short* qa = s_q + rows[0] * L::kQkStride + ks * 16 + 2 * t;
      const unsigned int a[4] = {load_pair(qa), load_pair(qa + 8 * L::kQkStride), load_pair(qa + 8),
                                 load_pair(qa + 8 * L::kQkStride + 8)};
#pragma unroll
      for (int nt = 0; nt < L::kKeyTiles; ++nt) {
        const unsigned short* kb = s_k + (nt * 8 + g) * L::kQkStride + ks * 16 + 2 * t;
        const unsigned int b[2] = {load_pair(kb), load_pair(kb + 8)};
        mma_m16n8k16<T>(s[nt], a, b);
      }
    }

    // Mask and online softmax; h = 0 is row g (s[.][0..1]), h = 1 is row g + 8 (s[.][2..3]).
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float tile_max = kNegBig;
#pragma unroll
      for (int nt = 0; nt < L::kKeyTiles; ++nt) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int key = kv0 + nt * 8 + 2 * t + i;
          const bool visible = key_visible(last_visible[h], key, span);
          const float score = visible ? s[nt][2 * h + i] * scale_log2 : kNegBig;
          s[nt][2 * h + i] = score;
          tile_max = fmaxf(tile_max, score);
        }
      }
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      const float m_new = fmaxf(m[h], tile_max);
      const float alpha = exp2f(m[h] - m_new);
      m[h] = m_new;
      l[h] *= alpha;
#pragma unroll
      for (int dt = 0; dt < L::kDimTiles; ++dt) {
        o[dt][2 * h] *= alpha;
        o[dt][2 * h + 1] *= alpha;
      }
#pragma unroll
      for (int nt = 0; nt < L::kKeyTiles; ++nt) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int key = kv0 + nt * 8 + 2 * t + i;
          const bool visible = key_visible(last_visible[h], key, span);
          const float p = visible ? exp2f(s[nt][2 * h + i] - m_new) : 0.0f;
          s[nt][2 * h + i] = p;
          l[h] += p;
        }
      }
    }

    // O += P V: the S accumulators of key tiles 2k and 2k+1 are exactly the A fragment of k-step k.
#pragma unroll
    for (int kstep = 0; kstep < L::kKeySteps; ++kstep) {
      const unsigned int a[4] = {pack2<T>(s[2 * kstep][0], s[2 * kstep][1]),
                                 pack2<T>(s[2 * kstep][2], s[2 * kstep][3]),
                                 pack2<T>(s[2 * kstep + 1][0], s[2 * kstep + 1][1]),
                                 pack2<T>(s[2 * kstep + 1][2], s[2 * kstep + 1][3])};
#pragma unroll
      for (int dt = 0; dt < L::kDimTiles; ++dt) {
        const unsigned short* vb = s_vt + (dt * 8 + g) * L::kVtStride + kstep * 16 + 2 * t;
        const unsigned int b[2] = {load_pair(vb), load_pair(vb + 8)};
        mma_m16n8k16<T>(o[dt], a, b);
      }
    }
  }

  // The 4 lanes of a row hold partial sums over their columns; m is already row-uniform.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (rows[h] < num_rows) {
      const long long token = q_begin + tok0 + rows[h] / group_size;
      const long long head = static_cast<long long>(kv_head) * group_size + rows[h] % group_size;
      T* dst = out + token * out_token_stride + head * HEAD_DIM + 2 * t;
      const float inv_sum = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
#pragma unroll
      for (int dt = 0; dt < L::kDimTiles; ++dt) {
        VecTraits<T>::store(dst + dt * 8, o[dt][2 * h] * inv_sum);
        VecTraits<T>::store(dst + dt * 8 + 1, o[dt][2 * h + 1] * inv_sum);
      }
    }
  }
}
