// aio_read.h: io_submit / io_getevents through syscall(2) (glibc has no wrappers for native AIO).
#include "aio_read.h"

#include "endor_decode.h"
#include "read_plan.h"
#include "row_copy.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
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

// The completion ring io_setup maps into the process (fs/aio.c's struct aio_ring): the kernel
// appends events at tail, io_getevents consumes them from head. Read here, never written.
struct AioRing {
  unsigned id, nr, head, tail, magic, compat_features, incompat_features, header_length;
};
constexpr unsigned kAioRingMagic = 0xa10a10a1;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Spin (at most spin_ns nanoseconds) until the ring holds a completion; true when one came. A wait
// in io_getevents puts the thread to sleep: its wake-up costs tens of microseconds on an idle VM
// and up to a scheduler time slice on a busy core, more than most decode reads take.
bool spin_for_event(const AioRing* ring, int64_t spin_ns) {
  if (ring == nullptr || spin_ns <= 0) return false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::nanoseconds(spin_ns);
  for (int64_t i = 0;; ++i) {
    if (__atomic_load_n(&ring->tail, __ATOMIC_ACQUIRE) != __atomic_load_n(&ring->head, __ATOMIC_ACQUIRE))
      return true;
    cpu_relax();
    if ((i & 63) == 63 && std::chrono::steady_clock::now() >= deadline) return false;
  }
}

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
                     const LandedCrcs* landed, int64_t spin_ns, int64_t* waits) {
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
  const auto* ring = reinterpret_cast<const AioRing*>(ctx);
  if (ring->magic != kAioRingMagic) ring = nullptr;  // not the layout read above: wait in io_getevents only
  int64_t submitted = 0, completed = 0, error = 0;
  auto reap = [&](int64_t min_nr) -> bool {  // false on a hard error (stored in `error`)
    const bool spun = spin_for_event(ring, spin_ns);
    if (waits != nullptr) ++waits[spun ? 0 : 1];
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

int64_t aio_read_staged(uint64_t ctx, int64_t n, int64_t fd, const int64_t* r0, const int64_t* r1,
                        const int64_t* pos, uint8_t* staging, int64_t depth, int64_t spin_ns, int64_t* waits,
                        int64_t* res, uint32_t* crcs, const StagedBundles& b, int64_t* bad) {
  *bad = -1;
  std::fill(crcs, crcs + b.bundles, 0u);
  std::vector<int64_t> fds(static_cast<size_t>(n), fd), sizes(static_cast<size_t>(n));
  std::vector<uint64_t> addresses(static_cast<size_t>(n));
  std::vector<int64_t> staged(static_cast<size_t>(b.bundles));  // each bundle's offset in staging
  for (int64_t k = 0; k < n; ++k) {
    sizes[k] = r1[k] - r0[k];
    addresses[k] = reinterpret_cast<uint64_t>(staging + pos[k]);
    for (int64_t i = b.first[k]; i < b.first[k + 1]; ++i) staged[i] = pos[k] + b.starts[i] - r0[k];
  }
  const Isa isa = active_isa();
  const LandedCrcs landed{staging, b.first, staged.data(), b.piece_off, b.piece_len, b.pieces, crcs, isa};
  const int64_t error = aio_read_all(ctx, n, fds.data(), r0, sizes.data(), addresses.data(), nullptr, depth, res,
                                     b.want != nullptr ? &landed : nullptr, spin_ns, waits);
  if (error) return error;
  int64_t short_reads = 0;
  for (int64_t k = 0; k < n; ++k) short_reads += res[k] != sizes[k];
  if (short_reads) return short_reads;
  if (b.want != nullptr)
    for (int64_t i = 0; i < b.bundles; ++i)
      if (crcs[i] != b.want[i]) {
        *bad = i;
        return 0;
      }
  std::vector<int64_t> from(static_cast<size_t>(b.bundles));
  for (int64_t t = 0; t < b.targets; ++t) {
    for (int64_t i = 0; i < b.bundles; ++i) from[i] = staged[i] + b.target_off[t];
    copy_rows(staging, from.data(), b.target_len[t], b.target_dest[t], b.target_stride[t], b.slots, b.bundles, isa);
  }
  return 0;
}

IdsRead aio_read_planned(uint64_t ctx, int64_t fd, int64_t n, const int64_t* sorted, const int64_t* index,
                         const int64_t* starts, int64_t reads, const int64_t* r0, const int64_t* r1,
                         const int64_t* first, const int64_t* slots, const uint32_t* table, uint8_t* staging,
                         int64_t staging_size, int64_t depth, int64_t spin_ns, int64_t* waits, int64_t* res,
                         uint32_t* crcs, StagedBundles b) {
  IdsRead out{reads, 0, false, 0, -1};
  std::vector<int64_t> pos(static_cast<size_t>(reads)), bounds(static_cast<size_t>(reads) + 1);
  for (int64_t k = 0; k < reads; ++k) {
    pos[k] = out.staged;
    out.staged += r1[k] - r0[k];
    bounds[k] = first[k];
  }
  bounds[reads] = n;
  out.fits = out.staged <= staging_size;
  if (!out.fits) return out;
  std::vector<int64_t> rows(static_cast<size_t>(n));  // rows follow the sorted ids
  std::vector<uint32_t> want(table != nullptr ? static_cast<size_t>(n) : 0);
  for (int64_t i = 0; i < n; ++i) {
    rows[i] = slots[index[i]];
    if (table != nullptr) want[i] = table[sorted[i]];
  }
  b.first = bounds.data();
  b.starts = starts;
  b.bundles = n;
  b.want = table != nullptr ? want.data() : nullptr;
  b.slots = rows.data();
  out.status = aio_read_staged(ctx, reads, fd, r0, r1, pos.data(), staging, depth, spin_ns, waits, res, crcs, b,
                               &out.bad);
  return out;
}

IdsRead aio_read_ids(uint64_t ctx, const StridedLayer& layer, const PlanRule& rule, int64_t n, const int64_t* ids,
                     const int64_t* slots, const uint32_t* table, uint8_t* staging, int64_t staging_size,
                     int64_t depth, int64_t spin_ns, int64_t* waits, int64_t* plan, int64_t* res, uint32_t* crcs,
                     StagedBundles b) {
  int64_t *sorted = plan, *index = plan + n, *starts = plan + 2 * n, *r0 = plan + 4 * n, *r1 = plan + 5 * n,
          *first = plan + 6 * n;
  const int64_t reads = plan_strided_reads(n, ids, layer.count, layer.offset, layer.stride, rule.align, rule.merge,
                                           rule.merge_gap, rule.max_read, sorted, index, starts, plan + 3 * n, r0,
                                           r1, first, plan + 7 * n);
  if (reads < 0) return IdsRead{reads, 0, false, 0, -1};
  return aio_read_planned(ctx, layer.fd, n, sorted, index, starts, reads, r0, r1, first, slots, table, staging,
                          staging_size, depth, spin_ns, waits, res, crcs, b);
}

#else

bool aio_read_available() { return false; }

int64_t aio_read_staged(uint64_t, int64_t n, int64_t, const int64_t*, const int64_t*, const int64_t*, uint8_t*,
                        int64_t, int64_t, int64_t*, int64_t* res, uint32_t*, const StagedBundles&, int64_t* bad) {
  *bad = -1;
  for (int64_t i = 0; i < n; ++i) res[i] = -ENOSYS;
  return -ENOSYS;
}

IdsRead aio_read_planned(uint64_t, int64_t, int64_t, const int64_t*, const int64_t*, const int64_t*, int64_t,
                         const int64_t*, const int64_t*, const int64_t*, const int64_t*, const uint32_t*, uint8_t*,
                         int64_t, int64_t, int64_t, int64_t*, int64_t*, uint32_t*, StagedBundles) {
  return IdsRead{0, 0, false, -ENOSYS, -1};
}

IdsRead aio_read_ids(uint64_t, const StridedLayer&, const PlanRule&, int64_t, const int64_t*, const int64_t*,
                     const uint32_t*, uint8_t*, int64_t, int64_t, int64_t, int64_t*, int64_t*, int64_t*, uint32_t*,
                     StagedBundles) {
  return IdsRead{0, 0, false, -ENOSYS, -1};
}

int64_t aio_read_all(uint64_t, int64_t n, const int64_t*, const int64_t*, const int64_t*, const uint64_t*,
                     const uint8_t*, int64_t, int64_t* res, const LandedCrcs*, int64_t, int64_t*) {
  for (int64_t i = 0; i < n; ++i) res[i] = -ENOSYS;
  return -ENOSYS;
}

#endif

}  // namespace flash
