// Body of the fused up/gate decode-matvec over ENDOR bundles (mx.fast.metal_kernel source; header:
// endor_common.metal). One SIMD group per (neuron j, token m): bundle j = words bounds[2 j] ..
// bounds[2 j + 1] of `enc`, holding its gate block (gated ACTs), up block and down block in order.
// The blocks are decoded while they are multiplied, never written out:
//   ACT 0 (gated, SiLU):  a = silu(gate_j . x);   h = a * (up_j . x)  where |a| > threshold, else 0
//   ACT 1 (ReLU):         a = max(up_j . x, 0);   h = a               where a > threshold, else 0
//   ACT 2 (gated ReLU):   a = max(gate_j . x, 0); h = a * (up_j . x)  where a > threshold, else 0
// Also writes (token 0's SIMD group) down_at[j]: the word where bundle j's down block starts, or -1
// when the bundle's blocks do not add up to its length (a popcount that disagrees with the stored
// bytes: h is 0 and endor_down skips the bundle; the caller reports it); and down_prefix[j, c]: the
// values stored in the down block before its 1024-column chunk c (c = chunks: all of them), so
// endor_down reads each bitmap word once.
// Template: T output type, FMT (endor_common.metal), ACT. params: [count, K, D, group_size].
// Grid (32 * count, M, 1).
uint j = thread_position_in_grid.x / 32;
uint m = thread_position_in_grid.y;
uint lane = thread_index_in_simdgroup;
uint count = uint(params[0]);
if (j >= count) {
  return;
}
uint K = uint(params[1]);
uint D = uint(params[2]);
uint group_size = uint(params[3]);
uint at = uint(bounds[2 * j]);
uint end = uint(bounds[2 * j + 1]);
bool ok = true;
float g = 0.0f;
if (ACT != 1) {
  g = metal::simd_sum(endor_lane_dot<FMT>(enc, x + m * K, at, end, K, group_size, lane, ok));
}
float u = metal::simd_sum(endor_lane_dot<FMT>(enc, x + m * K, at, end, K, group_size, lane, ok));
uint down_at = at;
uint down_words = (D + 31) / 32;
uint chunks = (down_words + 31) / 32;
if (ok && at + down_words <= end) {
  uint seen = 0;  // values stored in the down block's earlier 1024-column chunks
  for (uint c = 0; c < chunks; c++) {
    uint i = 32 * c + lane;
    uint in_chunk = metal::simd_sum(i < down_words ? metal::popcount(endor_bitmap_word(enc, at, D, i)) : 0u);
    if (m == 0 && lane == 0) {
      down_prefix_out[j * (chunks + 1) + c] = int(seen);
    }
    seen += in_chunk;
  }
  if (m == 0 && lane == 0) {
    down_prefix_out[j * (chunks + 1) + chunks] = int(seen);
  }
  ok = at + down_words + EndorPayload<FMT>::words(seen, group_size) == end;
} else {
  ok = false;
}
if (lane == 0) {
  float threshold = float(thresh[0]);
  float h;
  if (ACT == 0) {
    float a = g / (1.0f + metal::exp(-g));
    h = metal::abs(a) > threshold ? a * u : 0.0f;
  } else if (ACT == 1) {
    float a = metal::max(u, 0.0f);
    h = a > threshold ? a : 0.0f;
  } else {
    float a = metal::max(g, 0.0f);
    h = a > threshold ? a * u : 0.0f;
  }
  out[m * count + j] = T(ok ? h : 0.0f);
  if (m == 0) {
    down_at_out[j] = ok ? int(down_at) : -1;
  }
}
