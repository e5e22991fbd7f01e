// lora_shrink + lora_expand: the batched LoRA of one linear (vLLM's punica sgmv / bgmv),
// y[t] += B[s] (A[s] x[t]) for every token t whose slot s = token_slots[t] lies in
// [0, num_slots); tokens with any other slot (-1: no adapter) are neither read nor written.
//
// x [T, IN], y [T, OUT], lora_a [S, W, IN], lora_b [S, OUT, W]: contiguous, of one type T (float,
// half_t or bf16_t); token_slots int32 [T]; shrunk float32 [T, W] is the launcher's scratch.
// All math is fp32: the shrink A x stays fp32 in `shrunk`, never rounded, and y is rounded once.
//
// lora_shrink: grid x = tiles of kLoraShrinkTokens tokens, y = groups of kLoraShrinkWarps *
// kLoraShrinkRows rows of A. Each warp owns kLoraShrinkRows rows; its lanes stride over IN
// (coalesced), then reduce by shuffles. A CTA's tokens are consecutive, and a prompt's are
// one slot, so the rows it reads again for its next token come from L1.
// lora_expand: grid x = tiles of kLoraExpandTokens tokens, y = blocks of kLoraExpandThreads
// output columns, one per thread: y[t][o] += B[s][o] . shrunk[t], the row of B read in 16-byte
// vectors when the launcher says rows are 16-byte aligned (`vector_rows`), else one element
// at a time.
// No shared memory and no block barrier: warps never exchange data except by shuffles.
#include "common.cuh"

constexpr int kLoraShrinkWarps = 4;
constexpr int kLoraShrinkRows = 4;  // rows of A per warp
constexpr int kLoraShrinkTokens = 4;
constexpr int kLoraExpandThreads = 128;
constexpr int kLoraExpandTokens = 4;

__device__ __forceinline__ float lora_float(float value) { return value; }
__device__ __forceinline__ float lora_float(half_t value) { return half_bits_to_float(value.bits); }
__device__ __forceinline__ float lora_float(bf16_t value) { return bf16_bits_to_float(value.bits); }

__device__ __forceinline__ bool has_slot(int slot, int num_slots) {
  return slot >= 0 && slot < num_slots;
}

template <typename T>
__global__ void __launch_bounds__(kLoraShrinkWarps * 32) lora_shrink(
    const T* __restrict__ x,                // [num_tokens, in_features]
    const T* __restrict__ lora_a,           // [num_slots, width, in_features]
    const int* __restrict__ token_slots,    // [num_tokens]
    float* __restrict__ shrunk,             // [num_tokens, width]
    int num_tokens,
    int in_features,
    int width,
    int num_slots) {
  const int lane = threadIdx.x % 32;
  const int first_row = (blockIdx.y * kLoraShrinkWarps + threadIdx.x / 32) * kLoraShrinkRows;
  if (first_row >= width) {
    return;  // the whole warp: its shuffles below stay full-warp
  }
  const int num_rows = min(kLoraShrinkRows, width - first_row);
  const int first_token = blockIdx.x * kLoraShrinkTokens;
  const int end_token = min(num_tokens, first_token + kLoraShrinkTokens);
  for (int token = first_token; token < end_token; ++token) {
    const int slot = token_slots[token];
    if (!has_slot(slot, num_slots)) {
      continue;
    }
    const T* x_row = x + static_cast<long long>(token) * in_features;
    const T* a_rows =
        lora_a + (static_cast<long long>(slot) * width + first_row) * in_features;
    float sums[kLoraShrinkRows];
#pragma unroll
    for (int r = 0; r < kLoraShrinkRows; ++r) {
      sums[r] = 0.0f;
    }
    for (int i = lane; i < in_features; i += 32) {
      const float value = lora_float(x_row[i]);
#pragma unroll
      for (int r = 0; r < kLoraShrinkRows; ++r) {
        // Rows past `width` repeat the last real one (in bounds) and are never stored.
        const long long row = min(r, num_rows - 1);
        sums[r] = fmaf(lora_float(a_rows[row * in_features + i]), value, sums[r]);
      }
    }
#pragma unroll
    for (int r = 0; r < kLoraShrinkRows; ++r) {
      float sum = sums[r];
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) {
        sum += __shfl_xor_sync(0xffffffffu, sum, offset);
      }
      if (lane == 0 && r < num_rows) {
        shrunk[static_cast<long long>(token) * width + first_row + r] = sum;
      }
    }
  }
}

// row . shrunk_row over `width` elements; `vector_rows`: the row is 16-byte aligned and a whole
// number of 16-byte vectors long.
template <typename T>
__device__ __forceinline__ float row_dot(const T* row, const float* shrunk_row, int width,
                                         int vector_rows) {
  float sum = 0.0f;
  if (vector_rows) {
    constexpr int kElems = VecTraits<T>::kElems;
    for (int w = 0; w < width; w += kElems) {
      float values[kElems];
      load_vec(row + w, values);
#pragma unroll
      for (int e = 0; e < kElems; ++e) {
        sum = fmaf(values[e], shrunk_row[w + e], sum);
      }
    }
    return sum;
  }
  for (int w = 0; w < width; ++w) {
    sum = fmaf(lora_float(row[w]), shrunk_row[w], sum);
  }
  return sum;
}

template <typename T>
__global__ void __launch_bounds__(kLoraExpandThreads) lora_expand(
    const float* __restrict__ shrunk,       // [num_tokens, width]
    const T* __restrict__ lora_b,           // [num_slots, out_features, width]
    const int* __restrict__ token_slots,    // [num_tokens]
    T* __restrict__ y,                      // [num_tokens, out_features], updated in place
    int num_tokens,
    int out_features,
    int width,
    int num_slots,
    int vector_rows) {
  const int column = blockIdx.y * kLoraExpandThreads + threadIdx.x;
  if (column >= out_features) {
    return;
  }
  const int first_token = blockIdx.x * kLoraExpandTokens;
  const int end_token = min(num_tokens, first_token + kLoraExpandTokens);
  for (int token = first_token; token < end_token; ++token) {
    const int slot = token_slots[token];
    if (!has_slot(slot, num_slots)) {
      continue;
    }
    const T* row = lora_b + (static_cast<long long>(slot) * out_features + column) * width;
    const float sum =
        row_dot(row, shrunk + static_cast<long long>(token) * width, width, vector_rows);
    T* out = y + static_cast<long long>(token) * out_features + column;
    VecTraits<T>::store(out, lora_float(*out) + sum);
  }
}
