// Linux native AIO reads submitted and reaped in one C++ loop (io.aio's small-call path).
#pragma once

#include <cstdint>

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

// True when this build has the Linux AIO loop (false elsewhere: the caller uses its own).
bool aio_read_available();

}  // namespace flash
