// The read plan of one plain bundle layer (read_plan.h): Python's numpy version costs ~40 array
// calls per layer and token; this is one pass over a few hundred ids.
#include "read_plan.h"

#include <algorithm>
#include <numeric>

namespace flash {

int64_t plan_strided_reads(int64_t n, const int64_t* ids_in, int64_t count, int64_t offset, int64_t stride,
                           int64_t align, bool merge, int64_t merge_gap, int64_t max_read, int64_t* ids,
                           int64_t* index, int64_t* starts, int64_t* lengths, int64_t* r0, int64_t* r1,
                           int64_t* first, int64_t* member_read) {
  bool sorted = true;
  for (int64_t i = 0; i < n; ++i) {
    if (ids_in[i] < 0 || ids_in[i] >= count) return PLAN_ID_OUT_OF_RANGE;
    if (i && ids_in[i] <= ids_in[i - 1]) sorted = false;
  }
  std::iota(index, index + n, int64_t{0});
  if (!sorted) {  // callers mostly pass sorted ids; the rest get numpy's stable argsort order
    std::stable_sort(index, index + n, [ids_in](int64_t a, int64_t b) { return ids_in[a] < ids_in[b]; });
    for (int64_t i = 1; i < n; ++i)
      if (ids_in[index[i]] == ids_in[index[i - 1]]) return PLAN_DUPLICATE_ID;
  }
  int64_t reads = 0, read_start = 0, prev_end = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = ids_in[index[i]], start = offset + id * stride;
    const int64_t a0 = start / align * align, a1 = (start + stride + align - 1) / align * align;
    ids[i] = id;
    starts[i] = start;
    lengths[i] = stride;
    // a new read unless merging, the gap is small enough and the read stays within max_read
    if (i == 0 || !merge || a0 - prev_end > merge_gap || a1 - read_start > max_read) {
      r0[reads] = read_start = a0;
      first[reads++] = i;
    }
    r1[reads - 1] = prev_end = a1;
    member_read[i] = reads - 1;
  }
  return reads;
}

}  // namespace flash
