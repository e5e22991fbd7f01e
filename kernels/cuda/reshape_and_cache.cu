// reshape_and_cache: copy each new token's K and V row into its paged-cache slot.
//
// One CTA per token. A "row" is one token's [num_kv_heads, head_dim] K (or V) slice, moved as
// 16-byte vectors; the copy is byte-exact and dtype-agnostic (the launcher converts K/V to the
// cache dtype first). Tokens with slot_mapping < 0 are padding and leave the cache untouched.

extern "C" __global__ void reshape_and_cache(
    const uint4* __restrict__ key,          // [num_tokens, row_vecs] with a token stride
    const uint4* __restrict__ value,        // [num_tokens, row_vecs] with a token stride
    uint4* __restrict__ key_cache,          // [num_slots, row_vecs], contiguous
    uint4* __restrict__ value_cache,        // [num_slots, row_vecs], contiguous
    const long long* __restrict__ slot_mapping,  // [num_tokens]
    long long key_token_stride_vecs,
    long long value_token_stride_vecs,
    int row_vecs) {
  const long long token = blockIdx.x;
  const long long slot = slot_mapping[token];
  if (slot < 0) {
    return;
  }
  const uint4* key_row = key + token * key_token_stride_vecs;
  const uint4* value_row = value + token * value_token_stride_vecs;
  uint4* key_dst = key_cache + slot * row_vecs;
  uint4* value_dst = value_cache + slot * row_vecs;
  for (int i = threadIdx.x; i < row_vecs; i += blockDim.x) {
    key_dst[i] = key_row[i];
    value_dst[i] = value_row[i];
  }
}
