// Linux native AIO reads submitted and reaped in one C++ loop (io.aio's small-call path).
#pragma once

#include <cstdint>

namespace flash {

// Read sizes[i] bytes at offsets[i] of fds[i] into addresses[i] (vectored[i] != 0: addresses[i] is
// an array of sizes[i] struct iovec, IOCB_CMD_PREADV) through the io_setup context `ctx`, keeping
// at most `depth` reads in flight, until every read has completed. res[i] <- bytes read or -errno
// (-ECANCELED for a read never submitted). Returns 0, or -errno of a failed io_submit /
// io_getevents (every submitted read has completed by then: no buffer is written after return).
// No allocation per read beyond one iocb; the caller's thread does all of it (GIL released).
int64_t aio_read_all(uint64_t ctx, int64_t n, const int64_t* fds, const int64_t* offsets, const int64_t* sizes,
                     const uint64_t* addresses, const uint8_t* vectored, int64_t depth, int64_t* res);

// True when this build has the Linux AIO loop (false elsewhere: the caller uses its own).
bool aio_read_available();

}  // namespace flash
