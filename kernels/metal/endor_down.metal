// Body of the down decode-matvec over ENDOR bundles (mx.fast.metal_kernel source; header:
// endor_common.metal): y[m, :] = sum_j h[m, j] * down_j, down_j the D-element down block of bundle
// j at word down_at[j] (from endor_up; -1: a bad bundle, skipped), decoded while it is added.
// Threadgroup (32, NSG) owns 1024 columns: lane l of every SIMD group owns bitmap word
// 32 * chunk + l (columns 32 * (32 chunk + l) ..+ 31), whose first stored value is the values of
// the earlier chunks (down_prefix[j, chunk], from endor_up) plus the prefix sum of this chunk's
// popcounts (simd_prefix_exclusive_sum). SIMD group s adds rows s, s + NSG, ... of its split into its own
// 1024 sums in threadgroup memory; after the barrier the NSG sums of each column are added. Rows
// with h == 0 are not read. Splits as in sparse_down: out[m, split, :] float32, summed by the caller.
// Template: FMT, NSG. params: [count, D, group_size, splits].
// Grid (32 * ceil(D / 1024), NSG, M * splits).
threadgroup float partial[NSG * 1024];
uint lane = thread_index_in_simdgroup;
uint s = simdgroup_index_in_threadgroup;
uint count = uint(params[0]);
uint D = uint(params[1]);
uint group_size = uint(params[2]);
uint splits = uint(params[3]);
uint m = threadgroup_position_in_grid.z / splits;
uint split = threadgroup_position_in_grid.z % splits;
uint chunk = threadgroup_position_in_grid.x;
uint words = (D + 31) / 32;
uint chunks = (words + 31) / 32;
uint i = chunk * 32 + lane;
threadgroup float* sums = partial + s * 1024 + lane * 32;  // this lane's 32 columns
for (uint b = 0; b < 32; b++) {
  sums[b] = 0.0f;
}
for (uint j = split * NSG + s; j < count; j += NSG * splits) {
  float hv = float(h[m * count + j]);
  int at = down_at[j];
  if (hv == 0.0f || at < 0) {
    continue;  // a masked neuron (or a bad bundle): its block is not read
  }
  uint before = uint(down_prefix[j * (chunks + 1) + chunk]);
  uint nnz = uint(down_prefix[j * (chunks + 1) + chunks]);
  uint p = uint(at) + words;
  uint word = i < words ? endor_bitmap_word(enc, uint(at), D, i) : 0u;
  uint v = before + metal::simd_prefix_exclusive_sum(metal::popcount(word));
  while (word != 0u) {
    uint b = metal::ctz(word);
    sums[b] += hv * EndorPayload<FMT>::value(enc, p, nnz, group_size, v);
    v++;
    word &= word - 1u;
  }
}
metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
for (uint c = thread_index_in_threadgroup; c < 1024; c += NSG * 32) {
  uint d = chunk * 1024 + c;
  if (d < D) {
    float sum = 0.0f;
    for (uint k = 0; k < NSG; k++) {
      sum += partial[k * 1024 + c];
    }
    out[(m * splits + split) * D + d] = sum;
  }
}
