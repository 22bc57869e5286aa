// Body of the down projection over the rows an up/gate call used (mx.fast.metal_kernel source;
// header: sparse_common.metal): y[m, :] = sum_j h[m, j] * W[r_j, :], W the transposed down
// projection [rows, D] (one row per neuron), r_j = ids[j] (use_ids) or j; rows with h == 0 are
// skipped. Threadgroup (32, NSG): lane = column pack (one uint32 word, or 4 float16 values), SIMD
// group s sums rows s, s + NSG, ... of its row split; the NSG partial sums meet in threadgroup
// memory. The rows are cut into `splits` interleaved splits, one per threadgroup along z, each
// writing its own float32 partial row out[m, split, :] (the caller sums the splits): enough
// threadgroups to fill the GPU when D is small.
// Template: BITS 0/4/8, NSG. params: [count, use_ids, D, group_size, splits].
// Grid (32 * column threadgroups, NSG, M * splits).
threadgroup float partial[NSG * 256];
uint lane = thread_index_in_simdgroup;
uint s = simdgroup_index_in_threadgroup;
uint count = uint(params[0]);
bool use_ids = params[1] != 0;
uint D = uint(params[2]);
uint group_size = uint(params[3]);
uint splits = uint(params[4]);
uint m = threadgroup_position_in_grid.z / splits;
uint split = threadgroup_position_in_grid.z % splits;
const uint per_lane = BITS == 4 ? 8 : 4;
uint pack = threadgroup_position_in_grid.x * 32 + lane;
float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
RowAxpy<BITS>::accumulate(acc, w, scales, biases, h + m * count, ids, use_ids, count, D, group_size, pack,
                          split * NSG + s, NSG * splits);
for (uint v = 0; v < per_lane; v++) {
  partial[s * 32 * per_lane + lane * per_lane + v] = acc[v];
}
metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
uint d_first = threadgroup_position_in_grid.x * 32 * per_lane;
for (uint c = thread_index_in_threadgroup; c < 32 * per_lane; c += NSG * 32) {
  if (d_first + c < D) {
    float sum = 0.0f;
    for (uint k = 0; k < NSG; k++) {
      sum += partial[k * 32 * per_lane + c];
    }
    out[(m * splits + split) * D + d_first + c] = sum;
  }
}
