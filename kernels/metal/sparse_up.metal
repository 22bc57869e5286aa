// Body of the fused up/gate projection (mx.fast.metal_kernel source; header: sparse_common.metal).
// One SIMD group per output neuron j of token m: h[m, j] for row r = ids[j] (use_ids) or j.
//   ACT 0 (gated, SiLU):  a = silu(gate_r . x);  h = a * (up_r . x)  where |a| > threshold, else 0
//   ACT 1 (ReLU):         a = max(up_r . x, 0);  h = a               where a > threshold, else 0
//   ACT 2 (gated ReLU):   a = max(gate_r . x, 0); h = a * (up_r . x) where a > threshold, else 0
//                         (relu_llama's relu, and its fatrelu with the threshold as `threshold`)
// (+ gate_bias[r] / up_bias[r] before the activation when HAS_BIAS)
// Template: T output type, BITS 0/4/8, ACT, HAS_BIAS. params: [count, use_ids, K, group_size].
// Grid (32 * count, M, 1): the row count and ids are inputs, so they change without a recompile.
uint j = thread_position_in_grid.x / 32;
uint m = thread_position_in_grid.y;
uint lane = thread_index_in_simdgroup;
uint count = uint(params[0]);
if (j >= count) {
  return;
}
bool use_ids = params[1] != 0;
uint K = uint(params[2]);
uint group_size = uint(params[3]);
uint r = use_ids ? uint(ids[j]) : j;
float u = metal::simd_sum(RowDot<BITS>::lane_dot(up_w, up_scales, up_biases, x + m * K, r, K, group_size, lane));
float g = 0.0f;
if (ACT != 1) {
  g = metal::simd_sum(RowDot<BITS>::lane_dot(gate_w, gate_scales, gate_biases, x + m * K, r, K, group_size, lane));
}
if (lane == 0) {
  if (HAS_BIAS) {
    u += float(up_bias[r]);
    g += float(gate_bias[r]);
  }
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
  out[m * count + j] = T(h);
}
