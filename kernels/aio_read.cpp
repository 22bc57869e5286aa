// aio_read.h: io_submit / io_getevents through syscall(2) (glibc has no wrappers for native AIO).
#include "aio_read.h"

#include "endor_decode.h"
#include "read_plan.h"
#include "row_copy.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
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

// aio_read_all's loop as an object: reads submitted now (submit_some: at most depth go out) and
// reaped later (run). Its destructor reaps whatever is still in flight: no read lands in a caller's
// buffer after it.
class AioRun {
 public:
  AioRun(uint64_t ctx, int64_t n, const int64_t* fds, const int64_t* offsets, const int64_t* sizes,
         const uint64_t* addresses, const uint8_t* vectored, int64_t depth, int64_t* res, const LandedCrcs* landed,
         int64_t spin_ns, int64_t* waits)
      : n_(n), sizes_(sizes), vectored_(vectored), depth_(depth < 1 ? 1 : depth), res_(res), landed_(landed),
        spin_ns_(spin_ns), waits_(waits), context_(static_cast<aio_context_t>(ctx)),
        ring_(reinterpret_cast<const AioRing*>(ctx)), cbs_(static_cast<size_t>(n)), ptrs_(static_cast<size_t>(n)),
        events_(static_cast<size_t>(depth_)) {
    for (int64_t i = 0; i < n; ++i) {
      iocb& cb = cbs_[i];
      std::memset(&cb, 0, sizeof(cb));
      cb.aio_data = static_cast<uint64_t>(i);
      cb.aio_lio_opcode = (vectored != nullptr && vectored[i]) ? IOCB_CMD_PREADV : IOCB_CMD_PREAD;
      cb.aio_fildes = static_cast<uint32_t>(fds[i]);
      cb.aio_buf = addresses[i];
      cb.aio_nbytes = static_cast<uint64_t>(sizes[i]);
      cb.aio_offset = offsets[i];
      ptrs_[i] = &cb;
      res[i] = -ECANCELED;
    }
    if (ring_->magic != kAioRingMagic) ring_ = nullptr;  // not the layout read above: wait in io_getevents only
  }
  AioRun(const AioRun&) = delete;
  AioRun& operator=(const AioRun&) = delete;
  ~AioRun() { drain(); }

  // io_submit as many reads as the depth has room for; false on a hard error (kept for run).
  bool submit_some() {
    const int64_t room = std::min(depth_ - (submitted_ - completed_), n_ - submitted_);
    if (room <= 0 || error_) return !error_;
    const long got = syscall(SYS_io_submit, context_, room, ptrs_.data() + submitted_);
    if (got > 0) {
      submitted_ += got;
    } else if (got < 0 && errno != EAGAIN && errno != EINTR) {
      error_ = -errno;
      return false;
    }
    return true;
  }

  // Until every read has completed (or an error: then every submitted one is reaped): 0 or -errno.
  int64_t run() {
    while (completed_ < n_ && !error_) {
      if (!submit_some()) break;
      if (submitted_ == completed_) continue;  // nothing in flight: submit again
      if (!reap()) break;
    }
    drain();
    return error_;
  }

 private:
  bool reap() {  // false on a hard error (stored in error_)
    const bool spun = spin_for_event(ring_, spin_ns_);
    if (waits_ != nullptr) ++waits_[spun ? 0 : 1];
    const long got = syscall(SYS_io_getevents, context_, 1, depth_, events_.data(), nullptr);
    if (got < 0) {
      if (errno == EINTR) return true;
      error_ = -errno;
      return false;
    }
    for (long e = 0; e < got; ++e) res_[events_[e].data] = events_[e].res;
    completed_ += got;
    if (landed_ != nullptr)  // after recording every result: the work below runs while later reads fly
      for (long e = 0; e < got; ++e) {
        const int64_t k = static_cast<int64_t>(events_[e].data);
        if (res_[k] == sizes_[k] && (vectored_ == nullptr || !vectored_[k])) crc_landed(*landed_, k);
      }
    return true;
  }

  void drain() {  // the kernel may still write into caller buffers until each submitted read is reaped
    while (completed_ < submitted_) {
      const long got = syscall(SYS_io_getevents, context_, submitted_ - completed_, depth_, events_.data(), nullptr);
      if (got < 0) {
        if (errno == EINTR) continue;
        break;  // a context that cannot be reaped: nothing more can be done here
      }
      for (long e = 0; e < got; ++e) res_[events_[e].data] = events_[e].res;
      completed_ += got;
    }
  }

  int64_t n_;
  const int64_t* sizes_;
  const uint8_t* vectored_;
  int64_t depth_;
  int64_t* res_;
  const LandedCrcs* landed_;
  int64_t spin_ns_;
  int64_t* waits_;
  aio_context_t context_;
  const AioRing* ring_;
  std::vector<iocb> cbs_;
  std::vector<iocb*> ptrs_;
  std::vector<io_event> events_;
  int64_t submitted_ = 0, completed_ = 0, error_ = 0;
};

int64_t aio_read_all(uint64_t ctx, int64_t n, const int64_t* fds, const int64_t* offsets, const int64_t* sizes,
                     const uint64_t* addresses, const uint8_t* vectored, int64_t depth, int64_t* res,
                     const LandedCrcs* landed, int64_t spin_ns, int64_t* waits) {
  AioRun run(ctx, n, fds, offsets, sizes, addresses, vectored, depth, res, landed, spin_ns, waits);
  return run.run();
}

// aio_read_staged's call as an object: its reads go out with start() (at most depth) or finish(),
// which reaps the rest, then checks and copies out (aio_read_staged's return value).
class StagedRun {
 public:
  StagedRun(uint64_t ctx, int64_t n, int64_t fd, const int64_t* r0, const int64_t* r1, const int64_t* pos,
            uint8_t* staging, int64_t depth, int64_t spin_ns, int64_t* waits, int64_t* res, uint32_t* crcs,
            const StagedBundles& b)
      : n_(n), staging_(staging), res_(res), crcs_(crcs), b_(b), fds_(static_cast<size_t>(n), fd),
        sizes_(static_cast<size_t>(n)), addresses_(static_cast<size_t>(n)), staged_(static_cast<size_t>(b.bundles)) {
    std::fill(crcs, crcs + b.bundles, 0u);
    for (int64_t k = 0; k < n; ++k) {
      sizes_[k] = r1[k] - r0[k];
      addresses_[k] = reinterpret_cast<uint64_t>(staging + pos[k]);
      for (int64_t i = b.first[k]; i < b.first[k + 1]; ++i) staged_[i] = pos[k] + b.starts[i] - r0[k];
    }
    landed_ = LandedCrcs{staging, b.first, staged_.data(), b.piece_off, b.piece_len, b.pieces, crcs, active_isa()};
    run_ = std::make_unique<AioRun>(ctx, n, fds_.data(), r0, sizes_.data(), addresses_.data(), nullptr, depth, res,
                                    b.want != nullptr ? &landed_ : nullptr, spin_ns, waits);
  }

  bool start() { return run_->submit_some(); }

  int64_t finish(int64_t* bad) {
    *bad = -1;
    const int64_t error = run_->run();
    if (error) return error;
    int64_t short_reads = 0;
    for (int64_t k = 0; k < n_; ++k) short_reads += res_[k] != sizes_[k];
    if (short_reads) return short_reads;
    if (b_.want != nullptr)
      for (int64_t i = 0; i < b_.bundles; ++i)
        if (crcs_[i] != b_.want[i]) {
          *bad = i;
          return 0;
        }
    std::vector<int64_t> from(static_cast<size_t>(b_.bundles));
    for (int64_t t = 0; t < b_.targets; ++t) {
      for (int64_t i = 0; i < b_.bundles; ++i) from[i] = staged_[i] + b_.target_off[t];
      copy_rows(staging_, from.data(), b_.target_len[t], b_.target_dest[t], b_.target_stride[t], b_.slots, b_.bundles,
                landed_.isa);
    }
    return 0;
  }

 private:
  int64_t n_;
  uint8_t* staging_;
  int64_t* res_;
  uint32_t* crcs_;
  StagedBundles b_;
  std::vector<int64_t> fds_, sizes_;
  std::vector<uint64_t> addresses_;
  std::vector<int64_t> staged_;  // each bundle's offset in staging
  LandedCrcs landed_{};
  std::unique_ptr<AioRun> run_;
};

int64_t aio_read_staged(uint64_t ctx, int64_t n, int64_t fd, const int64_t* r0, const int64_t* r1,
                        const int64_t* pos, uint8_t* staging, int64_t depth, int64_t spin_ns, int64_t* waits,
                        int64_t* res, uint32_t* crcs, const StagedBundles& b, int64_t* bad) {
  StagedRun run(ctx, n, fd, r0, r1, pos, staging, depth, spin_ns, waits, res, crcs, b);
  return run.finish(bad);
}

struct PlannedRead::Impl {
  IdsRead out{0, 0, false, 0, -1};
  std::vector<int64_t> pos, bounds, rows;  // rows follow the sorted ids
  std::vector<uint32_t> want;
  std::unique_ptr<StagedRun> run;
  bool started = false;
};

PlannedRead::PlannedRead(uint64_t ctx, int64_t fd, int64_t n, const int64_t* sorted, const int64_t* index,
                         const int64_t* starts, int64_t reads, const int64_t* r0, const int64_t* r1,
                         const int64_t* first, const int64_t* slots, const uint32_t* table, uint8_t* staging,
                         int64_t staging_size, int64_t depth, int64_t spin_ns, int64_t* waits, int64_t* res,
                         uint32_t* crcs, StagedBundles b)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.out.reads = reads;
  m.pos.resize(static_cast<size_t>(reads));
  m.bounds.resize(static_cast<size_t>(reads) + 1);
  for (int64_t k = 0; k < reads; ++k) {
    m.pos[k] = m.out.staged;
    m.out.staged += r1[k] - r0[k];
    m.bounds[k] = first[k];
  }
  m.bounds[reads] = n;
  m.out.fits = m.out.staged <= staging_size;
  if (!m.out.fits) return;
  m.rows.resize(static_cast<size_t>(n));
  m.want.resize(table != nullptr ? static_cast<size_t>(n) : 0);
  for (int64_t i = 0; i < n; ++i) {
    m.rows[i] = slots[index[i]];
    if (table != nullptr) m.want[i] = table[sorted[i]];
  }
  b.first = m.bounds.data();
  b.starts = starts;
  b.bundles = n;
  b.want = table != nullptr ? m.want.data() : nullptr;
  b.slots = m.rows.data();
  m.run = std::make_unique<StagedRun>(ctx, reads, fd, r0, r1, m.pos.data(), staging, depth, spin_ns, waits, res, crcs,
                                      b);
}

PlannedRead::~PlannedRead() = default;

bool PlannedRead::fits() const { return impl_->out.fits; }

bool PlannedRead::start() { return impl_->run != nullptr && impl_->run->start(); }

IdsRead PlannedRead::finish() {
  Impl& m = *impl_;
  if (m.run != nullptr) m.out.status = m.run->finish(&m.out.bad);
  return m.out;
}

IdsRead aio_read_planned(uint64_t ctx, int64_t fd, int64_t n, const int64_t* sorted, const int64_t* index,
                         const int64_t* starts, int64_t reads, const int64_t* r0, const int64_t* r1,
                         const int64_t* first, const int64_t* slots, const uint32_t* table, uint8_t* staging,
                         int64_t staging_size, int64_t depth, int64_t spin_ns, int64_t* waits, int64_t* res,
                         uint32_t* crcs, StagedBundles b) {
  PlannedRead read(ctx, fd, n, sorted, index, starts, reads, r0, r1, first, slots, table, staging, staging_size, depth,
                   spin_ns, waits, res, crcs, b);
  return read.finish();
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

struct PlannedRead::Impl {};

PlannedRead::PlannedRead(uint64_t, int64_t, int64_t, const int64_t*, const int64_t*, const int64_t*, int64_t,
                         const int64_t*, const int64_t*, const int64_t*, const int64_t*, const uint32_t*, uint8_t*,
                         int64_t, int64_t, int64_t, int64_t*, int64_t*, uint32_t*, StagedBundles)
    : impl_(std::make_unique<Impl>()) {}

PlannedRead::~PlannedRead() = default;

bool PlannedRead::fits() const { return false; }

bool PlannedRead::start() { return false; }

IdsRead PlannedRead::finish() { return IdsRead{0, 0, false, -ENOSYS, -1}; }

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
