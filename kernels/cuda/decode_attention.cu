// Decode attention over the paged KV cache: one query token per request. Two kernels with the
// same arguments; the launcher (launch_config.decode_launch) picks one by dtype and group size.
//
// Grid: x = kv_head * num_head_chunks + head_chunk, y = request, z = KV split.
// Each CTA serves HEADS query heads of one GQA group (a "head chunk"; the whole group when the
// group has <= 8 heads), so every K/V byte of its key range is read once for all of them.
// 4 warps take interleaved warp tiles of keys; each warp keeps its own online softmax, so the key
// loop has no __syncthreads, and the warps are merged through shared memory at the end.
// Scores live in the log2 domain (scale_log2 = scale * log2(e)); softmax uses ex2.approx.
//
// decode_attention (CUDA cores; any dtype): kLanesPerKey lanes share one key (each lane owns
// kElemsPerLane dims of the head), one warp pass covers kKeysPerWarpPass keys, and a warp tile is
// KPT passes. The next tile's block ids and 16-byte K / V loads are issued into a second set of
// registers before the current tile's math (software pipelining without shared memory); KPT is
// sized so that both sets and the per-head state fit in registers.
//
// decode_attention_tc (tensor cores; fp16 / bf16, groups >= 4): mma.m16n8k16 per warp tile of
// 16 keys, S^T = K Q^T (rows = keys, columns = the <= 8 heads) and O^T += V^T P^T (rows = head
// dims, columns = heads), so K and V are loaded once per warp for all heads and every fragment
// register is used. K and V go from global memory straight into MMA fragments (no shared memory,
// details above the kernel); a tile's V loads are issued before S and the next tile's K loads
// right after S (up to head_dim 128; past it V after S and the next K after P V).
//
// Key range: the query (position seq_len - 1) attends to keys [key_begin, seq_len), key_begin =
// max(0, seq_len - sliding_window) with a sliding window (sliding_window > 0), else 0. Keys before
// key_begin are never loaded: a hybrid KV cache may have replaced their blocks by the null block.
// Splits: with gridDim.z == 1 the CTA covers the whole key range and writes normalized output.
// With gridDim.z > 1 split z covers keys [key_begin + z * keys_per_split, + keys_per_split) of it
// and writes its normalized partial output plus log2-sum-exp, merged by merge_attention_states.cu.
// Requests whose query length is not 1 are skipped (the prefill kernel serves them), so decode
// and prefill kernels can both run over one mixed batch.
// Block index of key pos: (mul_hi(pos, block_magic) + pos) >> block_shift, a round-up
// fast-divide by block_size (block_magic = 0 and a plain shift for a power-of-two block size).
#include "common.cuh"

constexpr int kDecodeThreads = 128;
constexpr int kDecodeWarps = kDecodeThreads / 32;
constexpr int kDecodeTcKeys = 16;  // keys per warp tile of decode_attention_tc

template <typename T, int HEAD_DIM, int HEADS>
struct DecodeLayout {
  static constexpr int kVec = VecTraits<T>::kElems;
  static constexpr int kVecsPerRow = HEAD_DIM / kVec;
  static constexpr int kLanesPerKey = next_pow2(kVecsPerRow < 32 ? kVecsPerRow : 32);
  static constexpr int kVecsPerLane = (kVecsPerRow + kLanesPerKey - 1) / kLanesPerKey;
  static constexpr int kElemsPerLane = kVecsPerLane * kVec;
  static constexpr int kKeysPerWarpPass = 32 / kLanesPerKey;
  // Keys per lane per warp tile: two tiles of raw K and V (8 registers per uint4) in flight
  // next to q and acc (2 * HEADS * kElemsPerLane registers) within about 176 registers.
  static constexpr int kFixedRegs = 2 * HEADS * kElemsPerLane;
  static constexpr int kRegsPerKey = 2 * 2 * 4 * kVecsPerLane;
  static constexpr int kBudget = (176 - kFixedRegs) / kRegsPerKey;
  static constexpr int kKeysPerThread = kBudget > 4 ? 4 : (kBudget < 1 ? 1 : kBudget);
  static constexpr int kWarpTile = kKeysPerWarpPass * kKeysPerThread;
  static_assert(HEAD_DIM % kVec == 0, "head_dim must be a whole number of 16-byte vectors");
};

// What one CTA computes: request, heads and key range [split_begin, split_end).
struct DecodeWork {
  int q_row;
  int kv_head;
  int first_head;
  int heads_here;
  int split_begin;
  int split_end;
};

// Fills `work`; false when the CTA has nothing to do (not a one-token query, or an empty split).
template <int HEADS>
__device__ __forceinline__ bool find_decode_work(const int* query_start_loc, const int* seq_lens,
                                                 int sliding_window, int group_size,
                                                 int num_head_chunks, int keys_per_split,
                                                 DecodeWork* work) {
  const int req = blockIdx.y;
  const int q_row = query_start_loc[req];
  if (query_start_loc[req + 1] - q_row != 1) {
    return false;
  }
  const int seq_len = seq_lens[req];
  const int split_begin = window_start(seq_len - 1, sliding_window) + blockIdx.z * keys_per_split;
  if (gridDim.z > 1 && split_begin >= seq_len) {
    return false;  // the merge only reads splits that hold keys
  }
  const int head_chunk = blockIdx.x % num_head_chunks;
  work->q_row = q_row;
  work->kv_head = blockIdx.x / num_head_chunks;
  work->first_head = work->kv_head * group_size + head_chunk * HEADS;
  work->heads_here = min(HEADS, group_size - head_chunk * HEADS);
  work->split_begin = split_begin;
  // Written so that UNSPLIT_KEYS_PER_SPLIT (INT_MAX) cannot overflow.
  work->split_end = split_begin + min(seq_len - split_begin, keys_per_split);
  return true;
}

// Cache row addressing of one request and kv head. 64-bit where it matters: a block's offset
// (block id * block_elems) can exceed 2^31 elements, one block (block_elems, < 2^31) cannot.
struct DecodeRows {
  const int* block_row;     // the request's block-table row
  int block_size;
  unsigned int block_magic;  // fast-divide by block_size (see the top)
  int block_shift;
  int block_elems;          // elements of one cache block: block_size * num_kv_heads * head_dim
  int row_elems;            // elements of one slot: num_kv_heads * head_dim
  int head_offset;          // kv_head * head_dim

  // Element offset of key `pos`'s row of this kv head.
  __device__ __forceinline__ long long offset(int pos) const {
    const unsigned int upos = static_cast<unsigned int>(pos);
    const int block_index = static_cast<int>((mul_hi_u32(upos, block_magic) + upos) >> block_shift);
    const int in_block = pos - block_index * block_size;
    return static_cast<long long>(block_row[block_index]) * block_elems +
           (in_block * row_elems + head_offset);
  }
};

__device__ __forceinline__ DecodeRows decode_rows(const int* block_table, int block_table_stride,
                                                  int block_size, unsigned int block_magic,
                                                  int block_shift, int num_kv_heads, int head_dim,
                                                  int kv_head) {
  const int row_elems = num_kv_heads * head_dim;
  return DecodeRows{block_table + static_cast<long long>(blockIdx.y) * block_table_stride,
                    block_size,
                    block_magic,
                    block_shift,
                    block_size * row_elems,
                    row_elems,
                    kv_head * head_dim};
}

// Shared-memory layout of the warp merge: [warps][HEADS] maxima and sums, then
// [warps][HEADS][HEAD_DIM] accumulators (launch_config.decode_shared_mem_bytes).
struct DecodeMergeSmem {
  float* max;
  float* sum;
  float* acc;
};

template <int HEADS>
__device__ __forceinline__ DecodeMergeSmem decode_merge_smem(float* smem) {
  return DecodeMergeSmem{smem, smem + kDecodeWarps * HEADS, smem + 2 * kDecodeWarps * HEADS};
}

// After every warp stored its (max, sum, acc) in `sm`: merges the warps and writes the output
// (unsplit) or the split's normalized partial output and log2-sum-exp.
template <typename T, int HEAD_DIM, int HEADS>
__device__ __forceinline__ void decode_merge_warps(const DecodeMergeSmem& sm,
                                                   const DecodeWork& work, T* out,
                                                   long long out_token_stride, float* partial_out,
                                                   float* partial_lse, int num_heads,
                                                   int num_reqs) {
  __syncthreads();  // every warp's state is in shared memory
  for (int idx = threadIdx.x; idx < work.heads_here * HEAD_DIM; idx += kDecodeThreads) {
    const int h = idx / HEAD_DIM;
    const int d = idx % HEAD_DIM;
    float m_all = kNegBig;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) {
      m_all = fmaxf(m_all, sm.max[w * HEADS + h]);
    }
    float sum = 0.0f;
    float val = 0.0f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) {
      const float factor = fast_exp2(sm.max[w * HEADS + h] - m_all);
      sum = fmaf(sm.sum[w * HEADS + h], factor, sum);
      val = fmaf(sm.acc[(w * HEADS + h) * HEAD_DIM + d], factor, val);
    }
    const float inv_sum = sum > 0.0f ? 1.0f / sum : 0.0f;
    const int head = work.first_head + h;
    if (gridDim.z == 1) {
      T* dst = out + work.q_row * out_token_stride + static_cast<long long>(head) * HEAD_DIM + d;
      VecTraits<T>::store(dst, val * inv_sum);
    } else {
      const long long row =
          (static_cast<long long>(blockIdx.z) * num_reqs + blockIdx.y) * num_heads + head;
      partial_out[row * HEAD_DIM + d] = val * inv_sum;
      if (d == 0) {
        partial_lse[row] = sum > 0.0f ? m_all + log2f(sum) : kNegBig;
      }
    }
  }
}

// One warp tile's raw K and V of the CUDA-core kernel.
template <int KPT, int VECS>
struct DecodeTile {
  uint4 k[KPT][VECS];
  uint4 v[KPT][VECS];
  bool valid[KPT];
};

template <typename T, int HEAD_DIM, int HEADS>
// minBlocksPerSM 1: without it ptxas may pick a tighter register budget and spill.
__global__ void __launch_bounds__(kDecodeThreads, 1) decode_attention(
    PAGED_ATTENTION_TENSORS(T),
    float* __restrict__ partial_out,        // [num_splits, num_reqs, num_heads, HEAD_DIM]
    float* __restrict__ partial_lse,        // [num_splits, num_reqs, num_heads]
    PAGED_ATTENTION_SHAPE,
    int num_head_chunks,
    int block_size,
    unsigned int block_magic,               // fast-divide by block_size (see the top)
    int block_shift,
    int keys_per_split,
    int num_reqs) {
  using L = DecodeLayout<T, HEAD_DIM, HEADS>;
  constexpr int E = L::kElemsPerLane;
  constexpr int KPT = L::kKeysPerThread;
  constexpr int VECS = L::kVecsPerLane;

  DecodeWork work;
  if (!find_decode_work<HEADS>(query_start_loc, seq_lens, sliding_window, group_size,
                               num_head_chunks, keys_per_split, &work)) {
    return;
  }
  const int split_end = work.split_end;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int lane_in_key = lane % L::kLanesPerKey;
  const int key_in_pass = lane / L::kLanesPerKey;

  // This lane's slice of every query head, scaled into the log2 domain.
  float q[HEADS][E];
#pragma unroll
  for (int h = 0; h < HEADS; ++h) {
#pragma unroll
    for (int v = 0; v < VECS; ++v) {
      const int vec = lane_in_key + v * L::kLanesPerKey;
      if (h < work.heads_here && vec < L::kVecsPerRow) {
        const T* src = query + work.q_row * query_token_stride +
                       static_cast<long long>(work.first_head + h) * HEAD_DIM + vec * L::kVec;
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

  const DecodeRows rows = decode_rows(block_table, block_table_stride, block_size, block_magic,
                                      block_shift, num_kv_heads, HEAD_DIM, work.kv_head);

  // Issues the loads of the warp tile starting at `tile`: block ids first, then K and V.
  auto load_tile = [&](int tile, DecodeTile<KPT, VECS>& dst) {
    long long base[KPT];
#pragma unroll
    for (int k = 0; k < KPT; ++k) {
      const int pos = tile + k * L::kKeysPerWarpPass + key_in_pass;
      dst.valid[k] = pos < split_end;
      base[k] = dst.valid[k] ? rows.offset(pos) : 0;
    }
#pragma unroll
    for (int k = 0; k < KPT; ++k) {
#pragma unroll
      for (int v = 0; v < VECS; ++v) {
        const int vec = lane_in_key + v * L::kLanesPerKey;
        if (dst.valid[k] && vec < L::kVecsPerRow) {
          dst.k[k][v] = load_raw(key_cache + base[k] + vec * L::kVec);
          dst.v[k][v] = load_raw(value_cache + base[k] + vec * L::kVec);
        } else {
          dst.k[k][v] = make_uint4(0u, 0u, 0u, 0u);
          dst.v[k][v] = make_uint4(0u, 0u, 0u, 0u);
        }
      }
    }
  };

  constexpr int kStride = kDecodeWarps * L::kWarpTile;
  DecodeTile<KPT, VECS> cur;
  int tile = work.split_begin + warp * L::kWarpTile;
  load_tile(tile, cur);
  // Main key loop: prefetch tile + kStride, then scores and softmax of `cur`.
#pragma unroll 1
  for (; tile < split_end; tile += kStride) {
    DecodeTile<KPT, VECS> next;
    load_tile(tile + kStride, next);  // past split_end: no loads, every key invalid

    // Scores: every lane of a key ends up holding the full dot product.
    float s[KPT][HEADS];
#pragma unroll
    for (int k = 0; k < KPT; ++k) {
      float kf[E];
#pragma unroll
      for (int v = 0; v < VECS; ++v) {
        VecTraits<T>::unpack(cur.k[k][v], &kf[v * L::kVec]);
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
        s[k][h] = cur.valid[k] ? dot : kNegBig;
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
      const float alpha = fast_exp2(m[h] - m_new);
      m[h] = m_new;
      l[h] *= alpha;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        acc[h][e] *= alpha;
      }
    }
#pragma unroll
    for (int k = 0; k < KPT; ++k) {
      // Invalid keys have zero V and p == 0, so no branch is needed.
      float vf[E];
#pragma unroll
      for (int v = 0; v < VECS; ++v) {
        VecTraits<T>::unpack(cur.v[k][v], &vf[v * L::kVec]);
      }
#pragma unroll
      for (int h = 0; h < HEADS; ++h) {
        const float p = fast_exp2(s[k][h] - m[h]);
        l[h] += p;
#pragma unroll
        for (int e = 0; e < E; ++e) {
          acc[h][e] = fmaf(p, vf[e], acc[h][e]);
        }
      }
    }
    cur = next;
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

  extern __shared__ float4 decode_smem4[];
  const DecodeMergeSmem sm = decode_merge_smem<HEADS>(reinterpret_cast<float*>(decode_smem4));
  if (key_in_pass == 0) {
#pragma unroll
    for (int h = 0; h < HEADS; ++h) {
#pragma unroll
      for (int v = 0; v < VECS; ++v) {
        const int vec = lane_in_key + v * L::kLanesPerKey;
        if (vec < L::kVecsPerRow) {
#pragma unroll
          for (int i = 0; i < L::kVec; ++i) {
            sm.acc[(warp * HEADS + h) * HEAD_DIM + vec * L::kVec + i] = acc[h][v * L::kVec + i];
          }
        }
      }
      if (lane == 0) {
        sm.max[warp * HEADS + h] = m[h];
        sm.sum[warp * HEADS + h] = l[h];
      }
    }
  }
  decode_merge_warps<T, HEAD_DIM, HEADS>(sm, work, out, out_token_stride, partial_out,
                                         partial_lse, num_kv_heads * group_size, num_reqs);
}

// ---- Tensor cores -------------------------------------------------------------------------------

template <int HEAD_DIM>
struct DecodeTcLayout {
  static constexpr int kChunks = HEAD_DIM / 8;         // 16-byte chunks per row
  static constexpr int kQkChunks = (kChunks + 3) / 4;  // per lane, of K and q: chunks t + 4 j
  static constexpr int kPvChunks = 2 * ((kChunks + 15) / 16);  // per lane, of V: chunks g + 8 m
  static constexpr int kDimTiles = 4 * kPvChunks;      // O^T m-tiles (m / 2, i), 16 dims each
  // Up to 128 dims a tile's V loads are issued before S = K Q^T and the next tile's K loads
  // right after it; past that K, V, q and O would not all fit in registers, so V is loaded
  // after S and the next tile's K after P V.
  static constexpr bool kEarlyLoads = HEAD_DIM <= 128;
  // CTAs per SM the register allocation must allow: without it ptxas may pick a tighter budget
  // and spill (e.g. 96 registers at head_dim 64).
  static constexpr int kMinBlocks = HEAD_DIM <= 128 ? 3 : 2;
  static_assert(HEAD_DIM % 8 == 0, "head_dim must be a whole number of 16-byte chunks");
};

// (lo half of a, lo half of b) and (hi half of a, hi half of b): one PRMT each.
__device__ __forceinline__ unsigned int pair_lo_halves(unsigned int a, unsigned int b) {
  return (a & 0xffffu) | (b << 16);
}
__device__ __forceinline__ unsigned int pair_hi_halves(unsigned int a, unsigned int b) {
  return (a >> 16) | (b & 0xffff0000u);
}

__device__ __forceinline__ unsigned int uint4_word(const uint4& v, int i) {
  return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

// Tensor-core decode, fp16 / bf16. Per warp tile of 16 keys (g = lane / 4, t = lane % 4):
// S^T = K Q^T (m16n8k16: rows = keys, columns = the <= 8 heads, k = head dims). The k order is
// free as long as K and q agree, so lane (g, t) loads whole 16-byte chunks t + 4 j of keys g and
// g + 8 (A) and of head g's q (B), straight from global memory into fragments.
// O^T += V^T P^T (rows = head dims, columns = heads, k = keys): P^T's B fragment wants head g's
// p of four keys, which 4 shuffles gather from S^T's accumulators; with the key order
// k = 2t, 2t + 1, 2t + 8, 2t + 9 -> keys t, t + 4, t + 8, t + 12 lane (g, t) loads V chunks
// g + 8 m of those four keys and pairs their halves into A fragments (row g of m-tile (m / 2, i)
// is dim 8 (g + 16 (m / 2)) + i, row g + 8 is dim 8 (g + 8 + 16 (m / 2)) + i).
template <typename T, int HEAD_DIM, int HEADS>
__global__ void __launch_bounds__(kDecodeThreads, DecodeTcLayout<HEAD_DIM>::kMinBlocks)
    decode_attention_tc(
    PAGED_ATTENTION_TENSORS(T),
    float* __restrict__ partial_out,
    float* __restrict__ partial_lse,
    PAGED_ATTENTION_SHAPE,
    int num_head_chunks,
    int block_size,
    unsigned int block_magic,
    int block_shift,
    int keys_per_split,
    int num_reqs) {
  static_assert(HEADS <= 8, "the heads are the 8 MMA columns");
  using L = DecodeTcLayout<HEAD_DIM>;
  constexpr int QC = L::kQkChunks;
  constexpr int PC = L::kPvChunks;

  DecodeWork work;
  if (!find_decode_work<HEADS>(query_start_loc, seq_lens, sliding_window, group_size,
                               num_head_chunks, keys_per_split, &work)) {
    return;
  }
  const int split_end = work.split_end;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4;
  const int t = lane % 4;

  // q of head g (unscaled: the scale goes on the fp32 scores), chunks t + 4 j: the B fragments
  // of k-steps 2 j (x, y) and 2 j + 1 (z, w).
  uint4 q[QC];
#pragma unroll
  for (int j = 0; j < QC; ++j) {
    const int c = t + 4 * j;
    q[j] = make_uint4(0u, 0u, 0u, 0u);
    if (g < work.heads_here && c < L::kChunks) {
      q[j] = load_raw(query + work.q_row * query_token_stride +
                      static_cast<long long>(work.first_head + g) * HEAD_DIM + c * 8);
    }
  }

  float o[L::kDimTiles][4];  // O^T[dims g, g + 8 of each m-tile][heads 2t, 2t + 1]
#pragma unroll
  for (int n = 0; n < L::kDimTiles; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      o[n][i] = 0.0f;
    }
  }
  float m_run[2] = {kNegBig, kNegBig};  // running max of heads 2t, 2t + 1 (warp-column uniform)
  float l_run[2] = {0.0f, 0.0f};        // running sums of this lane's p values of those heads

  const DecodeRows rows = decode_rows(block_table, block_table_stride, block_size, block_magic,
                                      block_shift, num_kv_heads, HEAD_DIM, work.kv_head);

  // K of keys tile + g (kr[0]) and tile + g + 8 (kr[1]), chunks t + 4 j; invalid keys are zero.
  uint4 kr[2][QC];
  auto load_k = [&](int tile) {
    const T* src[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int pos = tile + g + 8 * r;
      src[r] = pos < split_end ? key_cache + rows.offset(pos) + t * 8 : nullptr;
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int j = 0; j < QC; ++j) {
        kr[r][j] = src[r] != nullptr && t + 4 * j < L::kChunks ? load_raw(src[r] + 32 * j)
                                                                : make_uint4(0u, 0u, 0u, 0u);
      }
    }
  };
  // V of keys tile + t + 4 r, chunks g + 8 m; invalid keys are zero.
  uint4 vr[4][PC];
  auto load_v = [&](int tile) {
    const T* src[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int pos = tile + t + 4 * r;
      src[r] = pos < split_end ? value_cache + rows.offset(pos) + g * 8 : nullptr;
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
#pragma unroll
      for (int mc = 0; mc < PC; ++mc) {
        vr[r][mc] = src[r] != nullptr && g + 8 * mc < L::kChunks ? load_raw(src[r] + 64 * mc)
                                                                  : make_uint4(0u, 0u, 0u, 0u);
      }
    }
  };

  // Who sends what in the 4 shuffles that turn S^T's accumulators into P^T's B fragments: in
  // round r an even-head reader takes key t + 4 r, an odd-head reader key t + 4 ((r + 1) % 4),
  // so the 8 readers of a sender column never collide.
  const bool g_high = g >= 4;
  const bool odd_head = (g & 1) != 0;

  constexpr int kStride = kDecodeWarps * kDecodeTcKeys;
  int tile = work.split_begin + warp * kDecodeTcKeys;
  if (tile < split_end) {
    load_k(tile);
  }
  // Main key loop: 16 keys per warp tile.
#pragma unroll 1
  for (; tile < split_end; tile += kStride) {
    if constexpr (L::kEarlyLoads) {
      load_v(tile);  // in flight during S^T = K Q^T
    }

    // s[2 r + h] = score of key tile + g + 8 r and head 2t + h.
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < QC; ++j) {
      const unsigned int a_lo[4] = {kr[0][j].x, kr[1][j].x, kr[0][j].y, kr[1][j].y};
      const unsigned int b_lo[2] = {q[j].x, q[j].y};
      mma_m16n8k16<T>(s, a_lo, b_lo);
      const unsigned int a_hi[4] = {kr[0][j].z, kr[1][j].z, kr[0][j].w, kr[1][j].w};
      const unsigned int b_hi[2] = {q[j].z, q[j].w};
      mma_m16n8k16<T>(s, a_hi, b_hi);
    }
    if constexpr (L::kEarlyLoads) {
      if (tile + kStride < split_end) {
        load_k(tile + kStride);  // the next tile's K, in flight during softmax and P V
      }
    } else {
      load_v(tile);
    }

    // Online softmax of heads 2t, 2t + 1 (the 8 lanes of a column hold the tile's 16 keys).
    float tile_max[2] = {kNegBig, kNegBig};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      s[i] = tile + g + 8 * (i / 2) < split_end ? s[i] * scale_log2 : kNegBig;
      tile_max[i % 2] = fmaxf(tile_max[i % 2], s[i]);
    }
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int offset = 4; offset < 32; offset *= 2) {
        tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], offset));
      }
      const float m_new = fmaxf(m_run[h], tile_max[h]);
      alpha[h] = fast_exp2(m_run[h] - m_new);
      m_run[h] = m_new;
    }
    float p[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      p[i] = fast_exp2(s[i] - m_run[i % 2]);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      l_run[h] = fmaf(l_run[h], alpha[h], p[h] + p[h + 2]);
    }

    // P^T's B fragment: head g's p of keys t, t + 4, t + 8, t + 12.
    float got[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const bool to_even = g_high == ((r & 1) != 0);
      const float send = to_even ? p[r >= 2 ? 2 : 0] : p[(r == 1 || r == 2) ? 3 : 1];
      const int key_low = t + 4 * ((odd_head ? r + 1 : r) & 1);  // the key's index mod 8
      got[r] = __shfl_sync(0xffffffffu, send, key_low * 4 + g / 2);
    }
    const float p_t = odd_head ? got[3] : got[0];
    const float p_t4 = odd_head ? got[0] : got[1];
    const float p_t8 = odd_head ? got[1] : got[2];
    const float p_t12 = odd_head ? got[2] : got[3];
    const unsigned int b[2] = {pack2<T>(p_t, p_t4), pack2<T>(p_t8, p_t12)};

    // O^T = alpha O^T + V^T P^T over the tile's 16 keys.
#pragma unroll
    for (int mp = 0; mp < PC / 2; ++mp) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        float* acc = o[mp * 8 + i];
        acc[0] *= alpha[0];
        acc[1] *= alpha[1];
        acc[2] *= alpha[0];
        acc[3] *= alpha[1];
        unsigned int a[4];
#pragma unroll
        for (int half = 0; half < 2; ++half) {  // rows g (chunk 2 mp), g + 8 (chunk 2 mp + 1)
          const unsigned int w0 = uint4_word(vr[0][2 * mp + half], i / 2);
          const unsigned int w4 = uint4_word(vr[1][2 * mp + half], i / 2);
          const unsigned int w8 = uint4_word(vr[2][2 * mp + half], i / 2);
          const unsigned int w12 = uint4_word(vr[3][2 * mp + half], i / 2);
          a[half] = (i & 1) ? pair_hi_halves(w0, w4) : pair_lo_halves(w0, w4);
          a[half + 2] = (i & 1) ? pair_hi_halves(w8, w12) : pair_lo_halves(w8, w12);
        }
        mma_m16n8k16<T>(o[mp * 8 + i], a, b);
      }
    }
    if constexpr (!L::kEarlyLoads) {
      if (tile + kStride < split_end) {
        load_k(tile + kStride);
      }
    }
  }

  // m_run is uniform over the 8 lanes of a column; sum l over them.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int offset = 4; offset < 32; offset *= 2) {
      l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], offset);
    }
  }
  extern __shared__ float4 decode_smem4[];
  const DecodeMergeSmem sm = decode_merge_smem<HEADS>(reinterpret_cast<float*>(decode_smem4));
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int head = 2 * t + h;
    if (head < HEADS) {
#pragma unroll
      for (int n = 0; n < L::kDimTiles; ++n) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int c = g + 8 * half + 16 * (n / 8);
          if (c < L::kChunks) {
            sm.acc[(warp * HEADS + head) * HEAD_DIM + 8 * c + n % 8] = o[n][2 * half + h];
          }
        }
      }
      if (g == 0) {
        sm.max[warp * HEADS + head] = m_run[h];
        sm.sum[warp * HEADS + head] = l_run[h];
      }
    }
  }
  decode_merge_warps<T, HEAD_DIM, HEADS>(sm, work, out, out_token_stride, partial_out,
                                         partial_lse, num_kv_heads * group_size, num_reqs);
}
