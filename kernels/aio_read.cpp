// aio_read.h: io_submit / io_getevents through syscall(2) (glibc has no wrappers for native AIO).
#include "aio_read.h"

#include "endor_decode.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#if defined(__linux__)
#include <linux/aio_abi.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace flash {

#if defined(__linux__)

bool aio_read_available() { return true; }

namespace {

void crc_landed(const LandedCrcs& l, int64_t read) {
  for (int64_t b = l.first[read]; b < l.first[read + 1]; ++b) {
    uint32_t crc = 0;
    for (int64_t p = 0; p < l.pieces; ++p)
      crc = endor::crc32(crc, l.flat + l.starts[b] + l.piece_off[p], l.piece_len[p], l.isa);
    l.crcs[b] = crc;
  }
}

}  // namespace

int64_t aio_read_all(uint64_t ctx, int64_t n, const int64_t* fds, const int64_t* offsets, const int64_t* sizes,
                     const uint64_t* addresses, const uint8_t* vectored, int64_t depth, int64_t* res,
                     const LandedCrcs* landed) {
  std::vector<iocb> cbs(static_cast<size_t>(n));
  std::vector<iocb*> ptrs(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    iocb& cb = cbs[i];
    std::memset(&cb, 0, sizeof(cb));
    cb.aio_data = static_cast<uint64_t>(i);
    cb.aio_lio_opcode = (vectored != nullptr && vectored[i]) ? IOCB_CMD_PREADV : IOCB_CMD_PREAD;
    cb.aio_fildes = static_cast<uint32_t>(fds[i]);
    cb.aio_buf = addresses[i];
    cb.aio_nbytes = static_cast<uint64_t>(sizes[i]);
    cb.aio_offset = offsets[i];
    ptrs[i] = &cb;
    res[i] = -ECANCELED;
  }
  if (depth < 1) depth = 1;
  std::vector<io_event> events(static_cast<size_t>(depth));
  const aio_context_t context = static_cast<aio_context_t>(ctx);
  int64_t submitted = 0, completed = 0, error = 0;
  auto reap = [&](int64_t min_nr) -> bool {  // false on a hard error (stored in `error`)
    const long got = syscall(SYS_io_getevents, context, min_nr, depth, events.data(), nullptr);
    if (got < 0) {
      if (errno == EINTR) return true;
      error = -errno;
      return false;
    }
    for (long e = 0; e < got; ++e) res[events[e].data] = events[e].res;
    completed += got;
    if (landed != nullptr)  // after recording every result: the work below runs while later reads fly
      for (long e = 0; e < got; ++e) {
        const int64_t k = static_cast<int64_t>(events[e].data);
        if (res[k] == sizes[k] && (vectored == nullptr || !vectored[k])) crc_landed(*landed, k);
      }
    return true;
  };
  while (completed < n) {
    const int64_t room = std::min(depth - (submitted - completed), n - submitted);
    if (room > 0) {
      const long got = syscall(SYS_io_submit, context, room, ptrs.data() + submitted);
      if (got > 0) {
        submitted += got;
      } else if (got < 0 && errno != EAGAIN && errno != EINTR) {
        error = -errno;
        break;
      }
    }
    if (submitted == completed) continue;  // nothing in flight: submit again
    if (!reap(1)) break;
  }
  while (completed < submitted) {  // after an error: the kernel may still write into caller buffers
    const long got = syscall(SYS_io_getevents, context, submitted - completed, depth, events.data(), nullptr);
    if (got < 0) {
      if (errno == EINTR) continue;
      break;  // a context that cannot be reaped: nothing more can be done here
    }
    for (long e = 0; e < got; ++e) res[events[e].data] = events[e].res;
    completed += got;
  }
  return error;
}

#else

bool aio_read_available() { return false; }

int64_t aio_read_all(uint64_t, int64_t n, const int64_t*, const int64_t*, const int64_t*, const uint64_t*,
                     const uint8_t*, int64_t, int64_t* res, const LandedCrcs*) {
  for (int64_t i = 0; i < n; ++i) res[i] = -ENOSYS;
  return -ENOSYS;
}

#endif

}  // namespace flash
