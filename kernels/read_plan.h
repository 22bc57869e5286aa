// The read plan of one plain (fixed-stride) bundle layer in one pass (io.loader.FlashLoader.plan).
#pragma once

#include <cstdint>

namespace flash {

// Returned by plan_strided_reads for bad ids (nothing else is written then).
constexpr int64_t PLAN_ID_OUT_OF_RANGE = -1;
constexpr int64_t PLAN_DUPLICATE_ID = -2;

// Bundles ids_in[0..n) of a layer whose bundle i is `stride` bytes at offset + i * stride, planned
// exactly as io.planner.plan_read_arrays does over their sorted file ranges: sorted ids (ids,
// index[i] = position of ids[i] in ids_in, a stable sort), starts[i] = offset + ids[i] * stride,
// lengths[i] = stride; reads rounded out to `align` bytes, and when `merge` a request joins the
// previous read when the gap between them is at most merge_gap bytes and the read stays within
// max_read bytes (a read holds at least one request). Read k covers [r0[k], r1[k]) and bundles
// first[k]..first[k + 1] - 1; member_read[i]: the read holding bundle i. Every output has room
// for n. Returns the number of reads, or PLAN_ID_OUT_OF_RANGE (an id outside 0..count-1) or
// PLAN_DUPLICATE_ID.
int64_t plan_strided_reads(int64_t n, const int64_t* ids_in, int64_t count, int64_t offset, int64_t stride,
                           int64_t align, bool merge, int64_t merge_gap, int64_t max_read, int64_t* ids,
                           int64_t* index, int64_t* starts, int64_t* lengths, int64_t* r0, int64_t* r1,
                           int64_t* first, int64_t* member_read);

}  // namespace flash
