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
// Heavy tiles first: blockIdx.x = 0 is the LAST query tile of its request (the one with the most
// keys under the causal mask), so the longest CTAs of each (request, kv_head) start first and the
// short ones fill the tail of the wave. The grid shape is unchanged; CTAs past a request's tiles
// exit at once.
//
// Four warps, 16 rows each (FlashAttention-2 style): per KV tile of kTcKeys keys the warp computes
// S = Q K^T on tensor cores, applies the mask and the online softmax to its accumulator fragments
// in fp32, re-packs P (rounded to T) as the A operand and accumulates O += P V.
//
// Data movement:
// - K and V tiles are double-buffered in shared memory and filled with 16-byte cp.async.cg copies
//   (global -> shared, no register staging): tile i + 1 is in flight while tile i is computed.
//   One __syncthreads per tile, right after this thread's cp.async.wait_group 0: it publishes
//   tile i to all warps and also proves every warp is done with the other stage (tile i - 1, or
//   Q on the first pass), which is then refilled with tile i + 1.
// - Each warp copies 16 key rows of a tile; lanes 0..15 look up one row's cache slot each (one
//   block-table lookup per key row) and the other lanes get it by shuffle.
// - Q, K and V all stay row-major in shared memory. Each warp stages its own 16 Q rows (no block
//   barrier: only that warp reads them), loads its Q A-fragments once with ldmatrix.x4 and keeps
//   them in registers for the whole KV loop; Q is staged in stage 1's K buffer, free until the
//   first barrier. Exception: at head_dim > kTcMaxRegisterQDim (256) the 64 Q registers would
//   not fit next to O (128) and S (32) without spills, so Q keeps its own shared buffer and is
//   re-read with ldmatrix.x4 for each tile. K B-fragments come from ldmatrix.x4, V B-fragments
//   from ldmatrix.x4.trans (which transposes 8x8 blocks on the fly, so V is never transposed
//   through 16-bit stores).
//
// Bank math (32 banks x 4 bytes = 8 groups of 16 bytes per 128-byte line): every shared row holds
// HEAD_DIM + kTcPad 16-bit elements, i.e. S = HEAD_DIM / 8 + 1 16-byte units; HEAD_DIM % 16 == 0
// makes S odd. An ldmatrix phase reads one 8x8 matrix = 8 rows x 16 bytes at the same column, at
// units c + r S (r = 0..7); S odd makes r S mod 8 a permutation of 0..7, so all 8 rows hit
// distinct bank groups: conflict-free for every head_dim. The 16-byte tile stores (cp.async and
// the Q staging) go lane-consecutive along a row; a phase of 8 lanes inside one row covers 8
// consecutive units, conflict-free (always the case for head_dim 64, 128, 256, whose rows are a
// whole number of 8-lane phases); for head_dim 80 / 96 the phases that straddle two rows are at
// most 2-way, on the asynchronous copy path only.
//
// Expected effect (no GPU here to measure it): the old kernel transposed V with 16-bit stores
// that all hit one bank (16-way conflicts) and loaded K/V one register-staged vector at a time
// with the loads exposed between barriers; now shared accesses are conflict-free, global loads
// overlap the tensor-core math of the previous tile, and there is one barrier per tile instead
// of two. Shared memory: 2 stages x (K + V) x 64 rows x (HEAD_DIM + 8) x 2 bytes (36 KB at
// head_dim 64, 68 KB at 128; 165 KB at 256 with Q's own buffer), mirrored by
// launch_config.prefill_tc_shared_mem_bytes. HEAD_DIM must be a multiple of 16.
#include "async_copy.cuh"
#include "common.cuh"

constexpr int kTcThreads = 128;
constexpr int kTcRows = 64;
constexpr int kTcKeys = 64;
constexpr int kTcPad = 8;     // 16-bit elements of padding per shared row (see the bank math)
constexpr int kTcStages = 2;  // K/V tile buffers
constexpr int kTcMaxRegisterQDim = 128;  // largest head_dim whose Q fragments stay in registers

template <int HEAD_DIM>
struct TcLayout {
  static constexpr int kStride = HEAD_DIM + kTcPad;           // elements per Q / K / V shared row
  static constexpr int kTileElems = kTcKeys * kStride;        // one K or V tile
  static constexpr int kVecsPerRow = HEAD_DIM / 8;            // 16-byte vectors per row
  static constexpr int kWarpRows = 16;                        // Q rows / key rows per warp
  static constexpr int kCopiesPerLane = kWarpRows * kVecsPerRow / 32;  // per tile and tensor
  static constexpr int kDimSteps = HEAD_DIM / 16;             // k-steps of S = Q K^T
  static constexpr int kDimTiles = HEAD_DIM / 8;              // n-tiles of O
  static constexpr int kKeyTiles = kTcKeys / 8;               // n-tiles of S
  static constexpr int kKeySteps = kTcKeys / 16;              // k-steps of O += P V
  // Q A-fragments in registers for the whole KV loop (HEAD_DIM / 4 registers); at 256 they would
  // not fit next to O and S, so there Q stays in its own shared buffer and is re-read per tile.
  static constexpr bool kQInRegisters = HEAD_DIM <= kTcMaxRegisterQDim;
  static constexpr int kQOffset = (kQInRegisters ? 2 : 2 * kTcStages) * kTileElems;
  static_assert(HEAD_DIM % 16 == 0, "the tensor-core prefill needs head_dim % 16 == 0");
  static_assert(kTcRows == kTcKeys, "Q is staged in one K tile buffer");
  static_assert(kTcRows == (kTcThreads / 32) * kWarpRows, "one warp per 16 rows");
  static_assert(kTcKeys == (kTcThreads / 32) * kWarpRows, "one warp copies 16 key rows");
};

template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(kTcThreads) prefill_attention_tc(
    PAGED_ATTENTION_TENSORS(T),
    PAGED_ATTENTION_SHAPE,
    int tokens_per_tile,
    int block_size,
    int skip_single_token_queries) {
  using L = TcLayout<HEAD_DIM>;

  PrefillTile tile;
  if (!find_prefill_tile(query_start_loc, seq_lens, tokens_per_tile, group_size,
                         skip_single_token_queries, sliding_window, /*heavy_first=*/true, &tile)) {
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

  // Stage s: K tile at smem + 2 s kTileElems, its V tile right after; [kTcKeys][kStride] each.
  extern __shared__ float4 tc_smem4[];
  unsigned short* smem = reinterpret_cast<unsigned short*>(tc_smem4);
  const SharedAddress smem_address = shared_address(tc_smem4);  // byte address of smem[0]

  const long long slot_stride = static_cast<long long>(num_kv_heads) * HEAD_DIM;
  const long long head_offset = static_cast<long long>(kv_head) * HEAD_DIM;
  const int* block_row = block_table + static_cast<long long>(req) * block_table_stride;

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4;
  const int t = lane % 4;
  const int warp_row0 = warp * L::kWarpRows;

  // Issues this warp's 16 key rows of the tile at kv0 into `stage` (zeros past kv_end).
  const auto load_kv_tile = [&](int kv0, int stage) {
    const int pos = kv0 + warp_row0 + lane % L::kWarpRows;
    long long row_offset = -1;  // element offset of the row's K / V in the cache, -1 = none
    if (lane < L::kWarpRows && pos < kv_end) {
      row_offset = cache_slot(block_row, pos, block_size) * slot_stride + head_offset;
    }
    const SharedAddress k_dst =
        smem_address + 2 * ((2 * stage * L::kTileElems) + warp_row0 * L::kStride);
    const SharedAddress v_dst = k_dst + 2 * L::kTileElems;
#pragma unroll 2  // (full unrolling makes ptxas spill at head_dim 80 / 96)
    for (int i = 0; i < L::kCopiesPerLane; ++i) {
      const int idx = lane + 32 * i;
      const int row = idx / L::kVecsPerRow;
      const int col = (idx % L::kVecsPerRow) * 8;
      const long long offset = __shfl_sync(0xffffffffu, row_offset, row);
      const bool valid = offset >= 0;
      const long long src = valid ? offset + col : 0;
      const int dst = 2 * (row * L::kStride + col);
      cp_async_16(k_dst + dst, key_cache + src, valid);
      cp_async_16(v_dst + dst, value_cache + src, valid);
    }
  };

  load_kv_tile(kv_begin, 0);
  cp_async_commit();

  // This warp's Q rows: staged in stage 1's K buffer and held as A fragments in registers, or
  // (!kQInRegisters) kept in their own buffer and re-read with ldmatrix for every KV tile.
  unsigned short* s_q = smem + L::kQOffset + warp_row0 * L::kStride;
  // Matrices 0..3 = (rows 0-7, cols 0-7), (rows 8-15, 0-7), (0-7, 8-15), (8-15, 8-15).
  const SharedAddress q_row = shared_address(s_q + (lane % 16) * L::kStride + (lane / 16) * 8);
  unsigned int q_frag[L::kQInRegisters ? L::kDimSteps : 1][4];
  {
#pragma unroll
    for (int i = 0; i < L::kCopiesPerLane; ++i) {
      const int idx = lane + 32 * i;
      const int row = idx / L::kVecsPerRow;
      const int col = (idx % L::kVecsPerRow) * 8;
      const int cta_row = warp_row0 + row;
      uint4 raw = make_uint4(0u, 0u, 0u, 0u);
      if (cta_row < num_rows) {
        const long long token = q_begin + tok0 + cta_row / group_size;
        const long long head = static_cast<long long>(kv_head) * group_size + cta_row % group_size;
        raw = load_raw(query + token * query_token_stride + head * HEAD_DIM + col);
      }
      *reinterpret_cast<uint4*>(s_q + row * L::kStride + col) = raw;
    }
    __syncwarp();
    if constexpr (L::kQInRegisters) {
#pragma unroll
      for (int ks = 0; ks < L::kDimSteps; ++ks) {
        ldmatrix_x4<false>(q_frag[ks], q_row + 32 * ks);
      }
    }
  }

  const int rows[2] = {warp_row0 + g, warp_row0 + g + 8};
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

  // ldmatrix row addresses within a tile. K (non-transposed): matrices (keys 0-7, dims 0-7),
  // (0-7, 8-15), (8-15, 0-7), (8-15, 8-15) = b[0..1] of key tiles 2p and 2p + 1. V (transposed):
  // (keys 0-7, dims 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15) = b[0..1] of dim tiles 2p, 2p + 1.
  const int k_lane_offset = 2 * ((lane % 8 + 8 * (lane / 16)) * L::kStride + 8 * ((lane / 8) % 2));
  const int v_lane_offset = 2 * ((lane % 8 + 8 * ((lane / 8) % 2)) * L::kStride + 8 * (lane / 16));

  int stage = 0;
  for (int kv0 = kv_begin; kv0 < kv_end; kv0 += kTcKeys) {
    cp_async_wait<0>();  // this thread's copies of the tile at kv0 have landed
    __syncthreads();     // ... and everyone's; every warp is done with the other stage
    if (kv0 + kTcKeys < kv_end) {
      load_kv_tile(kv0 + kTcKeys, stage ^ 1);
      cp_async_commit();
    }
    const SharedAddress s_k = smem_address + 2 * (2 * stage * L::kTileElems);  // byte addresses
    const SharedAddress s_v = s_k + 2 * L::kTileElems;

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
      const int qi = L::kQInRegisters ? ks : 0;
      if constexpr (!L::kQInRegisters) {
        ldmatrix_x4<false>(q_frag[0], q_row + 32 * ks);
      }
#pragma unroll
      for (int np = 0; np < L::kKeyTiles / 2; ++np) {
        unsigned int kb[4];
        ldmatrix_x4<false>(kb, s_k + 2 * (np * 16 * L::kStride + ks * 16) + k_lane_offset);
        const unsigned int b0[2] = {kb[0], kb[1]};
        const unsigned int b1[2] = {kb[2], kb[3]};
        mma_m16n8k16<T>(s[2 * np], q_frag[qi], b0);
        mma_m16n8k16<T>(s[2 * np + 1], q_frag[qi], b1);
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
      for (int dp = 0; dp < L::kDimTiles / 2; ++dp) {
        unsigned int vb[4];
        ldmatrix_x4<true>(vb, s_v + 2 * (kstep * 16 * L::kStride + dp * 16) + v_lane_offset);
        const unsigned int b0[2] = {vb[0], vb[1]};
        const unsigned int b1[2] = {vb[2], vb[3]};
        mma_m16n8k16<T>(o[2 * dp], a, b0);
        mma_m16n8k16<T>(o[2 * dp + 1], a, b1);
      }
    }
    stage ^= 1;
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
