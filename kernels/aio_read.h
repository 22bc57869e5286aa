// Linux native AIO reads submitted and reaped in one C++ loop (io.aio's small-call path).
#pragma once

#include <cstdint>
#include <memory>

#include "cpu_features.h"

namespace flash {

// The crc32 of the bundles a read brought into staging, taken as the read lands (while later
// reads are still in flight): read k holds bundles first[k]..first[k + 1] - 1, bundle b at
// flat + starts[b]; its crc32 chains over `pieces` byte ranges (offset piece_off[p], piece_len[p]
// bytes from its start) into crcs[b]. Bundles of a read that did not land whole are left as they were.
struct LandedCrcs {
  const uint8_t* flat;
  const int64_t* first;
  const int64_t* starts;
  const int64_t* piece_off;
  const int64_t* piece_len;
  int64_t pieces;
  uint32_t* crcs;
  Isa isa;
};

// Read sizes[i] bytes at offsets[i] of fds[i] into addresses[i] (vectored[i] != 0: addresses[i] is
// an array of sizes[i] struct iovec, IOCB_CMD_PREADV) through the io_setup context `ctx`, keeping
// at most `depth` reads in flight, until every read has completed. res[i] <- bytes read or -errno
// (-ECANCELED for a read never submitted). Returns 0, or -errno of a failed io_submit /
// io_getevents (every submitted read has completed by then: no buffer is written after return).
// No allocation per read beyond one iocb; the caller's thread does all of it (GIL released).
// landed: optional, the crc32 of each read's bundles taken as it lands (LandedCrcs).
// spin_ns: before each wait for completions, watch the context's completion ring for up to this
// many nanoseconds (no sleep, no wake-up) before blocking in io_getevents; 0: block at once.
// waits: optional int64[2] += (waits a completion ended while spinning, waits that blocked).
int64_t aio_read_all(uint64_t ctx, int64_t n, const int64_t* fds, const int64_t* offsets, const int64_t* sizes,
                     const uint64_t* addresses, const uint8_t* vectored, int64_t depth, int64_t* res,
                     const LandedCrcs* landed = nullptr, int64_t spin_ns = 0, int64_t* waits = nullptr);

// The bundles a staged call's reads bring in and where they go: read k holds bundles
// first[k]..first[k + 1] - 1 (first has reads + 1 entries), bundle b at file offset starts[b];
// want[b] its expected crc32 over `pieces` ranges (piece_off[p], piece_len[p] from its start), or
// want null (no check); target t takes target_len[t] bytes from target_off[t] of each bundle into
// row slots[b] of target_dest[t] (rows target_stride[t] bytes apart).
struct StagedBundles {
  const int64_t* first;
  const int64_t* starts;
  int64_t bundles;
  const uint32_t* want;
  const int64_t* piece_off;
  const int64_t* piece_len;
  int64_t pieces;
  const int64_t* target_off;
  const int64_t* target_len;
  uint8_t* const* target_dest;
  const int64_t* target_stride;
  int64_t targets;
  const int64_t* slots;
};

// A small staged call in one go: read k (r1[k] - r0[k] bytes at r0[k] of fd) lands at
// staging + pos[k] (aio_read_all with spin_ns and waits; each bundle's crc32 into crcs[b] as its
// read lands when want is given), then, when every read landed whole, each bundle's crc32 is
// compared with want (*bad <- the first that differs, -1: none; nothing is copied then) and the
// bundles are copied out to their rows. Returns -errno of a failed io_submit / io_getevents, else
// the number of reads that did not land whole (0: done; else nothing was compared or copied: the
// caller redoes those reads and finishes with res and crcs).
int64_t aio_read_staged(uint64_t ctx, int64_t n, int64_t fd, const int64_t* r0, const int64_t* r1,
                        const int64_t* pos, uint8_t* staging, int64_t depth, int64_t spin_ns, int64_t* waits,
                        int64_t* res, uint32_t* crcs, const StagedBundles& b, int64_t* bad);

// A plain layer's bundles: bundle i is `stride` bytes at offset + i * stride of fd, `count` of them.
struct StridedLayer {
  int64_t fd, count, offset, stride;
};

// How plan_strided_reads (read_plan.h) plans a call's reads.
struct PlanRule {
  int64_t align;
  bool merge;
  int64_t merge_gap, max_read;
};

// What aio_read_ids did: reads (the plan's, or PLAN_ID_OUT_OF_RANGE / PLAN_DUPLICATE_ID: nothing
// read), staged (their bytes), fits (staged <= the staging given; false: nothing read), status and
// bad (aio_read_staged's, when it ran).
struct IdsRead {
  int64_t reads, staged;
  bool fits;
  int64_t status, bad;
};

// Planned reads of a call in one go: read k (r0[k]..r1[k] of fd, k < reads) holds the sorted
// bundles first[k]..first[k + 1] - 1 of sorted[0..n) (file offsets starts; index[i]: the position
// of bundle i among the caller's ids, whose row is slots[index[i]]), staged back to back from
// staging[0] when they fit staging_size (else nothing read, fits false), then aio_read_staged with
// b's checks and targets; table: the crc32 table by bundle id, or null. res: room for the reads,
// crcs for n.
IdsRead aio_read_planned(uint64_t ctx, int64_t fd, int64_t n, const int64_t* sorted, const int64_t* index,
                         const int64_t* starts, int64_t reads, const int64_t* r0, const int64_t* r1,
                         const int64_t* first, const int64_t* slots, const uint32_t* table, uint8_t* staging,
                         int64_t staging_size, int64_t depth, int64_t spin_ns, int64_t* waits, int64_t* res,
                         uint32_t* crcs, StagedBundles b);

// aio_read_planned in two steps: the constructor stages the plan (fits() false: more than
// staging_size, nothing will be read), start() submits the first reads (at most depth; false: none
// went out, finish() still reads them all) and returns at once, finish() reaps the rest, checks and
// copies out, returning what aio_read_planned returns. Between them the caller may compute and make
// reads of its own on another AIO context; it keeps every array it passed (and b's) and the staging
// alive until finish() has returned or the object is gone (its destructor waits for the reads in
// flight, so none lands afterwards).
class PlannedRead {
 public:
  PlannedRead(uint64_t ctx, int64_t fd, int64_t n, const int64_t* sorted, const int64_t* index, const int64_t* starts,
              int64_t reads, const int64_t* r0, const int64_t* r1, const int64_t* first, const int64_t* slots,
              const uint32_t* table, uint8_t* staging, int64_t staging_size, int64_t depth, int64_t spin_ns,
              int64_t* waits, int64_t* res, uint32_t* crcs, StagedBundles b);
  PlannedRead(const PlannedRead&) = delete;
  PlannedRead& operator=(const PlannedRead&) = delete;
  ~PlannedRead();
  bool fits() const;
  bool start();
  IdsRead finish();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A decode call from bundle ids to rows in one go: bundles ids[0..n) of `layer` planned as
// plan_strided_reads plans them (plan: int64 scratch [8 * n], its rows as that function writes
// them), then aio_read_planned, bundle ids[i] going to row slots[i] (b.first, starts, bundles and
// slots are filled from the plan; table: the crc32 table by bundle id, or null). res and crcs:
// room for n.
IdsRead aio_read_ids(uint64_t ctx, const StridedLayer& layer, const PlanRule& rule, int64_t n, const int64_t* ids,
                     const int64_t* slots, const uint32_t* table, uint8_t* staging, int64_t staging_size,
                     int64_t depth, int64_t spin_ns, int64_t* waits, int64_t* plan, int64_t* res, uint32_t* crcs,
                     StagedBundles b);

// True when this build has the Linux AIO loop (false elsewhere: the caller uses its own).
bool aio_read_available();

}  // namespace flash
